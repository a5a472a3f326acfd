//! Cross-process robustness: a peer process that aborts in the middle of a transfer, or
//! scribbles garbage over its shared segment, must not crash or corrupt the survivor. The
//! survivor's queue pair goes to ERR with every request completed (the one in flight with the
//! reason, the rest flushed), the peer's memory is unmapped at once, and after teardown nothing
//! is left: no mappings, no memfds, no sockets, no threads.
//!
//! This binary (`harness = false`) is both the test runner and, when `LIGHTPATH_SHM_CHILD` is
//! set, the peer process the runner spawns. They meet over TCP on loopback and connect their
//! queue pairs with `lightpath_verbs::connect`, exactly as two real processes would.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use lightpath_shm::fault::{self, Fault};
use lightpath_shm::{ShmConfig, ShmDevice, VENDOR_ERR_PEER_CORRUPT, VENDOR_ERR_PEER_GONE};
use lightpath_verbs::connect::{self, ConnectOptions};
use lightpath_verbs::{
    AccessFlags, CompletionQueue, CqOf, Device, Gid, MemoryRegion, MrOf, PdOf, ProtectionDomain, QpCaps,
    QpOf, QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const ROLE: &str = "LIGHTPATH_SHM_CHILD";
const PORT: &str = "LIGHTPATH_SHM_PORT";
const DEADLINE: Duration = Duration::from_secs(30);
const CHUNK: usize = 256 << 10;

/// One side's objects; field order is drop order.
struct End {
    qp: QpOf<ShmDevice>,
    cq: CqOf<ShmDevice>,
    mr: MrOf<ShmDevice>,
    _pd: PdOf<ShmDevice>,
    device: ShmDevice,
}

fn open_end(region: usize) -> End {
    let device = ShmDevice::open(ShmConfig::default()).expect("shm device");
    let pd = device.alloc_pd().expect("pd");
    let cq = device.create_cq(1024).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let mr = pd.alloc_mr(region, AccessFlags::ALL).expect("mr");
    End { qp, cq, mr, _pd: pd, device }
}

fn options(mr: &MrOf<ShmDevice>) -> ConnectOptions {
    ConnectOptions { regions: vec![mr.remote()], ..ConnectOptions::default() }
}

fn wait_n(cq: &CqOf<ShmDevice>, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::new();
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 16];
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "expected {n} completions, got {}: {got:?}", got.len());
        let count = cq.wait(&mut buf[..(n - got.len()).min(16)], left).expect("wait");
        got.extend_from_slice(&buf[..count]);
    }
    got
}

fn read_line(reader: &mut impl BufRead) -> String {
    let mut line = String::new();
    reader.read_line(&mut line).expect("control line");
    line.trim().to_string()
}

/// The control lines after the exchange go through the same buffered reader as the exchange
/// itself, so nothing it read ahead is lost.
fn control_channel(stream: TcpStream) -> (BufReader<TcpStream>, TcpStream) {
    stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
    stream.set_nodelay(true).expect("nodelay");
    (BufReader::new(stream.try_clone().expect("clone")), stream)
}

fn send_sge(end: &End, offset: usize, len: u32) -> [lightpath_verbs::Sge; 1] {
    [end.mr.sge(offset, len)]
}

// ---------------------------------------------------------------------------------------
// The peer process.

fn child(role: &str) {
    let port: u16 = std::env::var(PORT).expect("port").parse().expect("port number");
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the runner");
    let end = open_end(CHUNK);
    let (mut reader, mut writer) = control_channel(stream);
    connect::exchange_over(&mut reader, &mut writer, &end.qp, &options(&end.mr)).expect("exchange");
    assert_eq!(read_line(&mut reader), "go");
    match role {
        "abort" => {
            // Stream 256 KiB SENDs at the runner; once two have been received in full, die
            // with the rest in the ring and in the send queue.
            let sge = send_sge(&end, 0, CHUNK as u32);
            for i in 0..32 {
                end.qp.post_send(&SendWr::new(i, SendOp::Send, &sge)).expect("post send");
            }
            let done = wait_n(&end.cq, 2);
            assert!(done.iter().all(|wc| wc.status == WcStatus::Success), "{done:?}");
            std::process::abort();
        }
        "exit" => {
            let sge = send_sge(&end, 0, 1000);
            end.qp.post_send(&SendWr::new(1, SendOp::Send, &sge)).expect("post send");
            assert_eq!(wait_n(&end.cq, 1)[0].status, WcStatus::Success);
        }
        scribble => {
            let name = scribble.strip_prefix("scribble:").expect("role");
            let fault = match name {
                "forged-descriptor" => Fault::ForgedDescriptor { rkey: end.mr.rkey() },
                other => fault_named(other),
            };
            fault::inject(&end.qp, fault).expect("inject");
            writeln!(writer, "done").expect("report");
            // Stay alive until the runner has checked that it survived the garbage.
            let _ = read_line(&mut reader);
        }
    }
}

