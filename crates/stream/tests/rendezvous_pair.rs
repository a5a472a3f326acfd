//! Rendezvous between two connection cores wired back to back through an in-memory model of
//! RDMA (rings, staging, credit slots, registered buffers and RDMA READ, completions in
//! order): stream bytes and rendezvous interleave in any order and sizes, the reader takes
//! them through the bounce region or straight into its own buffer in any mix, and every byte
//! must arrive in stream order; the sender learns its buffer is free only after every READ of
//! it was carried out; lying descriptors and stray done records are refused.

use std::collections::VecDeque;

use lightpath_stream::rendezvous::{
    BounceGeometry, Descriptor, DescriptorError, ReadRequest, ReadTarget, DESCRIPTOR_LEN,
};
use lightpath_stream::{Arrival, Conn, ConnConfig, CreditWord, Imm, Op, ProtocolError, RecordKind};
use proptest::prelude::*;

/// Address and key of the sender's registered buffer in the model.
const EXPOSED_ADDR: u64 = 0x7000_0000;
const EXPOSED_RKEY: u32 = 77;

struct Side {
    conn: Conn,
    staging: Vec<u8>,
    ring: Vec<u8>,
    credit_slot: [u8; 8],
    recvs: u64,
    send_done: VecDeque<u64>,
    /// The registered buffer a rendezvous of this side names.
    exposed: Vec<u8>,
    bounce: Vec<u8>,
    /// Destination of the direct read in progress.
    direct: Vec<u8>,
    /// READs of this side the peer refused (bad key or range): a remote access error.
    access_errors: u32,
}

enum Packet {
    Ring { pos: u64, bytes: Vec<u8>, imm: Option<u32>, done: Option<u64> },
    Credit { word: [u8; 8], imm: Option<u32>, done: Option<u64> },
    Read(ReadRequest),
}

struct Pair {
    sides: [Side; 2],
    wires: [VecDeque<Packet>; 2],
    geometry: BounceGeometry,
}

fn config(ring: u32, depth: u32) -> ConnConfig {
    ConnConfig {
        local_ring: ring,
        peer_ring: ring,
        local_recv_depth: depth,
        peer_recv_depth: depth,
        send_depth: 16,
        max_record: ring,
        cork_depth: 0,
    }
}

impl Pair {
    fn new(ring: u32, depth: u32, geometry: BounceGeometry) -> Self {
        let side = || Side {
            conn: Conn::new(config(ring, depth)),
            staging: vec![0; ring as usize],
            ring: vec![0; ring as usize],
            credit_slot: [0; 8],
            recvs: u64::from(depth),
            send_done: VecDeque::new(),
            exposed: Vec::new(),
            bounce: vec![0; geometry.len()],
            direct: Vec::new(),
            access_errors: 0,
        };
        Self { sides: [side(), side()], wires: [VecDeque::new(), VecDeque::new()], geometry }
    }

    fn post(&mut self, i: usize) {
        while let Some(op) = self.sides[i].conn.poll_op() {
            let side = &mut self.sides[i];
            match op {
                Op::PostRecv { count } => side.recvs += u64::from(count),
                Op::Write { seq, pos, len, imm, signaled } => {
                    let ring = side.staging.len() as u64;
                    let offset = (pos % ring) as usize;
                    let bytes = side.staging[offset..offset + len as usize].to_vec();
                    self.wires[i].push_back(Packet::Ring { pos, bytes, imm, done: signaled.then_some(seq) });
                }
                Op::Credit { seq, word, imm, signaled } => {
                    let done = signaled.then_some(seq);
                    self.wires[i].push_back(Packet::Credit { word: word.to_bytes(), imm, done });
                }
            }
        }
    }

    /// Queues a READ of side `i` (the driver's job).
    fn post_read(&mut self, i: usize, request: ReadRequest) {
        self.wires[i].push_back(Packet::Read(request));
    }

