//! `lightpath perf stream_lat|stream_bw|stream_rr [SERVER]`: the stream layer's own numbers,
//! measured through `lightpath::Stream` exactly as applications use it, over the soft or shm
//! provider, or over plain kernel TCP sockets (`--provider tcp`: `std`'s and tokio's
//! `TcpStream`, the baseline every ratio is taken against), or over Lightpath's own TCP
//! fallback (`--provider fallback`); see [`conn`].
//!
//! | test | pattern | reported |
//! |---|---|---|
//! | stream_lat | `size` bytes each way, one at a time | one-way latency (round trip / 2) |
//! | stream_bw | `iters` writes of `size` bytes; the server answers the CRC-32 of the last one | MB/s |
//! | stream_rr | `--conns` connections, each `iters` requests of `size` bytes echoed back | transactions/s, round-trip latency |
//!
//! The server (no SERVER argument) listens on `-p` with a Lightpath listener and serves one
//! client run (for stream_rr, all its connections), in one of two shapes (`--server`): a
//! thread per connection (`threads`, the default) or one event loop (`loop`: a tokio
//! current-thread runtime serving every connection through `lightpath::tokio` streams); see
//! [`server`]. Each connection opens with one message holding the plan as JSON, which the
//! server answers with its shape. The options and the JSON lines are those of the verbs-level
//! tests, plus `conns`, `transport` (what the connection really got), `server` (its shape),
//! `polling`, and both processes' CPU time over the measured iterations (`cpu_s`,
//! `server_cpu_s`, `cpu_us_per_op` or `cpu_s_per_gb`; see [`super::cpu`]): before and after
//! them the client asks the server for a reading, over the first connection.
//!
//! This subcommand is parsed before the verbs-level `perf` (see `wants`), so the verbs tests'
//! enum stays untouched.

use std::ffi::OsString;
use std::net::IpAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use lightpath::{Options, Stream};
use lightpath_soft::ProgressMode;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use self::conn::{is_kernel_tcp, AsyncConn, Conn, KernelTcp};
use super::cpu::{self, CpuUse};
use super::stats::{BandwidthSummary, LatencySummary};

#[path = "stream_conn.rs"]
mod conn;
#[path = "stream_server.rs"]
pub mod server;
#[path = "stream_zero_copy.rs"]
mod zero_copy;

/// The shape of the server (`--server`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerShape {
    /// A thread per connection, blocking calls.
    Threads,
    /// One event loop: a tokio current-thread runtime, a task per connection.
    Loop,
}

impl ServerShape {
    fn name(self) -> &'static str {
        match self {
            ServerShape::Threads => "threads",
            ServerShape::Loop => "loop",
        }
    }
}

/// The stream-layer tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum StreamTest {
    /// Ping-pong of `size` bytes; one-way latency.
    #[value(name = "stream_lat")]
    #[serde(rename = "stream_lat")]
    Lat,
    /// Streamed writes of `size` bytes; bandwidth.
    #[value(name = "stream_bw")]
    #[serde(rename = "stream_bw")]
    Bw,
    /// Request/response over many connections at once.
    #[value(name = "stream_rr")]
    #[serde(rename = "stream_rr")]
    Rr,
}

impl StreamTest {
    fn name(self) -> &'static str {
        match self {
            StreamTest::Lat => "stream_lat",
            StreamTest::Bw => "stream_bw",
            StreamTest::Rr => "stream_rr",
        }
    }
}

