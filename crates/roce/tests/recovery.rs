//! Loss recovery: PSN wrap-around, go-back-N, timeouts, duplicates, RNR, retry exhaustion,
//! the READ/atomic limits and the 128-PSN window.

mod common;

use common::*;
use lightpath_verbs::{Mtu, QpState, SendOp, WcOpcode, WcStatus};
use lightpath_wire::{NakCode, Opcode, Syndrome};

const SEQ_NAK: Syndrome = Syndrome::Nak(NakCode::PsnSequenceError);

/// Drops the `nth` (1-based) datagram matching `pred`, once.
fn drop_nth(net: &mut Net, nth: usize, pred: impl Fn(&Seen) -> bool + 'static) {
    let mut seen = 0;
    net.set_filter(move |s| {
        if pred(s) {
            seen += 1;
            if seen == nth {
                return Verdict::Drop;
            }
        }
        Verdict::Deliver
    });
}

#[test]
fn psn_wrap_around_for_every_operation() {
    let mut net = Net::new(2);
    let opts = Opts { mtu: Mtu::Mtu256, psn_a: 0xFF_FFF0, psn_b: 0xFF_FFFE, ..Opts::default() };
    let c = connect(&mut net, 0, 1, &opts);
    let src = reg(&mut net, 0, pattern(8000, 1), 0x1000, rw());
    let local = reg(&mut net, 0, vec![0; 8000], 0x10000, rw());
    let dst = reg(&mut net, 1, vec![0; 8000], 0x20000, rw());
    let b_src = reg(&mut net, 1, pattern(8000, 2), 0x40000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.sge(0, 3000)]));
    let read = SendOp::Read { remote_addr: b_src.addr, rkey: b_src.keys.rkey };
    post_send(&mut net, c.a, &send_wr(2, read, &[local.sge(0, 5000)]));
    let write = SendOp::Write { remote_addr: dst.addr + 4000, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &send_wr(3, write, &[src.sge(0, 2000)]));
    let fadd = SendOp::FetchAdd { remote_addr: dst.addr + 7992, rkey: dst.keys.rkey, add: 1 };
    post_send(&mut net, c.a, &send_wr(4, fadd, &[local.sge(7992, 8)]));
    // The other direction wraps too.
    let a_dst = reg(&mut net, 0, vec![0; 3000], 0x80000, rw());
    post_recv(&mut net, c.a, 9, &[a_dst.all()]);
    post_send(&mut net, c.b, &send_wr(9, SendOp::Send, &[b_src.sge(0, 3000)]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(
        done.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::Success), (4, WcStatus::Success)]
    );
    assert_eq!(&dst.contents()[..3000], &pattern(8000, 1)[..3000]);
    assert_eq!(&local.contents()[..5000], &pattern(8000, 2)[..5000]);
    assert_eq!(&dst.contents()[4000..6000], &pattern(8000, 1)[..2000]);
    assert_eq!(a_dst.contents(), pattern(8000, 2)[..3000].to_vec());
    // PSNs really wrapped: both 0xFFFFFF and small values appear on the wire.
    assert!(net.trace.iter().any(|s| s.psn == 0xFF_FFFF));
    assert!(net.trace.iter().any(|s| s.from == 0 && s.psn < 0x20));
    assert_eq!(net.engines[0].stats().retransmits, 0);
}

#[test]
fn go_back_n_after_a_dropped_middle_packet() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(2560, 3), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 2560], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    drop_nth(&mut net, 3, |s| s.from == 0);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(dst.contents(), pattern(2560, 3));
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq).len(), 1);
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    // Exactly one sequence NAK, carrying the PSN of the lost packet.
    let naks: Vec<_> = net.trace.iter().filter(|s| s.syndrome == Some(SEQ_NAK)).collect();
    assert_eq!(naks.len(), 1);
    assert_eq!(naks[0].psn, 0x1000 + 2);
    // The resend restarts mid-message with a MIDDLE packet at the lost PSN.
    let requests: Vec<_> = net.trace.iter().filter(|s| s.from == 0).collect();
    let resent = requests[10];
    assert_eq!((resent.opcode, resent.psn), (Opcode::RC_SEND_MIDDLE, 0x1000 + 2));
    assert_eq!(net.engines[0].stats().retransmits, 8);
    assert_eq!(net.engines[1].stats().drops_out_of_sequence, 6);
}

