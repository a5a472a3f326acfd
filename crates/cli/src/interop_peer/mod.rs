//! `lightpath interop-peer`: the Lightpath side of the interop test protocol
//! (interop/PROTOCOL.md), whose other side is `interop/c/verbs_peer.c` on Linux rxe.
//!
//! The server is the responder: it registers the target memory, posts the receives and checks
//! at the end what arrived ([`server`]). The client is the requester: it runs one operation at
//! a time and checks every completion, READ datum and atomic original value ([`client`]). Both
//! take verbs_peer's options (plus `--bind`, `--udp-port` and `--provider`), print verbs_peer's
//! messages with `lightpath interop-peer` in place of `verbs_peer`, end with a line starting
//! `PASS` or `FAIL`, and exit 0 only if both sides passed, 1 on a verification failure, 2 on a
//! setup or usage error.

mod client;
mod known;
mod line;
mod op;
mod peer;
mod server;

use std::fmt::Display;
use std::io::Write;
use std::net::IpAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use lightpath_verbs::Mtu;

use crate::pingpong::endpoint::{c_number, Placement, ProviderChoice};
use crate::pingpong::source::{DeviceSource, IbvSource, SoftSource};
use lightpath_soft::ProgressMode;
use op::Op;
use peer::Shape;

/// Default TCP port of the exchange.
const DEFAULT_TCP_PORT: u16 = 18516;
/// Verification failures printed; the rest are only counted.
const PRINTED_FAILURES: u32 = 20;
/// Grace after `-t` before the backstop ends a run that is stuck anyway (as verbs_peer's alarm).
const BACKSTOP_GRACE: Duration = Duration::from_secs(10);

/// Options of `lightpath interop-peer` (those of verbs_peer, plus the provider's).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Server to connect to (this side is then the requester); without it, this side is the
    /// server and responder.
    pub server: Option<String>,
    /// Operation: send, send_imm, write, write_imm, read, cmp_swap or fetch_add.
    #[arg(short = 'o', long = "op", default_value = "send", value_parser = Op::parse)]
    pub op: Op,
    /// Bytes per operation (default: read 1048576, atomics 8, others 10000).
    #[arg(short = 's', long = "size", value_parser = c_number::<u64>)]
    pub size: Option<u64>,
    /// Iterations (1 to 65535).
    #[arg(short = 'n', long = "iters", default_value = "5", value_parser = c_number::<u32>)]
    pub iters: u32,
    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096; the smaller of both sides' is used.
    #[arg(short = 'm', long = "mtu", default_value = "1024", value_parser = c_number::<u32>)]
    pub mtu: u32,
    /// GID index (a soft device has one GID, index 0).
    #[arg(short = 'g', long = "gid-index", value_parser = c_number::<u32>)]
    pub gid_index: Option<u32>,
    /// Device: a soft device name (soft-IP, soft-IP-UDPPORT, IP or IP:UDPPORT).
    #[arg(short = 'd', long = "ib-dev", conflicts_with_all = ["bind", "udp_port"])]
    pub device: Option<String>,
    /// Port of the device (a soft device has one: 1).
    #[arg(short = 'i', long = "ib-port", default_value = "1", value_parser = c_number::<u8>)]
    pub ib_port: u8,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_TCP_PORT, value_parser = c_number::<u16>)]
    pub port: u16,
    /// Timeout in seconds for each phase (accept, exchange, operations).
    #[arg(short = 't', long = "timeout", default_value = "60", value_parser = c_number::<u64>)]
    pub timeout: u64,
    /// QP retry_cnt, 0 to 7.
    #[arg(short = 'R', long = "retry-cnt", default_value = "7", value_parser = c_number::<u8>)]
    pub retry_cnt: u8,
    /// Print the exchanged lines.
    #[arg(short = 'v', long = "verbose")]
    pub verbose: bool,
    /// Client only (ignored by the server): make one deliberate mistake in iteration 0, so
    /// the run must FAIL.
    #[arg(short = 'x', long = "inject-fault")]
    pub inject_fault: bool,
    /// RDMA provider.
    #[arg(long, value_enum, default_value = "soft")]
    pub provider: ProviderChoice,
    /// Local IPv4 address of the soft provider, which gives its GID ::ffff:ADDR (default: the
    /// client's side of the TCP connection; for the server, the address the client reached).
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// UDP port of the soft provider (RoCE uses 4791; both sides must agree).
    #[arg(long, default_value_t = lightpath_soft::ROCE_PORT)]
    pub udp_port: u16,
}

/// Which side this process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
}

impl Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Server => "server",
            Role::Client => "client",
        })
    }
}

/// The checked options.
#[derive(Debug)]
pub struct Config {
    pub shape: Shape,
    /// This side's `-m`, in bytes.
    pub mtu: u32,
    pub placement: Placement,
    pub port_num: u8,
    pub tcp_port: u16,
    pub timeout: Duration,
    pub retry_cnt: u8,
    pub inject_fault: bool,
    pub server: Option<String>,
}