/// Options of `lightpath perf stream_*`.
#[derive(Debug, Parser)]
#[command(name = "lightpath perf", about = "Stream-layer latency, bandwidth and request/response tests")]
pub struct StreamArgs {
    /// The test to run.
    #[arg(value_enum)]
    pub test: StreamTest,
    /// Server to connect to. Without it, this process is the server.
    pub server: Option<String>,
    /// Data transport: soft (RDMA over the soft provider), shm (shared memory, both processes
    /// on this host), ibverbs, or a comma-separated list of them (best first); tcp (plain
    /// kernel TCP sockets, no Lightpath: the baseline); fallback (Lightpath streams forced onto
    /// their TCP fallback). Server and client must name the same.
    #[arg(long, default_value = "soft")]
    pub provider: String,
    /// Message size in bytes, suffixes allowed (64K, 1M; default 8 for latency and rr, 65536
    /// for bandwidth).
    #[arg(short = 's', long, value_parser = crate::size::parse_usize)]
    pub size: Option<usize>,
    /// Iterations per size (default 1000 for latency and rr, 5000 for bandwidth).
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u64>,
    /// Local address to listen on (server).
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// Port of the Lightpath listener.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// Every size from 2 bytes to 8 MiB (powers of two).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Connections (stream_rr).
    #[arg(long, default_value_t = 16)]
    pub conns: usize,
    /// Server shape: a thread per connection (`threads`, default) or one tokio event loop
    /// (`loop`). On a client: the shape to expect (the run fails if the server has another).
    #[arg(long = "server", value_enum, value_name = "SHAPE")]
    pub shape: Option<ServerShape>,
    /// Drive the soft device from the calling threads and busy-poll (as the verbs tests do)
    /// instead of sleeping until the progress thread wakes them.
    #[arg(long)]
    pub polling: bool,
    /// How long a blocked call busy-polls before it sleeps, in µs (default: the library's).
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Bytes of each connection's receive ring, over every provider (default: the library's,
    /// `Options::ring_size` and `Options::soft_ring_size`). Each side uses its own. Suffixes
    /// allowed (256K, 4M).
    #[arg(long, value_parser = crate::size::parse_u32)]
    pub ring_size: Option<u32>,
    /// Print one JSON object per size instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Zero-copy on both sides (stream_lat, stream_bw): write_buf from and read_buf into
    /// registered buffers, so sizes from the rendezvous threshold up are fetched by RDMA READ.
    #[arg(long)]
    pub zero_copy: bool,
    /// Rendezvous threshold in bytes for this side's zero-copy writes (default: the library's).
    /// Suffixes allowed (64K).
    #[arg(long, value_parser = crate::size::parse_usize)]
    pub rendezvous_min: Option<usize>,
}

/// Whether the command line asks for a stream test (`lightpath perf stream_…`).
pub fn wants(args: &[OsString]) -> bool {
    args.get(1).is_some_and(|a| a == "perf")
        && args
            .iter()
            .skip(2)
            .find(|a| !a.to_string_lossy().starts_with('-'))
            .is_some_and(|a| a.to_string_lossy().starts_with("stream_"))
}

/// Parses and runs `lightpath perf stream_…` from the full argument list.
pub fn run_from(args: Vec<OsString>) -> Result<ExitCode> {
    let args = StreamArgs::try_parse_from(args.into_iter().skip(1)).unwrap_or_else(|err| err.exit());
    diagnose_if_still_running();
    run(&args)
}

/// With `LIGHTPATH_PERF_DIAGNOSE_AFTER=SECONDS`, a process still running after that long
/// prints Lightpath's completion-queue state to stderr (`lightpath::diagnostics`), so a stall
/// (a lost wake-up) leaves its evidence behind. A plain thread that sleeps: no timer joins the
/// runtime being diagnosed.
fn diagnose_if_still_running() {
    let Some(after) = std::env::var("LIGHTPATH_PERF_DIAGNOSE_AFTER").ok().and_then(|s| s.parse::<f64>().ok())
    else {
        return;
    };
    let Ok(after) = Duration::try_from_secs_f64(after) else { return };
    lightpath::enable_diagnostics();
    let _ = std::thread::Builder::new().name("perf-diagnose".into()).spawn(move || {
        std::thread::sleep(after);
        eprintln!(
            "lightpath perf: still running after {:.0} s; Lightpath's state:\n{}",
            after.as_secs_f64(),
            lightpath::diagnostics()
        );
    });
}

