//! How a soft device is set up: its address, port, MTU, progress mode and limits.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use lightpath_verbs::Mtu;

/// The IANA RoCE v2 UDP port.
pub const ROCE_PORT: u16 = 4791;

/// Who moves datagrams between the socket and the engine and runs its timers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A progress thread owns the work: it sleeps in `poll` on the socket and an eventfd with
    /// the engine's next timer as timeout, and wakes blocked `wait` callers. Posting threads
    /// transmit their own packets directly (no thread hop on the send path); they wake the
    /// progress thread only when a new timer is due earlier than the one it sleeps towards.
    /// A thread blocked in `wait` watches the socket itself and drives the device when a
    /// datagram arrives (the progress thread then watches only its timers and eventfd).
    Thread,
    /// The application drives the device: every `poll`/`wait` on a completion queue receives
    /// datagrams, runs due timers and transmits, and `wait` spins for `spin` before it blocks
    /// in `poll(2)` on the socket (waking a blocked thread costs microseconds). When a poll
    /// receives completions, it returns them before sending what the engine answered (ACKs);
    /// that goes out with the next post or at the start of the next poll. A helper thread
    /// drives the device when nobody has done so for `assist_after`, so a peer still gets
    /// ACKs and retransmissions while the application is busy elsewhere, and at once when an
    /// event loop goes to sleep on a completion notification
    /// (`CompletionQueue::consumer_idle`), until the application drives again.
    Polling {
        /// How long `wait` busy-polls before blocking.
        spin: Duration,
        /// Idle time after which the helper thread steps in.
        assist_after: Duration,
    },
}

impl ProgressMode {
    /// Polling mode with the defaults (spin 50 µs, assist after 1 ms).
    pub const fn polling() -> Self {
        ProgressMode::Polling { spin: Duration::from_micros(50), assist_after: Duration::from_millis(1) }
    }

    /// Whether the application drives the device ([`ProgressMode::Polling`]).
    pub const fn is_polling(&self) -> bool {
        matches!(self, ProgressMode::Polling { .. })
    }
}

