//! A region shared with its first peer only (`MemoryRegion::share_with_first_peer_only`, what
//! a stream's receive ring asks for): the first peer queue pair that WRITEs into it succeeds,
//! and keeps doing so; the device closes the region's memfd once that peer has it (an idle
//! connection then costs no descriptor for its ring); another peer queue pair of the same
//! protection domain is refused with a remote access error.

mod common;

use common::{open_device, to_init, to_rtr, to_rts};
use lightpath_shm::{ShmCq, ShmDevice, ShmQp};
use lightpath_verbs::conformance::harness::{assert_success, read_region, wait_n};
use lightpath_verbs::{
    AccessFlags, Device, MemoryRegion, ProtectionDomain, QpCaps, QueuePair, SendOp, SendWr, WcOpcode,
    WcStatus,
};

/// Region memfds this process holds.
fn region_memfds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("fd list")
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("lightpath-shm-mr"))
        .count()
}

fn writer(device: &ShmDevice) -> (ShmQp, ShmCq, lightpath_shm::ShmMr) {
    let pd = device.alloc_pd().expect("pd");
    let cq = device.create_cq(16).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).expect("src");
    (qp, cq, src)
}

#[test]
fn a_region_shared_with_its_first_peer_only_refuses_the_second_and_keeps_no_memfd() {
    let left = open_device();
    let right = open_device();
    let pd = right.alloc_pd().expect("pd");
    let cq = right.create_cq(16).expect("cq");
    let first_target = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let second_target = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let ring = pd.alloc_mr(4096, AccessFlags::ALL).expect("ring");
    assert!(ring.share_with_first_peer_only(), "shm supports it");

    let (first, first_cq, first_src) = writer(&left);
    let (second, second_cq, second_src) = writer(&left);
    for (qp, target) in [(&first, &first_target), (&second, &second_target)] {
        to_init(qp);
        to_init(target);
        to_rtr(qp, target);
        to_rtr(target, qp);
        to_rts(qp);
        to_rts(target);
    }
    first_src.write(0, &[7; 64]).expect("fill");
    second_src.write(0, &[9; 64]).expect("fill");
    let before = region_memfds();
    let write = |qp: &ShmQp, src: &lightpath_shm::ShmMr, wr_id: u64, offset: u64| {
        let op = SendOp::Write { remote_addr: ring.addr() + offset, rkey: ring.rkey() };
        qp.post_send(&SendWr::new(wr_id, op, &[src.sge(0, 64)])).expect("post WRITE");
    };

    write(&first, &first_src, 1, 0);
    assert_success(&wait_n(&first_cq, 1)[0], 1, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&ring, 0, 64), vec![7; 64]);
    assert_eq!(region_memfds(), before - 1, "the ring's memfd is still open after its peer took it");

    write(&second, &second_src, 2, 64);
    let refused = wait_n(&second_cq, 1)[0];
    assert_eq!(refused.status, WcStatus::RemAccessErr, "{refused:?}");
    assert_eq!(read_region(&ring, 64, 64), vec![0; 64], "the refused WRITE landed");

    // The first peer keeps its mapping.
    write(&first, &first_src, 3, 128);
    assert_success(&wait_n(&first_cq, 1)[0], 3, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&ring, 128, 64), vec![7; 64]);
}
