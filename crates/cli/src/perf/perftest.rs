//! `lightpath perf TEST --perftest`: the soft provider on one end and rdma-core's perftest
//! (`ib_write_bw`, `ib_send_lat`, ...) on the other, speaking perftest's own out-of-band
//! exchange and message pattern, so a machine without an RNIC measures against one that has
//! it (or rxe) with the tool everyone already runs.
//!
//! # perftest's exchange (version 6.06, Debian's perftest 4.5-0.17), as implemented here
//!
//! One TCP connection to port 18515 (`-p`). Every exchange is symmetric: the client writes its
//! bytes, then reads the server's; the server reads, then writes. In order:
//!
//! 1. version: 16 bytes, a NUL-padded decimal string (`"6.06"`); perftest refuses peers below
//!    5.70, and so do we (the steps below assume a recent peer);
//! 2. system data: the page size ("cycle buffer") and the cache-line size, two 4-byte
//!    big-endian integers; both sides take the larger of each;
//! 3. MTU: 2 bytes, the path MTU as an `ibv_mtu` number in decimal (`"3"` = 1024) and a NUL;
//!    both sides take the smaller;
//! 4. queue-pair "keys", 108 bytes: `%04x:%04x:%06x:%06x:%08x:%016x:` (LID, outstanding
//!    reads, QPN, PSN, rkey, address) then the 16 GID bytes as `%02x:` and the SRQ number as
//!    `%08x:`, NUL-terminated ([`Keys`]). The same keys go back and forth several times as
//!    synchronisation points: how many times, and where, depends on the test ([`Flow`]);
//! 5. bandwidth tests end with the client's report (size and iterations as 8-byte big-endian
//!    integers, then peak bandwidth, average bandwidth and message rate as big-endian IEEE
//!    doubles; bandwidth in MiB/s, rate in Mpps), which the server prints as its own result;
//! 6. tests that close the connection exchange keys once more and write `"done\0"`.
//!
//! Nothing in the exchange carries the test, the message size, the iteration count or the
//! connection type, exactly as with perftest itself: both ends must be started with the same
//! test, `-s`/`-a`, `-n`, and RC. What this side can see of a mismatch it reports plainly
//! instead of waiting forever: every wait has a deadline, and on a failure the queue pair's
//! counters say what happened (packets of another transport dropped: the peer runs UC or UD;
//! NAKs sent: the peer wrote past our buffer, so it runs larger sizes; nothing arrived).
//!
//! # Message patterns (as perftest's)
//!
//! | test | active side | pattern |
//! |---|---|---|
//! | write_bw, read_bw | client | RDMA WRITE / READ streamed, `-t` (128) outstanding |
//! | read_lat | client | one RDMA READ at a time |
//! | write_lat | both | ping-pong: each side spins on the last byte of the area the peer writes (the byte is the iteration count), the server posts first |
//! | send_lat | both | ping-pong of SENDs: per size, receives posted (`min(512, -n)`, one re-posted per arrival up to `-n` in all), a keys exchange, then the client sends first and each side answers every arrival |
//! | send_bw | client | SENDs streamed, `-t` in flight, after the server posted its receives and a keys exchange; each side prints its own report (the server's times its receives), none crosses; `-a` adds a keys exchange after each size |
//!
//! Sizes: `-s`, or perftest's defaults (65,536 for bandwidth, 2 for latency); `-a` runs
//! 2 B..8 MiB. Iterations: `-n`, or perftest's defaults (5,000 for bandwidth, 1,000 for
//! latency) for every size.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use lightpath_soft::SoftDevice;
use lightpath_verbs::{
    AddressVector, Gid, MemoryRegion, Mtu, QpAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
};

use super::{Side, Watchdog, SEND_WR};
use crate::perf::args::{Args, PerfTest, MAX_SIZE};
use crate::perf::stats::LatencySummary;

/// The perftest version this side claims (that of Debian 12's perftest).
const OUR_VERSION: &str = "6.06";
/// The oldest peer version accepted (perftest's own limit).
const OLDEST_PEER_VERSION: f64 = 5.70;
/// Bytes of a keys message with a GID.
const KEYS_LEN: usize = 108;
/// Reads this side allows in flight towards it, and issues (perftest's usual value).
const OUT_READS: u32 = 16;
/// The ACK timeout exponent of the queue pair (4.096 µs × 2^18 ≈ 1.07 s; see `connect_perftest`).
const ACK_TIMEOUT: u8 = 18;
/// How long a control-connection step may take before the peer is declared stuck.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a passive server waits with neither a datagram nor a control message.
const QUIET_LIMIT: Duration = Duration::from_secs(30);

