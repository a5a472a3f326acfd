//! `lightpath perf --provider ibverbs`: opens an RDMA device through libibverbs (loaded at run
//! time) and hands it to the provider-neutral verbs tests in [`super::rdma`], so the numbers are
//! comparable with perftest's on the same device.
//!
//! Device: `-d` (as perftest's `--ib-dev`), else the first one libibverbs lists. GID: `-x`, else
//! the port's RoCE v2 IPv4 GID, chosen automatically. Path MTU: `-m`, else the port's active MTU;
//! both sides use the smaller of their two.

use std::net::TcpStream;

use anyhow::{anyhow, bail, Context, Result};
use lightpath_ibverbs::{IbvConfig, IbvDevice, IbvProvider};
use lightpath_verbs::{Device, Mtu, Provider};

use super::args::{Args, PerfTest, ProviderKind};
use super::control::{self, Answer, Hello};
use super::rdma::{self, RdmaEndpoint, Side};
use super::report::{Reporter, SizeResult};
use super::session;

/// Which device a side opens.
#[derive(Debug, Clone, Default)]
pub struct EndpointOptions {
    /// Device name (default: the first device).
    pub device: Option<String>,
    /// GID index (default: automatic).
    pub gid_index: Option<u8>,
    /// Path MTU in bytes (default: the port's active MTU).
    pub mtu: Option<u32>,
}

impl EndpointOptions {
    fn from_args(args: &Args) -> Self {
        Self { device: args.device.clone(), gid_index: args.gid_index, mtu: args.mtu }
    }
}

/// Runs the server or the client side.
pub fn run(args: &Args) -> Result<()> {
    match &args.server {
        None => {
            let (stream, hello) = session::accept_client(args, rdma::usable_endpoint)?;
            serve_hello(stream, hello, &EndpointOptions::from_args(args), args.test)
        }
        Some(server) => {
            let stream = session::connect(args, server)?;
            let mut reporter = Reporter::new(args.json);
            let options = EndpointOptions::from_args(args);
            client_stream(stream, &options, args.test, &args.plan(), args.tx_depth, |r| reporter.print(r))
        }
    }
}

/// Opens the device the options name, and the path MTU to offer.
fn open(options: &EndpointOptions) -> Result<(IbvDevice, Mtu)> {
    let provider =
        IbvProvider::with_config(IbvConfig { port: None, gid_index: options.gid_index.map(u32::from) });
    let device = match &options.device {
        Some(name) => provider.open(name),
        None => provider.open_first(),
    }
    .map_err(|err| anyhow!("cannot open an ibverbs device: {err}"))?;
    let active = device.query_port(device.port())?.active_mtu;
    let mtu = match options.mtu {
        Some(bytes) => {
            Mtu::from_bytes(bytes).ok_or_else(|| anyhow!("MTU {bytes} is not an IB MTU"))?.min(active)
        }
        None => active,
    };
    let source = device.source_gid();
    eprintln!(
        "lightpath perf: ibverbs device {} port {} GID index {} ({}), path MTU up to {mtu}",
        device.name(),
        device.port(),
        source.index,
        source.gid
    );
    Ok((device, mtu))
}

/// The server side on an accepted control connection.
pub fn serve_stream(mut stream: TcpStream, options: &EndpointOptions, test: PerfTest) -> Result<()> {
    let hello: Hello = control::recv(&mut stream)?;
    serve_hello(stream, hello, options, test)
}

/// The server side once the client's hello has been read.
pub fn serve_hello(
    mut stream: TcpStream,
    hello: Hello,
    options: &EndpointOptions,
    test: PerfTest,
) -> Result<()> {
    if let Err(reason) = control::check_hello(&hello, test, ProviderKind::Ibverbs) {
        control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
        bail!("refused the client: {reason}");
    }
    let peer: RdmaEndpoint = match hello.endpoint.clone().map(serde_json::from_value) {
        Some(Ok(peer)) => peer,
        _ => {
            let reason = "the client sent no usable RDMA endpoint".to_string();
            control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
            bail!(reason);
        }
    };
    let max_size = hello.plan.iter().map(|(size, _)| *size).max().unwrap_or(8);
    let opened = open(options)
        .and_then(|(device, mtu)| Side::new(device, max_size, hello.tx_depth, mtu))
        .and_then(|mut side| side.connect(&peer).map(|()| side));
    let mut side = match opened {
        Ok(side) => side,
        Err(err) => {
            control::send(&mut stream, &Answer::Reject { reason: format!("{err:#}") })?;
            return Err(err);
        }
    };
    control::send(&mut stream, &Answer::Accept { endpoint: Some(serde_json::to_value(side.endpoint())?) })?;
    rdma::server_run(&mut side, &mut stream, hello.test, &hello.plan)
}

/// The client side on a connected control connection; `on_result` gets each size's result.
pub fn client_stream(
    mut stream: TcpStream,
    options: &EndpointOptions,
    test: PerfTest,
    plan: &[(usize, u64)],
    tx_depth: u32,
    on_result: impl FnMut(&SizeResult),
) -> Result<()> {
    let max_size = plan.iter().map(|(size, _)| *size).max().unwrap_or(8);
    let (device, mtu) = open(options)?;
    let mut side = Side::new(device, max_size, tx_depth, mtu).context("setting up the ibverbs side")?;
    let hello = Hello {
        magic: control::MAGIC.into(),
        version: control::VERSION,
        test,
        provider: ProviderKind::Ibverbs,
        plan: plan.to_vec(),
        tx_depth,
        cpu: true,
        endpoint: Some(serde_json::to_value(side.endpoint())?),
    };
    control::send(&mut stream, &hello)?;
    let peer: RdmaEndpoint = match control::recv::<Answer>(&mut stream)? {
        Answer::Accept { endpoint: Some(endpoint) } => serde_json::from_value(endpoint)?,
        Answer::Accept { endpoint: None } => bail!("the server sent no RDMA endpoint"),
        Answer::Reject { reason } => bail!("the server refused: {reason}"),
    };
    side.connect(&peer)?;
    let plan = rdma::ClientPlan { test, provider: ProviderKind::Ibverbs, sizes: plan, depth: tx_depth };
    rdma::client_run(&mut side, &mut stream, plan, &peer, on_result)
}
