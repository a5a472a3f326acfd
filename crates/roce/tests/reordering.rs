//! Reordering and lost answers: responses that arrive out of order are kept, a missing
//! READ/atomic response is asked for again at once (and only the missing part), a fatal NAK
//! that overtakes an earlier answer still reports the right errors, and go-back-N recovers
//! without flooding the path or waiting for the retransmit timer. Each case is the smallest
//! form of a failure the simulator found (the seeds are named in `crates/sim/tests`).

mod common;

use common::*;
use lightpath_roce::MAX_DATAGRAM;
use lightpath_verbs::{Mtu, SendOp, WcStatus};
use lightpath_wire::icrc::{self, Endpoints};
use lightpath_wire::{NakCode, Opcode, Psn, Syndrome, TransportRepr};

const SEQ_NAK: Syndrome = Syndrome::Nak(NakCode::PsnSequenceError);

fn statuses(net: &mut Net, end: End) -> Vec<(u64, WcStatus)> {
    poll_all(net, end.engine, end.send_cq).iter().map(|w| (w.wr_id, w.status)).collect()
}

fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Holds the `nth` (1-based) datagram matching `pred` until `later` more datagrams have been
/// delivered.
fn hold_nth(net: &mut Net, nth: usize, later: usize, pred: impl Fn(&Seen) -> bool + 'static) {
    let mut seen = 0;
    net.set_filter(move |s| {
        if pred(s) {
            seen += 1;
            if seen == nth {
                return Verdict::Hold(later);
            }
        }
        Verdict::Deliver
    });
}

#[test]
fn an_atomic_answer_overtaken_by_the_next_one_is_kept() {
    // Simulator: `--reorder 0.2 --negative 1 --ops fetch_add,cmp_swap,read,write,send
    // --max-ops 4 --max-message 4096`, seed 152 — the second answer used to be dropped as
    // unexpected, and its atomic was then retried into a responder already in ERR.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { retry_cnt: 1, ..Opts::default() });
    let remote = reg(&mut net, 1, 100u64.to_ne_bytes().to_vec(), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 16], 0x8000, rw());
    hold_nth(&mut net, 1, 1, |s| s.opcode == Opcode::RC_ATOMIC_ACKNOWLEDGE);
    let rkey = remote.keys.rkey;
    for (wr_id, add) in [(1u64, 5u64), (2, 7)] {
        let fadd = SendOp::FetchAdd { remote_addr: 0x4000, rkey, add };
        post_send(&mut net, c.a, &send_wr(wr_id, fadd, &[local.sge(8 * (wr_id as usize - 1), 8)]));
    }
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    let found = local.contents();
    assert_eq!((word(&found, 0), word(&found, 8)), (100, 105));
    assert_eq!(word(&remote.contents(), 0), 112, "each add executed exactly once");
    assert_eq!(net.engines[0].stats().timeouts, 0);
}

#[test]
fn a_fatal_nak_that_overtakes_an_atomic_answer_still_reports_its_own_error() {
    // K1 under reordering (simulator: same options as above, seed 37): the NAK of the bad
    // request arrives before the answer to the FETCH_ADD in front of it. The FETCH_ADD must
    // succeed and the bad request fail with REM_ACCESS_ERR — not RETRY_EXC_ERR after retrying
    // into a responder in ERR.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { timeout: 8, retry_cnt: 2, ..Opts::default() });
    let remote = reg(&mut net, 1, vec![0; 64], 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 16], 0x8000, rw());
    hold_nth(&mut net, 1, 1, |s| s.opcode == Opcode::RC_ATOMIC_ACKNOWLEDGE);
    let rkey = remote.keys.rkey;
    let fadd = SendOp::FetchAdd { remote_addr: 0x4000, rkey, add: 1 };
    post_send(&mut net, c.a, &send_wr(1, fadd, &[local.sge(0, 8)]));
    let bad = SendOp::CompareSwap { remote_addr: 0x4000 + 64, rkey, compare: 0, swap: 1 };
    post_send(&mut net, c.a, &send_wr(2, bad, &[local.sge(8, 8)]));
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success), (2, WcStatus::RemAccessErr)]);
    assert_eq!(net.engines[0].stats().timeouts, 0);
    assert_eq!(word(&remote.contents(), 0), 1);
}