/// Runs `lightpath perf TEST --perftest [SERVER]`.
pub fn run(args: &Args) -> Result<()> {
    let flow = Flow::of(args.test)?;
    let plan = plan(args);
    let (stream, role) = match &args.server {
        Some(server) => {
            let stream = TcpStream::connect((server.as_str(), args.port))
                .with_context(|| format!("cannot reach perftest at {server}:{}", args.port))?;
            (stream, Role::Client)
        }
        None => {
            let ip = args.bind.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            let listener = TcpListener::bind((ip, args.port))
                .with_context(|| format!("cannot listen on TCP {ip}:{}", args.port))?;
            eprintln!("lightpath perf --perftest: waiting for {} on port {}", flow.peer_tool(), args.port);
            let (stream, peer) = listener.accept()?;
            eprintln!("lightpath perf --perftest: {peer} connected");
            (stream, Role::Server)
        }
    };
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(STEP_TIMEOUT))?;
    stream.set_write_timeout(Some(STEP_TIMEOUT))?;
    let mut oob = Oob { stream, role };

    // 1-3: version, system data, MTU.
    let peer_version = oob.exchange_version()?;
    let cycle_buffer = oob.exchange_sys_data()?;
    let ip = match args.bind {
        Some(ip) => ip,
        None => oob.stream.local_addr()?.ip().to_canonical(),
    };
    let our_mtu = match args.mtu {
        Some(bytes) => Mtu::from_bytes(bytes).ok_or_else(|| anyhow!("bad MTU {bytes}"))?,
        None if ip.is_loopback() => Mtu::Mtu4096,
        None => Mtu::Mtu1024,
    };
    let mtu = oob.exchange_mtu(our_mtu)?;
    if mtu != our_mtu {
        eprintln!("lightpath perf --perftest: the peer's MTU is smaller; using {} bytes", mtu.bytes());
    }

    // The objects: a region [tx | rx] large enough for every size and for perftest's habit of
    // moving the remote address through a page-sized cycle buffer.
    let max_size = plan.iter().map(|&(size, _)| size).max().unwrap_or(2).max(cycle_buffer as usize).max(4096);
    let device = super::super::soft::open_device(ip, args.udp_port, mtu)?;
    let mut side = Side::new(device, max_size, args.tx_depth.max(1), mtu)?;
    let ours = side.perftest_keys();

    // 4: keys, connect, the synchronising exchanges.
    let mut peer = Keys::default();
    for _ in 0..flow.keys_before_connect {
        peer = oob.exchange_keys(&ours)?;
    }
    ensure!(
        peer.gid_is_v4_mapped() == ours.gid_is_v4_mapped(),
        "the peer's GID {} and ours {} are of different IP versions: use a GID index of the same kind (-x)",
        peer.gid(),
        ours.gid()
    );
    side.connect_perftest(&peer, mtu)?;
    for _ in 0..flow.keys_after_connect {
        oob.exchange_keys(&ours)?;
    }
    eprintln!(
        "lightpath perf --perftest: {} {} QPN {:#08x} PSN {:#08x} <-> perftest {peer_version:.2} GID {} QPN {:#08x} PSN {:#08x}, MTU {}",
        args.test,
        role.name(),
        ours.qpn,
        ours.psn,
        peer.gid(),
        peer.qpn,
        peer.psn,
        mtu.bytes()
    );

    let outcome = match (args.test, role) {
        (PerfTest::WriteBw | PerfTest::ReadBw, Role::Client) => {
            bw_client(&mut side, &mut oob, &ours, &peer, args, &plan)
        }
        (PerfTest::WriteBw | PerfTest::ReadBw, Role::Server) => bw_server(&mut side, &mut oob, &ours),
        (PerfTest::ReadLat, Role::Client) => read_lat_client(&mut side, &mut oob, &ours, &peer, &plan),
        (PerfTest::ReadLat, Role::Server) => passive_until_close(&mut side, &mut oob, &ours),
        (PerfTest::WriteLat, role) => write_lat(&mut side, role, &peer, &plan),
        (PerfTest::SendLat, role) => send_lat(&mut side, &mut oob, &ours, role, &plan),
        (PerfTest::SendBw, Role::Client) => send_bw_client(&mut side, &mut oob, &ours, args, &plan),
        (PerfTest::SendBw, Role::Server) => send_bw_server(&mut side, &mut oob, &ours, args.all, &plan),
        (test, _) => Err(anyhow!("{test} is not supported with --perftest")),
    };
    outcome.map_err(|err| explain(err, &side))
}

/// Whether the device has dropped packets of a transport it lacks (a UC or UD perftest
/// peer): then a wait without progress will not end, and `explain` says why. (NAKs are not
/// taken as a sign: a lost packet's sequence NAK is part of a healthy run's recovery.)
fn peer_unservable(side: &Side<SoftDevice>) -> impl FnMut() -> bool + 'static {
    let device = side._device.clone();
    move || device.stats().engine.drops_unsupported > 0
}

/// Adds what the counters say to an error.
fn explain(err: anyhow::Error, side: &Side<SoftDevice>) -> anyhow::Error {
    let qp = side.qp.stats().unwrap_or_default();
    let device = side._device.stats();
    let mut hints = Vec::new();
    if device.engine.drops_unsupported > 0 {
        hints.push(format!(
            "{} packets of a transport other than RC arrived and were dropped: the peer runs UC or UD (perftest -c); the soft provider speaks RC only",
            device.engine.drops_unsupported
        ));
    }
    if qp.naks_sent > 0 {
        hints.push(format!(
            "this side refused {} of the peer's requests (NAKs sent): it addressed memory past our buffer, so it runs larger messages than we do; start both sides with the same -s / -a",
            qp.naks_sent
        ));
    }
    if qp.rx_datagrams == 0 {
        hints.push("no datagram from the peer reached the queue pair".into());
    }
    if hints.is_empty() {
        err
    } else {
        err.context(hints.join("; "))
    }
}

