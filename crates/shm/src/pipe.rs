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
//! the receiver's position and a [`ring`](crate::ring::Producer) of records, and tells the receiver where
//! it is as text, `pid:fd:nonce` ([`PipeSender::address`]), over any channel; the receiver
//! opens `/proc/<pid>/fd/<fd>` (the kernel checks that it may: same user, or root), checks the
//! file as it checks every memfd a peer hands over, maps it, and checks that it holds the
//! nonce (a pid of another PID namespace names some other process). Nothing is left in a file system:
//! the memory goes when both processes have dropped their ends (or died).
//!
//! A message is one record of a [packed](crate::ring::PACKED) ring, 16 bytes apart, so that
//! small messages share cache lines ([`PipeSender::try_send`] copies it in, `false` when the
//! ring is full for now); [`PipeReceiver::try_recv`] copies the next one out. There is no
//! wake-up: the receiver polls, and a caller that sleeps must wake itself now and then.
//! Everything read from
//! the shared memory is validated (the ring's own checks); a peer that writes garbage makes
//! the receiver's calls fail with [`PipeError`], never read out of bounds.
//!
//! # Large messages: one copy
//!
//! A message through the ring is copied twice (in, then out). For large ones the sender can
//! instead send where the bytes are in its own memory, and the receiver copies them straight
//! into place with one `process_vm_readv` ([`PipeReceiver::read_sender_memory`], Linux's
//! cross-memory attach, as Open MPI's CMA), then counts one [`PipeReceiver::acknowledge`]; the
//! sender keeps the bytes untouched until [`PipeSender::acknowledged`] has counted past its
//! message. The kernel allows that read only to a process that may trace the sender (same
//! user, no stricter Yama setting, or root): [`PipeReceiver::can_read_sender_memory`] tries
//! it on a word whose address the sender gives ([`PipeSender::probe_address`]).
//!
//! A sender that waits for that acknowledgement has a core with nothing to do, so a receiver
//! may ask it to copy part of the message itself ([`PipeReceiver::ask_help`]: where the part
//! goes in the receiver's memory), and copies the rest at the same time: the sender finds the
//! request with [`PipeSender::help_asked`], writes the part into the receiver
//! ([`PipeReceiver::write_sender_memory`] on the pipe coming the other way, whose sender is
//! that receiver, checked by its nonce) and answers ([`PipeSender::answer_help`]); the
//! receiver acknowledges once the answer came ([`PipeReceiver::help_answer`]) and copies the
//! part itself if the sender could not.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use crate::ring::{self, Consumer, Producer, RecordHeader, RingError, RingMemory, Word, PACKED};
use crate::sys::{Mapping, Memfd};

/// Where the ring starts in the file (the receiver's position and acknowledgement count have
/// the first line).
const RING_OFFSET: usize = 64;
/// The word counting the receiver's acknowledgements of messages read from sender memory.
const ACK_OFFSET: usize = 8;
/// A random word the sender writes and names in its address, so that a receiver that opened
/// some other file (a pid of another PID namespace, a reused descriptor) finds out.
const NONCE_OFFSET: usize = 16;
/// A receiver's request that the sender copy part of a message itself (see
/// [`PipeReceiver::ask_help`]): the message's number (written last), then where the part goes
/// in the receiver's memory, its offset in the message and its length.
const HELP_NUMBER_OFFSET: usize = 24;
const HELP_DST_OFFSET: usize = 32;
const HELP_FROM_OFFSET: usize = 40;
const HELP_LEN_OFFSET: usize = 48;
/// The sender's answer to a request for help: the message's number times two, plus one if it
/// copied the part.
const HELP_ANSWER_OFFSET: usize = 56;
/// What [`PipeSender::probe_address`] points at.
static PROBE: u64 = 0x4C50_434D_4150_5242; // "LPCMAPRB"
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

    fn prepare_write(&self, offset: usize) {
        self.0.prefetch_for_write(RING_OFFSET + offset);
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
    nonce: u64,
}

