//! The shared segment of one queue pair: everything the queue pair tells its peer.
//!
//! Each queue pair writes only its own segment and only reads its peer's (mapped read-only:
//! the owner seals the memfd against new writable mappings before handing it over). So a peer
//! can put garbage only into the memory we *read*, never into anything we rely on having
//! written ourselves.
//!
//! ```text
//! offset 0      header (written once): magic, version, ring capacity, largest record payload
//! offset 64     status line (the owner updates it, the peer polls it):
//!                 acked   messages of the peer's this queue pair has fully received
//!                 nak     0, or (message + 1) << 8 | reason: the peer's message that failed
//!                 state   QP state | responder access << 8 | rnr_retry << 16 | 1 << 63
//!                 head    this queue pair's position in the peer's ring
//! offset 4096   the ring of records this queue pair sends
//! ```

use std::io;
use std::sync::atomic::Ordering as StdOrdering;

use lightpath_verbs::{AccessFlags, QpState};

use crate::ring::{self, RingMemory, Word};
use crate::sync::Ordering;
use crate::sys::{Mapping, Memfd};

const MAGIC: u64 = u64::from_le_bytes(*b"LPSHMQP\0");
const VERSION: u64 = 2;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_CAPACITY: usize = 16;
const OFF_MAX_PAYLOAD: usize = 24;
pub(crate) const OFF_ACKED: usize = 64;
pub(crate) const OFF_NAK: usize = 72;
pub(crate) const OFF_STATE: usize = 80;
pub(crate) const OFF_HEAD: usize = 88;
/// Where the ring starts.
pub(crate) const RING_OFFSET: usize = 4096;

/// What a queue pair publishes about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerStatus {
    pub(crate) state: QpState,
    pub(crate) access: AccessFlags,
    pub(crate) rnr_retry: u8,
}

impl PeerStatus {
    fn encode(&self) -> u64 {
        u64::from(self.state.to_raw() as u8)
            | u64::from(self.access.bits() as u8) << 8
            | u64::from(self.rnr_retry) << 16
            | 1 << 63
    }

    /// `None` for a word that was never published or holds values that cannot occur.
    fn decode(word: u64) -> Option<Self> {
        if word >> 63 != 1 {
            return None;
        }
        let state = QpState::from_raw((word & 0xFF) as u32)?;
        let access = AccessFlags::from_raw(((word >> 8) & 0xFF) as u32)?;
        let rnr_retry = ((word >> 16) & 0xFF) as u8;
        (rnr_retry <= 7).then_some(Self { state, access, rnr_retry })
    }
}

/// A queue pair's own segment, mapped read-write. The memfd is not kept: once it is handed to
/// the peer, the mapping is all the owner needs (a descriptor per connection less, issue 15).
#[derive(Debug)]
pub(crate) struct OwnSegment {
    map: Mapping,
    capacity: usize,
}

impl OwnSegment {
    /// Creates, maps and seals a segment with a ring of `capacity` bytes whose records carry
    /// at most `max_payload` bytes; returns it and the memfd to hand to the peer (close it
    /// once sent).
    pub(crate) fn create(capacity: usize, max_payload: u32) -> io::Result<(Self, Memfd)> {
        let memfd = Memfd::create("lightpath-shm-qp", (RING_OFFSET + capacity) as u64)?;
        let map = Mapping::new(&memfd, true)?;
        let header = [
            (OFF_MAGIC, MAGIC),
            (OFF_VERSION, VERSION),
            (OFF_CAPACITY, capacity as u64),
            (OFF_MAX_PAYLOAD, u64::from(max_payload)),
        ];
        for (offset, value) in header {
            if !map.store_u64(offset, value, StdOrdering::Relaxed) {
                return Err(io::Error::other("segment header outside the mapping"));
            }
        }
        memfd.seal_future_writes()?;
        Ok((Self { map, capacity }, memfd))
    }

    /// The mapping (for copying payloads into the ring).
    pub(crate) fn map(&self) -> &Mapping {
        &self.map
    }

