//! Two connection cores wired back to back through an in-memory model of RDMA: every
//! operation the cores ask for is carried out on byte arrays (staging, rings, credit slots),
//! completions come back in order, and the test checks that every byte and every message
//! boundary arrives, that no ring is ever overrun and that neither side deadlocks, for random
//! write and read sizes.

use std::collections::VecDeque;

use lightpath_stream::{Arrival, Conn, ConnConfig, CreditWord, Op, RecordKind};
use proptest::prelude::*;

/// One side: its core and its memory.
struct Side {
    conn: Conn,
    staging: Vec<u8>,
    ring: Vec<u8>,
    credit_slot: [u8; 8],
    /// Receive requests posted and not consumed.
    recvs: u64,
    /// Signaled sends whose completion is due.
    send_done: VecDeque<u64>,
}

/// What travels from one side to the other, in order.
enum Packet {
    Ring { pos: u64, bytes: Vec<u8>, imm: Option<u32>, done: Option<u64> },
    Credit { word: [u8; 8], imm: Option<u32>, done: Option<u64> },
}

struct Pair {
    sides: [Side; 2],
    wires: [VecDeque<Packet>; 2],
}

fn config(ring: u32, depth: u32, cork: u32) -> ConnConfig {
    ConnConfig {
        local_ring: ring,
        peer_ring: ring,
        local_recv_depth: depth,
        peer_recv_depth: depth,
        send_depth: 16,
        max_record: ring,
        cork_depth: cork,
    }
}

impl Pair {
    fn new(ring: u32, depth: u32, cork: u32) -> Self {
        let side = || Side {
            conn: Conn::new(config(ring, depth, cork)),
            staging: vec![0; ring as usize],
            ring: vec![0; ring as usize],
            credit_slot: [0; 8],
            recvs: u64::from(depth),
            send_done: VecDeque::new(),
        };
        Self { sides: [side(), side()], wires: [VecDeque::new(), VecDeque::new()] }
    }

    /// Posts every op side `i` has.
    fn post(&mut self, i: usize) {
        while let Some(op) = self.sides[i].conn.poll_op() {
            let side = &mut self.sides[i];
            match op {
                Op::PostRecv { count } => side.recvs += u64::from(count),
                Op::Write { seq, pos, len, imm, signaled } => {
                    let ring = side.staging.len() as u64;
                    let offset = (pos % ring) as usize;
                    assert!(offset + len as usize <= side.staging.len(), "a write never wraps");
                    let bytes = side.staging[offset..offset + len as usize].to_vec();
                    self.wires[i].push_back(Packet::Ring { pos, bytes, imm, done: signaled.then_some(seq) });
                }
                Op::Credit { seq, word, imm, signaled } => {
                    self.wires[i].push_back(Packet::Credit {
                        word: word.to_bytes(),
                        imm,
                        done: signaled.then_some(seq),
                    });
                }
            }
        }
    }

    /// Delivers up to `n` packets from side `i` to the other; returns how many moved.
    fn deliver(&mut self, i: usize, n: usize) -> usize {
        let mut moved = 0;
        while moved < n {
            let Some(packet) = self.wires[i].pop_front() else { break };
            moved += 1;
            let peer = &mut self.sides[1 - i];
            let (imm, done) = match packet {
                Packet::Ring { pos, bytes, imm, done } => {
                    let ring = peer.ring.len() as u64;
                    let offset = (pos % ring) as usize;
                    peer.ring[offset..offset + bytes.len()].copy_from_slice(&bytes);
                    (imm.map(|imm| (imm, bytes.len() as u32)), done)
                }
                Packet::Credit { word, imm, done } => {
                    peer.credit_slot = word;
                    (imm.map(|imm| (imm, 8)), done)
                }
            };
            // The sender's completion: acknowledged once delivered.
            self.sides[i].send_done.extend(done);
            let peer = &mut self.sides[1 - i];
            if let Some((imm, len)) = imm {
                assert!(peer.recvs > 0, "a record arrived with no receive posted (RNR)");
                peer.recvs -= 1;
                match peer.conn.on_recv(imm, len).expect("the peer follows the protocol") {
                    Arrival::Credit => {
                        peer.conn.on_credit_word(CreditWord::from_bytes(peer.credit_slot));
                    }
                    Arrival::Bytes | Arrival::Closed | Arrival::Notify(_) => {}
                }
            }
        }
        let side = &mut self.sides[i];
        while let Some(seq) = side.send_done.pop_front() {
            side.conn.on_send_complete(seq);
        }
        moved
    }

    /// The application on side `i` reads up to `max` stream bytes.
    fn read(&mut self, i: usize, max: usize) -> Vec<u8> {
        let side = &mut self.sides[i];
        side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        let mut out = Vec::new();
        while out.len() < max {
            let Some(front) = side.conn.front() else { break };
            assert_eq!(front.kind, RecordKind::Data);
            let n = (front.contiguous as usize).min(max - out.len());
            let start = front.offset as usize;
            out.extend_from_slice(&side.ring[start..start + n]);
            side.conn.consume(n as u32);
        }
        out
    }

    /// The application on side `i` writes as much of `data` as fits; returns how much.
    fn write(&mut self, i: usize, data: &[u8], kind: RecordKind) -> usize {
        let side = &mut self.sides[i];
        side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        let mut done = 0;
        loop {
            let Some((grant, offset)) = side.conn.send_room(kind, data.len() - done) else {
                if done < data.len() {
                    side.conn.note_blocked();
                }
                break;
            };
            let ring = side.staging.len();
            for k in 0..grant as usize {
                side.staging[(offset as usize + k) % ring] = data[done + k];
            }
            side.conn.commit(kind, grant);
            done += grant as usize;
            if done == data.len() {
                break;
            }
        }
        done
    }

    fn idle(&self) -> bool {
        self.wires.iter().all(VecDeque::is_empty)
    }
}

fn pattern(n: usize, salt: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt) ^ (i >> 8) as u8).collect()
}

/// Runs a bidirectional transfer with the given chunk sizes; returns the bytes each side got.
fn run(ring: u32, depth: u32, cork: u32, total: usize, writes: &[usize], reads: &[usize], batch: usize) {
    let mut pair = Pair::new(ring, depth, cork);
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
    assert_eq!(got[1], data[0], "side 0 → 1 bytes differ");
    assert_eq!(got[0], data[1], "side 1 → 0 bytes differ");
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