/// Sizes and iterations, perftest's way: `-a` is 2 B..8 MiB, every size with `-n` or the
/// default iterations.
fn plan(args: &Args) -> Vec<(usize, u64)> {
    let iters = args.iters.unwrap_or(if args.test.is_latency() { 1000 } else { 5000 });
    if args.all {
        return (1..24).map(|shift| (1usize << shift, iters)).collect();
    }
    let size = args.size.unwrap_or(if args.test.is_latency() { 2 } else { 65536 });
    vec![(size.min(MAX_SIZE), iters)]
}

/// Which end of the TCP connection this side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Client,
    Server,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Server => "server",
        }
    }
}

/// How many keys exchanges a test makes around the connect (from perftest's sources).
#[derive(Clone, Copy, Debug)]
struct Flow {
    test: PerfTest,
    keys_before_connect: u32,
    keys_after_connect: u32,
}

impl Flow {
    fn of(test: PerfTest) -> Result<Self> {
        let (before, after) = match test {
            PerfTest::WriteBw | PerfTest::ReadBw => (1, 2),
            PerfTest::WriteLat | PerfTest::ReadLat => (2, 2),
            PerfTest::SendLat | PerfTest::SendBw => (1, 2),
            other => bail!(
                "{other} is not available with --perftest yet (send_lat, send_bw, write_bw, read_bw, write_lat and read_lat are)"
            ),
        };
        Ok(Self { test, keys_before_connect: before, keys_after_connect: after })
    }

    fn peer_tool(&self) -> String {
        format!("ib_{}", self.test.name())
    }
}

/// A queue pair's description in perftest's keys message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Keys {
    pub lid: u16,
    pub out_reads: u32,
    pub qpn: u32,
    pub psn: u32,
    pub rkey: u32,
    pub vaddr: u64,
    pub gid: [u8; 16],
    pub srqn: u32,
}

impl Keys {
    /// The 108-byte message.
    pub fn emit(&self) -> [u8; KEYS_LEN] {
        let mut text = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        for byte in self.gid {
            text.push_str(&format!("{byte:02x}:"));
        }
        text.push_str(&format!("{:08x}:", self.srqn));
        let mut out = [0u8; KEYS_LEN];
        let bytes = text.as_bytes();
        out[..bytes.len().min(KEYS_LEN - 1)].copy_from_slice(&bytes[..bytes.len().min(KEYS_LEN - 1)]);
        out
    }

    /// Parses a 108-byte message; anything else is an error naming what was wrong.
    pub fn parse(message: &[u8]) -> Result<Self> {
        ensure!(message.len() == KEYS_LEN, "a keys message is {KEYS_LEN} bytes, got {}", message.len());
        let end = message.iter().position(|&b| b == 0).unwrap_or(message.len());
        let text = std::str::from_utf8(&message[..end])
            .map_err(|_| anyhow!("the peer's keys message is not text: {:?}", &message[..end]))?;
        let fields: Vec<&str> = text.split(':').collect();
        // 6 fields, 16 GID bytes, the SRQ number, and the empty rest after the last colon.
        ensure!(
            fields.len() == 24 && fields[23].is_empty(),
            "the peer's keys message {text:?} is not perftest's format with a GID (is the peer using a GID, -x?)"
        );
        let hex = |i: usize, max_digits: usize| -> Result<u64> {
            let field = fields[i];
            ensure!(
                !field.is_empty() && field.len() <= max_digits,
                "field {i} of the peer's keys message {text:?} is not {max_digits} hex digits"
            );
            u64::from_str_radix(field, 16).map_err(|_| anyhow!("field {i} of {text:?} is not hexadecimal"))
        };
        let mut gid = [0u8; 16];
        for (i, byte) in gid.iter_mut().enumerate() {
            *byte = hex(6 + i, 2)? as u8;
        }
        Ok(Self {
            lid: hex(0, 4)? as u16,
            out_reads: hex(1, 4)? as u32,
            qpn: hex(2, 6)? as u32,
            psn: hex(3, 6)? as u32,
            rkey: hex(4, 8)? as u32,
            vaddr: hex(5, 16)?,
            gid,
            srqn: hex(22, 8)? as u32,
        })
    }

    fn gid(&self) -> Gid {
        Gid(self.gid)
    }

    fn gid_is_v4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|&b| b == 0) && self.gid[10] == 0xFF && self.gid[11] == 0xFF
    }
}

/// The out-of-band connection.
struct Oob {
    stream: TcpStream,
    role: Role,
}

