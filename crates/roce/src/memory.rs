//! Registered memory: the [`RegionMemory`] trait the engine reads and writes through, a simple
//! owned implementation ([`VecMemory`]), and the table of memory regions that checks keys,
//! bounds and access flags before any byte is touched.
//!
//! Keys: a region's lkey is `(slot + 1) << 8 | generation` (bit 31 clear) and its rkey is the
//! same value with bit 31 set. Lookups are O(1) (the slot is in the key), a key whose slot was
//! reused no longer matches (the generation byte changed), and a local key presented as a
//! remote one (or the reverse) is refused, which catches a common application mistake.

use lightpath_verbs::copy::copy_bytes;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use lightpath_verbs::{AccessFlags, Error, Result};

/// Memory a region is backed by. The engine calls these only after checking bounds, so
/// `offset + len <= self.len()` always holds; implementations may still assert it.
/// Atomics operate on an 8-byte, 8-aligned host-order u64 at `offset` and return the old value.
pub trait RegionMemory: Send + Sync {
    /// Length of the region in bytes.
    fn len(&self) -> usize;
    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]);
    /// Copies `src` into the region starting at `offset`.
    fn write(&self, offset: usize, src: &[u8]);
    /// Atomically: if the u64 at `offset` equals `compare`, replace it by `swap`. Returns the
    /// value found.
    fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64;
    /// Atomically adds `add` (wrapping) to the u64 at `offset`. Returns the value found.
    fn fetch_add(&self, offset: usize, add: u64) -> u64;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The address of the first byte, if the bytes never move while this memory is alive:
    /// then a driver may let the kernel read ranges of it (checked by the engine) while the
    /// engine holds the region ([`EngineConfig::gather_payloads`](crate::EngineConfig::gather_payloads)).
    /// `None` (the default): every read goes through [`RegionMemory::read`].
    fn stable_addr(&self) -> Option<usize> {
        None
    }
}

/// A simple owned region: a byte vector behind a mutex. Meant for tests and the simulator.
pub struct VecMemory {
    bytes: Mutex<Vec<u8>>,
    len: usize,
}

impl VecMemory {
    /// `len` zero bytes.
    pub fn new(len: usize) -> Self {
        Self::from_bytes(vec![0; len])
    }

    /// A region holding exactly `bytes`.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self { bytes: Mutex::new(bytes), len }
    }

    /// A copy of the current contents.
    pub fn snapshot(&self) -> Vec<u8> {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        // A panic while holding the lock cannot leave the bytes in an invalid state (they are
        // plain bytes), so a poisoned lock is still usable.
        self.bytes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn word(bytes: &[u8], offset: usize) -> u64 {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&bytes[offset..offset + 8]);
        u64::from_ne_bytes(raw)
    }
}

impl fmt::Debug for VecMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VecMemory").field("len", &self.len).finish()
    }
}

impl RegionMemory for VecMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, dst: &mut [u8]) {
        copy_bytes(dst, &self.lock()[offset..offset + dst.len()]);
    }

    fn write(&self, offset: usize, src: &[u8]) {
        copy_bytes(&mut self.lock()[offset..offset + src.len()], src);
    }

    fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64 {
        let mut bytes = self.lock();
        let old = Self::word(&bytes, offset);
        if old == compare {
            bytes[offset..offset + 8].copy_from_slice(&swap.to_ne_bytes());
        }
        old
    }

    fn fetch_add(&self, offset: usize, add: u64) -> u64 {
        let mut bytes = self.lock();
        let old = Self::word(&bytes, offset);
        bytes[offset..offset + 8].copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
        old
    }
}

/// The keys of a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrKeys {
    /// Key for local use in scatter/gather entries.
    pub lkey: u32,
    /// Key a peer names in RDMA READ/WRITE/atomic requests.
    pub rkey: u32,
}

/// A refused remote access: unknown or invalidated R_Key, a range outside the region, or a
/// missing permission (answered with NAK 0x62, remote access error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemoteAccessError;

/// Why a local scatter/gather entry was refused (a local protection error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LocalProtectionError;

/// One registered region.
pub(crate) struct MemoryRegion {
    memory: Arc<dyn RegionMemory>,
    addr: u64,
    len: u64,
    access: AccessFlags,
    keys: MrKeys,
    /// Cleared by a SEND with invalidate naming this region's rkey; the region then refuses
    /// every remote access until it is deregistered and registered again.
    remote_valid: bool,
}