/// What each connection's opening message says.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Plan {
    magic: String,
    test: StreamTest,
    sizes: Vec<(usize, u64)>,
    conns: usize,
    /// Both sides use registered buffers (write_buf / read_buf).
    #[serde(default)]
    zero_copy: bool,
    /// The server answers the plan with a [`ServerInfo`] message.
    #[serde(default)]
    reply: bool,
    /// Around each size's measured iterations the client sends [`PROBE`] on this connection
    /// and the server answers its CPU time ([`cpu::encode`]).
    #[serde(default)]
    cpu_probe: bool,
}

/// The server's answer to a plan.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct ServerInfo {
    /// The server's shape.
    server: ServerShape,
    /// Why the server refuses the plan, if it does.
    #[serde(default)]
    error: Option<String>,
}

const MAGIC: &str = "lightpath-perf-stream";
/// The client's request for the server's CPU time.
const PROBE: &[u8] = b"cpu?";

/// One result line.
#[derive(Debug, Clone, Serialize)]
pub struct StreamResult {
    pub test: &'static str,
    pub provider: String,
    pub transport: String,
    pub size: usize,
    pub iters: u64,
    pub conns: usize,
    /// The server's shape (`threads` or `loop`).
    pub server: &'static str,
    /// Whether this run busy-polled (`--polling`).
    pub polling: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_us: Option<LatencySummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_mb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub msg_rate_mpps: Option<f64>,
    pub verified: bool,
    /// Both processes' CPU time over the measured iterations.
    #[serde(flatten)]
    pub cpu: Option<CpuUse>,
    /// stream_rr: connections set up per second, one after another (connect, negotiation,
    /// and the server's accept and answer to the opening message), over all `conns`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setup_per_s: Option<f64>,
}

fn options(args: &StreamArgs) -> Result<Options> {
    let providers = if args.provider == conn::FALLBACK {
        Vec::new()
    } else {
        lightpath::options::parse_providers(&args.provider).map_err(anyhow::Error::msg)?
    };
    let mut options = Options { providers, ..Options::default() };
    if args.polling {
        // Busy-poll as the verbs tests do: the calling thread drives the device and does not
        // sleep between messages (liveness is still checked after each 100 ms of spinning).
        options.soft_progress = ProgressMode::polling();
        options.spin = Duration::from_millis(100);
    }
    if let Some(bytes) = args.ring_size {
        options = options.with_ring_size(bytes);
    }
    if let Some(spin) = args.spin_us {
        options.spin = Duration::from_micros(spin);
    }
    if let Some(min) = args.rendezvous_min {
        options = options.with_rendezvous_min(min);
    }
    Ok(options)
}

fn plan(args: &StreamArgs) -> Vec<(usize, u64)> {
    let latency = args.test != StreamTest::Bw;
    let sizes: Vec<usize> = if args.all {
        (1..=23).map(|shift| 1usize << shift).collect()
    } else {
        vec![args.size.unwrap_or(if latency { 8 } else { 65536 })]
    };
    sizes
        .into_iter()
        .map(|size| {
            let iters = args.iters.unwrap_or(if latency { 1000 } else { 5000 });
            let iters = if args.all && args.iters.is_none() {
                let budget = if latency { 256u64 << 20 } else { 2u64 << 30 };
                (budget / size as u64).clamp(16, iters)
            } else {
                iters
            };
            (size, iters)
        })
        .collect()
}