    /// The ring this queue pair produces into.
    pub(crate) fn ring(&self) -> RingView<'_> {
        RingView { map: &self.map, capacity: self.capacity }
    }

    /// One of the owner's words (`OFF_HEAD`).
    pub(crate) fn word(&self, offset: usize) -> SharedWord<'_> {
        SharedWord { map: &self.map, offset }
    }

    /// Publishes the count of the peer's messages received in full.
    pub(crate) fn publish_acked(&self, acked: u64) {
        let stored = self.map.store_u64(OFF_ACKED, acked, StdOrdering::Release);
        debug_assert!(stored);
    }

    /// Publishes that the peer's message `message` failed with `reason`.
    pub(crate) fn publish_nak(&self, message: u64, reason: u8) {
        let stored =
            self.map.store_u64(OFF_NAK, (message + 1) << 8 | u64::from(reason), StdOrdering::Release);
        debug_assert!(stored);
    }

    /// Publishes the queue pair's state, responder access and RNR retry count.
    pub(crate) fn publish_status(&self, status: PeerStatus) {
        let stored = self.map.store_u64(OFF_STATE, status.encode(), StdOrdering::Release);
        debug_assert!(stored);
    }
}

/// The peer's segment, mapped read-only, with its header validated.
#[derive(Debug)]
pub(crate) struct PeerSegment {
    map: Mapping,
    capacity: usize,
    max_payload: u32,
}

/// What the peer's segment says, read in one go (one cache line).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StatusLine {
    /// `None` if the status word is not valid.
    pub(crate) status: Option<PeerStatus>,
    pub(crate) acked: u64,
    pub(crate) nak: u64,
}

impl PeerSegment {
    /// Maps a segment received from a peer and checks its header.
    pub(crate) fn from_memfd(memfd: &Memfd, max_ring: usize) -> Result<Self, &'static str> {
        let mut header = [0u8; 32];
        match rustix::io::pread(memfd, &mut header, 0) {
            Ok(32) => {}
            _ => return Err("cannot read the peer's segment header"),
        }
        let word = |offset: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&header[offset..offset + 8]);
            u64::from_ne_bytes(bytes)
        };
        if word(OFF_MAGIC) != MAGIC || word(OFF_VERSION) != VERSION {
            return Err("the peer's segment has no Lightpath shm header");
        }
        let capacity = usize::try_from(word(OFF_CAPACITY)).map_err(|_| "ring size out of range")?;
        let max_payload = u32::try_from(word(OFF_MAX_PAYLOAD)).map_err(|_| "record size out of range")?;
        let valid_capacity =
            capacity.is_power_of_two() && (ring::MIN_CAPACITY..=max_ring).contains(&capacity);
        if !valid_capacity || max_payload > ring::max_payload_for(capacity) {
            return Err("the peer's ring sizes are invalid");
        }
        let map = Mapping::peer(memfd, (RING_OFFSET + capacity) as u64, false)
            .map_err(|_| "the peer's segment is smaller than its ring")?;
        Ok(Self { map, capacity, max_payload })
    }

    /// The ring the peer produces into.
    pub(crate) fn ring(&self) -> RingView<'_> {
        RingView { map: &self.map, capacity: self.capacity }
    }

    /// The mapping (for copying payloads out of the ring).
    pub(crate) fn map(&self) -> &Mapping {
        &self.map
    }

    /// Ring size.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Largest record payload.
    pub(crate) fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// One of the peer's words (`OFF_HEAD`), read-only.
    pub(crate) fn word(&self, offset: usize) -> SharedWord<'_> {
        SharedWord { map: &self.map, offset }
    }

    /// Reads the status line: the state first (`Acquire`), so acknowledgements published
    /// before a state change are seen with it.
    pub(crate) fn status_line(&self) -> StatusLine {
        let load = |offset| self.map.load_u64(offset, StdOrdering::Acquire).unwrap_or(0);
        let status = PeerStatus::decode(load(OFF_STATE));
        StatusLine { status, acked: load(OFF_ACKED), nak: load(OFF_NAK) }
    }
}

/// A ring inside a segment mapping.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingView<'a> {
    map: &'a Mapping,
    capacity: usize,
}