impl Oob {
    /// perftest's symmetric exchange: the client writes first, the server reads first.
    fn exchange(&mut self, mine: &[u8], theirs: usize, what: &str) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; theirs];
        let read = |stream: &mut TcpStream, buf: &mut [u8]| -> Result<()> {
            stream.read_exact(buf).map_err(|err| match err.kind() {
                ErrorKind::UnexpectedEof => {
                    anyhow!("the peer closed the connection while we waited for its {what}")
                }
                ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow!(
                    "no {what} from the peer within {} s: does it run the same test and options?",
                    STEP_TIMEOUT.as_secs()
                ),
                _ => anyhow!("reading the peer's {what}: {err}"),
            })
        };
        match self.role {
            Role::Client => {
                self.stream.write_all(mine).with_context(|| format!("sending our {what}"))?;
                read(&mut self.stream, &mut buf)?;
            }
            Role::Server => {
                read(&mut self.stream, &mut buf)?;
                self.stream.write_all(mine).with_context(|| format!("sending our {what}"))?;
            }
        }
        Ok(buf)
    }

    fn exchange_version(&mut self) -> Result<f64> {
        let mut mine = [0u8; 16];
        mine[..OUR_VERSION.len()].copy_from_slice(OUR_VERSION.as_bytes());
        let theirs = self.exchange(&mine, 16, "version")?;
        let end = theirs.iter().position(|&b| b == 0).unwrap_or(theirs.len());
        let text = String::from_utf8_lossy(&theirs[..end]).to_string();
        let version: f64 = text
            .trim()
            .parse()
            .map_err(|_| anyhow!("the peer's version {text:?} is not perftest's (is it perftest?)"))?;
        ensure!(
            version >= OLDEST_PEER_VERSION,
            "the peer runs perftest {text}; versions before {OLDEST_PEER_VERSION} exchange differently"
        );
        Ok(version)
    }

    /// Returns the cycle buffer both sides use (the larger page size).
    fn exchange_sys_data(&mut self) -> Result<u32> {
        let (page, cache_line) = (4096u32, 64u32);
        let theirs = self.exchange(&page.to_be_bytes(), 4, "page size")?;
        let their_page = u32::from_be_bytes(theirs[..4].try_into().expect("4 bytes"));
        self.exchange(&cache_line.to_be_bytes(), 4, "cache-line size")?;
        ensure!(their_page <= MAX_SIZE as u32, "the peer's page size {their_page} is implausible");
        Ok(page.max(their_page))
    }

    fn exchange_mtu(&mut self, ours: Mtu) -> Result<Mtu> {
        let code = mtu_code(ours);
        let mine = [b'0' + code, 0];
        let theirs = self.exchange(&mine, 2, "MTU")?;
        let peer = match theirs[0] {
            c @ b'1'..=b'5' if theirs[1] == 0 => mtu_from_code(c - b'0'),
            _ => bail!("the peer's MTU {:?} is not an ibv_mtu number", String::from_utf8_lossy(&theirs)),
        };
        Ok(ours.min(peer))
    }

    fn exchange_keys(&mut self, ours: &Keys) -> Result<Keys> {
        let theirs = self.exchange(&ours.emit(), KEYS_LEN, "queue-pair keys")?;
        Keys::parse(&theirs)
    }

    /// The end of a bandwidth test: the client's report goes to the server (which prints it
    /// as its result), the server's comes back. Returns the peer's (size, iterations).
    fn exchange_bw_report(&mut self, report: &BwReport) -> Result<BwReport> {
        let size = self.exchange(&report.size.to_be_bytes(), 8, "report (size)")?;
        let iters = self.exchange(&report.iters.to_be_bytes(), 8, "report (iterations)")?;
        let peak = self.exchange(&report.bw_peak.to_bits().to_be_bytes(), 8, "report (peak)")?;
        let avg = self.exchange(&report.bw_avg.to_bits().to_be_bytes(), 8, "report (average)")?;
        let rate = self.exchange(&report.msg_rate.to_bits().to_be_bytes(), 8, "report (message rate)")?;
        let u = |b: Vec<u8>| u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
        Ok(BwReport {
            size: u(size),
            iters: u(iters),
            bw_peak: f64::from_bits(u(peak)),
            bw_avg: f64::from_bits(u(avg)),
            msg_rate: f64::from_bits(u(rate)),
        })
    }

    /// perftest's close: one more keys exchange, then `"done\0"` each way.
    fn close(&mut self, ours: &Keys) -> Result<()> {
        self.exchange_keys(ours)?;
        self.stream.write_all(b"done\0")?;
        // The peer writes its own; read it (briefly) so the close is not a reset.
        self.stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut done = [0u8; 5];
        let _ = self.stream.read_exact(&mut done);
        Ok(())
    }
}

fn mtu_code(mtu: Mtu) -> u8 {
    match mtu.bytes() {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    }
}

fn mtu_from_code(code: u8) -> Mtu {
    Mtu::from_bytes(128 << code).unwrap_or(Mtu::Mtu1024)
}

/// perftest's bandwidth report (MiB/s and Mpps, as perftest computes them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct BwReport {
    size: u64,
    iters: u64,
    bw_peak: f64,
    bw_avg: f64,
    msg_rate: f64,
}

const BW_HEADER: &str = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
const LAT_HEADER: &str =
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_99%[usec]";

fn print_bw(report: &BwReport) {
    outln!(
        " {:<10} {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
        report.size,
        report.iters,
        report.bw_peak,
        report.bw_avg,
        report.msg_rate
    );
}

