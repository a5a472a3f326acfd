//! [`IbvPd`]: a protection domain (`ibv_pd`), the creator of regions and queue pairs. Unlike
//! the soft provider, the device enforces the domain: keys of one domain are rejected by queue
//! pairs of another.

use std::sync::Arc;

use lightpath_verbs::{AccessFlags, Error, ProtectionDomain, QpCaps, Result};

use crate::cq::IbvCq;
use crate::device::ContextInner;
use crate::error::from_errno;
use crate::ffi::library::IbvPd as RawPd;
use crate::memory::RegionMemory;
use crate::mr::IbvMr;
use crate::provider::{ForkSafety, IbvProvider};
use crate::qp::IbvQp;

/// A protection domain of an [`IbvDevice`](crate::IbvDevice). Cloning gives another handle.
#[derive(Clone)]
pub struct IbvPd {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) device: Arc<ContextInner>,
    pub(crate) pd: *mut RawPd,
}

// SAFETY: an ibv_pd may be used from any thread (libibverbs verbs are thread safe).
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl IbvPd {
    pub(crate) fn new(device: Arc<ContextInner>) -> Result<Self> {
        // SAFETY: the context is open while `device` lives.
        let pd = unsafe { (device.api.alloc_pd)(device.ctx) };
        if pd.is_null() {
            return Err(from_errno("ibv_alloc_pd"));
        }
        Ok(Self { inner: Arc::new(PdInner { device, pd }) })
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: regions and queue pairs of this domain held an Arc to it, so none is left;
        // the domain is deallocated once.
        unsafe { (self.device.api.dealloc_pd)(self.pd) };
    }
}

impl std::fmt::Debug for IbvPd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvPd").field("device", &self.inner.device.name).finish()
    }
}

fn check_access(access: AccessFlags) -> Result<()> {
    if access.is_valid_for_mr() {
        Ok(())
    } else {
        Err(Error::InvalidAttribute("remote write or atomic access requires local write"))
    }
}

impl ProtectionDomain for IbvPd {
    type Mr = IbvMr;
    type Cq = IbvCq;
    type Qp = IbvQp;

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<IbvMr> {
        check_access(access)?;
        let memory = RegionMemory::map(len).ok_or_else(|| {
            Error::Unavailable(format!(
                "cannot allocate a region of {len} bytes: the kernel refused the mapping"
            ))
        })?;
        IbvMr::register(Arc::clone(&self.inner), memory, access)
    }

    /// Registers the vector's own heap block in place where a fork cannot break it (see
    /// [`ForkSafety`]); otherwise copies it into a Lightpath region.
    fn reg_vec(&self, memory: Vec<u8>, access: AccessFlags) -> Result<IbvMr> {
        check_access(access)?;
        let safety = IbvProvider::fork_safety().unwrap_or(ForkSafety::Unknown);
        let region = if safety.in_place_registration_is_safe() && !memory.is_empty() {
            RegionMemory::from_vec(memory)
        } else {
            let mapped = RegionMemory::map(memory.len()).ok_or_else(|| {
                Error::Unavailable(format!("cannot allocate a region of {} bytes", memory.len()))
            })?;
            mapped.copy_in(0..memory.len(), &memory);
            mapped
        };
        IbvMr::register(Arc::clone(&self.inner), region, access)
    }

    fn create_qp(&self, send_cq: &IbvCq, recv_cq: &IbvCq, caps: QpCaps) -> Result<IbvQp> {
        IbvQp::create(Arc::clone(&self.inner), send_cq, recv_cq, caps)
    }
}
