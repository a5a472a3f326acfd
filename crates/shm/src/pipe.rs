//! Pipes: one-way message channels between two processes of one host, in shared memory, with
//! no verbs objects, no device and no system call per message.
//!
//! # Why
//!
//! A stream over the shm provider moves a small message through a ring record, a completion, a
//! receive credit and the device lock: about 0.75 µs one way on this project's machines, where
//! a store into memory the peer polls takes a fraction of that. Latency-bound users that poll
//! anyway (the collectives' driver, for messages of a few KiB) use a pipe beside their stream.
//!
//! # How
//!
//! The sender makes a memfd (sealed against shrinking and growing) holding a 64-byte line for
//! the receiver's position and a [`ring`](crate::ring) of records, and tells the receiver where
//! it is as text, `pid:fd` ([`PipeSender::address`]), over any channel; the receiver opens
//! `/proc/<pid>/fd/<fd>` (the kernel checks that it may: same user, or root), checks the file
//! as it checks every memfd a peer hands over, and maps it. Nothing is left in a file system:
//! the memory goes when both processes have dropped their ends (or died).
//!
//! A message is one record ([`PipeSender::try_send`] copies it in, `false` when the ring is
//! full for now); [`PipeReceiver::try_recv`] copies the next one out. There is no wake-up: the
//! receiver polls, and a caller that sleeps must wake itself now and then. Everything read from
//! the shared memory is validated (the ring's own checks); a peer that writes garbage makes
//! the receiver's calls fail with [`PipeError`], never read out of bounds.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use crate::ring::{self, Consumer, Producer, RecordHeader, RingError, RingMemory, Word};
use crate::sys::{Mapping, Memfd};

/// Where the ring starts in the file (the receiver's position has the first line).
const RING_OFFSET: usize = 64;
/// The record kind of a message.
const KIND_MESSAGE: u8 = 1;

/// What went wrong with a pipe.
#[derive(Debug)]
#[non_exhaustive]
pub enum PipeError {
    /// The peer broke the ring's protocol (a corrupt or hostile peer).
    Ring(RingError),
    /// A message longer than the pipe carries ([`PipeSender::max_message`]) or than the
    /// buffer given to receive it.
    TooLong {
        /// The message's length.
        len: usize,
        /// What fits.
        max: usize,
    },
}

impl std::fmt::Display for PipeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PipeError::Ring(e) => write!(f, "pipe: {e}"),
            PipeError::TooLong { len, max } => write!(f, "pipe: a {len}-byte message, at most {max} fit"),
        }
    }
}

impl std::error::Error for PipeError {}

impl From<RingError> for PipeError {
    fn from(e: RingError) -> Self {
        PipeError::Ring(e)
    }
}

/// The ring part of a pipe's mapping.
struct PipeRing<'a>(&'a Mapping);

// Ring offsets stay below the capacity, which the mapping was checked to hold; should a
// bounds check fail anyway, the access is skipped (a load reads 0, never a valid stamp).
impl RingMemory for PipeRing<'_> {
    fn load_word(&self, offset: usize, order: Ordering) -> u64 {
        self.0.load_u64(RING_OFFSET + offset, order).unwrap_or(0)
    }

    fn store_word(&self, offset: usize, value: u64, order: Ordering) {
        let _ = self.0.store_u64(RING_OFFSET + offset, value, order);
    }

    fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        if !self.0.read(RING_OFFSET + offset, dst) {
            dst.fill(0);
        }
    }

    fn write_bytes(&self, offset: usize, src: &[u8]) {
        let _ = self.0.write(RING_OFFSET + offset, src);
    }
}

/// The receiver's position, the pipe's first word.
struct HeadWord<'a>(&'a Mapping);

impl Word for HeadWord<'_> {
    fn load(&self, order: Ordering) -> u64 {
        self.0.load_u64(0, order).unwrap_or(0)
    }

    fn store(&self, value: u64, order: Ordering) {
        let _ = self.0.store_u64(0, value, order);
    }
}

/// The sending end of a pipe (see the [module](self) docs).
#[derive(Debug)]
pub struct PipeSender {
    memfd: Memfd,
    map: Mapping,
    producer: Producer,
    capacity: usize,
}

impl PipeSender {
    /// A pipe whose ring holds `capacity` bytes of records (a power of two, 256 bytes to
    /// 64 MiB); it carries messages of up to a quarter of that, less 32 bytes.
    pub fn create(capacity: usize) -> io::Result<PipeSender> {
        let invalid =
            || io::Error::new(io::ErrorKind::InvalidInput, "pipe capacity: a power of two, 256 B to 64 MiB");
        if !capacity.is_power_of_two() || !(ring::MIN_CAPACITY..=64 << 20).contains(&capacity) {
            return Err(invalid());
        }
        let producer = Producer::new(capacity, ring::max_payload_for(capacity)).ok_or_else(invalid)?;
        let memfd = Memfd::create("lightpath-pipe", (RING_OFFSET + capacity) as u64)?;
        let map = Mapping::new(&memfd, true)?;
        Ok(PipeSender { memfd, map, producer, capacity })
    }

    /// Where a receiver finds the pipe ([`PipeReceiver::open`]): `pid:fd`.
    pub fn address(&self) -> String {
        format!("{}:{}", std::process::id(), self.memfd.as_fd().as_raw_fd())
    }

    /// The ring's size in bytes (what a receiver opens the pipe with).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The longest message the pipe carries.
    pub fn max_message(&self) -> usize {
        self.producer.max_payload() as usize
    }

