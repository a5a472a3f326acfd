//! The memory behind memory regions: one memfd per region, so a peer that is allowed to READ,
//! WRITE or run atomics on it maps the very same pages and does so itself, with no help from
//! this process (true one-sided operations).
//!
//! ```text
//! [ data: len bytes, rounded up to a page ][ header page: magic | valid | len | rkey ]
//! ```
//!
//! The header tells a peer that cached the mapping whether the region is still registered: the
//! owner clears `valid` when it deregisters, and the peer checks it before every access. A
//! region that grants no remote write or atomic access is sealed against writable mappings, so
//! a peer can map it read-only and nothing more, whatever it tries.

use std::io;
use std::sync::atomic::Ordering;

use lightpath_verbs::AccessFlags;

use crate::sys::{page_size, Mapping, Memfd};

const MAGIC: u64 = u64::from_le_bytes(*b"LPSHMMR\0");
const OFF_MAGIC: usize = 0;
const OFF_VALID: usize = 8;
const OFF_LEN: usize = 16;
const OFF_RKEY: usize = 24;

/// Where the header starts for a region of `len` bytes, and the whole file size.
pub(crate) fn layout(len: u64) -> Option<(usize, u64)> {
    let page = page_size() as u64;
    let data = len.max(1).checked_next_multiple_of(page)?;
    let file = data.checked_add(page)?;
    Some((usize::try_from(data).ok()?, file))
}

/// Whether `access` lets a peer write the region (so its mapping must be writable).
pub(crate) fn peer_writes(access: AccessFlags) -> bool {
    access.contains(AccessFlags::REMOTE_WRITE) || access.contains(AccessFlags::REMOTE_ATOMIC)
}

/// A region this process owns.
#[derive(Debug)]
pub(crate) struct LocalRegion {
    pub(crate) map: Mapping,
    pub(crate) len: usize,
    pub(crate) access: AccessFlags,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) pd: u32,
    header: usize,
}

impl LocalRegion {
    /// Allocates a zero-filled region of `len` bytes; returns it with its memfd (what peers
    /// map: the region itself keeps only its mapping).
    pub(crate) fn alloc(
        len: usize,
        access: AccessFlags,
        lkey: u32,
        rkey: u32,
        pd: u32,
    ) -> io::Result<(Self, Memfd)> {
        let (header, file) = layout(len as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
        let memfd = Memfd::create("lightpath-shm-mr", file)?;
        let map = Mapping::new(&memfd, true)?;
        let fields = [(OFF_MAGIC, MAGIC), (OFF_VALID, 1), (OFF_LEN, len as u64), (OFF_RKEY, u64::from(rkey))];
        for (offset, value) in fields {
            if !map.store_u64(header + offset, value, Ordering::Release) {
                return Err(io::Error::other("region header outside the mapping"));
            }
        }
        if peer_writes(access) {
            memfd.seal_seals()?;
        } else {
            memfd.seal_future_writes()?;
        }
        Ok((Self { map, len, access, lkey, rkey, pd, header }, memfd))
    }

    /// The region's address in this process (what `MemoryRegion::addr` reports).
    pub(crate) fn addr(&self) -> u64 {
        self.map.addr()
    }

    /// `offset..offset + len` inside the data (not the header)?
    pub(crate) fn contains(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// The data offset of address `addr` with `len` bytes after it, if inside the region.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let offset = usize::try_from(addr.checked_sub(self.addr())?).ok()?;
        self.contains(offset, usize::try_from(len).ok()?).then_some(offset)
    }

    /// Tells peers the region is gone (they check before each access).
    pub(crate) fn invalidate(&self) {
        let stored = self.map.store_u64(self.header + OFF_VALID, 0, Ordering::Release);
        debug_assert!(stored);
    }
}

/// A peer's region, mapped here so this process performs WRITE, READ and atomics on it.
#[derive(Debug)]
pub(crate) struct PeerRegion {
    pub(crate) map: Mapping,
    /// The region's address in the owner (what remote addresses are relative to).
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: AccessFlags,
    header: usize,
}

impl PeerRegion {
    /// Checks and maps a region the peer described (`addr`, `len`, `access`) with `memfd`.
    pub(crate) fn map(
        memfd: Memfd,
        rkey: u32,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<Self, &'static str> {
        let (header, file) = layout(len).ok_or("region length out of range")?;
        if memfd.len() < file {
            return Err("region memfd smaller than its length");
        }
        if usize::try_from(len).is_err() || addr.checked_add(len).is_none() {
            return Err("region address range overflows");
        }
        let map =
            Mapping::peer(&memfd, file, peer_writes(access)).map_err(|_| "cannot map the peer's region")?;
        let word = |offset| map.load_u64(header + offset, Ordering::Acquire).unwrap_or(0);
        if word(OFF_MAGIC) != MAGIC || word(OFF_LEN) != len || word(OFF_RKEY) != u64::from(rkey) {
            return Err("region header does not match the peer's description");
        }
        Ok(Self { map, addr, len, access, header })
    }

