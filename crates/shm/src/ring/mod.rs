//! The single-producer/single-consumer record ring that carries one queue pair's messages to
//! its peer.
//!
//! # Layout
//!
//! The ring is `capacity` bytes (a power of two) of records, never wrapping around the end, in
//! one of two [`Layout`]s:
//!
//! ```text
//! LINES:   [ stamp: u64 | info: u64 | word2: u64 | word3: u64 | payload … ] padded to 64 bytes
//! PACKED:  [ stamp: u64 | info: u64 | payload … ]                           padded to 16 bytes
//! info  =  kind (bits 0..8) | flags (8..16) | payload length (32..64)
//! ```
//!
//! [`LINES`] starts every record on a cache line and carries two opaque words: the queue pairs'
//! rings (a record there is a work request's notice). [`PACKED`] carries only the kind, flags
//! and length, and packs records 16 bytes apart (so that the end of a lap always has room for
//! a skip record's header): the pipes' rings, whose messages are the small ones of a
//! collective (an 8-byte broadcast takes 32 bytes instead of a line). A consumer that runs
//! behind its producer takes a cache miss per line it reads, so a packed ring of small
//! messages moves two of them per miss (2 ranks, 8-byte broadcasts in a loop, where the
//! receiver's misses set the pace). Both ends of a ring must use the same layout: nothing in
//! the ring says which it is.
//!
//! Positions are byte counts that only grow (`u64`); a record at position `p` lives at offset
//! `p % capacity`. Its *stamp* is `!p`. The producer writes the header words and the payload,
//! then stores the stamp with `Release`; the consumer loads the stamp at its own position with
//! `Acquire` and treats the record as present exactly when it equals `!position`. Stale
//! records from an earlier lap carry an older position and zeroed memory never matches, so no
//! per-record "consumed" flag has to be written back, and the producer never reads anything
//! the consumer wrote except its position. To make "stale" airtight even when old payload bytes
//! sit where the next record's stamp will go, the producer zeroes the stamp word after each
//! record before publishing it.
//!
//! A record that would run past the end is preceded by a *skip* record that covers the rest of
//! the lap. The consumer publishes its position (`head`, `Release`) after each record
//! ([`Consumer::release`]), or less often ([`Consumer::consume`], then [`Consumer::publish`]:
//! a consumer that runs behind a producer waiting for room then does not take a cache miss on
//! the word the producer keeps reading, each record); the producer reads it (`Acquire`) when
//! its cached copy says the ring is full, and before a
//! record that would be the first in a [`PAGE`] of the ring: if the consumer has read
//! everything then, the producer skips the rest of the lap and writes the record at offset 0.
//! A connection whose ring empties between its messages (a request and its answer) so keeps
//! to the ring's first page, instead of running through every page of the ring (resident from
//! then on in both processes, ~64 KiB of notices per queue pair and side); one look at the
//! consumer's position per page costs nothing measurable. A consumer takes such a skip like
//! any other (it only refuses one at offset 0), so rings of older producers and consumers mix.
//!
//! # Trust
//!
//! The producer is the peer process. Everything the consumer reads is validated before use
//! (lengths against the ring and the configured maximum, skip records never at offset 0), and
//! the head the producer reads back is checked against its own tail; anything impossible is a
//! [`RingError`], which the caller turns into an error on the queue pair. A peer that writes
//! garbage can stall or break its own connection, never make this process access memory out of
//! bounds.
//!
//! # Sleeping
//!
//! The ring itself has no wake-up mechanism: after publishing a record the producer marks its
//! peer's queue pair in the peer device's activity area, which also tells it whether to ring
//! the device's doorbell (see [`crate::activity`]).
//!
//! The memory-ordering argument is model-checked with `loom` (`tests/loom.rs`), which runs this
//! exact code against a ring whose payload bytes are `loom` cells (so a read not ordered after
//! the write it observes is reported as a data race).

mod memory;

pub use memory::{RingMemory, Word};

use crate::sync::Ordering;

/// Bytes of a record header in the [`LINES`] layout (the stamp and three words).
pub const HEADER: usize = 32;
/// Records of the [`LINES`] layout start on cache-line boundaries.
pub const ALIGN: usize = 64;

