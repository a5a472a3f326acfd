//! Command-line options of `lightpath perf`, modelled on perftest's.

use std::fmt;
use std::net::IpAddr;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The perftest-style tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PerfTest {
    /// SEND ping-pong; one-way latency.
    SendLat,
    /// RDMA WRITE ping-pong; one-way latency.
    WriteLat,
    /// RDMA READ; round-trip latency.
    ReadLat,
    /// Atomic fetch-and-add; round-trip latency.
    AtomicLat,
    /// Streamed SENDs; bandwidth.
    SendBw,
    /// Streamed RDMA WRITEs; bandwidth.
    WriteBw,
    /// Streamed RDMA READs; bandwidth.
    ReadBw,
}

impl PerfTest {
    /// Whether the test measures latency (else bandwidth).
    pub fn is_latency(self) -> bool {
        matches!(self, PerfTest::SendLat | PerfTest::WriteLat | PerfTest::ReadLat | PerfTest::AtomicLat)
    }

    /// Whether a latency test reports the whole round trip (a READ or atomic cannot be halved).
    pub fn reports_round_trip(self) -> bool {
        matches!(self, PerfTest::ReadLat | PerfTest::AtomicLat)
    }

    /// The name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            PerfTest::SendLat => "send_lat",
            PerfTest::WriteLat => "write_lat",
            PerfTest::ReadLat => "read_lat",
            PerfTest::AtomicLat => "atomic_lat",
            PerfTest::SendBw => "send_bw",
            PerfTest::WriteBw => "write_bw",
            PerfTest::ReadBw => "read_bw",
        }
    }
}

impl fmt::Display for PerfTest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which transport carries the test's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// Lightpath's userspace RoCE v2 engine over UDP (runs anywhere).
    Soft,
    /// The same message pattern over kernel TCP (the baseline).
    Tcp,
    /// RDMA hardware (or the kernel's rxe) through rdma-core's libibverbs.
    Ibverbs,
    /// Shared memory between two processes of one host.
    Shm,
}

impl ProviderKind {
    /// The name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            ProviderKind::Soft => "soft",
            ProviderKind::Tcp => "tcp",
            ProviderKind::Ibverbs => "ibverbs",
            ProviderKind::Shm => "shm",
        }
    }

    /// Whether a client of this provider can run a test against a server of `other`: soft and
    /// ibverbs speak one wire protocol (RoCE v2), so a soft client reaches an ibverbs server (a
    /// real RNIC, or rxe) and the other way round; shm and tcp meet only themselves.
    pub fn interoperates_with(self, other: ProviderKind) -> bool {
        let roce = |p: ProviderKind| matches!(p, ProviderKind::Soft | ProviderKind::Ibverbs);
        self == other || (roce(self) && roce(other))
    }
}

/// Largest message `--all` reaches and the largest accepted size: 8 MiB (rxe's limit).
pub const MAX_SIZE: usize = 8 << 20;

/// Options of `lightpath perf`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The test to run.
    #[arg(value_enum)]
    pub test: PerfTest,
    /// Server to connect to (host name or address). Without it, this process is the server.
    pub server: Option<String>,
    /// Data transport.
    #[arg(long, value_enum, default_value = "soft")]
    pub provider: ProviderKind,
    /// Device name (provider-specific).
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// GID index of the device to use.
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u8>,
    /// Message size in bytes, suffixes allowed (64K, 1M; default 2 for latency tests, 65536
    /// for bandwidth tests).
    #[arg(short = 's', long, value_parser = crate::size::parse_usize)]
    pub size: Option<usize>,
    /// Iterations per size (default 1000 for latency tests, 5000 for bandwidth tests).
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u64>,
    /// Local address: of the out-of-band TCP socket and, for soft, of the UDP endpoint.
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// Out-of-band TCP port.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub port: u16,
    /// UDP port of the soft provider's RoCE endpoint (both sides must agree).
    #[arg(long, default_value_t = 4791)]
    pub udp_port: u16,
    /// Path MTU for RDMA providers (256, 512, 1024, 2048 or 4096; between soft sides any size
    /// up to 32768 the link carries, the Lightpath extension). Default: the provider's, and
    /// between soft sides the largest both links carry.
    #[arg(short = 'm', long)]
    pub mtu: Option<u32>,
    /// Run every size from 2 bytes to 8 MiB (powers of two).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Requests kept in flight by bandwidth tests.
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    pub tx_depth: u32,
    /// Print one JSON object per size (client) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Speak perftest's out-of-band exchange and message pattern, so the other end is
    /// rdma-core's perftest (`ib_send_lat`, `ib_send_bw`, `ib_write_bw`, `ib_read_bw`,
    /// `ib_write_lat`, `ib_read_lat`) instead of another `lightpath perf` (soft provider, RC,
    /// one queue pair).
    #[arg(long)]
    pub perftest: bool,
}

impl Args {
    /// Checks option combinations before anything is opened.
    pub fn validate(&self) -> Result<()> {
        if let Some(size) = self.size {
            if size > MAX_SIZE {
                bail!("message size {size} is above the 8 MiB maximum");
            }
            if size == 0 {
                bail!("message size must be at least 1 byte");
            }
        }
        if self.test == PerfTest::AtomicLat && self.size.is_some_and(|s| s != 8) {
            bail!("atomic_lat always uses 8-byte operands; drop -s");
        }
        if self.iters == Some(0) {
            bail!("at least one iteration is needed");
        }
        if let Some(mtu) = self.mtu {
            let ib = lightpath_verbs::Mtu::from_bytes(mtu).is_some();
            let extension = self.provider == ProviderKind::Soft
                && (256..=lightpath_verbs::MAX_LIGHTPATH_PMTU).contains(&mtu);
            if !(ib || extension) {
                bail!(
                    "MTU {mtu} is not one of 256, 512, 1024, 2048, 4096 (between soft sides any size from 256 \
                     to 32768 the link carries)"
                );
            }
        }
        if self.perftest && self.provider != ProviderKind::Soft {
            bail!("--perftest runs the soft provider against perftest; drop --provider");
        }
        if self.perftest && self.json {
            bail!("--perftest prints perftest's table; --json is not available with it");
        }
        if self.tx_depth == 0 {
            bail!("tx depth must be at least 1");
        }
        Ok(())
    }

    /// Message sizes to run, in order.
    pub fn sizes(&self) -> Vec<usize> {
        if self.test == PerfTest::AtomicLat {
            return vec![8];
        }
        if self.all {
            return (1..=23).map(|shift| 1usize << shift).collect();
        }
        vec![self.size.unwrap_or(if self.test.is_latency() { 2 } else { 65536 })]
    }

    /// Every size with its iteration count.
    pub fn plan(&self) -> Vec<(usize, u64)> {
        self.sizes().into_iter().map(|size| (size, self.iterations_for(size))).collect()
    }

    /// Iterations for one size: `-n` if given, else perftest's defaults (1000 for latency, 5000
    /// for bandwidth) — except that `--all` without `-n` caps the bytes moved per size (256 MiB
    /// for latency tests, 2 GiB for bandwidth tests, at least 16 iterations) so that the 8 MiB
    /// steps finish in seconds rather than minutes.
    pub fn iterations_for(&self, size: usize) -> u64 {
        if let Some(iters) = self.iters {
            return iters;
        }
        let (default, budget) =
            if self.test.is_latency() { (1000, 256u64 << 20) } else { (5000, 2u64 << 30) };
        if !self.all {
            return default;
        }
        (budget / size.max(1) as u64).clamp(16, default)
    }
}
