//! Model check of the ring's memory ordering with `loom`: every interleaving (up to a
//! preemption bound) of one producer and one consumer thread running the crate's own
//! [`Producer`] and [`Consumer`] over a ring whose bytes are `loom` cells. A payload or header
//! read that is not ordered after the write it observes is reported by loom as a data race; a
//! record delivered twice, lost, reordered or torn fails the assertions; a lost wake-up shows
//! as a deadlock (the consumer blocked forever).
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p lightpath-shm --release --test loom`.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use lightpath_shm::ring::{
    self, announce_awake, announce_sleep, sleeping_value, wake_needed, Consumer, Producer, RecordHeader,
    RingMemory, Word,
};
use std::sync::atomic::Ordering;

/// A ring of `capacity` bytes: one atomic stamp per 64-byte line (records start on lines),
/// every other byte a checked cell.
struct ModelRing {
    stamps: Vec<AtomicU64>,
    bytes: Vec<UnsafeCell<u8>>,
}

impl ModelRing {
    fn new(capacity: usize) -> Self {
        Self {
            stamps: (0..capacity / ring::ALIGN).map(|_| AtomicU64::new(0)).collect(),
            bytes: (0..capacity).map(|_| UnsafeCell::new(0)).collect(),
        }
    }

    fn stamp(&self, offset: usize) -> &AtomicU64 {
        assert_eq!(offset % ring::ALIGN, 0, "stamps live at the start of a line");
        &self.stamps[offset / ring::ALIGN]
    }
}

impl RingMemory for ModelRing {
    fn load_word(&self, offset: usize, order: Ordering) -> u64 {
        self.stamp(offset).load(order)
    }

    fn store_word(&self, offset: usize, value: u64, order: Ordering) {
        self.stamp(offset).store(value, order);
    }

    fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        for (i, out) in dst.iter_mut().enumerate() {
            // SAFETY: loom's cell checks the access; the model only reads inside the ring.
            *out = self.bytes[offset + i].with(|p| unsafe { *p });
        }
    }

    fn write_bytes(&self, offset: usize, src: &[u8]) {
        for (i, byte) in src.iter().enumerate() {
            // SAFETY: loom's cell checks the access; the model only writes inside the ring.
            self.bytes[offset + i].with_mut(|p| unsafe { *p = *byte });
        }
    }
}

struct ModelWord(AtomicU64);

impl Word for ModelWord {
    fn load(&self, order: Ordering) -> u64 {
        self.0.load(order)
    }

    fn store(&self, value: u64, order: Ordering) {
        self.0.store(value, order);
    }
}

/// What both threads share: the ring, the consumer's position and wake word, and an eventfd
/// modelled as a counter under a mutex.
struct Shared {
    ring: ModelRing,
    head: ModelWord,
    wake: ModelWord,
    doorbell: Mutex<u64>,
    rung: Condvar,
}

impl Shared {
    fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            ring: ModelRing::new(capacity),
            head: ModelWord(AtomicU64::new(0)),
            wake: ModelWord(AtomicU64::new(0)),
            doorbell: Mutex::new(0),
            rung: Condvar::new(),
        })
    }

    fn ring_doorbell(&self) {
        *self.doorbell.lock().unwrap() += 1;
        self.rung.notify_all();
    }

    fn wait_doorbell(&self) {
        let mut count = self.doorbell.lock().unwrap();
        while *count == 0 {
            count = self.rung.wait(count).unwrap();
        }
        *count = 0;
    }
}

fn header(len: u32, tag: u64) -> RecordHeader {
    RecordHeader { kind: 1, flags: 0, len, word2: tag, word3: !tag }
}

fn payload(len: u32, tag: u64) -> Vec<u8> {
    (0..len).map(|i| (tag as u8).wrapping_mul(31).wrapping_add(i as u8)).collect()
}

/// Producer: pushes `sizes` in order; when the ring is full it sleeps on the consumer's head
/// the same way (here by yielding, as the provider's sender would be woken by a ring).
fn produce(shared: &Shared, capacity: usize, max: u32, sizes: &[u32]) {
    let mut producer = Producer::new(capacity, max).expect("producer");
    let mut last_rung = 0;
    for (tag, &len) in sizes.iter().enumerate() {
        let tag = tag as u64;
        loop {
            let pushed = producer
                .try_push(&shared.ring, &shared.head, header(len, tag), |offset| {
                    shared.ring.write_bytes(offset, &payload(len, tag));
                })
                .expect("the consumer never reports an impossible position");
            if pushed {
                break;
            }
            thread::yield_now();
        }
        if wake_needed(&shared.wake, &mut last_rung) {
            shared.ring_doorbell();
        }
    }
}

/// Consumer: takes `count` records, checking each; when the ring is empty it either spins
/// (yield) or, if `sleep`, announces a sleep, looks again and blocks on the doorbell.
fn consume(shared: &Shared, capacity: usize, max: u32, sizes: &[u32], sleep: bool) {
    let mut consumer = Consumer::new(capacity, max).expect("consumer");
    let mut epoch = 0;
    for (tag, &len) in sizes.iter().enumerate() {
        let tag = tag as u64;
        let record = loop {
            if let Some(record) = consumer.peek(&shared.ring, &shared.head).expect("valid records") {
                break record;
            }
            if !sleep {
                thread::yield_now();
                continue;
            }
            epoch += 1;
            announce_sleep(&shared.wake, sleeping_value(epoch));
            if let Some(record) = consumer.peek(&shared.ring, &shared.head).expect("valid records") {
                announce_awake(&shared.wake);
                break record;
            }
            shared.wait_doorbell();
            announce_awake(&shared.wake);
        };
        assert_eq!(record.header, header(len, tag), "record {tag}");
        let mut got = vec![0u8; len as usize];
        shared.ring.read_bytes(record.payload_offset, &mut got);
        assert_eq!(got, payload(len, tag), "payload of record {tag}");
        consumer.release(&record, &shared.head);
    }
    assert!(consumer.peek(&shared.ring, &shared.head).expect("valid").is_none(), "an extra record appeared");
}

fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(f);
}

/// Records of mixed sizes through a 256-byte ring (room for three 64-byte records): the ring
/// fills, wraps with skip records, and the producer waits for space.
#[test]
fn records_arrive_whole_and_in_order_through_wraps_and_full_rings() {
    const CAPACITY: usize = 256;
    model(2, || {
        let max = ring::max_payload_for(CAPACITY);
        let sizes = [32u32, 0, 32, 8, 32];
        let shared = Shared::new(CAPACITY);
        let producer = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes))
        };
        consume(&shared, CAPACITY, max, &sizes, false);
        producer.join().unwrap();
    });
}

/// Records larger than a line (several lines of payload) and a wrap in a 512-byte ring.
#[test]
fn multi_line_records_and_skips() {
    const CAPACITY: usize = 512;
    model(2, || {
        let max = ring::max_payload_for(CAPACITY);
        let sizes = [96u32, 40, 96];
        let shared = Shared::new(CAPACITY);
        let producer = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes))
        };
        consume(&shared, CAPACITY, max, &sizes, false);
        producer.join().unwrap();
    });
}

/// The consumer sleeps on the doorbell whenever the ring is empty: with the fences of
/// `announce_sleep` and `wake_needed`, no interleaving leaves it asleep with a record waiting
/// (loom reports a deadlock if one does).
#[test]
fn a_sleeping_consumer_is_always_woken() {
    const CAPACITY: usize = 256;
    model(3, || {
        let max = ring::max_payload_for(CAPACITY);
        let sizes = [8u32, 16, 0];
        let shared = Shared::new(CAPACITY);
        let producer = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes))
        };
        consume(&shared, CAPACITY, max, &sizes, true);
        producer.join().unwrap();
    });
}
