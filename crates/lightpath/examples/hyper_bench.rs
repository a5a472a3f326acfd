//! hyper HTTP/1.1 over Lightpath beside TCP (issue 17): requests per second, median and p99
//! latency, and CPU time, for N keep-alive connections each sending R POSTs of a given body.
//!
//! ```text
//! cargo run --release -p lightpath --features tokio --example hyper_bench -- \
//!     server 127.0.0.1:7100 --provider shm
//! cargo run --release -p lightpath --features tokio --example hyper_bench -- \
//!     client 127.0.0.1:7100 --provider shm --conns 8 --requests 2000 --body 100
//! ```
//!
//! Server and client are two processes, each with one multi-thread tokio runtime (as many
//! workers as cores unless `--threads N`). The server answers every POST with the body's
//! length and CRC-32, which the client checks, and answers `GET /cpu` with its own CPU time so
//! that the client can report both processes' cost. `--provider` takes `shm`, `soft`,
//! `ibverbs` or a list of them (`shm,soft`), chosen through `lightpath::Options`; `tcp` is
//! Lightpath's TCP fallback (`Options::tcp_only()`), and `tokio-tcp` plain `tokio::net`
//! sockets with no Lightpath code at all. A server without `--provider` accepts whatever a
//! Lightpath client offers; the client fails if its connections end up on any other
//! transport than the one asked for.
//!
//! Each connection first sends `--warmup` requests (default: a tenth of `--requests`, at least
//! one); the clock starts once every connection has warmed up and stops when the last one has
//! sent its `--requests`. Printed: requests/s of all connections together, median and p99 of
//! every request's latency (request built to response body read and checked), CPU (user +
//! system, all threads) of the client and of the server over the measured time. `--json`
//! prints one JSON line instead (`scripts/hyper_bench.sh` runs the whole matrix).

use std::io;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use lightpath::{Options, ProviderId, Transport};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Barrier;

const USAGE: &str = "usage:
  hyper_bench server ADDR [--provider P] [--threads N]
  hyper_bench client ADDR [--provider P] [--conns N] [--requests R] [--body BYTES]
                          [--warmup W] [--threads N] [--timeout SECS] [--json]
P: shm, soft, ibverbs or a list (shm,soft); tcp (Lightpath's TCP fallback); tokio-tcp (plain
tokio::net sockets). BYTES may end in k or m (KiB, MiB). Defaults: client --provider shm
--conns 1 --requests 1000 --body 100 --timeout 120; server: every RDMA provider.";

/// How connections are made.
#[derive(Clone, Debug)]
enum Provider {
    /// Through `lightpath::tokio` with these options (`providers` empty: the TCP fallback).
    Lightpath { name: String, options: Box<Options> },
    /// `tokio::net` directly.
    TokioTcp,
}

impl Provider {
    fn parse(text: &str) -> Result<Provider, String> {
        match text {
            "tokio-tcp" => Ok(Provider::TokioTcp),
            "tcp" => Ok(Provider::Lightpath { name: text.into(), options: Box::new(Options::tcp_only()) }),
            _ => {
                let providers = lightpath::options::parse_providers(text)?;
                if providers.is_empty() {
                    return Err(format!("no provider in {text:?}"));
                }
                let options = Options::default().with_providers(&providers);
                Ok(Provider::Lightpath { name: text.into(), options: Box::new(options) })
            }
        }
    }

    fn name(&self) -> &str {
        match self {
            Provider::Lightpath { name, .. } => name,
            Provider::TokioTcp => "tokio-tcp",
        }
    }

    /// Whether a connection over `transport` is what this provider asked for.
    fn accepts(&self, transport: Transport) -> bool {
        match (self, transport) {
            (Provider::Lightpath { options, .. }, Transport::Rdma(p)) => options.providers.contains(&p),
            (Provider::Lightpath { options, .. }, Transport::Tcp(_)) => options.providers.is_empty(),
            _ => false,
        }
    }
}

struct ServerArgs {
    addr: String,
    provider: Provider,
}

struct ClientArgs {
    addr: String,
    provider: Provider,
    conns: usize,
    requests: usize,
    warmup: usize,
    body: usize,
    timeout: Duration,
    json: bool,
}

enum Command {
    Server(ServerArgs),
    Client(ClientArgs),
}

