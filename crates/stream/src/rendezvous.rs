//! Rendezvous: how a large zero-copy write travels without passing through the receive ring.
//!
//! The sender does not copy the bytes anywhere. It writes a [`Descriptor`] record (kind
//! [`crate::RecordKind::Rendezvous`]) into the ring, in stream order, naming its registered
//! buffer (address, length, remote key), and waits. When the receiver's reader reaches that
//! record, the receiver *pulls* the bytes with RDMA READ: straight into the application's
//! registered buffer when the reader offers one, else into a small bounce region from which
//! plain reads copy. Once every byte has been fetched it answers with a
//! [`crate::RecordKind::RendezvousDone`] control record carrying the rendezvous' number, and
//! the sender's write returns: its buffer may be reused. Ring records after the descriptor are
//! read only after the whole rendezvous, so stream order holds exactly.
//!
//! This module is the sans-I/O part: the descriptor's bytes and their validation, and the
//! receiver's bookkeeping of one rendezvous being fetched ([`Incoming`]): which byte ranges
//! have a READ posted, into which target, and which have been handed to the application. The
//! [`crate::Conn`] owns one [`Incoming`] at a time and hands out sequence numbers for the
//! READs; the driver posts them.
//!
//! # Descriptor (24 bytes, big-endian)
//!
//! ```text
//! +----------------+----------------+-----------+-------+---------------+
//! | addr (u64)     | len (u64)      | rkey (u32)| flags | reserved (3)  |
//! +----------------+----------------+-----------+-------+---------------+
//! ```
//!
//! `flags` bit 0: the rendezvous is one whole message (sent by `send_msg_buf`) rather than
//! stream bytes. Every other bit and the reserved bytes must be zero; `len` is at least 1 and
//! at most [`MAX_RENDEZVOUS_LEN`], and `addr + len` must not overflow. The address and key
//! cannot be checked by the receiver: a peer that lies about them makes the READ fail with a
//! remote access error at the peer, which the receiver reports — its own memory is never the
//! target of anything the peer chose.

use std::collections::VecDeque;

/// Bytes of an encoded [`Descriptor`] (the ring record's length).
pub const DESCRIPTOR_LEN: u32 = 24;
/// Longest rendezvous a descriptor may announce (256 TiB): far beyond any real buffer, small
/// enough that offsets never overflow.
pub const MAX_RENDEZVOUS_LEN: u64 = 1 << 48;
/// Rendezvous numbers (in [`crate::RecordKind::RendezvousDone`]) are taken mod 2^27.
pub const NUMBER_MASK: u32 = crate::record::MAX_RECORD_LEN;

const FLAG_MESSAGE: u8 = 1;

/// What a rendezvous record announces: the sender's registered buffer holding the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Address of the first byte (the sender's).
    pub addr: u64,
    /// Stream (or message) bytes the rendezvous carries.
    pub len: u64,
    /// Remote key of the sender's buffer.
    pub rkey: u32,
    /// The bytes are one whole message, not stream bytes.
    pub message: bool,
}

/// Why a descriptor from the peer was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DescriptorError {
    /// Not [`DESCRIPTOR_LEN`] bytes.
    Length(usize),
    /// Unknown flag bits.
    Flags(u8),
    /// Non-zero reserved bytes.
    Reserved,
    /// A rendezvous of zero bytes.
    Empty,
    /// Longer than [`MAX_RENDEZVOUS_LEN`].
    TooLong(u64),
    /// `addr + len` overflows the address space.
    Wraps,
}

impl std::fmt::Display for DescriptorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DescriptorError::Length(len) => write!(f, "descriptor of {len} bytes (expected 24)"),
            DescriptorError::Flags(flags) => write!(f, "unknown descriptor flags {flags:#04x}"),
            DescriptorError::Reserved => f.write_str("non-zero reserved descriptor bytes"),
            DescriptorError::Empty => f.write_str("a rendezvous of zero bytes"),
            DescriptorError::TooLong(len) => write!(f, "a rendezvous of {len} bytes is out of range"),
            DescriptorError::Wraps => f.write_str("the buffer wraps around the address space"),
        }
    }
}