/// Runs the server or the client.
pub fn run(args: &StreamArgs) -> Result<ExitCode> {
    if let Some(size) = args.size {
        ensure!(size > 0 && size <= 8 << 20, "message size must be 1 byte … 8 MiB");
    }
    ensure!(args.iters != Some(0), "at least one iteration is needed");
    ensure!(args.conns > 0, "at least one connection is needed");
    ensure!(!(args.zero_copy && args.test == StreamTest::Rr), "--zero-copy is for stream_lat and stream_bw");
    ensure!(
        !(args.zero_copy && is_kernel_tcp(&args.provider)),
        "--zero-copy needs Lightpath streams (registered buffers), not plain TCP"
    );
    if args.server.is_none() && args.shape == Some(ServerShape::Loop) {
        ensure!(!args.zero_copy, "--zero-copy is served by --server threads only");
        // In polling mode nothing processes the soft device's arrivals while the loop sleeps.
        ensure!(!args.polling, "--server loop needs the soft provider's progress thread: drop --polling");
    }
    let options = options(args)?;
    match &args.server {
        None => server::serve(args, &options),
        Some(server) => {
            let results = client(args, server, &options)?;
            print(&results, args.json);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print(results: &[StreamResult], json: bool) {
    for (i, result) in results.iter().enumerate() {
        if json {
            outln!("{}", serde_json::to_string(result).expect("results serialise"));
            continue;
        }
        if i == 0 {
            outln!(
                "# {} over {} ({}), {} connection(s), server: {}{}",
                result.test,
                result.provider,
                result.transport,
                result.conns,
                result.server,
                if result.polling { ", busy-polling" } else { "" }
            );
            outln!(
                "{:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>14} {:>14}",
                "#bytes",
                "#iters",
                "min[us]",
                "median[us]",
                "p99[us]",
                "BW[MB/s]",
                "rate[Mops]",
                "CPU (both)"
            );
        }
        let lat = result.lat_us.map_or([f64::NAN; 3], |l| [l.min, l.median, l.p99]);
        outln!(
            "{:>10} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>14.6} {:>14}",
            result.size,
            result.iters,
            lat[0],
            lat[1],
            lat[2],
            result.bw_mb_s.unwrap_or(f64::NAN),
            result.msg_rate_mpps.unwrap_or(f64::NAN),
            result.cpu.map(|c| c.summary()).unwrap_or_default()
        );
    }
}

fn warmup(iters: u64) -> u64 {
    (iters / 10).clamp(1, 100)
}

/// Fills `buf` with a pattern stamped with `index`.
fn stamp(buf: &mut [u8], index: u64) {
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = (i as u64).wrapping_mul(131).wrapping_add(index) as u8;
    }
    let bytes = index.to_be_bytes();
    let n = buf.len().min(8);
    buf[..n].copy_from_slice(&bytes[..n]);
}

/// Runs `connect` until it succeeds, retrying for 5 s while the server is not listening yet.
fn with_retries<T>(
    server: &str,
    args: &StreamArgs,
    mut connect: impl FnMut() -> std::io::Result<T>,
) -> Result<T> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match connect() {
            Ok(stream) => return Ok(stream),
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(err) => return Err(err).with_context(|| format!("cannot connect to {server}:{}", args.port)),
        }
    }
}

fn connect(server: &str, args: &StreamArgs, options: &Options) -> Result<Stream> {
    with_retries(server, args, || Stream::connect_with((server, args.port), options))
}

/// A plain kernel TCP connection (`--provider tcp`).
fn connect_kernel(server: &str, args: &StreamArgs) -> Result<KernelTcp> {
    let tcp = with_retries(server, args, || std::net::TcpStream::connect((server, args.port)))?;
    Ok(KernelTcp::new(tcp)?)
}

fn check_transport(stream: &Stream, args: &StreamArgs) -> Result<String> {
    let transport = stream.transport();
    if args.provider != conn::FALLBACK && !transport.is_rdma() {
        bail!("asked for {} but the connection fell back to {transport}", args.provider);
    }
    Ok(transport.to_string())
}

/// Sends `plan` and reads the server's answer; returns the server's shape.
fn send_plan(stream: &mut impl Conn, plan: &Plan, args: &StreamArgs) -> Result<ServerShape> {
    stream.send_msg(&serde_json::to_vec(plan)?)?;
    let reply = stream.recv_msg()?.context(NO_ANSWER)?;
    check_info(&reply, args)
}

/// The client's error when the server closes instead of answering the plan.
const NO_ANSWER: &str =
    "the server closed instead of answering the plan (was it started with the same --provider and test?)";