/// Where a ring's records start and how long their headers are (see the [module](self) docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Records start at multiples of this many bytes (a power of two, at least the header, so
    /// that the end of a lap has room for a skip record's header).
    align: u64,
    /// Bytes of a record's header: the stamp, the info word and, in [`LINES`], two more.
    header: usize,
}

/// Records on cache lines with a 32-byte header carrying `word2` and `word3`.
pub const LINES: Layout = Layout { align: ALIGN as u64, header: HEADER };
/// Records 16 bytes apart with a 16-byte header: `word2` and `word3` are not carried (a
/// producer refuses records that set them).
pub const PACKED: Layout = Layout { align: 16, header: 16 };

impl Layout {
    /// Bytes a record with `len` payload bytes occupies.
    pub fn record_size(&self, len: u32) -> u64 {
        (self.header as u64 + u64::from(len)).div_ceil(self.align) * self.align
    }

    /// The largest payload one record of a ring of `capacity` bytes may carry: a quarter of
    /// the ring, so that a lap always has room for a record after any skip.
    pub fn max_payload_for(&self, capacity: usize) -> u32 {
        u32::try_from(capacity / 4 - self.header).unwrap_or(u32::MAX)
    }

    /// Bytes after the stamp that the header takes.
    fn rest(&self) -> usize {
        self.header - 8
    }

    /// Whether a ring of `capacity` bytes carrying at most `max_payload` per record is valid.
    fn valid(&self, capacity: usize, max_payload: u32) -> bool {
        capacity.is_power_of_two()
            && capacity >= MIN_CAPACITY
            && max_payload <= self.max_payload_for(capacity)
    }
}

/// Smallest ring.
pub const MIN_CAPACITY: usize = 256;
/// The unit of the producer's restarts at the beginning of the ring (see the module docs): a
/// memory page.
pub const PAGE: usize = 4096;

/// The kind of the record that pads to the end of a lap.
pub const KIND_SKIP: u8 = 0xFF;

/// The ring found something the protocol forbids: the peer is broken or malicious.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingError {
    /// A record's length does not fit the ring or exceeds the maximum payload.
    BadLength,
    /// A skip record at the start of a lap (a lap always has room for one record).
    BadSkip,
    /// The consumer position read back is behind, ahead of, or misaligned with the producer.
    BadHead,
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RingError::BadLength => "record length outside the ring",
            RingError::BadSkip => "skip record at the start of a lap",
            RingError::BadHead => "consumer position inconsistent with the producer",
        })
    }
}

impl std::error::Error for RingError {}

/// The header fields of a record, except its stamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// What the record is (the ring reserves [`KIND_SKIP`]).
    pub kind: u8,
    /// Kind-specific flags.
    pub flags: u8,
    /// Payload bytes that follow the header.
    pub len: u32,
    /// Opaque to the ring.
    pub word2: u64,
    /// Opaque to the ring.
    pub word3: u64,
}

impl RecordHeader {
    fn encode(&self) -> [u8; HEADER - 8] {
        let info = u64::from(self.kind) | u64::from(self.flags) << 8 | u64::from(self.len) << 32;
        let mut bytes = [0u8; HEADER - 8];
        bytes[0..8].copy_from_slice(&info.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.word2.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.word3.to_le_bytes());
        bytes
    }

    fn decode(bytes: &[u8; HEADER - 8]) -> Self {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let info = word(0);
        Self {
            kind: info as u8,
            flags: (info >> 8) as u8,
            len: (info >> 32) as u32,
            word2: word(8),
            word3: word(16),
        }
    }
}

/// A record the consumer may process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// The header, copied out of the ring once and validated.
    pub header: RecordHeader,
    /// Where the payload starts, as an offset into the ring.
    pub payload_offset: usize,
    size: u64,
}

/// Bytes a record with `len` payload bytes occupies in the [`LINES`] layout.
pub fn record_size(len: u32) -> u64 {
    LINES.record_size(len)
}

/// The largest payload one record of a [`LINES`] ring of `capacity` bytes may carry (see
/// [`Layout::max_payload_for`]).
pub fn max_payload_for(capacity: usize) -> u32 {
    LINES.max_payload_for(capacity)
}