fn print_lat(size: usize, iters: u64, lat: &LatencySummary) {
    outln!(
        " {:<7} {:<10}   {:<7.2}        {:<7.2}      {:<7.2}            {:<7.2}        {:<7.2}",
        size,
        iters,
        lat.min,
        lat.max,
        lat.median,
        lat.avg,
        lat.p99
    );
}

impl Side<SoftDevice> {
    fn perftest_keys(&self) -> Keys {
        let ep = self.qp.endpoint();
        Keys {
            lid: 0,
            out_reads: OUT_READS,
            qpn: ep.qpn,
            psn: self.psn,
            rkey: self.mr.rkey(),
            vaddr: self.mr.addr() + self.rx_offset() as u64,
            gid: ep.gid.0,
            srqn: 0,
        }
    }

    /// RTR and RTS towards a perftest peer (an rdma-core device: no Lightpath extensions).
    fn connect_perftest(&mut self, peer: &Keys, mtu: Mtu) -> Result<()> {
        let av = AddressVector::new(peer.gid(), self.qp.endpoint().gid_index);
        let mut rtr = QpAttr::to_rtr(av, mtu, peer.qpn, peer.psn);
        rtr.max_dest_rd_atomic = Some(OUT_READS as u8);
        rtr.min_rnr_timer = Some(1);
        self.qp.modify(&rtr).context("moving the queue pair to RTR")?;
        let mut rts = QpAttr::to_rts(self.psn);
        rts.max_rd_atomic = Some(peer.out_reads.clamp(1, OUT_READS) as u8);
        // perftest's peer is often rxe, in a VM: under load its responder stalls for longer
        // than the usual 67 ms timeout times 7 retries (seen with -a's 4-8 MiB messages under
        // TCG), so this side waits up to ~1 s per retry before sending again.
        rts.timeout = Some(ACK_TIMEOUT);
        self.qp.modify(&rts).context("moving the queue pair to RTS")?;
        self.peer_region = (peer.vaddr, peer.rkey);
        self.mtu = mtu;
        Ok(())
    }
}

/// The bandwidth client: every size streamed with `-t` in flight, then perftest's end.
fn bw_client(
    side: &mut Side<SoftDevice>,
    oob: &mut Oob,
    ours: &Keys,
    peer: &Keys,
    args: &Args,
    plan: &[(usize, u64)],
) -> Result<()> {
    outln!("{BW_HEADER}");
    let mut last = BwReport::default();
    for &(size, iters) in plan {
        let elapsed = stream_ops(side, args.test, size, iters, args.tx_depth, peer)?;
        let secs = elapsed.as_secs_f64().max(1e-9);
        last = BwReport {
            size: size as u64,
            iters,
            // Per-completion time stamps are not kept, so no peak is measured (0, as perftest
            // prints for runs without them).
            bw_peak: 0.0,
            bw_avg: (size as u64 * iters) as f64 / secs / f64::from(1u32 << 20),
            msg_rate: iters as f64 / secs / 1e6,
        };
        print_bw(&last);
    }
    // The server waits for this point, then prints our (last) report.
    oob.exchange_keys(ours)?;
    oob.exchange_bw_report(&last)?;
    oob.close(ours)
}

/// Streams `iters` WRITEs or READs of `size` with at most `depth` in flight.
fn stream_ops(
    side: &mut Side<SoftDevice>,
    test: PerfTest,
    size: usize,
    iters: u64,
    depth: u32,
    peer: &Keys,
) -> Result<Duration> {
    let rx = side.rx_offset();
    let (op, sge) = match test {
        PerfTest::WriteBw => {
            (SendOp::Write { remote_addr: peer.vaddr, rkey: peer.rkey }, side.tx(0, size as u32))
        }
        _ => (SendOp::Read { remote_addr: peer.vaddr, rkey: peer.rkey }, side.mr.sge(rx, size as u32)),
    };
    let sges = [sge];
    let wr = SendWr::new(SEND_WR, op, &sges);
    let waiting = "waiting for completions (does the peer run the same -s / -a?)";
    super::post_keeping_in_flight(side, &wr, iters, depth, waiting, |_| {})
}

/// Drives the device until a control message arrives, giving up after [`QUIET_LIMIT`] with
/// neither a datagram for the queue pair nor a control message.
fn drive_until_message(side: &mut Side<SoftDevice>, oob: &mut Oob) -> Result<()> {
    oob.stream.set_nonblocking(true)?;
    let mut last_rx = side.qp.stats().map(|s| s.rx_datagrams).unwrap_or(0);
    let mut quiet_since = Instant::now();
    let mut spins = 0u32;
    let result = loop {
        side.poll()?;
        spins = spins.wrapping_add(1);
        if spins & 0x3f != 0 {
            continue;
        }
        let mut probe = [0u8; 1];
        match oob.stream.peek(&mut probe) {
            Ok(0) => break Err(anyhow!("the peer closed the control connection before the end of the test")),
            Ok(_) => break Ok(()),
            Err(err) if err.kind() == ErrorKind::WouldBlock => {}
            Err(err) => break Err(err.into()),
        }
        if spins & 0xffff == 0 {
            let rx = side.qp.stats().map(|s| s.rx_datagrams).unwrap_or(0);
            if rx != last_rx {
                last_rx = rx;
                quiet_since = Instant::now();
            } else if quiet_since.elapsed() > QUIET_LIMIT {
                break Err(anyhow!(
                    "neither traffic nor a control message from the peer for {} s",
                    QUIET_LIMIT.as_secs()
                ));
            }
        }
    };
    oob.stream.set_nonblocking(false)?;
    result
}

