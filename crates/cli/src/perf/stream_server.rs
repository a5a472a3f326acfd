//! The server of `lightpath perf stream_*`, in two shapes (`--server`):
//!
//! * `threads` (default): a thread per connection, blocking `lightpath::Stream` calls;
//! * `loop`: one event loop — a tokio current-thread runtime, one task per connection on
//!   `lightpath::tokio` streams (accepting, whose negotiation blocks, runs on tokio's blocking
//!   pool; everything else on the one thread).
//!
//! Over `--provider tcp` the same shapes serve plain kernel TCP sockets (`std::net` threads or
//! tokio's `TcpListener`): the baseline, with nothing of Lightpath in the data path.
//!
//! Both serve one client run: the first plan says how many connections the run has, and the
//! server exits once that many have been served. A connection that is not a Lightpath perf
//! client — a port scanner, a plain TCP client sending garbage or nothing, a client asking for
//! another test — is logged and dropped, and the server goes on: each connection reads its
//! plan on its own thread or task, within [`PLAN_PATIENCE`].

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use lightpath::{Listener, Options, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::conn::{is_kernel_tcp, AsyncConn, Conn, KernelTcp};
use super::{cpu, warmup, Plan, ServerInfo, ServerShape, StreamArgs, StreamTest, MAGIC, PROBE};

/// How long a new connection may take to send its plan.
pub const PLAN_PATIENCE: Duration = Duration::from_secs(10);

/// What the connections tell the main thread (or task).
enum Event {
    /// A connection's plan was accepted.
    Started { conns: usize, peer: SocketAddr, transport: String },
    /// A connection is done.
    Finished(Result<()>),
}

/// Counts connections until the run is served; returns the first failure, if any.
struct Run {
    expected: Option<usize>,
    started: usize,
    finished: usize,
    failure: Option<anyhow::Error>,
}

impl Run {
    fn new() -> Self {
        Self { expected: None, started: 0, finished: 0, failure: None }
    }

    /// Takes one event; true once the run is over.
    fn take(&mut self, event: Event) -> bool {
        match event {
            Event::Started { conns, peer, transport } => {
                self.started += 1;
                if self.expected.is_none() {
                    eprintln!("lightpath perf: client {peer} connected over {transport}");
                    self.expected = Some(conns);
                }
            }
            Event::Finished(result) => {
                self.finished += 1;
                if let Err(err) = result {
                    self.failure.get_or_insert(err);
                }
            }
        }
        // Done when every connection of the run has been served, or when one failed and no
        // other is still running (the client is gone; the rest will never come).
        self.expected.is_some_and(|n| self.finished >= n)
            || (self.failure.is_some() && self.finished == self.started)
    }

    fn result(self) -> Result<ExitCode> {
        match self.failure {
            Some(err) => Err(err),
            None => Ok(ExitCode::SUCCESS),
        }
    }
}

fn listen_addr(args: &StreamArgs) -> SocketAddr {
    SocketAddr::new(args.bind.unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED)), args.port)
}

/// Runs the server in the shape `--server` asks for.
pub fn serve(args: &StreamArgs, options: &Options) -> Result<ExitCode> {
    let shape = args.shape.unwrap_or(ServerShape::Threads);
    match shape {
        ServerShape::Threads => serve_threads(args, options),
        ServerShape::Loop => serve_loop(args, options),
    }
}

fn parse_plan(hello: &[u8]) -> Result<Plan> {
    let plan: Plan = serde_json::from_slice(hello).context("not a lightpath perf stream client")?;
    ensure!(plan.magic == MAGIC, "not a lightpath perf stream client");
    ensure!(plan.conns >= 1 && plan.conns <= 100_000, "implausible connection count {}", plan.conns);
    ensure!(plan.sizes.iter().all(|&(size, _)| size > 0 && size <= 8 << 20), "message size out of range");
    Ok(plan)
}

fn info(shape: ServerShape, error: Option<String>) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(&ServerInfo { server: shape, error })?)
}

