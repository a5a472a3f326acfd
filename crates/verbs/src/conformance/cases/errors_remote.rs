//! Cases: remote access errors. The requester sees the NAK's status, the responder's memory is
//! untouched, the requester's queue pair is in ERR, and every later request is flushed.

use crate::conformance::harness::{pattern, read_region, wait_n, wait_state, Pair, MR_ALL};
use crate::conformance::ConformanceFixture;
use crate::{AccessFlags, Error, MemoryRegion, QpState, QueuePair, RemoteRegion, SendOp, SendWr, WcStatus};

const TARGET_LEN: usize = 4096;

/// Posts the request `make_op` builds against a responder region with `target_access`, then a
/// SEND behind it, and checks the outcome. `expected` lists the acceptable statuses of the bad
/// request; `refusal_allowed` says whether a provider may instead refuse it at post time with
/// [`Error::InvalidAttribute`] (only for requests that are malformed on their face).
fn check_remote_error<F: ConformanceFixture>(
    target_access: AccessFlags,
    make_op: impl Fn(RemoteRegion) -> SendOp,
    expected: &[WcStatus],
    refusal_allowed: bool,
) {
    let pair = Pair::connected::<F>();
    let target = pair.b.alloc(TARGET_LEN, target_access);
    let local = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    let original = pattern(TARGET_LEN, 0x5A);
    target.write(0, &original).expect("fill target");
    local.write(0, &pattern(4096, 0x11)).expect("fill local");
    pair.b.post_recv(50, &inbox, 0, 4096);

    let op = make_op(target.remote());
    let len = if op.is_atomic() { 8 } else { 20 };
    let sge = [local.sge(0, len)];
    match pair.a.qp.post_send(&SendWr::new(1, op, &sge)) {
        Ok(()) => {}
        Err(Error::InvalidAttribute(_)) if refusal_allowed => return,
        Err(err) => panic!("post_send of {op:?} refused: {err}"),
    }
    let follow_sge = [local.sge(0, 8)];
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &follow_sge)).expect("post follow-up send");

    let completions = wait_n(&pair.a.cq, 2);
    assert_eq!(completions[0].wr_id, 1, "{completions:?}");
    assert!(
        expected.contains(&completions[0].status),
        "{op:?}: expected one of {expected:?}, got {:?}",
        completions[0]
    );
    assert_eq!(completions[0].qp_num, pair.a.qp.qpn());
    assert_eq!(completions[1].wr_id, 2, "{completions:?}");
    assert_eq!(
        completions[1].status,
        WcStatus::WrFlushErr,
        "request behind the failed one: {:?}",
        completions[1]
    );
    wait_state(&pair.a.qp, QpState::Err);
    assert_eq!(read_region(&target, 0, TARGET_LEN), original, "{op:?} changed responder memory");

    // A request posted in ERR is flushed (or, in some providers, refused outright).
    match pair.a.qp.post_send(&SendWr::new(3, SendOp::Send, &follow_sge)) {
        Ok(()) => {
            let flushed = wait_n(&pair.a.cq, 1)[0];
            assert_eq!((flushed.wr_id, flushed.status), (3, WcStatus::WrFlushErr), "{flushed:?}");
        }
        Err(Error::InvalidState(QpState::Err)) => {}
        Err(err) => panic!("post_send in ERR: unexpected refusal {err}"),
    }
}

/// A WRITE with an rkey that names no region ends in `RemAccessErr`.
pub fn remote_bad_rkey<F: ConformanceFixture>() {
    check_remote_error::<F>(
        MR_ALL,
        |r| SendOp::Write { remote_addr: r.addr, rkey: r.rkey ^ 0x00A5_5A00 },
        &[WcStatus::RemAccessErr],
        false,
    );
}

/// A WRITE that runs past the end of the region ends in `RemAccessErr` and writes nothing, not
/// even the part that would have fitted.
pub fn remote_out_of_bounds<F: ConformanceFixture>() {
    check_remote_error::<F>(
        MR_ALL,
        |r| SendOp::Write { remote_addr: r.addr + r.len - 10, rkey: r.rkey },
        &[WcStatus::RemAccessErr],
        false,
    );
}

/// A WRITE into a region that grants only remote read ends in `RemAccessErr`.
pub fn remote_no_permission<F: ConformanceFixture>() {
    check_remote_error::<F>(
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        |r| SendOp::Write { remote_addr: r.addr, rkey: r.rkey },
        &[WcStatus::RemAccessErr],
        false,
    );
}

/// An atomic at an address that is not 8-byte aligned ends in `RemInvReqErr` (NAK invalid
/// request; some NICs report `RemAccessErr`), or is refused at post time.
pub fn remote_misaligned_atomic<F: ConformanceFixture>() {
    check_remote_error::<F>(
        MR_ALL,
        |r| SendOp::FetchAdd { remote_addr: r.addr + 4, rkey: r.rkey, add: 1 },
        &[WcStatus::RemInvReqErr, WcStatus::RemAccessErr],
        true,
    );
}
