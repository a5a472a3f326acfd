//! [`SoftPd`]: a protection domain, the creator of regions and queue pairs.
//!
//! The engine keeps one table of regions per device and does not tag regions or queue pairs
//! with a domain, so keys from any domain of the same device are accepted: protection domains
//! here group objects and hold them alive, but do not yet isolate them from each other.

use std::sync::Arc;

use lightpath_verbs::{AccessFlags, Error, ProtectionDomain, QpCaps, Result};

use crate::cq::SoftCq;
use crate::driver::DeviceInner;
use crate::memory::RegionBytes;
use crate::mr::SoftMr;
use crate::qp::SoftQp;

/// A protection domain of a [`SoftDevice`](crate::SoftDevice).
#[derive(Clone)]
pub struct SoftPd {
    pub(crate) device: Arc<DeviceInner>,
}

impl SoftPd {
    pub(crate) fn new(device: Arc<DeviceInner>) -> Self {
        Self { device }
    }
}

impl std::fmt::Debug for SoftPd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftPd").field("device", &self.device.name).finish()
    }
}

impl ProtectionDomain for SoftPd {
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = SoftQp;

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<SoftMr> {
        if !access.is_valid_for_mr() {
            return Err(Error::InvalidAttribute("remote write or atomic access requires local write"));
        }
        let memory = RegionBytes::alloc(len, self.device.config.lock_memory)
            .ok_or(Error::InvalidAttribute("region too large to allocate"))?;
        SoftMr::register(self.clone(), Arc::new(memory), access)
    }

    fn reg_vec(&self, memory: Vec<u8>, access: AccessFlags) -> Result<SoftMr> {
        if !access.is_valid_for_mr() {
            return Err(Error::InvalidAttribute("remote write or atomic access requires local write"));
        }
        SoftMr::register(self.clone(), Arc::new(RegionBytes::from_vec(memory)), access)
    }

    fn create_qp(&self, send_cq: &SoftCq, recv_cq: &SoftCq, caps: QpCaps) -> Result<SoftQp> {
        SoftQp::create(self.clone(), send_cq, recv_cq, caps)
    }
}