fn stamp(position: u64) -> u64 {
    !position
}

/// The writing side of a ring.
#[derive(Debug)]
pub struct Producer {
    layout: Layout,
    capacity: u64,
    max_payload: u32,
    tail: u64,
    head_seen: u64,
}

impl Producer {
    /// A producer for an empty [`LINES`] ring of `capacity` bytes (a power of two, at least
    /// [`MIN_CAPACITY`]) whose records carry at most `max_payload` bytes (at most
    /// [`max_payload_for`]`(capacity)`). Returns `None` for other sizes.
    pub fn new(capacity: usize, max_payload: u32) -> Option<Self> {
        Self::with_layout(LINES, capacity, max_payload)
    }

    /// [`Producer::new`] for a ring of the given layout (`max_payload` at most
    /// [`Layout::max_payload_for`]`(capacity)`).
    pub fn with_layout(layout: Layout, capacity: usize, max_payload: u32) -> Option<Self> {
        layout.valid(capacity, max_payload).then_some(Self {
            layout,
            capacity: capacity as u64,
            max_payload,
            tail: 0,
            head_seen: 0,
        })
    }

    /// The position of the next record.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// The largest payload of one record.
    pub fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// Whether `bytes` more can be written (plus the spare line for the next stamp), reading
    /// the consumer's position only if the cached one says no.
    fn has_room<W: Word>(&mut self, bytes: u64, peer_head: &W) -> Result<bool, RingError> {
        let needed = self.tail + bytes + self.layout.align;
        if needed <= self.head_seen + self.capacity {
            return Ok(true);
        }
        Ok(needed <= self.look_at_head(peer_head)? + self.capacity)
    }

    /// Whether the consumer has read every record (its published position is this side's
    /// tail).
    fn consumer_caught_up<W: Word>(&mut self, peer_head: &W) -> Result<bool, RingError> {
        Ok(self.look_at_head(peer_head)? == self.tail)
    }

    /// Reads the consumer's position, checks that it is possible (never ahead of this side,
    /// never more than a lap behind, on a line, never going back) and remembers it.
    fn look_at_head<W: Word>(&mut self, peer_head: &W) -> Result<u64, RingError> {
        let head = peer_head.load(Ordering::Acquire);
        if head > self.tail
            || self.tail - head > self.capacity
            || !head.is_multiple_of(self.layout.align)
            || head < self.head_seen
        {
            return Err(RingError::BadHead);
        }
        self.head_seen = head;
        Ok(head)
    }

    /// Appends one record: if there is room, writes the header, calls `fill` with the ring
    /// offset where the `header.len` payload bytes go (it must write exactly there), publishes
    /// the record and returns `Ok(true)`; returns `Ok(false)` if the ring is full for now.
    ///
    /// # Panics
    ///
    /// If `header.len` exceeds the maximum payload, `header.kind` is [`KIND_SKIP`], or the
    /// ring is [`PACKED`] and `word2` or `word3` is set (caller bugs, never peer input).
    pub fn try_push<M: RingMemory, W: Word>(
        &mut self,
        ring: &M,
        peer_head: &W,
        header: RecordHeader,
        fill: impl FnOnce(usize),
    ) -> Result<bool, RingError> {
        assert!(header.len <= self.max_payload, "record payload above the ring's maximum");
        assert!(header.kind != KIND_SKIP, "the skip kind is reserved");
        assert!(
            self.layout.header == HEADER || (header.word2 == 0 && header.word3 == 0),
            "a packed ring carries no header words"
        );
        let size = self.layout.record_size(header.len);
        let mut offset = (self.tail % self.capacity) as usize;
        let pad = self.capacity - offset as u64;
        let wraps = size > pad;
        // A record (with the stamp word zeroed after it) that reaches into a page of this lap
        // not yet written restarts the lap instead, if the consumer has read everything and a
        // skip and the record fit in one lap.
        let page = PAGE as u64;
        let restarts = !wraps
            && offset != 0
            && (offset as u64 + size) / page > offset as u64 / page
            && pad + size + self.layout.align <= self.capacity
            && self.consumer_caught_up(peer_head)?;
        if wraps || restarts {
            if !self.has_room(pad + size, peer_head)? {
                return Ok(false);
            }
            let skip = RecordHeader { kind: KIND_SKIP, flags: 0, len: 0, word2: 0, word3: 0 };
            self.publish(ring, offset, pad, &skip);
            offset = 0;
        } else if !self.has_room(size, peer_head)? {
            return Ok(false);
        }
        ring.write_bytes(offset + 8, &header.encode()[..self.layout.rest()]);
        fill(offset + self.layout.header);
        self.publish(ring, offset, size, &header);
        Ok(true)
    }