#[test]
fn go_back_n_inside_a_write_resumes_without_reth() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu512, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(5000, 3), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 5000], 0x2000, rw());
    drop_nth(&mut net, 5, |s| s.from == 0);
    let write = SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, write, &[src.all()]));
    net.run();
    assert_eq!(dst.contents(), pattern(5000, 3));
    let requests: Vec<_> = net.trace.iter().filter(|s| s.from == 0).map(|s| (s.opcode, s.psn)).collect();
    assert_eq!(requests[10], (Opcode::RC_RDMA_WRITE_MIDDLE, 0x1000 + 4));
    assert_eq!(net.count(Opcode::RC_RDMA_WRITE_FIRST), 1);
}

#[test]
fn dropped_ack_times_out_and_the_duplicate_is_re_acked() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu1024, timeout: 14, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(3000, 4), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 3000], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[dst.all()]);
    drop_nth(&mut net, 1, |s| s.opcode == Opcode::RC_ACKNOWLEDGE);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    // Delivered once, even though the whole message arrived twice.
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq).len(), 1);
    assert_eq!(net.engines[0].stats().timeouts, 1);
    assert_eq!(net.engines[1].stats().duplicates, 3);
    // The timeout fired after 4.096 µs × 2^14.
    assert!(net.now.as_nanos() >= 67_108_864);
    // Every duplicate is answered with ePSN − 1 = the last PSN of the message.
    let acks: Vec<_> =
        net.trace.iter().filter(|s| s.opcode == Opcode::RC_ACKNOWLEDGE).map(|s| s.psn).collect();
    assert!(acks.len() >= 2);
    assert!(acks.iter().all(|&psn| psn == 0x1000 + 2));
}

#[test]
fn lost_read_response_reissues_only_the_missing_run() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let remote = reg(&mut net, 1, pattern(1200, 6), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 1200], 0x8000, rw());
    drop_nth(&mut net, 3, |s| s.opcode == Opcode::RC_RDMA_READ_RESPONSE_MIDDLE);
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    net.run();
    assert_eq!(local.contents(), pattern(1200, 6));
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    // Packets 0..=2 arrived, 3 was lost, 4 arrived and was kept: the new READ request starts
    // at PSN +3, 3 × 256 bytes in, and asks for that one packet only, which the responder
    // replays from its resources (as a one-packet sub-range: READ_RESPONSE_ONLY).
    let requests: Vec<_> =
        net.trace.iter().filter(|s| s.opcode == Opcode::RC_RDMA_READ_REQUEST).map(|s| s.psn).collect();
    assert_eq!(requests, vec![0x1000, 0x1000 + 3]);
    assert_eq!(net.engines[1].stats().duplicates, 1);
    let responses: Vec<_> = net.trace.iter().filter(|s| s.from == 1).map(|s| (s.opcode, s.psn)).collect();
    assert_eq!(responses.len(), 5 + 1);
    assert_eq!(responses[5], (Opcode::RC_RDMA_READ_RESPONSE_ONLY, 0x1000 + 3));
}

#[test]
fn lost_read_response_stream_is_replayed_after_timeout() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu512, timeout: 10, ..Opts::default() });
    let remote = reg(&mut net, 1, pattern(2000, 8), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 2000], 0x8000, rw());
    // Lose every response of the first attempt.
    let mut dropped = 0;
    net.set_filter(move |s| {
        if s.from == 1 && dropped < 4 {
            dropped += 1;
            return Verdict::Drop;
        }
        Verdict::Deliver
    });
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    net.run();
    assert_eq!(local.contents(), pattern(2000, 8));
    assert_eq!(net.engines[0].stats().timeouts, 1);
    assert_eq!(net.engines[1].stats().duplicates, 1);
    assert_eq!(net.count(Opcode::RC_RDMA_READ_REQUEST), 2);
}