impl PipeSender {
    /// A pipe whose ring holds `capacity` bytes of records (a power of two, 256 bytes to
    /// 64 MiB); it carries messages of up to a quarter of that, less 16 bytes.
    pub fn create(capacity: usize) -> io::Result<PipeSender> {
        let invalid =
            || io::Error::new(io::ErrorKind::InvalidInput, "pipe capacity: a power of two, 256 B to 64 MiB");
        if !capacity.is_power_of_two() || !(ring::MIN_CAPACITY..=64 << 20).contains(&capacity) {
            return Err(invalid());
        }
        let producer =
            Producer::with_layout(PACKED, capacity, PACKED.max_payload_for(capacity)).ok_or_else(invalid)?;
        let memfd = Memfd::create("lightpath-pipe", (RING_OFFSET + capacity) as u64)?;
        let map = Mapping::new(&memfd, true)?;
        let nonce = crate::sys::random_u64() | 1;
        if !map.store_u64(NONCE_OFFSET, nonce, Ordering::Release) {
            return Err(io::Error::other("pipe: the nonce does not fit"));
        }
        Ok(PipeSender { memfd, map, producer, capacity, nonce })
    }

    /// Where a receiver finds the pipe ([`PipeReceiver::open`]): `pid:fd:nonce` (at most 38
    /// characters).
    pub fn address(&self) -> String {
        format!("{}:{}:{:x}", std::process::id(), self.memfd.as_fd().as_raw_fd(), self.nonce)
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

    /// How many messages the receiver has acknowledged ([`PipeReceiver::acknowledge`]).
    pub fn acknowledged(&self) -> u64 {
        self.map.load_u64(ACK_OFFSET, Ordering::Acquire).unwrap_or(0)
    }

    /// The receiver's latest request for help ([`PipeReceiver::ask_help`]), if it made one.
    /// The receiver writes these words: check the number and the part against the message
    /// before acting on them.
    pub fn help_asked(&self) -> Option<HelpAsk> {
        let number = self.map.load_u64(HELP_NUMBER_OFFSET, Ordering::Acquire).filter(|&n| n > 0)?;
        let word = |offset| self.map.load_u64(offset, Ordering::Relaxed).unwrap_or(0);
        Some(HelpAsk {
            number,
            dst: word(HELP_DST_OFFSET),
            from: word(HELP_FROM_OFFSET),
            len: word(HELP_LEN_OFFSET),
        })
    }

    /// Answers the request for help with message `number`: `copied`, or the receiver must copy
    /// the part itself.
    pub fn answer_help(&self, number: u64, copied: bool) {
        let answer = number.wrapping_mul(2) | u64::from(copied);
        let _ = self.map.store_u64(HELP_ANSWER_OFFSET, answer, Ordering::Release);
    }

    /// The address, in this process, of a word a receiver may read with
    /// [`PipeReceiver::can_read_sender_memory`] to learn whether it may read this process's
    /// memory.
    pub fn probe_address() -> u64 {
        std::ptr::addr_of!(PROBE) as u64
    }

    /// Whether everything sent has been taken by the receiver, as far as it has said: a
    /// receiver says so when it finds the pipe empty, and after each eighth of the ring (see
    /// [`PipeReceiver::try_recv`]).
    pub fn is_drained(&self) -> bool {
        HeadWord(&self.map).load(Ordering::Acquire) == self.producer.tail()
    }
}

/// A receiver's request that the sender copy part of message `number` (counted from 1, as
/// acknowledgements count) itself: `len` bytes from offset `from` of the message, to address
/// `dst` of the receiver (see [`PipeReceiver::ask_help`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelpAsk {
    /// The message's number.
    pub number: u64,
    /// Where the part goes, in the receiver's memory.
    pub dst: u64,
    /// The part's offset in the message.
    pub from: u64,
    /// The part's length.
    pub len: u64,
}

/// The receiving end of a pipe (see the [module](self) docs).
#[derive(Debug)]
pub struct PipeReceiver {
    map: Mapping,
    consumer: Consumer,
    /// The sender's process id (whose memory `read_sender_memory` reads).
    pid: u32,
    acks: u64,
    /// The ring's capacity in bytes.
    capacity: usize,
    /// The position this side last published (see [`PipeReceiver::try_recv`]).
    published: u64,
    /// Where the kernel copies sender memory that `dst` lies at a slow distance from (see
    /// [`PipeReceiver::read_sender_memory`]); empty until first needed.
    bounce: std::sync::Mutex<Vec<u8>>,
}

/// Bytes a read of sender memory at a slow distance moves through the bounce buffer at a time
/// (it stays in the L2 cache while it is copied on).
pub const BOUNCE: usize = 256 << 10;
/// Reads from this size on go through the bounce buffer at a slow distance: the extra copy
/// costs less than the kernel's slow one.
const BOUNCE_FROM: usize = 16 << 10;

