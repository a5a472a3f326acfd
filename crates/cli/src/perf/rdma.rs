//! The verbs side of `lightpath perf`, written once against the provider traits of
//! `lightpath-verbs` so that every provider (soft now; ibverbs and shm later) runs the same
//! tests.
//!
//! Each side registers one region laid out as `[tx: max size][rx: max size]`, creates one RC
//! queue pair whose send and receive completions share one completion queue, and busy-polls
//! that queue, as perftest does. The message patterns follow perftest:
//!
//! | test | what moves | who is active |
//! |---|---|---|
//! | send_lat | SEND ping-pong | both |
//! | write_lat | RDMA WRITE ping-pong; each side spins on the last byte of its rx area | both |
//! | read_lat, atomic_lat | RDMA READ / FETCH_ADD from the server's region, one at a time | client |
//! | send_bw | SENDs, `tx_depth` in flight, server keeps receives posted | both |
//! | write_bw, read_bw | WRITEs / READs, `tx_depth` in flight | client |
//!
//! Between sizes the two processes step together over the control connection
//! ([`Step`]), and at the end of each size the receiver checks what arrived (bandwidth tests
//! compare a CRC-32 of the final buffer with the sender's).

use std::io::ErrorKind;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, CqOf, Device, Gid, MemoryRegion, MrOf, Mtu,
    ProtectionDomain, QpAttr, QpCaps, QpOf, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};
use serde::{Deserialize, Serialize};

use super::args::{PerfTest, ProviderKind};

#[path = "perftest.rs"]
pub mod perftest;
use super::control;
use super::cpu::{self, CpuUse};
use super::pattern;
use super::progress::Progress;
use super::report::SizeResult;
use super::stats::{BandwidthSummary, LatencySummary};

/// Salts of the two sides' payload patterns, so that a side never mistakes its own bytes for
/// the peer's.
const CLIENT_SALT: u32 = 0x00C1_1E47;
const SERVER_SALT: u32 = 0x005E_4E45;
/// Receives the send tests keep posted.
const RECV_DEPTH: u32 = 512;
/// How long any single wait may take before the run is declared stuck.
const STALL_LIMIT: Duration = Duration::from_secs(10);
/// How long a wait without progress goes on once the device says the peer cannot be served
/// (see [`Watchdog::give_up_early_if`]).
const HOPELESS_LIMIT: Duration = Duration::from_secs(1);

/// What one side tells the other about its queue pair and region.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// GID as 32 hex digits.
    pub gid: String,
    pub qpn: u32,
    pub psn: u32,
    /// Path MTU in bytes; both sides use the smaller.
    pub mtu: u32,
    /// The region: address, length and rkey.
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
    /// The side is a Lightpath soft device (its peer may then segment its sends and widen
    /// its window: `AddressVector::lightpath_peer`); false from ibverbs sides and older
    /// Lightpath versions.
    #[serde(default)]
    pub lightpath_soft: bool,
    /// The largest path MTU a soft side takes from another soft side through the Lightpath
    /// extension (`QpAttr::lightpath_pmtu`: any size 256..32 KiB its link carries); both
    /// use the smaller offer when it beats `mtu`. Absent from ibverbs sides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lightpath_pmtu: Option<u32>,
}

/// Whether `bytes` is a path MTU the Lightpath extension accepts.
fn lightpath_pmtu_in_range(bytes: u32) -> bool {
    (256..=lightpath_verbs::MAX_LIGHTPATH_PMTU).contains(&bytes)
}

/// Whether a client's hello carries an RDMA endpoint this side can connect to (for
/// `session::accept_client`; the soft and ibverbs servers).
pub fn usable_endpoint(hello: &super::control::Hello) -> std::result::Result<(), String> {
    let endpoint: RdmaEndpoint = hello
        .endpoint
        .clone()
        .and_then(|e| serde_json::from_value(e).ok())
        .ok_or("the client sent no usable RDMA endpoint")?;
    Gid::from_hex(&endpoint.gid).ok_or_else(|| format!("the client sent a bad GID {:?}", endpoint.gid))?;
    Mtu::from_bytes(endpoint.mtu).ok_or_else(|| format!("the client sent a bad MTU {}", endpoint.mtu))?;
    if let Some(bytes) = endpoint.lightpath_pmtu.filter(|&b| !lightpath_pmtu_in_range(b)) {
        return Err(format!("the client sent a bad Lightpath MTU {bytes}"));
    }
    Ok(())
}