impl std::error::Error for DescriptorError {}

impl Descriptor {
    /// The record's bytes.
    pub fn encode(&self) -> [u8; DESCRIPTOR_LEN as usize] {
        let mut out = [0u8; DESCRIPTOR_LEN as usize];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..20].copy_from_slice(&self.rkey.to_be_bytes());
        out[20] = if self.message { FLAG_MESSAGE } else { 0 };
        out
    }

    /// Parses and checks a descriptor received from the peer.
    pub fn parse(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let bytes: &[u8; DESCRIPTOR_LEN as usize] =
            bytes.try_into().map_err(|_| DescriptorError::Length(bytes.len()))?;
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let (addr, len) = (u64_at(0), u64_at(8));
        let rkey = u32::from_be_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
        let flags = bytes[20];
        if flags & !FLAG_MESSAGE != 0 {
            return Err(DescriptorError::Flags(flags));
        }
        if bytes[21..] != [0, 0, 0] {
            return Err(DescriptorError::Reserved);
        }
        if len == 0 {
            return Err(DescriptorError::Empty);
        }
        if len > MAX_RENDEZVOUS_LEN {
            return Err(DescriptorError::TooLong(len));
        }
        if addr.checked_add(len).is_none() {
            return Err(DescriptorError::Wraps);
        }
        Ok(Self { addr, len, rkey, message: flags & FLAG_MESSAGE != 0 })
    }
}

/// How the receiver's bounce region is cut: `slots` slots of `slot_len` bytes, filled by READs
/// ahead of the reader (at most `slots` in flight), so plain reads of a rendezvous stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BounceGeometry {
    /// Bytes per slot (one READ fills one slot).
    pub slot_len: u32,
    /// Number of slots.
    pub slots: u32,
}

impl BounceGeometry {
    /// Total bytes of the bounce region.
    pub fn len(&self) -> usize {
        self.slot_len as usize * self.slots as usize
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a READ puts its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadTarget {
    /// This offset of the bounce region.
    Bounce {
        /// Offset in the bounce region.
        offset: u32,
    },
    /// This offset from the start of the application's destination of the current direct
    /// read (see [`crate::Conn::rendezvous_direct`]).
    Direct {
        /// Offset from the start of the destination.
        offset: u64,
    },
}

/// An RDMA READ the driver must post (signaled, with work request id `seq`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Work request id (the connection's sequence number).
    pub seq: u64,
    /// Address in the peer's buffer.
    pub remote_addr: u64,
    /// The peer's key.
    pub rkey: u32,
    /// Bytes.
    pub len: u32,
    /// Where they land.
    pub target: ReadTarget,
}

/// A bounce slot holding (or about to hold) rendezvous bytes `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    start: u64,
    len: u32,
    /// Offset of the slot in the bounce region.
    at: u32,
    seq: u64,
    /// Bytes already handed to the application.
    taken: u32,
}

/// A direct read in progress: `want` bytes into the application's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Direct {
    want: u64,
    requested: u64,
    /// READs posted and not known complete, in order.
    in_flight: VecDeque<u64>,
}

/// The receiver's state of the rendezvous at the head of its stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incoming {
    desc: Descriptor,
    number: u32,
    /// Bytes `[0, requested)` have a READ posted (or done).
    requested: u64,
    /// Bytes `[0, delivered)` were handed to the application.
    delivered: u64,
    /// Bounce slots in stream order, covering `[delivered, requested)` when no direct read
    /// is in progress.
    slots: VecDeque<Slot>,
    next_slot: u32,
    direct: Option<Direct>,
    /// The done record was queued.
    done_queued: bool,
}

impl Incoming {
    /// A rendezvous with this descriptor, the `number`th (mod 2^27) from the peer.
    pub fn new(desc: Descriptor, number: u32) -> Self {
        Self {
            desc,
            number: number & NUMBER_MASK,
            requested: 0,
            delivered: 0,
            slots: VecDeque::new(),
            next_slot: 0,
            direct: None,
            done_queued: false,
        }
    }