fn check_info(reply: &[u8], args: &StreamArgs) -> Result<ServerShape> {
    let info: ServerInfo =
        serde_json::from_slice(reply).context("the server's answer is not a lightpath perf one")?;
    if let Some(error) = info.error {
        bail!("the server refused: {error}");
    }
    if let Some(want) = args.shape {
        ensure!(
            info.server == want,
            "asked for a {} server but this one is {}",
            want.name(),
            info.server.name()
        );
    }
    Ok(info.server)
}

/// One CPU reading of each side: this process's, then the server's (asked over `stream`).
fn probe(stream: &mut impl Conn) -> Result<(Duration, Duration)> {
    let mine = cpu::process_cpu();
    stream.send_msg(PROBE)?;
    let reply = stream.recv_msg()?.context("the server closed instead of answering a CPU probe")?;
    let theirs = cpu::decode(&reply).context("the server's CPU reading is malformed")?;
    Ok((mine, theirs))
}

/// The CPU used between two [`probe`]s.
fn used(before: (Duration, Duration), after: (Duration, Duration)) -> (Duration, Duration) {
    (after.0.saturating_sub(before.0), after.1.saturating_sub(before.1))
}

fn client(args: &StreamArgs, server: &str, options: &Options) -> Result<Vec<StreamResult>> {
    let sizes = plan(args);
    let conns = if args.test == StreamTest::Rr { args.conns } else { 1 };
    let plan = Plan {
        magic: MAGIC.into(),
        test: args.test,
        sizes: sizes.clone(),
        conns,
        zero_copy: args.zero_copy,
        reply: true,
        cpu_probe: !args.zero_copy,
    };
    if args.test == StreamTest::Rr {
        return rr_client(args, server, options, &plan);
    }
    if is_kernel_tcp(&args.provider) {
        let mut conn = connect_kernel(server, args)?;
        let shape = send_plan(&mut conn, &plan, args)?;
        let transport = conn.transport_name();
        return measure(args, &mut conn, &transport, shape, &sizes);
    }
    let mut stream = connect(server, args, options)?;
    let transport = check_transport(&stream, args)?;
    let shape = send_plan(&mut stream, &plan, args)?;
    if args.zero_copy {
        return zero_copy::client(args, &mut stream, &transport, &sizes);
    }
    measure(args, &mut stream, &transport, shape, &sizes)
}