/// The bandwidth server: serves the client's WRITEs or READs (the engine answers them), then
/// prints the client's report as perftest's server does.
fn bw_server(side: &mut Side<SoftDevice>, oob: &mut Oob, ours: &Keys) -> Result<()> {
    drive_until_message(side, oob)?;
    oob.exchange_keys(ours)?;
    let theirs = oob.exchange_bw_report(&BwReport::default())?;
    let qp = side.qp.stats()?;
    oob.close(ours)?;
    if side._device.stats().engine.drops_unsupported > 0 || qp.naks_sent > 0 {
        return Err(anyhow!("the client's test did not run cleanly against this side"));
    }
    outln!("{BW_HEADER}");
    print_bw(&theirs);
    Ok(())
}

/// A passive server that only waits for the client's close (read_lat).
fn passive_until_close(side: &mut Side<SoftDevice>, oob: &mut Oob, ours: &Keys) -> Result<()> {
    drive_until_message(side, oob)?;
    oob.close(ours)?;
    let qp = side.qp.stats()?;
    if side._device.stats().engine.drops_unsupported > 0 || qp.naks_sent > 0 {
        return Err(anyhow!("the client's test did not run cleanly against this side"));
    }
    eprintln!(
        "lightpath perf --perftest: served {} datagrams ({} bytes) in, {} out",
        qp.rx_datagrams, qp.rx_bytes, qp.tx_datagrams
    );
    Ok(())
}

/// read_lat's client: one READ at a time; round-trip latency per iteration.
fn read_lat_client(
    side: &mut Side<SoftDevice>,
    oob: &mut Oob,
    ours: &Keys,
    peer: &Keys,
    plan: &[(usize, u64)],
) -> Result<()> {
    outln!("{LAT_HEADER}");
    let rx = side.rx_offset();
    for &(size, iters) in plan {
        let op = SendOp::Read { remote_addr: peer.vaddr, rkey: peer.rkey };
        let sge = [side.mr.sge(rx, size as u32)];
        let wr = SendWr::new(SEND_WR, op, &sge);
        let mut samples = Vec::with_capacity(iters as usize);
        let mut watchdog =
            Watchdog::new("waiting for a READ response").give_up_early_if(peer_unservable(side));
        for _ in 0..iters {
            let start = Instant::now();
            side.post_send(&wr)?;
            let mut spins = 0u32;
            loop {
                if side.poll()?.iter().any(|wc| wc.opcode == WcOpcode::RdmaRead) {
                    break;
                }
                watchdog.check(&mut spins)?;
            }
            watchdog.progressed();
            samples.push(start.elapsed().as_nanos() as u64);
        }
        let lat = LatencySummary::from_nanos(&mut samples, 1).ok_or_else(|| anyhow!("no iterations"))?;
        print_lat(size, iters, &lat);
    }
    oob.close(ours)
}

/// write_lat, both sides: perftest's ping-pong on the last byte of each message (the
/// iteration count, modulo 256). The server sends first, on the client's first arrival.
fn write_lat(side: &mut Side<SoftDevice>, role: Role, peer: &Keys, plan: &[(usize, u64)]) -> Result<()> {
    outln!("{LAT_HEADER}");
    let rx = side.rx_offset();
    for &(size, iters) in plan {
        let mut posted_at = Vec::with_capacity(iters as usize);
        let (mut scnt, mut rcnt, mut ccnt) = (0u64, 0u64, 0u64);
        let mut tx = vec![0u8; size];
        let mut watchdog =
            Watchdog::new("waiting for the peer's write (does it run the same -s / -a and -n?)")
                .give_up_early_if(peer_unservable(side));
        while scnt < iters || ccnt < iters || rcnt < iters {
            if rcnt < iters && !(scnt < 1 && role == Role::Server) {
                rcnt += 1;
                let mut spins = 0u32;
                while side.read_byte(rx + size - 1)? != rcnt as u8 {
                    side.poll()?;
                    watchdog.check(&mut spins)?;
                }
                watchdog.progressed();
            }
            if scnt < iters {
                posted_at.push(Instant::now());
                scnt += 1;
                tx[size - 1] = scnt as u8;
                side.mr.write(0, &tx)?;
                let op = SendOp::Write { remote_addr: peer.vaddr, rkey: peer.rkey };
                let sge = [side.tx(0, size as u32)];
                side.post_send(&SendWr::new(SEND_WR, op, &sge))?;
            }
            if ccnt < iters {
                let mut spins = 0u32;
                loop {
                    let n = side.poll()?.len() as u64;
                    if n > 0 {
                        ccnt += n;
                        break;
                    }
                    watchdog.check(&mut spins)?;
                }
            }
        }
        // One-way latency: half of each interval between consecutive posts.
        let mut samples: Vec<u64> =
            posted_at.windows(2).map(|w| w[1].duration_since(w[0]).as_nanos() as u64).collect();
        if let Some(lat) = LatencySummary::from_nanos(&mut samples, 2) {
            print_lat(size, iters, &lat);
        }
    }
    Ok(())
}