    /// Whether the owner still has the region registered.
    pub(crate) fn is_valid(&self) -> bool {
        self.map.load_u64(self.header + OFF_VALID, Ordering::Acquire) == Some(1)
    }

    /// The data offset of remote address `addr` with `len` bytes after it, if inside.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let offset = addr.checked_sub(self.addr)?;
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| usize::try_from(offset).ok()).flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn peer_copy(memfd: &Memfd) -> Memfd {
        let fd = memfd.as_fd().try_clone_to_owned().expect("dup");
        Memfd::from_peer(fd, 1).expect("accepted")
    }

    #[test]
    fn peers_share_bytes_and_see_deregistration() {
        let (region, memfd) = LocalRegion::alloc(10_000, AccessFlags::ALL, 1, 2, 0).expect("region");
        let peer =
            PeerRegion::map(peer_copy(&memfd), 2, region.addr(), 10_000, AccessFlags::ALL).expect("map");
        assert!(peer.map.write(9_990, b"0123456789"));
        let mut out = [0u8; 10];
        assert!(region.map.read(9_990, &mut out));
        assert_eq!(&out, b"0123456789");
        assert_eq!(peer.offset_of(region.addr() + 9_990, 10), Some(9_990));
        assert_eq!(peer.offset_of(region.addr() + 9_991, 10), None);
        assert_eq!(peer.offset_of(region.addr() - 1, 1), None);
        assert!(peer.is_valid());
        region.invalidate();
        assert!(!peer.is_valid());
    }

    #[test]
    fn read_only_regions_cannot_be_mapped_writable_by_peers() {
        let (region, memfd) = LocalRegion::alloc(4096, AccessFlags::REMOTE_READ, 1, 2, 0).expect("region");
        // A peer that claims write access (or simply tries) cannot get a writable mapping.
        assert!(PeerRegion::map(peer_copy(&memfd), 2, region.addr(), 4096, AccessFlags::ALL).is_err());
        let peer = PeerRegion::map(peer_copy(&memfd), 2, region.addr(), 4096, AccessFlags::REMOTE_READ)
            .expect("read-only");
        assert!(!peer.map.write(0, b"x"));
        assert!(region.map.write(0, b"owner writes"), "the owner's mapping stays writable");
    }

    #[test]
    fn descriptions_that_disagree_with_the_header_are_refused() {
        let (region, memfd) = LocalRegion::alloc(4096, AccessFlags::ALL, 1, 2, 0).expect("region");
        assert!(
            PeerRegion::map(peer_copy(&memfd), 3, region.addr(), 4096, AccessFlags::ALL).is_err(),
            "rkey"
        );
        assert!(PeerRegion::map(peer_copy(&memfd), 2, region.addr(), 4000, AccessFlags::ALL).is_err(), "len");
        assert!(
            PeerRegion::map(peer_copy(&memfd), 2, region.addr(), 1 << 40, AccessFlags::ALL).is_err(),
            "file"
        );
        assert!(
            PeerRegion::map(peer_copy(&memfd), 2, u64::MAX - 10, 4096, AccessFlags::ALL).is_err(),
            "overflow"
        );
    }
}
