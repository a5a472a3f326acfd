//! `lightpath pingpong`: rdma-core's `ibv_rc_pingpong`, interoperable with it, so that either
//! side of a ping-pong can be the real rdma-core tool (on rxe or a RoCE NIC) and the other
//! Lightpath.
//!
//! Same options (where they make sense for the provider), same out-of-band exchange over TCP
//! ([`oob`]), same queue-pair attributes and message pattern ([`traffic`]), and the same four
//! output lines ([`output`]): the local and remote address, then the bytes and iterations
//! summary. What differs: every wait is bounded (`--timeout`), a peer that is not a ping-pong
//! is named as such, and the soft provider's address is chosen as [`endpoint`] describes.

pub mod endpoint;
pub mod oob;
pub mod output;
pub(crate) mod source;
pub mod tcp;
pub mod traffic;

use std::net::{IpAddr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lightpath_soft::ProgressMode;
use lightpath_verbs::{Device, Mtu};

use endpoint::{c_number, random_psn, Placement, ProviderChoice};
use oob::PeerAddress;
use source::{DeviceSource, IbvSource, SoftSource};
use traffic::{PathOptions, PingPong, Waiting};

/// Largest message accepted by `-s` (two buffers of this size are allocated).
const MAX_SIZE: u32 = 1 << 30;

/// Options of `lightpath pingpong` (those of `ibv_rc_pingpong`, plus the provider's).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Server to connect to; without it this process is the server and waits for a client.
    pub server: Option<String>,
    /// Listen on / connect to this TCP port.
    #[arg(short = 'p', long = "port", default_value = "18515", value_parser = c_number::<u16>)]
    pub port: u16,
    /// Device: a soft device name (soft-IP, soft-IP-UDPPORT, IP or IP:UDPPORT);
    /// the alternative to --bind and --udp-port.
    #[arg(short = 'd', long = "ib-dev", conflicts_with_all = ["bind", "udp_port"])]
    pub device: Option<String>,
    /// Port of the device (a soft device has one: 1).
    #[arg(short = 'i', long = "ib-port", default_value = "1", value_parser = c_number::<u8>)]
    pub ib_port: u8,
    /// GID index (a soft device has one GID, index 0; its real GID is always sent).
    #[arg(short = 'g', long = "gid-idx", value_parser = c_number::<u32>)]
    pub gid_index: Option<u32>,
    /// Size of each message in bytes.
    #[arg(short = 's', long = "size", default_value = "4096", value_parser = c_number::<u32>)]
    pub size: u32,
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(short = 'm', long = "mtu", default_value = "1024", value_parser = c_number::<u32>)]
    pub mtu: u32,
    /// Receives to keep posted.
    #[arg(short = 'r', long = "rx-depth", default_value = "500", value_parser = c_number::<u32>)]
    pub rx_depth: u32,
    /// Number of exchanges.
    #[arg(short = 'n', long = "iters", default_value = "1000", value_parser = c_number::<u32>)]
    pub iters: u32,
    /// Service level.
    #[arg(short = 'l', long = "sl", default_value = "0", value_parser = c_number::<u8>)]
    pub sl: u8,
    /// Sleep on completion events instead of busy polling.
    #[arg(short = 'e', long = "events", action = clap::ArgAction::Count)]
    pub events: u8,
    /// Validate the received buffer: the client marks the first byte of every 4 KiB page, the
    /// server reports unmarked pages after the run ("invalid data in page N").
    #[arg(short = 'c', long = "chk")]
    pub check: bool,
    /// Completion timestamps (not supported).
    #[arg(short = 't', long = "ts")]
    pub timestamps: bool,
    /// Device memory (not supported).
    #[arg(short = 'j', long = "dm")]
    pub device_memory: bool,
    /// On-demand paging (not supported).
    #[arg(short = 'o', long = "odp")]
    pub odp: bool,
    /// Implicit on-demand paging (not supported).
    #[arg(short = 'O', long = "iodp")]
    pub implicit_odp: bool,
    /// Prefetch an on-demand paging region (not supported).
    #[arg(short = 'P', long = "prefetch")]
    pub prefetch: bool,
    /// The newer send API of libibverbs (accepted; the wire traffic is the same).
    #[arg(short = 'N', long = "new_send")]
    pub new_send: bool,
    /// RDMA provider.
    #[arg(long, value_enum, default_value = "soft")]
    pub provider: ProviderChoice,
    /// Local address of the soft provider, which becomes its GID (default: the client's side of
    /// the TCP connection; for the server, the address the client connected to).
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// UDP port of the soft provider (RoCE uses 4791; both sides must agree).
    #[arg(long, default_value_t = lightpath_soft::ROCE_PORT)]
    pub udp_port: u16,
    /// Give up after this many seconds of waiting: for a client to connect (the server), for
    /// the out-of-band exchange, or for any completion during the run. A refused connection
    /// (server not started yet) is retried for at most 10 s.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
}

/// What `Args` says once checked.
#[derive(Debug)]
struct Plan {
    placement: Placement,
    path: PathOptions,
    waiting: Waiting,
    timeout: Duration,
}