/// The latency and bandwidth tests' measured part, over an answered plan.
fn measure(
    args: &StreamArgs,
    stream: &mut impl Conn,
    transport: &str,
    shape: ServerShape,
    sizes: &[(usize, u64)],
) -> Result<Vec<StreamResult>> {
    let mut results = Vec::new();
    for &(size, iters) in sizes {
        let mut buf = vec![0u8; size];
        let mut back = vec![0u8; size];
        let result = |lat_us, bw_mb_s, msg_rate_mpps, cpu| StreamResult {
            test: args.test.name(),
            provider: args.provider.clone(),
            transport: transport.to_string(),
            size,
            iters,
            conns: 1,
            server: shape.name(),
            polling: args.polling,
            lat_us,
            bw_mb_s,
            msg_rate_mpps,
            verified: true,
            cpu,
            setup_per_s: None,
        };
        match args.test {
            StreamTest::Lat | StreamTest::Rr => {
                for i in 0..warmup(iters) {
                    round_trip(stream, &mut buf, &mut back, i)?;
                }
                let before = probe(stream)?;
                let mut samples = Vec::with_capacity(iters as usize);
                for i in 0..iters {
                    let elapsed = round_trip(stream, &mut buf, &mut back, warmup(iters) + i)?;
                    samples.push(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
                }
                let (client_cpu, server_cpu) = used(before, probe(stream)?);
                let cpu = CpuUse::per_op(client_cpu, server_cpu, iters);
                results.push(result(LatencySummary::from_nanos(&mut samples, 2), None, None, Some(cpu)));
            }
            StreamTest::Bw => {
                stamp(&mut buf, 0);
                let before = probe(stream)?;
                let started = Instant::now();
                for i in 0..iters {
                    if i + 1 == iters {
                        stamp(&mut buf, i);
                    }
                    stream.write_all(&buf)?;
                }
                let mut crc = [0u8; 4];
                stream.read_exact(&mut crc)?;
                let elapsed = started.elapsed();
                let (client_cpu, server_cpu) = used(before, probe(stream)?);
                ensure!(u32::from_be_bytes(crc) == crc32fast::hash(&buf), "the server's checksum differs");
                let bw = BandwidthSummary::new(size as u64 * iters, iters, elapsed);
                let cpu = CpuUse::per_gb(client_cpu, server_cpu, size as u64 * iters);
                results.push(result(None, Some(bw.bw_mb_s), Some(bw.msg_rate_mpps), Some(cpu)));
            }
        }
    }
    Ok(results)
}

/// One ping-pong of `buf` (stamped with `i`), checked; returns the round-trip time.
fn round_trip(stream: &mut impl Conn, buf: &mut [u8], back: &mut [u8], i: u64) -> Result<Duration> {
    stamp(buf, i);
    let started = Instant::now();
    stream.write_all(buf)?;
    stream.read_exact(back)?;
    let elapsed = started.elapsed();
    ensure!(back == buf, "the echo of iteration {i} differs");
    Ok(elapsed)
}

/// `count` round trips on one connection (requests stamped `first..first + count`, XORed with
/// the connection number); returns the stream and, if `record`, the round-trip times in ns.
async fn round_trips<S: AsyncConn>(
    mut stream: S,
    c: usize,
    size: usize,
    first: u64,
    count: u64,
    record: bool,
) -> Result<(S, Vec<u64>)> {
    let mut buf = vec![0u8; size];
    let mut back = vec![0u8; size];
    let mut samples = Vec::with_capacity(if record { count as usize } else { 0 });
    for i in first..first + count {
        stamp(&mut buf, i ^ (c as u64) << 32);
        let t = Instant::now();
        stream.write_all(&buf).await.with_context(|| format!("connection {c}: sending request {i}"))?;
        stream
            .read_exact(&mut back)
            .await
            .with_context(|| format!("connection {c}: reading the echo of request {i}"))?;
        ensure!(back == buf, "connection {c}: the echo of request {i} differs");
        if record {
            samples.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
    }
    Ok((stream, samples))
}

/// Runs `count` round trips on every connection at once; the streams come back in order.
async fn all_round_trips<S: AsyncConn>(
    streams: &mut Vec<S>,
    size: usize,
    first: u64,
    count: u64,
    record: bool,
) -> Result<Vec<u64>> {
    let tasks: Vec<_> = streams
        .drain(..)
        .enumerate()
        .map(|(c, stream)| tokio::spawn(round_trips(stream, c, size, first, count, record)))
        .collect();
    let mut samples = Vec::new();
    let mut failure = None;
    for task in tasks {
        match task.await.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok((stream, mut mine)) => {
                streams.push(stream);
                samples.append(&mut mine);
            }
            Err(err) => failure = failure.or(Some(err)),
        }
    }
    match failure {
        Some(err) => Err(err),
        None => Ok(samples),
    }
}

/// [`probe`] over a tokio stream.
async fn probe_async(stream: &mut impl AsyncConn) -> Result<(Duration, Duration)> {
    let mine = cpu::process_cpu();
    stream.send_msg(PROBE).await.context("sending a CPU probe")?;
    let reply = stream
        .recv_msg()
        .await
        .context("reading the answer to a CPU probe")?
        .context("the server closed instead of answering a CPU probe")?;
    let theirs = cpu::decode(&reply).context("the server's CPU reading is malformed")?;
    Ok((mine, theirs))
}

fn rr_client(args: &StreamArgs, server: &str, options: &Options, plan: &Plan) -> Result<Vec<StreamResult>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let started = Instant::now();
        // Each connection gets its plan as soon as it is open (the server waits for a plan
        // `PLAN_PATIENCE` after accepting, however long the others take to open).
        if is_kernel_tcp(&args.provider) {
            let (mut streams, mut shape) = (Vec::with_capacity(plan.conns), ServerShape::Threads);
            for c in 0..plan.conns {
                let KernelTcp(tcp) = connect_kernel(server, args)?;
                tcp.set_nonblocking(true)?;
                let mut stream = tokio::net::TcpStream::from_std(tcp)?;
                shape = send_rr_plan(&mut stream, plan, c, args).await?;
                streams.push(stream);
            }
            let transport = streams[0].transport_name();
            return rr_measure(args, plan, streams, shape, &transport, started).await;
        }
        // Connected as `lightpath::tokio::Stream::connect_with` would (each soft queue pair
        // with a UDP port of its own, as every soft stream by default; shm queue pairs woken
        // through their device's task doorbell, `Options::event_loop`).
        let options = &Options { event_loop: true, ..options.clone() };
        let (mut streams, mut shape) = (Vec::with_capacity(plan.conns), ServerShape::Threads);
        for c in 0..plan.conns {
            let mut stream = lightpath::tokio::Stream::from_std(connect(server, args, options)?)?;
            shape = send_rr_plan(&mut stream, plan, c, args).await?;
            streams.push(stream);
        }
        let transport = check_transport(streams[0].get_ref(), args)?;
        rr_measure(args, plan, streams, shape, &transport, started).await
    })
}

