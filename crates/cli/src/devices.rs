//! `lightpath devices`: every provider and device this machine can use, and for each one that
//! cannot be used, why.

use std::net::{SocketAddr, UdpSocket};
use std::process::ExitCode;

use anyhow::Result;
use lightpath_soft::{parse_device_name, SoftProvider};
use lightpath_verbs::{Gid, Provider};
use serde::Serialize;

/// Options of `lightpath devices`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

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

fn unbuilt(provider: &'static str, what: &str) -> ProviderReport {
    ProviderReport {
        provider,
        available: false,
        reason: Some(format!("not in this build yet ({what})")),
        devices: Vec::new(),
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> Result<ExitCode> {
    let reports = vec![
        soft_report(),
        unbuilt("ibverbs", "real RDMA NICs through rdma-core's libibverbs, loaded at run time"),
        unbuilt("shm", "processes on one host through shared memory"),
    ];
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(ExitCode::SUCCESS);
    }
    for report in &reports {
        match &report.reason {
            None => println!("{}: available", report.provider),
            Some(reason) => println!("{}: unavailable: {reason}", report.provider),
        }
        for device in &report.devices {
            let state = if device.usable {
                "ready".to_string()
            } else {
                format!("unusable: {}", device.note.as_deref().unwrap_or(""))
            };
            println!("  {:<28} GID {:<28} {}", device.name, device.gid, state);
        }
    }
    Ok(ExitCode::SUCCESS)
}
