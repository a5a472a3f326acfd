//! The libibverbs devices of this process, one per local IP address: the device whose port
//! has a RoCE v2 GID equal to the address the TCP connection runs from, sending from that GID.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};

use lightpath_ibverbs::gid::GidKind;
use lightpath_ibverbs::{IbvConfig, IbvDevice, IbvProvider};
use lightpath_verbs::{Device, Gid, Provider};

use crate::completions::HubPool;
use crate::options::Options;
use crate::rdma::{PendingSetup, RdmaSetup};

/// A device and the completion queues its connections share.
type Entry = (IbvDevice, Arc<HubPool<IbvDevice>>);

/// Completion entries of a device's first shared queue (hardware queues are pinned memory,
/// so they start small; the pool doubles them as connections come).
const FIRST_CQ_ENTRIES: u32 = 4096;

/// Devices by local address; `None` caches "no device has this address".
fn registry() -> &'static Mutex<HashMap<IpAddr, Option<Entry>>> {
    static DEVICES: OnceLock<Mutex<HashMap<IpAddr, Option<Entry>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Finds and opens the device with a RoCE v2 (or InfiniBand) GID for `ip` on port 1.
fn open_for(ip: IpAddr) -> Option<IbvDevice> {
    IbvProvider::load().ok()?;
    let wanted = Gid::from_ip(ip);
    let provider = IbvProvider::default();
    for name in provider.devices().ok()? {
        let Ok(device) = provider.open(&name) else { continue };
        let Ok(entries) = device.gid_entries(1) else { continue };
        let found =
            entries.iter().find(|e| e.gid == wanted && matches!(e.kind, GidKind::RoceV2 | GidKind::Ib));
        if let Some(entry) = found {
            let config = IbvConfig { port: Some(1), gid_index: Some(entry.index) };
            return IbvProvider::with_config(config).open(&name).ok();
        }
    }
    None
}

fn device_for(ip: IpAddr) -> Option<Entry> {
    let ip = ip.to_canonical();
    let mut devices = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    devices
        .entry(ip)
        .or_insert_with(|| open_for(ip).map(|device| (device, Arc::new(HubPool::new(FIRST_CQ_ENTRIES)))))
        .clone()
}

/// Whether an RDMA device serves `ip`.
pub(crate) fn available_for(ip: IpAddr) -> bool {
    device_for(ip).is_some()
}

/// Whether an RDMA device with an Ethernet (RoCE) port serves the local address of `tcp`.
pub(crate) fn serves_roce(tcp: &TcpStream) -> bool {
    let Ok(local) = tcp.local_addr() else { return false };
    device_for(local.ip()).is_some_and(|(device, _)| device.is_ethernet())
}

/// This side's verbs objects for a connection from the local address of `tcp`.
pub(crate) fn setup(tcp: &TcpStream, options: &Options) -> io::Result<Box<dyn PendingSetup>> {
    let local = tcp.local_addr()?.ip();
    let (device, hubs) = device_for(local).ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, format!("no RDMA device has a RoCE v2 GID for {local}"))
    })?;
    let mtu = device.query_port(1).map_err(crate::error::from_verbs)?.active_mtu;
    Ok(Box::new(RdmaSetup::new(device, &hubs, 0, mtu, None, std::time::Duration::ZERO, options)?))
}
