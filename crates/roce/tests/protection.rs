//! Memory protection: every remote access is checked against R_Key, bounds, region and QP
//! permissions and atomic alignment; violations get the right NAK and status and never touch
//! memory (guard bytes around every region prove it). Local keys are checked too.

mod common;

use common::*;
use lightpath_verbs::{AccessFlags, Mtu, QpState, SendOp, WcStatus};
use lightpath_wire::{NakCode, Opcode, Syndrome};

struct Outcome {
    requester: Vec<(u64, WcStatus)>,
    nak: Option<Syndrome>,
}

fn outcome(net: &mut Net, c: &Conn) -> Outcome {
    let requester = poll_all(net, 0, c.a.send_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    let nak = net
        .trace
        .iter()
        .filter(|s| s.opcode == Opcode::RC_ACKNOWLEDGE)
        .filter_map(|s| s.syndrome)
        .find(|s| matches!(s, Syndrome::Nak(_)));
    Outcome { requester, nak }
}

/// Builds the operation under test against the target buffer.
type OpMaker = fn(&Buf) -> SendOp;

const REMOTE_ACCESS: Syndrome = Syndrome::Nak(NakCode::RemoteAccessError);
const INVALID_REQUEST: Syndrome = Syndrome::Nak(NakCode::InvalidRequest);

/// Runs one remote operation against a 256-byte target region at 0x4000 with `access`,
/// and checks the expected status, NAK, that the target is unchanged and that both queue
/// pairs ended as expected.
fn attempt(
    op: impl Fn(&Buf) -> SendOp,
    access: AccessFlags,
    qp_access: AccessFlags,
    status: WcStatus,
    nak: Syndrome,
) {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { access: qp_access, mtu: Mtu::Mtu256, ..Opts::default() });
    let original = pattern(256, 0x5A);
    let target = reg(&mut net, 1, original.clone(), 0x4000, access);
    let local = reg(&mut net, 0, pattern(1024, 1), 0x1000, rw());
    let op = op(&target);
    let len = if op.is_atomic() { 8 } else { 300 };
    post_send(&mut net, c.a, &send_wr(1, op, &[local.sge(0, len)]));
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[local.sge(0, 4)]));
    net.run();
    let result = outcome(&mut net, &c);
    assert_eq!(result.requester, vec![(1, status), (2, WcStatus::WrFlushErr)], "{op:?}");
    assert_eq!(result.nak, Some(nak), "{op:?}");
    assert_eq!(target.contents(), original, "{op:?} touched the target");
    assert!(target.mem.guards_intact());
    // Nothing was read into the local buffer either.
    assert_eq!(local.contents(), pattern(1024, 1));
    // Class C: both ends are in ERR.
    assert_eq!(net.engines[0].qp_state(c.a.qpn).unwrap(), QpState::Err);
    assert_eq!(net.engines[1].qp_state(c.b.qpn).unwrap(), QpState::Err);
}

#[test]
fn bad_rkey() {
    for op in [
        |t: &Buf| SendOp::Write { remote_addr: t.addr, rkey: t.keys.rkey ^ 0x100 },
        |t: &Buf| SendOp::Read { remote_addr: t.addr, rkey: t.keys.rkey + 1 },
        |t: &Buf| SendOp::FetchAdd { remote_addr: t.addr, rkey: 0x8000_0000, add: 1 },
        // An lkey is not an rkey.
        |t: &Buf| SendOp::Write { remote_addr: t.addr, rkey: t.keys.lkey },
    ] {
        attempt(op, rw(), rw(), WcStatus::RemAccessErr, REMOTE_ACCESS);
    }
}

#[test]
fn out_of_bounds_at_both_ends() {
    // 300 bytes: starting 1 byte before the region, or ending 1 byte past it (the region is
    // 256 bytes; 300 bytes never fit).
    for op in [
        |t: &Buf| SendOp::Write { remote_addr: t.addr - 1, rkey: t.keys.rkey },
        |t: &Buf| SendOp::Write { remote_addr: t.addr, rkey: t.keys.rkey },
        |t: &Buf| SendOp::Read { remote_addr: t.addr - 1, rkey: t.keys.rkey },
        |t: &Buf| SendOp::Read { remote_addr: t.addr + 100, rkey: t.keys.rkey },
        |t: &Buf| SendOp::CompareSwap { remote_addr: t.addr + 256, rkey: t.keys.rkey, compare: 0, swap: 1 },
        |t: &Buf| SendOp::FetchAdd { remote_addr: t.addr - 8, rkey: t.keys.rkey, add: 1 },
        |t: &Buf| SendOp::Write { remote_addr: u64::MAX - 10, rkey: t.keys.rkey },
    ] {
        attempt(op, rw(), rw(), WcStatus::RemAccessErr, REMOTE_ACCESS);
    }
}

