//! `lightpath demo`: the README's first command. On one machine with nothing installed, it
//! starts two soft RoCE v2 endpoints on loopback (127.0.0.1 and 127.0.0.2), performs every RDMA
//! operation between them with verified data, shows `lightpath::Stream` choosing its transport
//! (see `demo_streams`), then measures the soft provider side by side with kernel TCP (latency
//! at 8 B and 4 KiB, bandwidth at 64 KiB and 1 MiB), and last the streams as applications get
//! them — default options, server and client as two processes of this binary — over shm and
//! soft against the same API over kernel TCP.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use lightpath_soft::{SoftConfig, SoftDevice};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, Device, MemoryRegion, Mtu, ProtectionDomain, QpAttr, QpCaps,
    QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

use crate::perf::{self, PerfTest, ProviderKind, SizeResult};

/// Options of `lightpath demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only run the operations, skip the measurements.
    #[arg(long)]
    pub no_bench: bool,
    /// Iterations of each latency measurement.
    #[arg(long, default_value_t = 2000)]
    pub lat_iters: u64,
    /// Iterations of each bandwidth measurement (scaled down for 1 MiB).
    #[arg(long, default_value_t = 2000)]
    pub bw_iters: u64,
}

/// Runs the demo.
pub fn run(args: Args) -> Result<ExitCode> {
    outln!("Lightpath demo: two soft RoCE v2 endpoints on loopback\n");
    let port = operations().context("the operations demo failed")?;
    outln!("\nStreams (lightpath::Stream, the socket-like API): negotiated over a TCP connection, then");
    outln!("RDMA where both sides can — shared memory between processes of one host:\n");
    crate::demo_streams::run()?;
    if args.no_bench {
        return Ok(ExitCode::SUCCESS);
    }
    outln!("\nSide by side with kernel TCP on loopback (one run; both measured now, on this machine):\n");
    benchmarks(&args, port)?;
    outln!(
        "\nStreams with default options (lightpath::Stream as applications use it; server and client\n\
         are two processes) against the same API over kernel TCP:\n"
    );
    stream_benchmarks(&args)?;
    Ok(ExitCode::SUCCESS)
}

const A_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const B_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Opens the two devices on one UDP port: the RoCE port if it is free on both addresses, else
/// an ephemeral one (every soft peer must use the same port).
fn open_pair() -> Result<(SoftDevice, SoftDevice)> {
    let open = |ip: Ipv4Addr, port: u16| {
        SoftDevice::open(SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(ip), port)))
    };
    if let (Ok(a), Ok(b)) = (open(A_IP, 4791), open(B_IP, 4791)) {
        return Ok((a, b));
    }
    for _ in 0..10 {
        let a = open(A_IP, 0)?;
        if let Ok(b) = open(B_IP, a.local_addr().port()) {
            return Ok((a, b));
        }
    }
    bail!("could not find a UDP port free on both 127.0.0.1 and 127.0.0.2")
}

/// Polls `cq` until one completion arrives (or 5 s pass).
fn next_completion<C: CompletionQueue>(cq: &C) -> Result<WorkCompletion> {
    let mut wc = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0)];
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if cq.wait(&mut wc, Duration::from_millis(100))? == 1 {
            return Ok(wc[0]);
        }
    }
    bail!("no completion within 5 s")
}

fn expect_ok(wc: WorkCompletion, opcode: WcOpcode) -> Result<WorkCompletion> {
    ensure!(wc.status == WcStatus::Success, "{:?} completed with {}", wc.opcode, wc.status);
    ensure!(wc.opcode == opcode, "expected a {opcode:?} completion, got {:?}", wc.opcode);
    Ok(wc)
}

fn step(name: &str, detail: String) {
    outln!("  [ok] {name:<22} {detail}");
}