const FAULTS: [(&str, Fault); 8] = [
    ("ring-garbage", Fault::RingGarbage { seed: 0x5EED_1234 }),
    ("oversized-record", Fault::OversizedRecord),
    ("unknown-kind", Fault::UnknownKind),
    ("wrong-sequence", Fault::WrongSequence),
    ("acked-beyond-sent", Fault::AckedBeyondSent),
    ("bad-nak", Fault::BadNak),
    ("head-garbage", Fault::HeadGarbage),
    ("status-garbage", Fault::StatusGarbage),
];

fn fault_named(name: &str) -> Fault {
    FAULTS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f).unwrap_or_else(|| panic!("unknown fault {name}"))
}

// ---------------------------------------------------------------------------------------
// What a process holds of the shm provider, from /proc.

#[derive(Debug, PartialEq, Eq)]
struct Holdings {
    /// Mappings of queue-pair segments (ours and peers').
    segments: usize,
    /// Mappings of memory regions (ours and peers').
    regions: usize,
    /// Open memfds of the provider.
    memfds: usize,
    /// Helper threads.
    threads: usize,
}

fn holdings() -> Holdings {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let count = |name: &str| maps.lines().filter(|line| line.contains(name)).count();
    let memfds = std::fs::read_dir("/proc/self/fd")
        .expect("fds")
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("memfd:lightpath-shm"))
        .count();
    let threads = std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("lpshm-"))
        .count();
    Holdings {
        segments: count("memfd:lightpath-shm-qp"),
        regions: count("memfd:lightpath-shm-mr"),
        memfds,
        threads,
    }
}

/// Whether the abstract socket of the device with `gid` still exists anywhere on the host.
fn rendezvous_exists(gid: Gid) -> bool {
    let name = String::from_utf8(lightpath_shm::address::rendezvous_name(gid)).expect("ascii");
    std::fs::read_to_string("/proc/net/unix").expect("unix sockets").contains(&format!("@{name}"))
}

// ---------------------------------------------------------------------------------------
// The runner's scenarios.

struct Peer {
    child: Child,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    region: lightpath_verbs::RemoteRegion,
    gid: Gid,
}

/// Spawns this binary as a peer with `role` and connects `end`'s queue pair with it.
fn spawn_peer(role: &str, end: &End) -> Peer {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let child = Command::new(std::env::current_exe().expect("this binary"))
        .env(ROLE, role)
        .env(PORT, port.to_string())
        .spawn()
        .expect("spawn the peer");
    let (stream, _) = listener.accept().expect("the peer connects");
    let (mut reader, mut writer) = control_channel(stream);
    let connection =
        connect::exchange_over(&mut reader, &mut writer, &end.qp, &options(&end.mr)).expect("exchange");
    let region = connection.peer.regions[0];
    Peer { child, reader, writer, region, gid: connection.peer.gid }
}

/// Polls until every one of `expected` completions arrived, then checks the queue pair is in
/// ERR and that nothing more arrives.
fn collect(end: &End, expected: usize) -> Vec<WorkCompletion> {
    let wcs = wait_n(&end.cq, expected);
    assert_eq!(end.qp.state().expect("state"), QpState::Err);
    let mut spare = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
    assert_eq!(end.cq.poll(&mut spare).expect("poll"), 0, "extra completions: {:?}", &spare);
    wcs
}