    fn deliver(&mut self, i: usize, n: usize) -> usize {
        let mut moved = 0;
        while moved < n {
            let Some(packet) = self.wires[i].pop_front() else { break };
            moved += 1;
            let (imm, done) = match packet {
                Packet::Ring { pos, bytes, imm, done } => {
                    let peer = &mut self.sides[1 - i];
                    let ring = peer.ring.len() as u64;
                    let offset = (pos % ring) as usize;
                    peer.ring[offset..offset + bytes.len()].copy_from_slice(&bytes);
                    (imm.map(|imm| (imm, bytes.len() as u32)), done)
                }
                Packet::Credit { word, imm, done } => {
                    self.sides[1 - i].credit_slot = word;
                    (imm.map(|imm| (imm, 8)), done)
                }
                Packet::Read(request) => {
                    // The peer's responder checks key and range, then the bytes land here.
                    let exposed = &self.sides[1 - i].exposed;
                    let start = request.remote_addr.wrapping_sub(EXPOSED_ADDR) as usize;
                    let end = start.checked_add(request.len as usize);
                    let valid = request.rkey == EXPOSED_RKEY
                        && request.remote_addr >= EXPOSED_ADDR
                        && end.is_some_and(|end| end <= exposed.len());
                    if !valid {
                        self.sides[i].access_errors += 1;
                        continue;
                    }
                    let bytes = exposed[start..start + request.len as usize].to_vec();
                    let side = &mut self.sides[i];
                    let target = match request.target {
                        ReadTarget::Bounce { offset } => &mut side.bounce[offset as usize..],
                        ReadTarget::Direct { offset } => &mut side.direct[offset as usize..],
                    };
                    target[..bytes.len()].copy_from_slice(&bytes);
                    (None, Some(request.seq))
                }
            };
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

    /// Ring bytes `[offset, offset + len)` of side `i`, wrapping.
    fn ring_bytes(&self, i: usize, offset: u32, len: u32) -> Vec<u8> {
        let ring = &self.sides[i].ring;
        (0..len as usize).map(|k| ring[(offset as usize + k) % ring.len()]).collect()
    }

    /// The application on side `i` reads up to `max` bytes, `direct` into its own buffer (a
    /// direct read, which may need several steps to land) or through the bounce region.
    /// Returns what it got in this step.
    fn read(&mut self, i: usize, max: usize, direct: bool, chunk: u32) -> Vec<u8> {
        {
            let side = &mut self.sides[i];
            side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        }
        let mut out = Vec::new();
        while out.len() < max {
            let Some(front) = self.sides[i].conn.front() else { break };
            match front.kind {
                RecordKind::Data => {
                    let side = &mut self.sides[i];
                    let n = (front.contiguous as usize).min(max - out.len());
                    let start = front.offset as usize;
                    out.extend_from_slice(&side.ring[start..start + n]);
                    side.conn.consume(n as u32);
                }
                RecordKind::Rendezvous => {
                    if front.left > 0 {
                        let bytes = self.ring_bytes(i, front.offset, front.left);
                        let desc = self.sides[i].conn.accept_rendezvous(&bytes).expect("a valid descriptor");
                        assert!(desc.is_some(), "an unaccepted rendezvous at the head is accepted");
                        continue;
                    }
                    if !self.rendezvous_step(i, max - out.len(), direct, chunk, &mut out) {
                        break;
                    }
                }
                other => panic!("unexpected record {other:?}"),
            }
        }
        out
    }

    /// One step of reading the rendezvous at the head; `false` when it must wait for READs.
    fn rendezvous_step(&mut self, i: usize, max: usize, direct: bool, chunk: u32, out: &mut Vec<u8>) -> bool {
        let geometry = self.geometry;
        let conn = &mut self.sides[i].conn;
        let incoming = conn.incoming().expect("accepted").clone();
        if incoming.direct_in_progress() {
            let mut requests = Vec::new();
            while let Some(request) = conn.rendezvous_direct(chunk, 3) {
                requests.push(request);
            }
            for request in requests {
                self.post_read(i, request);
            }
            let side = &mut self.sides[i];
            return match side.conn.rendezvous_finish_direct() {
                Some((n, _)) => {
                    out.extend_from_slice(&side.direct[..n as usize]);
                    true
                }
                None => false,
            };
        }
        if let Some((at, len)) = conn.rendezvous_bounced() {
            let n = len.min(max as u32);
            out.extend_from_slice(&self.sides[i].bounce[at as usize..(at + n) as usize]);
            self.sides[i].conn.rendezvous_take_bounced(n);
            return true;
        }
        if direct && !incoming.bounce_pending() {
            let want = conn.rendezvous_begin_direct(max as u64);
            assert!(want > 0 && want <= max as u64);
            self.sides[i].direct = vec![0; want as usize];
            return true;
        }
        let mut requests = Vec::new();
        while let Some(request) = conn.rendezvous_prefetch(geometry) {
            requests.push(request);
        }
        let posted = !requests.is_empty();
        for request in requests {
            self.post_read(i, request);
        }
        // Waiting for a READ: the caller delivers packets and comes back.
        let _ = posted;
        false
    }

    /// Side `i` writes `data` through the ring, as much as fits; returns how much.
    fn write(&mut self, i: usize, data: &[u8]) -> usize {
        let side = &mut self.sides[i];
        side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        let mut done = 0;
        while done < data.len() {
            let Some((grant, offset)) = side.conn.send_room(RecordKind::Data, data.len() - done) else {
                side.conn.note_blocked();
                break;
            };
            let ring = side.staging.len();
            for k in 0..grant as usize {
                side.staging[(offset as usize + k) % ring] = data[done + k];
            }
            side.conn.commit(RecordKind::Data, grant);
            done += grant as usize;
        }
        done
    }

    /// Side `i` announces `data` as a rendezvous if there is room; returns whether it did.
    fn start_rendezvous(&mut self, i: usize, data: &[u8], desc_override: Option<Descriptor>) -> bool {
        let side = &mut self.sides[i];
        side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        let Some(offset) = side.conn.rendezvous_room() else {
            side.conn.note_blocked_for(DESCRIPTOR_LEN);
            return false;
        };
        side.exposed = data.to_vec();
        let desc = desc_override.unwrap_or(Descriptor {
            addr: EXPOSED_ADDR,
            len: data.len() as u64,
            rkey: EXPOSED_RKEY,
            message: false,
        });
        let ring = side.staging.len();
        for (k, byte) in desc.encode().iter().enumerate() {
            side.staging[(offset as usize + k) % ring] = *byte;
        }
        side.conn.commit_rendezvous();
        true
    }

    fn idle(&self) -> bool {
        self.wires.iter().all(VecDeque::is_empty)
    }
}

fn pattern(n: usize, salt: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(29).wrapping_add(salt) ^ (i >> 7) as u8).collect()
}

/// A piece of what the sender writes.
#[derive(Clone, Debug)]
enum Piece {
    Ring(usize),
    Rendezvous(usize),
}

/// Side 0 sends the pieces in order; side 1 reads with the given sizes and modes. Checks the
/// bytes, and that each rendezvous buffer is released only after every READ of it.
fn run(
    ring: u32,
    geometry: BounceGeometry,
    chunk: u32,
    pieces: &[Piece],
    reads: &[(usize, bool)],
    batch: usize,
) {
    let mut pair = Pair::new(ring, 8, geometry);
    let mut expected = Vec::new();
    let mut got = Vec::new();
    let mut piece = 0;
    let mut written = 0; // of the current ring piece
    let mut outstanding = false;
    let mut step = 0usize;
    let mut stalled = 0;
    let mut salt = 0u8;
    loop {
        let mut progress = false;
        if outstanding {
            if !pair.sides[0].conn.rendezvous_outstanding() {
                // Done arrived: every READ was carried out. The sender reuses its buffer.
                outstanding = false;
                pair.sides[0].exposed.iter_mut().for_each(|b| *b = 0xEE);
                piece += 1;
                progress = true;
            }
        } else if let Some(current) = pieces.get(piece) {
            match *current {
                Piece::Ring(len) => {
                    let data = pattern(len.max(1), salt);
                    let n = pair.write(0, &data[written..]);
                    expected.extend_from_slice(&data[written..written + n]);
                    written += n;
                    progress |= n > 0;
                    if written == data.len() {
                        written = 0;
                        piece += 1;
                        salt = salt.wrapping_add(1);
                    }
                }
                Piece::Rendezvous(len) => {
                    let data = pattern(len.max(1), salt.wrapping_add(100));
                    if pair.start_rendezvous(0, &data, None) {
                        expected.extend_from_slice(&data);
                        outstanding = true;
                        progress = true;
                        salt = salt.wrapping_add(1);
                    }
                }
            }
        }
        pair.post(0);
        progress |= pair.deliver(0, batch) > 0;
        let (size, direct) = reads[step % reads.len()];
        let chunk_got = pair.read(1, size.max(1), direct, chunk);
        progress |= !chunk_got.is_empty();
        got.extend_from_slice(&chunk_got);
        pair.post(1);
        progress |= pair.deliver(1, batch) > 0;
        pair.post(0);
        if piece == pieces.len() && !outstanding && got.len() == expected.len() && pair.idle() {
            break;
        }
        step += 1;
        assert!(step < 200_000, "no end after {step} steps");
        stalled = if progress || !pair.idle() { 0 } else { stalled + 1 };
        assert!(stalled < 4, "deadlock at piece {piece}: received {} of {}", got.len(), expected.len());
    }
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "stream bytes differ");
    assert_eq!(pair.sides[1].access_errors, 0);
    assert!(pair.sides[1].conn.incoming().is_none());
    assert!(pair.sides[1].conn.front().is_none());
}

