//! `QueuePair::write_direct`: the caller's bytes go straight into the peer's mapped region,
//! with the checks an RDMA WRITE gets, and a refused write changes nothing.

mod common;

use common::Fixture;
use lightpath_shm::ShmDevice;
use lightpath_verbs::conformance::harness::{read_region, Pair};
use lightpath_verbs::{AccessFlags, Error, MemoryRegion, QpCaps, QueuePair};

#[test]
fn bytes_land_in_the_peer_region() {
    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    let target = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let result = pair.a.qp.write_direct(target.addr() + 100, target.rkey(), &bytes);
    assert!(matches!(result, Some(Ok(()))), "{result:?}");
    assert_eq!(read_region(&target, 100, 1000), bytes);
    assert_eq!(read_region(&target, 0, 100), vec![0u8; 100], "bytes before the range changed");
    assert_eq!(read_region(&target, 1100, 100), vec![0u8; 100], "bytes after the range changed");
    // Nothing was queued: no completion on either side.
    lightpath_verbs::conformance::harness::assert_empty(&pair.a.cq);
    lightpath_verbs::conformance::harness::assert_empty(&pair.b.cq);
}

#[test]
fn refused_writes_change_nothing() {
    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    let target = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let read_only = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    let bytes = [0xAB_u8; 64];
    let cases = [
        ("a key the peer never gave", target.addr(), target.rkey() ^ 0x5555),
        ("past the region's end", target.addr() + 4096 - 32, target.rkey()),
        ("before the region", target.addr().wrapping_sub(8), target.rkey()),
        ("a region without remote write", read_only.addr(), read_only.rkey()),
    ];
    for (what, addr, rkey) in cases {
        let result = pair.a.qp.write_direct(addr, rkey, &bytes);
        assert!(matches!(result, Some(Err(_))), "{what}: {result:?}");
    }
    assert_eq!(read_region(&target, 0, 4096), vec![0u8; 4096]);
    assert_eq!(read_region(&read_only, 0, 4096), vec![0u8; 4096]);
    // The connection still works.
    let result = pair.a.qp.write_direct(target.addr(), target.rkey(), &bytes);
    assert!(matches!(result, Some(Ok(()))), "{result:?}");
    assert_eq!(read_region(&target, 0, 64), bytes.to_vec());
}

#[test]
fn a_queue_pair_not_in_rts_refuses() {
    let pair = Pair::<ShmDevice>::unconnected_with::<Fixture>(&Default::default());
    let target = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let result = pair.a.qp.write_direct(target.addr(), target.rkey(), &[1, 2, 3]);
    assert!(matches!(result, Some(Err(Error::InvalidState(_)))), "{result:?}");
    assert_eq!(read_region(&target, 0, 3), vec![0u8; 3]);
}

#[test]
fn the_provider_says_it_writes_directly_even_for_no_bytes() {
    // How the stream layer decides, at set-up, whether it needs a staging mirror.
    let pair = Pair::<ShmDevice>::unconnected_with::<Fixture>(&Default::default());
    assert!(pair.a.qp.write_direct(0, 0, &[]).is_some());
    let _ = QpCaps::default();
}
