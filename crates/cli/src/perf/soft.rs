//! `lightpath perf --provider soft`: opens a soft RoCE v2 device for the run and hands it to the
//! provider-neutral verbs tests in [`super::rdma`].
//!
//! Addresses: the server's UDP endpoint is the address the client reached it at (or `--bind`);
//! the client's is its side of the control connection (or `--bind`). On one host both would be
//! the same loopback address, and two soft devices cannot share an address and port, so a client
//! that would collide with its server moves to 127.0.0.2 (any 127/8 address is loopback on
//! Linux). The UDP port is the RoCE port, 4791, unless `--udp-port` says otherwise (both sides
//! must agree). The path MTU defaults to 4096 on loopback (no link limit) and 1024 elsewhere
//! (right for a 1500-byte Ethernet link).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};

use anyhow::{bail, Context, Result};
use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::Mtu;

use super::args::{Args, PerfTest, ProviderKind};
use super::control::{self, Answer, Hello};
use super::rdma::{self, RdmaEndpoint, Side};
use super::report::{Reporter, SizeResult};
use super::session;

/// Runs the server or the client side.
pub fn run(args: &Args) -> Result<()> {
    match &args.server {
        None => serve(args),
        Some(server) => client(args, server),
    }
}

/// Where a side's soft device lives.
#[derive(Debug, Clone, Copy)]
pub struct EndpointOptions {
    /// Local address (default: derived from the control connection, see the module doc).
    pub bind: Option<IpAddr>,
    /// UDP port of the RoCE endpoint.
    pub udp_port: u16,
    /// Path MTU in bytes: an IB size (256…4096) uses exactly that; another size up to 32 KiB
    /// asks for the Lightpath extension with a soft peer. Default: 4096 on loopback, else 1024,
    /// and towards a soft peer the largest the links of both sides carry (the extension).
    pub mtu: Option<u32>,
}

impl EndpointOptions {
    fn from_args(args: &Args) -> Self {
        Self { bind: args.bind, udp_port: args.udp_port, mtu: args.mtu }
    }
}

fn default_mtu(options: &EndpointOptions, ip: IpAddr) -> Mtu {
    match options.mtu {
        Some(bytes) => Mtu::from_bytes(bytes).or(Mtu::largest_fitting(bytes)).unwrap_or(Mtu::Mtu256),
        None if ip.is_loopback() => Mtu::Mtu4096,
        None => Mtu::Mtu1024,
    }
}

/// What this side offers a soft peer through the Lightpath extension: an explicit non-IB
/// `-m` as given (a size the link cannot carry is refused when the queue pair connects), no
/// extension for an explicit IB size, and by default what the device offers (the largest its
/// link carries, at most `PREFERRED_LIGHTPATH_PMTU`).
fn lightpath_offer(options: &EndpointOptions, device: &SoftDevice) -> Option<u32> {
    match options.mtu {
        Some(bytes) if Mtu::from_bytes(bytes).is_some() => None,
        Some(bytes) => Some(bytes),
        None => Some(device.preferred_lightpath_pmtu()),
    }
}

/// A soft side: the device and its verbs objects, with this side's Lightpath offer.
fn soft_side(options: &EndpointOptions, ip: IpAddr, max_size: usize, depth: u32) -> Result<Side<SoftDevice>> {
    let mtu = default_mtu(options, ip);
    let device = open_device(ip, options.udp_port, mtu)?;
    let offer = lightpath_offer(options, &device);
    Ok(Side::new(device, max_size, depth, mtu)?.with_lightpath_pmtu(offer))
}

/// Opens a soft device on `ip`, driven by the caller (the tests busy-poll, as perftest does).
pub fn open_device(ip: IpAddr, udp_port: u16, mtu: Mtu) -> Result<SoftDevice> {
    let mut config = SoftConfig::with_addr(SocketAddr::new(ip, udp_port));
    config.mtu = mtu;
    config.mode = ProgressMode::polling();
    SoftDevice::open(config).with_context(|| format!("cannot open a soft device on {ip} UDP port {udp_port}"))
}

fn serve(args: &Args) -> Result<()> {
    let (stream, hello) = session::accept_client(args, rdma::usable_endpoint)?;
    serve_hello(stream, hello, &EndpointOptions::from_args(args), args.test)
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
    if let Err(reason) = control::check_hello(&hello, test, ProviderKind::Soft) {
        control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
        bail!("refused the client: {reason}");
    }
    let peer: RdmaEndpoint = match hello.endpoint.clone().map(serde_json::from_value) {
        Some(Ok(peer)) => peer,
        _ => {
            let reason = "the client sent no usable soft endpoint".to_string();
            control::send(&mut stream, &Answer::Reject { reason: reason.clone() })?;
            bail!(reason);
        }
    };
    let ip = options.bind.unwrap_or(stream.local_addr()?.ip().to_canonical());
    let max_size = hello.plan.iter().map(|(size, _)| *size).max().unwrap_or(8);
    let opened = soft_side(options, ip, max_size, hello.tx_depth)
        .and_then(|mut side| side.connect(&peer).map(|()| side));
    let mut side = match opened {
        Ok(side) => side,
        Err(err) => {
            control::send(&mut stream, &Answer::Reject { reason: format!("{err:#}") })?;
            return Err(err);
        }
    };
    let endpoint = RdmaEndpoint { lightpath_soft: true, ..side.endpoint() };
    control::send(&mut stream, &Answer::Accept { endpoint: Some(serde_json::to_value(endpoint)?) })?;
    rdma::server_run(&mut side, &mut stream, hello.test, &hello.plan)
}

fn client(args: &Args, server: &str) -> Result<()> {
    let stream = session::connect(args, server)?;
    let mut reporter = Reporter::new(args.json);
    let options = EndpointOptions::from_args(args);
    client_stream(stream, &options, args.test, &args.plan(), args.tx_depth, |r| reporter.print(r))
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
    let server_ip = stream.peer_addr()?.ip().to_canonical();
    let ip = match options.bind {
        Some(ip) => ip,
        None => {
            let mine = stream.local_addr()?.ip().to_canonical();
            if mine == server_ip && mine.is_loopback() {
                if mine.is_ipv4() {
                    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))
                } else {
                    bail!("client and server would share {mine}; pass --bind with another local address")
                }
            } else {
                mine
            }
        }
    };
    let max_size = plan.iter().map(|(size, _)| *size).max().unwrap_or(8);
    let mut side = soft_side(options, ip, max_size, tx_depth)?;
    let hello = Hello {
        magic: control::MAGIC.into(),
        version: control::VERSION,
        test,
        provider: ProviderKind::Soft,
        plan: plan.to_vec(),
        tx_depth,
        cpu: true,
        endpoint: Some(serde_json::to_value(RdmaEndpoint { lightpath_soft: true, ..side.endpoint() })?),
    };
    control::send(&mut stream, &hello)?;
    let peer: RdmaEndpoint = match control::recv::<Answer>(&mut stream)? {
        Answer::Accept { endpoint: Some(endpoint) } => serde_json::from_value(endpoint)?,
        Answer::Accept { endpoint: None } => bail!("the server sent no soft endpoint"),
        Answer::Reject { reason } => bail!("the server refused: {reason}"),
    };
    side.connect(&peer)?;
    let plan = rdma::ClientPlan { test, provider: ProviderKind::Soft, sizes: plan, depth: tx_depth };
    rdma::client_run(&mut side, &mut stream, plan, &peer, on_result)
}