    /// The descriptor.
    pub fn descriptor(&self) -> &Descriptor {
        &self.desc
    }

    /// Its number (what the done record carries).
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Bytes not yet handed to the application.
    pub fn remaining(&self) -> u64 {
        self.desc.len - self.delivered
    }

    /// Bytes handed to the application so far.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// Whether every byte has been handed to the application.
    pub fn is_delivered(&self) -> bool {
        self.delivered == self.desc.len
    }

    /// Whether a READ is posted for every byte and all of them completed (given the highest
    /// completed sequence number): the sender may have its buffer back.
    pub fn is_fetched(&self, completed_seq: u64) -> bool {
        self.requested == self.desc.len
            && self.slots.iter().all(|slot| slot.seq <= completed_seq)
            && self.direct.as_ref().is_none_or(|d| d.in_flight.iter().all(|&seq| seq <= completed_seq))
    }

    /// Whether `seq` is one of this rendezvous' READs that has not completed.
    pub fn owns(&self, seq: u64) -> bool {
        self.slots.iter().any(|slot| slot.seq == seq)
            || self.direct.as_ref().is_some_and(|d| d.in_flight.contains(&seq))
    }

    /// Bytes fetched into the bounce region and not yet handed out.
    pub fn bounced(&self) -> u64 {
        self.slots.iter().map(|slot| u64::from(slot.len - slot.taken)).sum()
    }

    pub(crate) fn mark_done_queued(&mut self) -> bool {
        !std::mem::replace(&mut self.done_queued, true)
    }

    /// Whether a prefetch into the bounce region may start: bytes left to request, a free
    /// slot, and no direct read in progress.
    pub(crate) fn wants_prefetch(&self, geometry: BounceGeometry) -> bool {
        self.direct.is_none()
            && self.requested < self.desc.len
            && (self.slots.len() as u32) < geometry.slots
            && geometry.slot_len > 0
    }

    /// Starts the next prefetch READ (the caller checked [`Incoming::wants_prefetch`]).
    pub(crate) fn start_prefetch(&mut self, seq: u64, geometry: BounceGeometry) -> ReadRequest {
        let len = (self.desc.len - self.requested).min(u64::from(geometry.slot_len)) as u32;
        let index = self.next_slot % geometry.slots;
        self.next_slot = (index + 1) % geometry.slots;
        let at = index * geometry.slot_len;
        let start = self.requested;
        self.requested += u64::from(len);
        self.slots.push_back(Slot { start, len, at, seq, taken: 0 });
        ReadRequest {
            seq,
            remote_addr: self.desc.addr + start,
            rkey: self.desc.rkey,
            len,
            target: ReadTarget::Bounce { offset: at },
        }
    }

    /// The bounce bytes readable now: `(offset in the bounce region, length)` of the first
    /// slot, once its READ has completed.
    pub fn bounce_front(&self, completed_seq: u64) -> Option<(u32, u32)> {
        let slot = self.slots.front()?;
        (slot.seq <= completed_seq && slot.taken < slot.len)
            .then(|| (slot.at + slot.taken, slot.len - slot.taken))
    }

    /// Whether a bounce READ is in flight (the reader must wait for it before anything else:
    /// its bytes come first).
    pub fn bounce_pending(&self) -> bool {
        !self.slots.is_empty()
    }

    /// Hands `n` bytes of the first slot to the application (at most what
    /// [`Incoming::bounce_front`] offered).
    pub(crate) fn take_bounced(&mut self, n: u32) {
        let Some(slot) = self.slots.front_mut() else { return };
        let n = n.min(slot.len - slot.taken);
        slot.taken += n;
        self.delivered += u64::from(n);
        if slot.taken == slot.len {
            self.slots.pop_front();
        }
    }