/// The command and the runtime's worker count (`None`: tokio's default, one per core).
fn parse(args: &[String]) -> Result<(Command, Option<usize>), String> {
    let (mode, addr) = match args {
        [mode, addr, ..] if !addr.starts_with("--") => (mode.as_str(), addr.clone()),
        [mode, ..] if mode == "server" || mode == "client" => return Err(format!("{mode}: ADDR missing")),
        _ => return Err("server or client expected".into()),
    };
    let mut provider = None;
    let (mut conns, mut requests, mut warmup, mut body) = (1, 1000, None, 100);
    let (mut threads, mut timeout, mut json) = (None, 120.0, false);
    let mut rest = args[2..].iter();
    while let Some(flag) = rest.next() {
        if flag == "--json" {
            json = true;
            continue;
        }
        let value = rest.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--provider" => provider = Some(Provider::parse(value)?),
            "--threads" => threads = Some(number(flag, value)?.max(1)),
            "--conns" => conns = number(flag, value)?,
            "--requests" => requests = number(flag, value)?,
            "--warmup" => warmup = Some(number(flag, value)?),
            "--body" => body = bytes(value)?,
            "--timeout" => {
                timeout = value
                    .parse::<f64>()
                    .ok()
                    .filter(|t| *t > 0.0 && t.is_finite())
                    .ok_or_else(|| format!("--timeout: {value:?} is not a positive number of seconds"))?
            }
            _ => return Err(format!("unknown option {flag:?}")),
        }
    }
    let command = match mode {
        "server" => {
            let provider = provider.unwrap_or_else(|| Provider::Lightpath {
                name: "any".into(),
                options: Box::new(Options::default().with_providers(&[
                    ProviderId::Shm,
                    ProviderId::Ibverbs,
                    ProviderId::Soft,
                ])),
            });
            Command::Server(ServerArgs { addr, provider })
        }
        "client" => {
            if conns == 0 || requests == 0 {
                return Err("--conns and --requests must be at least 1".into());
            }
            Command::Client(ClientArgs {
                addr,
                provider: provider.map_or_else(|| Provider::parse("shm"), Ok)?,
                conns,
                requests,
                warmup: warmup.unwrap_or((requests / 10).max(1)),
                body,
                timeout: Duration::from_secs_f64(timeout),
                json,
            })
        }
        other => return Err(format!("unknown mode {other:?}: server or client expected")),
    };
    Ok((command, threads))
}

fn number(flag: &str, value: &str) -> Result<usize, String> {
    value.parse().map_err(|_| format!("{flag}: {value:?} is not a number"))
}

/// A byte count: digits, optionally followed by k or m (KiB, MiB).
fn bytes(value: &str) -> Result<usize, String> {
    let lower = value.to_ascii_lowercase();
    let (digits, unit) = match lower.strip_suffix('k') {
        Some(d) => (d, 1 << 10),
        None => lower.strip_suffix('m').map_or((lower.as_str(), 1), |d| (d, 1 << 20)),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("--body: {value:?} is not a byte count (such as 100, 64k, 1m)"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (command, threads) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(err) => {
            eprintln!("hyper_bench: {err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = threads {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("hyper_bench: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match command {
            Command::Server(args) => serve(args).await.map_err(|err| err.to_string()),
            Command::Client(args) => client(args).await,
        }
    });
    // The server's connections may still be open: do not wait for them.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hyper_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

/// CPU time (user + system, every thread) this process has used so far.
fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

/// What the server answers for a body: its length and CRC-32.
fn digest(body: &[u8]) -> String {
    format!("{} {:08x}", body.len(), crc32fast::hash(body))
}

/// An error and its sources (hyper's own message rarely says what the stream reported).
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text += &format!(": {cause}");
        source = cause.source();
    }
    text
}

// ---- server ----

async fn serve(args: ServerArgs) -> io::Result<()> {
    match &args.provider {
        Provider::TokioTcp => {
            let listener = tokio::net::TcpListener::bind(&args.addr).await?;
            println!("hyper_bench server on {} (tokio-tcp)", listener.local_addr()?);
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        stream.set_nodelay(true)?;
                        tokio::spawn(serve_connection(stream));
                    }
                    Err(err) => accept_failed(err).await,
                }
            }
        }
        Provider::Lightpath { name, options } => {
            let listener = lightpath::tokio::Listener::bind_with(&args.addr, Options::clone(options)).await?;
            println!("hyper_bench server on {} ({name})", listener.local_addr()?);
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => drop(tokio::spawn(serve_connection(stream))),
                    Err(err) => accept_failed(err).await,
                }
            }
        }
    }
}

async fn accept_failed(err: io::Error) {
    eprintln!("hyper_bench server: accept: {err}");
    tokio::time::sleep(Duration::from_millis(10)).await;
}

async fn serve_connection(stream: impl AsyncRead + AsyncWrite + Send + Unpin + 'static) {
    let service = hyper::service::service_fn(answer);
    let served = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    if let Err(err) = served.await {
        eprintln!("hyper_bench server: connection: {}", chain(&err));
    }
}