/// Performs each operation between the two endpoints and checks the bytes. Returns the UDP port
/// that was free, for the measurements.
fn operations() -> Result<u16> {
    let (dev_a, dev_b) = open_pair()?;
    let port = dev_a.local_addr().port();
    outln!("  endpoint A: {} (GID {})", dev_a.local_addr(), dev_a.gid());
    outln!("  endpoint B: {} (GID {})\n", dev_b.local_addr(), dev_b.gid());
    let access = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    let (pd_a, pd_b) = (dev_a.alloc_pd()?, dev_b.alloc_pd()?);
    let (cq_a, cq_b) = (dev_a.create_cq(64)?, dev_b.create_cq(64)?);
    const LEN: usize = 2 << 20;
    let (mr_a, mr_b) = (pd_a.alloc_mr(LEN, access)?, pd_b.alloc_mr(LEN, access)?);
    let (qp_a, qp_b) =
        (pd_a.create_qp(&cq_a, &cq_a, QpCaps::default())?, pd_b.create_qp(&cq_b, &cq_b, QpCaps::default())?);
    let (psn_a, psn_b) = (0x00_1234, 0xFF_FFF0);
    for (qp, peer, rq_psn, sq_psn) in [(&qp_a, &qp_b, psn_b, psn_a), (&qp_b, &qp_a, psn_a, psn_b)] {
        qp.modify(&QpAttr::to_init(access))?;
        let av = AddressVector::new(peer.endpoint().gid, 0);
        qp.modify(&QpAttr::to_rtr(av, Mtu::Mtu1024, peer.qpn(), rq_psn))?;
        qp.modify(&QpAttr::to_rts(sq_psn))?;
    }
    step("connect", format!("QP {:#x} <-> QP {:#x}, path MTU 1024, RTS", qp_a.qpn(), qp_b.qpn()));

    // SEND: B posts a receive, A sends a greeting.
    let greeting = b"hello over RoCE v2, from Lightpath";
    qp_b.post_recv(&RecvWr::new(1, &[mr_b.sge(0, 4096)]))?;
    mr_a.write(0, greeting)?;
    qp_a.post_send(&SendWr::new(2, SendOp::Send, &[mr_a.sge(0, greeting.len() as u32)]))?;
    expect_ok(next_completion(&cq_a)?, WcOpcode::Send)?;
    let wc = expect_ok(next_completion(&cq_b)?, WcOpcode::Recv)?;
    let mut got = vec![0u8; wc.byte_len as usize];
    mr_b.read(0, &mut got)?;
    ensure!(got == greeting, "SEND delivered different bytes");
    step("SEND", format!("{} bytes: {:?}", got.len(), String::from_utf8_lossy(&got)));

    // RDMA WRITE with immediate: 256 KiB into B's region, B gets the immediate.
    let block: Vec<u8> = (0..256 * 1024).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    mr_a.write(0, &block)?;
    qp_b.post_recv(&RecvWr::new(3, &[]))?;
    let imm = 0xC0FF_EE00u32;
    let op = SendOp::WriteWithImm { remote_addr: mr_b.addr() + 4096, rkey: mr_b.rkey(), imm };
    qp_a.post_send(&SendWr::new(4, op, &[mr_a.sge(0, block.len() as u32)]))?;
    expect_ok(next_completion(&cq_a)?, WcOpcode::RdmaWrite)?;
    let wc = expect_ok(next_completion(&cq_b)?, WcOpcode::RecvRdmaWithImm)?;
    ensure!(wc.imm_data == Some(imm), "immediate data {:?} instead of {imm:#x}", wc.imm_data);
    let mut landed = vec![0u8; block.len()];
    mr_b.read(4096, &mut landed)?;
    ensure!(landed == block, "RDMA WRITE delivered different bytes");
    step(
        "RDMA WRITE with imm",
        format!(
            "{} KiB, immediate {imm:#010x}, CRC-32 {:08x} matches",
            block.len() / 1024,
            crc32fast::hash(&landed)
        ),
    );

    // RDMA READ: A reads 1 MiB that B prepared.
    let source: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    mr_b.write(LEN / 2, &source)?;
    let op = SendOp::Read { remote_addr: mr_b.addr() + (LEN / 2) as u64, rkey: mr_b.rkey() };
    qp_a.post_send(&SendWr::new(5, op, &[mr_a.sge(LEN / 2, source.len() as u32)]))?;
    let wc = expect_ok(next_completion(&cq_a)?, WcOpcode::RdmaRead)?;
    let mut read_back = vec![0u8; source.len()];
    mr_a.read(LEN / 2, &mut read_back)?;
    ensure!(read_back == source, "RDMA READ returned different bytes");
    step(
        "RDMA READ",
        format!(
            "{} KiB in {} packets, CRC-32 {:08x} matches",
            wc.byte_len / 1024,
            source.len() / 1024,
            crc32fast::hash(&read_back)
        ),
    );

    // Atomics on a counter in B's region.
    let counter = 8192usize;
    mr_b.write_u64(counter, 40)?;
    let op = SendOp::CompareSwap {
        remote_addr: mr_b.addr() + counter as u64,
        rkey: mr_b.rkey(),
        compare: 40,
        swap: 42,
    };
    qp_a.post_send(&SendWr::new(6, op, &[mr_a.sge(0, 8)]))?;
    expect_ok(next_completion(&cq_a)?, WcOpcode::CompSwap)?;
    let (old, now) = (mr_a.read_u64(0)?, mr_b.read_u64(counter)?);
    ensure!(old == 40 && now == 42, "compare-and-swap: old {old}, now {now}");
    step("ATOMIC CMP_SWAP", format!("compare 40, swap 42: returned {old}, memory now {now}"));
    let op = SendOp::FetchAdd { remote_addr: mr_b.addr() + counter as u64, rkey: mr_b.rkey(), add: 8 };
    qp_a.post_send(&SendWr::new(7, op, &[mr_a.sge(0, 8)]))?;
    expect_ok(next_completion(&cq_a)?, WcOpcode::FetchAdd)?;
    let (old, now) = (mr_a.read_u64(0)?, mr_b.read_u64(counter)?);
    ensure!(old == 42 && now == 50, "fetch-and-add: old {old}, now {now}");
    step("ATOMIC FETCH_ADD", format!("add 8: returned {old}, memory now {now}"));

    // A protection check: a WRITE with a wrong rkey is refused by B and touches nothing.
    let before = mr_b.read_u64(counter)?;
    mr_a.write(0, &u64::MAX.to_ne_bytes())?;
    let op = SendOp::Write { remote_addr: mr_b.addr() + counter as u64, rkey: mr_b.rkey() ^ 0x5a5a };
    qp_a.post_send(&SendWr::new(8, op, &[mr_a.sge(0, 8)]))?;
    let wc = next_completion(&cq_a)?;
    ensure!(wc.status == WcStatus::RemAccessErr, "a bad rkey completed with {}", wc.status);
    ensure!(mr_b.read_u64(counter)? == before, "a refused WRITE changed memory");
    step("bad rkey refused", format!("completion: {}; target memory unchanged", wc.status));
    Ok(port)
}

