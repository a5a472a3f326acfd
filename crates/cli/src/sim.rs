//! `lightpath sim`: runs the RC engine over the deterministic lossy network of
//! `lightpath-sim` for many seeds and reports which invariants held.
//!
//! Every seed is replayable: `--seed-start S --seeds 1` reruns seed S, and `--trace S` reruns
//! it printing every datagram. The exit code is 0 when every seed passed and 1 otherwise.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;

use anyhow::{bail, Context};
use lightpath_sim::{
    run_seed, AddressFamily, LinkConfig, OpKind, QpConfig, SeedReport, SimConfig, Summary, WorkloadConfig,
};
use lightpath_verbs::Mtu;
use serde_json::json;

/// Options of `lightpath sim`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Number of seeds to run.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    seed_start: u64,
    /// Probability that a datagram is lost (0..=1; 1 means nothing ever arrives).
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Probability that a datagram is duplicated.
    #[arg(long, default_value_t = 0.0)]
    dup: f64,
    /// Probability that a datagram is held back so later ones overtake it.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// Probability that bits of a datagram are flipped (the receiver's ICRC check must drop it).
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// Path MTU in bytes (256, 512, 1024, 2048 or 4096); random per connection if absent.
    #[arg(long)]
    mtu: Option<u32>,
    /// Operations to use, comma-separated (send, send_imm, send_inv, write, write_imm, read,
    /// cmp_swap, fetch_add); all if absent.
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// Most operations per direction of a connection.
    #[arg(long, default_value_t = 12)]
    max_ops: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_message: u32,
    /// Probability that a connection carries one deliberately invalid operation.
    #[arg(long, default_value_t = 0.1)]
    negative: f64,
    /// Number of nodes (connections form a ring).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Transport retry count of every QP (7 retries, not infinite, in this engine).
    #[arg(long, default_value_t = 7)]
    retry_cnt: u8,
    /// Read the network only every this many microseconds, handing each engine every
    /// datagram that arrived since before it transmits (as a driver reading batches with
    /// recvmmsg does); 0 hands over each datagram as it arrives.
    #[arg(long, default_value_t = 0)]
    receive_batch_us: u64,
    /// IP version of the GIDs: v4, v6 or random (random picks v6 when corrupting).
    #[arg(long, default_value = "random")]
    family: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Rerun only this seed, printing every datagram it sent, delivered or lost.
    #[arg(long)]
    trace: Option<u64>,
}

fn probability(name: &str, value: f64) -> anyhow::Result<f64> {
    if !(0.0..=1.0).contains(&value) {
        bail!("--{name} must be between 0 and 1, got {value}");
    }
    Ok(value)
}