#[test]
fn region_permissions() {
    let local_write = AccessFlags::LOCAL_WRITE;
    let cases: [(OpMaker, AccessFlags); 3] = [
        (
            |t| SendOp::Write { remote_addr: t.addr, rkey: t.keys.rkey },
            local_write | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        ),
        (
            |t| SendOp::Read { remote_addr: t.addr, rkey: t.keys.rkey },
            local_write | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
        ),
        (
            |t| SendOp::FetchAdd { remote_addr: t.addr, rkey: t.keys.rkey, add: 1 },
            local_write | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ),
    ];
    for (op, access) in cases {
        attempt(op, access, rw(), WcStatus::RemAccessErr, REMOTE_ACCESS);
    }
}

#[test]
fn queue_pair_permissions_give_invalid_request() {
    let all = rw();
    let cases: [(OpMaker, AccessFlags); 3] = [
        (
            |t| SendOp::Write { remote_addr: t.addr, rkey: t.keys.rkey },
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ),
        (
            |t| SendOp::Read { remote_addr: t.addr, rkey: t.keys.rkey },
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ),
        (
            |t| SendOp::CompareSwap { remote_addr: t.addr, rkey: t.keys.rkey, compare: 0, swap: 9 },
            AccessFlags::LOCAL_WRITE,
        ),
    ];
    for (op, qp_access) in cases {
        attempt(op, all, qp_access, WcStatus::RemInvReqErr, INVALID_REQUEST);
    }
}

#[test]
fn misaligned_atomics() {
    attempt(
        |t| SendOp::FetchAdd { remote_addr: t.addr + 4, rkey: t.keys.rkey, add: 1 },
        rw(),
        rw(),
        WcStatus::RemInvReqErr,
        INVALID_REQUEST,
    );
    attempt(
        |t| SendOp::CompareSwap { remote_addr: t.addr + 1, rkey: t.keys.rkey, compare: 0, swap: 1 },
        rw(),
        rw(),
        WcStatus::RemInvReqErr,
        INVALID_REQUEST,
    );
}

#[test]
fn no_responder_resources_means_invalid_request() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { max_dest_rd_atomic: 0, ..Opts::default() });
    let target = reg(&mut net, 1, vec![0; 64], 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 64], 0x1000, rw());
    post_send(
        &mut net,
        c.a,
        &send_wr(1, SendOp::Read { remote_addr: 0x4000, rkey: target.keys.rkey }, &[local.all()]),
    );
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::RemInvReqErr)]);
}

#[test]
fn zero_length_remote_operations_skip_key_checks() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let local = reg(&mut net, 0, vec![0; 8], 0x1000, rw());
    post_send(&mut net, c.a, &send_wr(1, SendOp::Write { remote_addr: 0xDEAD, rkey: 0x1234 }, &[]));
    post_send(
        &mut net,
        c.a,
        &send_wr(2, SendOp::Read { remote_addr: 0xBEEF, rkey: 0x5678 }, &[local.sge(0, 0)]),
    );
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(net.count(Opcode::RC_RDMA_READ_RESPONSE_ONLY), 1);
}

#[test]
fn deregistered_region_refuses_remote_access() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let target = reg(&mut net, 1, vec![3; 64], 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 64], 0x1000, rw());
    net.engines[1].dereg_mr(target.keys.lkey).unwrap();
    post_send(
        &mut net,
        c.a,
        &send_wr(1, SendOp::Write { remote_addr: 0x4000, rkey: target.keys.rkey }, &[local.all()]),
    );
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::RemAccessErr)]);
    assert_eq!(target.contents(), vec![3; 64]);
}

#[test]
fn local_key_errors_are_local_protection_errors() {
    // A bad lkey in a SEND's gather list.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let local = reg(&mut net, 0, vec![0; 64], 0x1000, rw());
    let mut bad = local.all();
    bad.lkey ^= 0x100;
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[bad]));
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[local.all()]));
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::LocProtErr), (2, WcStatus::WrFlushErr)]);
    assert!(net.trace.is_empty(), "nothing may be sent for a WR with a bad lkey");
    assert_eq!(net.engines[0].poll_event(), Some(lightpath_roce::EngineEvent::Completion(c.a.send_cq)));
    assert_eq!(net.engines[0].poll_event(), Some(lightpath_roce::EngineEvent::QpError { qpn: c.a.qpn }));

    // A READ into a region without local write access; a gather list past the region's end.
    for case in 0..2 {
        let mut net = Net::new(2);
        let c = connect(&mut net, 0, 1, &Opts::default());
        let remote = reg(&mut net, 1, vec![9; 64], 0x4000, rw());
        let read_only = reg(&mut net, 0, vec![0; 64], 0x1000, AccessFlags::NONE);
        let op = SendOp::Read { remote_addr: 0x4000, rkey: remote.keys.rkey };
        let sge = if case == 0 { read_only.all() } else { read_only.sge(32, 33) };
        let op = if case == 0 { op } else { SendOp::Send };
        post_send(&mut net, c.a, &send_wr(1, op, &[sge]));
        net.run();
        assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::LocProtErr)]);
        assert_eq!(read_only.contents(), vec![0; 64]);
    }
}