#[test]
fn ring_bytes_around_rendezvous_keep_their_order() {
    let geometry = BounceGeometry { slot_len: 100, slots: 3 };
    let pieces =
        [Piece::Ring(50), Piece::Rendezvous(1000), Piece::Ring(30), Piece::Rendezvous(1), Piece::Ring(7)];
    run(256, geometry, 128, &pieces, &[(64, false)], 4);
    run(256, geometry, 128, &pieces, &[(5000, true)], 4);
    run(256, geometry, 333, &pieces, &[(10, true), (300, false), (77, true)], 1);
}

#[test]
fn back_to_back_rendezvous_and_wrapped_descriptors() {
    // A 64-byte ring: descriptors (24 bytes) regularly straddle its end.
    let geometry = BounceGeometry { slot_len: 16, slots: 2 };
    let mut pieces = Vec::new();
    for k in 0..12 {
        pieces.push(Piece::Rendezvous(40 + k * 13));
        if k % 3 == 0 {
            pieces.push(Piece::Ring(k + 5));
        }
    }
    run(64, geometry, 32, &pieces, &[(25, false), (1000, true), (3, false)], 2);
}

#[test]
fn done_waits_for_every_read_and_the_ring_frees_at_once() {
    let geometry = BounceGeometry { slot_len: 64, slots: 2 };
    let mut pair = Pair::new(256, 8, geometry);
    let data = pattern(1000, 3);
    assert!(pair.start_rendezvous(0, &data, None));
    assert!(pair.sides[0].conn.rendezvous_outstanding());
    assert_eq!(pair.sides[0].conn.rendezvous_room(), None, "one rendezvous at a time");
    pair.post(0);
    pair.deliver(0, usize::MAX);
    // The reader accepts the descriptor; its ring bytes are consumed at once.
    let front = pair.sides[1].conn.front().unwrap();
    assert_eq!((front.kind, front.left), (RecordKind::Rendezvous, 24));
    let got = pair.read(1, 100, false, 64);
    assert!(got.is_empty(), "nothing landed yet");
    assert_eq!(pair.sides[1].conn.readable_bytes(), 0, "the descriptor's ring bytes are free");
    assert_eq!(pair.sides[1].conn.incoming().unwrap().descriptor().len, 1000);
    assert!(!pair.sides[1].conn.at_eof());
    // Read it all through the bounce region; Done only once the last READ completed.
    let mut all = Vec::new();
    for _ in 0..100 {
        all.extend(pair.read(1, 100, false, 64));
        pair.post(1);
        if pair.sides[1].conn.incoming().is_some_and(|i| !i.is_fetched(u64::MAX)) {
            assert!(pair.wires[1].iter().all(|p| !matches!(p, Packet::Credit { imm: Some(_), .. })));
        }
        pair.deliver(1, usize::MAX);
        pair.post(0);
        pair.deliver(0, usize::MAX);
        if all.len() == data.len() {
            break;
        }
    }
    assert_eq!(all, data);
    assert!(!pair.sides[0].conn.rendezvous_outstanding(), "the sender has its buffer back");
    assert!(pair.sides[1].conn.front().is_none());
    assert!(pair.sides[0].conn.rendezvous_room().is_some());
}

