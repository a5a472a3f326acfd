//! Cases: errors detected locally or by the responder's receive queue (bad lkey, receive buffer
//! too small, receiver not ready).

use crate::conformance::harness::{pattern, read_region, wait_n, wait_state, Pair, PairOptions};
use crate::conformance::ConformanceFixture;
use crate::{AccessFlags, MemoryRegion, QpState, QueuePair, SendOp, SendWr, Sge, WcStatus};

/// A SEND whose scatter/gather entry has an lkey that names no region, or that runs past the
/// end of a real region, completes with `LocProtErr` and sends nothing. For the unknown lkey,
/// Linux rxe (kernel 6.1) reports `LocQpOpErr` instead, which is accepted too.
pub fn local_protection_error<F: ConformanceFixture>() {
    for bad_entry in [BadEntry::UnknownKey, BadEntry::PastTheEnd] {
        let pair = Pair::connected::<F>();
        let local = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
        let inbox = pair.b.alloc(8192, AccessFlags::LOCAL_WRITE);
        pair.b.post_recv(1, &inbox, 0, 8192);
        let sge = match bad_entry {
            BadEntry::UnknownKey => Sge { lkey: local.lkey() ^ 0x00FF_FF00, ..local.sge(0, 64) },
            BadEntry::PastTheEnd => local.sge(4000, 200),
        };
        pair.a.qp.post_send(&SendWr::new(7, SendOp::Send, &[sge])).expect("post_send");
        let wc = wait_n(&pair.a.cq, 1)[0];
        assert_eq!(wc.wr_id, 7, "{bad_entry:?}: {wc:?}");
        let allowed: &[WcStatus] = match bad_entry {
            BadEntry::UnknownKey => &[WcStatus::LocProtErr, WcStatus::LocQpOpErr],
            BadEntry::PastTheEnd => &[WcStatus::LocProtErr],
        };
        assert!(allowed.contains(&wc.status), "{bad_entry:?}: {wc:?}");
        wait_state(&pair.a.qp, QpState::Err);
        assert_eq!(read_region(&inbox, 0, 8192), vec![0u8; 8192], "{bad_entry:?}: data reached the peer");
    }
}

/// A READ whose local destination region lacks LOCAL_WRITE completes with `LocProtErr` and
/// leaves that region unchanged.
pub fn local_write_required<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let source = pair.b.alloc(256, crate::conformance::harness::MR_ALL);
    source.write(0, &pattern(256, 2)).expect("fill");
    let read_only = pair.a.alloc(256, AccessFlags::REMOTE_READ);
    let remote = source.remote();
    let op = SendOp::Read { remote_addr: remote.addr, rkey: remote.rkey };
    pair.a.qp.post_send(&SendWr::new(8, op, &[read_only.sge(0, 256)])).expect("post read");
    let wc = wait_n(&pair.a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (8, WcStatus::LocProtErr), "{wc:?}");
    wait_state(&pair.a.qp, QpState::Err);
    assert_eq!(read_region(&read_only, 0, 256), vec![0u8; 256], "a region without LOCAL_WRITE was written");
}

#[derive(Clone, Copy, Debug)]
enum BadEntry {
    UnknownKey,
    PastTheEnd,
}

/// A SEND larger than the receive posted for it: the requester gets `RemInvReqErr` (NAK
/// invalid request) and the receiver `LocLenErr` (IBA) or `RemInvReqErr`; Linux rxe 6.1
/// treats it as a remote operational error instead: `RemOpErr` at the requester and
/// `LocQpOpErr` at the receiver (seen on rxe0 in the interop suite).
pub fn recv_buffer_too_small<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(100, 4)).expect("fill");
    pair.b.post_recv(1, &inbox, 0, 16);
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 100)])).expect("post_send");

    let sent = wait_n(&pair.a.cq, 1)[0];
    assert_eq!(sent.wr_id, 2, "{sent:?}");
    assert!(matches!(sent.status, WcStatus::RemInvReqErr | WcStatus::RemOpErr), "requester status {sent:?}");
    let received = wait_n(&pair.b.cq, 1)[0];
    assert_eq!(received.wr_id, 1, "{received:?}");
    assert!(
        matches!(received.status, WcStatus::LocLenErr | WcStatus::RemInvReqErr | WcStatus::LocQpOpErr),
        "receiver status {received:?}"
    );
    wait_state(&pair.a.qp, QpState::Err);
    assert_eq!(read_region(&inbox, 16, 4080), vec![0u8; 4080], "bytes past the receive buffer were written");
}

/// With `rnr_retry` 0 and no receive posted, a SEND ends in `RnrRetryExcErr`; the receiver's
/// queue pair is not harmed (RNR is flow control, not an error there).
pub fn rnr_retry_exceeded<F: ConformanceFixture>() {
    let options = PairOptions { rnr_retry: 0, ..PairOptions::default() };
    let pair = Pair::connected_with::<F>(&options);
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    pair.a.qp.post_send(&SendWr::new(3, SendOp::Send, &[src.sge(0, 32)])).expect("post_send");
    let wc = wait_n(&pair.a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::RnrRetryExcErr), "{wc:?}");
    wait_state(&pair.a.qp, QpState::Err);
    assert_eq!(pair.b.qp.state().expect("state"), QpState::Rts);
}
