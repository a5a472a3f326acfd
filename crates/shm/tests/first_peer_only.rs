//! A region shared with its first peer only (`MemoryRegion::share_with_first_peer_only`, what
//! a stream's receive ring asks for): the first queue pair of its protection domain to reach
//! RTR hands it to its peer with its introduction (or, marked later, the first peer to ask gets
//! it); that peer's WRITEs succeed; the device closes the region's memfd once it went (an idle
//! connection then costs no descriptor for its ring); another peer queue pair of the same
//! protection domain is refused with a remote access error.

mod common;

use common::{open_descriptors, open_device, to_init, to_rtr, to_rts};
use lightpath_shm::{ShmCq, ShmDevice, ShmQp};
use lightpath_verbs::conformance::harness::{assert_success, read_region, wait_n};
use lightpath_verbs::{
    AccessFlags, Device, MemoryRegion, ProtectionDomain, QpCaps, QueuePair, SendOp, SendWr, WcOpcode,
    WcStatus,
};

/// The tests count this process's descriptors: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn writer(device: &ShmDevice) -> (ShmQp, ShmCq, lightpath_shm::ShmMr) {
    let pd = device.alloc_pd().expect("pd");
    let cq = device.create_cq(16).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).expect("src");
    (qp, cq, src)
}

/// Two devices; on the right, two queue pairs and a ring in one protection domain; on the
/// left, two writers (each its own queue pair, queue and filled source).
struct Scene {
    _devices: (ShmDevice, ShmDevice),
    targets: (ShmQp, ShmQp),
    ring: lightpath_shm::ShmMr,
    first: (ShmQp, ShmCq, lightpath_shm::ShmMr),
    second: (ShmQp, ShmCq, lightpath_shm::ShmMr),
}

impl Scene {
    fn new() -> Self {
        let left = open_device();
        let right = open_device();
        let pd = right.alloc_pd().expect("pd");
        let cq = right.create_cq(16).expect("cq");
        let first_target = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
        let second_target = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
        let ring = pd.alloc_mr(4096, AccessFlags::ALL).expect("ring");
        let first = writer(&left);
        let second = writer(&left);
        first.2.write(0, &[7; 64]).expect("fill");
        second.2.write(0, &[9; 64]).expect("fill");
        Self { _devices: (left, right), targets: (first_target, second_target), ring, first, second }
    }
}

/// Links `qp` (left) and `target` (right) up to RTS both ways.
fn link(qp: &ShmQp, target: &ShmQp) {
    to_init(qp);
    to_init(target);
    to_rtr(qp, target);
    to_rtr(target, qp);
    to_rts(qp);
    to_rts(target);
}

fn write(qp: &ShmQp, src: &lightpath_shm::ShmMr, ring: &lightpath_shm::ShmMr, wr_id: u64, offset: u64) {
    let op = SendOp::Write { remote_addr: ring.addr() + offset, rkey: ring.rkey() };
    qp.post_send(&SendWr::new(wr_id, op, &[src.sge(0, 64)])).expect("post WRITE");
}

/// Marked before RTR: the region goes with the introduction, its memfd is closed then.
#[test]
fn a_region_for_the_first_peer_goes_with_the_introduction() {
    let _serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Scene {
        targets,
        ring,
        first: (first, first_cq, first_src),
        second: (second, second_cq, second_src),
        ..
    } = Scene::new();
    assert!(ring.share_with_first_peer_only(), "shm supports it");

    let before = open_descriptors("lightpath-shm-mr");
    link(&first, &targets.0);
    assert_eq!(
        open_descriptors("lightpath-shm-mr"),
        before - 1,
        "the ring's memfd is still open after it went with the introduction"
    );
    write(&first, &first_src, &ring, 1, 0);
    assert_success(&wait_n(&first_cq, 1)[0], 1, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&ring, 0, 64), vec![7; 64]);

    link(&second, &targets.1);
    write(&second, &second_src, &ring, 2, 64);
    let refused = wait_n(&second_cq, 1)[0];
    assert_eq!(refused.status, WcStatus::RemAccessErr, "{refused:?}");
    assert_eq!(read_region(&ring, 64, 64), vec![0; 64], "the refused WRITE landed");

    // The first peer keeps its mapping.
    write(&first, &first_src, &ring, 3, 128);
    assert_success(&wait_n(&first_cq, 1)[0], 3, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&ring, 128, 64), vec![7; 64]);
}

/// Marked once the queue pairs are linked: the first peer to ask gets it, nobody after.
#[test]
fn a_region_for_the_first_peer_marked_late_goes_to_the_first_that_asks() {
    let _serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Scene {
        targets,
        ring,
        first: (first, first_cq, first_src),
        second: (second, second_cq, second_src),
        ..
    } = Scene::new();
    link(&first, &targets.0);
    link(&second, &targets.1);
    assert!(ring.share_with_first_peer_only(), "shm supports it");

    let before = open_descriptors("lightpath-shm-mr");
    write(&first, &first_src, &ring, 1, 0);
    assert_success(&wait_n(&first_cq, 1)[0], 1, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&ring, 0, 64), vec![7; 64]);
    assert_eq!(
        open_descriptors("lightpath-shm-mr"),
        before - 1,
        "the ring's memfd is still open after its peer took it"
    );

    write(&second, &second_src, &ring, 2, 64);
    let refused = wait_n(&second_cq, 1)[0];
    assert_eq!(refused.status, WcStatus::RemAccessErr, "{refused:?}");
    assert_eq!(read_region(&ring, 64, 64), vec![0; 64], "the refused WRITE landed");
}