/// POST: the body's digest. `GET /cpu`: this process's CPU time so far, in nanoseconds.
async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let text = if request.method() == hyper::Method::GET && request.uri().path() == "/cpu" {
        process_cpu().as_nanos().to_string()
    } else {
        digest(&request.into_body().collect().await?.to_bytes())
    };
    Ok(Response::new(Full::new(Bytes::from(text))))
}

// ---- client ----

/// One keep-alive HTTP/1.1 connection.
struct Connection {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    /// What it runs over.
    transport: String,
    /// The task driving the connection; it ends once `sender` is dropped.
    driver: tokio::task::JoinHandle<()>,
}

impl Connection {
    async fn open(args: &ClientArgs) -> Result<Connection, String> {
        let failed =
            |err: io::Error| format!("cannot connect to {} over {}: {err}", args.addr, args.provider.name());
        match &args.provider {
            Provider::TokioTcp => {
                let stream = tokio::net::TcpStream::connect(&args.addr).await.map_err(failed)?;
                stream.set_nodelay(true).map_err(failed)?;
                Self::handshake(stream, "tokio-tcp".into()).await
            }
            Provider::Lightpath { options, .. } => {
                let stream =
                    lightpath::tokio::Stream::connect_with(&args.addr, options).await.map_err(failed)?;
                let transport = stream.transport();
                if !args.provider.accepts(transport) {
                    return Err(format!(
                        "asked for {}, the connection went over {transport}",
                        args.provider.name()
                    ));
                }
                Self::handshake(stream, transport.to_string()).await
            }
        }
    }

    async fn handshake(
        stream: impl AsyncRead + AsyncWrite + Send + Unpin + 'static,
        transport: String,
    ) -> Result<Connection, String> {
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| format!("HTTP handshake: {err}"))?;
        let driver = tokio::spawn(async move {
            if let Err(err) = connection.await {
                eprintln!("hyper_bench client: connection: {}", chain(&err));
            }
        });
        Ok(Connection { sender, transport, driver })
    }

    /// Closes the connection cleanly (hyper shuts the stream down once the sender is gone).
    async fn close(self) {
        drop(self.sender);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.driver).await;
    }

    /// Sends one request and returns the response body.
    async fn call(&mut self, request: Request<Full<Bytes>>) -> Result<Bytes, String> {
        self.sender.ready().await.map_err(|err| format!("connection lost: {err}"))?;
        let response = self.sender.send_request(request).await.map_err(|err| format!("request: {err}"))?;
        if !response.status().is_success() {
            return Err(format!("status {}", response.status()));
        }
        let body = response.into_body().collect().await.map_err(|err| format!("response body: {err}"))?;
        Ok(body.to_bytes())
    }

    /// POSTs `body` and checks the answer against `expected`.
    async fn post(&mut self, body: &Bytes, expected: &str) -> Result<(), String> {
        let request = Request::post("/digest")
            .header(hyper::header::HOST, "lightpath")
            .body(Full::new(body.clone()))
            .map_err(|err| err.to_string())?;
        let answer = self.call(request).await?;
        if answer != expected.as_bytes() {
            return Err(format!("answer {:?}, expected {expected:?}", String::from_utf8_lossy(&answer)));
        }
        Ok(())
    }

    /// The server's CPU time so far.
    async fn server_cpu(&mut self) -> Result<Duration, String> {
        let request = Request::get("/cpu")
            .header(hyper::header::HOST, "lightpath")
            .body(Full::new(Bytes::new()))
            .map_err(|err| err.to_string())?;
        let answer = self.call(request).await?;
        std::str::from_utf8(&answer)
            .ok()
            .and_then(|text| text.parse().ok())
            .map(Duration::from_nanos)
            .ok_or_else(|| format!("GET /cpu answered {:?}", String::from_utf8_lossy(&answer)))
    }
}