/// A Lightpath server drops plain TCP clients (a kernel-TCP perf client, a port scanner).
fn not_lightpath(transport: Transport) -> Result<()> {
    if transport == Transport::PlainTcp {
        bail!("a plain TCP client, not a Lightpath peer (a perf client with --provider tcp needs a server with it too)");
    }
    Ok(())
}

// ---- a thread per connection ----

fn serve_threads(args: &StreamArgs, options: &Options) -> Result<ExitCode> {
    let addr = listen_addr(args);
    let (events, arrivals) = mpsc::channel::<Event>();
    let test = args.test;
    if is_kernel_tcp(&args.provider) {
        let listener = std::net::TcpListener::bind(addr)
            .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", args.port)))
            .with_context(|| format!("cannot listen on {addr}"))?;
        spawn_acceptor(test, events, move || {
            let (tcp, peer) = listener.accept()?;
            Ok((KernelTcp::new(tcp)?, peer))
        })?;
    } else {
        let listener = Listener::bind_with(addr, options.clone())
            .or_else(|_| Listener::bind_with(("0.0.0.0", args.port), options.clone()))
            .with_context(|| format!("cannot listen on {addr}"))?;
        spawn_acceptor(test, events, move || loop {
            let (stream, peer) = listener.accept()?;
            match not_lightpath(stream.transport()) {
                Ok(()) => return Ok((stream, peer)),
                Err(err) => eprintln!("lightpath perf: dropped a connection from {peer}: {err:#}"),
            }
        })?;
    }
    eprintln!(
        "lightpath perf: waiting for a client on port {} ({} over {}, a thread per connection)",
        args.port,
        args.test.name(),
        args.provider
    );
    let mut run = Run::new();
    loop {
        let event = arrivals.recv().map_err(|_| anyhow!("the acceptor thread stopped"))?;
        if run.take(event) {
            return run.result();
        }
    }
}

