//! `lightpath devices`: every provider and device this machine can use, and for each one that
//! cannot be used, why.

use std::net::{SocketAddr, UdpSocket};
use std::process::ExitCode;

use anyhow::Result;
use lightpath_ibverbs::IbvProvider;
use lightpath_shm::{HostIdentity, ShmProvider};
use lightpath_soft::{parse_device_name, SoftProvider};
use lightpath_verbs::{Gid, Provider};
use serde::Serialize;

/// Options of `lightpath devices`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Show the counters of the soft devices that running Lightpath processes opened for
    /// their streams (datagrams, bytes, retransmissions, NAKs, RNR NAKs, drops by reason),
    /// asked of each process over its `@lightpath-stats-<pid>` socket (this network namespace).
    #[arg(long)]
    pub stats: bool,
}

#[derive(Debug, Serialize)]
struct ProcessStats {
    pid: u32,
    devices: Vec<DeviceStats>,
}

#[derive(Debug, Serialize)]
struct DeviceStats {
    name: String,
    local: String,
    counters: std::collections::BTreeMap<String, u64>,
    /// The counters in the order the process reported them (engine, then driver).
    #[serde(skip)]
    in_order: Vec<(String, u64)>,
}

/// `lightpath devices --stats`.
fn run_stats(json: bool) -> Result<ExitCode> {
    let pids = lightpath::counters::serving_processes()
        .map_err(|err| anyhow::anyhow!("cannot read /proc/net/unix: {err}"))?;
    let mut processes = Vec::new();
    for pid in pids {
        match lightpath::counters::fetch_report(pid) {
            Ok(devices) => processes.push(ProcessStats {
                pid,
                devices: devices
                    .into_iter()
                    .map(|(name, local, in_order)| DeviceStats {
                        name,
                        local,
                        counters: in_order.iter().cloned().collect(),
                        in_order,
                    })
                    .collect(),
            }),
            // The process may have exited between the listing and the question.
            Err(err) => eprintln!("lightpath: process {pid}: {err}"),
        }
    }
    if json {
        outln!("{}", serde_json::to_string_pretty(&processes)?);
        return Ok(ExitCode::SUCCESS);
    }
    if processes.is_empty() {
        outln!("no Lightpath process in this network namespace has a soft device open");
    }
    for process in &processes {
        for device in &process.devices {
            outln!("process {} {} ({})", process.pid, device.name, device.local);
            for (name, value) in &device.in_order {
                if *value != 0 || COUNTERS_ALWAYS_SHOWN.contains(&name.as_str()) {
                    outln!("  {name:<26} {value}");
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Counters printed even when zero (the rest only when they moved).
const COUNTERS_ALWAYS_SHOWN: [&str; 10] = [
    "rx_datagrams",
    "rx_bytes",
    "tx_datagrams",
    "tx_bytes",
    "retransmits",
    "naks_sent",
    "naks_received",
    "rnr_naks_sent",
    "rnr_naks_received",
    "drops_icrc",
];

#[derive(Debug, Serialize)]
struct ProviderReport {
    provider: &'static str,
    available: bool,
    /// Why the provider cannot be used, when it cannot.
    reason: Option<String>,
    devices: Vec<DeviceReport>,
}

#[derive(Debug, Serialize)]
struct DeviceReport {
    name: String,
    gid: String,
    /// Whether the device can be opened now (its UDP port is free).
    usable: bool,
    note: Option<String>,
}

fn soft_report() -> ProviderReport {
    let provider = SoftProvider::default();
    match provider.devices() {
        Ok(names) => {
            let devices = names
                .into_iter()
                .filter_map(|name| {
                    let addr = parse_device_name(&name)?;
                    Some(soft_device(name, addr))
                })
                .collect();
            ProviderReport { provider: "soft", available: true, reason: None, devices }
        }
        Err(err) => ProviderReport {
            provider: "soft",
            available: false,
            reason: Some(format!("cannot list network interfaces: {err}")),
            devices: Vec::new(),
        },
    }
}

/// Probes whether a soft device could bind `addr` right now.
fn soft_device(name: String, addr: SocketAddr) -> DeviceReport {
    let gid = Gid::from_ip(addr.ip()).to_string();
    match UdpSocket::bind(addr) {
        Ok(_) => DeviceReport { name, gid, usable: true, note: None },
        Err(err) if err.kind() == std::io::ErrorKind::AddrInUse => DeviceReport {
            name,
            gid,
            usable: false,
            note: Some(format!(
                "UDP {addr} is in use (another Lightpath process, or the kernel's rxe, which owns port 4791 on every address of its host)"
            )),
        },
        Err(_) if matches!(addr.ip(), std::net::IpAddr::V6(v6) if v6.is_unicast_link_local()) => DeviceReport {
            name,
            gid,
            usable: false,
            note: Some("link-local IPv6 addresses need an interface scope, which soft devices do not take yet".into()),
        },
        Err(err) => DeviceReport { name, gid, usable: false, note: Some(format!("cannot bind UDP {addr}: {err}")) },
    }
}

/// The ibverbs provider: libibverbs (loaded at run time), its devices and, per device, the port
/// and the GID Lightpath would send from.
fn ibverbs_report() -> ProviderReport {
    let unavailable = |reason: String| ProviderReport {
        provider: "ibverbs",
        available: false,
        reason: Some(reason),
        devices: Vec::new(),
    };
    if let Err(err) = IbvProvider::load() {
        return unavailable(err.to_string());
    }
    let provider = IbvProvider::default();
    let names = match provider.devices() {
        Ok(names) if names.is_empty() => {
            return unavailable("libibverbs is installed but lists no RDMA devices".into());
        }
        Ok(names) => names,
        Err(err) => return unavailable(verbs_reason(&err)),
    };
    let fork = IbvProvider::fork_safety().map(|f| f.describe()).unwrap_or("fork safety unknown");
    let devices = names.into_iter().map(|name| ibverbs_device(&provider, name, fork)).collect();
    ProviderReport { provider: "ibverbs", available: true, reason: None, devices }
}

/// The reason inside an "unavailable" error, without the generic prefix.
fn verbs_reason(err: &lightpath_verbs::Error) -> String {
    match err {
        lightpath_verbs::Error::Unavailable(reason) => reason.clone(),
        other => other.to_string(),
    }
}

fn ibverbs_device(provider: &IbvProvider, name: String, fork: &str) -> DeviceReport {
    use lightpath_verbs::Device;
    let device = match provider.open(&name) {
        Ok(device) => device,
        Err(err) => {
            return DeviceReport { name, gid: "-".into(), usable: false, note: Some(verbs_reason(&err)) }
        }
    };
    let source = device.source_gid();
    let port = device.port();
    let link = if device.is_ethernet() { "RoCE" } else { "InfiniBand" };
    let (usable, state) = match device.query_port(port) {
        Ok(attr) => (
            attr.state == lightpath_verbs::PortState::Active,
            format!("{:?}, active MTU {}", attr.state, attr.active_mtu),
        ),
        Err(err) => (false, verbs_reason(&err)),
    };
    let note = format!(
        "port {port} ({link}, {state}), GID index {} ({}) chosen automatically; {fork}",
        source.index, source.kind
    );
    DeviceReport { name, gid: source.gid.to_string(), usable, note: Some(note) }
}

/// The shm provider: available when the kernel offers sealable memfds; its one device name
/// opens a fresh endpoint each time, reachable from processes with the same host identity.
fn shm_report() -> ProviderReport {
    let unavailable = |reason: String| ProviderReport {
        provider: "shm",
        available: false,
        reason: Some(reason),
        devices: Vec::new(),
    };
    let provider = ShmProvider::default();
    let names = match provider.devices() {
        Ok(names) => names,
        Err(err) => return unavailable(verbs_reason(&err)),
    };
    let host = match HostIdentity::current() {
        Ok(host) => host,
        Err(err) => return unavailable(format!("cannot determine the host identity: {err}")),
    };
    let devices = names
        .into_iter()
        .map(|name| match provider.open(&name) {
            Ok(device) => DeviceReport {
                gid: format!("{} (fresh per open)", device.gid()),
                name,
                usable: true,
                note: Some(format!("reaches processes of host {host}")),
            },
            Err(err) => DeviceReport { name, gid: "-".into(), usable: false, note: Some(verbs_reason(&err)) },
        })
        .collect();
    ProviderReport { provider: "shm", available: true, reason: None, devices }
}

/// Runs the subcommand.
pub fn run(args: Args) -> Result<ExitCode> {
    if args.stats {
        return run_stats(args.json);
    }
    let reports = vec![soft_report(), ibverbs_report(), shm_report()];
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(ExitCode::SUCCESS);
    }
    for report in &reports {
        match &report.reason {
            None => outln!("{}: available", report.provider),
            Some(reason) => outln!("{}: unavailable: {reason}", report.provider),
        }
        for device in &report.devices {
            let state = if device.usable {
                device.note.as_ref().map_or_else(|| "ready".to_string(), |note| format!("ready: {note}"))
            } else {
                format!("unusable: {}", device.note.as_deref().unwrap_or(""))
            };
            outln!("  {:<28} GID {:<28} {}", device.name, device.gid, state);
        }
    }
    Ok(ExitCode::SUCCESS)
}