#[test]
fn duplicate_atomic_is_answered_from_the_cache() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { timeout: 8, ..Opts::default() });
    let remote = reg(&mut net, 1, 40u64.to_ne_bytes().to_vec(), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 16], 0x8000, rw());
    drop_nth(&mut net, 1, |s| s.opcode == Opcode::RC_ATOMIC_ACKNOWLEDGE);
    let fadd = SendOp::FetchAdd { remote_addr: remote.addr, rkey: remote.keys.rkey, add: 2 };
    post_send(&mut net, c.a, &send_wr(1, fadd, &[local.sge(0, 8)]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!((done[0].status, done[0].opcode), (WcStatus::Success, WcOpcode::FetchAdd));
    assert_eq!(net.count(Opcode::RC_FETCH_ADD), 2);
    assert_eq!(net.count(Opcode::RC_ATOMIC_ACKNOWLEDGE), 2);
    // Added once; the replayed answer carries the original value.
    assert_eq!(remote.contents(), 42u64.to_ne_bytes().to_vec());
    assert_eq!(&local.contents()[..8], &40u64.to_ne_bytes());
}

#[test]
fn rnr_nak_then_success_after_a_late_post_recv() {
    let mut net = Net::new(2);
    let c = connect(
        &mut net,
        0,
        1,
        &Opts { min_rnr_timer: 14, rnr_retry: 7, mtu: Mtu::Mtu256, ..Opts::default() },
    );
    let src = reg(&mut net, 0, pattern(1000, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 1000], 0x2000, rw());
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run_for(5_000_000); // a few RNR rounds (1.28 ms each)
    let rnr = Syndrome::RnrNak { timer_code: 14 };
    let rounds = net.naks(rnr);
    assert!(rounds >= 2, "{rounds} RNR NAKs");
    assert!(poll_all(&mut net, 0, c.a.send_cq).is_empty());
    post_recv(&mut net, c.b, 5, &[dst.all()]);
    net.run();
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq)[0].byte_len, 1000);
    assert_eq!(dst.contents(), pattern(1000, 1));
    assert_eq!(net.engines[1].stats().rnr_naks_sent, net.naks(rnr) as u64);
}

#[test]
fn rnr_retry_exhaustion() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { min_rnr_timer: 1, rnr_retry: 2, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(100, 1), 0x1000, rw());
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[src.all()]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(
        done.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(net.naks(Syndrome::RnrNak { timer_code: 1 }), 3);
    assert_eq!(net.engines[0].qp_state(c.a.qpn).unwrap(), QpState::Err);
    assert_eq!(net.engines[0].poll_event(), Some(lightpath_roce::EngineEvent::Completion(c.a.send_cq)));
    assert_eq!(net.engines[0].poll_event(), Some(lightpath_roce::EngineEvent::QpError { qpn: c.a.qpn }));
}