impl Args {
    fn plan(&self) -> Result<Plan> {
        let refused = [
            (self.timestamps, "-t/--ts"),
            (self.device_memory, "-j/--dm"),
            (self.odp, "-o/--odp"),
            (self.implicit_odp, "-O/--iodp"),
            (self.prefetch, "-P/--prefetch"),
        ];
        if let Some((_, name)) = refused.iter().find(|(given, _)| *given) {
            bail!("{name} is not supported by lightpath pingpong");
        }
        let soft = self.provider == ProviderChoice::Soft;
        if soft && self.ib_port != 1 {
            bail!("-i {}: a soft device has one port, number 1", self.ib_port);
        }
        if soft && self.gid_index.is_some_and(|index| index != 0) {
            bail!(
                "-g {}: a soft device has one GID, index 0 (its address, see --bind)",
                self.gid_index.unwrap_or(0)
            );
        }
        if !soft && (self.bind.is_some() || self.udp_port != lightpath_soft::ROCE_PORT) {
            bail!(
                "--bind and --udp-port place a soft device; an ibverbs device is chosen with -d, -i and -g"
            );
        }
        let Some(mtu) = Mtu::from_bytes(self.mtu) else {
            bail!("-m {}: the path MTU must be 256, 512, 1024, 2048 or 4096", self.mtu);
        };
        if self.size == 0 || self.size > MAX_SIZE {
            bail!("-s {}: the message size must be 1 to {MAX_SIZE} bytes", self.size);
        }
        if self.iters == 0 || self.iters > i32::MAX as u32 {
            bail!("-n {}: the number of iterations must be at least 1", self.iters);
        }
        if self.rx_depth == 0 {
            bail!("-r 0: at least one receive must be posted");
        }
        if self.sl > 15 {
            bail!("-l {}: the service level is 0 to 15", self.sl);
        }
        if self.timeout == 0 {
            bail!("--timeout must be at least 1 second");
        }
        Ok(Plan {
            placement: match self.provider {
                ProviderChoice::Soft => {
                    Placement::from_options(self.device.as_deref(), self.bind, self.udp_port)?
                }
                ProviderChoice::Ibverbs => Placement::from_options(None, None, self.udp_port)?,
            },
            path: PathOptions { mtu, sl: self.sl, port_num: self.ib_port },
            waiting: if self.events > 0 { Waiting::Events } else { Waiting::BusyPoll },
            timeout: Duration::from_secs(self.timeout),
        })
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> Result<ExitCode> {
    let plan = args.plan()?;
    match args.provider {
        ProviderChoice::Soft => {
            let mode = match plan.waiting {
                Waiting::BusyPoll => ProgressMode::polling(),
                Waiting::Events => ProgressMode::Thread,
            };
            run_on(&args, &plan, &SoftSource { placement: plan.placement, mtu: plan.path.mtu, mode })?;
        }
        ProviderChoice::Ibverbs => {
            let source =
                IbvSource { device: args.device.clone(), port: args.ib_port, gid_index: args.gid_index };
            run_on(&args, &plan, &source)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run_on<S: DeviceSource>(args: &Args, plan: &Plan, source: &S) -> Result<()> {
    match &args.server {
        None => serve(args, plan, source),
        Some(server) => client(args, plan, source, server),
    }
}

/// One side before the exchange: its verbs objects and the address it will send.
struct Local<D: Device> {
    side: PingPong<D>,
    address: PeerAddress,
}

/// Creates the queue pair on `device` with its receives posted, and prints the local address
/// line.
fn prepare<D: Device>(args: &Args, plan: &Plan, device: D) -> Result<Local<D>> {
    let side = PingPong::new(device, args.size, args.rx_depth, plan.path.port_num)?;
    let address = side.address(random_psn());
    outln!("{}", output::local_line(&address));
    Ok(Local { side, address })
}

fn serve<S: DeviceSource>(args: &Args, plan: &Plan, source: &S) -> Result<()> {
    let deadline = Instant::now() + plan.timeout;
    // With a known place the device is ready before the client can connect, as in the C tool;
    // otherwise (a soft device without --bind) its address is the one the client reaches us at.
    let (local, mut stream) = match source.before_accept()? {
        Some(device) => {
            let local = prepare(args, plan, device)?;
            let listener = tcp::listen_any(args.port)?;
            (local, tcp::accept_one(&listener, deadline)?)
        }
        None => {
            let listener = tcp::listen_any(args.port)?;
            let stream = tcp::accept_one(&listener, deadline)?;
            (prepare(args, plan, source.for_server(&stream)?)?, stream)
        }
    };
    let remote = oob::read_address(&mut stream, deadline)?;
    local.side.connect(&remote, local.address.psn, plan.path)?;
    oob::write_address(&mut stream, &local.address)?;
    oob::read_done(&mut stream, deadline)?;
    drop(stream);
    outln!("{}", output::remote_line(&remote));
    exchange(args, plan, local.side, false)
}

fn client<S: DeviceSource>(args: &Args, plan: &Plan, source: &S, server: &str) -> Result<()> {
    let deadline = Instant::now() + plan.timeout;
    let mut stream: TcpStream = tcp::connect(server, args.port, deadline)?;
    let local = prepare(args, plan, source.for_client(&stream)?)?;
    oob::write_address(&mut stream, &local.address)?;
    let remote = oob::read_address(&mut stream, deadline)?;
    oob::write_done(&mut stream)?;
    drop(stream);
    outln!("{}", output::remote_line(&remote));
    local.side.connect(&remote, local.address.psn, plan.path)?;
    exchange(args, plan, local.side, true)
}

fn exchange<D: Device>(args: &Args, plan: &Plan, mut side: PingPong<D>, is_client: bool) -> Result<()> {
    if args.check && is_client {
        side.mark_pages()?;
    }
    let elapsed = side
        .run(args.iters, is_client, plan.waiting, plan.timeout)
        .with_context(|| format!("ping-pong of {} × {} bytes", args.iters, args.size))?;
    for line in output::summary_lines(args.size, args.iters, elapsed) {
        outln!("{line}");
    }
    if args.check && !is_client {
        // As the C tool: reported, but not an error.
        for page in side.unmarked_pages()? {
            outln!("invalid data in page {page}");
        }
    }
    Ok(())
}
