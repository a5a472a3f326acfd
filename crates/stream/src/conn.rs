//! The RDMA connection core: ring and credit accounting for one connection, sans I/O.
//!
//! Each side owns a *receive ring* (registered, remotely writable) and a *credit slot*; the
//! peer's sender writes stream bytes into the ring with RDMA WRITE with immediate (one
//! immediate per record, see [`crate::record`]) and the receiver returns space by writing its
//! [`CreditWord`] into the sender's credit slot. The sender stages outgoing bytes in a local
//! *staging ring* that mirrors the peer's ring byte for byte (stream position `p` lives at
//! offset `p % ring_len` in both), so a record's bytes are written once into staging and
//! posted from there.
//!
//! The core never touches memory or the network: the driver asks it for room
//! ([`Conn::send_room`]), copies the application's bytes into staging itself, calls
//! [`Conn::commit`], and posts whatever [`Conn::poll_op`] returns; it feeds completions back
//! ([`Conn::on_recv`], [`Conn::on_send_complete`], [`Conn::on_credit_word`]) and reads
//! received bytes where [`Conn::front`] says.
//!
//! # Credits without a round trip per message
//!
//! Two limits bound a sender: ring space (`ring_len − (committed − peer_consumed)`) and the
//! receive requests the peer has posted (each WRITE with immediate uses one). The receiver
//! reposts receives as soon as it sees completions and reports both totals with a plain RDMA
//! WRITE of its credit word — which costs the sender nothing — whenever a quarter of the ring
//! or of the receive queue has been returned, or the sender is running low. Only when a sender
//! is actually blocked does it say so (a *starved notice*: a credit-slot write with immediate
//! carrying its view of the counter it waits on), and only then does the receiver answer with
//! a credit write *with* immediate, which wakes it: at once if the sender's view is stale (a
//! plain credit write was still in flight), else when a quarter of the ring or half the
//! receive queue can be returned. A wake-up is sent only when it gives the sender something
//! new, so notices and wake-ups never feed each other. Four receive credits in each direction
//! are reserved for control records (one notice, one wake-up, one rendezvous-done and the
//! close record can be outstanding at a time), so they always get through.
//!
//! # Rendezvous
//!
//! A large zero-copy write is announced by a descriptor record in the ring and fetched by the
//! receiver with RDMA READ (see [`crate::rendezvous`]): [`Conn::rendezvous_room`] /
//! [`Conn::commit_rendezvous`] on the sending side, [`Conn::accept_rendezvous`] and the
//! `rendezvous_*` READ planning on the receiving side, whose done record is sent ahead of any
//! pending data (the sender waits for it and may not be reading).
//!
//! # Ring restarts
//!
//! Stream position `p` lives at ring offset `p % ring_len`, so a connection that keeps sending
//! cycles through its whole ring (and the sender's staging mirror) however small its messages
//! are: after enough traffic every page of both is resident, a megabyte or two per soft
//! connection and side that a socket never holds. With `ConnConfig::ring_restarts` (protocol
//! version 4 on both sides), a sender that knows the receiver has read everything it sent
//! (the last credit word reported `consumed == committed`) starts its next ring-bytes record
//! at offset 0 instead: it skips its position to the next multiple of the ring length and sets
//! the record's restart flag ([`crate::record`]), and the receiver, which has read everything
//! too (that is what it reported), skips its own position the same way when the record
//! arrives. Both count the skipped bytes as consumed and reported, so no credit write is spent
//! on them. Request/response traffic then keeps using the start of the ring: the pages it
//! touches are those of the largest burst between two credit words, and they stay in cache.
//!
//! # Batching (corking)
//!
//! With corking on, a record is posted at once when fewer than `cork_depth` records are in
//! flight (so an idle connection adds no latency), and otherwise stays pending: later writes
//! merge into it until a completion lets it go, so a busy connection sends few large records.

use std::collections::VecDeque;

use crate::credit::{Counter, CreditWord, CONSUMED_WIDTH, POSTED_WIDTH};
use crate::record::{Imm, RecordKind, MAX_RECORD_LEN};
use crate::rendezvous::{
    BounceGeometry, Descriptor, DescriptorError, Incoming, ReadRequest, DESCRIPTOR_LEN, NUMBER_MASK,
};

/// Receive credits (in each direction) kept for control records: a starved notice, a
/// wake-up, a rendezvous-done and the close record.
pub const RESERVED_RECVS: u64 = 4;
/// A record held back by [`Conn::set_hold`] leaves once it has this many bytes.
pub const HOLD_LIMIT: u32 = 64 << 10;
/// Smallest receive queue a connection accepts.
pub const MIN_RECV_DEPTH: u32 = 8;
/// Smallest send queue a connection accepts (a record that wraps the ring takes two).
pub const MIN_SEND_DEPTH: u32 = 8;