#[test]
fn retry_exhaustion_with_a_dead_peer() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { timeout: 10, retry_cnt: 3, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(100, 1), 0x1000, rw());
    let local = reg(&mut net, 0, vec![0; 100], 0x9000, rw());
    net.set_filter(|s| if s.from == 0 { Verdict::Drop } else { Verdict::Deliver });
    let write = SendOp::Write { remote_addr: 0x5000, rkey: 0x8000_0101 };
    post_send(&mut net, c.a, &send_wr(1, write, &[src.all()]));
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[src.all()]).with_flags(unsignaled()));
    post_send(&mut net, c.a, &send_wr(3, SendOp::Read { remote_addr: 0, rkey: 1 }, &[local.all()]));
    net.run();
    let done = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(
        done.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect::<Vec<_>>(),
        vec![
            (1, WcStatus::RetryExcErr, WcOpcode::RdmaWrite),
            (2, WcStatus::WrFlushErr, WcOpcode::Send),
            (3, WcStatus::WrFlushErr, WcOpcode::RdmaRead)
        ]
    );
    assert_eq!(net.engines[0].qp_state(c.a.qpn).unwrap(), QpState::Err);
    // retry_cnt 3: the original transmission plus three retries of the oldest WRITE.
    let writes = net.trace.iter().filter(|s| s.opcode == Opcode::RC_RDMA_WRITE_ONLY).count();
    assert_eq!(writes, 4);
    assert_eq!(net.engines[0].stats().timeouts, 4);
    // Four ACK timeouts of 4.096 µs × 2^10.
    assert!(net.now.as_nanos() >= 4 * 4_194_304);
    // Nothing is left armed; a WR posted now is flushed at once.
    assert_eq!(net.engines[0].poll_timeout(), None);
    post_send(&mut net, c.a, &send_wr(4, SendOp::Send, &[src.all()]));
    let late = poll_all(&mut net, 0, c.a.send_cq);
    assert_eq!(late.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(), vec![(4, WcStatus::WrFlushErr)]);
}

#[test]
fn max_rd_atomic_limits_outstanding_reads() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { max_rd_atomic: 2, mtu: Mtu::Mtu256, ..Opts::default() });
    let remote = reg(&mut net, 1, pattern(4096, 5), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 8 * 512], 0x8000, rw());
    for i in 0..8u64 {
        let read = SendOp::Read { remote_addr: remote.addr + i * 512, rkey: remote.keys.rkey };
        post_send(&mut net, c.a, &send_wr(i, read, &[local.sge(i as usize * 512, 512)]));
    }
    // Also an atomic, counted against the same limit.
    let results = reg(&mut net, 0, vec![0; 8], 0xF000, rw());
    let fadd = SendOp::FetchAdd { remote_addr: remote.addr, rkey: remote.keys.rkey, add: 0 };
    post_send(&mut net, c.a, &send_wr(8, fadd, &[results.all()]));
    net.run();
    assert_eq!(local.contents(), pattern(4096, 5));
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq).len(), 9);
    let mut outstanding = 0i32;
    let mut peak = 0;
    for s in &net.trace {
        match s.opcode {
            Opcode::RC_RDMA_READ_REQUEST | Opcode::RC_FETCH_ADD => outstanding += 1,
            Opcode::RC_RDMA_READ_RESPONSE_LAST | Opcode::RC_ATOMIC_ACKNOWLEDGE => outstanding -= 1,
            _ => {}
        }
        peak = peak.max(outstanding);
    }
    assert_eq!(peak, 2);
}

#[test]
fn fence_waits_for_earlier_reads() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let remote = reg(&mut net, 1, pattern(64, 5), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 64], 0x8000, rw());
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    let write = SendOp::Write { remote_addr: remote.addr, rkey: remote.keys.rkey };
    let flags = lightpath_verbs::SendFlags::SIGNALED | lightpath_verbs::SendFlags::FENCE;
    post_send(&mut net, c.a, &send_wr(2, write, &[local.sge(0, 8)]).with_flags(flags));
    net.run();
    let order: Vec<_> = net.trace.iter().map(|s| s.opcode).collect();
    let response = order.iter().position(|&o| o == Opcode::RC_RDMA_READ_RESPONSE_ONLY).unwrap();
    let fenced = order.iter().position(|&o| o == Opcode::RC_RDMA_WRITE_ONLY).unwrap();
    assert!(response < fenced);
}

#[test]
fn requester_window_is_128_psns() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, timeout: 12, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(256 * 300, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 256 * 300], 0x100000, rw());
    // Every ACK is lost: the requester must stop after 128 packets.
    net.set_filter(|s| if s.opcode == Opcode::RC_ACKNOWLEDGE { Verdict::Drop } else { Verdict::Deliver });
    let write = SendOp::Write { remote_addr: dst.addr, rkey: dst.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, write, &[src.all()]));
    net.pump();
    assert_eq!(net.trace.iter().filter(|s| s.from == 0).count(), 128);
    net.clear_filter();
    net.run();
    assert_eq!(dst.contents(), pattern(256 * 300, 1));
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
}