fn config_from(args: &Args) -> anyhow::Result<SimConfig> {
    if args.nodes < 2 {
        bail!("--nodes must be at least 2");
    }
    let link = LinkConfig {
        loss: probability("loss", args.loss)?,
        duplicate: probability("dup", args.dup)?,
        reorder: probability("reorder", args.reorder)?,
        corrupt: probability("corrupt", args.corrupt)?,
        ..LinkConfig::default()
    };
    let mtu = match args.mtu {
        None => None,
        Some(bytes) => Some(
            Mtu::from_bytes(bytes)
                .with_context(|| format!("--mtu {bytes}: expected 256, 512, 1024, 2048 or 4096"))?,
        ),
    };
    let ops = args
        .ops
        .iter()
        .map(|s| s.parse::<OpKind>().map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let workload = WorkloadConfig {
        ops,
        max_ops: args.max_ops.max(1),
        max_message: args.max_message,
        negative: probability("negative", args.negative)?,
        ..WorkloadConfig::default()
    };
    let family = match args.family.as_str() {
        "v4" | "ipv4" => AddressFamily::V4,
        "v6" | "ipv6" => AddressFamily::V6,
        "random" => AddressFamily::Random,
        other => bail!("--family {other}: expected v4, v6 or random"),
    };
    let defaults = SimConfig::default();
    Ok(SimConfig {
        nodes: args.nodes,
        link,
        workload,
        qp: QpConfig { mtu, retry_cnt: args.retry_cnt, ..defaults.qp.clone() },
        family,
        trace: args.trace.is_some(),
        receive_batch: std::time::Duration::from_micros(args.receive_batch_us),
        ..defaults
    })
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config_from(&args)?;
    let seeds: Vec<u64> = match args.trace {
        Some(seed) => vec![seed],
        None => (0..args.seeds).map(|i| args.seed_start.saturating_add(i)).collect(),
    };
    let mut summary = Summary::default();
    let mut traced: Option<SeedReport> = None;
    for &seed in &seeds {
        let report = run_seed(&config, seed);
        summary.record(&report);
        if args.trace.is_some() {
            traced = Some(report);
        }
    }
    let output = if args.json {
        render_json(&args, &summary, traced.as_ref())?
    } else {
        render_text(&args, &summary, traced.as_ref())?
    };
    write_stdout(&output)?;
    Ok(if summary.all_passed() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Writes the whole report at once; a closed pipe (`| head`) is not an error.
fn write_stdout(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => Err(err.into()),
        _ => Ok(()),
    }
}

fn render_json(args: &Args, summary: &Summary, traced: Option<&SeedReport>) -> anyhow::Result<String> {
    let ops: serde_json::Map<String, serde_json::Value> = summary
        .ops
        .iter()
        .map(|(kind, counts)| Ok((kind.name().to_string(), serde_json::to_value(counts)?)))
        .collect::<anyhow::Result<_>>()?;
    let mut object = json!({
        "seeds": summary.seeds,
        "passed": summary.passed,
        "failed": summary.failed,
        "failures": summary.failures,
        "ops": ops,
        "goodput_bytes_per_sec": summary.goodput(),
        "stats": summary.stats,
        "config": {
            "seed_start": args.seed_start,
            "loss": args.loss,
            "dup": args.dup,
            "reorder": args.reorder,
            "corrupt": args.corrupt,
            "mtu": args.mtu,
            "retry_cnt": args.retry_cnt,
            "nodes": args.nodes,
            "negative": args.negative,
            "receive_batch_us": args.receive_batch_us,
        },
    });
    if let Some(report) = traced {
        object["trace"] = json!(report.trace.iter().map(ToString::to_string).collect::<Vec<_>>());
        object["seed_failures"] = json!(report.failures);
    }
    Ok(format!("{object}\n"))
}

fn render_text(
    args: &Args,
    summary: &Summary,
    traced: Option<&SeedReport>,
) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    if let Some(report) = traced {
        for event in &report.trace {
            writeln!(out, "{event}")?;
        }
        writeln!(out)?;
        for failure in &report.failures {
            writeln!(out, "violation: {failure}")?;
        }
    }
    let mtu = args.mtu.map_or_else(|| "random".to_string(), |m| m.to_string());
    writeln!(
        out,
        "lightpath sim: {} seeds from {}, loss {} dup {} reorder {} corrupt {}, MTU {mtu}",
        summary.seeds, args.seed_start, args.loss, args.dup, args.reorder, args.corrupt
    )?;
    writeln!(
        out,
        "{:<10} {:>8} {:>8} {:>8} {:>10} {:>9}",
        "op", "posted", "passed", "failed", "succeeded", "negative"
    )?;
    for (kind, c) in &summary.ops {
        writeln!(
            out,
            "{:<10} {:>8} {:>8} {:>8} {:>10} {:>9}",
            kind.name(),
            c.posted,
            c.passed,
            c.failed,
            c.succeeded,
            c.negative
        )?;
    }
    let s = &summary.stats;
    writeln!(
        out,
        "packets: {} sent, {} delivered, {} dropped, {} duplicated, {} corrupted, {} reordered",
        s.packets_sent,
        s.packets_delivered,
        s.packets_dropped,
        s.packets_duplicated,
        s.packets_corrupted,
        s.packets_reordered
    )?;
    writeln!(
        out,
        "engine: {} retransmits, {} timeouts, {} NAKs, {} RNR NAKs, {} ICRC drops, {} retries exhausted",
        s.retransmits, s.timeouts, s.naks_sent, s.rnr_naks_sent, s.drops_icrc, s.retry_exhausted
    )?;
    if s.undetected_corruptions > 0 {
        writeln!(
            out,
            "{} damaged datagrams passed the ICRC check (IPv4 cannot see the IP ID: ~2^-15 of corruptions); their connections were checked for memory safety only",
            s.undetected_corruptions
        )?;
    }
    writeln!(
        out,
        "goodput: {:.1} MB/s of virtual time ({} bytes in {:.3} virtual s)",
        summary.goodput() / 1e6,
        s.bytes_delivered,
        s.virtual_nanos as f64 / 1e9
    )?;
    for failure in &summary.failures {
        writeln!(out, "FAIL seed {}: {}", failure.seed, failure.reason)?;
    }
    writeln!(out, "seeds: {} passed, {} failed", summary.passed, summary.failed)?;
    Ok(out)
}
