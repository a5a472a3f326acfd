//! The kernel-TCP baseline: each test's message pattern over one TCP connection (the control
//! connection itself, after the handshake), so RDMA numbers have a side-by-side reference.
//! Latency tests busy-poll a nonblocking socket, as the RDMA tests busy-poll their completion
//! queues, so neither side pays for a thread wake-up the other does not.
//!
//! | test | client → server | server → client | reported |
//! |---|---|---|---|
//! | send_lat, write_lat | `size` bytes | the same `size` bytes | round trip / 2 |
//! | read_lat | 8-byte request | `size` bytes | round trip |
//! | atomic_lat | 16-byte fetch-and-add request | 8-byte old value | round trip |
//! | send_bw, write_bw | `iters` × `size` bytes | 4-byte CRC of the last message | bytes / time to the CRC |
//! | read_bw | `iters` 8-byte requests, ≤ tx_depth in flight | `iters` × `size` bytes | bytes / time |

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};

use super::args::{Args, PerfTest, ProviderKind};
use super::control::{self, Answer, Hello};
use super::cpu::{self, CpuUse};
use super::pattern;
use super::progress::Progress;
use super::report::{Reporter, SizeResult};
use super::session;
use super::stats::{BandwidthSummary, LatencySummary};

/// Reads exactly `buf.len()` bytes from a nonblocking socket by spinning, as the RDMA tests spin
/// on their completion queues: a blocking `read` would add a kernel wake-up (tens of µs on an
/// idle machine) to every TCP round trip and make the baseline look worse than it is.
fn spin_read_exact(stream: &mut TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match stream.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a nonblocking socket, spinning while the send buffer is full.
fn spin_write_all(stream: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match stream.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Unmeasured iterations before each latency measurement.
fn warmup(iters: u64) -> u64 {
    (iters / 10).clamp(1, 100)
}

/// Runs the server or the client side.
pub fn run(args: &Args) -> Result<()> {
    match &args.server {
        None => serve(args),
        Some(server) => client(args, server),
    }
}

fn serve(args: &Args) -> Result<()> {
    let (stream, hello) = session::accept_client(args, |_| Ok(()))?;
    serve_hello(stream, hello, args.test)
}

/// The server side on an accepted control connection.
pub fn serve_stream(mut stream: TcpStream, test: PerfTest) -> Result<()> {
    let hello: Hello = control::recv(&mut stream)?;
    serve_hello(stream, hello, test)
}

/// The server side once the client's hello has been read.
pub fn serve_hello(mut stream: TcpStream, hello: Hello, test: PerfTest) -> Result<()> {
    if let Err(reason) = control::check_hello(&hello, test, ProviderKind::Tcp) {
        control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
        bail!("refused the client: {reason}");
    }
    control::send(&mut stream, &Answer::Accept { endpoint: None })?;
    for &(size, iters) in &hello.plan {
        let cpu_start = cpu::process_cpu();
        serve_size(&mut stream, hello.test, size, iters)
            .with_context(|| format!("{} over tcp, {size} bytes", hello.test))?;
        if hello.cpu {
            stream.write_all(&cpu::encode(cpu::process_cpu().saturating_sub(cpu_start)))?;
        }
    }
    Ok(())
}

fn client(args: &Args, server: &str) -> Result<()> {
    let stream = session::connect(args, server)?;
    let plan = args.plan();
    let mut reporter = Reporter::new(args.json);
    client_stream(stream, args.test, &plan, args.tx_depth, |r| reporter.print(r))
}

/// The client side on a connected control connection; `on_result` gets each size's result.
pub fn client_stream(
    mut stream: TcpStream,
    test: PerfTest,
    plan: &[(usize, u64)],
    tx_depth: u32,
    mut on_result: impl FnMut(&SizeResult),
) -> Result<()> {
    let hello = Hello {
        magic: control::MAGIC.into(),
        version: control::VERSION,
        test,
        provider: ProviderKind::Tcp,
        plan: plan.to_vec(),
        tx_depth,
        endpoint: None,
        cpu: true,
    };
    control::send(&mut stream, &hello)?;
    match control::recv::<Answer>(&mut stream)? {
        Answer::Accept { .. } => {}
        Answer::Reject { reason } => bail!("the server refused: {reason}"),
    }
    for &(size, iters) in plan {
        let cpu_start = cpu::process_cpu();
        let mut result = run_size(&mut stream, test, size, iters, tx_depth)
            .with_context(|| format!("{test} over tcp, {size} bytes"))?;
        let client_cpu = cpu::process_cpu().saturating_sub(cpu_start);
        let mut reading = [0u8; 8];
        stream.read_exact(&mut reading).context("reading the server's CPU time")?;
        let server_cpu = cpu::decode(&reading).expect("8 bytes");
        result.cpu = Some(if test.is_latency() {
            CpuUse::per_op(client_cpu, server_cpu, iters + warmup(iters))
        } else {
            CpuUse::per_gb(client_cpu, server_cpu, size as u64 * iters)
        });
        on_result(&result);
    }
    Ok(())
}

fn serve_size(stream: &mut TcpStream, test: PerfTest, size: usize, iters: u64) -> Result<()> {
    // Latency tests spin on a nonblocking socket (see `spin_read_exact`); bandwidth tests block.
    let spin = test.is_latency();
    stream.set_nonblocking(spin)?;
    match test {
        PerfTest::SendLat | PerfTest::WriteLat => {
            let mut buf = vec![0u8; size];
            for _ in 0..iters + warmup(iters) {
                spin_read_exact(stream, &mut buf)?;
                spin_write_all(stream, &buf)?;
            }
        }
        PerfTest::ReadLat | PerfTest::ReadBw => {
            let data = pattern::make(size, size as u32);
            let mut request = [0u8; 8];
            let total = if test == PerfTest::ReadLat { iters + warmup(iters) } else { iters };
            for _ in 0..total {
                if spin {
                    spin_read_exact(stream, &mut request)?;
                } else {
                    stream.read_exact(&mut request)?;
                }
                ensure!(u64::from_be_bytes(request) == size as u64, "read request for the wrong size");
                if spin {
                    spin_write_all(stream, &data)?;
                } else {
                    stream.write_all(&data)?;
                }
            }
        }
        PerfTest::AtomicLat => {
            let mut counter = 0u64;
            let mut request = [0u8; 16];
            for _ in 0..iters + warmup(iters) {
                spin_read_exact(stream, &mut request)?;
                let add = u64::from_be_bytes(request[8..].try_into().expect("8 bytes"));
                spin_write_all(stream, &counter.to_be_bytes())?;
                counter = counter.wrapping_add(add);
            }
        }
        PerfTest::SendBw | PerfTest::WriteBw => {
            let mut buf = vec![0u8; size];
            for _ in 0..iters {
                stream.read_exact(&mut buf)?;
            }
            stream.write_all(&pattern::checksum(&buf).to_be_bytes())?;
        }
    }
    stream.set_nonblocking(false)?;
    Ok(())
}

fn run_size(
    stream: &mut TcpStream,
    test: PerfTest,
    size: usize,
    iters: u64,
    depth: u32,
) -> Result<SizeResult> {
    let mut progress = Progress::new(format!("{test} {size} B"), iters);
    let result = match test {
        PerfTest::SendLat | PerfTest::WriteLat | PerfTest::ReadLat | PerfTest::AtomicLat => {
            let mut samples = Vec::with_capacity(iters as usize);
            let mut exchange = LatencyExchange::new(test, size);
            stream.set_nonblocking(true)?;
            let mut previous = Instant::now();
            for i in 0..iters + warmup(iters) {
                exchange.once(stream)?;
                let now = Instant::now();
                if i >= warmup(iters) {
                    samples.push(now.duration_since(previous).as_nanos() as u64);
                    progress.update(samples.len() as u64);
                }
                previous = now;
            }
            stream.set_nonblocking(false)?;
            exchange.verify(iters + warmup(iters))?;
            let divisor = if test.reports_round_trip() { 1 } else { 2 };
            let lat = LatencySummary::from_nanos(&mut samples, divisor).expect("at least one iteration");
            SizeResult::latency(test, ProviderKind::Tcp, size, iters, lat)
        }
        PerfTest::SendBw | PerfTest::WriteBw => {
            let data = pattern::make(size, size as u32);
            let start = Instant::now();
            for i in 0..iters {
                stream.write_all(&data)?;
                progress.update(i + 1);
            }
            let mut crc = [0u8; 4];
            stream.read_exact(&mut crc)?;
            let elapsed = start.elapsed();
            ensure!(
                u32::from_be_bytes(crc) == pattern::checksum(&data),
                "payload checksum mismatch: the server received different bytes"
            );
            let bw = BandwidthSummary::new(size as u64 * iters, iters, elapsed);
            SizeResult::bandwidth(test, ProviderKind::Tcp, size, iters, bw)
        }
        PerfTest::ReadBw => {
            let start = Instant::now();
            let last = read_stream(stream, size, iters, depth, &mut progress)?;
            let elapsed = start.elapsed();
            ensure!(
                pattern::checksum(&last) == pattern::checksum(&pattern::make(size, size as u32)),
                "payload checksum mismatch: the data read differs from the server's buffer"
            );
            let bw = BandwidthSummary::new(size as u64 * iters, iters, elapsed);
            SizeResult::bandwidth(test, ProviderKind::Tcp, size, iters, bw)
        }
    };
    progress.finish();
    Ok(result)
}

/// One latency round trip of a TCP test, with what is needed to verify the answers.
struct LatencyExchange {
    test: PerfTest,
    message: Vec<u8>,
    reply: Vec<u8>,
    last_old_value: Option<u64>,
}

impl LatencyExchange {
    fn new(test: PerfTest, size: usize) -> Self {
        let (message, reply) = match test {
            PerfTest::ReadLat => ((size as u64).to_be_bytes().to_vec(), vec![0u8; size]),
            PerfTest::AtomicLat => {
                let mut request = vec![0u8; 16];
                request[8..].copy_from_slice(&1u64.to_be_bytes());
                (request, vec![0u8; 8])
            }
            _ => (pattern::make(size, size as u32), vec![0u8; size]),
        };
        Self { test, message, reply, last_old_value: None }
    }

    #[inline]
    fn once(&mut self, stream: &mut TcpStream) -> Result<()> {
        spin_write_all(stream, &self.message)?;
        spin_read_exact(stream, &mut self.reply)?;
        if self.test == PerfTest::AtomicLat {
            let old = u64::from_be_bytes(self.reply[..8].try_into().expect("8 bytes"));
            ensure!(
                self.last_old_value.is_none_or(|prev| old == prev + 1),
                "fetch-and-add returned {old} after {:?}",
                self.last_old_value
            );
            self.last_old_value = Some(old);
        }
        Ok(())
    }

    fn verify(&self, rounds: u64) -> Result<()> {
        match self.test {
            PerfTest::ReadLat => ensure!(
                self.reply == pattern::make(self.reply.len(), self.reply.len() as u32),
                "read_lat: the data read differs from the server's buffer"
            ),
            PerfTest::AtomicLat => {
                ensure!(self.last_old_value == Some(rounds - 1), "fetch-and-add count is off")
            }
            _ => ensure!(self.reply == self.message, "the echoed message differs from the one sent"),
        }
        Ok(())
    }
}

/// Issues `iters` read requests with at most `depth` in flight and returns the last response.
fn read_stream(
    stream: &mut TcpStream,
    size: usize,
    iters: u64,
    depth: u32,
    progress: &mut Progress,
) -> Result<Vec<u8>> {
    let mut writer = stream.try_clone()?;
    let (credit_tx, credit_rx) = mpsc::channel::<()>();
    let requester = std::thread::spawn(move || -> std::io::Result<()> {
        let request = (size as u64).to_be_bytes();
        for i in 0..iters {
            if i >= u64::from(depth) && credit_rx.recv().is_err() {
                break;
            }
            writer.write_all(&request)?;
        }
        Ok(())
    });
    let mut buf = vec![0u8; size];
    for i in 0..iters {
        stream.read_exact(&mut buf)?;
        // The requester may already have finished; a closed channel is fine.
        let _ = credit_tx.send(());
        progress.update(i + 1);
    }
    requester.join().map_err(|_| anyhow::anyhow!("request thread panicked"))??;
    Ok(buf)
}