#[test]
fn spurious_resend_of_a_completed_message_is_not_delivered_twice() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(700, 1), 0x1000, rw());
    let dst = reg(&mut net, 1, vec![0; 2000], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[dst.sge(0, 1000)]);
    post_recv(&mut net, c.b, 2, &[dst.sge(1000, 1000)]);
    // Record the request bytes, then replay them (as rxe sometimes does).
    let captured = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let sink = captured.clone();
    net.set_filter(move |s| {
        if s.from == 0 {
            sink.borrow_mut().push((s.bytes.clone(), s.src_port));
        }
        Verdict::Deliver
    });
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    net.clear_filter();
    let replay = captured.borrow().clone();
    assert_eq!(replay.len(), 3);
    let before = net.trace.len();
    for (bytes, src_port) in &replay {
        net.inject(0, 1, *src_port, bytes);
    }
    net.pump();
    // One receive completed, the second receive is untouched, and each duplicate was
    // re-ACKed with ePSN − 1.
    assert_eq!(poll_all(&mut net, 1, c.b.recv_cq).len(), 1);
    assert!(dst.contents()[1000..].iter().all(|&b| b == 0));
    let reacks: Vec<_> = net.trace[before..].iter().map(|s| (s.opcode, s.psn)).collect();
    assert_eq!(reacks, vec![(Opcode::RC_ACKNOWLEDGE, 0x1000 + 2)]);
    assert_eq!(net.engines[1].stats().duplicates, 3);
}

#[test]
fn fatal_nak_behind_a_lost_atomic_response_never_flushes_before_the_error() {
    // The FETCH_ADD executes but its answer is lost; the next request is NAKed (out of
    // bounds). The NAK implies the FETCH_ADD ran, so its missing answer is a lost response:
    // retry it (the peer is in ERR now, so it ends in RETRY_EXC_ERR), then flush.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { timeout: 8, retry_cnt: 2, ..Opts::default() });
    let remote = reg(&mut net, 1, vec![0; 64], 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 16], 0x8000, rw());
    drop_nth(&mut net, 1, |s| s.opcode == Opcode::RC_ATOMIC_ACKNOWLEDGE);
    let rkey = remote.keys.rkey;
    let fadd = SendOp::FetchAdd { remote_addr: 0x4000, rkey, add: 1 };
    post_send(&mut net, c.a, &send_wr(1, fadd, &[local.sge(0, 8)]));
    let bad = SendOp::CompareSwap { remote_addr: 0x4000 + 64, rkey, compare: 0, swap: 1 };
    post_send(&mut net, c.a, &send_wr(2, bad, &[local.sge(8, 8)]));
    net.run();
    let done: Vec<_> = poll_all(&mut net, 0, c.a.send_cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(done, vec![(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]);
    assert_eq!(net.naks(Syndrome::Nak(NakCode::RemoteAccessError)), 1);
}

#[test]
fn reordered_read_responses_reissue_at_most_once_per_round_trip_and_never_time_out() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let len = 256 * 400;
    let remote = reg(&mut net, 1, pattern(len, 3), 0x10_0000, rw());
    let local = reg(&mut net, 0, vec![0; len], 0x80_0000, rw());
    // Every 5th response packet is overtaken by the next 7: nothing is lost.
    let mut count = 0;
    net.set_filter(move |s| {
        if s.from == 1 {
            count += 1;
            if count % 5 == 0 {
                return Verdict::Hold(7);
            }
        }
        Verdict::Deliver
    });
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    net.run();
    assert_eq!(poll_all(&mut net, 0, c.a.send_cq)[0].status, WcStatus::Success);
    assert_eq!(local.contents(), pattern(len, 3));
    let stats = net.engines[0].stats();
    assert_eq!(stats.timeouts, 0);
    // Go-back-N discards what arrives after a gap, so reordering costs replays — but a new
    // reissue only ever follows the first packet of the reply to the previous one.
    let mut awaiting: Option<u32> = None;
    for s in &net.trace {
        match s.opcode {
            Opcode::RC_RDMA_READ_REQUEST => {
                assert_eq!(awaiting, None, "reissue at {:#x} before the previous one was answered", s.psn);
                awaiting = (s.psn != 0x1000).then_some(s.psn);
            }
            Opcode::RC_RDMA_READ_RESPONSE_FIRST if Some(s.psn) == awaiting => awaiting = None,
            _ => {}
        }
    }
    assert!(net.count(Opcode::RC_RDMA_READ_REQUEST) > 1);
}