impl RingView<'_> {
    /// The segment offset of ring offset `offset`.
    pub(crate) fn segment_offset(&self, offset: usize) -> usize {
        RING_OFFSET + offset
    }
}

// Ring offsets are below the capacity, which the segment was checked to hold, so the mapping's
// own bounds checks never fail here; should one fail anyway, the access is skipped (a load
// reads 0, which is never a valid stamp) rather than touching anything outside.
impl RingMemory for RingView<'_> {
    fn load_word(&self, offset: usize, order: Ordering) -> u64 {
        debug_assert!(offset < self.capacity);
        self.map.load_u64(RING_OFFSET + offset, order).unwrap_or(0)
    }

    fn store_word(&self, offset: usize, value: u64, order: Ordering) {
        let stored = self.map.store_u64(RING_OFFSET + offset, value, order);
        debug_assert!(stored);
    }

    fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        if !self.map.read(RING_OFFSET + offset, dst) {
            dst.fill(0);
        }
    }

    fn write_bytes(&self, offset: usize, src: &[u8]) {
        let written = self.map.write(RING_OFFSET + offset, src);
        debug_assert!(written);
    }

    fn prepare_write(&self, offset: usize) {
        self.map.prefetch_for_write(RING_OFFSET + offset);
    }
}

/// One 8-byte word of a segment.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedWord<'a> {
    map: &'a Mapping,
    offset: usize,
}

impl Word for SharedWord<'_> {
    fn load(&self, order: Ordering) -> u64 {
        self.map.load_u64(self.offset, order).unwrap_or(0)
    }

    fn store(&self, value: u64, order: Ordering) {
        let stored = self.map.store_u64(self.offset, value, order);
        debug_assert!(stored);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_sees_what_the_owner_publishes() {
        let (own, memfd) = OwnSegment::create(4096, 992).expect("segment");
        let peer = PeerSegment::from_memfd(&memfd, 1 << 20).expect("peer view");
        assert_eq!((peer.capacity(), peer.max_payload()), (4096, 992));
        assert!(peer.status_line().status.is_none(), "status before any was published");
        let status = PeerStatus { state: QpState::Rts, access: AccessFlags::REMOTE_READ, rnr_retry: 7 };
        own.publish_status(status);
        own.publish_acked(5);
        own.publish_nak(5, 2);
        let line = peer.status_line();
        assert_eq!((line.status, line.acked, line.nak), (Some(status), 5, 6 << 8 | 2));
        own.word(OFF_HEAD).store(640, Ordering::Release);
        assert_eq!(peer.word(OFF_HEAD).load(Ordering::Acquire), 640);
        assert!(!peer.map().write(OFF_HEAD, &[0; 8]), "the peer's view is writable");
    }

    #[test]
    fn forged_headers_are_refused() {
        let (_own, memfd) = OwnSegment::create(4096, 992).expect("segment");
        assert!(PeerSegment::from_memfd(&memfd, 2048).is_err(), "ring larger than allowed");
        for (offset, value) in
            [(OFF_MAGIC, 1u64), (OFF_CAPACITY, 3000), (OFF_CAPACITY, 1 << 40), (OFF_MAX_PAYLOAD, 4000)]
        {
            let (own, memfd) = OwnSegment::create(4096, 992).expect("segment");
            assert!(own.map.store_u64(offset, value, StdOrdering::Relaxed));
            assert!(PeerSegment::from_memfd(&memfd, 1 << 20).is_err(), "word {offset} = {value} accepted");
        }
    }

    #[test]
    fn impossible_status_words_decode_to_none() {
        assert_eq!(PeerStatus::decode(0), None);
        assert_eq!(PeerStatus::decode(1 << 63 | 9), None, "state 9");
        assert_eq!(PeerStatus::decode(1 << 63 | 3 | 0x80 << 8), None, "unknown access bit");
        assert_eq!(PeerStatus::decode(1 << 63 | 3 | 8 << 16), None, "rnr_retry 8");
        let status = PeerStatus { state: QpState::Err, access: AccessFlags::ALL, rnr_retry: 0 };
        assert_eq!(PeerStatus::decode(status.encode()), Some(status));
    }
}
