//! Single-threaded tests of the ring's bookkeeping and of its validation of peer input; the
//! concurrent behaviour is model-checked in `tests/loom.rs`.

use std::cell::{Cell, RefCell};

use super::*;

struct HeapRing(RefCell<Vec<u8>>);

impl HeapRing {
    fn new(capacity: usize) -> Self {
        Self(RefCell::new(vec![0; capacity]))
    }

    fn poke(&self, offset: usize, bytes: &[u8]) {
        self.0.borrow_mut()[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}

impl RingMemory for HeapRing {
    fn load_word(&self, offset: usize, _: Ordering) -> u64 {
        let mut word = [0u8; 8];
        word.copy_from_slice(&self.0.borrow()[offset..offset + 8]);
        u64::from_le_bytes(word)
    }

    fn store_word(&self, offset: usize, value: u64, _: Ordering) {
        self.poke(offset, &value.to_le_bytes());
    }

    fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.0.borrow()[offset..offset + dst.len()]);
    }

    fn write_bytes(&self, offset: usize, src: &[u8]) {
        self.poke(offset, src);
    }
}

#[derive(Default)]
struct CellWord(Cell<u64>);

impl Word for CellWord {
    fn load(&self, _: Ordering) -> u64 {
        self.0.get()
    }

    fn store(&self, value: u64, _: Ordering) {
        self.0.set(value);
    }
}

fn header(len: u32, tag: u64) -> RecordHeader {
    RecordHeader { kind: 1, flags: 2, len, word2: tag, word3: !tag }
}

fn push(producer: &mut Producer, ring: &HeapRing, head: &CellWord, len: u32, tag: u64) -> bool {
    producer
        .try_push(ring, head, header(len, tag), |offset| {
            let payload: Vec<u8> = (0..len).map(|i| (i as u64 + tag) as u8).collect();
            ring.write_bytes(offset, &payload);
        })
        .expect("push")
}

fn pop(consumer: &mut Consumer, ring: &HeapRing, head: &CellWord) -> Option<(RecordHeader, Vec<u8>)> {
    let record = consumer.peek(ring, head).expect("peek")?;
    let mut payload = vec![0u8; record.header.len as usize];
    ring.read_bytes(record.payload_offset, &mut payload);
    consumer.release(&record, head);
    Some((record.header, payload))
}

#[test]
fn records_round_trip_across_many_laps() {
    let ring = HeapRing::new(1024);
    let head = CellWord::default();
    let mut producer = Producer::new(1024, max_payload_for(1024)).expect("producer");
    let mut consumer = Consumer::new(1024, max_payload_for(1024)).expect("consumer");
    let sizes = [0u32, 1, 31, 32, 33, 100, 224, 7, 150, 64];
    for round in 0..40u64 {
        let len = sizes[round as usize % sizes.len()];
        assert!(push(&mut producer, &ring, &head, len, round), "round {round}: ring full");
        let (got, payload) = pop(&mut consumer, &ring, &head).expect("record");
        assert_eq!(got, header(len, round));
        assert!(payload.iter().enumerate().all(|(i, b)| *b == (i as u64 + round) as u8));
        assert!(pop(&mut consumer, &ring, &head).is_none(), "a record appeared twice");
    }
    assert!(producer.tail() > 4 * 1024, "did not wrap several times");
    assert_eq!(consumer.head(), producer.tail());
}

#[test]
fn a_full_ring_refuses_until_the_consumer_releases() {
    let ring = HeapRing::new(256);
    let head = CellWord::default();
    let mut producer = Producer::new(256, 32).expect("producer");
    let mut consumer = Consumer::new(256, 32).expect("consumer");
    // Three 64-byte records fill 256 bytes minus the spare line kept for the next stamp.
    for tag in 0..3 {
        assert!(push(&mut producer, &ring, &head, 32, tag));
    }
    assert!(!push(&mut producer, &ring, &head, 1, 9), "pushed into a full ring");
    assert_eq!(pop(&mut consumer, &ring, &head).expect("first").0.word2, 0);
    assert!(push(&mut producer, &ring, &head, 1, 3), "space released by the consumer not reused");
    for tag in 1..4 {
        assert_eq!(pop(&mut consumer, &ring, &head).expect("record").0.word2, tag);
    }
    assert!(pop(&mut consumer, &ring, &head).is_none());
}

#[test]
fn sizes_are_validated() {
    assert!(Producer::new(1000, 10).is_none(), "not a power of two");
    assert!(Producer::new(128, 10).is_none(), "too small");
    assert!(Producer::new(1024, max_payload_for(1024) + 1).is_none());
    assert!(Consumer::new(1024, max_payload_for(1024)).is_some());
    assert_eq!(record_size(0), 64);
    assert_eq!(record_size(32), 64);
    assert_eq!(record_size(33), 128);
}