#[test]
fn many_queue_pairs_under_periodic_loss() {
    let mut net = Net::new(2);
    let opts = Opts { mtu: Mtu::Mtu512, timeout: 8, ..Opts::default() };
    let conns: Vec<Conn> = (0..8).map(|_| connect(&mut net, 0, 1, &opts)).collect();
    // Every 11th datagram in either direction is lost.
    let mut n = 0;
    net.set_filter(move |_| {
        n += 1;
        if n % 11 == 0 {
            Verdict::Drop
        } else {
            Verdict::Deliver
        }
    });
    let mut checks = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        let seed = i as u8;
        let src = reg(&mut net, 0, pattern(6000, seed), 0x10_0000 * (i as u64 + 1), rw());
        let local = reg(&mut net, 0, vec![0; 6008], 0x100_0000 * (i as u64 + 1), rw());
        let mut init = pattern(12_000, seed.wrapping_add(100));
        init[11_992..].copy_from_slice(&1000u64.to_ne_bytes());
        let remote = reg(&mut net, 1, init, 0x10_0000 * (i as u64 + 1), rw());
        let inbox = reg(&mut net, 1, vec![0; 6000], 0x100_0000 * (i as u64 + 1), rw());
        post_recv(&mut net, c.b, 1, &[inbox.all()]);
        let rkey = remote.keys.rkey;
        post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
        let write = SendOp::Write { remote_addr: remote.addr, rkey };
        post_send(&mut net, c.a, &send_wr(2, write, &[src.sge(0, 5000)]).with_flags(unsignaled()));
        let read = SendOp::Read { remote_addr: remote.addr + 6000, rkey };
        post_send(&mut net, c.a, &send_wr(3, read, &[local.sge(0, 5000)]));
        let fadd = SendOp::FetchAdd { remote_addr: remote.addr + 11_992, rkey, add: 5 };
        post_send(&mut net, c.a, &send_wr(4, fadd, &[local.sge(6000, 8)]));
        checks.push((src, local, remote, inbox, seed));
    }
    net.run();
    for (i, c) in conns.iter().enumerate() {
        let done: Vec<_> = poll_all(&mut net, 0, c.a.send_cq).iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            done,
            vec![(1, WcStatus::Success), (3, WcStatus::Success), (4, WcStatus::Success)],
            "qp {i}"
        );
        let (src, local, remote, inbox, seed) = &checks[i];
        assert_eq!(inbox.contents(), pattern(6000, *seed));
        let remote_bytes = remote.contents();
        assert_eq!(&remote_bytes[..5000], &src.contents()[..5000]);
        assert_eq!(&local.contents()[..5000], &pattern(12_000, seed.wrapping_add(100))[6000..11_000]);
        // Added exactly once, however often the request was retried.
        assert_eq!(u64::from_ne_bytes(remote_bytes[11_992..].try_into().unwrap()), 1005);
        assert_eq!(u64::from_ne_bytes(local.contents()[6000..6008].try_into().unwrap()), 1000);
        assert_eq!(poll_all(&mut net, 1, c.b.recv_cq).len(), 1);
    }
    assert!(net.engines[0].stats().retransmits > 0);
}
