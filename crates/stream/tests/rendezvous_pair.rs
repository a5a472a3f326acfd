//! Rendezvous between two connection cores wired back to back through an in-memory model of
//! RDMA (rings, staging, credit slots, registered buffers and RDMA READ, completions in
//! order): stream bytes and rendezvous interleave in any order and sizes, the reader takes
//! them through the bounce region or straight into its own buffer in any mix, and every byte
//! must arrive in stream order; the sender learns its buffer is free only after every READ of
//! it was carried out; lying descriptors and stray done records are refused.

mod model;

use lightpath_stream::rendezvous::{BounceGeometry, Descriptor, DescriptorError};
use lightpath_stream::{Arrival, Conn, CreditWord, Imm, ProtocolError, RecordKind};
use model::{config, Packet, Pair, EXPOSED_ADDR, EXPOSED_RKEY};
use proptest::prelude::*;

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
    let mut pair = Pair::with_bounce(ring, 8, geometry);
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
                    let n = pair.write(0, &data[written..], RecordKind::Data);
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
        let chunk_got = pair.read_mixed(1, size.max(1), direct, chunk);
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
    let mut pair = Pair::with_bounce(256, 8, geometry);
    let data = pattern(1000, 3);
    assert!(pair.start_rendezvous(0, &data, None));
    assert!(pair.sides[0].conn.rendezvous_outstanding());
    assert_eq!(pair.sides[0].conn.rendezvous_room(), None, "one rendezvous at a time");
    pair.post(0);
    pair.deliver(0, usize::MAX);
    // The reader accepts the descriptor; its ring bytes are consumed at once.
    let front = pair.sides[1].conn.front().unwrap();
    assert_eq!((front.kind, front.left), (RecordKind::Rendezvous, 24));
    let got = pair.read_mixed(1, 100, false, 64);
    assert!(got.is_empty(), "nothing landed yet");
    assert_eq!(pair.sides[1].conn.readable_bytes(), 0, "the descriptor's ring bytes are free");
    assert_eq!(pair.sides[1].conn.incoming().unwrap().descriptor().len, 1000);
    assert!(!pair.sides[1].conn.at_eof());
    // Read it all through the bounce region; Done only once the last READ completed.
    let mut all = Vec::new();
    for _ in 0..100 {
        all.extend(pair.read_mixed(1, 100, false, 64));
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
    let mut pair = Pair::with_bounce(256, 8, geometry);
    assert_eq!(pair.write(1, &pattern(256, 1), RecordKind::Data), 256);
    pair.post(1);
    assert_eq!(pair.write(1, b"more", RecordKind::Data), 0, "side 0's ring is full");
    assert!(pair.start_rendezvous(0, &pattern(500, 2), None));
    pair.post(0);
    pair.deliver(0, usize::MAX);
    let mut got = Vec::new();
    for _ in 0..20 {
        got.extend(pair.read_mixed(1, 1000, true, 128));
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
    let mut pair = Pair::with_bounce(256, 8, geometry);
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
    let mut pair = Pair::with_bounce(256, 8, geometry);
    let lie = Descriptor { addr: EXPOSED_ADDR, len: 10, rkey: EXPOSED_RKEY + 1, message: false };
    assert!(pair.start_rendezvous(0, &pattern(10, 0), Some(lie)));
    pair.post(0);
    pair.deliver(0, usize::MAX);
    assert!(pair.read_mixed(1, 100, false, 64).is_empty());
    let seq = match pair.wires[1].back() {
        Some(Packet::Read(request)) => request.seq,
        _ => panic!("a READ was posted"),
    };
    assert!(pair.sides[1].conn.is_rendezvous_read(seq), "a failure of it is the rendezvous'");
    pair.deliver(1, usize::MAX);
    assert_eq!(pair.sides[1].access_errors, 1);
    assert!(pair.sides[1].bounce.iter().all(|&b| b == 0), "the bounce region is untouched");
    // Records of the wrong shape.
    let mut conn = Conn::new(config(256, 8, 0));
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::Rendezvous, 23).encode(), 23),
        Err(ProtocolError::BadLength)
    );
    let mut conn = Conn::new(config(256, 8, 0));
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::RendezvousDone, 0).encode(), 8),
        Err(ProtocolError::UnexpectedRendezvousDone),
        "no rendezvous was started"
    );
    let mut conn = Conn::new(config(256, 8, 0));
    conn.commit_rendezvous();
    assert_eq!(
        conn.on_recv(Imm::new(RecordKind::RendezvousDone, 1).encode(), 8),
        Err(ProtocolError::UnexpectedRendezvousDone),
        "the wrong rendezvous"
    );
    assert_eq!(conn.on_recv(Imm::new(RecordKind::RendezvousDone, 0).encode(), 8), Ok(Arrival::Credit));
    assert!(!conn.rendezvous_outstanding());
    // A rendezvous after the peer's close is data after close.
    let mut conn = Conn::new(config(256, 8, 0));
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
    let mut conn = Conn::new(config(256, 8, 0));
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
    let mut pair = Pair::with_bounce(4096, 16, BounceGeometry { slot_len: 1024, slots: 2 });
    let filler = pattern(4096 - 10, 3);
    assert_eq!(pair.write(0, &filler, RecordKind::Data), filler.len());
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
    assert_eq!(pair.read_mixed(1, usize::MAX, false, 1024), filler);
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
