//! Shared machinery of the conformance cases: building connected queue pairs, waiting for
//! completions with a deadline, and the checks many cases repeat.

use std::time::{Duration, Instant};

use super::ConformanceFixture;
use crate::{
    AccessFlags, AddressVector, CompletionQueue, CqOf, Device, Error, MemoryRegion, MrOf, Mtu, PdOf,
    ProtectionDomain, QpAttr, QpCaps, QpOf, QueuePair, WcStatus, WorkCompletion,
};

/// How long a case waits for something that should happen before it declares failure. Generous
/// on purpose: it exists to turn a hang into a failure, not to measure anything.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Responder access every connected pair grants unless a case says otherwise.
pub const FULL_REMOTE_ACCESS: AccessFlags =
    AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ).union(AccessFlags::REMOTE_ATOMIC);

/// Every access flag, as memory regions that serve any remote operation need.
pub const MR_ALL: AccessFlags = AccessFlags::ALL;

/// How a pair of queue pairs is created and connected.
#[derive(Clone, Copy, Debug)]
pub struct PairOptions {
    /// Requested queue sizes.
    pub caps: QpCaps,
    /// Completion queue entries on each side.
    pub cq_entries: u32,
    /// Responder access of both queue pairs (RESET→INIT `access`).
    pub qp_access: AccessFlags,
    /// First PSN side A sends (B's `rq_psn`).
    pub a_psn: u32,
    /// First PSN side B sends (A's `rq_psn`).
    pub b_psn: u32,
    /// Local ACK timeout code (RTR→RTS).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR timer code both responders advertise.
    pub min_rnr_timer: u8,
}

impl Default for PairOptions {
    fn default() -> Self {
        Self {
            caps: QpCaps::default(),
            cq_entries: 1024,
            qp_access: FULL_REMOTE_ACCESS,
            a_psn: 0x00_1000,
            b_psn: 0x77_0000,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            // 0.01 ms: RNR retries in the cases that provoke them come back quickly.
            min_rnr_timer: 1,
        }
    }
}

/// One end: a device with a protection domain, a completion queue used for both send and
/// receive completions, and a queue pair.
pub struct Side<D: Device> {
    /// The queue pair.
    pub qp: QpOf<D>,
    /// Send and receive completions of `qp`.
    pub cq: CqOf<D>,
    /// The protection domain of `qp`.
    pub pd: PdOf<D>,
    /// The device.
    pub device: D,
}

impl<D: Device> std::fmt::Debug for Side<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side").field("device", &self.device.name()).field("qpn", &self.qp.qpn()).finish()
    }
}

impl<D: Device> Side<D> {
    /// Builds the protection domain, completion queue and a RESET queue pair on `device`.
    pub fn new(device: D, options: &PairOptions) -> Self {
        let pd = device.alloc_pd().expect("alloc_pd");
        let cq = device.create_cq(options.cq_entries).expect("create_cq");
        let qp = pd.create_qp(&cq, &cq, options.caps).expect("create_qp");
        Self { qp, cq, pd, device }
    }

    /// Allocates a region, panicking on failure.
    pub fn alloc(&self, len: usize, access: AccessFlags) -> MrOf<D> {
        self.pd.alloc_mr(len, access).expect("alloc_mr")
    }

    /// Waits for exactly one completion.
    pub fn wait_one(&self) -> WorkCompletion {
        wait_n(&self.cq, 1)[0]
    }

    /// Posts a receive of `len` bytes at `offset` of `mr`.
    pub fn post_recv(&self, wr_id: u64, mr: &MrOf<D>, offset: usize, len: u32) {
        let sge = [mr.sge(offset, len)];
        self.qp.post_recv(&crate::RecvWr::new(wr_id, &sge)).expect("post_recv");
    }
}

/// Two connected ends.
pub struct Pair<D: Device> {
    /// Side A (the requester in most cases).
    pub a: Side<D>,
    /// Side B (the responder in most cases).
    pub b: Side<D>,
    /// The path MTU both queue pairs use: the smaller active MTU of the two ports.
    pub mtu: Mtu,
}

impl<D: Device> std::fmt::Debug for Pair<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair").field("a", &self.a).field("b", &self.b).field("mtu", &self.mtu).finish()
    }
}

impl<D: Device> Pair<D> {
    /// Opens two devices with fixture `F` and connects a queue pair on each, with default
    /// options.
    pub fn connected<F: ConformanceFixture<Device = D>>() -> Self {
        Self::connected_with::<F>(&PairOptions::default())
    }

    /// Opens two devices with fixture `F` and connects a queue pair on each.
    pub fn connected_with<F: ConformanceFixture<Device = D>>(options: &PairOptions) -> Self {
        let pair = Self::unconnected_with::<F>(options);
        connect(&pair.a.qp, &pair.b.qp, pair.mtu, options);
        pair
    }

