//! What the shm tests share: the conformance fixture (two default devices), and for the tests
//! of the helper threads' region questions a device configuration under which a stuck question
//! turns into a failed completion quickly, queue-pair set-up one step at a time, and waiting on
//! a notification fd without driving the device.

#![allow(dead_code)] // each test binary uses its own part

use std::os::fd::BorrowedFd;
use std::time::Duration;

use lightpath_shm::{ShmConfig, ShmCq, ShmDevice, ShmMr, ShmQp};
use lightpath_verbs::conformance::harness::{assert_success, read_region, wait_n, FULL_REMOTE_ACCESS};
use lightpath_verbs::conformance::ConformanceFixture;
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, MemoryRegion, Mtu, QpAttr, QpCaps, QueuePair, SendOp,
    SendWr, WcOpcode,
};
use rustix::event::{poll, PollFd, PollFlags, Timespec};

/// Two shm devices with the default configuration, for the harness's `Pair`.
pub struct Fixture;

impl ConformanceFixture for Fixture {
    type Device = ShmDevice;

    fn open_pair() -> (ShmDevice, ShmDevice) {
        let open = || ShmDevice::open(ShmConfig::default()).expect("shm device");
        (open(), open())
    }
}

/// Bytes each WRITE carries.
pub const LEN: u32 = 256;
/// The immediate of the WRITE with immediate.
pub const IMM: u32 = 0x5eed_0001;

/// A device whose region questions time out after `rpc_timeout`: a question nobody answers
/// (the bug these tests guard against) fails its WRITE with `RetryExcErr` instead of stalling.
/// The timeout is still far longer than any answer takes, so a slow machine does not fail.
pub fn open_device() -> ShmDevice {
    let config = ShmConfig {
        rpc_timeout: Duration::from_secs(2),
        ring_bytes: 64 << 10,
        max_fragment: 8 << 10,
        spin: Duration::ZERO,
        ..ShmConfig::default()
    };
    ShmDevice::open(config).expect("shm device")
}

/// RESET→INIT.
pub fn to_init(qp: &ShmQp) {
    qp.modify(&QpAttr::to_init(FULL_REMOTE_ACCESS)).expect("modify to INIT");
}

/// INIT→RTR towards `peer` (which introduces `qp` to the peer's device).
pub fn to_rtr(qp: &ShmQp, peer: &ShmQp) {
    let endpoint = peer.endpoint();
    let av = AddressVector::new(endpoint.gid, 0);
    qp.modify(&QpAttr::to_rtr(av, Mtu::Mtu4096, endpoint.qpn, 0)).expect("modify to RTR");
}

/// RTR→RTS.
pub fn to_rts(qp: &ShmQp) {
    qp.modify(&QpAttr::to_rts(0)).expect("modify to RTS");
}

/// One side's queue pair and queues.
pub struct End {
    pub qp: ShmQp,
    pub cq: ShmCq,
    /// Source of this side's WRITEs.
    pub src: ShmMr,
    /// Where the peer's WRITEs land (and the receive for its WRITE with immediate).
    pub dst: ShmMr,
}

impl End {
    /// A RESET queue pair on `device` with its own completion queue and regions; `seed` tells
    /// this side's bytes apart.
    pub fn new(device: &ShmDevice, seed: u8) -> Self {
        use lightpath_verbs::{Device, ProtectionDomain};
        let pd = device.alloc_pd().expect("pd");
        let cq = device.create_cq(64).expect("cq");
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
        let src = pd.alloc_mr(2 * LEN as usize, AccessFlags::LOCAL_WRITE).expect("src");
        let dst = pd.alloc_mr(2 * LEN as usize, AccessFlags::ALL).expect("dst");
        src.write(0, &bytes(seed, 2 * LEN as usize)).expect("fill");
        Self { qp, cq, src, dst }
    }

    /// Posts the receive the peer's WRITE with immediate consumes (allowed from INIT on).
    pub fn post_recv(&self) {
        self.qp.post_recv(&lightpath_verbs::RecvWr::new(7, &[])).expect("post_recv");
    }

    /// Posts a WRITE (wr 1) of the first `LEN` bytes and a WRITE with immediate (wr 2) of the
    /// next `LEN` bytes into `peer`'s `dst`.
    pub fn post_writes(&self, peer: &End) {
        let first = [self.src.sge(0, LEN)];
        let second = [self.src.sge(LEN as usize, LEN)];
        let write = SendOp::Write { remote_addr: peer.dst.addr(), rkey: peer.dst.rkey() };
        let write_imm = SendOp::WriteWithImm {
            remote_addr: peer.dst.addr() + u64::from(LEN),
            rkey: peer.dst.rkey(),
            imm: IMM,
        };
        self.qp.post_send(&SendWr::new(1, write, &first)).expect("post WRITE");
        self.qp.post_send(&SendWr::new(2, write_imm, &second)).expect("post WRITE with immediate");
    }

    /// Checks that both WRITEs completed successfully here and that their bytes landed in
    /// `peer`'s region, whose receive completed with the immediate. `round` names the set-up.
    pub fn check_writes(&self, peer: &End, seed: u8, round: usize) {
        let mut sent = wait_n(&self.cq, 2);
        sent.sort_by_key(|wc| wc.wr_id);
        for wc in &sent {
            assert!(wc.status.is_success(), "round {round}: WRITE {} failed: {wc:?}", wc.wr_id);
        }
        assert_success(&sent[0], 1, WcOpcode::RdmaWrite);
        assert_success(&sent[1], 2, WcOpcode::RdmaWrite);
        let received = wait_n(&peer.cq, 1)[0];
        assert_success(&received, 7, WcOpcode::RecvRdmaWithImm);
        assert_eq!(received.imm_data, Some(IMM), "round {round}");
        assert_eq!(
            read_region(&peer.dst, 0, 2 * LEN as usize),
            bytes(seed, 2 * LEN as usize),
            "round {round}"
        );
    }
}

/// A recognisable pattern for side `seed`.
pub fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

/// Blocks in `poll(2)` until `cq`'s notification fd fires (the caller armed it), without
/// calling into the device: whatever happens meanwhile is the helper threads' doing.
pub fn wait_for_notification(cq: &ShmCq, round: usize) {
    let fd = cq.notify_fd().expect("an fd");
    // SAFETY: the fd belongs to the queue, which outlives this borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let timeout = Timespec { tv_sec: 30, tv_nsec: 0 };
    assert_eq!(poll(&mut fds, Some(&timeout)).expect("poll(2)"), 1, "round {round}: no notification");
    assert!(cq.take_notify().expect("take"), "round {round}: readable fd without a notification");
}

/// Descriptors of this process whose `/proc/self/fd` link contains `name` (`socket:`, a memfd's
/// name).
pub fn open_descriptors(name: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("fd list")
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains(name))
        .count()
}
