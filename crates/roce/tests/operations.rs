//! Every RC operation end to end between two engines, at several sizes and path MTUs.

mod common;

use common::*;
use lightpath_roce::Time;
use lightpath_verbs::{Mtu, QpState, SendOp, WcOpcode, WcStatus};
use lightpath_wire::Opcode;

fn sizes(mtu: Mtu) -> Vec<usize> {
    let p = mtu.bytes() as usize;
    vec![0, 1, p - 1, p, p + 1, 3 * p + 17]
}

#[test]
fn send_all_sizes_and_mtus() {
    for mtu in Mtu::ALL {
        for len in sizes(mtu) {
            let mut net = Net::new(2);
            let opts = Opts { mtu, ..Opts::default() };
            let c = connect(&mut net, 0, 1, &opts);
            let src = reg(&mut net, 0, pattern(len, 7), 0x1000, rw());
            let dst = reg(&mut net, 1, vec![0; len + 8], 0x9000, rw());
            post_recv(&mut net, c.b, 42, &[dst.all()]);
            post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
            net.run();
            let sent = poll_all(&mut net, 0, c.a.send_cq);
            assert_eq!(sent.len(), 1, "mtu {mtu} len {len}");
            assert_eq!(
                (sent[0].wr_id, sent[0].status, sent[0].opcode),
                (1, WcStatus::Success, WcOpcode::Send)
            );
            let got = poll_all(&mut net, 1, c.b.recv_cq);
            assert_eq!(got.len(), 1);
            assert_eq!((got[0].wr_id, got[0].status, got[0].opcode), (42, WcStatus::Success, WcOpcode::Recv));
            assert_eq!(got[0].byte_len as usize, len);
            assert_eq!(got[0].src_qp, c.a.qpn);
            assert_eq!(got[0].qp_num, c.b.qpn);
            assert_eq!(&dst.contents()[..len], &pattern(len, 7)[..]);
            assert!(dst.contents()[len..].iter().all(|&b| b == 0));
            assert!(dst.mem.guards_intact());
            let packets = len.div_ceil(mtu.bytes() as usize).max(1);
            let requests = net.trace.iter().filter(|s| s.from == 0).count();
            assert_eq!(requests, packets);
            assert_eq!(net.engines[0].stats().retransmits, 0);
        }
    }
}

#[test]
fn engines_go_idle_after_traffic() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(10, 1), 0, rw());
    let dst = reg(&mut net, 1, vec![0; 10], 0, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(net.engines[0].poll_timeout(), None);
    assert_eq!(net.engines[1].poll_timeout(), None);
    assert_eq!(net.engines[0].qp_state(c.a.qpn).unwrap(), QpState::Rts);
    assert!(net.now < Time::from_nanos(1));
    assert_eq!(net.count(Opcode::RC_SEND_ONLY), 1);
    assert_eq!(net.count(Opcode::RC_ACKNOWLEDGE), 1);
}