/// Sizes agreed at set-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnConfig {
    /// Bytes in this side's receive ring.
    pub local_ring: u32,
    /// Bytes in the peer's receive ring (and in this side's staging mirror).
    pub peer_ring: u32,
    /// Receive requests this side posts before the first record (and keeps posted).
    pub local_recv_depth: u32,
    /// Receive requests the peer posts before the first record.
    pub peer_recv_depth: u32,
    /// Send queue depth of this side's queue pair.
    pub send_depth: u32,
    /// Largest record this side sends (further limited by the peer's ring).
    pub max_record: u32,
    /// Records in flight before new ones are held back and merged; 0 turns corking off.
    pub cork_depth: u32,
    /// The peer takes ring restarts (protocol version 4; see the module docs): this side may
    /// start a record at the beginning of the peer's ring once the peer has read everything.
    /// A receiver takes them whatever this says.
    pub ring_restarts: bool,
}

impl ConnConfig {
    /// Checks the sizes: rings of at least 64 bytes, queues at least the minimums.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.local_ring < 64 || self.peer_ring < 64 {
            return Err("rings must hold at least 64 bytes");
        }
        if self.local_recv_depth < MIN_RECV_DEPTH || self.peer_recv_depth < MIN_RECV_DEPTH {
            return Err("receive queues must hold at least 8 requests");
        }
        if self.send_depth < MIN_SEND_DEPTH {
            return Err("send queues must hold at least 8 requests");
        }
        Ok(())
    }
}

/// A work request the driver must post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Post this many receive requests (no scatter entries: payloads land in the ring).
    PostRecv {
        /// How many.
        count: u32,
    },
    /// RDMA WRITE of staging bytes `[pos, pos+len)` (offsets `pos % peer_ring`, never wrapping)
    /// to the same offsets of the peer's ring, with an immediate if `imm` is set.
    Write {
        /// Work request id (a sequence number).
        seq: u64,
        /// Stream position of the first byte.
        pos: u64,
        /// Bytes.
        len: u32,
        /// Immediate, for the last part of a record.
        imm: Option<u32>,
        /// Ask for a completion.
        signaled: bool,
    },
    /// RDMA WRITE of `word` into the peer's credit slot (inline), with an immediate if set.
    Credit {
        /// Work request id.
        seq: u64,
        /// The credit word.
        word: CreditWord,
        /// Immediate (a wake-up, starved notice or close).
        imm: Option<u32>,
        /// Ask for a completion.
        signaled: bool,
    },
}

/// A violation of the protocol by the peer; the connection cannot continue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    /// The immediate has an unknown kind.
    BadImmediate(u32),
    /// A record would overwrite bytes not yet consumed.
    RingOverrun,
    /// More records arrived than receives were posted.
    TooManyRecords,
    /// Bytes arrived after the peer's close record.
    DataAfterClose,
    /// A zero-length record that must carry bytes, or a byte count that disagrees with the
    /// immediate.
    BadLength,
    /// A rendezvous descriptor that does not parse or announces an impossible buffer.
    BadRendezvous(DescriptorError),
    /// A rendezvous-done record for no rendezvous of this side (or the wrong one).
    UnexpectedRendezvousDone,
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProtocolError::BadImmediate(_) => "peer sent an immediate with an unknown record kind",
            ProtocolError::RingOverrun => "peer wrote past the free space of the receive ring",
            ProtocolError::TooManyRecords => "peer sent more records than receives were posted",
            ProtocolError::DataAfterClose => "peer sent data after closing",
            ProtocolError::BadLength => "peer sent a record whose length does not match",
            ProtocolError::BadRendezvous(err) => {
                return write!(f, "peer sent a malformed rendezvous descriptor ({err})");
            }
            ProtocolError::UnexpectedRendezvousDone => "peer finished a rendezvous this side never started",
        })
    }
}

impl std::error::Error for ProtocolError {}

/// What an arriving record changed, for the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Ring bytes (stream or message) became readable.
    Bytes,
    /// The peer rewrote this side's credit slot: read it and call [`Conn::on_credit_word`].
    /// (Also after a rendezvous-done record, which carries credit as every control record.)
    Credit,
    /// The peer closed its sending side.
    Closed,
    /// A one-sided write's notification value.
    Notify(u32),
}

/// The readable record at the head of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Front {
    /// Kind of the record.
    pub kind: RecordKind,
    /// Ring offset of the next unread byte.
    pub offset: u32,
    /// Bytes readable at `offset` without wrapping, within this record.
    pub contiguous: u32,
    /// Bytes left in this record.
    pub left: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    kind: RecordKind,
    /// Stream position of the record's first byte.
    pos: u64,
    /// Record length (what the immediate says).
    len: u32,
    /// Bytes already posted (the first part of a record that wraps the ring).
    posted: u32,
    /// The record restarts the peer's ring (its immediate carries the flag).
    restart: bool,
}

/// What a blocked peer waits for, with its view of the counter (mod 2^27).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerWants {
    Bytes(u32),
    Recvs(u32),
}

const VIEW_MASK: u64 = MAX_RECORD_LEN as u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CloseState {
    Open,
    Queued,
    Sent,
}