/// Deterministic bytes, different for each connection.
fn pattern(len: usize, salt: usize) -> Bytes {
    let mut x = (salt as u32).wrapping_mul(2654435761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Readings taken when the clock starts or stops.
struct Mark {
    at: Instant,
    cpu: Duration,
    server_cpu: Duration,
}

impl Mark {
    /// The server's reading, then this process's: the clock starts right after.
    async fn start(control: &mut Connection) -> Result<Mark, String> {
        let server_cpu = control.server_cpu().await?;
        Ok(Mark { at: Instant::now(), cpu: process_cpu(), server_cpu })
    }

    /// This process's reading, then the server's: the clock stopped right before.
    async fn end(control: &mut Connection) -> Result<Mark, String> {
        let (at, cpu) = (Instant::now(), process_cpu());
        Ok(Mark { at, cpu, server_cpu: control.server_cpu().await? })
    }
}

/// One connection's part: warm up, wait for the others, then the measured requests, whose
/// latencies it returns with the connection (closed once the clock has stopped).
async fn run_connection(
    mut conn: Connection,
    args: Arc<ClientArgs>,
    index: usize,
    gates: Arc<[Barrier; 2]>,
    done: Arc<AtomicUsize>,
) -> Result<(Connection, Vec<Duration>), String> {
    let body = pattern(args.body, index);
    let expected = digest(&body);
    let mut warm = Ok(());
    for _ in 0..args.warmup {
        warm = conn.post(&body, &expected).await;
        if warm.is_err() {
            break;
        }
    }
    // Meet the others even after a failure, so that the run ends with this error.
    gates[0].wait().await;
    gates[1].wait().await;
    warm.map_err(|err| format!("connection {index}, warm-up: {err}"))?;
    let mut latencies = Vec::with_capacity(args.requests);
    for i in 0..args.requests {
        let start = Instant::now();
        conn.post(&body, &expected).await.map_err(|err| format!("connection {index}, request {i}: {err}"))?;
        latencies.push(start.elapsed());
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok((conn, latencies))
}

async fn client(args: ClientArgs) -> Result<(), String> {
    let args = Arc::new(args);
    let mut control = Connection::open(&args).await?;
    let mut conns = Vec::with_capacity(args.conns);
    for _ in 0..args.conns {
        conns.push(Connection::open(&args).await?);
    }
    // Every connection was checked against the provider; name what the first one got.
    let transport = conns[0].transport.clone();
    let gates = Arc::new([Barrier::new(args.conns + 1), Barrier::new(args.conns + 1)]);
    let progress: Vec<Arc<AtomicUsize>> = (0..args.conns).map(|_| Arc::default()).collect();
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(i, conn)| {
            let work =
                run_connection(conn, Arc::clone(&args), i, Arc::clone(&gates), Arc::clone(&progress[i]));
            tokio::spawn(work)
        })
        .collect();
    let run = async {
        gates[0].wait().await;
        let start = Mark::start(&mut control).await?;
        gates[1].wait().await;
        let mut latencies = Vec::with_capacity(args.conns * args.requests);
        let mut finished = Vec::with_capacity(args.conns);
        for task in tasks {
            let (conn, times) = task.await.map_err(|err| format!("a connection's task failed: {err}"))??;
            latencies.extend(times);
            finished.push(conn);
        }
        let end = Mark::end(&mut control).await?;
        for conn in finished {
            conn.close().await;
        }
        control.close().await;
        Ok::<_, String>((start, end, latencies))
    };
    let (start, end, mut latencies) = match tokio::time::timeout(args.timeout, run).await {
        Ok(result) => result?,
        Err(_) => {
            let counts: Vec<usize> = progress.iter().map(|p| p.load(Ordering::Relaxed)).collect();
            return Err(format!(
                "timed out after {:?}; measured requests done per connection (of {}): {counts:?}",
                args.timeout, args.requests
            ));
        }
    };
    latencies.sort_unstable();
    let quantile = |q: f64| {
        let rank = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len());
        latencies[rank - 1].as_secs_f64() * 1e6
    };
    let total = latencies.len();
    let secs = (end.at - start.at).as_secs_f64();
    let cpu = (end.cpu - start.cpu).as_secs_f64();
    let server_cpu = end.server_cpu.saturating_sub(start.server_cpu).as_secs_f64();
    let per_request = |seconds: f64| seconds * 1e6 / total as f64;
    let (rate, median, p99) = (total as f64 / secs, quantile(0.5), quantile(0.99));
    let (p90, p999) = (quantile(0.9), quantile(0.999));
    if args.json {
        println!(
            "{{\"provider\":\"{}\",\"transport\":\"{transport}\",\"conns\":{},\"body\":{},\"requests\":{total},\
             \"secs\":{secs:.4},\"req_per_s\":{rate:.1},\"lat_us\":{{\"median\":{median:.2},\"p90\":{p90:.2},\"p99\":{p99:.2},\"p999\":{p999:.2}}},\
             \"cpu_s\":{cpu:.4},\"server_cpu_s\":{server_cpu:.4},\"cpu_us_per_req\":{:.2},\
             \"server_cpu_us_per_req\":{:.2}}}",
            args.provider.name(),
            args.conns,
            args.body,
            per_request(cpu),
            per_request(server_cpu),
        );
    } else {
        println!(
            "{} ({transport}), {} connections x {} requests, body {} B: {rate:.0} requests/s over {secs:.2} s\n\
             latency median {median:.1} us, p90 {p90:.1} us, p99 {p99:.1} us, p99.9 {p999:.1} us\n\
             CPU client {cpu:.2} s ({:.1} us/request), server {server_cpu:.2} s ({:.1} us/request)",
            args.provider.name(),
            args.conns,
            args.requests,
            args.body,
            per_request(cpu),
            per_request(server_cpu),
        );
    }
    Ok(())
}
