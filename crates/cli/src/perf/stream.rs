//! `lightpath perf stream_lat|stream_bw|stream_rr [SERVER]`: the stream layer's own numbers,
//! measured through `lightpath::Stream` exactly as applications use it, over the soft or shm
//! provider or (`--provider tcp`) over the same API on kernel TCP — the baseline.
//!
//! | test | pattern | reported |
//! |---|---|---|
//! | stream_lat | `size` bytes each way, one at a time | one-way latency (round trip / 2) |
//! | stream_bw | `iters` writes of `size` bytes; the server answers the CRC-32 of the last one | MB/s |
//! | stream_rr | `--conns` connections, each `iters` requests of `size` bytes echoed back | transactions/s, round-trip latency |
//!
//! The server (no SERVER argument) listens on `-p` with a Lightpath listener and serves one
//! client run (for stream_rr, all its connections). Each connection opens with one message
//! holding the plan as JSON. The options and the JSON lines are those of the verbs-level
//! tests, plus `conns` and `transport` (what the connection really got).
//!
//! This subcommand is parsed before the verbs-level `perf` (see `wants`), so the verbs tests'
//! enum stays untouched.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use lightpath::{Listener, Options, Stream};
use lightpath_soft::ProgressMode;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::stats::{BandwidthSummary, LatencySummary};

#[path = "stream_zero_copy.rs"]
mod zero_copy;

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
    /// on this host) or tcp (the same API over kernel TCP); a comma-separated list offers
    /// several, best first.
    #[arg(long, default_value = "soft")]
    pub provider: String,
    /// Message size in bytes (default 8 for latency and rr, 65536 for bandwidth).
    #[arg(short = 's', long)]
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
    /// Drive the soft device from the calling threads and busy-poll (as the verbs tests do)
    /// instead of sleeping until the progress thread wakes them.
    #[arg(long)]
    pub polling: bool,
    /// How long a blocked call busy-polls before it sleeps, in µs (default: the library's).
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Print one JSON object per size instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Zero-copy on both sides (stream_lat, stream_bw): write_buf from and read_buf into
    /// registered buffers, so sizes from the rendezvous threshold up are fetched by RDMA READ.
    #[arg(long)]
    pub zero_copy: bool,
    /// Rendezvous threshold in bytes for this side's zero-copy writes (default: the library's).
    #[arg(long)]
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
    run(&args)
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
}

const MAGIC: &str = "lightpath-perf-stream";

/// One result line.
#[derive(Debug, Clone, Serialize)]
pub struct StreamResult {
    pub test: &'static str,
    pub provider: String,
    pub transport: String,
    pub size: usize,
    pub iters: u64,
    pub conns: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_us: Option<LatencySummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_mb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub msg_rate_mpps: Option<f64>,
    pub verified: bool,
}