/// One side of an RDMA stream connection.
#[derive(Clone, Debug)]
pub struct Conn {
    config: ConnConfig,
    next_seq: u64,
    completed_seq: u64,
    last_signaled: u64,
    // Sending.
    committed: u64,
    /// Ring restarts this side made (see the module docs).
    restarts: u64,
    peer_consumed: Counter,
    peer_recvs: Counter,
    imms_sent: u64,
    pending: VecDeque<Pending>,
    records_in_flight: VecDeque<u64>,
    imms_in_flight: VecDeque<u64>,
    force_flush: bool,
    /// Writes are held back whole (TCP_CORK's meaning, see [`Conn::set_hold`]).
    hold: bool,
    close: CloseState,
    notice_wanted: Option<Imm>,
    notice_outstanding: bool,
    // Receiving.
    head: u64,
    tail: u64,
    records: VecDeque<(RecordKind, u32)>,
    reported_consumed: u64,
    recvs_posted: u64,
    recvs_reported: u64,
    repost_pending: u32,
    imms_received: u64,
    peer_wants: Option<PeerWants>,
    peer_closed: bool,
    notifies: VecDeque<u32>,
    // Rendezvous.
    /// Number of this side's rendezvous the peer has not finished fetching.
    outgoing: Option<u32>,
    rendezvous_sent: u32,
    /// The rendezvous at the head of the received stream, once its descriptor was accepted.
    incoming: Option<Incoming>,
    rendezvous_received: u32,
    /// A done record to send (the number of the peer's rendezvous).
    done_wanted: Option<u32>,
}

