//! [`SoftMr`]: a registered region over library-owned (or moved-in) memory.

use lightpath_verbs::copy::copy_bytes;
use std::sync::Arc;

use lightpath_roce::MrKeys;
use lightpath_verbs::{AccessFlags, Error, MemoryRegion, Result};

use crate::memory::RegionBytes;
use crate::pd::SoftPd;

/// A memory region of a [`SoftDevice`](crate::SoftDevice). Deregistered when dropped.
pub struct SoftMr {
    pd: SoftPd,
    memory: Arc<RegionBytes>,
    keys: MrKeys,
    access: AccessFlags,
}

impl SoftMr {
    pub(crate) fn register(pd: SoftPd, memory: Arc<RegionBytes>, access: AccessFlags) -> Result<Self> {
        let keys = {
            let mut core = pd.device.lock();
            let shared_memory: Arc<dyn lightpath_roce::RegionMemory> = memory.clone();
            core.engine.reg_mr(shared_memory, memory.addr(), access)?
        };
        Ok(Self { pd, memory, keys, access })
    }

    /// Whether the region's pages are locked into RAM (best effort, see `SoftConfig`).
    pub fn is_locked(&self) -> bool {
        self.memory.is_locked()
    }

    /// Runs `f` on the region's bytes with the region locked for reading (zero copy).
    ///
    /// The engine cannot touch the region while `f` runs, so `f` must be short and must not
    /// call into the device (post, poll, wait): that would deadlock if the engine is waiting
    /// for this region at the time.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        self.memory.with_bytes(f)
    }

    /// Runs `f` on the region's bytes with the region locked for writing (zero copy). The same
    /// rules as for [`SoftMr::with_bytes`] apply.
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.memory.with_bytes_mut(f)
    }

    fn range(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>> {
        // (Not `ok_or`: the error would be built, and dropped, on every access.)
        match self.memory.range(offset, len) {
            Some(range) => Ok(range),
            None => Err(Error::InvalidAttribute("range outside the memory region")),
        }
    }
}

impl std::fmt::Debug for SoftMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftMr")
            .field("addr", &format_args!("{:#x}", self.memory.addr()))
            .field("len", &lightpath_roce::RegionMemory::len(&*self.memory))
            .field("lkey", &format_args!("{:#x}", self.keys.lkey))
            .field("access", &self.access)
            .finish()
    }
}

impl MemoryRegion for SoftMr {
    fn addr(&self) -> u64 {
        self.memory.addr()
    }

    fn len(&self) -> usize {
        lightpath_roce::RegionMemory::len(&*self.memory)
    }

    fn lkey(&self) -> u32 {
        self.keys.lkey
    }

    fn rkey(&self) -> u32 {
        self.keys.rkey
    }

    fn access(&self) -> AccessFlags {
        self.access
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let range = self.range(offset, dst.len())?;
        self.memory.with_bytes(|bytes| copy_bytes(dst, &bytes[range]));
        Ok(())
    }

    fn read_uninit<'a>(
        &self,
        offset: usize,
        dst: &'a mut [std::mem::MaybeUninit<u8>],
    ) -> Result<&'a mut [u8]> {
        let range = self.range(offset, dst.len())?;
        Ok(self.memory.with_bytes(|bytes| dst.write_copy_of_slice(&bytes[range])))
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let range = self.range(offset, src.len())?;
        self.memory.with_bytes_mut(|bytes| copy_bytes(&mut bytes[range], src));
        Ok(())
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        // Requests still in flight that name this region's keys fail with a protection error
        // from here on, as with a NIC; the memory itself stays alive while the engine holds it.
        // The sending lock first: no batch in flight still reads the region's memory.
        let device = &self.pd.device;
        let sending = device.lock_tx();
        let _ = device.lock().engine.dereg_mr(self.keys.lkey);
        device.unlock_tx(sending);
    }
}