#[test]
fn an_ack_past_a_lost_atomic_answer_asks_for_it_again_at_once() {
    // rxe's rule (digest §6.3): an ACK past an unanswered READ/atomic means its response was
    // lost. The atomic is asked for again right away — not after the 67 ms retransmit timer —
    // and the responder answers the duplicate from its resources without adding twice.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let remote = reg(&mut net, 1, 40u64.to_ne_bytes().to_vec(), 0x4000, rw());
    let local = reg(&mut net, 0, vec![0; 8], 0x8000, rw());
    let src = reg(&mut net, 0, pattern(100, 1), 0x9000, rw());
    let inbox = reg(&mut net, 1, vec![0; 100], 0x5000, rw());
    post_recv(&mut net, c.b, 9, &[inbox.all()]);
    let mut dropped = false;
    net.set_filter(move |s| {
        if s.opcode == Opcode::RC_ATOMIC_ACKNOWLEDGE && !dropped {
            dropped = true;
            return Verdict::Drop;
        }
        Verdict::Deliver
    });
    let fadd = SendOp::FetchAdd { remote_addr: 0x4000, rkey: remote.keys.rkey, add: 2 };
    post_send(&mut net, c.a, &send_wr(1, fadd, &[local.all()]));
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(word(&local.contents(), 0), 40);
    assert_eq!(word(&remote.contents(), 0), 42);
    assert_eq!(inbox.contents(), pattern(100, 1));
    assert_eq!(net.engines[0].stats().timeouts, 0);
    assert_eq!(net.count(Opcode::RC_FETCH_ADD), 2);
    assert_eq!(net.engines[1].stats().duplicates, 1);
}

#[test]
fn a_read_response_overtaken_by_later_ones_is_kept_and_only_the_gap_is_asked_again() {
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let len = 256 * 10;
    let remote = reg(&mut net, 1, pattern(len, 4), 0x10_0000, rw());
    let local = reg(&mut net, 0, vec![0; len], 0x80_0000, rw());
    // The 4th response packet is overtaken by the next two.
    hold_nth(&mut net, 4, 2, |s| s.from == 1);
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success)]);
    assert_eq!(local.contents(), pattern(len, 4));
    assert_eq!(net.engines[0].stats().timeouts, 0);
    // The gap looked like a loss, so the READ was asked again — for the one missing packet,
    // not for the rest: the packets after the gap had been kept.
    let responses = net.trace.iter().filter(|s| s.from == 1).count();
    assert!(responses <= 10 + 1, "{responses} response packets for a 10-packet READ");
}