/// Writes a record header with a valid stamp for `position` at its offset, as a peer could.
fn forge(ring: &HeapRing, capacity: u64, position: u64, kind: u8, len: u32) {
    let offset = (position % capacity) as usize;
    let forged = RecordHeader { kind, flags: 0, len, word2: 0, word3: 0 };
    ring.write_bytes(offset + 8, &forged.encode());
    ring.store_word(offset, stamp(position), Ordering::Release);
}

#[test]
fn garbage_records_are_refused() {
    let cases = [
        (1u8, u32::MAX, RingError::BadLength),
        (1, 97, RingError::BadLength),
        (KIND_SKIP, 0, RingError::BadSkip),
    ];
    for (kind, len, expected) in cases {
        let ring = HeapRing::new(512);
        let head = CellWord::default();
        let mut consumer = Consumer::new(512, 96).expect("consumer");
        forge(&ring, 512, 0, kind, len);
        assert_eq!(consumer.peek(&ring, &head), Err(expected), "kind {kind} len {len}");
    }
    // A record within the maximum that would run past the end of the ring.
    let ring = HeapRing::new(512);
    let head = CellWord::default();
    let mut consumer = Consumer { layout: LINES, capacity: 512, max_payload: 96, head: 448 };
    forge(&ring, 512, 448, 1, 96);
    assert_eq!(consumer.peek(&ring, &head), Err(RingError::BadLength));
}

#[test]
fn stale_and_random_memory_is_not_a_record() {
    let ring = HeapRing::new(256);
    let head = CellWord::default();
    let mut consumer = Consumer::new(256, 32).expect("consumer");
    ring.poke(0, &[0xA5; 256]);
    assert_eq!(consumer.peek(&ring, &head), Ok(None), "random bytes taken as a record");
    // A record stamped for the previous lap at this offset.
    forge(&ring, 256, 0, 1, 0);
    let mut ahead = Consumer { layout: LINES, capacity: 256, max_payload: 32, head: 256 };
    assert_eq!(ahead.peek(&ring, &head), Ok(None), "a stale record taken as new");
}

#[test]
fn impossible_consumer_positions_are_refused() {
    for bad_head in [64 * 1000, 3, u64::MAX] {
        let ring = HeapRing::new(256);
        let head = CellWord::default();
        let mut producer = Producer::new(256, 32).expect("producer");
        for tag in 0..3 {
            assert!(push(&mut producer, &ring, &head, 32, tag));
        }
        head.store(bad_head, Ordering::Release);
        let result = producer.try_push(&ring, &head, header(32, 4), |_| {});
        assert_eq!(result, Err(RingError::BadHead), "head {bad_head}");
    }
    // A position that goes backwards is refused too.
    let ring = HeapRing::new(256);
    let head = CellWord::default();
    let mut producer = Producer::new(256, 32).expect("producer");
    let mut consumer = Consumer::new(256, 32).expect("consumer");
    for tag in 0..3 {
        assert!(push(&mut producer, &ring, &head, 32, tag));
    }
    pop(&mut consumer, &ring, &head).expect("record");
    assert!(push(&mut producer, &ring, &head, 32, 3));
    head.store(0, Ordering::Release);
    assert_eq!(producer.try_push(&ring, &head, header(32, 5), |_| {}), Err(RingError::BadHead));
}

/// Records read as soon as they are written (a request and its answer at a time) keep to the
/// ring's first page: before a record would reach a page not yet written in this lap, the
/// producer finds the ring empty and restarts the lap. A consumer that lags keeps the producer
/// on its lap, as before.
#[test]
fn a_ring_read_as_it_is_written_keeps_to_its_first_page() {
    let capacity = 64 << 10;
    let ring = HeapRing::new(capacity);
    let head = CellWord::default();
    let mut producer = Producer::new(capacity, max_payload_for(capacity)).expect("producer");
    let mut consumer = Consumer::new(capacity, max_payload_for(capacity)).expect("consumer");
    let mut furthest = 0;
    for tag in 0..5_000u64 {
        let len = (tag % 200) as u32;
        assert!(push(&mut producer, &ring, &head, len, tag));
        // Where the record ended (a record that ends the lap ends at the capacity).
        let end = (producer.tail() - 1) % capacity as u64 + 1;
        furthest = furthest.max(end as usize);
        let (got, payload) = pop(&mut consumer, &ring, &head).expect("the record just written");
        assert_eq!(got, header(len, tag));
        assert_eq!(payload.len(), len as usize);
    }
    assert!(furthest <= PAGE, "records reached offset {furthest} of the ring");
    assert!(producer.tail() > 10 * capacity as u64, "the producer restarted its laps");
    // With a record always unread the producer goes on through the lap.
    assert!(push(&mut producer, &ring, &head, 100, 0));
    let mut furthest = 0;
    for tag in 1..=200u64 {
        assert!(push(&mut producer, &ring, &head, 100, tag));
        furthest = furthest.max((producer.tail() - 1) % capacity as u64 + 1);
        let (got, _) = pop(&mut consumer, &ring, &head).expect("a record");
        assert_eq!(got, header(100, tag - 1));
    }
    assert!(furthest > 8 * PAGE as u64, "with a record unread the lap went only to {furthest}");
}