#[test]
fn local_region_deregistered_mid_message() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(256 * 200, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 256 * 200], 0x100000, rw());
    post_send(
        &mut net,
        c.a,
        &send_wr(1, SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey }, &[src.all()]),
    );
    // The ACKs are lost, so the window (128 packets) goes out and the requester waits.
    net.set_filter(|s| if s.from == 1 { Verdict::Drop } else { Verdict::Deliver });
    net.pump();
    assert_eq!(net.trace.iter().filter(|s| s.from == 0).count(), 128);
    net.clear_filter();
    net.engines[0].dereg_mr(src.keys.lkey).unwrap();
    net.run(); // the timeout's go-back-N finds the region gone
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::LocProtErr)]);
}

#[test]
fn receive_buffer_too_small() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(600, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 1024], 0x2000, rw());
    post_recv(&mut net, c.b, 7, &[dst.sge(0, 500)]);
    post_recv(&mut net, c.b, 8, &[dst.sge(500, 500)]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::RemInvReqErr)]);
    let recv: Vec<_> = poll_all(&mut net, 1, c.b.recv_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(recv, vec![(7, WcStatus::LocLenErr), (8, WcStatus::WrFlushErr)]);
    // The part that fits may have been written; nothing beyond the receive buffer was.
    assert!(dst.contents()[500..].iter().all(|&b| b == 0));
}

#[test]
fn bad_receive_lkey_is_an_operational_error() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(100, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 100], 0x2000, AccessFlags::NONE); // no local write
    post_recv(&mut net, c.b, 7, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::RemOpErr)]);
    let recv: Vec<_> = poll_all(&mut net, 1, c.b.recv_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(recv, vec![(7, WcStatus::LocProtErr)]);
    assert_eq!(dst.contents(), vec![0; 100]);
}

#[test]
fn invalidating_an_unknown_rkey() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(100, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 100], 0x2000, rw());
    post_recv(&mut net, c.b, 7, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::SendWithInv { rkey: 0x8012_3456 }, &[src.all()]));
    net.run();
    assert_eq!(outcome(&mut net, &c).requester, vec![(1, WcStatus::RemAccessErr)]);
    let recv: Vec<_> = poll_all(&mut net, 1, c.b.recv_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(recv, vec![(7, WcStatus::LocProtErr)]);
}

#[test]
fn responses_owed_before_a_fatal_error_still_go_out() {
    // A driver may hand the responder several requests before it asks for output (a batch
    // from recvmmsg). If a READ is followed by a request that fails, the READ's responses are
    // still owed and must go out ahead of the NAK, as rxe sends them: otherwise the requester
    // takes them for lost, retries into a responder in ERR and reports RETRY_EXC_ERR on the
    // READ instead of success and REM_ACCESS_ERR on the bad request.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, timeout: 8, retry_cnt: 1, ..Opts::default() });
    let remote = reg(&mut net, 1, pattern(1000, 2), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 1008], 0x8000, rw());
    let rkey = remote.keys.rkey;
    let read = SendOp::Read { remote_addr: 0x4000, rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.sge(0, 1000)]));
    let bad = SendOp::FetchAdd { remote_addr: 0x4000 + 1000, rkey, add: 1 };
    post_send(&mut net, c.a, &send_wr(2, bad, &[local.sge(1000, 8)]));
    let mut buf = vec![0; lightpath_roce::MAX_DATAGRAM];
    let mut requests = Vec::new();
    while let Some(t) = net.engines[0].poll_transmit(net.now, &mut buf) {
        requests.push((t.src_port, buf[..t.len].to_vec()));
    }
    assert_eq!(requests.len(), 2);
    for (port, datagram) in &requests {
        net.inject(0, 1, *port, datagram);
    }
    net.run();
    let done: Vec<_> = poll_all(&mut net, 0, c.a.send_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(done, vec![(1, WcStatus::Success), (2, WcStatus::RemAccessErr)]);
    assert_eq!(&local.contents()[..1000], pattern(1000, 2).as_slice());
    assert_eq!(net.engines[0].stats().timeouts, 0);
    assert_eq!(net.engines[1].qp_state(c.b.qpn).unwrap(), QpState::Err);
}