/// What a failed or stalled SEND test most likely means.
const SEND_MISMATCH: &str = "start both sides with the same test, -s / -a and -n, over RC";

/// The receives of one size of a SEND test, perftest's way: `min(512, iters)` posted before
/// the size starts, one more after each arrival until `iters` have been posted in all (so
/// none is left over for the next size), each exactly `size` bytes long (a larger message from
/// the peer fails the receive instead of landing in a larger buffer).
struct Receives {
    size: usize,
    iters: u64,
    posted: u64,
}

impl Receives {
    fn post(side: &mut Side<SoftDevice>, size: usize, iters: u64) -> Result<Self> {
        let mut recvs = Self { size, iters, posted: 0 };
        let first = iters.min(u64::from(super::RECV_DEPTH.min(side.qp.caps().max_recv_wr)));
        for _ in 0..first {
            recvs.post_one(side)?;
        }
        Ok(recvs)
    }

    fn post_one(&mut self, side: &mut Side<SoftDevice>) -> Result<()> {
        if self.posted < self.iters {
            let sge = [side.mr.sge(side.rx_offset(), self.size as u32)];
            side.qp.post_recv(&RecvWr::new(super::RECV_WR, &sge)).context("posting a receive")?;
            side.recvs_posted += 1;
            self.posted += 1;
        }
        Ok(())
    }

    /// Polls once: (receives completed, sends completed). Every receive must carry exactly
    /// `size` bytes; each completed one is replaced while fewer than `iters` were posted.
    fn poll(&mut self, side: &mut Side<SoftDevice>) -> Result<(u64, u64)> {
        let (mut received, mut sent) = (0u64, 0u64);
        let wcs = side.poll().with_context(|| {
            format!(
                "this side's receives hold {} B and a receive failed (a length error means the peer sends larger messages): {SEND_MISMATCH}",
                self.size
            )
        })?;
        for wc in wcs {
            if wc.opcode == WcOpcode::Recv {
                ensure!(
                    wc.byte_len as usize == self.size,
                    "the peer sent a {} B message where this side expects {} B: start both sides with the same -s / -a",
                    wc.byte_len,
                    self.size
                );
                received += 1;
            } else {
                sent += 1;
            }
        }
        for _ in 0..received {
            self.post_one(side)?;
        }
        Ok((received, sent))
    }
}

/// send_lat, both sides (perftest's `run_iter_lat_send`): per size, the receives are posted
/// and a keys exchange tells the peer so; then a ping-pong of SENDs in which the client sends
/// first and the server answers each arrival. Latency is half the interval between this
/// side's consecutive posts, as perftest computes it. Then perftest's close.
fn send_lat(
    side: &mut Side<SoftDevice>,
    oob: &mut Oob,
    ours: &Keys,
    role: Role,
    plan: &[(usize, u64)],
) -> Result<()> {
    outln!("{LAT_HEADER}");
    let max_sends = u64::from(side.qp.caps().max_send_wr.max(1));
    for &(size, iters) in plan {
        let mut recvs = Receives::post(side, size, iters)?;
        oob.exchange_keys(ours)?;
        let mut posted_at = Vec::with_capacity(iters as usize);
        let (mut scnt, mut rcnt, mut arrived) = (0u64, 0u64, 0u64);
        let mut watchdog =
            Watchdog::new("waiting for the peer's SEND (does it run the same -s / -a and -n?)")
                .give_up_early_if(peer_unservable(side));
        let sge = [side.tx(0, size as u32)];
        while scnt < iters || rcnt < iters {
            if rcnt < iters && !(scnt < 1 && role == Role::Client) {
                let mut spins = 0u32;
                while arrived == rcnt {
                    let (received, _) = recvs.poll(side)?;
                    arrived += received;
                    if received == 0 {
                        watchdog.check(&mut spins)?;
                    }
                }
                watchdog.progressed();
                rcnt += 1;
            }
            if scnt < iters {
                // Room in the send queue (the ping-pong keeps at most a few in flight).
                let mut spins = 0u32;
                while side.sends_outstanding >= max_sends {
                    let (received, _) = recvs.poll(side)?;
                    arrived += received;
                    watchdog.check(&mut spins)?;
                }
                posted_at.push(Instant::now());
                scnt += 1;
                side.post_send(&SendWr::new(SEND_WR, SendOp::Send, &sge))?;
            }
        }
        side.drain_sends().with_context(|| format!("{size} B messages: {SEND_MISMATCH}"))?;
        ensure!(
            arrived == iters,
            "{} more SENDs than -n {iters} arrived from the peer: start both sides with the same -n",
            arrived - iters
        );
        let mut samples: Vec<u64> =
            posted_at.windows(2).map(|w| w[1].duration_since(w[0]).as_nanos() as u64).collect();
        if let Some(lat) = LatencySummary::from_nanos(&mut samples, 2) {
            print_lat(size, iters, &lat);
        }
    }
    oob.close(ours)
}