fn options(args: &StreamArgs) -> Result<Options> {
    let providers = lightpath::options::parse_providers(&args.provider).map_err(anyhow::Error::msg)?;
    let mut options = Options { providers, ..Options::default() };
    if args.polling {
        // Busy-poll as the verbs tests do: the calling thread drives the device and does not
        // sleep between messages (liveness is still checked after each 100 ms of spinning).
        options.soft_progress = ProgressMode::polling();
        options.spin = Duration::from_millis(100);
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
    let options = options(args)?;
    match &args.server {
        None => serve(args, &options),
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
            println!("{}", serde_json::to_string(result).expect("results serialise"));
            continue;
        }
        if i == 0 {
            println!(
                "# {} over {} ({}), {} connection(s)",
                result.test, result.provider, result.transport, result.conns
            );
            println!(
                "{:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>14}",
                "#bytes", "#iters", "min[us]", "median[us]", "p99[us]", "BW[MB/s]", "rate[Mops]"
            );
        }
        let lat = result.lat_us.map_or([f64::NAN; 3], |l| [l.min, l.median, l.p99]);
        println!(
            "{:>10} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>14.6}",
            result.size,
            result.iters,
            lat[0],
            lat[1],
            lat[2],
            result.bw_mb_s.unwrap_or(f64::NAN),
            result.msg_rate_mpps.unwrap_or(f64::NAN)
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

fn serve(args: &StreamArgs, options: &Options) -> Result<ExitCode> {
    let addr = SocketAddr::new(args.bind.unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED)), args.port);
    let listener = Listener::bind_with(addr, options.clone())
        .or_else(|_| Listener::bind_with(("0.0.0.0", args.port), options.clone()))
        .with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!("lightpath perf: waiting for a client on port {} ({})", args.port, args.test.name());
    // The first connection's plan says how many connections the run has (stream_rr).
    let mut handles = Vec::new();
    let mut total = 1;
    while handles.len() < total {
        let (mut stream, peer) = listener.accept()?;
        let plan = read_plan(&mut stream)?;
        if handles.is_empty() {
            eprintln!("lightpath perf: client {peer} connected over {}", stream.transport());
            total = plan.conns;
        }
        handles.push(std::thread::spawn(move || serve_conn(stream, &plan)));
    }
    for handle in handles {
        handle.join().map_err(|_| anyhow::anyhow!("a server thread panicked"))??;
    }
    Ok(ExitCode::SUCCESS)
}

fn read_plan(stream: &mut Stream) -> Result<Plan> {
    let hello = stream.recv_msg()?.context("the client closed before its plan")?;
    let plan: Plan = serde_json::from_slice(&hello).context("not a lightpath perf stream client")?;
    ensure!(plan.magic == MAGIC, "not a lightpath perf stream client");
    ensure!(plan.conns >= 1 && plan.conns <= 100_000, "implausible connection count {}", plan.conns);
    ensure!(plan.sizes.iter().all(|&(size, _)| size > 0 && size <= 8 << 20), "message size out of range");
    Ok(plan)
}

/// Serves one connection's plan.
fn serve_conn(mut stream: Stream, plan: &Plan) -> Result<()> {
    if plan.zero_copy {
        return zero_copy::serve(stream, plan);
    }
    for &(size, iters) in &plan.sizes {
        let mut buf = vec![0u8; size];
        match plan.test {
            StreamTest::Lat | StreamTest::Rr => {
                for _ in 0..iters + warmup(iters) {
                    stream.read_exact(&mut buf)?;
                    stream.write_all(&buf)?;
                }
            }
            StreamTest::Bw => {
                for _ in 0..iters {
                    stream.read_exact(&mut buf)?;
                }
                stream.write_all(&crc32fast::hash(&buf).to_be_bytes())?;
            }
        }
    }
    // Stay until the client closes, so its last records (its close among them) are
    // acknowledged before this process exits and takes its queue pairs with it.
    let mut rest = [0u8; 64];
    while matches!(stream.read(&mut rest), Ok(n) if n > 0) {}
    Ok(())
}

fn connect(server: &str, args: &StreamArgs, options: &Options) -> Result<Stream> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Stream::connect_with((server, args.port), options) {
            Ok(stream) => return Ok(stream),
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(err) => return Err(err).with_context(|| format!("cannot connect to {server}:{}", args.port)),
        }
    }
}

fn check_transport(stream: &Stream, args: &StreamArgs) -> Result<String> {
    let transport = stream.transport();
    if args.provider != "tcp" && !transport.is_rdma() {
        bail!("asked for {} but the connection fell back to {transport}", args.provider);
    }
    Ok(transport.to_string())
}