fn packed_header(len: u32) -> RecordHeader {
    RecordHeader { kind: 1, flags: 2, len, word2: 0, word3: 0 }
}

/// A packed ring carries the kind, flags, length and payload across many laps (with skips of
/// every size down to one 16-byte slot at the end of a lap), 16 bytes per record of up to 0
/// bytes and 32 per record of 8.
#[test]
fn packed_records_round_trip_across_many_laps_with_every_skip_size() {
    assert_eq!(PACKED.record_size(0), 16);
    assert_eq!(PACKED.record_size(8), 32);
    assert_eq!(PACKED.record_size(17), 48);
    assert_eq!(PACKED.max_payload_for(1024), 240);
    let capacity = 1024;
    let ring = HeapRing::new(capacity);
    let head = CellWord::default();
    let max = PACKED.max_payload_for(capacity);
    let mut producer = Producer::with_layout(PACKED, capacity, max).expect("producer");
    let mut consumer = Consumer::with_layout(PACKED, capacity, max).expect("consumer");
    let mut pads = std::collections::BTreeSet::new();
    for round in 0..2_000u64 {
        // Lengths that leave every multiple of 16 at the end of some lap.
        let len = ((round * 37) % u64::from(max + 1)) as u32;
        let before = producer.tail();
        let pushed = producer
            .try_push(&ring, &head, packed_header(len), |offset| {
                let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ round) as u8).collect();
                ring.write_bytes(offset, &payload);
            })
            .expect("push");
        assert!(pushed, "round {round}: an empty ring refused a record");
        let size = PACKED.record_size(len);
        if producer.tail() - before != size {
            pads.insert(producer.tail() - before - size);
        }
        let record = consumer.peek(&ring, &head).expect("peek").expect("the record just written");
        assert_eq!(record.header, packed_header(len), "round {round}");
        let mut payload = vec![0u8; len as usize];
        ring.read_bytes(record.payload_offset, &mut payload);
        assert!(payload.iter().enumerate().all(|(i, b)| *b == (i as u64 ^ round) as u8), "round {round}");
        consumer.release(&record, &head);
        assert!(consumer.peek(&ring, &head).expect("peek").is_none(), "a record appeared twice");
    }
    assert!(pads.contains(&16), "no lap ended with a one-slot skip ({pads:?})");
    assert_eq!(consumer.head(), producer.tail());
}

/// Small packed records share lines: a 1 KiB ring holds 31 records of 8 bytes (a lines ring
/// 15), and a packed ring refuses header words it cannot carry.
#[test]
fn a_packed_ring_holds_twice_the_small_records_and_no_header_words() {
    let capacity = 1024;
    let fill = |layout: Layout| {
        let ring = HeapRing::new(capacity);
        let head = CellWord::default();
        let mut producer =
            Producer::with_layout(layout, capacity, layout.max_payload_for(capacity)).expect("producer");
        let mut n = 0;
        while producer
            .try_push(&ring, &head, packed_header(8), |offset| ring.write_bytes(offset, &[7; 8]))
            .expect("push")
        {
            n += 1;
        }
        n
    };
    assert_eq!(fill(PACKED), 31);
    assert_eq!(fill(LINES), 15);
    let refused = std::panic::catch_unwind(|| {
        let ring = HeapRing::new(capacity);
        let head = CellWord::default();
        let mut producer = Producer::with_layout(PACKED, capacity, 64).expect("producer");
        let _ = producer.try_push(&ring, &head, header(8, 1), |_| {});
    });
    assert!(refused.is_err(), "a packed ring took word2 and word3 and would drop them");
}

/// A consumer that publishes its position only now and then ([`Consumer::consume`]) hands
/// the space back when it does, and not before.
#[test]
fn consumed_space_goes_back_when_published() {
    let ring = HeapRing::new(256);
    let head = CellWord::default();
    let mut producer = Producer::with_layout(PACKED, 256, 32).expect("producer");
    let mut consumer = Consumer::with_layout(PACKED, 256, 32).expect("consumer");
    let push = |producer: &mut Producer| {
        producer
            .try_push(&ring, &head, packed_header(32), |offset| ring.write_bytes(offset, &[1; 32]))
            .expect("push")
    };
    // Five 48-byte records fill 256 bytes less the slot kept for the next stamp.
    for _ in 0..5 {
        assert!(push(&mut producer));
    }
    assert!(!push(&mut producer));
    while let Some(record) = consumer.peek(&ring, &head).expect("peek") {
        consumer.consume(&record);
    }
    assert_eq!(consumer.head(), producer.tail());
    assert!(!push(&mut producer), "space came back before it was published");
    consumer.publish(&head);
    assert!(push(&mut producer), "published space not reused");
}