    /// Starts a direct read of up to `want` bytes (only when the bounce region holds nothing
    /// of this rendezvous, so the direct bytes are the next in the stream). Returns how many
    /// bytes it will deliver; 0 if it cannot start.
    pub(crate) fn begin_direct(&mut self, want: u64) -> u64 {
        if self.direct.is_some() || !self.slots.is_empty() || want == 0 {
            return 0;
        }
        let want = want.min(self.desc.len - self.requested);
        if want > 0 {
            self.direct = Some(Direct { want, requested: 0, in_flight: VecDeque::new() });
        }
        want
    }

    /// Whether the direct read has bytes left to request.
    pub(crate) fn direct_wants_more(&self, completed_seq: u64, max_in_flight: usize) -> bool {
        self.direct.as_ref().is_some_and(|d| {
            d.requested < d.want
                && d.in_flight.iter().filter(|&&seq| seq > completed_seq).count() < max_in_flight
        })
    }

    /// The next READ of the direct read, at most `chunk` bytes (the caller checked
    /// [`Incoming::direct_wants_more`]).
    pub(crate) fn next_direct(&mut self, seq: u64, chunk: u32) -> Option<ReadRequest> {
        let direct = self.direct.as_mut()?;
        let len = (direct.want - direct.requested).min(u64::from(chunk.max(1))) as u32;
        if len == 0 {
            return None;
        }
        let offset = direct.requested;
        direct.requested += u64::from(len);
        direct.in_flight.push_back(seq);
        let start = self.requested;
        self.requested += u64::from(len);
        Some(ReadRequest {
            seq,
            remote_addr: self.desc.addr + start,
            rkey: self.desc.rkey,
            len,
            target: ReadTarget::Direct { offset },
        })
    }

    /// Forgets direct READs that completed.
    pub(crate) fn prune(&mut self, completed_seq: u64) {
        if let Some(direct) = self.direct.as_mut() {
            while direct.in_flight.front().is_some_and(|&seq| seq <= completed_seq) {
                direct.in_flight.pop_front();
            }
        }
    }

    /// Ends the direct read once all its bytes have landed; returns how many were delivered.
    pub(crate) fn finish_direct(&mut self, completed_seq: u64) -> Option<u64> {
        let direct = self.direct.as_ref()?;
        if direct.requested < direct.want || direct.in_flight.iter().any(|&seq| seq > completed_seq) {
            return None;
        }
        let want = direct.want;
        self.direct = None;
        self.delivered += want;
        Some(want)
    }