/// Lock-step messages on the control connection during a run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
enum Step {
    Start {
        size: usize,
        iters: u64,
    },
    Ready,
    Finish,
    /// The server's check of the size, and the CPU time it used from `Start` to `Finish`.
    Verdict {
        ok: bool,
        detail: String,
        #[serde(default)]
        cpu_ns: Option<u64>,
    },
}

/// One side's verbs objects. Field order is drop order: the queue pair goes before the region
/// and the completion queue it uses.
pub struct Side<D: Device> {
    qp: QpOf<D>,
    mr: MrOf<D>,
    cq: CqOf<D>,
    _pd: <D as Device>::Pd,
    _device: D,
    max_size: usize,
    max_inline: u32,
    psn: u32,
    mtu: Mtu,
    /// This side's Lightpath-extension offer (soft sides), then what the connection uses.
    lightpath_pmtu: Option<u32>,
    /// The peer's region (address, rkey), known once connected.
    peer_region: (u64, u32),
    /// Receives currently posted.
    recvs_posted: u32,
    /// Send requests posted and not yet completed.
    sends_outstanding: u64,
    wcs: Vec<WorkCompletion>,
}

impl<D: Device> Side<D> {
    /// Creates the objects, with the queue pair in INIT.
    pub fn new(device: D, max_size: usize, depth: u32, mtu: Mtu) -> Result<Self> {
        let max_size = max_size.max(8);
        let pd = device.alloc_pd()?;
        let cq = device.create_cq(2 * (depth + RECV_DEPTH) + 64)?;
        let access = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;
        let mr = pd.alloc_mr(2 * max_size, access).context("registering the test buffer")?;
        let caps = QpCaps {
            max_send_wr: depth.max(16),
            max_recv_wr: RECV_DEPTH,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 256,
        };
        let qp = pd.create_qp(&cq, &cq, caps)?;
        qp.modify(&QpAttr::to_init(access))?;
        let max_inline = qp.caps().max_inline_data;
        let psn = initial_psn();
        Ok(Self {
            qp,
            mr,
            cq,
            _pd: pd,
            _device: device,
            max_size,
            max_inline,
            psn,
            mtu,
            lightpath_pmtu: None,
            peer_region: (0, 0),
            recvs_posted: 0,
            sends_outstanding: 0,
            wcs: vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 64],
        })
    }

    /// Offers a path MTU through the Lightpath extension (a soft side; see
    /// [`RdmaEndpoint::lightpath_pmtu`]).
    pub fn with_lightpath_pmtu(mut self, bytes: Option<u32>) -> Self {
        self.lightpath_pmtu = bytes;
        self
    }

    /// The path MTU in bytes the connected queue pair uses.
    pub fn path_mtu(&self) -> u32 {
        self.lightpath_pmtu.unwrap_or(self.mtu.bytes())
    }

    /// What the peer needs.
    pub fn endpoint(&self) -> RdmaEndpoint {
        let ep = self.qp.endpoint();
        RdmaEndpoint {
            gid: ep.gid.to_hex(),
            qpn: ep.qpn,
            psn: self.psn,
            mtu: self.mtu.bytes(),
            addr: self.mr.addr(),
            len: self.mr.len() as u64,
            rkey: self.mr.rkey(),
            lightpath_soft: false,
            lightpath_pmtu: self.lightpath_pmtu,
        }
    }

    /// Brings the queue pair to RTS towards `peer`.
    pub fn connect(&mut self, peer: &RdmaEndpoint) -> Result<()> {
        let gid = Gid::from_hex(&peer.gid).ok_or_else(|| anyhow!("peer sent a bad GID {:?}", peer.gid))?;
        let mtu = Mtu::from_bytes(peer.mtu)
            .ok_or_else(|| anyhow!("peer sent a bad MTU {}", peer.mtu))?
            .min(self.mtu);
        self.mtu = mtu;
        if let Some(bytes) = peer.lightpath_pmtu.filter(|&b| !lightpath_pmtu_in_range(b)) {
            bail!("peer sent a bad Lightpath MTU {bytes}");
        }
        // Both soft sides offered the extension: the smaller offer, if it beats the IB MTU
        // (both sides compute the same).
        self.lightpath_pmtu = match (self.lightpath_pmtu, peer.lightpath_pmtu) {
            (Some(mine), Some(theirs)) if peer.lightpath_soft => Some(mine.min(theirs)),
            _ => None,
        }
        .filter(|&bytes| bytes > mtu.bytes());
        let av = AddressVector {
            lightpath_peer: peer.lightpath_soft,
            // Both sides run this build (the control exchange checks its version).
            lightpath_bundles: peer.lightpath_soft,
            ..AddressVector::new(gid, self.qp.endpoint().gid_index)
        };
        let mut rtr = QpAttr::to_rtr(av, mtu, peer.qpn, peer.psn);
        rtr.lightpath_pmtu = self.lightpath_pmtu;
        // Short RNR back-off: a bandwidth test's receiver re-posts within microseconds.
        rtr.min_rnr_timer = Some(1);
        self.qp.modify(&rtr).context("moving the queue pair to RTR")?;
        self.qp.modify(&QpAttr::to_rts(self.psn)).context("moving the queue pair to RTS")?;
        self.peer_region = (peer.addr, peer.rkey);
        Ok(())
    }

    fn tx(&self, offset: usize, len: u32) -> lightpath_verbs::Sge {
        self.mr.sge(offset, len)
    }

    fn rx_offset(&self) -> usize {
        self.max_size
    }

    /// Posts receives until `target` are outstanding. Every receive spans the whole rx area, so
    /// receives left over from a smaller size still fit the next one.
    fn top_up_recvs(&mut self, target: u32) -> Result<()> {
        let sge = [self.mr.sge(self.rx_offset(), self.max_size as u32)];
        while self.recvs_posted < target {
            self.qp.post_recv(&RecvWr::new(RECV_WR, &sge))?;
            self.recvs_posted += 1;
        }
        Ok(())
    }

    /// Polls once; returns the completions, failing on any error status.
    fn poll(&mut self) -> Result<&[WorkCompletion]> {
        let n = self.cq.poll(&mut self.wcs)?;
        for wc in &self.wcs[..n] {
            if !wc.status.is_success() {
                bail!("work request {} ({:?}) failed: {}", wc.wr_id, wc.opcode, wc.status);
            }
            if wc.wr_id == RECV_WR {
                self.recvs_posted -= 1;
            } else {
                self.sends_outstanding -= 1;
            }
        }
        Ok(&self.wcs[..n])
    }

    fn post_send(&mut self, wr: &SendWr<'_>) -> Result<()> {
        self.qp.post_send(wr)?;
        self.sends_outstanding += 1;
        Ok(())
    }

    /// Polls until every posted send has completed.
    fn drain_sends(&mut self) -> Result<()> {
        let mut watchdog = Watchdog::new("waiting for the last send completions");
        let mut spins = 0u32;
        while self.sends_outstanding > 0 {
            if self.poll()?.is_empty() {
                watchdog.check(&mut spins)?;
            }
        }
        Ok(())
    }

    fn read_byte(&self, offset: usize) -> Result<u8> {
        let mut byte = [0u8];
        self.mr.read(offset, &mut byte)?;
        Ok(byte[0])
    }
}