/// send_bw's client (perftest's `run_iter_bw` with SENDs): per size, a keys exchange once the
/// server has posted its receives, `-t` SENDs in flight, this side's report; with `-a` another
/// keys exchange after each size. No report crosses: each side prints its own. Then the close.
fn send_bw_client(
    side: &mut Side<SoftDevice>,
    oob: &mut Oob,
    ours: &Keys,
    args: &Args,
    plan: &[(usize, u64)],
) -> Result<()> {
    outln!("{BW_HEADER}");
    for &(size, iters) in plan {
        oob.exchange_keys(ours)?;
        let sges = [side.tx(0, size as u32)];
        let wr = SendWr::new(SEND_WR, SendOp::Send, &sges);
        let waiting = "waiting for SEND completions (does the peer run the same -s / -a and -n?)";
        let elapsed = super::post_keeping_in_flight(side, &wr, iters, args.tx_depth, waiting, |_| {})
            .with_context(|| format!("sending {size} B messages failed or stalled: {SEND_MISMATCH}"))?;
        print_bw(&bw_report(size, iters, elapsed));
        if args.all {
            oob.exchange_keys(ours)?;
        }
    }
    oob.close(ours)
}

/// send_bw's server (perftest's `run_iter_bw_server`): per size, the receives, a keys
/// exchange, every arrival counted (the time runs from the first to the last), this side's
/// report; with `-a` another keys exchange after each size. Then the close.
fn send_bw_server(
    side: &mut Side<SoftDevice>,
    oob: &mut Oob,
    ours: &Keys,
    all: bool,
    plan: &[(usize, u64)],
) -> Result<()> {
    outln!("{BW_HEADER}");
    for &(size, iters) in plan {
        let mut recvs = Receives::post(side, size, iters)?;
        oob.exchange_keys(ours)?;
        let mut watchdog =
            Watchdog::new("waiting for the peer's SENDs (does it run the same -s / -a and -n?)")
                .give_up_early_if(peer_unservable(side));
        let (mut arrived, mut spins) = (0u64, 0u32);
        let mut first = None;
        while arrived < iters {
            let (received, _) = recvs.poll(side)?;
            if received > 0 {
                first.get_or_insert_with(Instant::now);
                arrived += received;
                watchdog.progressed();
            } else {
                watchdog.check(&mut spins)?;
            }
        }
        let elapsed = first.map(|t| t.elapsed()).unwrap_or_default();
        print_bw(&bw_report(size, iters, elapsed));
        if all {
            oob.exchange_keys(ours)?;
        }
    }
    let qp = side.qp.stats()?;
    oob.close(ours)?;
    if side._device.stats().engine.drops_unsupported > 0 || qp.naks_sent > 0 {
        return Err(anyhow!("the client's test did not run cleanly against this side"));
    }
    Ok(())
}

/// A bandwidth report of `iters` messages of `size` in `elapsed` (no peak: per-completion
/// time stamps are not kept).
fn bw_report(size: usize, iters: u64, elapsed: Duration) -> BwReport {
    let secs = elapsed.as_secs_f64().max(1e-9);
    BwReport {
        size: size as u64,
        iters,
        bw_peak: 0.0,
        bw_avg: (size as u64 * iters) as f64 / secs / f64::from(1u32 << 20),
        msg_rate: iters as f64 / secs / 1e6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_perftests_108_byte_text_and_read_back() {
        let keys = Keys {
            lid: 0,
            out_reads: 0x10,
            qpn: 0x11,
            psn: 0xABCDEF,
            rkey: 0x1234,
            vaddr: 0x5555_0000_1000,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 10, 78, 0, 1],
            srqn: 0,
        };
        let message = keys.emit();
        let text = std::str::from_utf8(&message[..107]).unwrap();
        assert_eq!(
            text,
            "0000:0010:000011:abcdef:00001234:0000555500001000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4e:00:01:00000000:"
        );
        assert_eq!(message[107], 0);
        assert_eq!(Keys::parse(&message).unwrap(), keys);
        assert!(keys.gid_is_v4_mapped());
    }

    #[test]
    fn a_bad_keys_message_is_a_clear_error() {
        let short = [b'0'; 59];
        assert!(Keys::parse(&short).is_err(), "the GID-less form is refused");
        let mut message = Keys::default().emit();
        message[2] = b'x';
        assert!(Keys::parse(&message).unwrap_err().to_string().contains("hexadecimal"));
        let garbage = [0xFFu8; KEYS_LEN];
        assert!(Keys::parse(&garbage).is_err());
    }

    #[test]
    fn mtu_codes_are_ibv_mtu_numbers() {
        for (code, bytes) in [(1, 256), (2, 512), (3, 1024), (4, 2048), (5, 4096)] {
            let mtu = Mtu::from_bytes(bytes).unwrap();
            assert_eq!(mtu_code(mtu), code);
            assert_eq!(mtu_from_code(code), mtu);
        }
    }
}