fn peer_abort_mid_transfer() {
    let before = holdings();
    let (own_gid, child_gid) = {
        let end = open_end(8 * CHUNK);
        let mut peer = spawn_peer("abort", &end);
        // A WRITE into the peer's region maps it here.
        end.mr.write(0, b"written before the crash").expect("fill");
        let write = SendOp::Write { remote_addr: peer.region.addr, rkey: peer.region.rkey };
        end.qp.post_send(&SendWr::new(7, write, &send_sge(&end, 0, 24))).expect("write");
        assert_eq!(wait_n(&end.cq, 1)[0].status, WcStatus::Success);
        for i in 0..8 {
            let sge = send_sge(&end, i * CHUNK, CHUNK as u32);
            end.qp.post_recv(&RecvWr::new(i as u64, &sge)).expect("post recv");
        }
        // The peer posts no receives: these wait (RNR, retried forever) until it dies.
        for i in 0..3 {
            end.qp.post_send(&SendWr::new(100 + i, SendOp::Send, &send_sge(&end, 0, 4096))).expect("send");
        }
        let connected = holdings();
        assert_eq!(connected.segments, 2, "ours and the peer's segment: {connected:?}");
        assert_eq!(connected.regions, before.regions + 2, "ours and the peer's region: {connected:?}");
        writeln!(peer.writer, "go").expect("go");

        let wcs = collect(&end, 11);
        let (recvs, sends): (Vec<&WorkCompletion>, Vec<&WorkCompletion>) =
            wcs.iter().partition(|wc| wc.opcode == WcOpcode::Recv);
        let received = recvs.iter().take_while(|wc| wc.status == WcStatus::Success).count();
        assert!(received >= 2, "the peer saw two receives complete before aborting: {recvs:?}");
        for (i, wc) in recvs.iter().enumerate() {
            assert_eq!(wc.wr_id, i as u64, "receives complete in order: {recvs:?}");
            if i >= received {
                assert_eq!(
                    (wc.status, wc.vendor_err),
                    (WcStatus::WrFlushErr, VENDOR_ERR_PEER_GONE),
                    "{wc:?}"
                );
            } else {
                assert_eq!(wc.byte_len as usize, CHUNK);
            }
        }
        let statuses: Vec<_> = sends.iter().map(|wc| (wc.wr_id, wc.status, wc.vendor_err)).collect();
        assert_eq!(
            statuses,
            vec![
                (100, WcStatus::RetryExcErr, VENDOR_ERR_PEER_GONE),
                (101, WcStatus::WrFlushErr, VENDOR_ERR_PEER_GONE),
                (102, WcStatus::WrFlushErr, VENDOR_ERR_PEER_GONE),
            ]
        );
        let status = peer.child.wait().expect("reap the peer");
        assert_eq!(status.signal(), Some(6), "the peer was meant to abort: {status:?}");
        // The dead peer's memory was let go at once, and our own segment with it.
        let failed = holdings();
        assert_eq!((failed.segments, failed.regions), (0, before.regions + 1), "{failed:?}");
        // Later requests are flushed, and the device still works for others.
        end.qp.post_send(&SendWr::new(200, SendOp::Send, &send_sge(&end, 0, 8))).expect("post in ERR");
        assert_eq!(wait_n(&end.cq, 1)[0].status, WcStatus::WrFlushErr);
        assert_eq!(end.device.qp_count(), 1);
        (end.device.gid(), peer.gid)
    };
    assert_eq!(holdings(), before, "leftovers after teardown");
    assert!(
        !rendezvous_exists(own_gid) && !rendezvous_exists(child_gid),
        "a rendezvous socket outlived its device"
    );
}