const RECV_WR: u64 = 1;
const SEND_WR: u64 = 2;

fn initial_psn() -> u32 {
    // Any 24-bit value works; varying it between runs exercises the peer's PSN handling.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(7);
    (nanos ^ std::process::id().rotate_left(12)) & 0xFF_FFFF
}

/// A deadline that resets whenever progress is made. It reads the clock only every few
/// thousand idle spins, never on progress: on some machines (a VM whose clocksource is the
/// HPET) one clock read costs microseconds, which would otherwise show up in every sample.
struct Watchdog {
    last_check: Instant,
    progressed: bool,
    what: &'static str,
    /// Asked after [`HOPELESS_LIMIT`] without progress: whether waiting longer is pointless.
    hopeless: Option<Box<dyn FnMut() -> bool>>,
}

impl Watchdog {
    fn new(what: &'static str) -> Self {
        Self { last_check: Instant::now(), progressed: false, what, hopeless: None }
    }

    /// Gives up after [`HOPELESS_LIMIT`] instead of [`STALL_LIMIT`] when `hopeless` says so
    /// (a perftest peer whose every packet the device drops: a user waited ten seconds for an
    /// error the counters gave after the first packet).
    fn give_up_early_if(mut self, hopeless: impl FnMut() -> bool + 'static) -> Self {
        self.hopeless = Some(Box::new(hopeless));
        self
    }

