//! [`ShmPd`]: a protection domain, the creator of regions and queue pairs. Keys and queue pairs
//! are tagged with their domain: a queue pair can use only its own domain's regions as local
//! buffers, and a peer reaches only regions of its peer queue pair's domain.

use std::sync::Arc;

use lightpath_verbs::{AccessFlags, Error, ProtectionDomain, QpCaps, Result};

use crate::cq::ShmCq;
use crate::device::{DeviceInner, ExportedRegion};
use crate::engine::QpCore;
use crate::mr::ShmMr;
use crate::qp::ShmQp;
use crate::region::LocalRegion;

/// A protection domain of an [`ShmDevice`](crate::ShmDevice).
#[derive(Clone)]
pub struct ShmPd {
    pub(crate) device: Arc<DeviceInner>,
    pub(crate) id: u32,
}

impl ShmPd {
    pub(crate) fn new(device: Arc<DeviceInner>) -> Self {
        let id = device.shared.alloc_id();
        Self { device, id }
    }
}

impl std::fmt::Debug for ShmPd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPd").field("device", &self.device.shared.name).field("id", &self.id).finish()
    }
}

/// The queue sizes granted for a request, or why it is refused.
fn grant(caps: QpCaps) -> Result<QpCaps> {
    if caps.max_send_wr > 16_384 || caps.max_recv_wr > 16_384 {
        return Err(Error::InvalidAttribute("queue depth above max_qp_wr (16384)"));
    }
    if caps.max_send_sge > 32 || caps.max_recv_sge > 32 {
        return Err(Error::InvalidAttribute("scatter/gather list above max_sge (32)"));
    }
    if caps.max_inline_data > crate::MAX_INLINE {
        return Err(Error::InvalidAttribute("inline data above max_inline_data"));
    }
    Ok(QpCaps { max_inline_data: caps.max_inline_data.max(64), ..caps })
}

impl ProtectionDomain for ShmPd {
    type Mr = ShmMr;
    type Cq = ShmCq;
    type Qp = ShmQp;

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<ShmMr> {
        if !access.is_valid_for_mr() {
            return Err(Error::InvalidAttribute("remote write or atomic access requires local write"));
        }
        let shared = &self.device.shared;
        let (lkey, rkey) = shared.alloc_keys();
        let (region, memfd) = LocalRegion::alloc(len, access, lkey, rkey, self.id)?;
        let region = Arc::new(region);
        {
            let mut regions = shared.tables.regions_mut();
            if regions.len() >= shared.ctx.config.max_mrs as usize {
                return Err(Error::InvalidAttribute("more memory regions than max_mr"));
            }
            regions.insert(lkey, Arc::clone(&region));
            // Every region is described to peers that ask through a queue pair of its domain:
            // for one-sided operations (which the asking side checks against `access`) and as
            // the source of direct SENDs (which the receiver copies out of).
            let export = ExportedRegion {
                memfd: Some(memfd),
                first_peer_only: false,
                addr: region.addr(),
                len: len as u64,
                access,
                pd: self.id,
            };
            shared.lock_exports().regions.insert(rkey, export);
        }
        Ok(ShmMr { device: Arc::clone(&self.device), region })
    }

    /// Copies the vector into a new shared region (its bytes must live in shared memory for
    /// peers to reach them).
    fn reg_vec(&self, memory: Vec<u8>, access: AccessFlags) -> Result<ShmMr> {
        let mr = self.alloc_mr(memory.len(), access)?;
        lightpath_verbs::MemoryRegion::write(&mr, 0, &memory)?;
        Ok(mr)
    }

    fn create_qp(&self, send_cq: &ShmCq, recv_cq: &ShmCq, caps: QpCaps) -> Result<ShmQp> {
        let same_device = |cq: &ShmCq| Arc::ptr_eq(&cq.device.shared, &self.device.shared);
        if !same_device(send_cq) || !same_device(recv_cq) {
            return Err(Error::InvalidAttribute("completion queue belongs to another device"));
        }
        let caps = grant(caps)?;
        let shared = &self.device.shared;
        let (qpn, slot, waiter_linked, cell) = {
            let mut core = shared.lock_core();
            if core.qps.len() >= shared.ctx.config.max_qps as usize {
                return Err(Error::InvalidAttribute("more queue pairs than max_qp"));
            }
            let qpn = core.alloc_qpn().ok_or(Error::InvalidAttribute("no queue-pair number left"))?;
            let slot = core.alloc_slot(qpn).ok_or(Error::InvalidAttribute("more queue pairs than max_qp"))?;
            let (send, recv) = (Arc::clone(&send_cq.shared), Arc::clone(&recv_cq.shared));
            let qp = QpCore::new(qpn, slot, self.id, caps, send, recv, shared.ctx.config.direct_min);
            let waiter_linked = Arc::clone(&qp.waiter_linked);
            let cell = core.insert_qp(qp);
            send_cq.shared.attach(&cell);
            if !Arc::ptr_eq(&send_cq.shared, &recv_cq.shared) {
                recv_cq.shared.attach(&cell);
            }
            shared.lock_exports().qp_pds.insert(qpn, self.id);
            (qpn, slot, waiter_linked, cell)
        };
        Ok(ShmQp { pd: self.clone(), qpn, slot, waiter_linked, caps, cell })
    }
}