impl MemoryRegion {
    /// The byte offset of `[addr, addr + len)` inside the region, if it lies inside.
    fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let start = addr.checked_sub(self.addr)?;
        let end = start.checked_add(len)?;
        if end > self.len {
            return None;
        }
        usize::try_from(start).ok()
    }

    pub(crate) fn memory(&self) -> &dyn RegionMemory {
        &*self.memory
    }
}

struct Slot {
    generation: u8,
    region: Option<MemoryRegion>,
}

/// Bit that distinguishes an rkey from the lkey of the same region.
const RKEY_BIT: u32 = 1 << 31;
/// Largest slot index that still fits the key layout.
const MAX_SLOTS: u32 = (1 << 23) - 2;

/// The engine's table of memory regions.
pub(crate) struct MrTable {
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: u32,
    max: u32,
}

impl MrTable {
    pub(crate) fn new(max: u32) -> Self {
        Self { slots: Vec::new(), free: Vec::new(), live: 0, max: max.min(MAX_SLOTS) }
    }

    pub(crate) fn register(
        &mut self,
        memory: Arc<dyn RegionMemory>,
        addr: u64,
        access: AccessFlags,
    ) -> Result<MrKeys> {
        if !access.is_valid_for_mr() {
            return Err(Error::InvalidAttribute("remote write or atomic access requires local write"));
        }
        let len = memory.len() as u64;
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidAttribute("region wraps the address space"));
        }
        if self.live >= self.max {
            return Err(Error::QueueFull);
        }
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(Slot { generation: 0, region: None });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.generation = slot.generation.wrapping_add(1);
        let lkey = ((index + 1) << 8) | u32::from(slot.generation);
        let keys = MrKeys { lkey, rkey: lkey | RKEY_BIT };
        slot.region = Some(MemoryRegion { memory, addr, len, access, keys, remote_valid: true });
        self.live += 1;
        Ok(keys)
    }

    pub(crate) fn deregister(&mut self, lkey: u32) -> Result<()> {
        let index = self.slot_of(lkey, false).ok_or(Error::NotFound("lkey"))?;
        self.slots[index].region = None;
        self.free.push(index as u32);
        self.live -= 1;
        Ok(())
    }

    fn slot_of(&self, key: u32, remote: bool) -> Option<usize> {
        if (key & RKEY_BIT != 0) != remote {
            return None;
        }
        let index = ((key & !RKEY_BIT) >> 8).checked_sub(1)? as usize;
        let slot = self.slots.get(index)?;
        let region = slot.region.as_ref()?;
        let expected = if remote { region.keys.rkey } else { region.keys.lkey };
        (expected == key).then_some(index)
    }

    fn region(&self, key: u32, remote: bool) -> Option<&MemoryRegion> {
        let index = self.slot_of(key, remote)?;
        self.slots[index].region.as_ref()
    }

    /// Checks a local access of `len` bytes at `addr` through `lkey`; `write` asks for
    /// LOCAL_WRITE. Returns the memory and the offset inside it.
    pub(crate) fn local(
        &self,
        lkey: u32,
        addr: u64,
        len: u64,
        write: bool,
    ) -> std::result::Result<(&dyn RegionMemory, usize), LocalProtectionError> {
        let region = self.region(lkey, false).ok_or(LocalProtectionError)?;
        if write && !region.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(LocalProtectionError);
        }
        let offset = region.offset_of(addr, len).ok_or(LocalProtectionError)?;
        Ok((region.memory(), offset))
    }

    /// Checks a remote access of `len` bytes at `va` through `rkey` needing `need`.
    pub(crate) fn remote(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
        need: AccessFlags,
    ) -> std::result::Result<(&dyn RegionMemory, usize), RemoteAccessError> {
        let region = self.region(rkey, true).ok_or(RemoteAccessError)?;
        if !region.remote_valid || !region.access.contains(need) {
            return Err(RemoteAccessError);
        }
        let offset = region.offset_of(va, len).ok_or(RemoteAccessError)?;
        Ok((region.memory(), offset))
    }

    /// SEND with invalidate: withdraws remote access from the region `rkey` names. Returns
    /// whether such a region exists.
    pub(crate) fn invalidate_remote(&mut self, rkey: u32) -> bool {
        let Some(index) = self.slot_of(rkey, true) else { return false };
        match self.slots[index].region.as_mut() {
            Some(region) if region.remote_valid => {
                region.remote_valid = false;
                true
            }
            _ => false,
        }
    }
}