    #[inline]
    fn progressed(&mut self) {
        self.progressed = true;
    }

    #[inline]
    fn check(&mut self, spins: &mut u32) -> Result<()> {
        *spins = spins.wrapping_add(1);
        if *spins & 0xfff != 0 {
            return Ok(());
        }
        let now = Instant::now();
        if std::mem::take(&mut self.progressed) {
            self.last_check = now;
            return Ok(());
        }
        let idle = now.duration_since(self.last_check);
        if idle > STALL_LIMIT {
            bail!("no progress for {} s while {}", STALL_LIMIT.as_secs(), self.what);
        }
        if idle > HOPELESS_LIMIT && self.hopeless.as_mut().is_some_and(|hopeless| hopeless()) {
            bail!("no progress for {} s while {}", HOPELESS_LIMIT.as_secs(), self.what);
        }
        Ok(())
    }
}

/// Unmeasured iterations before each latency measurement.
fn warmup(iters: u64) -> u64 {
    (iters / 10).clamp(1, 100)
}

/// What the client runs: the test, the provider name it reports, and each size with its
/// iteration count.
#[derive(Debug, Clone, Copy)]
pub struct ClientPlan<'a> {
    pub test: PerfTest,
    pub provider: ProviderKind,
    pub sizes: &'a [(usize, u64)],
    pub depth: u32,
}

/// The client's side of every size in the plan; `on_result` gets one result per size.
pub fn client_run<D: Device>(
    side: &mut Side<D>,
    control_stream: &mut TcpStream,
    plan: ClientPlan<'_>,
    peer: &RdmaEndpoint,
    mut on_result: impl FnMut(&SizeResult),
) -> Result<()> {
    let ClientPlan { test, provider, sizes, depth } = plan;
    for &(size, iters) in sizes {
        control::send(control_stream, &Step::Start { size, iters })?;
        let cpu_start = cpu::process_cpu();
        expect_step(control_stream, &Step::Ready)?;
        let mut progress = Progress::new(format!("{test} {size} B"), iters);
        let mut result = match test {
            PerfTest::SendLat | PerfTest::WriteLat | PerfTest::ReadLat | PerfTest::AtomicLat => {
                let mut samples = latency_client(side, test, size, iters, peer, &mut progress)?;
                let divisor = if test.reports_round_trip() { 1 } else { 2 };
                let lat = LatencySummary::from_nanos(&mut samples, divisor).expect("at least one iteration");
                SizeResult::latency(test, provider, size, iters, lat)
            }
            PerfTest::SendBw | PerfTest::WriteBw | PerfTest::ReadBw => {
                let elapsed = bandwidth_client(side, test, size, iters, depth, peer, &mut progress)?;
                SizeResult::bandwidth(
                    test,
                    provider,
                    size,
                    iters,
                    BandwidthSummary::new(size as u64 * iters, iters, elapsed),
                )
            }
        };
        result.path_mtu = Some(side.path_mtu());
        let client_cpu = cpu::process_cpu().saturating_sub(cpu_start);
        progress.finish();
        control::send(control_stream, &Step::Finish)?;
        let server_cpu = match control::recv::<Step>(control_stream)? {
            Step::Verdict { ok: true, cpu_ns, .. } => cpu_ns.map(Duration::from_nanos),
            Step::Verdict { ok: false, detail, .. } => bail!("the server found the data wrong: {detail}"),
            other => bail!("unexpected control message {other:?}"),
        };
        result.cpu = server_cpu.map(|server| {
            if test.is_latency() {
                CpuUse::per_op(client_cpu, server, iters + warmup(iters))
            } else {
                CpuUse::per_gb(client_cpu, server, size as u64 * iters)
            }
        });
        verify_client(side, test, size)?;
        on_result(&result);
    }
    Ok(())
}

