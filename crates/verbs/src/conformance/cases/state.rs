//! Cases: the queue-pair state machine (what each state refuses, which transitions exist, and
//! the flush on entering ERR).

use crate::conformance::harness::{assert_refused, wait_n, Pair, PairOptions, FULL_REMOTE_ACCESS};
use crate::conformance::ConformanceFixture;
use crate::{
    AccessFlags, AddressVector, Error, MemoryRegion, QpAttr, QpState, QueuePair, RecvWr, SendOp, SendWr,
    WcStatus,
};

/// `post_send` is refused with `InvalidState` in RESET, INIT and RTR; `post_recv` is refused in
/// RESET and accepted from INIT on.
pub fn post_before_rts_refused<F: ConformanceFixture>() {
    let pair = Pair::unconnected_with::<F>(&PairOptions::default());
    let qp = &pair.a.qp;
    let mr = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let sge = [mr.sge(0, 16)];
    let send = SendWr::new(1, SendOp::Send, &sge);
    let recv = RecvWr::new(2, &sge);

    let refused_in = |state: QpState| move |e: &Error| matches!(e, Error::InvalidState(s) if *s == state);
    assert_refused(qp.post_send(&send), "post_send in RESET", refused_in(QpState::Reset));
    assert_refused(qp.post_recv(&recv), "post_recv in RESET", refused_in(QpState::Reset));

    qp.modify(&QpAttr::to_init(FULL_REMOTE_ACCESS)).expect("to INIT");
    assert_refused(qp.post_send(&send), "post_send in INIT", refused_in(QpState::Init));
    qp.post_recv(&recv).expect("post_recv in INIT");

    let peer = pair.b.qp.endpoint();
    let av = AddressVector::new(peer.gid, qp.endpoint().gid_index);
    qp.modify(&QpAttr::to_rtr(av, pair.mtu, peer.qpn, 0)).expect("to RTR");
    assert_refused(qp.post_send(&send), "post_send in RTR", refused_in(QpState::Rtr));
    qp.post_recv(&recv).expect("post_recv in RTR");
    qp.modify(&QpAttr::to_rts(0)).expect("to RTS");
    assert_eq!(qp.state().expect("state"), QpState::Rts);
}

/// Skipped states, missing attributes and out-of-range values are refused and leave the state
/// unchanged; ERR and RESET are reachable from anywhere, and a reset queue pair can start over.
pub fn modify_refusals<F: ConformanceFixture>() {
    let pair = Pair::unconnected_with::<F>(&PairOptions::default());
    let qp = &pair.a.qp;
    let peer = pair.b.qp.endpoint();
    let av = AddressVector::new(peer.gid, qp.endpoint().gid_index);
    let rtr = QpAttr::to_rtr(av, pair.mtu, peer.qpn, 0x10);

    assert_refused(qp.modify(&rtr), "RESET→RTR", |e| matches!(e, Error::InvalidTransition { .. }));
    assert_eq!(qp.state().expect("state"), QpState::Reset);
    let mut init = QpAttr::to_init(FULL_REMOTE_ACCESS);
    init.access = None;
    assert_refused(qp.modify(&init), "RESET→INIT without access", |e| {
        matches!(e, Error::MissingAttribute { attribute: "access", .. })
    });
    assert_eq!(qp.state().expect("state"), QpState::Reset);

    qp.modify(&QpAttr::to_init(FULL_REMOTE_ACCESS)).expect("to INIT");
    assert_refused(qp.modify(&QpAttr::to_rts(0)), "INIT→RTS", |e| {
        matches!(e, Error::InvalidTransition { .. })
    });
    let mut missing = rtr;
    missing.dest_qp_num = None;
    assert_refused(qp.modify(&missing), "INIT→RTR without dest_qp_num", |e| {
        matches!(e, Error::MissingAttribute { attribute: "dest_qp_num", .. })
    });
    let mut out_of_range = rtr;
    out_of_range.rq_psn = Some(1 << 24);
    assert_refused(qp.modify(&out_of_range), "rq_psn of 25 bits", |e| {
        matches!(e, Error::InvalidAttribute(_))
    });
    assert_eq!(qp.state().expect("state"), QpState::Init);

    qp.modify(&rtr).expect("to RTR");
    let mut rts = QpAttr::to_rts(0x20);
    rts.retry_cnt = None;
    assert_refused(qp.modify(&rts), "RTR→RTS without retry_cnt", |e| {
        matches!(e, Error::MissingAttribute { attribute: "retry_cnt", .. })
    });
    assert_eq!(qp.state().expect("state"), QpState::Rtr);

    qp.modify(&QpAttr::state(QpState::Err)).expect("to ERR");
    assert_eq!(qp.state().expect("state"), QpState::Err);
    assert_refused(qp.modify(&QpAttr::state(QpState::Rts)), "ERR→RTS", |e| {
        matches!(e, Error::InvalidTransition { .. })
    });
    qp.modify(&QpAttr::state(QpState::Reset)).expect("to RESET");
    assert_eq!(qp.state().expect("state"), QpState::Reset);
    qp.modify(&QpAttr::to_init(AccessFlags::NONE)).expect("INIT again after RESET");
    assert_eq!(qp.state().expect("state"), QpState::Init);
}

/// Moving to ERR completes every posted receive with `WrFlushErr`, in order.
pub fn modify_err_flushes_receives<F: ConformanceFixture>() {
    let pair = Pair::unconnected_with::<F>(&PairOptions::default());
    let qp = &pair.a.qp;
    let mr = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    qp.modify(&QpAttr::to_init(FULL_REMOTE_ACCESS)).expect("to INIT");
    for wr_id in [11, 12, 13] {
        pair.a.post_recv(wr_id, &mr, 0, 1024);
    }
    qp.modify(&QpAttr::state(QpState::Err)).expect("to ERR");
    let flushed = wait_n(&pair.a.cq, 3);
    for (wc, wr_id) in flushed.iter().zip([11, 12, 13]) {
        assert_eq!((wc.wr_id, wc.status, wc.qp_num), (wr_id, WcStatus::WrFlushErr, qp.qpn()), "{wc:?}");
    }
    // A receive posted in ERR is flushed too (or refused).
    match qp.post_recv(&RecvWr::new(14, &[mr.sge(0, 16)])) {
        Ok(()) => assert_eq!(wait_n(&pair.a.cq, 1)[0].status, WcStatus::WrFlushErr),
        Err(Error::InvalidState(QpState::Err)) => {}
        Err(err) => panic!("post_recv in ERR: {err}"),
    }
}