#[test]
fn done_gets_through_while_the_other_ring_is_full() {
    // Side 1 fills side 0's ring (side 0 never reads) and still gets its done record out.
    let geometry = BounceGeometry { slot_len: 512, slots: 2 };
    let mut pair = Pair::new(256, 8, geometry);
    assert_eq!(pair.write(1, &pattern(256, 1)), 256);
    pair.post(1);
    assert_eq!(pair.write(1, b"more"), 0, "side 0's ring is full");
    assert!(pair.start_rendezvous(0, &pattern(500, 2), None));
    pair.post(0);
    pair.deliver(0, usize::MAX);
    let mut got = Vec::new();
    for _ in 0..20 {
        got.extend(pair.read(1, 1000, true, 128));
        pair.post(1);
        pair.deliver(1, usize::MAX);
        pair.post(0);
        pair.deliver(0, usize::MAX);
    }
    assert_eq!(got, pattern(500, 2));
    assert!(!pair.sides[0].conn.rendezvous_outstanding());
}

#[test]
fn lying_descriptors_and_stray_done_records_are_refused() {
    let geometry = BounceGeometry { slot_len: 64, slots: 1 };
    // A descriptor whose length field is absurd: refused before any READ.
    let mut pair = Pair::new(256, 8, geometry);
    let lie = Descriptor { addr: EXPOSED_ADDR, len: u64::MAX, rkey: EXPOSED_RKEY, message: false };
    assert!(pair.start_rendezvous(0, &pattern(10, 0), Some(lie)));
    pair.post(0);
    pair.deliver(0, usize::MAX);
    let front = pair.sides[1].conn.front().unwrap();
    let bytes = pair.ring_bytes(1, front.offset, front.left);
    assert_eq!(
        pair.sides[1].conn.accept_rendezvous(&bytes),
        Err(ProtocolError::BadRendezvous(DescriptorError::TooLong(u64::MAX)))
    );
    assert!(pair.sides[1].conn.incoming().is_none());
    assert!(pair.sides[1].conn.rendezvous_prefetch(geometry).is_none(), "nothing to read from");
    // A wrong key passes the descriptor check but the peer refuses the READ: nothing lands.
    let mut pair = Pair::new(256, 8, geometry);
    let lie = Descriptor { addr: EXPOSED_ADDR, len: 10, rkey: EXPOSED_RKEY + 1, message: false };
    assert!(pair.start_rendezvous(0, &pattern(10, 0), Some(lie)));
    pair.post(0);
    pair.deliver(0, usize::MAX);
    assert!(pair.read(1, 100, false, 64).is_empty());
    let seq = match pair.wires[1].back() {
        Some(Packet::Read(request)) => request.seq,
        _ => panic!("a READ was posted"),
    };
    assert!(pair.sides[1].conn.is_rendezvous_read(seq), "a failure of it is the rendezvous'");
    pair.deliver(1, usize::MAX);
    assert_eq!(pair.sides[1].access_errors, 1);
    assert!(pair.sides[1].bounce.iter().all(|&b| b == 0), "the bounce region is untouched");
    // Records of the wrong shape.
    let mut conn = Conn::new(config(256, 8));
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::Rendezvous, 23).encode(), 23),
        Err(ProtocolError::BadLength)
    );
    let mut conn = Conn::new(config(256, 8));
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::RendezvousDone, 0).encode(), 8),
        Err(ProtocolError::UnexpectedRendezvousDone),
        "no rendezvous was started"
    );
    let mut conn = Conn::new(config(256, 8));
    conn.commit_rendezvous();
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::RendezvousDone, 1).encode(), 8),
        Err(ProtocolError::UnexpectedRendezvousDone),
        "the wrong rendezvous"
    );
    assert_eq!(conn.on_recv(Imm::new(RecordKind::RendezvousDone, 0).encode(), 8), Ok(Arrival::Credit));
    assert!(!conn.rendezvous_outstanding());
    // A rendezvous after the peer's close is data after close.
    let mut conn = Conn::new(config(256, 8));
    conn.on_recv(Imm::new(RecordKind::Close, 0).encode(), 8).unwrap();
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::Rendezvous, 24).encode(), 24),
        Err(ProtocolError::DataAfterClose)
    );
}