/// Starts the thread that accepts connections and gives each a thread of its own. It is
/// blocked in `accept` when the run ends; the process exits with it.
fn spawn_acceptor<C: Conn + 'static>(
    test: StreamTest,
    events: mpsc::Sender<Event>,
    mut accept: impl FnMut() -> std::io::Result<(C, SocketAddr)> + Send + 'static,
) -> Result<()> {
    std::thread::Builder::new().name("perf-accept".into()).spawn(move || loop {
        match accept() {
            Ok((stream, peer)) => {
                let events = events.clone();
                let _ = std::thread::Builder::new()
                    .name("perf-conn".into())
                    .spawn(move || serve_one(stream, peer, test, &events));
            }
            Err(err) => {
                eprintln!("lightpath perf: accept failed: {err}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })?;
    Ok(())
}

/// One connection of the threaded server, from its plan to its close.
fn serve_one<C: Conn>(mut stream: C, peer: SocketAddr, test: StreamTest, events: &mpsc::Sender<Event>) {
    let plan = match handshake(&mut stream, test) {
        Ok(plan) => plan,
        Err(err) => {
            eprintln!("lightpath perf: dropped a connection from {peer}: {err:#}");
            return;
        }
    };
    let transport = stream.transport_name();
    if events.send(Event::Started { conns: plan.conns, peer, transport }).is_err() {
        return;
    }
    let _ = events.send(Event::Finished(serve_conn(stream, &plan)));
}

/// Reads and checks a connection's plan (within [`PLAN_PATIENCE`]) and answers it.
fn handshake(stream: &mut impl Conn, test: StreamTest) -> Result<Plan> {
    stream.set_read_timeout(Some(PLAN_PATIENCE))?;
    let hello = stream.recv_msg();
    stream.set_read_timeout(None)?;
    let hello = match hello {
        Ok(Some(hello)) => hello,
        Ok(None) => bail!("the client closed before its plan"),
        Err(err) if matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            bail!("no plan within {} s", PLAN_PATIENCE.as_secs())
        }
        Err(err) => return Err(err.into()),
    };
    let plan = parse_plan(&hello)?;
    if let Err(reason) = check_plan(&plan, test, ServerShape::Threads) {
        if plan.reply {
            let _ = stream.send_msg(&info(ServerShape::Threads, Some(reason.clone()))?);
        }
        bail!("refused: {reason}");
    }
    if plan.reply {
        stream.send_msg(&info(ServerShape::Threads, None)?)?;
    }
    Ok(plan)
}

/// Checks a plan against what this server was started for; the reason goes back to the client.
fn check_plan(plan: &Plan, test: StreamTest, shape: ServerShape) -> std::result::Result<(), String> {
    if plan.test != test {
        return Err(format!("client runs {} but this server runs {}", plan.test.name(), test.name()));
    }
    if plan.zero_copy && shape == ServerShape::Loop {
        return Err("--zero-copy is served by --server threads only".into());
    }
    Ok(())
}

/// Answers one CPU probe.
fn answer_probe(stream: &mut impl Conn) -> Result<()> {
    let probe = stream.recv_msg()?.context("the client closed instead of sending a CPU probe")?;
    ensure!(probe == PROBE, "expected a CPU probe from the client");
    stream.send_msg(&cpu::encode(cpu::process_cpu()))?;
    Ok(())
}

/// Serves one connection's plan.
fn serve_conn(mut stream: impl Conn, plan: &Plan) -> Result<()> {
    if plan.zero_copy {
        return stream.serve_zero_copy(plan);
    }
    for &(size, iters) in &plan.sizes {
        let mut buf = vec![0u8; size];
        match plan.test {
            StreamTest::Lat | StreamTest::Rr => {
                for _ in 0..warmup(iters) {
                    stream.read_exact(&mut buf)?;
                    stream.write_all(&buf)?;
                }
                if plan.cpu_probe {
                    answer_probe(&mut stream)?;
                }
                for _ in 0..iters {
                    stream.read_exact(&mut buf)?;
                    stream.write_all(&buf)?;
                }
            }
            StreamTest::Bw => {
                if plan.cpu_probe {
                    answer_probe(&mut stream)?;
                }
                for _ in 0..iters {
                    stream.read_exact(&mut buf)?;
                }
                stream.write_all(&crc32fast::hash(&buf).to_be_bytes())?;
            }
        }
        if plan.cpu_probe {
            answer_probe(&mut stream)?;
        }
    }
    // Stay until the client closes, so its last records (its close among them) are
    // acknowledged before this process exits and takes its queue pairs with it.
    let mut rest = [0u8; 64];
    while matches!(stream.read(&mut rest), Ok(n) if n > 0) {}
    Ok(())
}

// ---- one event loop ----

fn serve_loop(args: &StreamArgs, options: &Options) -> Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let test = args.test;
    let result = runtime.block_on(async {
        let addr = listen_addr(args);
        let (events, mut arrivals) = tokio::sync::mpsc::unbounded_channel::<Event>();
        if is_kernel_tcp(&args.provider) {
            let listener = match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => listener,
                Err(_) => tokio::net::TcpListener::bind(("0.0.0.0", args.port))
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?,
            };
            tokio::spawn(async move {
                loop {
                    match listener
                        .accept()
                        .await
                        .and_then(|(tcp, peer)| tcp.set_nodelay(true).map(|()| (tcp, peer)))
                    {
                        Ok((stream, peer)) => {
                            tokio::spawn(serve_one_async(stream, peer, test, events.clone()));
                        }
                        Err(err) => accept_failed(err).await,
                    }
                }
            });
        } else {
            let listener = match lightpath::tokio::Listener::bind_with(addr, options.clone()).await {
                Ok(listener) => listener,
                Err(_) => lightpath::tokio::Listener::bind_with(("0.0.0.0", args.port), options.clone())
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?,
            };
            tokio::spawn(async move {
                loop {
                    match listener.accept().await {
                        Ok((stream, peer)) => match not_lightpath(stream.transport()) {
                            Ok(()) => {
                                tokio::spawn(serve_one_async(stream, peer, test, events.clone()));
                            }
                            Err(err) => {
                                eprintln!("lightpath perf: dropped a connection from {peer}: {err:#}")
                            }
                        },
                        Err(err) => accept_failed(err).await,
                    }
                }
            });
        }
        eprintln!(
            "lightpath perf: waiting for a client on port {} ({} over {}, one event loop)",
            args.port,
            test.name(),
            args.provider
        );
        let mut run = Run::new();
        loop {
            let event = arrivals.recv().await.ok_or_else(|| anyhow!("the acceptor task stopped"))?;
            if run.take(event) {
                return run.result();
            }
        }
    });
    // The acceptor task and connections still closing are dropped, not waited for.
    runtime.shutdown_background();
    result
}

async fn accept_failed(err: std::io::Error) {
    eprintln!("lightpath perf: accept failed: {err}");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

async fn serve_one_async<S: AsyncConn>(
    mut stream: S,
    peer: SocketAddr,
    test: StreamTest,
    events: tokio::sync::mpsc::UnboundedSender<Event>,
) {
    let plan = match handshake_async(&mut stream, test).await {
        Ok(plan) => plan,
        Err(err) => {
            eprintln!("lightpath perf: dropped a connection from {peer}: {err:#}");
            return;
        }
    };
    let transport = stream.transport_name();
    if events.send(Event::Started { conns: plan.conns, peer, transport }).is_err() {
        return;
    }
    let _ = events.send(Event::Finished(serve_conn_async(stream, &plan).await));
}

async fn handshake_async(stream: &mut impl AsyncConn, test: StreamTest) -> Result<Plan> {
    let hello = match tokio::time::timeout(PLAN_PATIENCE, stream.recv_msg()).await {
        Ok(Ok(Some(hello))) => hello,
        Ok(Ok(None)) => bail!("the client closed before its plan"),
        Ok(Err(err)) => return Err(err.into()),
        Err(_) => bail!("no plan within {} s", PLAN_PATIENCE.as_secs()),
    };
    let plan = parse_plan(&hello)?;
    if let Err(reason) = check_plan(&plan, test, ServerShape::Loop) {
        if plan.reply {
            let _ = stream.send_msg(&info(ServerShape::Loop, Some(reason.clone()))?).await;
        }
        bail!("refused: {reason}");
    }
    if plan.reply {
        stream.send_msg(&info(ServerShape::Loop, None)?).await?;
    }
    Ok(plan)
}

async fn answer_probe_async(stream: &mut impl AsyncConn) -> Result<()> {
    let probe = stream.recv_msg().await?.context("the client closed instead of sending a CPU probe")?;
    ensure!(probe == PROBE, "expected a CPU probe from the client");
    stream.send_msg(&cpu::encode(cpu::process_cpu())).await?;
    Ok(())
}

/// [`serve_conn`] as a task of the event loop.
async fn serve_conn_async(mut stream: impl AsyncConn, plan: &Plan) -> Result<()> {
    for &(size, iters) in &plan.sizes {
        let mut buf = vec![0u8; size];
        match plan.test {
            StreamTest::Lat | StreamTest::Rr => {
                for _ in 0..warmup(iters) {
                    stream.read_exact(&mut buf).await?;
                    stream.write_all(&buf).await?;
                }
                if plan.cpu_probe {
                    answer_probe_async(&mut stream).await?;
                }
                for _ in 0..iters {
                    stream.read_exact(&mut buf).await?;
                    stream.write_all(&buf).await?;
                }
            }
            StreamTest::Bw => {
                if plan.cpu_probe {
                    answer_probe_async(&mut stream).await?;
                }
                for _ in 0..iters {
                    stream.read_exact(&mut buf).await?;
                }
                stream.write_all(&crc32fast::hash(&buf).to_be_bytes()).await?;
            }
        }
        if plan.cpu_probe {
            answer_probe_async(&mut stream).await?;
        }
    }
    // As the threaded server: stay until the client closes, then close cleanly (a dropped
    // tokio stream would close in the background, which this process may not outlive).
    let mut rest = [0u8; 64];
    while matches!(stream.read(&mut rest).await, Ok(n) if n > 0) {}
    let _ = stream.close().await;
    Ok(())
}