/// The server's side: follows the client's steps until the plan is done.
pub fn server_run<D: Device>(
    side: &mut Side<D>,
    control_stream: &mut TcpStream,
    test: PerfTest,
    plan: &[(usize, u64)],
) -> Result<()> {
    for _ in plan {
        let (size, iters) = match control::recv::<Step>(control_stream)? {
            Step::Start { size, iters } if size <= side.max_size => (size, iters),
            other => bail!("unexpected control message {other:?}"),
        };
        let cpu_start = cpu::process_cpu();
        side.mr.write(0, &pattern::make(size, SERVER_SALT ^ size as u32))?;
        if matches!(test, PerfTest::SendLat | PerfTest::SendBw) {
            side.top_up_recvs(RECV_DEPTH)?;
        }
        control::send(control_stream, &Step::Ready)?;
        let received = match test {
            PerfTest::SendLat | PerfTest::WriteLat => {
                latency_server(side, test, size, iters + warmup(iters))?;
                expect_step(control_stream, &Step::Finish)?;
                0
            }
            PerfTest::SendBw => drive_until_finish(side, control_stream, Some(iters))?,
            _ => drive_until_finish(side, control_stream, None)?,
        };
        let cpu_ns = u64::try_from(cpu::process_cpu().saturating_sub(cpu_start).as_nanos()).ok();
        let verdict = match verify_server(side, test, size, iters, received) {
            Ok(()) => Step::Verdict { ok: true, detail: String::new(), cpu_ns },
            Err(err) => Step::Verdict { ok: false, detail: format!("{err:#}"), cpu_ns },
        };
        control::send(control_stream, &verdict)?;
    }
    Ok(())
}

fn expect_step(stream: &mut TcpStream, want: &Step) -> Result<()> {
    let got: Step = control::recv(stream)?;
    ensure!(&got == want, "expected {want:?} from the peer, got {got:?}");
    Ok(())
}

/// Spins on the completion queue (driving the provider) until the client's `Finish` arrives,
/// keeping receives posted; returns the number of receives completed. With `expect_recvs`, it
/// then also waits for that many receives (the client saw them acknowledged, but this side may
/// not have polled them yet).
fn drive_until_finish<D: Device>(
    side: &mut Side<D>,
    stream: &mut TcpStream,
    expect_recvs: Option<u64>,
) -> Result<u64> {
    let mut received = 0u64;
    let mut spins = 0u32;
    stream.set_nonblocking(true)?;
    let result = loop {
        let recvs = side.poll()?.iter().filter(|wc| wc.opcode == WcOpcode::Recv).count() as u64;
        if recvs > 0 {
            received += recvs;
            side.top_up_recvs(RECV_DEPTH)?;
        }
        spins = spins.wrapping_add(1);
        if spins & 0x3f == 0 {
            let mut probe = [0u8; 1];
            match stream.peek(&mut probe) {
                Ok(0) => break Err(anyhow!("client closed the control connection")),
                Ok(_) => break Ok(()),
                Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                Err(err) => break Err(err.into()),
            }
        }
    };
    stream.set_nonblocking(false)?;
    result?;
    expect_step(stream, &Step::Finish)?;
    if let Some(expected) = expect_recvs {
        let mut watchdog = Watchdog::new("collecting the last receive completions");
        while received < expected {
            let recvs = side.poll()?.iter().filter(|wc| wc.opcode == WcOpcode::Recv).count() as u64;
            if recvs == 0 {
                watchdog.check(&mut spins)?;
            }
            received += recvs;
            side.top_up_recvs(RECV_DEPTH)?;
        }
    }
    Ok(received)
}

fn marker(i: u64) -> u8 {
    (i % 251) as u8 + 1
}