fn peer_exits_normally() {
    let before = holdings();
    let child_gid = {
        let end = open_end(CHUNK);
        let mut peer = spawn_peer("exit", &end);
        end.qp.post_recv(&RecvWr::new(1, &send_sge(&end, 0, CHUNK as u32))).expect("recv");
        end.qp.post_recv(&RecvWr::new(2, &send_sge(&end, 0, CHUNK as u32))).expect("recv");
        writeln!(peer.writer, "go").expect("go");
        let status = peer.child.wait().expect("reap");
        assert!(status.success(), "{status:?}");
        let wcs = collect(&end, 2);
        assert_eq!((wcs[0].wr_id, wcs[0].status, wcs[0].byte_len), (1, WcStatus::Success, 1000));
        assert_eq!(
            (wcs[1].wr_id, wcs[1].status, wcs[1].vendor_err),
            (2, WcStatus::WrFlushErr, VENDOR_ERR_PEER_GONE)
        );
        peer.gid
    };
    assert_eq!(holdings(), before, "leftovers after teardown");
    assert!(!rendezvous_exists(child_gid));
}

fn peer_scribbles(name: &str, fault: Fault) {
    let before = holdings();
    {
        let end = open_end(64 * CHUNK);
        let mut peer = spawn_peer(&format!("scribble:{name}"), &end);
        end.qp.post_recv(&RecvWr::new(1, &send_sge(&end, 0, 65536))).expect("recv");
        end.qp.post_recv(&RecvWr::new(2, &send_sge(&end, 0, 65536))).expect("recv");
        // Outstanding until the peer posts a receive (it never does): the survivor keeps
        // reading the peer's status line for it.
        end.qp.post_send(&SendWr::new(10, SendOp::Send, &send_sge(&end, 0, 1024))).expect("send");
        writeln!(peer.writer, "go").expect("go");
        assert_eq!(read_line(&mut peer.reader), "done");
        let mut posted = 3;
        if fault == Fault::HeadGarbage {
            // The peer's position is read back only once our ring looks full: 80 SENDs of 16
            // KiB (small enough to travel through the ring) fill its 1 MiB.
            for i in 0..80 {
                let sge = send_sge(&end, (i % 64) * CHUNK, 16 << 10);
                end.qp.post_send(&SendWr::new(11 + i as u64, SendOp::Send, &sge)).expect("post_send");
                posted += 1;
            }
        }
        let wcs = collect(&end, posted);
        let send_statuses: Vec<_> =
            wcs.iter().filter(|wc| wc.opcode == WcOpcode::Send).map(|wc| wc.status).collect();
        assert_eq!(send_statuses[0], WcStatus::BadRespErr, "{name}: {wcs:?}");
        assert!(send_statuses[1..].iter().all(|s| *s == WcStatus::WrFlushErr), "{name}: {wcs:?}");
        for wc in &wcs {
            assert_eq!(wc.vendor_err, VENDOR_ERR_PEER_CORRUPT, "{name}: {wc:?}");
            if wc.opcode == WcOpcode::Recv {
                assert_eq!(wc.status, WcStatus::WrFlushErr, "{name}: {wc:?}");
            }
        }
        assert_eq!(holdings().segments, 0, "{name}: the peer's segment is still mapped");
        writeln!(peer.writer, "bye").expect("bye");
        let status = peer.child.wait().expect("reap");
        assert!(status.success(), "{name}: the scribbling peer failed: {status:?}");
    }
    assert_eq!(holdings(), before, "{name}: leftovers after teardown");
}

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        child(&role);
        return ExitCode::SUCCESS;
    }
    let mut scenarios: Vec<(String, Box<dyn Fn()>)> = vec![
        ("peer_abort_mid_transfer".into(), Box::new(peer_abort_mid_transfer)),
        ("peer_exits_normally".into(), Box::new(peer_exits_normally)),
    ];
    scenarios.push((
        "peer_scribbles_forged_descriptor".into(),
        Box::new(|| peer_scribbles("forged-descriptor", Fault::ForgedDescriptor { rkey: 0 })),
    ));
    for (name, fault) in FAULTS {
        scenarios.push((
            format!("peer_scribbles_{}", name.replace('-', "_")),
            Box::new(move || peer_scribbles(name, fault)),
        ));
    }
    let filter = std::env::args().skip(1).find(|arg| !arg.starts_with('-'));
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, scenario) in &scenarios {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(scenario));
        println!("test {name} ... {}", if outcome.is_ok() { "ok" } else { "FAILED" });
        if outcome.is_err() {
            failed.push(name.clone());
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed",
        if failed.is_empty() { "ok" } else { "FAILED" },
        ran - failed.len(),
        failed.len()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