impl Args {
    /// Checks the options as verbs_peer does, and the provider's limits.
    fn config(&self) -> Result<Config> {
        if Mtu::from_bytes(self.mtu).is_none() {
            bail!("-m must be 256, 512, 1024, 2048 or 4096");
        }
        let size = if self.op.is_atomic() {
            if self.size.is_some_and(|size| size != 0 && size != 8) {
                bail!("atomics operate on 8 bytes; -s must be 8 (or left out)");
            }
            8
        } else {
            self.size.filter(|&size| size != 0).unwrap_or(self.op.default_size())
        };
        if self.retry_cnt > 7 {
            bail!("-R must be 0..7");
        }
        if self.iters == 0 || self.iters > 0xFFFF {
            bail!("-n must be 1..65535");
        }
        if size > 1 << 30 || size * u64::from(self.iters) > 1 << 31 {
            bail!("size * iterations must stay below 2 GiB");
        }
        let soft = self.provider == ProviderChoice::Soft;
        if soft && self.gid_index.is_some_and(|index| index != 0) {
            bail!("-g: a soft device has one GID, index 0 (its address, see --bind)");
        }
        if soft && self.ib_port != 1 {
            bail!("-i: a soft device has one port, number 1");
        }
        if !soft && (self.bind.is_some() || self.udp_port != lightpath_soft::ROCE_PORT) {
            bail!(
                "--bind and --udp-port place a soft device; an ibverbs device is chosen with -d, -i and -g"
            );
        }
        if self.timeout == 0 {
            bail!("-t must be at least 1 second");
        }
        Ok(Config {
            shape: Shape { op: self.op, size, iters: self.iters },
            mtu: self.mtu,
            placement: match self.provider {
                ProviderChoice::Soft => {
                    Placement::from_options(self.device.as_deref(), self.bind, self.udp_port)?
                }
                ProviderChoice::Ibverbs => Placement::from_options(None, None, self.udp_port)?,
            },
            port_num: self.ib_port,
            tcp_port: self.port,
            timeout: Duration::from_secs(self.timeout),
            retry_cnt: self.retry_cnt,
            inject_fault: self.inject_fault,
            server: self.server.clone(),
        })
    }
}

/// Messages and the count of verification failures.
#[derive(Debug)]
pub struct Report {
    role: Role,
    verbose: bool,
    failures: u32,
}

impl Report {
    fn new(role: Role, verbose: bool) -> Self {
        Self { role, verbose, failures: 0 }
    }

    /// Prints a progress message.
    pub fn say(&self, text: impl Display) {
        outln!("lightpath interop-peer {}: {text}", self.role);
        let _ = std::io::stdout().flush();
    }

    /// Prints a message with `-v` only.
    pub fn verbose(&self, text: impl Display) {
        if self.verbose {
            self.say(text);
        }
    }

    /// Records a verification failure (the first few are printed).
    pub fn fail(&mut self, text: impl Display) {
        self.failures += 1;
        if self.failures <= PRINTED_FAILURES {
            self.say(format_args!("FAIL: {text}"));
        }
    }

    /// Verification failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// Refuses a peer that runs another operation, size or count.
pub fn check_agreement(shape: &Shape, remote: &line::EndpointLine) -> Result<()> {
    if remote.op != shape.op || remote.size != shape.size || remote.iters != shape.iters {
        bail!(
            "peer wants op={} size={} iters={}, we have op={} size={} iters={}",
            remote.op,
            remote.size,
            remote.iters,
            shape.op,
            shape.size,
            shape.iters
        );
    }
    Ok(())
}

/// Ends a run that outlives every bounded wait (a bug, or a peer feeding data forever), as
/// verbs_peer's alarm does.
fn start_backstop(timeout: Duration) {
    let limit = timeout + BACKSTOP_GRACE;
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        outln!("lightpath interop-peer: FAIL: overall timeout (-t) expired");
        let _ = std::io::stdout().flush();
        std::process::exit(1);
    });
}

fn run_role<S: DeviceSource>(role: Role, config: &Config, source: &S, report: &mut Report) -> Result<bool> {
    match role {
        Role::Server => server::run(config, source, report),
        Role::Client => client::run(config, source, report),
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> Result<ExitCode> {
    let role = if args.server.is_some() { Role::Client } else { Role::Server };
    let mut report = Report::new(role, args.verbose);
    let outcome = args.config().and_then(|config| {
        start_backstop(config.timeout);
        match args.provider {
            ProviderChoice::Soft => {
                let mtu = Mtu::from_bytes(config.mtu).unwrap_or(Mtu::Mtu1024);
                let source = SoftSource { placement: config.placement, mtu, mode: ProgressMode::Thread };
                run_role(role, &config, &source, &mut report)
            }
            ProviderChoice::Ibverbs => {
                let source =
                    IbvSource { device: args.device.clone(), port: args.ib_port, gid_index: args.gid_index };
                run_role(role, &config, &source, &mut report)
            }
        }
    });
    match outcome {
        Ok(true) => Ok(ExitCode::SUCCESS),
        Ok(false) => Ok(ExitCode::from(1)),
        Err(err) => {
            report.say(format_args!("ERROR: {err:#}"));
            outln!("FAIL lightpath interop-peer {role} op={} (setup error)", args.op);
            Ok(ExitCode::from(2))
        }
    }
}