/// One row of the comparison: the soft provider and TCP for one test and size.
fn compare(test: PerfTest, size: usize, iters: u64, port: u16) -> Result<(SizeResult, SizeResult)> {
    let plan = [(size, iters)];
    let soft = perf::run_in_process(ProviderKind::Soft, test, &plan, port)?;
    let tcp = perf::run_in_process(ProviderKind::Tcp, test, &plan, port)?;
    match (soft.into_iter().next(), tcp.into_iter().next()) {
        (Some(soft), Some(tcp)) => Ok((soft, tcp)),
        _ => bail!("{test} produced no result"),
    }
}

fn human_size(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn benchmarks(args: &Args, port: u16) -> Result<()> {
    outln!("  {:<28} {:>12} {:>12} {:>12}", "measurement", "soft", "kernel TCP", "soft/TCP");
    for size in [8usize, 4096] {
        let (soft, tcp) = compare(PerfTest::SendLat, size, args.lat_iters, port)?;
        let (s, t) = (soft.lat_us.map_or(0.0, |l| l.median), tcp.lat_us.map_or(0.0, |l| l.median));
        outln!(
            "  {:<28} {:>9.2} us {:>9.2} us {:>11.2}x",
            format!("send_lat {} (median)", human_size(size)),
            s,
            t,
            s / t
        );
    }
    for size in [64 << 10, 1 << 20] {
        let iters = if size >= 1 << 20 { (args.bw_iters / 16).max(16) } else { args.bw_iters };
        let (soft, tcp) = compare(PerfTest::WriteBw, size, iters, port)?;
        let (s, t) = (soft.bw_mb_s.unwrap_or(0.0), tcp.bw_mb_s.unwrap_or(0.0));
        outln!(
            "  {:<28} {:>7.0} MB/s {:>7.0} MB/s {:>11.2}x",
            format!("write_bw {}", human_size(size)),
            s,
            t,
            s / t
        );
    }
    outln!(
        "
  Latency is one-way (round trip / 2); for latency lower is better, for bandwidth higher."
    );
    outln!("  Every payload was verified. Full runs: `lightpath perf TEST` (server) + `lightpath perf TEST 127.0.0.1`.");
    Ok(())
}

/// Runs one stream test as two processes of this binary (`lightpath perf TEST`, default
/// options) and returns the client's JSON result.
fn stream_run(
    test: &str,
    provider: &str,
    size: usize,
    iters: u64,
    extra: &[&str],
) -> Result<serde_json::Value> {
    let exe = std::env::current_exe().context("cannot find this program's binary")?;
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port().to_string();
    let server = Command::new(&exe)
        .args(["perf", test, "--provider", provider, "-p", &port, "--bind", "127.0.0.1"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start the perf server")?;
    let client = Command::new(&exe)
        .args(["perf", test, "127.0.0.1", "--provider", provider, "-p", &port, "--json"])
        .args(["-s", &size.to_string(), "-n", &iters.to_string()])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .context("cannot run the perf client")?;
    let mut server = server;
    if !client.status.success() {
        let _ = server.kill();
    }
    let server = server.wait_with_output()?;
    ensure!(
        client.status.success(),
        "{test} over {provider} failed: {}{}",
        String::from_utf8_lossy(&client.stderr),
        String::from_utf8_lossy(&server.stderr)
    );
    let line = String::from_utf8_lossy(&client.stdout);
    let first = line.lines().next().with_context(|| format!("{test} over {provider} printed no result"))?;
    serde_json::from_str(first).with_context(|| format!("{test} over {provider}: not JSON: {first}"))
}

fn stream_benchmarks(args: &Args) -> Result<()> {
    const PROVIDERS: [&str; 3] = ["shm", "soft", "tcp"];
    outln!(
        "  {:<28} {:>12} {:>12} {:>12} {:>9} {:>9}",
        "measurement",
        "shm",
        "soft",
        "kernel TCP",
        "shm/TCP",
        "soft/TCP"
    );
    let bw_iters = |size: u64| if size >= 1 << 20 { (args.bw_iters / 16).max(16) } else { args.bw_iters };
    let rows: [(&str, &str, u64, u64, &[&str]); 4] = [
        ("stream_lat 8 B (median)", "stream_lat", 8, args.lat_iters, &[]),
        ("stream_bw 64 KiB", "stream_bw", 64 << 10, bw_iters(64 << 10), &[]),
        ("stream_bw 1 MiB", "stream_bw", 1 << 20, bw_iters(1 << 20), &[]),
        ("stream_rr 64 B, 16 conns", "stream_rr", 64, (args.lat_iters / 10).max(20), &["--conns", "16"]),
    ];
    for (name, test, size, iters, extra) in rows {
        let mut values = Vec::new();
        for provider in PROVIDERS {
            let r = stream_run(test, provider, size as usize, iters, extra)?;
            let value = match test {
                "stream_lat" => r["lat_us"]["median"].as_f64(),
                "stream_rr" => r["msg_rate_mpps"].as_f64().map(|m| m * 1e3),
                _ => r["bw_mb_s"].as_f64(),
            };
            values.push(value.with_context(|| format!("{test} over {provider}: no value in {r}"))?);
        }
        let cell = |v: f64| match test {
            "stream_lat" => format!("{v:.2} us"),
            "stream_rr" => format!("{v:.1} kreq/s"),
            _ => format!("{v:.0} MB/s"),
        };
        outln!(
            "  {:<28} {:>12} {:>12} {:>12} {:>8.2}x {:>8.2}x",
            name,
            cell(values[0]),
            cell(values[1]),
            cell(values[2]),
            values[0] / values[2],
            values[1] / values[2]
        );
    }
    outln!(
        "\n  Defaults: no busy-polling (soft's progress thread; a short spin, then sleep), a thread per\n  \
         connection on the server. More rows, CPU cost and two namespaces: scripts/compare.sh."
    );
    Ok(())
}