fn client(args: &StreamArgs, server: &str, options: &Options) -> Result<Vec<StreamResult>> {
    let sizes = plan(args);
    let conns = if args.test == StreamTest::Rr { args.conns } else { 1 };
    let plan =
        Plan { magic: MAGIC.into(), test: args.test, sizes: sizes.clone(), conns, zero_copy: args.zero_copy };
    if args.test == StreamTest::Rr {
        return rr_client(args, server, options, &plan);
    }
    let mut stream = connect(server, args, options)?;
    let transport = check_transport(&stream, args)?;
    stream.send_msg(&serde_json::to_vec(&plan)?)?;
    if args.zero_copy {
        return zero_copy::client(args, &mut stream, &transport, &sizes);
    }
    let mut results = Vec::new();
    for &(size, iters) in &sizes {
        let mut buf = vec![0u8; size];
        let mut back = vec![0u8; size];
        let result = |lat_us, bw_mb_s, msg_rate_mpps| StreamResult {
            test: args.test.name(),
            provider: args.provider.clone(),
            transport: transport.clone(),
            size,
            iters,
            conns: 1,
            lat_us,
            bw_mb_s,
            msg_rate_mpps,
            verified: true,
        };
        match args.test {
            StreamTest::Lat | StreamTest::Rr => {
                let mut samples = Vec::with_capacity(iters as usize);
                for i in 0..iters + warmup(iters) {
                    stamp(&mut buf, i);
                    let started = Instant::now();
                    stream.write_all(&buf)?;
                    stream.read_exact(&mut back)?;
                    let elapsed = started.elapsed();
                    ensure!(back == buf, "the echo of iteration {i} differs");
                    if i >= warmup(iters) {
                        samples.push(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
                    }
                }
                results.push(result(LatencySummary::from_nanos(&mut samples, 2), None, None));
            }
            StreamTest::Bw => {
                stamp(&mut buf, 0);
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
                ensure!(u32::from_be_bytes(crc) == crc32fast::hash(&buf), "the server's checksum differs");
                let bw = BandwidthSummary::new(size as u64 * iters, iters, elapsed);
                results.push(result(None, Some(bw.bw_mb_s), Some(bw.msg_rate_mpps)));
            }
        }
    }
    Ok(results)
}

fn rr_client(args: &StreamArgs, server: &str, options: &Options, plan: &Plan) -> Result<Vec<StreamResult>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let mut streams = Vec::with_capacity(plan.conns);
        for _ in 0..plan.conns {
            let stream = lightpath::tokio::Stream::from_std(connect(server, args, options)?)?;
            streams.push(stream);
        }
        let transport = check_transport(streams[0].get_ref(), args)?;
        let hello = serde_json::to_vec(plan)?;
        for stream in &mut streams {
            stream.send_msg(&hello).await?;
        }
        let mut results = Vec::new();
        for &(size, iters) in &plan.sizes {
            let started = Instant::now();
            let mut tasks = Vec::new();
            for (c, mut stream) in streams.drain(..).enumerate() {
                tasks.push(tokio::spawn(async move {
                    let mut buf = vec![0u8; size];
                    let mut back = vec![0u8; size];
                    let mut samples = Vec::with_capacity(iters as usize);
                    for i in 0..iters + warmup(iters) {
                        stamp(&mut buf, i ^ (c as u64) << 32);
                        let t = Instant::now();
                        stream.write_all(&buf).await?;
                        stream.read_exact(&mut back).await?;
                        if back != buf {
                            return Err(anyhow::anyhow!("connection {c}: the echo of request {i} differs"));
                        }
                        if i >= warmup(iters) {
                            samples.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
                        }
                    }
                    Ok((stream, samples))
                }));
            }
            let mut samples = Vec::new();
            for task in tasks {
                let (stream, mut mine) = task.await??;
                streams.push(stream);
                samples.append(&mut mine);
            }
            let elapsed = started.elapsed();
            let total = samples.len() as u64;
            results.push(StreamResult {
                test: args.test.name(),
                provider: args.provider.clone(),
                transport: transport.clone(),
                size,
                iters,
                conns: plan.conns,
                lat_us: LatencySummary::from_nanos(&mut samples, 1),
                bw_mb_s: Some(2.0 * (total * size as u64) as f64 / elapsed.as_secs_f64() / 1e6),
                msg_rate_mpps: Some(total as f64 / elapsed.as_secs_f64() / 1e6),
                verified: true,
            });
        }
        // Close each connection cleanly (a dropped tokio stream closes in the background, which
        // this process would not outlive).
        for stream in streams {
            stream.close().await?;
        }
        Ok(results)
    })
}