impl fmt::Debug for MrTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrTable").field("live", &self.live).field("max", &self.max).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(len: usize, addr: u64, access: AccessFlags) -> (MrTable, MrKeys, Arc<VecMemory>) {
        let mut table = MrTable::new(16);
        let memory = Arc::new(VecMemory::new(len));
        let keys = table.register(memory.clone(), addr, access).unwrap();
        (table, keys, memory)
    }

    #[test]
    fn vec_memory_atomics_return_old_value() {
        let memory = VecMemory::new(16);
        assert_eq!(memory.fetch_add(8, 5), 0);
        assert_eq!(memory.fetch_add(8, 5), 5);
        assert_eq!(memory.compare_swap(8, 1, 99), 10);
        assert_eq!(memory.compare_swap(8, 10, 99), 10);
        let mut word = [0u8; 8];
        memory.read(8, &mut word);
        assert_eq!(u64::from_ne_bytes(word), 99);
        assert_eq!(&memory.snapshot()[..8], &[0; 8]);
    }

    #[test]
    fn keys_are_checked_for_kind_bounds_and_permission() {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let (table, keys, _) = table_with(100, 0x1000, access);
        assert_ne!(keys.lkey, keys.rkey);
        assert!(table.local(keys.lkey, 0x1000, 100, true).is_ok());
        assert_eq!(table.local(keys.lkey, 0x1010, 4, false).map(|(_, o)| o), Ok(0x10));
        // One byte too many, or starting before the region.
        assert!(table.local(keys.lkey, 0x1001, 100, false).is_err());
        assert!(table.local(keys.lkey, 0xFFF, 1, false).is_err());
        // The rkey is not an lkey and the reverse.
        assert!(table.local(keys.rkey, 0x1000, 1, false).is_err());
        assert!(table.remote(keys.lkey, 0x1000, 1, AccessFlags::REMOTE_WRITE).is_err());
        assert!(table.remote(keys.rkey, 0x1000, 100, AccessFlags::REMOTE_WRITE).is_ok());
        assert!(table.remote(keys.rkey, 0x1000, 1, AccessFlags::REMOTE_READ).is_err());
        // Overflowing ranges never wrap into the region.
        assert!(table.remote(keys.rkey, u64::MAX, 2, AccessFlags::REMOTE_WRITE).is_err());
    }

    #[test]
    fn local_write_needs_permission() {
        let (table, keys, _) = table_with(8, 0, AccessFlags::REMOTE_READ);
        assert!(table.local(keys.lkey, 0, 8, false).is_ok());
        assert!(table.local(keys.lkey, 0, 8, true).is_err());
    }

    #[test]
    fn invalid_flag_combinations_are_refused() {
        let mut table = MrTable::new(4);
        let memory = Arc::new(VecMemory::new(8));
        assert!(table.register(memory, 0, AccessFlags::REMOTE_WRITE).is_err());
    }

    #[test]
    fn stale_keys_fail_after_reuse() {
        let (mut table, old, _) = table_with(8, 0, AccessFlags::LOCAL_WRITE);
        table.deregister(old.lkey).unwrap();
        assert!(table.deregister(old.lkey).is_err());
        let new = table.register(Arc::new(VecMemory::new(8)), 0, AccessFlags::LOCAL_WRITE).unwrap();
        assert_ne!(new.lkey, old.lkey);
        assert!(table.local(old.lkey, 0, 1, false).is_err());
        assert!(table.local(new.lkey, 0, 1, false).is_ok());
    }

    #[test]
    fn invalidation_withdraws_remote_access_only() {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        let (mut table, keys, _) = table_with(8, 0, access);
        assert!(table.invalidate_remote(keys.rkey));
        assert!(!table.invalidate_remote(keys.rkey));
        assert!(table.remote(keys.rkey, 0, 8, AccessFlags::REMOTE_READ).is_err());
        assert!(table.local(keys.lkey, 0, 8, true).is_ok());
        assert!(!table.invalidate_remote(0x1234_5678));
    }

    #[test]
    fn table_limit_is_enforced() {
        let mut table = MrTable::new(1);
        table.register(Arc::new(VecMemory::new(1)), 0, AccessFlags::NONE).unwrap();
        assert!(matches!(
            table.register(Arc::new(VecMemory::new(1)), 0, AccessFlags::NONE),
            Err(Error::QueueFull)
        ));
    }
}