    /// Zeroes the stamp after the record, then publishes the record at `offset` (whose header
    /// words other than the stamp are already written, except for skips).
    fn publish<M: RingMemory>(&mut self, ring: &M, offset: usize, size: u64, header: &RecordHeader) {
        if header.kind == KIND_SKIP {
            ring.write_bytes(offset + 8, &header.encode()[..self.layout.rest()]);
        }
        let next = ((self.tail + size) % self.capacity) as usize;
        ring.store_word(next, 0, Ordering::Relaxed);
        ring.store_word(offset, stamp(self.tail), Ordering::Release);
        self.tail += size;
        // The line after the one the next record starts in: the consumer may be polling
        // that one.
        let ahead = ((self.tail % self.capacity) as usize & !(ALIGN - 1)) + ALIGN;
        if ahead < self.capacity as usize {
            ring.prepare_write(ahead);
        }
    }
}

/// The reading side of a ring.
#[derive(Debug)]
pub struct Consumer {
    layout: Layout,
    capacity: u64,
    max_payload: u32,
    head: u64,
}

impl Consumer {
    /// A consumer for an empty [`LINES`] ring of `capacity` bytes whose records carry at most
    /// `max_payload` bytes; `None` for sizes [`Producer::new`] would refuse.
    pub fn new(capacity: usize, max_payload: u32) -> Option<Self> {
        Self::with_layout(LINES, capacity, max_payload)
    }

    /// [`Consumer::new`] for a ring of the given layout.
    pub fn with_layout(layout: Layout, capacity: usize, max_payload: u32) -> Option<Self> {
        layout.valid(capacity, max_payload).then_some(Self {
            layout,
            capacity: capacity as u64,
            max_payload,
            head: 0,
        })
    }

    /// The position of the next record to read.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The next record if the producer has published one. Skip records are consumed here (and
    /// the new position published to `own_head`, so the producer sees the space).
    pub fn peek<M: RingMemory, W: Word>(
        &mut self,
        ring: &M,
        own_head: &W,
    ) -> Result<Option<Record>, RingError> {
        loop {
            let offset = (self.head % self.capacity) as usize;
            if ring.load_word(offset, Ordering::Acquire) != stamp(self.head) {
                return Ok(None);
            }
            let mut bytes = [0u8; HEADER - 8];
            ring.read_bytes(offset + 8, &mut bytes[..self.layout.rest()]);
            let header = RecordHeader::decode(&bytes);
            if header.kind == KIND_SKIP {
                if offset == 0 {
                    return Err(RingError::BadSkip);
                }
                self.head += self.capacity - offset as u64;
                own_head.store(self.head, Ordering::Release);
                continue;
            }
            let size = self.layout.record_size(header.len);
            if header.len > self.max_payload || offset as u64 + size > self.capacity {
                return Err(RingError::BadLength);
            }
            return Ok(Some(Record { header, payload_offset: offset + self.layout.header, size }));
        }
    }

    /// Consumes `record` (the one [`Consumer::peek`] returned last) and publishes the new
    /// position, releasing the space to the producer.
    pub fn release<W: Word>(&mut self, record: &Record, own_head: &W) {
        self.consume(record);
        self.publish(own_head);
    }

    /// Consumes `record` (the one [`Consumer::peek`] returned last) without publishing the
    /// new position: the producer sees the space after the next [`Consumer::publish`] (or a
    /// skip record taken by [`Consumer::peek`]).
    pub fn consume(&mut self, record: &Record) {
        self.head += record.size;
    }

    /// Publishes this side's position, releasing the space of every record consumed so far.
    pub fn publish<W: Word>(&self, own_head: &W) {
        own_head.store(self.head, Ordering::Release);
    }
}

#[cfg(test)]
mod tests;