impl Conn {
    /// A connection whose initial receives (`local_recv_depth`) the driver posts itself
    /// before the peer may send.
    pub fn new(config: ConnConfig) -> Self {
        Self {
            config,
            next_seq: 1,
            completed_seq: 0,
            last_signaled: 0,
            committed: 0,
            restarts: 0,
            peer_consumed: Counter(0),
            peer_recvs: Counter(u64::from(config.peer_recv_depth)),
            imms_sent: 0,
            pending: VecDeque::new(),
            records_in_flight: VecDeque::new(),
            imms_in_flight: VecDeque::new(),
            force_flush: false,
            hold: false,
            close: CloseState::Open,
            notice_wanted: None,
            notice_outstanding: false,
            head: 0,
            tail: 0,
            records: VecDeque::new(),
            reported_consumed: 0,
            recvs_posted: u64::from(config.local_recv_depth),
            recvs_reported: u64::from(config.local_recv_depth),
            repost_pending: 0,
            imms_received: 0,
            peer_wants: None,
            peer_closed: false,
            notifies: VecDeque::new(),
            outgoing: None,
            rendezvous_sent: 0,
            incoming: None,
            rendezvous_received: 0,
            done_wanted: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ConnConfig {
        &self.config
    }

    // ---- sending -------------------------------------------------------------------------

    fn peer_ring(&self) -> u64 {
        u64::from(self.config.peer_ring)
    }

    fn max_record(&self) -> u32 {
        self.config.max_record.min(self.config.peer_ring).clamp(1, MAX_RECORD_LEN)
    }

    /// Ring bytes the peer has room for, as far as this side knows.
    pub fn ring_free(&self) -> u64 {
        self.peer_ring() - (self.committed - self.peer_consumed.0)
    }

    /// Whether the next record of `kind` starts over at the beginning of the peer's ring: the
    /// peer takes restarts, the record carries ring bytes, nothing is pending, the peer has
    /// reported reading every byte committed, and the position is not at the beginning already.
    fn restarts_ring(&self, kind: RecordKind) -> bool {
        self.config.ring_restarts
            && kind.uses_ring()
            && self.pending.is_empty()
            && self.committed == self.peer_consumed.0
            && !self.committed.is_multiple_of(self.peer_ring())
    }

    /// Ring restarts this side made so far (see the module docs).
    pub fn ring_restarts(&self) -> u64 {
        self.restarts
    }

    /// Receive credits not yet spoken for (records pending or control records queued need
    /// one each).
    fn imms_available(&self) -> u64 {
        let spoken = self.imms_sent
            + self.pending.len() as u64
            + u64::from(self.close == CloseState::Queued)
            + u64::from(self.notice_wanted.is_some())
            + u64::from(self.done_wanted.is_some());
        self.peer_recvs.0.saturating_sub(spoken)
    }

    fn mergeable(&self, kind: RecordKind) -> Option<&Pending> {
        self.pending.back().filter(|last| {
            kind == RecordKind::Data
                && last.kind == RecordKind::Data
                && last.posted == 0
                && last.len < self.max_record()
        })
    }

    /// How many bytes of a record of `kind` may be committed now (at most `want`), and the
    /// staging offset where they start. `None` means no room; for a message part,
    /// `Some((0, _))` means an empty record may be committed.
    pub fn send_room(&self, kind: RecordKind, want: usize) -> Option<(u32, u32)> {
        if self.close != CloseState::Open {
            return None;
        }
        let (free, offset) = if self.restarts_ring(kind) {
            (self.peer_ring(), 0)
        } else {
            (self.ring_free(), (self.committed % self.peer_ring()) as u32)
        };
        let cap = match self.mergeable(kind) {
            Some(last) => self.max_record() - last.len,
            None if self.imms_available() > RESERVED_RECVS => self.max_record(),
            None => return None,
        };
        let grant = (want as u64).min(free).min(u64::from(cap)) as u32;
        if grant == 0 && (want > 0 || !kind.is_message()) {
            return None;
        }
        if kind == RecordKind::Rendezvous && grant < DESCRIPTOR_LEN {
            // A descriptor is never split.
            return None;
        }
        Some((grant, offset))
    }

    /// Commits `len` staged bytes as (part of) a record of `kind`. The caller got the room
    /// from [`Conn::send_room`] just before, with the same kind, and copied the bytes to the
    /// staging offsets it named (wrapping at the end of the ring).
    pub fn commit(&mut self, kind: RecordKind, len: u32) {
        let restart = len > 0 && self.restarts_ring(kind);
        if restart {
            // The peer has read up to `committed`; both sides skip to the ring's start and count
            // the skipped bytes as consumed (the peer does on the record's flag).
            let ring = self.peer_ring();
            let skip = ring - self.committed % ring;
            self.committed += skip;
            self.peer_consumed.0 += skip;
            self.restarts += 1;
        }
        let pos = self.committed;
        self.committed += u64::from(len);
        if kind == RecordKind::Data && len == 0 {
            return;
        }
        let max_record = self.max_record();
        if let Some(last) = self.pending.back_mut() {
            if kind == RecordKind::Data
                && last.kind == RecordKind::Data
                && last.posted == 0
                && last.len < max_record
            {
                last.len += len;
                return;
            }
        }
        self.pending.push_back(Pending { kind, pos, len, posted: 0, restart });
    }

    /// Says that the application wants to send more but [`Conn::send_room`] refused: the
    /// peer is told once (a starved notice) so that it wakes this side when there is room.
    ///
    /// Not while records are pending or any write with immediate is still in flight: their
    /// completions wake this side anyway, and a notice sent only once the peer has seen every
    /// earlier record lets the peer judge exactly what the sender is missing.
    pub fn note_blocked(&mut self) {
        self.note_blocked_for(1);
    }

    /// Like [`Conn::note_blocked`], for a send that needs `need` ring bytes in one piece (a
    /// rendezvous descriptor is never split): with fewer free the notice asks for bytes, or
    /// the peer would be asked for receive credits this side does not lack and never wake it.
    pub fn note_blocked_for(&mut self, need: u32) {
        if self.notice_outstanding
            || self.notice_wanted.is_some()
            || self.close != CloseState::Open
            || !self.pending.is_empty()
            || !self.imms_in_flight.is_empty()
        {
            return;
        }
        let notice = if self.ring_free() < u64::from(need.max(1)) {
            Imm::new(RecordKind::StarvedBytes, (self.peer_consumed.0 & VIEW_MASK) as u32)
        } else {
            Imm::new(RecordKind::StarvedRecvs, (self.peer_recvs.0 & VIEW_MASK) as u32)
        };
        self.notice_wanted = Some(notice);
    }

    /// Queues the close record (after everything committed). Idempotent.
    pub fn shutdown(&mut self) {
        if self.close == CloseState::Open {
            self.close = CloseState::Queued;
            self.notice_wanted = None;
        }
    }

    /// Whether this side has sent (or queued) its close record.
    pub fn is_shut_down(&self) -> bool {
        self.close != CloseState::Open
    }

    /// Whether every committed byte and the close record (if any) have been posted and
    /// acknowledged. (Records are always signaled; a plain credit write posted after the last
    /// signaled request carries no data and is not waited for.)
    pub fn is_flushed(&self) -> bool {
        self.pending.is_empty()
            && self.close != CloseState::Queued
            && self.notice_wanted.is_none()
            && self.done_wanted.is_none()
            && self.completed_seq >= self.last_signaled
    }

    /// Whether records are waiting to be posted (held back by corking, the send queue or
    /// receive credits).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.close == CloseState::Queued
    }

    /// Whether this side needs the acknowledgement of its own requests to go on: records or
    /// control messages wait to be posted, the send queue is full (a credit return would wait
    /// for room), or the peer is still fetching a rendezvous. A reader that waits while this is
    /// false needs only what the peer sends (see `lightpath_verbs::WakeFor::Arrivals`).
    pub fn needs_acks(&self) -> bool {
        self.has_pending()
            || self.sq_free() == 0
            || self.notice_wanted.is_some()
            || self.done_wanted.is_some()
            || self.rendezvous_outstanding()
    }

    /// Total bytes committed (the stream position of the next byte).
    pub fn bytes_committed(&self) -> u64 {
        self.committed
    }

    /// Records (writes with immediate) posted so far, control records included.
    pub fn records_sent(&self) -> u64 {
        self.imms_sent
    }

    /// Turns corking on (records in flight before new ones are held back) or off (0).
    pub fn set_cork_depth(&mut self, depth: u32) {
        self.config.cork_depth = depth;
        if depth == 0 {
            self.uncork();
        }
    }

    /// Holds data records back (`true`), whatever is in flight, until this is turned off or
    /// [`Conn::uncork`] (flush, close) lets them go; later writes merge into the held record.
    /// TCP_CORK's meaning, for a caller that writes a response in parts (a header, then a
    /// body) and wants them to leave as one. A held record leaves anyway once it reaches
    /// [`HOLD_LIMIT`] bytes (or the largest record), so a writer that fills the ring is never
    /// stuck behind its own hold, as TCP_CORK sends full segments.
    pub fn set_hold(&mut self, hold: bool) {
        self.hold = hold;
        if !hold {
            self.uncork();
        }
    }

    /// Whether data records are held back ([`Conn::set_hold`]).
    pub fn held(&self) -> bool {
        self.hold
    }

    /// Posts corked records regardless of the cork depth (for `flush()` and close).
    pub fn uncork(&mut self) {
        if !self.pending.is_empty() {
            self.force_flush = true;
        }
    }

    fn sq_free(&self) -> u64 {
        u64::from(self.config.send_depth).saturating_sub(self.next_seq - 1 - self.completed_seq)
    }

    fn take_seq(&mut self, force_signal: bool) -> (u64, bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        // Signal at least every half queue, so a full send queue always has a completion
        // coming that frees it.
        let signaled = force_signal || seq - self.last_signaled >= u64::from(self.config.send_depth / 2);
        if signaled {
            self.last_signaled = seq;
        }
        (seq, signaled)
    }

    /// The next work request to post, if any. Call until `None` after every change.
    pub fn poll_op(&mut self) -> Option<Op> {
        // Receives are reposted in small batches (one lock and one call for several), at once
        // when the peer is waiting or running low.
        let batch = (self.config.local_recv_depth / 8).max(1);
        let peer_view = self.recvs_posted - self.imms_received;
        let urgent = self.peer_wants.is_some() || peer_view <= u64::from(self.config.local_recv_depth / 2);
        if self.repost_pending >= batch || (self.repost_pending > 0 && urgent) {
            let count = self.repost_pending;
            self.repost_pending = 0;
            self.recvs_posted += u64::from(count);
            return Some(Op::PostRecv { count });
        }
        if self.sq_free() == 0 {
            return None;
        }
        self.done_op()
            .or_else(|| self.wake_op())
            .or_else(|| self.record_op())
            .or_else(|| self.control_op())
            .or_else(|| self.silent_credit_op())
    }

    fn credit_word(&mut self) -> CreditWord {
        self.reported_consumed = self.head;
        self.recvs_reported = self.recvs_posted;
        CreditWord::new(self.head, self.recvs_posted)
    }

    fn record_op(&mut self) -> Option<Op> {
        let front = *self.pending.front()?;
        let held =
            self.hold && front.kind == RecordKind::Data && front.len < HOLD_LIMIT.min(self.max_record());
        let behind =
            self.config.cork_depth > 0 && self.records_in_flight.len() >= self.config.cork_depth as usize;
        let corked = front.posted == 0 && !self.force_flush && (held || behind);
        if corked || self.imms_sent >= self.peer_recvs.0 {
            return None;
        }
        let ring = self.peer_ring();
        let start = front.pos + u64::from(front.posted);
        let left = front.len - front.posted;
        let part = (ring - start % ring).min(u64::from(left)) as u32;
        if part < left {
            // The record wraps the ring: the first part goes without immediate, the rest (on
            // the next call) carries it. Both need a send-queue slot.
            if self.sq_free() < 2 {
                return None;
            }
            let (seq, signaled) = self.take_seq(false);
            if let Some(pending) = self.pending.front_mut() {
                pending.posted += part;
            }
            return Some(Op::Write { seq, pos: start, len: part, imm: None, signaled });
        }
        self.pending.pop_front();
        if self.pending.is_empty() {
            self.force_flush = false;
        }
        let (seq, signaled) = self.take_seq(true);
        self.records_in_flight.push_back(seq);
        self.imms_in_flight.push_back(seq);
        self.imms_sent += 1;
        let imm = Imm::new(front.kind, front.len).restarting(front.restart).encode();
        Some(Op::Write { seq, pos: start, len: part, imm: Some(imm), signaled })
    }

    /// Close record and starved notice: credit-slot writes with immediate, after every record.
    fn control_op(&mut self) -> Option<Op> {
        if !self.pending.is_empty() || self.imms_sent >= self.peer_recvs.0 {
            return None;
        }
        let imm = if self.close == CloseState::Queued {
            self.close = CloseState::Sent;
            Imm::new(RecordKind::Close, 0)
        } else if let Some(notice) = self.notice_wanted.take() {
            self.notice_outstanding = true;
            notice
        } else {
            return None;
        };
        self.imms_sent += 1;
        let word = self.credit_word();
        let (seq, signaled) = self.take_seq(true);
        self.imms_in_flight.push_back(seq);
        Some(Op::Credit { seq, word, imm: Some(imm.encode()), signaled })
    }

    /// The rendezvous-done record: ahead of pending records, because the peer is blocked until
    /// it arrives and may not read the ring (so those records may wait for room a long time).
    /// It uses a reserved receive credit: at most one is outstanding.
    fn done_op(&mut self) -> Option<Op> {
        let number = self.done_wanted?;
        if self.imms_sent >= self.peer_recvs.0 {
            return None;
        }
        self.done_wanted = None;
        self.imms_sent += 1;
        let word = self.credit_word();
        let (seq, signaled) = self.take_seq(true);
        self.imms_in_flight.push_back(seq);
        let imm = Imm::new(RecordKind::RendezvousDone, number).encode();
        Some(Op::Credit { seq, word, imm: Some(imm), signaled })
    }

    /// A credit write with immediate, when the peer waits for room that now exists.
    fn wake_op(&mut self) -> Option<Op> {
        let wants = self.peer_wants?;
        let worth_it = match wants {
            PeerWants::Bytes(view) => {
                let gain = self.head.wrapping_sub(u64::from(view)) & VIEW_MASK;
                gain > 0 && (gain >= u64::from(self.config.local_ring) / 4 || self.head == self.tail)
            }
            PeerWants::Recvs(view) => {
                let gain = self.recvs_posted.wrapping_sub(u64::from(view)) & VIEW_MASK;
                // The notice used one receive and the sender may owe one wake-up of its own;
                // it needs more than the reserve beyond those.
                gain >= u64::from(self.config.local_recv_depth / 2).max(RESERVED_RECVS + 3)
            }
        };
        if !worth_it || self.imms_sent >= self.peer_recvs.0 {
            return None;
        }
        self.peer_wants = None;
        self.imms_sent += 1;
        let word = self.credit_word();
        let (seq, signaled) = self.take_seq(true);
        self.imms_in_flight.push_back(seq);
        Some(Op::Credit { seq, word, imm: Some(Imm::new(RecordKind::Credit, 0).encode()), signaled })
    }

    /// A plain credit write, when enough has been returned to be worth telling.
    fn silent_credit_op(&mut self) -> Option<Op> {
        let ring = u64::from(self.config.local_ring);
        let depth = u64::from(self.config.local_recv_depth);
        let freed = self.head - self.reported_consumed;
        let unreported = self.recvs_posted - self.recvs_reported;
        let peer_view = self.recvs_reported - self.imms_received;
        // Receives returned in a quarter of the queue are reported once the reader has read
        // what arrived (a pump reposts them before the application reads): the word then says
        // that everything was read, and lets the sender restart the ring (see the module
        // docs); a reader that does not read still reports them once the sender runs low.
        let read_all = self.head == self.tail;
        let due = freed >= ring / 4
            || (unreported >= depth / 4 && read_all)
            || (unreported > 0 && peer_view <= depth / 2);
        if !due || (freed == 0 && unreported == 0) {
            return None;
        }
        let word = self.credit_word();
        let (seq, signaled) = self.take_seq(false);
        Some(Op::Credit { seq, word, imm: None, signaled })
    }

    /// A signaled send request completed successfully (so did every earlier one).
    pub fn on_send_complete(&mut self, seq: u64) {
        if seq > self.completed_seq && seq < self.next_seq {
            self.completed_seq = seq;
        }
        while self.records_in_flight.front().is_some_and(|&s| s <= self.completed_seq) {
            self.records_in_flight.pop_front();
        }
        while self.imms_in_flight.front().is_some_and(|&s| s <= self.completed_seq) {
            self.imms_in_flight.pop_front();
        }
        if let Some(incoming) = self.incoming.as_mut() {
            incoming.prune(self.completed_seq);
        }
        self.check_fetched();
    }

    /// The local credit slot holds `word` (written by the peer). Returns whether it gave this
    /// side more room.
    pub fn on_credit_word(&mut self, word: CreditWord) -> bool {
        let bytes = self.peer_consumed.advance(word.consumed, CONSUMED_WIDTH);
        // A buggy or hostile peer cannot claim more than was sent.
        if self.peer_consumed.0 > self.committed {
            self.peer_consumed.0 = self.committed;
        }
        let recvs = self.peer_recvs.advance(word.recvs_posted, POSTED_WIDTH);
        let progressed = bytes > 0 || recvs > 0;
        if progressed {
            self.notice_outstanding = false;
        }
        progressed
    }

    // ---- receiving -----------------------------------------------------------------------

    /// A receive completed: the peer's record with immediate `imm` wrote `byte_len` bytes.
    pub fn on_recv(&mut self, imm: u32, byte_len: u32) -> Result<Arrival, ProtocolError> {
        let imm = Imm::decode(imm).map_err(|bad| ProtocolError::BadImmediate(bad.0))?;
        if self.imms_received >= self.recvs_posted {
            return Err(ProtocolError::TooManyRecords);
        }
        self.imms_received += 1;
        self.repost_pending += 1;
        match imm.kind {
            RecordKind::Data | RecordKind::MsgPart | RecordKind::MsgEnd | RecordKind::Rendezvous => {
                if self.peer_closed {
                    return Err(ProtocolError::DataAfterClose);
                }
                if byte_len > imm.len || (imm.len == 0 && imm.kind != RecordKind::MsgEnd) {
                    return Err(ProtocolError::BadLength);
                }
                if imm.kind == RecordKind::Rendezvous && imm.len != DESCRIPTOR_LEN {
                    return Err(ProtocolError::BadLength);
                }
                let ring = u64::from(self.config.local_ring);
                if imm.restart {
                    // The sender restarts only once this side reported reading everything;
                    // unread bytes here would be overwritten.
                    if self.head != self.tail {
                        return Err(ProtocolError::RingOverrun);
                    }
                    // Skipped to the ring's start: consumed, and as good as reported (the
                    // sender counted them itself).
                    let skip = (ring - self.tail % ring) % ring;
                    self.tail += skip;
                    self.head += skip;
                    self.reported_consumed += skip;
                }
                if self.tail - self.head + u64::from(imm.len) > ring {
                    return Err(ProtocolError::RingOverrun);
                }
                self.tail += u64::from(imm.len);
                match self.records.back_mut() {
                    Some((RecordKind::Data, len))
                        if imm.kind == RecordKind::Data && *len <= u32::MAX - imm.len =>
                    {
                        *len += imm.len;
                    }
                    _ => self.records.push_back((imm.kind, imm.len)),
                }
                Ok(Arrival::Bytes)
            }
            RecordKind::Credit => {
                self.notice_outstanding = false;
                Ok(Arrival::Credit)
            }
            RecordKind::StarvedBytes => {
                self.peer_wants = Some(PeerWants::Bytes(imm.len));
                Ok(Arrival::Credit)
            }
            RecordKind::StarvedRecvs => {
                self.peer_wants = Some(PeerWants::Recvs(imm.len));
                Ok(Arrival::Credit)
            }
            RecordKind::Close => {
                self.peer_closed = true;
                Ok(Arrival::Closed)
            }
            RecordKind::Notify => {
                self.notifies.push_back(imm.len);
                Ok(Arrival::Notify(imm.len))
            }
            RecordKind::RendezvousDone => match self.outgoing {
                Some(number) if number == imm.len => {
                    self.outgoing = None;
                    Ok(Arrival::Credit)
                }
                _ => Err(ProtocolError::UnexpectedRendezvousDone),
            },
        }
    }

    /// The record at the head of the ring, if any bytes (or an empty message end) are there.
    /// A rendezvous stays at the head (kind [`RecordKind::Rendezvous`]) until every byte it
    /// announced has been handed out; `left` is then the descriptor bytes not yet accepted
    /// (all of them, or 0 once [`Conn::accept_rendezvous`] took them).
    pub fn front(&self) -> Option<Front> {
        let &(kind, left) = self.records.front()?;
        let ring = u64::from(self.config.local_ring);
        let offset = self.head % ring;
        let contiguous = (ring - offset).min(u64::from(left)) as u32;
        Some(Front { kind, offset: offset as u32, contiguous, left })
    }

    /// Marks `n` bytes of the front record read (at most its `contiguous` bytes). A record
    /// read to its end is dropped; returns `true` if that record was a message end.
    pub fn consume(&mut self, n: u32) -> bool {
        let Some((kind, left)) = self.records.front_mut() else { return false };
        if *kind == RecordKind::Rendezvous {
            // Leaves only through the rendezvous calls.
            return false;
        }
        let n = n.min(*left);
        *left -= n;
        self.head += u64::from(n);
        if *left == 0 {
            let kind = *kind;
            self.records.pop_front();
            return kind == RecordKind::MsgEnd;
        }
        false
    }

    /// Ring bytes read so far, the ring's skipped ends included: the count this side's credit
    /// words report.
    pub fn bytes_consumed(&self) -> u64 {
        self.head
    }

    /// Ring bytes received and not yet read.
    pub fn readable_bytes(&self) -> u64 {
        self.tail - self.head
    }

    /// Whether the peer closed its side and everything before the close has been read.
    pub fn at_eof(&self) -> bool {
        self.peer_closed && self.records.is_empty()
    }

    /// Whether the peer's close record has arrived.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Records received so far (every kind).
    pub fn records_received(&self) -> u64 {
        self.imms_received
    }

    /// The next notification from a one-sided write, if any.
    pub fn take_notify(&mut self) -> Option<u32> {
        self.notifies.pop_front()
    }

    /// Queues a notification record for a one-sided write the driver posts itself (the driver
    /// must have checked [`Conn::can_notify`]). Returns the immediate to use and the sequence
    /// number of the write.
    pub fn notify_seq(&mut self, value: u32) -> (u32, u64) {
        self.imms_sent += 1;
        let (seq, _) = self.take_seq(true);
        self.imms_in_flight.push_back(seq);
        (Imm::new(RecordKind::Notify, value).encode(), seq)
    }

    /// Whether the signaled request `seq` has completed.
    pub fn is_complete(&self, seq: u64) -> bool {
        self.completed_seq >= seq
    }

    /// A one-sided write of the driver's own (no immediate) needs a send-queue slot.
    pub fn plain_seq(&mut self) -> Option<u64> {
        (self.sq_free() > 0).then(|| self.take_seq(true).0)
    }

    /// Whether this side is down to its reserved receive credits at the peer: the driver should
    /// read its credit slot, because the peer returns credits with plain writes that raise no
    /// completion, and a side that only reads (never asking for room) would otherwise not see
    /// them before its control records — done records, wake-ups — run out.
    pub fn credit_low(&self) -> bool {
        self.peer_recvs.0.saturating_sub(self.imms_sent) <= RESERVED_RECVS
    }

    /// Whether a notification record may be sent now (a send-queue slot and a receive credit
    /// beyond the reserve).
    pub fn can_notify(&self) -> bool {
        self.sq_free() > 0 && self.imms_available() > RESERVED_RECVS
    }

    // ---- rendezvous ----------------------------------------------------------------------

    /// The staging offset for a rendezvous descriptor, if one may be committed now: the whole
    /// descriptor fits, a receive credit beyond the reserve is free, and no earlier rendezvous
    /// of this side is still being fetched.
    pub fn rendezvous_room(&self) -> Option<u32> {
        if self.outgoing.is_some() {
            return None;
        }
        self.send_room(RecordKind::Rendezvous, DESCRIPTOR_LEN as usize).map(|(_, offset)| offset)
    }

    /// Commits the descriptor the driver staged at [`Conn::rendezvous_room`]'s offset (it is
    /// posted at once, never corked). Returns the rendezvous' number.
    pub fn commit_rendezvous(&mut self) -> u32 {
        self.commit(RecordKind::Rendezvous, DESCRIPTOR_LEN);
        self.uncork();
        let number = self.rendezvous_sent & NUMBER_MASK;
        self.rendezvous_sent = self.rendezvous_sent.wrapping_add(1);
        self.outgoing = Some(number);
        number
    }

    /// Whether the peer is still fetching this side's rendezvous (its buffer is in use).
    pub fn rendezvous_outstanding(&self) -> bool {
        self.outgoing.is_some()
    }

    /// Takes the descriptor of the rendezvous at the head of the stream: `bytes` are the
    /// `front().left` ring bytes at `front().offset` (wrapping at the end of the ring). A
    /// descriptor that does not describe a possible buffer is a protocol error. `Ok(None)`: no
    /// unaccepted rendezvous is at the head (nothing changes).
    pub fn accept_rendezvous(&mut self, bytes: &[u8]) -> Result<Option<Descriptor>, ProtocolError> {
        let Some((RecordKind::Rendezvous, left)) = self.records.front_mut() else { return Ok(None) };
        if *left != DESCRIPTOR_LEN || self.incoming.is_some() {
            return Ok(None);
        }
        let desc = Descriptor::parse(bytes).map_err(ProtocolError::BadRendezvous)?;
        *left = 0;
        self.head += u64::from(DESCRIPTOR_LEN);
        self.incoming = Some(Incoming::new(desc, self.rendezvous_received));
        self.rendezvous_received = self.rendezvous_received.wrapping_add(1);
        Ok(Some(desc))
    }

    /// The rendezvous being fetched (after [`Conn::accept_rendezvous`]).
    pub fn incoming(&self) -> Option<&Incoming> {
        self.incoming.as_ref()
    }

    /// The next READ into the bounce region, if one is due: bytes left to request, a free
    /// slot, no direct read in progress, and a send-queue slot.
    pub fn rendezvous_prefetch(&mut self, geometry: BounceGeometry) -> Option<ReadRequest> {
        if self.sq_free() == 0 || !self.incoming.as_ref()?.wants_prefetch(geometry) {
            return None;
        }
        let (seq, _) = self.take_seq(true);
        Some(self.incoming.as_mut()?.start_prefetch(seq, geometry))
    }

    /// The bounced bytes readable now: `(offset in the bounce region, length)`.
    pub fn rendezvous_bounced(&self) -> Option<(u32, u32)> {
        self.incoming.as_ref()?.bounce_front(self.completed_seq)
    }

    /// Hands `n` bounced bytes (at most what [`Conn::rendezvous_bounced`] offered) to the
    /// application. Returns `true` if that finished the rendezvous (it leaves the stream).
    pub fn rendezvous_take_bounced(&mut self, n: u32) -> bool {
        if let Some(incoming) = self.incoming.as_mut() {
            incoming.take_bounced(n);
        }
        self.check_fetched();
        self.finish_if_delivered()
    }

    /// Starts reading up to `want` bytes of the rendezvous straight into the application's
    /// buffer (only once no bounced bytes are left: those come first). Returns how many bytes
    /// the direct read covers; 0 if none can start.
    pub fn rendezvous_begin_direct(&mut self, want: u64) -> u64 {
        self.incoming.as_mut().map_or(0, |incoming| incoming.begin_direct(want))
    }

    /// The next READ of the direct read (at most `chunk` bytes, at most `max_in_flight` of them
    /// outstanding), if one is due and a send-queue slot is free.
    pub fn rendezvous_direct(&mut self, chunk: u32, max_in_flight: usize) -> Option<ReadRequest> {
        let due = self.incoming.as_ref()?.direct_wants_more(self.completed_seq, max_in_flight);
        if !due || self.sq_free() == 0 {
            return None;
        }
        let (seq, _) = self.take_seq(true);
        self.incoming.as_mut()?.next_direct(seq, chunk)
    }

    /// Ends the direct read once every READ of it completed: the bytes it delivered, and
    /// whether that finished the rendezvous.
    pub fn rendezvous_finish_direct(&mut self) -> Option<(u64, bool)> {
        let delivered = self.incoming.as_mut()?.finish_direct(self.completed_seq)?;
        self.check_fetched();
        Some((delivered, self.finish_if_delivered()))
    }

    /// Whether `seq` is a READ of the rendezvous being fetched that has not completed (so a
    /// failed completion with that id is the peer's descriptor at fault, or the path).
    pub fn is_rendezvous_read(&self, seq: u64) -> bool {
        self.incoming.as_ref().is_some_and(|incoming| incoming.owns(seq))
    }

    /// Queues the done record once every byte of the rendezvous has been fetched.
    fn check_fetched(&mut self) {
        let completed = self.completed_seq;
        if let Some(incoming) = self.incoming.as_mut() {
            if incoming.is_fetched(completed) && incoming.mark_done_queued() {
                self.done_wanted = Some(incoming.number());
            }
        }
    }

    fn finish_if_delivered(&mut self) -> bool {
        if self.incoming.as_ref().is_some_and(Incoming::is_delivered) {
            self.incoming = None;
            self.records.pop_front();
            return true;
        }
        false
    }
}