#[test]
fn a_sequence_nak_behind_a_read_resends_from_the_nak_not_the_read() {
    // Simulator: `--reorder 0.5 --negative 0`, seed 668. A sequence NAK for a request after
    // a READ whose responses are still arriving used to rewind to the READ, so the responder
    // replayed the whole READ for every such NAK: the replays filled the link for tens of
    // milliseconds and the other direction ran out of retries.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let len = 256 * 40;
    let remote = reg(&mut net, 1, pattern(len, 5), 0x10_0000, rw());
    let local = reg(&mut net, 0, vec![0; len], 0x80_0000, rw());
    let src = reg(&mut net, 0, pattern(768, 6), 0x90_0000, rw());
    let inbox = reg(&mut net, 1, vec![0; 768], 0x20_0000, rw());
    post_recv(&mut net, c.b, 9, &[inbox.all()]);
    // Lose one READ response packet and the SEND's first packet.
    let mut read_responses = 0;
    let mut send_firsts = 0;
    net.set_filter(move |s| {
        if s.from == 1 && s.opcode == Opcode::RC_RDMA_READ_RESPONSE_MIDDLE {
            read_responses += 1;
            if read_responses == 20 {
                return Verdict::Drop;
            }
        }
        if s.opcode == Opcode::RC_SEND_FIRST {
            send_firsts += 1;
            if send_firsts == 1 {
                return Verdict::Drop;
            }
        }
        Verdict::Deliver
    });
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    post_send(&mut net, c.a, &send_wr(2, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(local.contents(), pattern(len, 5));
    assert_eq!(inbox.contents(), pattern(768, 6));
    assert!(net.naks(SEQ_NAK) >= 1);
    // 40 packets, plus one for the lost one: never a replay of the READ.
    let responses =
        net.trace.iter().filter(|s| s.from == 1 && s.opcode.0 >= 0x0D && s.opcode.0 <= 0x10).count();
    assert_eq!(responses, 41);
    assert_eq!(net.engines[0].stats().timeouts, 0);
}

#[test]
fn a_retransmission_overtaken_again_is_resent_without_waiting_for_the_timer() {
    // Simulator: `--retry-cnt 1 --reorder 0.2`, seeds 16, 238 and 650. After a sequence NAK
    // the requester resends from the gap; if that resent packet is overtaken again, the
    // responder (which NAKs once per gap) drops the rest silently and then waits. With one
    // retry, the old requester waited for its retransmit timer, which then ended the
    // connection. The recovery probe resends after a few round trips, spending no retry.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, retry_cnt: 1, ..Opts::default() });
    let src = reg(&mut net, 0, pattern(8 * 256, 7), 0x1000, rw());
    let inbox = reg(&mut net, 1, vec![0; 8 * 256], 0x2000, rw());
    post_recv(&mut net, c.b, 1, &[inbox.all()]);
    let mut third = 0;
    net.set_filter(move |s| {
        if s.from == 0 && s.psn == 0x1000 + 2 {
            third += 1;
            match third {
                1 => return Verdict::Drop,
                // The resent packet arrives after everything behind it.
                2 => return Verdict::Hold(5),
                _ => {}
            }
        }
        Verdict::Deliver
    });
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success)]);
    assert_eq!(inbox.contents(), pattern(8 * 256, 7));
    assert_eq!(net.engines[0].stats().timeouts, 0);
}

#[test]
fn after_a_go_back_the_requester_resends_a_short_burst_and_asks_for_its_ack() {
    // Go-back-N halves the send window, so a loss does not put another full window of
    // packets on the path (the responder drops everything behind a gap); the packet that
    // fills the window asks for an ACK, which is what opens it again.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let len = 256 * 200;
    let src = reg(&mut net, 0, pattern(len, 8), 0x10_0000, rw());
    let inbox = reg(&mut net, 1, vec![0; len], 0x20_0000, rw());
    post_recv(&mut net, c.b, 1, &[inbox.all()]);
    drop_nth_of(&mut net, 11, |s| s.from == 0);
    post_send(&mut net, c.a, &send_wr(1, SendOp::Send, &[src.all()]));
    net.run();
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success)]);
    assert_eq!(inbox.contents(), pattern(len, 8));
    let nak = net.trace.iter().position(|s| s.syndrome == Some(SEQ_NAK)).expect("a sequence NAK");
    let burst: Vec<&Seen> = net.trace[nak + 1..].iter().take_while(|s| s.from == 0).collect();
    assert_eq!(burst[0].psn, 0x1000 + 10, "go-back-N starts at the lost packet");
    assert!(burst.len() <= 64, "{} packets resent before the first ACK", burst.len());
    assert!(burst.last().is_some_and(|s| s.ack_req));
}