impl PipeReceiver {
    /// Opens the pipe a [`PipeSender`] of another process (or this one) created, from its
    /// [`address`](PipeSender::address) and [`capacity`](PipeSender::capacity).
    pub fn open(address: &str, capacity: usize) -> io::Result<PipeReceiver> {
        let bad = |what: &str| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("pipe address {address:?}: {what}"))
        };
        let mut parts = address.split(':');
        let (Some(pid), Some(fd), Some(nonce), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("not pid:fd:nonce"));
        };
        let pid: u32 = pid.parse().map_err(|_| bad("bad pid"))?;
        let fd: u32 = fd.parse().map_err(|_| bad("bad fd"))?;
        let nonce = u64::from_str_radix(nonce, 16).map_err(|_| bad("bad nonce"))?;
        let consumer = Consumer::with_layout(PACKED, capacity, PACKED.max_payload_for(capacity))
            .filter(|_| capacity <= 64 << 20)
            .ok_or_else(|| bad("bad capacity"))?;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/fd/{fd}"))?;
        let memfd = Memfd::from_peer(OwnedFd::from(file), (RING_OFFSET + capacity) as u64)
            .map_err(|e| bad(&e.to_string()))?;
        let map = Mapping::peer(&memfd, (RING_OFFSET + capacity) as u64, true)?;
        if map.load_u64(NONCE_OFFSET, Ordering::Acquire) != Some(nonce) {
            return Err(bad("the file there is not that pipe"));
        }
        Ok(PipeReceiver {
            map,
            consumer,
            pid,
            acks: 0,
            capacity,
            published: 0,
            bounce: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Whether this process may read the sender's memory: reads the word at `probe` (the
    /// sender's [`PipeSender::probe_address`]) and checks it.
    pub fn can_read_sender_memory(&self, probe: u64) -> bool {
        let mut word = [0u8; 8];
        self.read_sender_memory(probe, &mut word).is_ok() && u64::from_ne_bytes(word) == PROBE
    }

    /// Copies `dst.len()` bytes at address `addr` of the sender's process into `dst`, with one
    /// copy by the kernel (`process_vm_readv`). An address the sender does not have mapped, or
    /// a sender that has exited, is an error; nothing of this process other than `dst` is
    /// written.
    ///
    /// Where `dst` lies 1-63 bytes past `addr` modulo the page, the kernel's copy (`rep movsb`
    /// on CPUs with fast string moves) runs at a quarter of its speed on AMD Zen 3/4 (see
    /// `lightpath_verbs::copy`; measured here, 8 MiB: 1.9 against 7.1 GB/s). There the kernel
    /// copies into a bounce buffer placed at the sender's page offset, [`BOUNCE`] bytes at a
    /// time, and each piece is copied on from there.
    pub fn read_sender_memory(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        if dst.len() < BOUNCE_FROM
            || !lightpath_verbs::copy::slow_distance(dst.as_ptr() as usize, addr as usize)
        {
            return self.read_sender_memory_directly(addr, dst);
        }
        let mut bounce = self.bounce.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        bounce.resize(BOUNCE + 4096, 0);
        // `at` puts the bounce buffer's piece at the sender's offset in its page.
        let at = (addr as usize).wrapping_sub(bounce.as_ptr() as usize) % 4096;
        let mut done = 0;
        while done < dst.len() {
            let n = BOUNCE.min(dst.len() - done);
            let from =
                addr.checked_add(done as u64).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
            self.read_sender_memory_directly(from, &mut bounce[at..at + n])?;
            lightpath_verbs::copy::copy_bytes(&mut dst[done..done + n], &bounce[at..at + n]);
            done += n;
        }
        Ok(())
    }

    /// [`PipeReceiver::read_sender_memory`] with the kernel copying straight into `dst`.
    fn read_sender_memory_directly(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        let len = dst.len();
        copy_across(addr, len, io::ErrorKind::UnexpectedEof, |done, remote| {
            let local = libc::iovec { iov_base: dst[done..].as_mut_ptr().cast(), iov_len: len - done };
            // SAFETY: `local` describes `dst[done..]`, memory this call borrows mutably, so the
            // kernel writes only there; `remote` is an address in the other process, which the
            // kernel checks (and faults on) itself: it is never dereferenced here. One iovec
            // each, as the counts say.
            unsafe { libc::process_vm_readv(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) }
        })
    }

    /// Copies `src` into the sender's process at address `addr` (`process_vm_writev`): how a
    /// process helps the peer whose pipe this is with a message of its own (see
    /// [`PipeSender::help_asked`]). An address the peer does not have mapped writable, or a
    /// peer that has exited, is an error.
    pub fn write_sender_memory(&self, addr: u64, src: &[u8]) -> io::Result<()> {
        copy_across(addr, src.len(), io::ErrorKind::WriteZero, |done, remote| {
            let local =
                libc::iovec { iov_base: src[done..].as_ptr().cast_mut().cast(), iov_len: src.len() - done };
            // SAFETY: `local` describes `src[done..]`, which the kernel only reads (the
            // mutable pointer is the iovec type's, nothing writes through it); `remote` is an
            // address in the other process, which the kernel checks (and faults on) itself:
            // it is never dereferenced here. One iovec each, as the counts say.
            unsafe { libc::process_vm_writev(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) }
        })
    }

    /// The number of the next message read from sender memory (acknowledgements count them
    /// from 1, in order).
    pub fn next_number(&self) -> u64 {
        self.acks + 1
    }

    /// Asks the sender to copy `len` bytes from offset `from` of message `number` (see
    /// [`PipeReceiver::next_number`]) to address `dst` of this process itself, while this
    /// process copies the rest; then wait for [`PipeReceiver::help_answer`] before
    /// acknowledging the message, and copy the part yourself if the sender did not.
    pub fn ask_help(&self, number: u64, dst: u64, from: u64, len: u64) {
        let _ = self.map.store_u64(HELP_DST_OFFSET, dst, Ordering::Relaxed);
        let _ = self.map.store_u64(HELP_FROM_OFFSET, from, Ordering::Relaxed);
        let _ = self.map.store_u64(HELP_LEN_OFFSET, len, Ordering::Relaxed);
        let _ = self.map.store_u64(HELP_NUMBER_OFFSET, number, Ordering::Release);
    }

    /// The sender's answer to the request for help with message `number`: `None` while it has
    /// not answered, `Some(true)` once it copied the part, `Some(false)` if it could not.
    pub fn help_answer(&self, number: u64) -> Option<bool> {
        let answer = self.map.load_u64(HELP_ANSWER_OFFSET, Ordering::Acquire)?;
        (answer / 2 == number && number > 0).then_some(answer & 1 == 1)
    }

    /// Withdraws a request for help with message `number` that this process no longer waits
    /// for (its call failed), and waits until the sender can no longer write into this
    /// process for it: it answered (it copies before it answers, and a sender that gives up
    /// on the message answers that it did not), or it exited. Gives up after `patience`
    /// (returns `false`): a sender stopped for that long in the middle of its copy could
    /// still write the part later.
    pub fn withdraw_help(&self, number: u64, patience: std::time::Duration) -> bool {
        let _ = self.map.store_u64(HELP_NUMBER_OFFSET, 0, Ordering::Release);
        let start = std::time::Instant::now();
        loop {
            if self.help_answer(number).is_some() || !self.sender_alive() {
                return true;
            }
            if start.elapsed() >= patience {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Whether the sender's process still exists.
    fn sender_alive(&self) -> bool {
        // Any read checks the target process first: ESRCH once it is gone (the address need
        // not be mapped there; EFAULT still means the process exists).
        let mut word = [0u8; 1];
        match self.read_sender_memory_directly(PipeSender::probe_address(), &mut word) {
            Ok(()) => true,
            Err(e) => e.raw_os_error() != Some(libc::ESRCH),
        }
    }

    /// Tells the sender that one more message read from its memory is done with.
    pub fn acknowledge(&mut self) {
        self.acks += 1;
        let _ = self.map.store_u64(ACK_OFFSET, self.acks, Ordering::Release);
    }

    /// Copies the next message into `dst` and returns its length, or `None` if none has
    /// arrived. A message longer than `dst` is an error (and stays in the pipe).
    ///
    /// The space of the messages taken goes back to the sender when the receiver finds the
    /// pipe empty (it then has nothing to wait for but the sender) or once an eighth of the
    /// ring has been taken since it last did, not after each message: a sender that runs
    /// ahead and waits for room keeps reading the receiver's position, and a store to it per
    /// message would cost the receiver a cache miss per message. The sender never waits on
    /// this alone: with less than an eighth of the ring held back it still has room for the
    /// largest message (a quarter).
    pub fn try_recv(&mut self, dst: &mut [u8]) -> Result<Option<usize>, PipeError> {
        let map = &self.map;
        let Some(record) = self.consumer.peek(&PipeRing(map), &HeadWord(map))? else {
            if self.published != self.consumer.head() {
                self.consumer.publish(&HeadWord(map));
                self.published = self.consumer.head();
            }
            return Ok(None);
        };
        let len = record.header.len as usize;
        if len > dst.len() {
            return Err(PipeError::TooLong { len, max: dst.len() });
        }
        if !map.read(RING_OFFSET + record.payload_offset, &mut dst[..len]) {
            return Err(PipeError::Ring(RingError::BadLength));
        }
        self.consumer.consume(&record);
        if self.consumer.head() - self.published >= (self.capacity / 8) as u64 {
            self.consumer.publish(&HeadWord(map));
            self.published = self.consumer.head();
        }
        Ok(Some(len))
    }
}

/// A copy of `len` bytes between this process and another at `addr` there, in as many system
/// calls as the kernel needs: `call(done, remote)` makes one (`process_vm_readv` or
/// `process_vm_writev`) for the bytes from `done` on, `remote` describing them in the other
/// process; `nothing` is the error when a call moves no byte. Interrupted calls are retried.
fn copy_across(
    addr: u64,
    len: usize,
    nothing: io::ErrorKind,
    mut call: impl FnMut(usize, libc::iovec) -> isize,
) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let remote = libc::iovec {
            iov_base: addr
                .checked_add(done as u64)
                .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))? as usize
                as *mut libc::c_void,
            iov_len: len - done,
        };
        match call(done, remote) {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::from(nothing)),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
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
            assert_eq!(rx.try_recv(&mut buf).expect("recv"), None, "one message sent");
            assert!(tx.is_drained(), "a receiver that found the pipe empty gave its space back");
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

    /// The receiver gives space back now and then, not per message, and never holds back so
    /// much that the largest message has no room: a sender that filled the pipe with small
    /// messages can send the largest once they are read, before the receiver finds it empty.
    #[test]
    fn small_messages_share_lines_and_read_space_comes_back_in_time() {
        let mut tx = PipeSender::create(4096).expect("pipe");
        let mut rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        let mut sent = 0u64;
        while tx.try_send(&sent.to_le_bytes()).expect("send") {
            sent += 1;
        }
        assert_eq!(sent, (4096 - 16) / 32, "8-byte messages take 32 bytes each");
        let mut buf = [0u8; 1024];
        for i in 0..sent {
            assert_eq!(rx.try_recv(&mut buf).expect("recv"), Some(8));
            assert_eq!(u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")), i);
        }
        assert!(!tx.is_drained(), "the last messages' space is given back when the pipe is found empty");
        let largest = vec![9u8; tx.max_message()];
        assert!(tx.try_send(&largest).expect("send"), "space held back kept the largest message out");
        assert_eq!(rx.try_recv(&mut buf).expect("recv"), Some(largest.len()));
        assert_eq!(rx.try_recv(&mut buf).expect("recv"), None);
        assert!(tx.is_drained());
    }

    #[test]
    fn the_receiver_reads_sender_memory_with_one_copy_and_acknowledges() {
        let tx = PipeSender::create(1024).expect("pipe");
        let mut rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        assert!(rx.can_read_sender_memory(PipeSender::probe_address()));
        assert!(!rx.can_read_sender_memory(PipeSender::probe_address() + 8), "a different word");
        let source: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; source.len()];
        rx.read_sender_memory(source.as_ptr() as u64, &mut dst).expect("read");
        assert_eq!(dst, source);
        assert!(rx.read_sender_memory(8, &mut dst[..8]).is_err(), "an unmapped address");
        assert_eq!(tx.acknowledged(), 0);
        rx.acknowledge();
        rx.acknowledge();
        assert_eq!(tx.acknowledged(), 2);
    }

    /// A destination 16 bytes past the source, modulo the page, goes through the bounce
    /// buffer, in several pieces, and lands exactly; a source that runs into unmapped memory
    /// is an error there too.
    #[test]
    fn reads_at_a_slow_distance_go_through_the_bounce_buffer() {
        let tx = PipeSender::create(1024).expect("pipe");
        let rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        let source: Vec<u8> = (0..(2 * BOUNCE + 5_000) as u32).map(|i| (i * 13 + i / 509) as u8).collect();
        let mut dst = vec![0u8; source.len() + 4096];
        let at = (source.as_ptr() as usize + 16).wrapping_sub(dst.as_ptr() as usize) % 4096;
        let target = &mut dst[at..at + source.len()];
        assert!(lightpath_verbs::copy::slow_distance(target.as_ptr() as usize, source.as_ptr() as usize));
        rx.read_sender_memory(source.as_ptr() as u64, target).expect("read");
        assert_eq!(target, &source[..]);
        assert!(!rx.bounce.lock().expect("lock").is_empty(), "the bounce buffer was used");
        let unmapped = rx.read_sender_memory(8, &mut dst[16..16 + (64 << 10)]);
        assert!(unmapped.is_err(), "an unmapped address");
    }

    /// The help protocol between two pipes, one each way, in one process: the receiver asks,
    /// the sender finds the request, writes the part through the pipe coming the other way
    /// and answers; a request it cannot serve is answered as not copied.
    #[test]
    fn a_sender_copies_the_part_a_receiver_asked_for() {
        let tx = PipeSender::create(1024).expect("pipe");
        let rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        let back = PipeSender::create(1024).expect("pipe the other way");
        let back_rx = PipeReceiver::open(&back.address(), back.capacity()).expect("open");
        assert_eq!(tx.help_asked(), None, "nothing asked yet");
        assert_eq!(rx.help_answer(1), None);
        let message: Vec<u8> = (0..100_000u32).map(|i| (i * 3 + i / 7) as u8).collect();
        let mut dst = vec![0u8; message.len()];
        let number = rx.next_number();
        assert_eq!(number, 1);
        let part = 40_000..message.len();
        // The address is taken from a mutable borrow: the kernel writes through it.
        let target = dst[part.start..].as_mut_ptr() as u64;
        rx.ask_help(number, target, part.start as u64, part.len() as u64);
        let ask = tx.help_asked().expect("asked");
        assert_eq!(ask, HelpAsk { number, dst: target, from: 40_000, len: 60_000 });
        let from = ask.from as usize;
        back_rx.write_sender_memory(ask.dst, &message[from..from + ask.len as usize]).expect("write");
        tx.answer_help(number, true);
        assert_eq!(rx.help_answer(number), Some(true));
        assert_eq!(rx.help_answer(number + 1), None, "an answer names its message");
        assert_eq!(&dst[part.clone()], &message[part]);
        assert!(dst[..40_000].iter().all(|&b| b == 0), "nothing else written");
        assert!(back_rx.write_sender_memory(8, &message[..64]).is_err(), "an unmapped address");
        tx.answer_help(2, false);
        assert_eq!(rx.help_answer(2), Some(false));
    }

    #[test]
    fn bad_lengths_and_addresses_are_refused() {
        let mut tx = PipeSender::create(1024).expect("pipe");
        assert!(matches!(tx.try_send(&[0u8; 300]), Err(PipeError::TooLong { len: 300, max: 240 })));
        let mut rx = PipeReceiver::open(&tx.address(), tx.capacity()).expect("open");
        assert!(tx.try_send(&[5u8; 40]).expect("send"));
        let mut small = [0u8; 8];
        assert!(matches!(rx.try_recv(&mut small), Err(PipeError::TooLong { len: 40, max: 8 })));
        let mut big = [0u8; 64];
        assert_eq!(rx.try_recv(&mut big).expect("still there"), Some(40));
        assert!(PipeSender::create(1000).is_err(), "not a power of two");
        assert!(PipeReceiver::open("nonsense", 1024).is_err());
        assert!(PipeReceiver::open(&format!("{}:999999:1", std::process::id()), 1024).is_err());
        let (pid, rest) =
            tx.address().split_once(':').map(|(p, r)| (p.to_string(), r.to_string())).expect("pid:");
        let fd = rest.split(':').next().expect("fd");
        assert!(PipeReceiver::open(&format!("{pid}:{fd}:2"), 1024).is_err(), "another nonce: another file");
        let other = PipeSender::create(1024).expect("pipe");
        let other_fd = other.address().split(':').nth(1).expect("fd").to_string();
        let nonce = tx.address().rsplit(':').next().expect("nonce").to_string();
        assert!(
            PipeReceiver::open(&format!("{pid}:{other_fd}:{nonce}"), 1024).is_err(),
            "the same size, not that pipe"
        );
        assert!(PipeReceiver::open(&tx.address(), 1 << 20).is_err(), "larger than the file");
        // An ordinary file is not a sealed memfd.
        let file = std::fs::File::open("/proc/self/status").expect("a file");
        let address = format!("{}:{}:1", std::process::id(), file.as_raw_fd());
        assert!(PipeReceiver::open(&address, 256).is_err());
    }
}