    /// Opens two devices and creates a queue pair on each, left in RESET.
    pub fn unconnected_with<F: ConformanceFixture<Device = D>>(options: &PairOptions) -> Self {
        let (dev_a, dev_b) = F::open_pair();
        let mtu = common_mtu(&dev_a, &dev_b);
        Self { a: Side::new(dev_a, options), b: Side::new(dev_b, options), mtu }
    }
}

/// The smaller active MTU of port 1 of both devices.
pub fn common_mtu<D: Device>(a: &D, b: &D) -> Mtu {
    let a = a.query_port(1).expect("query_port(1)").active_mtu;
    let b = b.query_port(1).expect("query_port(1)").active_mtu;
    a.min(b)
}

/// Moves `qp` RESET→INIT→RTR→RTS towards `peer`. `send_psn` is the first PSN this queue pair
/// sends, `recv_psn` the first it expects.
pub fn bring_up<Q: QueuePair>(
    qp: &Q,
    peer: crate::QpEndpoint,
    mtu: Mtu,
    send_psn: u32,
    recv_psn: u32,
    options: &PairOptions,
) {
    qp.modify(&QpAttr::to_init(options.qp_access)).expect("modify to INIT");
    let av = AddressVector::new(peer.gid, qp.endpoint().gid_index);
    let mut rtr = QpAttr::to_rtr(av, mtu, peer.qpn, recv_psn);
    rtr.min_rnr_timer = Some(options.min_rnr_timer);
    qp.modify(&rtr).expect("modify to RTR");
    let mut rts = QpAttr::to_rts(send_psn);
    rts.timeout = Some(options.timeout);
    rts.retry_cnt = Some(options.retry_cnt);
    rts.rnr_retry = Some(options.rnr_retry);
    qp.modify(&rts).expect("modify to RTS");
}

/// Connects two queue pairs with each other (both end in RTS).
pub fn connect<Q: QueuePair>(a: &Q, b: &Q, mtu: Mtu, options: &PairOptions) {
    bring_up(a, b.endpoint(), mtu, options.a_psn, options.b_psn, options);
    bring_up(b, a.endpoint(), mtu, options.b_psn, options.a_psn, options);
}

/// Waits until `n` completions have been collected from `cq`, or panics at [`DEADLINE`] with
/// what arrived so far.
pub fn wait_n<C: CompletionQueue>(cq: &C, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::with_capacity(n);
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, crate::WcOpcode::Send, 0); 16];
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "expected {n} completions within {DEADLINE:?}, got {}: {got:?}", got.len());
        let want = (n - got.len()).min(buf.len());
        let count = cq.wait(&mut buf[..want], left).expect("cq wait");
        got.extend_from_slice(&buf[..count]);
    }
    got
}

/// Polls once and asserts the queue is empty.
pub fn assert_empty<C: CompletionQueue>(cq: &C) {
    let mut buf = [WorkCompletion::new(0, WcStatus::Success, crate::WcOpcode::Send, 0); 4];
    let count = cq.poll(&mut buf).expect("cq poll");
    assert_eq!(count, 0, "unexpected completions: {:?}", &buf[..count]);
}

/// Asserts a completion is a success with the given identity.
pub fn assert_success(wc: &WorkCompletion, wr_id: u64, opcode: crate::WcOpcode) {
    assert_eq!(wc.status, WcStatus::Success, "completion {wc:?}");
    assert_eq!(wc.wr_id, wr_id, "completion {wc:?}");
    assert_eq!(wc.opcode, opcode, "completion {wc:?}");
}

/// A recognisable byte pattern of `len` bytes, different for each `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 8) as u8)).collect()
}

/// Reads `len` bytes at `offset` of a region.
pub fn read_region<M: MemoryRegion>(mr: &M, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    mr.read(offset, &mut out).expect("region read");
    out
}

/// Waits until `qp` reports `state`, polling its state (state changes caused by the network
/// may trail the completion that reports them by a moment in some providers).
pub fn wait_state<Q: QueuePair>(qp: &Q, state: crate::QpState) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let now = qp.state().expect("qp state");
        if now == state {
            return;
        }
        assert!(Instant::now() < deadline, "QP {} stayed in {now:?}, expected {state:?}", qp.qpn());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Asserts that `result` is the refusal `expected` describes.
pub fn assert_refused<T>(result: crate::Result<T>, what: &str, expected: impl Fn(&Error) -> bool) {
    match result {
        Err(err) if expected(&err) => {}
        Err(err) => panic!("{what}: refused with an unexpected error: {err:?}"),
        Ok(_) => panic!("{what}: accepted, but it must be refused"),
    }
}