#[test]
fn a_duplicate_read_for_a_run_the_stream_has_passed_does_not_cut_the_stream_short() {
    // A reissued READ may ask for just one missing run. If the responder still has the
    // original stream queued, it must not replace that stream by the short replay (which
    // would lose the rest of it); a run the stream has yet to send needs no replay at all.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts { mtu: Mtu::Mtu256, ..Opts::default() });
    let len = 256 * 8;
    let remote = reg(&mut net, 1, pattern(len, 9), 0x10_0000, rw());
    let local = reg(&mut net, 0, vec![0; len], 0x80_0000, rw());
    let read = SendOp::Read { remote_addr: remote.addr, rkey: remote.keys.rkey };
    post_send(&mut net, c.a, &send_wr(1, read, &[local.all()]));
    let mut buf = vec![0; MAX_DATAGRAM];
    let t = net.engines[0].poll_transmit(net.now, &mut buf).expect("the READ request");
    let request = buf[..t.len].to_vec();
    let port = t.src_port;
    net.inject(0, 1, port, &request);
    // Three response packets leave; five are still queued.
    let mut sent = Vec::new();
    for _ in 0..3 {
        let t = net.engines[1].poll_transmit(net.now, &mut buf).unwrap();
        sent.push(buf[..t.len].to_vec());
    }
    // Duplicates for one packet the stream has passed (PSN +1) and one it has not (+5).
    for k in [1u32, 5] {
        net.inject(0, 1, port, &duplicate_read(&request, &net, port, k, 256));
    }
    while let Some(t) = net.engines[1].poll_transmit(net.now, &mut buf) {
        sent.push(buf[..t.len].to_vec());
    }
    let psns: Vec<u32> =
        sent.iter().map(|d| TransportRepr::parse(d).unwrap().header.bth.psn.value() - 0x1000).collect();
    assert_eq!(psns, vec![0, 1, 2, 3, 4, 5, 6, 7, 1]);
    assert_eq!(net.engines[1].stats().duplicates, 2);
    // The requester takes what it needs and ignores the extra copy.
    for datagram in &sent {
        net.inject(1, 0, port, datagram);
    }
    assert_eq!(statuses(&mut net, c.a), vec![(1, WcStatus::Success)]);
    assert_eq!(local.contents(), pattern(len, 9));
}

/// The READ request `original` (sent from UDP port `port`) reissued for `len` bytes starting
/// `k` packets in.
fn duplicate_read(original: &[u8], net: &Net, port: u16, k: u32, len: u32) -> Vec<u8> {
    let repr = TransportRepr::parse(original).unwrap();
    let mut header = repr.header;
    header.bth.psn = Psn::new(header.bth.psn.value() + k);
    let reth = header.reth.as_mut().unwrap();
    reth.va += u64::from(k) * 256;
    reth.dma_len = len;
    let repr = TransportRepr { header, payload: &[] };
    let mut buf = vec![0; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    let endpoints = Endpoints { src: net.addr(0), dst: net.addr(1), src_port: port, dst_port: 4791 };
    icrc::seal(&endpoints, &mut buf).unwrap();
    buf
}

/// Drops the `nth` (1-based) datagram matching `pred`, once.
fn drop_nth_of(net: &mut Net, nth: usize, pred: impl Fn(&Seen) -> bool + 'static) {
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
fn a_sequence_nak_overtaken_by_an_ack_still_gets_the_dropped_packets_resent() {
    // Simulator: `--reorder 0.2 --negative 0`, seeds 56, 81 and 211 (no failure, but each
    // needed the retransmit timer). The first SEND is overtaken by the next three: the
    // responder NAKs it and drops those three; then the first arrives and is ACKed — and that
    // ACK overtakes the NAK. The NAK is stale (its PSN is acknowledged) but still says that
    // packets behind it were dropped; the requester resends them after a few round trips
    // instead of waiting 67 ms for its retransmit timer.
    let mut net = Net::new(2);
    let c = connect(&mut net, 0, 1, &Opts::default());
    let src = reg(&mut net, 0, pattern(64, 3), 0x1000, rw());
    let inbox = reg(&mut net, 1, vec![0; 4 * 16], 0x2000, rw());
    for i in 0..4 {
        post_recv(&mut net, c.b, i, &[inbox.sge(16 * i as usize, 16)]);
    }
    let (mut held_send, mut held_nak) = (false, false);
    net.set_filter(move |s| {
        if s.from == 0 && s.opcode == Opcode::RC_SEND_ONLY && !held_send {
            held_send = true;
            return Verdict::Hold(3);
        }
        if s.syndrome == Some(SEQ_NAK) && !held_nak {
            held_nak = true;
            return Verdict::Hold(1);
        }
        Verdict::Deliver
    });
    for i in 0..4u64 {
        post_send(&mut net, c.a, &send_wr(i, SendOp::Send, &[src.sge(16 * i as usize, 16)]));
    }
    net.run();
    let expected: Vec<_> = (0..4).map(|i| (i, WcStatus::Success)).collect();
    assert_eq!(statuses(&mut net, c.a), expected);
    assert_eq!(inbox.contents(), pattern(64, 3));
    assert_eq!(net.naks(SEQ_NAK), 1);
    assert_eq!(net.engines[0].stats().timeouts, 0);
}
