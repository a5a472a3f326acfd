//! [`IbvMr`]: memory registered with the device (`ibv_reg_mr`) over memory the region owns.

use std::sync::{Arc, Mutex};

use lightpath_verbs::{AccessFlags, Error, MemoryRegion, Result};

use crate::ffi::types::IbvMr as RawMr;
use crate::memory::RegionMemory;
use crate::pd::PdInner;

/// A registered memory region. Deregistered, then freed, when dropped.
pub struct IbvMr {
    pd: Arc<PdInner>,
    mr: *mut RawMr,
    memory: RegionMemory,
    access: AccessFlags,
    lkey: u32,
    rkey: u32,
    /// Serialises the CPU-side copies, so that two threads using the accessors never race with
    /// each other (the device's DMA is outside any lock, as with every NIC).
    cpu_access: Mutex<()>,
}

// SAFETY: the registration may be used and deregistered from any thread; the memory is owned
// and only reached through the serialised copies.
unsafe impl Send for IbvMr {}
// SAFETY: as above; `&IbvMr` offers only copies under `cpu_access`.
unsafe impl Sync for IbvMr {}

impl IbvMr {
    pub(crate) fn register(pd: Arc<PdInner>, memory: RegionMemory, access: AccessFlags) -> Result<Self> {
        let len = memory.len();
        // The device needs at least one byte to register; an empty region covers one byte of its
        // (page-sized) mapping but reports length 0.
        let reg_len = len.max(1);
        // SAFETY: the domain is alive; the range is owned memory that outlives the registration
        // (Drop deregisters before the memory is freed).
        let mr = unsafe {
            (pd.device.api.reg_mr)(pd.pd, memory.ptr().as_ptr().cast(), reg_len, access.bits() as i32)
        };
        if mr.is_null() {
            return Err(pin_error(len));
        }
        // SAFETY: a registration returned by ibv_reg_mr; its keys never change.
        let (lkey, mut rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        let remote = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
        if rkey == 0 && (access & remote) == AccessFlags::NONE {
            // A region without remote access has no meaningful rkey and rxe reports 0 for all of
            // them; report the lkey instead, which a peer cannot use either (the device checks
            // the region's access), so that every region still has a key of its own.
            rkey = lkey;
        }
        Ok(Self { pd, mr, memory, access, lkey, rkey, cpu_access: Mutex::new(()) })
    }

    fn range(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>> {
        self.memory.range(offset, len).ok_or(Error::InvalidAttribute("range outside the memory region"))
    }
}

/// Explains a failed registration: almost always the locked-memory limit.
fn pin_error(len: usize) -> Error {
    let err = std::io::Error::last_os_error();
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid out-pointer.
    let have_limit = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0;
    let limit_text = match (have_limit, limit.rlim_cur) {
        (false, _) => "unknown".to_string(),
        (true, libc::RLIM_INFINITY) => "unlimited".to_string(),
        (true, bytes) => format!("{bytes} bytes"),
    };
    let hint = match err.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::EAGAIN) | Some(libc::EPERM) => {
            "; the pages could not be pinned: raise the locked-memory limit (ulimit -l, \
             /etc/security/limits.conf) or register less"
        }
        _ => "",
    };
    Error::Unavailable(format!("ibv_reg_mr of {len} bytes failed: {err} (RLIMIT_MEMLOCK {limit_text}){hint}"))
}

impl Drop for IbvMr {
    fn drop(&mut self) {
        // SAFETY: the registration is live and deregistered once, before `memory` (a field
        // dropped after this body) is freed.
        unsafe { (self.pd.device.api.dereg_mr)(self.mr) };
    }
}

impl std::fmt::Debug for IbvMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvMr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.memory.len())
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("access", &self.access)
            .finish()
    }
}

impl MemoryRegion for IbvMr {
    fn addr(&self) -> u64 {
        self.memory.ptr().as_ptr() as u64
    }

    fn len(&self) -> usize {
        self.memory.len()
    }

    fn lkey(&self) -> u32 {
        self.lkey
    }

    fn rkey(&self) -> u32 {
        self.rkey
    }

    fn access(&self) -> AccessFlags {
        self.access
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let range = self.range(offset, dst.len())?;
        let _cpu = self.cpu_access.lock().unwrap_or_else(|p| p.into_inner());
        self.memory.copy_out(range, dst);
        Ok(())
    }

    fn read_uninit<'a>(
        &self,
        offset: usize,
        dst: &'a mut [std::mem::MaybeUninit<u8>],
    ) -> Result<&'a mut [u8]> {
        let range = self.range(offset, dst.len())?;
        let _cpu = self.cpu_access.lock().unwrap_or_else(|p| p.into_inner());
        Ok(self.memory.copy_out_uninit(range, dst))
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let range = self.range(offset, src.len())?;
        let _cpu = self.cpu_access.lock().unwrap_or_else(|p| p.into_inner());
        self.memory.copy_in(range, src);
        Ok(())
    }
}
