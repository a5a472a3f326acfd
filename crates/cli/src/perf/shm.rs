//! `lightpath perf --provider shm`: opens a shared-memory device for the run and hands it to the
//! provider-neutral verbs tests in [`super::rdma`].
//!
//! Both processes must be on one host (same kernel boot and network/IPC namespaces): each side
//! sends its [`HostIdentity`] with its endpoint, and the server refuses a client from elsewhere
//! with a clear reason instead of a connection failure. The control connection is the usual TCP
//! one; the shm devices find each other through the GIDs in the endpoints (an shm GID names the
//! device's abstract Unix socket). `-d`, `-x`, `-m`, `--bind` and `--udp-port` do not apply to
//! shm and are ignored.

use std::net::TcpStream;

use anyhow::{anyhow, bail, Context, Result};
use lightpath_shm::{HostIdentity, ShmConfig, ShmDevice};
use lightpath_verbs::Mtu;
use serde::{Deserialize, Serialize};

use super::args::{Args, PerfTest, ProviderKind};
use super::control::{self, Answer, Hello};
use super::rdma::{self, RdmaEndpoint, Side};
use super::report::{Reporter, SizeResult};
use super::session;

/// What each side sends: where it runs, and its queue pair and region.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct ShmEndpoint {
    /// [`HostIdentity`] as text.
    host: String,
    rdma: RdmaEndpoint,
}

/// Runs the server or the client side.
pub fn run(args: &Args) -> Result<()> {
    match &args.server {
        None => {
            let (stream, hello) = session::accept_client(args, usable_endpoint)?;
            serve_hello(stream, hello, args.test)
        }
        Some(server) => {
            let stream = session::connect(args, server)?;
            let mut reporter = Reporter::new(args.json);
            client_stream(stream, args.test, &args.plan(), args.tx_depth, |r| reporter.print(r))
        }
    }
}

fn open() -> Result<ShmDevice> {
    ShmDevice::open(ShmConfig::default()).context("cannot open an shm device")
}

fn here() -> Result<HostIdentity> {
    HostIdentity::current().context("cannot determine this host's identity")
}

/// Checks that the peer runs where shm can reach it.
fn same_host(peer: &ShmEndpoint, here: &HostIdentity) -> Result<()> {
    let theirs: HostIdentity = peer.host.parse().map_err(|err: String| anyhow!(err))?;
    if !here.can_share_with(&theirs) {
        bail!(
            "shm needs both processes on one host and in one network and IPC namespace; \
             this side is {here}, the peer is {theirs} (use --provider soft or tcp)"
        );
    }
    Ok(())
}

/// Whether a client's hello carries an shm endpoint of a process this one can share memory
/// with (for `session::accept_client`: a client from another host or namespace is told why,
/// and the server goes on waiting).
fn usable_endpoint(hello: &Hello) -> std::result::Result<(), String> {
    let peer: ShmEndpoint = hello
        .endpoint
        .clone()
        .and_then(|e| serde_json::from_value(e).ok())
        .ok_or("the client sent no usable shm endpoint")?;
    let host = here().map_err(|err| format!("{err:#}"))?;
    same_host(&peer, &host).map_err(|err| format!("{err:#}"))
}

/// The server side on an accepted control connection.
pub fn serve_stream(mut stream: TcpStream, test: PerfTest) -> Result<()> {
    let hello: Hello = control::recv(&mut stream)?;
    serve_hello(stream, hello, test)
}

/// The server side once the client's hello has been read.
pub fn serve_hello(mut stream: TcpStream, hello: Hello, test: PerfTest) -> Result<()> {
    if let Err(reason) = control::check_hello(&hello, test, ProviderKind::Shm) {
        control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
        bail!("refused the client: {reason}");
    }
    let peer: ShmEndpoint = match hello.endpoint.clone().map(serde_json::from_value) {
        Some(Ok(peer)) => peer,
        _ => {
            let reason = "the client sent no usable shm endpoint".to_string();
            control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
            bail!(reason);
        }
    };
    let max_size = hello.plan.iter().map(|(size, _)| *size).max().unwrap_or(8);
    let opened = here().and_then(|host| {
        same_host(&peer, &host)?;
        let mut side = Side::new(open()?, max_size, hello.tx_depth, Mtu::Mtu4096)?;
        side.connect(&peer.rdma)?;
        Ok((host, side))
    });
    let (host, mut side) = match opened {
        Ok(opened) => opened,
        Err(err) => {
            control::send(&mut stream, &Answer::Reject { reason: format!("{err:#}") })?;
            return Err(err);
        }
    };
    let mine = ShmEndpoint { host: host.to_string(), rdma: side.endpoint() };
    control::send(&mut stream, &Answer::Accept { endpoint: Some(serde_json::to_value(mine)?) })?;
    rdma::server_run(&mut side, &mut stream, hello.test, &hello.plan)
}

/// The client side on a connected control connection; `on_result` gets each size's result.
pub fn client_stream(
    mut stream: TcpStream,
    test: PerfTest,
    plan: &[(usize, u64)],
    tx_depth: u32,
    on_result: impl FnMut(&SizeResult),
) -> Result<()> {
    let host = here()?;
    let max_size = plan.iter().map(|(size, _)| *size).max().unwrap_or(8);
    let mut side = Side::new(open()?, max_size, tx_depth, Mtu::Mtu4096)?;
    let mine = ShmEndpoint { host: host.to_string(), rdma: side.endpoint() };
    let hello = Hello {
        magic: control::MAGIC.into(),
        version: control::VERSION,
        test,
        provider: ProviderKind::Shm,
        plan: plan.to_vec(),
        tx_depth,
        cpu: true,
        endpoint: Some(serde_json::to_value(mine)?),
    };
    control::send(&mut stream, &hello)?;
    let peer: ShmEndpoint = match control::recv::<Answer>(&mut stream)? {
        Answer::Accept { endpoint: Some(endpoint) } => serde_json::from_value(endpoint)?,
        Answer::Accept { endpoint: None } => bail!("the server sent no shm endpoint"),
        Answer::Reject { reason } => bail!("the server refused: {reason}"),
    };
    same_host(&peer, &host)?;
    side.connect(&peer.rdma)?;
    let plan = rdma::ClientPlan { test, provider: ProviderKind::Shm, sizes: plan, depth: tx_depth };
    rdma::client_run(&mut side, &mut stream, plan, &peer.rdma, on_result)
}
