//! [`ShmMr`]: a registered region whose bytes live in a memfd shared with the peers allowed to
//! reach it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use lightpath_verbs::{AccessFlags, Error, MemoryRegion, Result};

use crate::device::DeviceInner;
use crate::region::LocalRegion;

/// A memory region of an [`ShmDevice`](crate::ShmDevice). Deregistered when dropped: peers
/// that cached it see it invalid before their next access.
pub struct ShmMr {
    pub(crate) device: Arc<DeviceInner>,
    pub(crate) region: Arc<LocalRegion>,
}

impl std::fmt::Debug for ShmMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmMr")
            .field("addr", &format_args!("{:#x}", self.region.addr()))
            .field("len", &self.region.len)
            .field("lkey", &format_args!("{:#x}", self.region.lkey))
            .field("access", &self.region.access)
            .finish()
    }
}

fn out_of_range() -> Error {
    Error::InvalidAttribute("range outside the memory region")
}

impl MemoryRegion for ShmMr {
    fn addr(&self) -> u64 {
        self.region.addr()
    }

    fn len(&self) -> usize {
        self.region.len
    }

    fn lkey(&self) -> u32 {
        self.region.lkey
    }

    fn rkey(&self) -> u32 {
        self.region.rkey
    }

    fn access(&self) -> AccessFlags {
        self.region.access
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if self.region.contains(offset, dst.len()) && self.region.map.read(offset, dst) {
            Ok(())
        } else {
            Err(out_of_range())
        }
    }

    fn read_uninit<'a>(
        &self,
        offset: usize,
        dst: &'a mut [std::mem::MaybeUninit<u8>],
    ) -> Result<&'a mut [u8]> {
        if !self.region.contains(offset, dst.len()) {
            return Err(out_of_range());
        }
        self.region.map.read_uninit(offset, dst).ok_or_else(out_of_range)
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        if self.region.contains(offset, src.len()) && self.region.map.write(offset, src) {
            Ok(())
        } else {
            Err(out_of_range())
        }
    }

    /// An atomic load when `offset` is 8-byte aligned (so a value a peer's atomic wrote is
    /// read whole), a copy otherwise.
    fn read_u64(&self, offset: usize) -> Result<u64> {
        if !self.region.contains(offset, 8) {
            return Err(out_of_range());
        }
        if offset.is_multiple_of(8) {
            return self.region.map.load_u64(offset, Ordering::Acquire).ok_or_else(out_of_range);
        }
        let mut bytes = [0u8; 8];
        self.read(offset, &mut bytes)?;
        Ok(u64::from_ne_bytes(bytes))
    }

    /// An atomic store when `offset` is 8-byte aligned, a copy otherwise.
    fn write_u64(&self, offset: usize, value: u64) -> Result<()> {
        if !self.region.contains(offset, 8) {
            return Err(out_of_range());
        }
        if offset.is_multiple_of(8) && self.region.map.store_u64(offset, value, Ordering::Release) {
            return Ok(());
        }
        self.write(offset, &value.to_ne_bytes())
    }

    /// Marks the export: the next queue pair of the region's protection domain to reach RTR
    /// hands it to its peer with its introduction (or, if none does first, the socket thread
    /// answers the first question about it), and its memfd is closed once it went; later
    /// questions get "no such region".
    fn share_with_first_peer_only(&self) -> bool {
        let shared = &self.device.shared;
        let mut exports = shared.lock_exports();
        if let Some(export) = exports.regions.get_mut(&self.region.rkey) {
            export.first_peer_only = true;
            if export.memfd.is_some() {
                exports.offers.entry(self.region.pd).or_insert(self.region.rkey);
            }
        }
        true
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        self.region.invalidate();
        let shared = &self.device.shared;
        shared.tables.regions_mut().remove(&self.region.lkey);
        let mut exports = shared.lock_exports();
        exports.regions.remove(&self.region.rkey);
        if exports.offers.get(&self.region.pd) == Some(&self.region.rkey) {
            exports.offers.remove(&self.region.pd);
        }
    }
}
