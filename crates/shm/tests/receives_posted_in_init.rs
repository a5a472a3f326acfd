//! Receives posted while a queue pair is still in INIT (verbs allows posting receives from INIT
//! on, and programs often do so before connecting) are still there once it reaches RTR: the
//! first SEND lands in them instead of finding an empty receive queue.

mod common;

use common::{open_device, to_init, to_rtr, End};
use lightpath_verbs::conformance::harness::{assert_success, read_region, wait_n};
use lightpath_verbs::{MemoryRegion, QpAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode};

#[test]
fn receives_posted_in_init_take_the_first_sends() {
    let device = open_device();
    let a = End::new(&device, 1);
    let b = End::new(&device, 2);
    to_init(&a.qp);
    to_init(&b.qp);
    for (wr_id, offset) in [(10, 0), (11, 64)] {
        let sge = [b.dst.sge(offset, 64)];
        b.qp.post_recv(&RecvWr::new(wr_id, &sge)).expect("post_recv in INIT");
    }
    to_rtr(&a.qp, &b.qp);
    to_rtr(&b.qp, &a.qp);
    // No RNR retries: a SEND that finds no receive fails at once instead of waiting forever.
    let rts = QpAttr { rnr_retry: Some(0), ..QpAttr::to_rts(0) };
    a.qp.modify(&rts).expect("modify to RTS");

    for (wr_id, offset) in [(1, 0usize), (2, 64)] {
        let sge = [a.src.sge(offset, 64)];
        a.qp.post_send(&SendWr::new(wr_id, SendOp::Send, &sge)).expect("post SEND");
    }
    let mut sent = wait_n(&a.cq, 2);
    sent.sort_by_key(|wc| wc.wr_id);
    assert_success(&sent[0], 1, WcOpcode::Send);
    assert_success(&sent[1], 2, WcOpcode::Send);
    let received = wait_n(&b.cq, 2);
    assert_success(&received[0], 10, WcOpcode::Recv);
    assert_success(&received[1], 11, WcOpcode::Recv);
    assert_eq!(read_region(&b.dst, 0, 128), read_region(&a.src, 0, 128));
}