#[test]
fn a_side_down_to_its_reserve_is_told_to_read_its_credit_slot() {
    // Done records use the peer's receives like any record with immediate; the peer returns
    // them with plain credit writes, which a side that only reads must go and look at.
    let mut conn = Conn::new(config(256, 8));
    assert!(!conn.credit_low());
    for _ in 0..4 {
        conn.notify_seq(1);
    }
    assert!(conn.credit_low(), "8 receives, 4 used: only the reserve is left");
    conn.on_credit_word(CreditWord::new(0, 16));
    assert!(!conn.credit_low());
}

#[test]
fn a_rendezvous_blocked_on_a_sliver_of_ring_is_woken_when_bytes_free() {
    // The ring has room for less than a descriptor (and receives to spare): the starved notice
    // must ask for bytes, or the reader, with receives to give but no reason to, never wakes
    // the writer.
    let mut pair = Pair::new(4096, 16, BounceGeometry { slot_len: 1024, slots: 2 });
    let filler = pattern(4096 - 10, 3);
    assert_eq!(pair.write(0, &filler), filler.len());
    pair.post(0);
    while pair.deliver(0, usize::MAX) + pair.deliver(1, usize::MAX) > 0 {
        pair.post(0);
        pair.post(1);
    }
    assert!(!pair.start_rendezvous(0, &pattern(8192, 4), None), "10 free bytes hold no descriptor");
    pair.post(0);
    pair.deliver(0, usize::MAX);
    // The reader takes everything. A blocked writer sleeps until a record with immediate
    // arrives (a plain credit write raises no completion), so the reader must send one.
    assert_eq!(pair.read(1, usize::MAX, false, 1024), filler);
    pair.post(1);
    let wake_ups = pair.wires[1]
        .iter()
        .filter(|packet| matches!(packet, Packet::Credit { imm: Some(imm), .. } if Imm::decode(*imm).is_ok_and(|imm| imm.kind == RecordKind::Credit)))
        .count();
    assert_eq!(wake_ups, 1, "the reader woke the writer");
    pair.deliver(1, usize::MAX);
    assert!(pair.start_rendezvous(0, &pattern(8192, 4), None), "and the writer finds room");
}

fn piece() -> impl Strategy<Value = Piece> {
    prop_oneof![(1usize..400).prop_map(Piece::Ring), (1usize..3000).prop_map(Piece::Rendezvous)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_mixes_arrive_in_order(
        ring_shift in 6u32..10,
        slot_len in 1u32..200,
        slots in 1u32..4,
        chunk in 1u32..700,
        pieces in proptest::collection::vec(piece(), 1..8),
        reads in proptest::collection::vec((1usize..2000, any::<bool>()), 1..5),
        batch in 1usize..6,
    ) {
        run(1 << ring_shift, BounceGeometry { slot_len, slots }, chunk, &pieces, &reads, batch);
    }
}
