//! Cases: memory-region registration and the owner's byte accessors.

use std::collections::HashSet;

use crate::conformance::harness::{assert_refused, pattern, read_region};
use crate::conformance::ConformanceFixture;
use crate::{AccessFlags, Device, Error, MemoryRegion, ProtectionDomain};

/// Every one of the 16 access combinations: the 10 verbs allows register with exactly that
/// access and distinct keys; the 6 with remote write or atomic but no local write are refused.
pub fn mr_access_combinations<F: ConformanceFixture>() {
    let (device, _other) = F::open_pair();
    let pd = device.alloc_pd().expect("alloc_pd");
    let mut lkeys = HashSet::new();
    let mut rkeys = HashSet::new();
    let mut regions = Vec::new();
    for bits in 0..16 {
        let access = AccessFlags::from_raw(bits).expect("four known bits");
        let result = pd.alloc_mr(4096, access);
        if access.is_valid_for_mr() {
            let mr = result.unwrap_or_else(|e| panic!("alloc_mr({access:?}) refused: {e}"));
            assert_eq!(mr.access(), access);
            assert_eq!(mr.len(), 4096);
            assert!(!mr.is_empty());
            assert!(lkeys.insert(mr.lkey()), "lkey {:#x} reused", mr.lkey());
            assert!(rkeys.insert(mr.rkey()), "rkey {:#x} reused", mr.rkey());
            assert_eq!(mr.remote().rkey, mr.rkey());
            assert_eq!(mr.sge(16, 8).addr, mr.addr() + 16);
            regions.push(mr);
        } else {
            assert_refused(result, &format!("alloc_mr({access:?})"), |e| {
                matches!(e, Error::InvalidAttribute(_))
            });
        }
    }
    assert_eq!(regions.len(), 10);
    // Sizes that are not a page multiple work too.
    for len in [1usize, 4097, 10_000] {
        let mr = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).expect("odd-sized region");
        assert_eq!(mr.len(), len);
    }
}

/// New regions read as zeroes; writes read back; accesses outside the region are refused and
/// leave it unchanged.
pub fn mr_byte_accessors<F: ConformanceFixture>() {
    let (device, _other) = F::open_pair();
    let pd = device.alloc_pd().expect("alloc_pd");
    let mr = pd.alloc_mr(10_000, AccessFlags::LOCAL_WRITE).expect("alloc_mr");
    let neighbour = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).expect("alloc_mr");
    assert_eq!(read_region(&mr, 0, 10_000), vec![0u8; 10_000], "new region is not zeroed");

    let data = pattern(300, 7);
    mr.write(4000, &data).expect("write across a page boundary");
    assert_eq!(read_region(&mr, 4000, 300), data);
    let mut spare = vec![std::mem::MaybeUninit::<u8>::uninit(); 300];
    let read = mr.read_uninit(4000, &mut spare).expect("read_uninit across a page boundary");
    assert_eq!(read, &data[..], "read_uninit differs from read");
    assert_eq!(read_region(&mr, 3990, 10), vec![0u8; 10]);
    mr.write_u64(9992, 0x0123_4567_89ab_cdef).expect("write_u64 at the end");
    assert_eq!(mr.read_u64(9992).expect("read_u64"), 0x0123_4567_89ab_cdef);

    let before = read_region(&mr, 0, 10_000);
    let out_of_bounds = |e: &Error| matches!(e, Error::InvalidAttribute(_));
    let mut two = [0u8; 2];
    assert_refused(mr.read(9999, &mut two), "read past the end", out_of_bounds);
    assert_refused(mr.write(9999, &[1, 2]), "write past the end", out_of_bounds);
    assert_refused(mr.read(usize::MAX, &mut two), "read at usize::MAX", out_of_bounds);
    let mut spare_two = [std::mem::MaybeUninit::<u8>::uninit(); 2];
    assert_refused(mr.read_uninit(9999, &mut spare_two), "read_uninit past the end", out_of_bounds);
    assert_refused(mr.read_uninit(usize::MAX, &mut spare_two), "read_uninit at usize::MAX", out_of_bounds);
    assert_refused(mr.write(usize::MAX - 1, &[1, 2, 3]), "write wrapping around", out_of_bounds);
    assert_refused(mr.read_u64(9996), "read_u64 past the end", out_of_bounds);
    mr.write(10_000, &[]).expect("an empty write at the end is in bounds");
    assert_eq!(read_region(&mr, 0, 10_000), before, "refused accesses changed the region");
    assert_eq!(read_region(&neighbour, 0, 4096), vec![0u8; 4096], "another region changed");
}
