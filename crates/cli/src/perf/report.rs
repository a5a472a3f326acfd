//! Printing results: a perftest-like table, or one JSON object per size.

use serde::Serialize;

use super::args::{PerfTest, ProviderKind};
use super::cpu::CpuUse;
use super::stats::{BandwidthSummary, LatencySummary};

/// The result of one size.
#[derive(Debug, Clone, Serialize)]
pub struct SizeResult {
    pub test: &'static str,
    pub provider: &'static str,
    pub size: usize,
    pub iters: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_us: Option<LatencySummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_mb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub msg_rate_mpps: Option<f64>,
    /// Whether the payload was verified (bandwidth tests compare checksums at the end).
    pub verified: bool,
    /// Both processes' CPU time over this size (absent when the server did not report it).
    #[serde(flatten)]
    pub cpu: Option<CpuUse>,
    /// The path MTU in bytes the RDMA connection used (absent over TCP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_mtu: Option<u32>,
}

impl SizeResult {
    /// A latency result.
    pub fn latency(
        test: PerfTest,
        provider: ProviderKind,
        size: usize,
        iters: u64,
        lat: LatencySummary,
    ) -> Self {
        Self {
            test: test.name(),
            provider: provider.name(),
            size,
            iters,
            lat_us: Some(lat),
            bw_mb_s: None,
            msg_rate_mpps: None,
            verified: true,
            cpu: None,
            path_mtu: None,
        }
    }

    /// A bandwidth result.
    pub fn bandwidth(
        test: PerfTest,
        provider: ProviderKind,
        size: usize,
        iters: u64,
        bw: BandwidthSummary,
    ) -> Self {
        Self {
            test: test.name(),
            provider: provider.name(),
            size,
            iters,
            lat_us: None,
            bw_mb_s: Some(bw.bw_mb_s),
            msg_rate_mpps: Some(bw.msg_rate_mpps),
            verified: true,
            cpu: None,
            path_mtu: None,
        }
    }
}

/// Prints results as they come: a header before the first, then one line (or JSON object) each.
#[derive(Debug)]
pub struct Reporter {
    json: bool,
    printed_header: bool,
}

impl Reporter {
    /// A reporter printing JSON lines or a table.
    pub fn new(json: bool) -> Self {
        Self { json, printed_header: false }
    }

    /// Prints one result.
    pub fn print(&mut self, result: &SizeResult) {
        if self.json {
            outln!("{}", serde_json::to_string(result).expect("results always serialise"));
            return;
        }
        if !self.printed_header {
            self.printed_header = true;
            outln!("# {} over {}", result.test, result.provider);
            if result.lat_us.is_some() {
                outln!(
                    "{:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14}",
                    "#bytes",
                    "#iters",
                    "min[us]",
                    "median[us]",
                    "p99[us]",
                    "max[us]",
                    "avg[us]",
                    "CPU (both)"
                );
            } else {
                outln!(
                    "{:>10} {:>10} {:>14} {:>14} {:>14}",
                    "#bytes",
                    "#iters",
                    "BW[MB/s]",
                    "MsgRate[Mpps]",
                    "CPU (both)"
                );
            }
        }
        let cpu = result.cpu.map(|c| c.summary()).unwrap_or_default();
        if let Some(lat) = result.lat_us {
            outln!(
                "{:>10} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {cpu:>14}",
                result.size,
                result.iters,
                lat.min,
                lat.median,
                lat.p99,
                lat.max,
                lat.avg
            );
        } else {
            outln!(
                "{:>10} {:>10} {:>14.2} {:>14.6} {cpu:>14}",
                result.size,
                result.iters,
                result.bw_mb_s.unwrap_or(0.0),
                result.msg_rate_mpps.unwrap_or(0.0)
            );
        }
    }
}