    /// Sends `msg` as one message if the ring has room for it now (`Ok(false)`: full, try
    /// again once the receiver has taken some).
    pub fn try_send(&mut self, msg: &[u8]) -> Result<bool, PipeError> {
        let max = self.max_message();
        let len = u32::try_from(msg.len()).ok().filter(|&l| l as usize <= max);
        let Some(len) = len else { return Err(PipeError::TooLong { len: msg.len(), max }) };
        let header = RecordHeader { kind: KIND_MESSAGE, flags: 0, len, word2: 0, word3: 0 };
        let map = &self.map;
        Ok(self.producer.try_push(&PipeRing(map), &HeadWord(map), header, |offset| {
            let _ = map.write(RING_OFFSET + offset, msg);
        })?)
    }

    /// Whether everything sent has been taken by the receiver.
    pub fn is_drained(&self) -> bool {
        HeadWord(&self.map).load(Ordering::Acquire) == self.producer.tail()
    }
}

/// The receiving end of a pipe (see the [module](self) docs).
#[derive(Debug)]
pub struct PipeReceiver {
    map: Mapping,
    consumer: Consumer,
}

impl PipeReceiver {
    /// Opens the pipe a [`PipeSender`] of another process (or this one) created, from its
    /// [`address`](PipeSender::address) and [`capacity`](PipeSender::capacity).
    pub fn open(address: &str, capacity: usize) -> io::Result<PipeReceiver> {
        let bad = |what: &str| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("pipe address {address:?}: {what}"))
        };
        let (pid, fd) = address.split_once(':').ok_or_else(|| bad("not pid:fd"))?;
        let pid: u32 = pid.parse().map_err(|_| bad("bad pid"))?;
        let fd: u32 = fd.parse().map_err(|_| bad("bad fd"))?;
        let consumer = Consumer::new(capacity, ring::max_payload_for(capacity))
            .filter(|_| capacity <= 64 << 20)
            .ok_or_else(|| bad("bad capacity"))?;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/fd/{fd}"))?;
        let memfd = Memfd::from_peer(OwnedFd::from(file), (RING_OFFSET + capacity) as u64)
            .map_err(|e| bad(&e.to_string()))?;
        let map = Mapping::peer(&memfd, (RING_OFFSET + capacity) as u64, true)?;
        Ok(PipeReceiver { map, consumer })
    }

    /// Copies the next message into `dst` and returns its length, or `None` if none has
    /// arrived. A message longer than `dst` is an error (and stays in the pipe).
    pub fn try_recv(&mut self, dst: &mut [u8]) -> Result<Option<usize>, PipeError> {
        let map = &self.map;
        let Some(record) = self.consumer.peek(&PipeRing(map), &HeadWord(map))? else { return Ok(None) };
        let len = record.header.len as usize;
        if len > dst.len() {
            return Err(PipeError::TooLong { len, max: dst.len() });
        }
        if !map.read(RING_OFFSET + record.payload_offset, &mut dst[..len]) {
            return Err(PipeError::Ring(RingError::BadLength));
        }
        self.consumer.release(&record, &HeadWord(map));
        Ok(Some(len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_arrive_in_order_across_laps_and_a_full_ring_says_so() {
        let mut tx = PipeSender::create(1024).expect("pipe");
        let mut rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        let mut buf = [0u8; 256];
        assert_eq!(rx.try_recv(&mut buf).expect("recv"), None, "nothing sent yet");
        for round in 0..50u8 {
            let msg: Vec<u8> = (0..(round as usize * 7) % 200).map(|i| i as u8 ^ round).collect();
            assert!(tx.try_send(&msg).expect("send"), "room for one message");
            assert!(!tx.is_drained());
            assert_eq!(rx.try_recv(&mut buf).expect("recv"), Some(msg.len()));
            assert_eq!(&buf[..msg.len()], &msg[..], "round {round}");
            assert!(tx.is_drained());
        }
        let mut sent = 0;
        while tx.try_send(&[7u8; 100]).expect("send") {
            sent += 1;
        }
        assert!(sent > 0 && sent < 16, "a 1 KiB ring holds a few 100-byte messages ({sent})");
        for _ in 0..sent {
            assert_eq!(rx.try_recv(&mut buf).expect("recv"), Some(100));
        }
        assert!(tx.try_send(&[1]).expect("send"), "room again once taken");
    }

    #[test]
    fn bad_lengths_and_addresses_are_refused() {
        let mut tx = PipeSender::create(1024).expect("pipe");
        assert!(matches!(tx.try_send(&[0u8; 300]), Err(PipeError::TooLong { len: 300, max: 224 })));
        let mut rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        assert!(tx.try_send(&[5u8; 40]).expect("send"));
        let mut small = [0u8; 8];
        assert!(matches!(rx.try_recv(&mut small), Err(PipeError::TooLong { len: 40, max: 8 })));
        let mut big = [0u8; 64];
        assert_eq!(rx.try_recv(&mut big).expect("still there"), Some(40));
        assert!(PipeSender::create(1000).is_err(), "not a power of two");
        assert!(PipeReceiver::open("nonsense", 1024).is_err());
        assert!(PipeReceiver::open(&format!("{}:999999", std::process::id()), 1024).is_err());
        assert!(PipeReceiver::open(&tx.address(), 1 << 20).is_err(), "larger than the file");
        // An ordinary file is not a sealed memfd.
        let file = std::fs::File::open("/proc/self/status").expect("a file");
        let address = format!("{}:{}", std::process::id(), file.as_raw_fd());
        assert!(PipeReceiver::open(&address, 256).is_err());
    }
}
