//! Scatter/gather lists and how they resolve to this process's memory regions.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use lightpath_verbs::{AccessFlags, Sge};

use crate::region::LocalRegion;

/// A hasher for small integer keys (queue-pair numbers, local keys), which are dense
/// counters: a multiplication spreads them, no need for SipHash on the hot path.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by small integers.
pub(crate) type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// This device's registered regions by local key.
pub(crate) type Regions = IdMap<Arc<LocalRegion>>;

/// A scatter/gather list kept with a work request (up to four entries without allocating).
#[derive(Clone, Debug)]
pub(crate) struct SgeList {
    inline: [Sge; 4],
    inline_len: u8,
    heap: Vec<Sge>,
}

impl SgeList {
    pub(crate) fn new(sges: &[Sge]) -> Self {
        let mut list = Self { inline: [Sge::default(); 4], inline_len: 0, heap: Vec::new() };
        if sges.len() <= list.inline.len() {
            list.inline[..sges.len()].copy_from_slice(sges);
            list.inline_len = sges.len() as u8;
        } else {
            list.heap = sges.to_vec();
        }
        list
    }

    pub(crate) fn as_slice(&self) -> &[Sge] {
        if self.heap.is_empty() {
            &self.inline[..usize::from(self.inline_len)]
        } else {
            &self.heap
        }
    }

    /// Total bytes the entries cover.
    pub(crate) fn total(&self) -> u64 {
        self.as_slice().iter().map(|sge| u64::from(sge.length)).sum()
    }
}

/// The region an entry names and the entry's offset in it, if the entry is usable by a queue
/// pair of protection domain `pd` (and the region is locally writable when `write`).
pub(crate) fn resolve<'r>(
    sge: &Sge,
    regions: &'r Regions,
    pd: u32,
    write: bool,
) -> Option<(&'r LocalRegion, usize)> {
    let region = regions.get(&sge.lkey)?;
    if region.pd != pd || (write && !region.access.contains(AccessFlags::LOCAL_WRITE)) {
        return None;
    }
    Some((region, region.offset_of(sge.addr, u64::from(sge.length))?))
}

/// Whether every entry resolves (see `resolve`). Zero-length entries are checked too, as a
/// NIC checks their key.
pub(crate) fn check(sges: &[Sge], regions: &Regions, pd: u32, write: bool) -> bool {
    sges.iter().all(|sge| resolve(sge, regions, pd, write).is_some())
}

/// Visits the pieces of message bytes `start..start + len` as laid out over `sges`: for each,
/// `visit(region, offset in the region, offset relative to start, length)`. Returns false if an
/// entry does not resolve, the list is too short, or a visit returns false.
pub(crate) fn pieces(
    sges: &[Sge],
    regions: &Regions,
    pd: u32,
    write: bool,
    start: u64,
    len: u64,
    mut visit: impl FnMut(&LocalRegion, usize, usize, usize) -> bool,
) -> bool {
    let end = start + len;
    let mut position = 0u64;
    let mut done = 0u64;
    for sge in sges {
        if done == len {
            break;
        }
        let sge_end = position + u64::from(sge.length);
        if sge_end > start && position < end && sge.length > 0 {
            let Some((region, base)) = resolve(sge, regions, pd, write) else { return false };
            let from = start.max(position);
            let to = end.min(sge_end);
            let piece = (to - from) as usize;
            let region_offset = base + (from - position) as usize;
            if !visit(region, region_offset, (from - start) as usize, piece) {
                return false;
            }
            done += to - from;
        }
        position = sge_end;
    }
    done == len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regions() -> (Regions, Arc<LocalRegion>, Arc<LocalRegion>) {
        let writable =
            Arc::new(LocalRegion::alloc(4096, AccessFlags::LOCAL_WRITE, 1, 11, 7).expect("region").0);
        let read_only = Arc::new(LocalRegion::alloc(4096, AccessFlags::NONE, 2, 12, 7).expect("region").0);
        let mut map = Regions::default();
        map.insert(1, Arc::clone(&writable));
        map.insert(2, Arc::clone(&read_only));
        (map, writable, read_only)
    }

    #[test]
    fn checks_keys_domains_bounds_and_write_access() {
        let (map, writable, read_only) = regions();
        let good = Sge { addr: writable.addr() + 100, length: 200, lkey: 1 };
        assert!(check(&[good], &map, 7, true));
        assert!(!check(&[good], &map, 8, false), "another protection domain");
        assert!(!check(&[Sge { lkey: 9, ..good }], &map, 7, false), "unknown key");
        assert!(!check(&[Sge { addr: writable.addr() + 4000, ..good }], &map, 7, false), "past the end");
        assert!(!check(&[Sge { addr: writable.addr() - 1, ..good }], &map, 7, false), "before the start");
        let ro = Sge { addr: read_only.addr(), length: 10, lkey: 2 };
        assert!(check(&[ro], &map, 7, false));
        assert!(!check(&[ro], &map, 7, true), "no LOCAL_WRITE");
    }

    #[test]
    fn pieces_follow_the_list() {
        let (map, a, b) = regions();
        let sges = [
            Sge { addr: a.addr() + 10, length: 5, lkey: 1 },
            Sge { addr: b.addr() + 100, length: 0, lkey: 2 },
            Sge { addr: b.addr() + 20, length: 10, lkey: 2 },
        ];
        let mut seen = Vec::new();
        assert!(pieces(&sges, &map, 7, false, 3, 8, |region, offset, rel, len| {
            seen.push((region.lkey, offset, rel, len));
            true
        }));
        assert_eq!(seen, vec![(1, 13, 0, 2), (2, 20, 2, 6)]);
        assert!(!pieces(&sges, &map, 7, false, 10, 6, |_, _, _, _| true), "list shorter than the range");
        assert!(pieces(&sges, &map, 7, false, 15, 0, |_, _, _, _| panic!("visited an empty range")));
        let list = SgeList::new(&sges);
        assert_eq!((list.as_slice(), list.total()), (&sges[..], 15));
        let long = vec![sges[0]; 9];
        assert_eq!(SgeList::new(&long).as_slice().len(), 9);
    }
}
