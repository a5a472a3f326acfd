//! What a simulation run looks like: topology, links, scripted faults, workload shape, QP
//! attributes and the bounds that turn a stuck run into a "hang" failure.

use std::time::Duration;

use crate::faults::ScriptedFault;
use crate::link::LinkConfig;
use crate::op::OpKind;
use lightpath_verbs::Mtu;

/// Which IP version the endpoints' GIDs select.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressFamily {
    /// IPv4-mapped GIDs (RoCE v2 over IPv4).
    V4,
    /// IPv6 GIDs.
    V6,
    /// Chosen per seed. Runs that corrupt datagrams always use IPv6: over IPv4 a userspace
    /// receiver cannot see the IP ID and flags, and its ICRC check accepts a random corruption
    /// with probability about 2^-13 (see the architecture notes), which thousands of corrupted
    /// datagrams would hit.
    Random,
}

/// Attributes given to every queue pair.
#[derive(Clone, Debug, PartialEq)]
pub struct QpConfig {
    /// Path MTU of every connection, or random per connection when `None`.
    pub mtu: Option<Mtu>,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retry count (7 is treated as infinite by rxe-compatible engines).
    pub retry_cnt: u8,
    /// RNR retry count (7 = infinite).
    pub rnr_retry: u8,
    /// RNR timer code the responder advertises.
    pub min_rnr_timer: u8,
    /// Largest inline payload a QP accepts.
    pub max_inline_data: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
}

impl Default for QpConfig {
    /// Random MTU, a 4.2 ms ACK timeout (exponent 10), infinite RNR retries, 7 transport
    /// retries, RNR timer 0.64 ms, 256 inline bytes and 4 SGEs.
    fn default() -> Self {
        Self {
            mtu: None,
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_inline_data: 256,
            max_sge: 4,
        }
    }
}

/// Shape of the random workload of each seed.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadConfig {
    /// Operations the workload may use (every kind when empty).
    pub ops: Vec<OpKind>,
    /// Fewest operations posted per direction of a connection.
    pub min_ops: usize,
    /// Most operations posted per direction of a connection.
    pub max_ops: usize,
    /// Largest message in bytes.
    pub max_message: u32,
    /// Probability that an operation is a large one (256 KiB up to `max_message`).
    pub big_message: f64,
    /// Probability that a connection gets one negative operation (bad R_Key, out of bounds,
    /// missing permission, misaligned atomic) whose error the model knows.
    pub negative: f64,
    /// Probability that a seed posts some receives late (provoking RNR NAKs).
    pub late_recvs: f64,
    /// Probability that an operation (other than the last of its queue) is unsignaled.
    pub unsignaled: f64,
    /// Probability that a small enough SEND/WRITE payload is given inline.
    pub inline: f64,
    /// Whether the requester posts in bursts at random times (true) or everything at time 0.
    pub spread_posts: bool,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            ops: Vec::new(),
            min_ops: 1,
            max_ops: 12,
            max_message: 1 << 20,
            big_message: 0.01,
            negative: 0.1,
            late_recvs: 0.2,
            unsignaled: 0.3,
            inline: 0.5,
            spread_posts: true,
        }
    }
}

impl WorkloadConfig {
    /// The operation kinds in use.
    pub fn kinds(&self) -> Vec<OpKind> {
        if self.ops.is_empty() {
            OpKind::ALL.to_vec()
        } else {
            self.ops.clone()
        }
    }
}

/// Everything `run_seed` needs besides the seed.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Engines in the network (≥ 2). Connections form a ring: 0–1, 1–2, …, (n−1)–0 (just 0–1
    /// for two nodes).
    pub nodes: usize,
    /// Every link direction's faults and timing.
    pub link: LinkConfig,
    /// Deterministic faults.
    pub scripted: Vec<ScriptedFault>,
    /// The random workload.
    pub workload: WorkloadConfig,
    /// Queue-pair attributes.
    pub qp: QpConfig,
    /// IP version of the GIDs.
    pub family: AddressFamily,
    /// A run whose work has not finished by this virtual time has hung.
    pub max_virtual_time: Duration,
    /// A run that takes more driver steps than this has hung (livelock guard).
    pub max_steps: u64,
    /// How long the driver keeps delivering after all work finished, to catch late effects.
    pub drain: Duration,
    /// Record every datagram.
    pub trace: bool,
    /// The driver reads the network only every this often and hands each engine every
    /// datagram that arrived since before the engine may transmit — as a driver that polls
    /// its socket with `recvmmsg` does. Zero (the default): each datagram is handed over when
    /// it arrives and followed at once by the transmissions it causes.
    pub receive_batch: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 2,
            link: LinkConfig::default(),
            scripted: Vec::new(),
            workload: WorkloadConfig::default(),
            qp: QpConfig::default(),
            family: AddressFamily::Random,
            max_virtual_time: Duration::from_secs(60),
            max_steps: 3_000_000,
            drain: Duration::from_millis(50),
            trace: false,
            receive_batch: Duration::ZERO,
        }
    }
}

impl SimConfig {
    /// Whether every datagram gets through eventually (no loss, corruption or scripted drops).
    pub fn is_lossless(&self) -> bool {
        self.link.is_lossless() && self.scripted.is_empty()
    }

    /// Whether nothing can ever get through, so every connection must give up.
    pub fn is_black_hole(&self) -> bool {
        self.link.loss >= 1.0 || self.link.corrupt >= 1.0
    }

    /// Whether the faults may make a transport legitimately run out of retries: nothing gets
    /// through, a peer dies or is cut off for good, random loss is high enough that
    /// `retry_cnt + 1` attempts in a row all fail with a probability above 1e-5 (an attempt
    /// fails when its request or its response is lost; 20% loss with 7 retries gives 3e-4,
    /// 5% gives 1e-8), or `retry_cnt` is 0 on a reordering network: one overtaken packet
    /// makes the responder NAK a sequence error, and a NAK retry counts like a timeout
    /// (digest §6.7), so the first one already exceeds the count.
    pub fn may_exhaust_retries(&self) -> bool {
        self.is_black_hole()
            || self.scripted.iter().any(ScriptedFault::can_exhaust_retries)
            || self.random_exhaustion_probability() > 1e-5
            || self.link_mtu_too_small()
            || (self.qp.retry_cnt == 0 && self.link.reorder > 0.0)
    }

    /// Whether full-sized packets of some connection exceed the link MTU (and so never
    /// arrive): IP header (up to 40) + UDP (8) + BTH and extension headers (up to 40) + ICRC.
    pub fn link_mtu_too_small(&self) -> bool {
        let largest_path_mtu = self.qp.mtu.map_or(Mtu::Mtu4096.bytes(), Mtu::bytes) as usize;
        largest_path_mtu + 40 + 8 + 40 + 4 > self.link.mtu
    }

    /// Probability that `retry_cnt + 1` consecutive attempts are all lost at random.
    pub fn random_exhaustion_probability(&self) -> f64 {
        let lost = 1.0 - (1.0 - self.link.loss.clamp(0.0, 1.0)) * (1.0 - self.link.corrupt.clamp(0.0, 1.0));
        let attempt_fails = 1.0 - (1.0 - lost) * (1.0 - lost);
        attempt_fails.powi(i32::from(self.qp.retry_cnt) + 1)
    }

    /// The node pairs that get a connection.
    pub fn connections(&self) -> Vec<(usize, usize)> {
        match self.nodes {
            0 | 1 => Vec::new(),
            2 => vec![(0, 1)],
            n => (0..n).map(|i| (i, (i + 1) % n)).collect(),
        }
    }
}
