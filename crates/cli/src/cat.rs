//! `lightpath cat`: netcat over Lightpath streams. `lightpath cat -l PORT` listens for one
//! connection, `lightpath cat HOST PORT` connects; either way stdin goes to the peer and the
//! peer's bytes go to stdout. When stdin ends the sending side is shut down (the peer reads end
//! of stream) and the command exits once the peer has closed its side too.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use lightpath::tokio::{Listener, Stream};
use lightpath::Options;
use tokio::io::AsyncWriteExt;

/// Options of `lightpath cat`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listen on PORT for one connection instead of connecting.
    #[arg(short = 'l', long)]
    pub listen: bool,
    /// HOST to connect to (or, with -l, the PORT to listen on).
    pub host: String,
    /// PORT to connect to.
    pub port: Option<u16>,
    /// Data transports to offer, best first (comma-separated: shm, ibverbs, soft, tcp; RDMA
    /// falls back to TCP). Default: the library's (shm for peers on this host, else ibverbs
    /// if a device serves the address, else soft; `LIGHTPATH_PROVIDERS` overrides).
    #[arg(long)]
    pub provider: Option<String>,
    /// Print the transport the connection got on stderr.
    #[arg(short = 'v', long)]
    pub verbose: bool,
}

/// Runs `lightpath cat`.
pub fn run(args: Args) -> Result<ExitCode> {
    let mut options = Options::default();
    if let Some(list) = &args.provider {
        options.providers = lightpath::options::parse_providers(list).map_err(anyhow::Error::msg)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let stream = if args.listen {
            if args.port.is_some() {
                bail!("with -l give only the port: lightpath cat -l PORT");
            }
            let port: u16 = args.host.parse().with_context(|| format!("{:?} is not a port", args.host))?;
            let listener = match Listener::bind_with(("::", port), options.clone()).await {
                Ok(listener) => listener,
                Err(_) => Listener::bind_with(("0.0.0.0", port), options.clone()).await?,
            };
            let (stream, peer) = listener.accept().await?;
            if args.verbose {
                eprintln!("lightpath cat: connection from {peer}");
            }
            stream
        } else {
            let Some(port) = args.port else { bail!("usage: lightpath cat HOST PORT (or -l PORT)") };
            Stream::connect_with((args.host.as_str(), port), &options)
                .await
                .with_context(|| format!("cannot connect to {}:{port}", args.host))?
        };
        if args.verbose {
            eprintln!("lightpath cat: transport {}", stream.transport());
        }
        let (mut reader, mut writer) = tokio::io::split(stream);
        let upstream = async {
            tokio::io::copy(&mut tokio::io::stdin(), &mut writer).await?;
            writer.shutdown().await
        };
        let downstream = async {
            let mut stdout = tokio::io::stdout();
            tokio::io::copy(&mut reader, &mut stdout).await?;
            stdout.flush().await
        };
        let (up, down) = tokio::join!(upstream, downstream);
        down.context("receiving")?;
        up.context("sending")?;
        Ok(ExitCode::SUCCESS)
    })
}