/// Runs the measured ping-pong on the client and returns round-trip samples in ns.
fn latency_client<D: Device>(
    side: &mut Side<D>,
    test: PerfTest,
    size: usize,
    iters: u64,
    peer: &RdmaEndpoint,
    progress: &mut Progress,
) -> Result<Vec<u64>> {
    side.mr.write(0, &pattern::make(size, CLIENT_SALT ^ size as u32))?;
    if test == PerfTest::AtomicLat {
        ensure!(size == 8, "atomic_lat uses 8-byte operands");
    }
    if test == PerfTest::SendLat {
        side.top_up_recvs(64)?;
    }
    let total = iters + warmup(iters);
    let mut samples = Vec::with_capacity(iters as usize);
    let rx = side.rx_offset();
    let inline = size as u32 <= side.max_inline;
    let mut watchdog = Watchdog::new("waiting for a latency round trip");
    let mut tx_copy = Vec::new();
    if inline {
        tx_copy = pattern::make(size, CLIENT_SALT ^ size as u32);
    }
    // One clock read per iteration: each sample runs from the end of the previous round trip to
    // the end of this one (as perftest's cycle stamps do), so no read sits inside the loop twice.
    let mut previous = Instant::now();
    for i in 0..total {
        match test {
            PerfTest::SendLat => {
                post_send_op(side, SendOp::Send, size, inline, &tx_copy)?;
                wait_for(side, &mut watchdog, |wc| wc.opcode == WcOpcode::Recv)?;
                side.top_up_recvs(64)?;
            }
            PerfTest::WriteLat => {
                let m = marker(i);
                side.mr.write(size - 1, &[m])?;
                if inline {
                    tx_copy[size - 1] = m;
                }
                let op = SendOp::Write { remote_addr: peer.addr + rx as u64, rkey: peer.rkey };
                post_send_op(side, op, size, inline, &tx_copy)?;
                let mut spins = 0u32;
                while side.read_byte(rx + size - 1)? != m {
                    side.poll()?;
                    watchdog.check(&mut spins)?;
                }
            }
            PerfTest::ReadLat => {
                let op = SendOp::Read { remote_addr: peer.addr, rkey: peer.rkey };
                let sge = [side.mr.sge(rx, size as u32)];
                side.post_send(&SendWr::new(SEND_WR, op, &sge))?;
                wait_for(side, &mut watchdog, |wc| wc.opcode == WcOpcode::RdmaRead)?;
            }
            PerfTest::AtomicLat => {
                let op = SendOp::FetchAdd { remote_addr: peer.addr + rx as u64, rkey: peer.rkey, add: 1 };
                let sge = [side.mr.sge(rx, 8)];
                side.post_send(&SendWr::new(SEND_WR, op, &sge))?;
                wait_for(side, &mut watchdog, |wc| wc.opcode == WcOpcode::FetchAdd)?;
                let old = side.mr.read_u64(rx)?;
                ensure!(old == i, "fetch-and-add returned {old}, expected {i}");
            }
            _ => unreachable!("not a latency test"),
        }
        let now = Instant::now();
        watchdog.progressed();
        if i >= warmup(iters) {
            samples.push(now.duration_since(previous).as_nanos() as u64);
            progress.update(samples.len() as u64);
        }
        previous = now;
    }
    side.drain_sends()?;
    Ok(samples)
}

/// The server's half of the ping-pong tests.
fn latency_server<D: Device>(side: &mut Side<D>, test: PerfTest, size: usize, total: u64) -> Result<()> {
    let rx = side.rx_offset();
    let inline = size as u32 <= side.max_inline;
    let mut tx_copy = if inline { pattern::make(size, SERVER_SALT ^ size as u32) } else { Vec::new() };
    let mut watchdog = Watchdog::new("waiting for the client's ping");
    for i in 0..total {
        match test {
            PerfTest::SendLat => {
                wait_for(side, &mut watchdog, |wc| wc.opcode == WcOpcode::Recv)?;
                side.top_up_recvs(RECV_DEPTH)?;
                post_send_op(side, SendOp::Send, size, inline, &tx_copy)?;
            }
            PerfTest::WriteLat => {
                let m = marker(i);
                let mut spins = 0u32;
                while side.read_byte(rx + size - 1)? != m {
                    side.poll()?;
                    watchdog.check(&mut spins)?;
                }
                side.mr.write(size - 1, &[m])?;
                if inline {
                    tx_copy[size - 1] = m;
                }
                let (peer_addr, peer_rkey) = side.peer_region;
                let op = SendOp::Write { remote_addr: peer_addr + rx as u64, rkey: peer_rkey };
                post_send_op(side, op, size, inline, &tx_copy)?;
            }
            _ => unreachable!("not a ping-pong test"),
        }
        watchdog.progressed();
    }
    side.drain_sends()
}

fn post_send_op<D: Device>(
    side: &mut Side<D>,
    op: SendOp,
    size: usize,
    inline: bool,
    inline_bytes: &[u8],
) -> Result<()> {
    if inline {
        side.post_send(&SendWr::inline(SEND_WR, op, inline_bytes))
    } else {
        let sge = [side.tx(0, size as u32)];
        side.post_send(&SendWr::new(SEND_WR, op, &sge))
    }
}

/// Polls until a completion matching `wanted` arrives.
fn wait_for<D: Device>(
    side: &mut Side<D>,
    watchdog: &mut Watchdog,
    wanted: impl Fn(&WorkCompletion) -> bool,
) -> Result<()> {
    let mut spins = 0u32;
    loop {
        if side.poll()?.iter().any(&wanted) {
            return Ok(());
        }
        watchdog.check(&mut spins)?;
    }
}

