//! Two connection cores wired back to back through an in-memory model of RDMA: every
//! operation the cores ask for is carried out on byte arrays (staging, rings, credit slots),
//! completions come back in order, and the test checks that every byte and every message
//! boundary arrives, that no ring is ever overrun and that neither side deadlocks, for random
//! write and read sizes.

mod model;

use lightpath_stream::{Arrival, Conn, Imm, ProtocolError, RecordKind};
use model::{config, Pair};
use proptest::prelude::*;

fn pattern(n: usize, salt: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt) ^ (i >> 8) as u8).collect()
}

/// Runs a bidirectional transfer with the given chunk sizes; returns the bytes each side got.
fn run(ring: u32, depth: u32, cork: u32, total: usize, writes: &[usize], reads: &[usize], batch: usize) {
    for restarts in [true, false] {
        run_with(restarts, ring, depth, cork, total, writes, reads, batch);
    }
}

#[allow(clippy::too_many_arguments)]
fn run_with(
    restarts: bool,
    ring: u32,
    depth: u32,
    cork: u32,
    total: usize,
    writes: &[usize],
    reads: &[usize],
    batch: usize,
) {
    let mut pair = Pair::with_restarts(ring, depth, cork, restarts);
    let data = [pattern(total, 1), pattern(total, 2)];
    let mut sent = [0usize; 2];
    let mut got: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let mut step = 0usize;
    let mut stalled = 0;
    while got[0].len() < total || got[1].len() < total {
        let mut progress = false;
        for i in 0..2 {
            if sent[i] < total {
                let want = writes[step % writes.len()].min(total - sent[i]).max(1);
                let n = pair.write(i, &data[i][sent[i]..sent[i] + want], RecordKind::Data);
                sent[i] += n;
                progress |= n > 0;
                if sent[i] == total {
                    pair.sides[i].conn.uncork();
                }
            }
            pair.post(i);
            progress |= pair.deliver(i, batch) > 0;
            let chunk = pair.read(1 - i, reads[step % reads.len()].max(1));
            progress |= !chunk.is_empty();
            got[1 - i].extend_from_slice(&chunk);
            pair.post(1 - i);
        }
        step += 1;
        assert!(step < 20 * total + 1000, "no progress after {step} steps: sent {sent:?}");
        stalled = if progress || !pair.idle() { 0 } else { stalled + 1 };
        assert!(stalled < 4, "deadlock: sent {sent:?}, received {} / {}", got[0].len(), got[1].len());
    }
    assert_eq!(got[1], data[0], "side 0 → 1 bytes differ (restarts {restarts})");
    assert_eq!(got[0], data[1], "side 1 → 0 bytes differ (restarts {restarts})");
    if !restarts {
        assert_eq!(pair.sides[0].conn.ring_restarts() + pair.sides[1].conn.ring_restarts(), 0);
    }
}

/// Request/response traffic (each side reads all of one message before the next is sent) with
/// restarts keeps to the start of the ring: the pages touched are those of one burst between
/// two credit words, not the whole ring; without restarts the position runs through all of it.
#[test]
fn request_response_traffic_restarts_at_the_beginning_of_the_ring() {
    let ring = 64 << 10;
    for restarts in [true, false] {
        let mut pair = Pair::with_restarts(ring, 16, 0, restarts);
        let request = pattern(300, 7);
        for round in 0..2_000 {
            let (from, to) = if round % 2 == 0 { (0, 1) } else { (1, 0) };
            assert_eq!(pair.write(from, &request, RecordKind::Data), request.len());
            let mut got = Vec::new();
            for _ in 0..100 {
                pair.post(from);
                pair.deliver(from, usize::MAX);
                got.extend(pair.read(to, usize::MAX));
                pair.post(to);
                pair.deliver(to, usize::MAX);
                if got.len() == request.len() {
                    break;
                }
            }
            assert_eq!(got, request, "round {round} (restarts {restarts})");
        }
        let touched = pair.ring_touched(1).max(pair.ring_touched(0));
        let restarted = pair.sides[0].conn.ring_restarts() + pair.sides[1].conn.ring_restarts();
        if restarts {
            assert!(restarted >= 100, "only {restarted} restarts in 2,000 messages");
            // A credit word at least every quarter of the receive queue (4 records here).
            assert!(touched <= 8 * request.len(), "{touched} bytes of the ring touched");
        } else {
            assert_eq!(restarted, 0);
            assert_eq!(touched, ring as usize, "the position runs through the whole ring");
        }
    }
}

#[test]
fn small_ring_bulk_both_ways() {
    run(256, 8, 0, 20_000, &[1000], &[100], 3);
    run(256, 8, 2, 20_000, &[7, 300], &[64, 1], 1);
}

#[test]
fn tiny_writes_exhaust_receive_credits_not_the_ring() {
    run(1 << 16, 8, 0, 5_000, &[1], &[10_000], 2);
}