/// The configuration of one [`SoftDevice`](crate::SoftDevice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftConfig {
    /// Local address and UDP port. The address must be a specific (not unspecified) IPv4 or
    /// IPv6 address: it is the device's GID. The port is the one the device listens on and
    /// sends from (0: one the kernel picks, see [`SoftDevice::local_addr`]), and where a queue
    /// pair sends unless its address vector names the peer's port (`udp_dport`); several
    /// processes can so share one address with a device each on its own port. Peers that are
    /// rxe or RNICs listen on 4791 only.
    ///
    /// [`SoftDevice::local_addr`]: crate::SoftDevice::local_addr
    pub local: SocketAddr,
    /// Name reported by `Device::name` (default: `soft-<ip>` or `soft-<ip>-<port>`).
    pub name: Option<String>,
    /// The port's active MTU (default 1024, right for a 1500-byte link). Like Linux rxe, the
    /// device never goes above what the link holding its address carries (1024 on a 1500-byte
    /// link, 4096 on a 9000-byte one or loopback): a larger value is lowered when the device
    /// opens (`SoftDevice::config` shows the result), and `modify_qp` refuses a path MTU
    /// above it with [`Error::PathMtuTooLarge`](lightpath_verbs::Error::PathMtuTooLarge),
    /// naming the link's MTU.
    pub mtu: Mtu,
    /// Who drives the engine.
    pub mode: ProgressMode,
    /// Verify the ICRC of received datagrams (default true; see the crate doc for how IPv4
    /// datagrams, whose IP ID a UDP socket does not report, are checked).
    pub verify_icrc: bool,
    /// Try to `mlock` region memory (best effort).
    pub lock_memory: bool,
    /// Socket receive buffer to ask for (bytes); bursts beyond it are dropped by the kernel
    /// and recovered by retransmission.
    pub recv_buffer: usize,
    /// Socket send buffer to ask for (bytes).
    pub send_buffer: usize,
    /// Use the kernel's UDP offloads (default true): receive offload (`UDP_GRO`: coalesced
    /// datagrams arrive in one piece) and, towards loopback and IPv6 peers and peers whose
    /// address vector says `lightpath_peer` (Lightpath soft devices), segmentation offload
    /// (`UDP_SEGMENT`: one system call and one trip through the network stack for up to 64 KB
    /// of datagrams). Other IPv4 peers never get segmented messages: the kernel numbers the IP
    /// identification of the segments it cuts, which the ICRC covers, so Linux rxe and RNICs
    /// would drop them. Either offload is skipped where the kernel lacks it.
    pub udp_offload: bool,
    /// [`ProgressMode::Thread`]: how long the thread that watches the socket in `wait`
    /// busy-polls it (receiving and running the engine itself) after the last datagram before
    /// it sleeps (default 50 µs; at most four times that in all while datagrams keep coming).
    /// Past the first 4 µs it yields the core between rounds, so a peer or another thread on
    /// a busy machine still runs. Four spins in a row that see no datagram stop spinning
    /// (an idle connection costs no CPU); one wait in 32 tries again. A ping-pong then never
    /// sleeps: waking a sleeping thread costs 5-40 µs on a virtual machine, more than the
    /// whole round trip. Zero turns spinning off; `LIGHTPATH_SOFT_SPIN_US` sets the default
    /// ([`default_wait_spin`]).
    pub wait_spin: Duration,
    /// Most queue pairs.
    pub max_qps: u32,
    /// Most memory regions.
    pub max_mrs: u32,
    /// Most completion queues.
    pub max_cqs: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
    /// [`ProgressMode::Thread`]: how many queue pairs may receive on a UDP port of their own
    /// (default 64, or `LIGHTPATH_SOFT_QP_PORTS`; 0 turns ports off). A queue pair gets one
    /// when a waiter gives it a doorbell (`QueuePair::set_waiter_fd`, as Lightpath's tokio
    /// streams do) and its peer is told to send to it (`QueuePair::own_udp_port`); the kernel
    /// then wakes that waiter itself, once per message, instead of waking a thread that runs
    /// the engine and wakes the waiter in turn. Each costs a descriptor; past the limit queue
    /// pairs share the device socket as before. Why 64: with many busy connections the shared
    /// socket wins back, since one receive call there serves them all (an event-loop server
    /// with 1,000 connections: 19.5-23.5k requests/s with a port each, 29.3-30.5k with 64 and
    /// 28.2-30.1k with none), while up to tens of connections gain from their own ports.
    pub max_qp_ports: usize,
}

/// [`SoftConfig::max_qp_ports`]' default: 64, or `LIGHTPATH_SOFT_QP_PORTS` when that
/// environment variable holds a number.
pub fn default_max_qp_ports() -> usize {
    std::env::var("LIGHTPATH_SOFT_QP_PORTS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(64)
}

/// [`SoftConfig::wait_spin`]'s default: 50 µs, or `LIGHTPATH_SOFT_SPIN_US` µs when that
/// environment variable holds a number (0 turns spinning off).
pub fn default_wait_spin() -> Duration {
    std::env::var("LIGHTPATH_SOFT_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or(Duration::from_micros(50), Duration::from_micros)
}

impl SoftConfig {
    /// Defaults for a device on `ip` at the RoCE port 4791.
    pub fn new(ip: IpAddr) -> Self {
        Self::with_addr(SocketAddr::new(ip, ROCE_PORT))
    }

    /// Defaults for a device bound to `local`.
    pub fn with_addr(local: SocketAddr) -> Self {
        Self {
            local,
            name: None,
            mtu: Mtu::Mtu1024,
            mode: ProgressMode::Thread,
            verify_icrc: true,
            lock_memory: true,
            recv_buffer: 8 << 20,
            send_buffer: 4 << 20,
            udp_offload: true,
            wait_spin: default_wait_spin(),
            max_qps: 4096,
            max_mrs: 65536,
            max_cqs: 4096,
            max_cqe: 65536,
            max_qp_ports: default_max_qp_ports(),
        }
    }

    /// The device name: the configured one or one derived from the address.
    pub fn device_name(&self) -> String {
        match (&self.name, self.local.port()) {
            (Some(name), _) => name.clone(),
            (None, ROCE_PORT) => format!("soft-{}", self.local.ip()),
            (None, port) => format!("soft-{}-{port}", self.local.ip()),
        }
    }
}