/// Streams `iters` operations with at most `depth` in flight; returns the elapsed time.
fn bandwidth_client<D: Device>(
    side: &mut Side<D>,
    test: PerfTest,
    size: usize,
    iters: u64,
    depth: u32,
    peer: &RdmaEndpoint,
    progress: &mut Progress,
) -> Result<Duration> {
    side.mr.write(0, &pattern::make(size, CLIENT_SALT ^ size as u32))?;
    let rx = side.rx_offset();
    let (op, sge) = match test {
        PerfTest::SendBw => (SendOp::Send, side.tx(0, size as u32)),
        PerfTest::WriteBw => {
            (SendOp::Write { remote_addr: peer.addr + rx as u64, rkey: peer.rkey }, side.tx(0, size as u32))
        }
        PerfTest::ReadBw => {
            (SendOp::Read { remote_addr: peer.addr, rkey: peer.rkey }, side.mr.sge(rx, size as u32))
        }
        _ => unreachable!("not a bandwidth test"),
    };
    let sges = [sge];
    let wr = SendWr::new(SEND_WR, op, &sges);
    let waiting = "waiting for bandwidth-test completions";
    post_keeping_in_flight(side, &wr, iters, depth, waiting, |completed| progress.update(completed))
}

/// Posts `wr` `iters` times with at most `depth` in flight (capped by the send queue) and
/// polls until every one completed; `on_progress` gets the running count. The watchdog's
/// message (`waiting`) says what a stall most likely means. Returns the elapsed time.
fn post_keeping_in_flight<D: Device>(
    side: &mut Side<D>,
    wr: &SendWr<'_>,
    iters: u64,
    depth: u32,
    waiting: &'static str,
    mut on_progress: impl FnMut(u64),
) -> Result<Duration> {
    let depth = u64::from(depth.min(side.qp.caps().max_send_wr));
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut watchdog = Watchdog::new(waiting);
    let mut spins = 0u32;
    let start = Instant::now();
    while completed < iters {
        while posted < iters && posted - completed < depth {
            side.post_send(wr)?;
            posted += 1;
        }
        let n = side.poll()?.len() as u64;
        if n > 0 {
            completed += n;
            watchdog.progressed();
            on_progress(completed);
        } else {
            watchdog.check(&mut spins)?;
        }
    }
    Ok(start.elapsed())
}

fn verify_server<D: Device>(
    side: &Side<D>,
    test: PerfTest,
    size: usize,
    iters: u64,
    received: u64,
) -> Result<()> {
    let rx = side.rx_offset();
    let mut bytes = vec![0u8; size];
    side.mr.read(rx, &mut bytes)?;
    let expected = pattern::make(size, CLIENT_SALT ^ size as u32);
    match test {
        PerfTest::SendBw => {
            ensure!(received == iters, "received {received} of {iters} messages");
            ensure!(pattern::checksum(&bytes) == pattern::checksum(&expected), "payload checksum mismatch");
        }
        PerfTest::WriteBw => {
            ensure!(pattern::checksum(&bytes) == pattern::checksum(&expected), "payload checksum mismatch");
        }
        PerfTest::SendLat => ensure!(bytes == expected, "the last message differs from the client's"),
        PerfTest::WriteLat => {
            ensure!(bytes[..size - 1] == expected[..size - 1], "the written bytes differ from the client's")
        }
        PerfTest::ReadLat | PerfTest::ReadBw | PerfTest::AtomicLat => {}
    }
    Ok(())
}

fn verify_client<D: Device>(side: &Side<D>, test: PerfTest, size: usize) -> Result<()> {
    let rx = side.rx_offset();
    let mut bytes = vec![0u8; size];
    side.mr.read(rx, &mut bytes)?;
    let expected = pattern::make(size, SERVER_SALT ^ size as u32);
    match test {
        PerfTest::SendLat => ensure!(bytes == expected, "the last reply differs from the server's message"),
        PerfTest::WriteLat => ensure!(bytes[..size - 1] == expected[..size - 1], "the written bytes differ"),
        PerfTest::ReadLat | PerfTest::ReadBw => {
            ensure!(
                pattern::checksum(&bytes) == pattern::checksum(&expected),
                "data read differs from the server's"
            )
        }
        _ => {}
    }
    Ok(())
}
