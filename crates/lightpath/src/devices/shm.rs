//! The shm device of this process: one for every same-host connection.
//!
//! Stream connections move their data with RDMA WRITEs straight into the peer's receive ring
//! (the shm requester copies into the peer's mapped region), so the queue pairs' own rings
//! only carry completion notices: a small ring keeps a thousand connections cheap.

use std::io;
use std::sync::{Arc, Mutex, OnceLock};

use lightpath_shm::{ShmConfig, ShmDevice};
use lightpath_verbs::Mtu;

use crate::completions::HubPool;
use crate::options::Options;
use crate::rdma::{PendingSetup, RdmaSetup};

/// Bytes of each stream queue pair's notice ring.
const NOTICE_RING: usize = 64 << 10;

/// A device and the completion queues its connections share.
type Entry = (ShmDevice, Arc<HubPool<ShmDevice>>);

/// Completion entries of the first shared queue (when options ask for one: shm connections get
/// queues of their own by default, see `Options::shared_completion_queues`): shm queues are
/// plain memory.
const SHARED_CQ_ENTRIES: u32 = 1 << 20;

fn slot() -> std::sync::MutexGuard<'static, Option<Entry>> {
    static DEVICE: OnceLock<Mutex<Option<Entry>>> = OnceLock::new();
    DEVICE.get_or_init(|| Mutex::new(None)).lock().unwrap_or_else(|p| p.into_inner())
}

fn device() -> io::Result<Entry> {
    let mut slot = slot();
    if let Some(entry) = slot.as_ref() {
        return Ok(entry.clone());
    }
    let config = ShmConfig {
        name: Some("shm-stream".into()),
        ring_bytes: NOTICE_RING,
        max_fragment: 8 << 10,
        ..ShmConfig::default()
    };
    let device = ShmDevice::open(config).map_err(crate::error::from_verbs)?;
    let entry = (device, Arc::new(HubPool::own_queues_by_default(SHARED_CQ_ENTRIES)));
    *slot = Some(entry.clone());
    Ok(entry)
}

/// Whether this process has opened its device.
pub(crate) fn is_open() -> bool {
    slot().is_some()
}

/// Opens the process's device if it is not yet (see `devices::warm_likely_pick`).
pub(crate) fn warm() {
    let _ = device();
}

/// This side's verbs objects for a same-host connection.
pub(crate) fn setup(options: &Options) -> io::Result<Box<dyn PendingSetup>> {
    let (device, hubs) = device()?;
    Ok(Box::new(RdmaSetup::new(device, &hubs, 0, Mtu::Mtu4096, None, options.shm_wait_spin, options)?))
}

/// The 16-byte identity of this host and namespace, as the client hello carries it (zeros if
/// it cannot be read, which never matches: shm is then not chosen).
pub(crate) fn host_id() -> [u8; 16] {
    static ID: OnceLock<[u8; 16]> = OnceLock::new();
    *ID.get_or_init(|| lightpath_shm::HostIdentity::current().map(|id| id.to_bytes()).unwrap_or([0; 16]))
}
