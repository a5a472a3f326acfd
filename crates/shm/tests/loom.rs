//! Model check of the ring's and the activity area's memory ordering with `loom`: every
//! interleaving (up to a preemption bound) of producer and consumer threads running the
//! crate's own [`Producer`], [`Consumer`] and activity protocol (`mark`, `take`, `announce`,
//! and the waiting bits: `arm_waiter`, `take_waiter`)
//! over rings whose bytes are `loom` cells. A payload or header read that is not ordered after
//! the write it observes is reported by loom as a data race; a record delivered twice, lost,
//! reordered or torn fails the assertions; a lost wake-up shows as a deadlock (the consumer
//! blocked forever).
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p lightpath-shm --release --test loom`.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use lightpath_shm::activity::{self, announce, state_value, take, AtomicWord};
use lightpath_shm::ring::{self, Consumer, Layout, Producer, RecordHeader, RingMemory, Word, LINES, PACKED};
use std::sync::atomic::Ordering;

/// A ring of `capacity` bytes: one atomic stamp per `slot` bytes (where records may start: a
/// line for [`LINES`], 16 bytes for [`PACKED`]), every other byte a checked cell.
struct ModelRing {
    slot: usize,
    stamps: Vec<AtomicU64>,
    bytes: Vec<UnsafeCell<u8>>,
}

impl ModelRing {
    fn new(capacity: usize, slot: usize) -> Self {
        Self {
            slot,
            stamps: (0..capacity / slot).map(|_| AtomicU64::new(0)).collect(),
            bytes: (0..capacity).map(|_| UnsafeCell::new(0)).collect(),
        }
    }

    fn stamp(&self, offset: usize) -> &AtomicU64 {
        assert_eq!(offset % self.slot, 0, "stamps live where records may start");
        &self.stamps[offset / self.slot]
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

impl AtomicWord for ModelWord {
    fn fetch_or(&self, bits: u64, order: Ordering) -> u64 {
        self.0.fetch_or(bits, order)
    }

    fn swap(&self, value: u64, order: Ordering) -> u64 {
        self.0.swap(value, order)
    }

    fn fetch_and(&self, bits: u64, order: Ordering) -> u64 {
        self.0.fetch_and(bits, order)
    }
}

/// What one producer and the consumer share: the ring and the consumer's position in it.
struct Shared {
    layout: Layout,
    ring: ModelRing,
    head: ModelWord,
}

impl Shared {
    fn new(capacity: usize) -> Arc<Self> {
        Self::with_layout(LINES, capacity)
    }

    fn with_layout(layout: Layout, capacity: usize) -> Arc<Self> {
        let slot = if layout == PACKED { 16 } else { ring::ALIGN };
        Arc::new(Self { layout, ring: ModelRing::new(capacity, slot), head: ModelWord(AtomicU64::new(0)) })
    }
}

fn word() -> ModelWord {
    ModelWord(AtomicU64::new(0))
}

fn header(layout: Layout, len: u32, tag: u64) -> RecordHeader {
    if layout == PACKED {
        // A packed record carries no header words: the tag goes in the flags.
        RecordHeader { kind: 1, flags: tag as u8, len, word2: 0, word3: 0 }
    } else {
        RecordHeader { kind: 1, flags: 0, len, word2: tag, word3: !tag }
    }
}

fn payload(len: u32, tag: u64) -> Vec<u8> {
    (0..len).map(|i| (tag as u8).wrapping_mul(31).wrapping_add(i as u8)).collect()
}

/// Producer: pushes `sizes` in order, calling `published` after each record; when the ring is
/// full it yields (as the provider's sender waits to be told of freed space).
fn produce(shared: &Shared, capacity: usize, max: u32, sizes: &[u32], published: impl Fn()) {
    let mut producer = Producer::with_layout(shared.layout, capacity, max).expect("producer");
    for (tag, &len) in sizes.iter().enumerate() {
        let tag = tag as u64;
        loop {
            let pushed = producer
                .try_push(&shared.ring, &shared.head, header(shared.layout, len, tag), |offset| {
                    shared.ring.write_bytes(offset, &payload(len, tag));
                })
                .expect("the consumer never reports an impossible position");
            if pushed {
                break;
            }
            thread::yield_now();
        }
        published();
    }
}

/// Consumer: takes the records of `sizes` in order, checking each, yielding while the ring
/// is empty.
fn consume(shared: &Shared, capacity: usize, max: u32, sizes: &[u32]) {
    let mut reader = Reader::with_layout(shared.layout, capacity, max, sizes);
    while !reader.done() {
        if !reader.read(shared) {
            thread::yield_now();
        }
    }
    assert!(!reader.read(shared), "an extra record appeared");
}

/// The consumer of one ring: reads the records it expects, in order, checking each.
struct Reader<'s> {
    consumer: Consumer,
    /// Publishes its position only when it finds the ring empty, as a pipe's receiver does
    /// (packed rings).
    lazy: bool,
    sizes: &'s [u32],
    next: usize,
}

impl<'s> Reader<'s> {
    fn new(capacity: usize, max: u32, sizes: &'s [u32]) -> Self {
        Self::with_layout(LINES, capacity, max, sizes)
    }

    fn with_layout(layout: Layout, capacity: usize, max: u32, sizes: &'s [u32]) -> Self {
        let consumer = Consumer::with_layout(layout, capacity, max).expect("consumer");
        Self { consumer, lazy: layout == PACKED, sizes, next: 0 }
    }

    fn done(&self) -> bool {
        self.next == self.sizes.len()
    }

    /// Reads every record present; returns whether there was one.
    fn read(&mut self, shared: &Shared) -> bool {
        let mut any = false;
        while let Some(record) = self.consumer.peek(&shared.ring, &shared.head).expect("valid records") {
            let tag = self.next as u64;
            let len = *self.sizes.get(self.next).expect("an extra record appeared");
            assert_eq!(record.header, header(shared.layout, len, tag), "record {tag}");
            let mut got = vec![0u8; len as usize];
            shared.ring.read_bytes(record.payload_offset, &mut got);
            assert_eq!(got, payload(len, tag), "payload of record {tag}");
            if self.lazy {
                self.consumer.consume(&record);
            } else {
                self.consumer.release(&record, &shared.head);
            }
            self.next += 1;
            any = true;
        }
        if self.lazy {
            self.consumer.publish(&shared.head);
        }
        any
    }
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
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes, || {}))
        };
        consume(&shared, CAPACITY, max, &sizes);
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
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes, || {}))
        };
        consume(&shared, CAPACITY, max, &sizes);
        producer.join().unwrap();
    });
}

/// A packed ring (records 16 bytes apart, as pipes use) whose consumer publishes its position
/// only when it finds the ring empty: the ring fills and wraps with a skip of one slot, and
/// every record arrives whole and in order.
#[test]
fn packed_records_with_late_published_positions_arrive_whole_and_in_order() {
    const CAPACITY: usize = 256;
    model(2, || {
        let max = PACKED.max_payload_for(CAPACITY);
        // Records of 64 + 64 + 64 + 48 bytes fill the lap to offset 240; the last (32 bytes)
        // takes a 16-byte skip to the start and room the consumer has given back.
        let sizes = [48u32, 48, 48, 20, 8];
        let shared = Shared::with_layout(PACKED, CAPACITY);
        let producer = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes, || {}))
        };
        consume(&shared, CAPACITY, max, &sizes);
        producer.join().unwrap();
    });
}

/// Records of about a quarter page through a two-page ring: before the fourth record, which
/// reaches the second page, the producer looks at the consumer's position and, if the consumer
/// has read everything, restarts the lap with a skip; either way every record arrives whole
/// and in order.
#[test]
fn restarts_at_a_page_boundary_when_the_consumer_has_caught_up() {
    const CAPACITY: usize = 2 * ring::PAGE;
    model(1, || {
        let max = ring::max_payload_for(CAPACITY);
        let sizes = [1000u32; 5];
        let shared = Shared::new(CAPACITY);
        let producer = {
            let shared = Arc::clone(&shared);
            thread::spawn(move || produce(&shared, CAPACITY, max, &sizes, || {}))
        };
        consume(&shared, CAPACITY, max, &sizes);
        producer.join().unwrap();
    });
}

/// A device (the consumer) with two queue pairs, each fed by its own producer through its own
/// ring, and the activity area between them: the state word, the rung word, one word of marks,
/// and a doorbell modelled as a counter under a mutex.
struct Device {
    rings: [Arc<Shared>; 2],
    state: ModelWord,
    rung: ModelWord,
    bits: ModelWord,
    doorbell: Mutex<u64>,
    rang: Condvar,
}

impl Device {
    fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            rings: [Shared::new(capacity), Shared::new(capacity)],
            state: word(),
            rung: word(),
            bits: word(),
            doorbell: Mutex::new(0),
            rang: Condvar::new(),
        })
    }

    /// A producer's signal after publishing for queue pair `slot`.
    fn signal(&self, slot: u32) {
        if activity::signal(&self.bits, slot, &self.state, &self.rung) {
            *self.doorbell.lock().unwrap() += 1;
            self.rang.notify_all();
        }
    }

    fn wait_doorbell(&self) {
        let mut count = self.doorbell.lock().unwrap();
        while *count == 0 {
            count = self.rang.wait(count).unwrap();
        }
        *count = 0;
    }
}

/// How the consumer finds news.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// From the marks only.
    Marks,
    /// By looking at both rings on every call.
    Everywhere,
    /// Everywhere until the first record, then from the marks (a device that got more queue
    /// pairs), looking everywhere once after announcing the switch.
    Switching,
}

/// The consumer: finds news as `mode` says and sleeps on the doorbell whenever there is none,
/// as `DeviceCore` and its sleepers do.
fn consume_device(device: &Device, capacity: usize, max: u32, sizes: [&[u32]; 2], mode: Mode) {
    let mut readers = [Reader::new(capacity, max, sizes[0]), Reader::new(capacity, max, sizes[1])];
    let mut everywhere = mode != Mode::Marks;
    let mut epoch = 0;
    announce(&device.state, state_value(epoch, false, everywhere));
    // One call: take the marks, then read the rings marked (or all of them).
    let call = |readers: &mut [Reader<'_>; 2], everywhere: bool| {
        let bits = take(&device.bits);
        let mut any = false;
        for (slot, reader) in readers.iter_mut().enumerate() {
            if everywhere || bits & 1 << slot != 0 {
                any |= reader.read(&device.rings[slot]);
            }
        }
        any
    };
    while !readers.iter().all(Reader::done) {
        if call(&mut readers, everywhere) {
            if mode == Mode::Switching && everywhere {
                everywhere = false;
                announce(&device.state, state_value(epoch, false, false));
                call(&mut readers, true);
            }
            continue;
        }
        epoch += 1;
        announce(&device.state, state_value(epoch, true, everywhere));
        if !call(&mut readers, everywhere) {
            device.wait_doorbell();
        }
        announce(&device.state, state_value(epoch, false, everywhere));
    }
}

fn sleeping_consumer(mode: Mode) {
    const CAPACITY: usize = 256;
    model(2, move || {
        let max = ring::max_payload_for(CAPACITY);
        let sizes: [&'static [u32]; 2] = [&[8, 16], &[0]];
        let device = Device::new(CAPACITY);
        let producers: Vec<_> = (0..2)
            .map(|slot| {
                let device = Arc::clone(&device);
                thread::spawn(move || {
                    let shared = Arc::clone(&device.rings[slot]);
                    produce(&shared, CAPACITY, max, sizes[slot], || device.signal(slot as u32));
                })
            })
            .collect();
        consume_device(&device, CAPACITY, max, sizes, mode);
        for producer in producers {
            producer.join().unwrap();
        }
    });
}

/// With the fences of `announce` and `signal`, no interleaving leaves a consumer that relies
/// on marks asleep with a record waiting (loom reports a deadlock if one does), and the rung
/// word never keeps a second producer's news from it.
#[test]
fn a_sleeping_consumer_relying_on_marks_is_always_woken() {
    sleeping_consumer(Mode::Marks);
}

/// Producers do not mark a consumer that looks everywhere while it is awake; it is still
/// always woken once it sleeps.
#[test]
fn a_sleeping_consumer_looking_everywhere_is_always_woken() {
    sleeping_consumer(Mode::Everywhere);
}

/// A consumer that stops looking everywhere misses nothing a producer left unmarked.
#[test]
fn switching_from_looking_everywhere_to_marks_loses_nothing() {
    sleeping_consumer(Mode::Switching);
}

/// Two queue pairs of one device, each fed by its own producer, each waited for by a thread of
/// its own on the queue pair's own doorbell (the waiting bits of the activity area): a waiter
/// arms its bit, looks (skipping the engine when nothing is marked, as `arm_waiter` does), and
/// sleeps; a producer takes the bit after publishing; the engine, run by either waiter, takes
/// the marks, reads the rings marked and, for records it delivers to the *other* queue pair,
/// fences and takes that queue pair's bit (`tell_waiter`).
struct Waited {
    rings: [Arc<Shared>; 2],
    state: ModelWord,
    rung: ModelWord,
    bits: ModelWord,
    waiting: ModelWord,
    /// The engine: each queue pair's reader.
    engine: Mutex<[Reader<'static>; 2]>,
    /// Records delivered to each queue pair (its completion queue's length, which a poll
    /// reads without a lock).
    delivered: [AtomicU64; 2],
    /// Each queue pair's own doorbell.
    doorbells: [Mutex<u64>; 2],
    rang: [Condvar; 2],
}

const WAITED_SIZES: [&[u32]; 2] = [&[8], &[16]];

impl Waited {
    fn new(capacity: usize) -> Arc<Self> {
        let max = ring::max_payload_for(capacity);
        Arc::new(Self {
            rings: [Shared::new(capacity), Shared::new(capacity)],
            state: word(),
            rung: word(),
            bits: word(),
            waiting: word(),
            engine: Mutex::new([
                Reader::new(capacity, max, WAITED_SIZES[0]),
                Reader::new(capacity, max, WAITED_SIZES[1]),
            ]),
            delivered: [AtomicU64::new(0), AtomicU64::new(0)],
            doorbells: [Mutex::new(0), Mutex::new(0)],
            rang: [Condvar::new(), Condvar::new()],
        })
    }

    fn ring(&self, slot: usize) {
        *self.doorbells[slot].lock().unwrap() += 1;
        self.rang[slot].notify_all();
    }

    /// A producer's signal after publishing a record for `slot`.
    fn signal(&self, slot: u32) {
        // As `PeerSide::signal`: mark, hand the news to a waiter if one is armed, and only
        // otherwise ask whether the device must be rung (it never sleeps here: only the queue
        // pairs' own doorbells matter).
        let _ = activity::mark(&self.bits, slot, &self.state);
        if activity::take_waiter(&self.waiting, slot, true) {
            self.ring(slot as usize);
        } else {
            let _ = activity::ring_needed(&self.state, &self.rung);
        }
    }

    /// One look by the waiter of `me`, under the engine lock: take the marks, read the rings
    /// marked, and ring the other queue pair's waiter for what it got.
    fn progress(&self, me: usize) {
        let mut readers = self.engine.lock().unwrap();
        let marks = take(&self.bits);
        for slot in 0..2 {
            if marks & 1 << slot == 0 {
                continue;
            }
            if readers[slot].read(&self.rings[slot]) {
                self.delivered[slot].store(readers[slot].next as u64, Ordering::Release);
                if slot != me {
                    loom::sync::atomic::fence(Ordering::SeqCst);
                    if activity::take_waiter(&self.waiting, slot as u32, true) {
                        self.ring(slot);
                    }
                }
            }
        }
    }

    fn delivered(&self, slot: usize) -> usize {
        self.delivered[slot].load(Ordering::Acquire) as usize
    }

    /// The waiter of `slot`: until its records are delivered, arm, look, sleep.
    fn wait_for_all(&self, slot: usize) {
        let want = WAITED_SIZES[slot].len();
        while self.delivered(slot) < want {
            activity::arm_waiter(&self.waiting, slot as u32, activity::Wake::Arrivals);
            // As `arm_waiter`: the engine only if something is marked.
            if self.bits.load(Ordering::Relaxed) != 0 {
                self.progress(slot);
            }
            if self.delivered(slot) >= want {
                break;
            }
            let mut count = self.doorbells[slot].lock().unwrap();
            while *count == 0 {
                count = self.rang[slot].wait(count).unwrap();
            }
            *count = 0;
            drop(count);
            self.progress(slot);
        }
    }
}

/// With the fences of `arm_waiter`, `signal` and the engine's ring for the other queue pair,
/// no interleaving leaves a waiter asleep with its record delivered or waiting in its ring,
/// whichever of the two waiters' looks finds it (loom reports a deadlock if one does; removing
/// the fence of `arm_waiter`, or the engine's before it takes the other waiter's bit, makes it
/// report one).
#[test]
fn a_waiter_on_its_own_doorbell_is_always_woken() {
    const CAPACITY: usize = 256;
    model(2, || {
        let max = ring::max_payload_for(CAPACITY);
        let device = Waited::new(CAPACITY);
        let producers: Vec<_> = (0..2)
            .map(|slot| {
                let device = Arc::clone(&device);
                thread::spawn(move || {
                    let shared = Arc::clone(&device.rings[slot]);
                    produce(&shared, CAPACITY, max, WAITED_SIZES[slot], || device.signal(slot as u32));
                })
            })
            .collect();
        let other = {
            let device = Arc::clone(&device);
            thread::spawn(move || device.wait_for_all(1))
        };
        device.wait_for_all(0);
        other.join().unwrap();
        for producer in producers {
            producer.join().unwrap();
        }
    });
}

/// Task wake-ups (`activity::mark_task`, `task_ring_needed`, `rearm_task_ring`): producers
/// publish news for their queue pair, set its task bit and ring the task doorbell only when
/// no ring is pending; the dispatcher sleeps on the doorbell, clears the pending ring, takes
/// the bits and reads the news of each slot named. No interleaving leaves news unseen with
/// the dispatcher asleep (loom reports a deadlock), and a bit taken always shows its news.
#[test]
fn task_bits_are_dispatched_and_no_ring_is_lost() {
    model(3, || {
        let device = Device::new(64);
        let news = Arc::new([word(), word()]);
        let producers: Vec<_> = (0..2u32)
            .map(|slot| {
                let (device, news) = (Arc::clone(&device), Arc::clone(&news));
                thread::spawn(move || {
                    news[slot as usize].store(1, Ordering::Release);
                    activity::mark_task(&device.bits, slot);
                    if activity::task_ring_needed(&device.rung) {
                        *device.doorbell.lock().unwrap() += 1;
                        device.rang.notify_all();
                    }
                })
            })
            .collect();
        let mut seen = [false; 2];
        while !seen.iter().all(|s| *s) {
            device.wait_doorbell();
            activity::rearm_task_ring(&device.rung);
            let bits = take(&device.bits);
            for slot in 0..2 {
                if bits & 1 << slot != 0 {
                    assert_eq!(news[slot].load(Ordering::Acquire), 1, "a task bit without its news");
                    seen[slot] = true;
                }
            }
        }
        for producer in producers {
            producer.join().unwrap();
        }
    });
}