#[test]
fn messages_keep_boundaries_and_close_arrives_last() {
    let mut pair = Pair::new(128, 8, 0);
    let messages: Vec<Vec<u8>> = [0usize, 1, 127, 128, 300, 5].iter().map(|&n| pattern(n, n as u8)).collect();
    let mut received: Vec<Vec<u8>> = Vec::new();
    let mut current = Vec::new();
    for message in &messages {
        let mut done = 0;
        loop {
            let left = message.len() - done;
            let room = pair.sides[0].conn.send_room(RecordKind::MsgPart, left);
            if let Some((grant, offset)) = room {
                let kind = if grant as usize == left { RecordKind::MsgEnd } else { RecordKind::MsgPart };
                for k in 0..grant as usize {
                    pair.sides[0].staging[(offset as usize + k) % 128] = message[done + k];
                }
                pair.sides[0].conn.commit(kind, grant);
                done += grant as usize;
                if kind == RecordKind::MsgEnd {
                    break;
                }
            } else {
                pair.sides[0].conn.note_blocked();
            }
            pair.post(0);
            pair.deliver(0, usize::MAX);
            drain_messages(&mut pair, &mut current, &mut received);
            pair.post(1);
            pair.deliver(1, usize::MAX);
        }
    }
    pair.sides[0].conn.shutdown();
    for _ in 0..4 {
        pair.post(0);
        pair.deliver(0, usize::MAX);
        drain_messages(&mut pair, &mut current, &mut received);
        pair.post(1);
        pair.deliver(1, usize::MAX);
    }
    assert_eq!(received, messages);
    assert!(pair.sides[1].conn.at_eof());
    assert!(pair.sides[0].conn.is_flushed());
    assert_eq!(pair.sides[0].conn.send_room(RecordKind::Data, 1), None, "no writes after shutdown");
}

fn drain_messages(pair: &mut Pair, current: &mut Vec<u8>, received: &mut Vec<Vec<u8>>) {
    let side = &mut pair.sides[1];
    while let Some(front) = side.conn.front() {
        assert!(front.kind.is_message());
        let start = front.offset as usize;
        current.extend_from_slice(&side.ring[start..start + front.contiguous as usize]);
        if side.conn.consume(front.contiguous) {
            received.push(std::mem::take(current));
        }
    }
}

#[test]
fn corking_merges_writes_behind_records_in_flight() {
    let mut pair = Pair::new(4096, 16, 1);
    for _ in 0..10 {
        assert_eq!(pair.write(0, b"abcd", RecordKind::Data), 4);
        pair.post(0);
    }
    // The first write went at once; the other nine wait behind it as one record.
    assert_eq!(pair.wires[0].len(), 1);
    pair.deliver(0, usize::MAX);
    pair.post(0);
    assert_eq!(pair.wires[0].len(), 1, "nine writes, one record");
    pair.deliver(0, usize::MAX);
    assert_eq!(pair.read(1, 100), b"abcd".repeat(10));
}

#[test]
fn held_writes_leave_as_one_record_when_the_hold_ends_or_fills() {
    let mut pair = Pair::new(1 << 20, 16, 0);
    pair.sides[0].conn.set_hold(true);
    assert_eq!(pair.write(0, b"HTTP/1.1 200 OK\r\n\r\n", RecordKind::Data), 19);
    pair.post(0);
    assert_eq!(pair.write(0, b"body", RecordKind::Data), 4);
    pair.post(0);
    assert!(pair.wires[0].is_empty(), "a held write was posted");
    pair.sides[0].conn.set_hold(false);
    pair.post(0);
    assert_eq!(pair.wires[0].len(), 1, "header and body, one record");
    pair.deliver(0, usize::MAX);
    assert_eq!(pair.read(1, 100), b"HTTP/1.1 200 OK\r\n\r\nbody");
    // Held, a record that reaches the limit leaves anyway (a writer never waits on its own
    // hold for room in the ring).
    pair.sides[0].conn.set_hold(true);
    let big = vec![7u8; lightpath_stream::HOLD_LIMIT as usize];
    assert_eq!(pair.write(0, &big, RecordKind::Data), big.len());
    pair.post(0);
    assert_eq!(pair.wires[0].len(), 1, "a full held record stayed back");
    // And a flush (uncork) lets a held record go while the hold stays on.
    pair.deliver(0, usize::MAX);
    assert_eq!(pair.write(0, b"tail", RecordKind::Data), 4);
    pair.post(0);
    assert!(pair.wires[0].is_empty());
    pair.sides[0].conn.uncork();
    pair.post(0);
    assert_eq!(pair.wires[0].len(), 1, "the flush did not post the held record");
    assert!(pair.sides[0].conn.held(), "a flush leaves the hold on");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_transfers_arrive_intact(
        ring_shift in 6u32..12,
        depth in 8u32..20,
        cork in 0u32..3,
        total in 1usize..6000,
        writes in proptest::collection::vec(1usize..3000, 1..6),
        reads in proptest::collection::vec(1usize..3000, 1..6),
        batch in 1usize..5,
    ) {
        run(1 << ring_shift, depth, cork, total, &writes, &reads, batch);
    }
}

/// A receiver takes a restart only when it has read everything: then the record is read from
/// the start of the ring; with bytes unread it would overwrite them, and the peer broke the
/// protocol.
#[test]
fn a_restart_is_taken_only_by_a_receiver_that_has_read_everything() {
    let restart = |len| Imm::new(RecordKind::Data, len).restarting(true).encode();
    let mut conn = Conn::new(config(256, 8, 0));
    assert_eq!(conn.on_recv(Imm::new(RecordKind::Data, 100).encode(), 100), Ok(Arrival::Bytes));
    assert_eq!(conn.on_recv(restart(10), 10), Err(ProtocolError::RingOverrun), "100 bytes unread");
    let mut conn = Conn::new(config(256, 8, 0));
    assert_eq!(conn.on_recv(Imm::new(RecordKind::Data, 100).encode(), 100), Ok(Arrival::Bytes));
    assert!(!conn.consume(100));
    assert_eq!(conn.on_recv(restart(10), 10), Ok(Arrival::Bytes));
    let front = conn.front().expect("the restarted record");
    assert_eq!((front.offset, front.left), (0, 10), "read from the start of the ring");
    assert_eq!(conn.readable_bytes(), 10);
    // The skipped bytes count as consumed: the next credit word says 256 + 10 once it is read.
    assert!(!conn.consume(10));
    assert_eq!(conn.bytes_consumed(), 266);
}