/// Sends connection `c` its plan (the first carries the CPU probes) and checks the answer.
async fn send_rr_plan<S: AsyncConn>(
    stream: &mut S,
    plan: &Plan,
    c: usize,
    args: &StreamArgs,
) -> Result<ServerShape> {
    let plan = Plan { cpu_probe: c == 0, ..plan.clone() };
    stream.send_msg(&serde_json::to_vec(&plan)?).await?;
    let reply = stream.recv_msg().await?.context(NO_ANSWER)?;
    check_info(&reply, args)
}

/// The request/response test over connected streams whose plans were answered: measures.
async fn rr_measure<S: AsyncConn>(
    args: &StreamArgs,
    plan: &Plan,
    mut streams: Vec<S>,
    shape: ServerShape,
    transport: &str,
    connecting_since: Instant,
) -> Result<Vec<StreamResult>> {
    {
        let setup_per_s = Some(plan.conns as f64 / connecting_since.elapsed().as_secs_f64().max(1e-9));
        let mut results = Vec::new();
        for &(size, iters) in &plan.sizes {
            all_round_trips(&mut streams, size, 0, warmup(iters), false).await?;
            let before = probe_async(&mut streams[0]).await?;
            let started = Instant::now();
            let mut samples = all_round_trips(&mut streams, size, warmup(iters), iters, true).await?;
            let elapsed = started.elapsed();
            let (client_cpu, server_cpu) = used(before, probe_async(&mut streams[0]).await?);
            let total = samples.len() as u64;
            results.push(StreamResult {
                test: args.test.name(),
                provider: args.provider.clone(),
                transport: transport.to_string(),
                size,
                iters,
                conns: plan.conns,
                server: shape.name(),
                polling: args.polling,
                lat_us: LatencySummary::from_nanos(&mut samples, 1),
                bw_mb_s: Some(2.0 * (total * size as u64) as f64 / elapsed.as_secs_f64() / 1e6),
                msg_rate_mpps: Some(total as f64 / elapsed.as_secs_f64() / 1e6),
                verified: true,
                cpu: Some(CpuUse::per_op(client_cpu, server_cpu, total)),
                setup_per_s,
            });
        }
        // Close each connection cleanly (a dropped tokio stream closes in the background, which
        // this process would not outlive).
        for stream in streams {
            stream.close().await?;
        }
        Ok(results)
    }
}