    /// Whether a direct read is in progress.
    pub fn direct_in_progress(&self) -> bool {
        self.direct.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Descriptor {
        Descriptor { addr: 0x7f00_1234_5000, len: 1 << 20, rkey: 0xABCD, message: true }
    }

    #[test]
    fn descriptor_bytes() {
        let bytes = sample().encode();
        assert_eq!(&bytes[..8], &0x7f00_1234_5000u64.to_be_bytes());
        assert_eq!(&bytes[8..16], &(1u64 << 20).to_be_bytes());
        assert_eq!(&bytes[16..20], &[0, 0, 0xAB, 0xCD]);
        assert_eq!(&bytes[20..], &[1, 0, 0, 0]);
        assert_eq!(Descriptor::parse(&bytes), Ok(sample()));
        let stream = Descriptor { message: false, ..sample() };
        assert_eq!(Descriptor::parse(&stream.encode()), Ok(stream));
    }

    #[test]
    fn lying_descriptors_are_refused() {
        let good = sample().encode();
        assert_eq!(Descriptor::parse(&good[..23]), Err(DescriptorError::Length(23)));
        let mut bad = good;
        bad[20] = 0x81;
        assert_eq!(Descriptor::parse(&bad), Err(DescriptorError::Flags(0x81)));
        let mut bad = good;
        bad[23] = 1;
        assert_eq!(Descriptor::parse(&bad), Err(DescriptorError::Reserved));
        let empty = Descriptor { len: 0, ..sample() };
        assert_eq!(Descriptor::parse(&empty.encode()), Err(DescriptorError::Empty));
        let huge = Descriptor { len: MAX_RENDEZVOUS_LEN + 1, ..sample() };
        assert_eq!(Descriptor::parse(&huge.encode()), Err(DescriptorError::TooLong(MAX_RENDEZVOUS_LEN + 1)));
        let wraps = Descriptor { addr: u64::MAX - 10, len: 11, ..sample() };
        assert_eq!(Descriptor::parse(&wraps.encode()), Err(DescriptorError::Wraps));
        let edge = Descriptor { addr: u64::MAX - 11, len: 11, ..sample() };
        assert_eq!(Descriptor::parse(&edge.encode()), Ok(edge));
    }

    #[test]
    fn prefetch_fills_slots_in_order_and_hands_bytes_out() {
        let geometry = BounceGeometry { slot_len: 100, slots: 2 };
        let mut incoming = Incoming::new(Descriptor { len: 250, ..sample() }, 5);
        assert!(incoming.wants_prefetch(geometry));
        let first = incoming.start_prefetch(10, geometry);
        let second = incoming.start_prefetch(11, geometry);
        assert!(!incoming.wants_prefetch(geometry), "two slots, both busy");
        assert_eq!(
            (first.remote_addr, first.len, first.target),
            (sample().addr, 100, ReadTarget::Bounce { offset: 0 })
        );
        assert_eq!(
            (second.remote_addr, second.target),
            (sample().addr + 100, ReadTarget::Bounce { offset: 100 })
        );
        assert_eq!(incoming.bounce_front(9), None, "nothing landed yet");
        assert_eq!(incoming.bounce_front(10), Some((0, 100)));
        incoming.take_bounced(60);
        assert_eq!(incoming.bounce_front(10), Some((60, 40)));
        incoming.take_bounced(40);
        assert!(incoming.wants_prefetch(geometry));
        let third = incoming.start_prefetch(12, geometry);
        assert_eq!(
            (third.len, third.target),
            (50, ReadTarget::Bounce { offset: 0 }),
            "slot 0 again, the tail"
        );
        assert!(!incoming.wants_prefetch(geometry), "everything requested");
        assert!(!incoming.is_fetched(11));
        assert!(incoming.is_fetched(12));
        assert!(incoming.owns(12) && !incoming.owns(10));
        incoming.take_bounced(100);
        incoming.take_bounced(50);
        assert!(incoming.is_delivered());
        assert_eq!(incoming.remaining(), 0);
    }

    #[test]
    fn direct_reads_follow_the_bounced_bytes() {
        let geometry = BounceGeometry { slot_len: 64, slots: 1 };
        let mut incoming = Incoming::new(Descriptor { len: 1000, ..sample() }, 0);
        incoming.start_prefetch(1, geometry);
        assert_eq!(incoming.begin_direct(500), 0, "bounced bytes come first");
        incoming.take_bounced(64);
        assert_eq!(incoming.begin_direct(2000), 936, "at most what is left");
        assert!(incoming.direct_wants_more(1, 2));
        let a = incoming.next_direct(2, 400).unwrap();
        let b = incoming.next_direct(3, 400).unwrap();
        assert!(!incoming.direct_wants_more(1, 2), "two in flight");
        assert!(incoming.direct_wants_more(2, 2));
        let c = incoming.next_direct(4, 400).unwrap();
        assert_eq!(
            (a.remote_addr, a.len, a.target),
            (sample().addr + 64, 400, ReadTarget::Direct { offset: 0 })
        );
        assert_eq!((b.remote_addr, b.target), (sample().addr + 464, ReadTarget::Direct { offset: 400 }));
        assert_eq!((c.len, c.target), (136, ReadTarget::Direct { offset: 800 }));
        assert!(incoming.next_direct(5, 400).is_none());
        assert_eq!(incoming.finish_direct(3), None, "a READ is still in flight");
        assert!(incoming.owns(4));
        incoming.prune(4);
        assert!(incoming.is_fetched(4));
        assert_eq!(incoming.finish_direct(4), Some(936));
        assert!(incoming.is_delivered());
    }
}
