//! The responder side of a queue pair: reading the peer's ring, matching SENDs and WRITE
//! with immediate records to posted receives, copying payloads out, and publishing
//! acknowledgements (or a NAK).
//!
//! Everything read from the peer's ring is checked against what the protocol allows — message
//! numbers in sequence, pieces contiguous and within the message, lengths within the posted
//! receive — and anything else fails the link (the peer is broken or hostile).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use lightpath_verbs::{QpState, WcOpcode, WcStatus, WorkCompletion};

use super::link::LinkFailure;
use super::qp::{QpCore, MAX_MESSAGE};
use super::requester::{
    DESCRIPTOR, FLAG_IMM, FLAG_SOLICITED, KIND_SEND, KIND_SEND_DIRECT, KIND_WRITE_IMM, MAX_DESCRIPTORS,
    NAK_INVALID_REQUEST, NAK_REMOTE_OPERATION, NAK_RNR_EXCEEDED,
};
use super::sge::{self, Regions};
use super::wqe::RecvWqe;
use crate::ring::Record;
use crate::segment::{OFF_HEAD, RING_OFFSET};
use crate::sys::Mapping;

/// Most records handled per call, so one busy peer cannot monopolise the device lock.
const BATCH: usize = 64;

/// The RNR timer (IBA table 45): microseconds for each 5-bit code.
const RNR_TIMER_MICROS: [u64; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120,
    7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680,
    491_520,
];

fn rnr_timer(code: u8) -> Duration {
    Duration::from_micros(RNR_TIMER_MICROS[usize::from(code & 31)])
}

/// A message being received piece by piece.
#[derive(Debug)]
pub(crate) struct Assembly {
    pub(crate) recv: RecvWqe,
    message: u64,
    total: u32,
    received: u32,
    imm: Option<u32>,
    solicited: bool,
}

/// Receive-side bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct Responder {
    pub(crate) rq: VecDeque<RecvWqe>,
    pub(crate) assembling: Option<Assembly>,
    /// The number of the next message from the peer.
    expected: u64,
    /// Since when a message has been waiting for a receive to be posted.
    rnr_since: Option<Instant>,
    /// A NAK was sent: the peer's queue pair is in ERR and nothing more is read.
    halted: bool,
}

impl Responder {
    /// Whether a message waits for a receive.
    pub(crate) fn rnr_waiting(&self) -> bool {
        self.rnr_since.is_some()
    }
}

/// How a read of the ring ended.
enum Reading {
    /// Nothing more to read for now.
    Idle,
    /// A message waits for a receive; retry by the deadline if there is one.
    Waiting(Option<Instant>),
    /// The batch is used up with records left.
    More,
}

/// What handling one record led to.
enum Handled {
    /// Consumed; go on.
    Consumed,
    /// Left in the ring (no receive posted yet); retry later, by `deadline` at the latest.
    Waiting(Option<Instant>),
    /// Reading stops (a NAK was published, or this queue pair went to ERR).
    Stop,
}

impl QpCore {
    /// Reads what the peer sent, and notes when an RNR wait expires (`wake_at`) or that
    /// records are left for later (`more_to_read`).
    pub(crate) fn respond(&mut self, regions: &Regions) {
        (self.wake_at, self.more_to_read) = match self.read_ring(regions) {
            Reading::Idle => (None, false),
            Reading::Waiting(deadline) => (deadline, false),
            Reading::More => (None, true),
        };
    }

    fn read_ring(&mut self, regions: &Regions) -> Reading {
        if self.resp.halted {
            return Reading::Idle;
        }
        for _ in 0..BATCH {
            let Some(link) = self.link.as_mut() else { return Reading::Idle };
            let Some(peer) = link.peer.as_mut() else { return Reading::Idle };
            let own_head = link.outbox.word(OFF_HEAD);
            let record = match peer.consumer.peek(&peer.segment.ring(), &own_head) {
                Ok(Some(record)) => record,
                Ok(None) => return Reading::Idle,
                Err(_) => {
                    self.fail_link(LinkFailure::PeerCorrupt);
                    return Reading::Idle;
                }
            };
            let handled = match record.header.kind {
                KIND_SEND => self.on_send(&record, regions),
                KIND_WRITE_IMM => self.on_write_imm(&record),
                KIND_SEND_DIRECT => self.on_send_direct(&record, regions),
                _ => Err(LinkFailure::PeerCorrupt),
            };
            match handled {
                Ok(Handled::Consumed) => {
                    // Freed ring space is news to a sender sleeping on a full ring.
                    self.published = true;
                    if let Some(link) = self.link.as_mut() {
                        let own_head = link.outbox.word(OFF_HEAD);
                        if let Some(peer) = link.peer.as_mut() {
                            peer.consumer.release(&record, &own_head);
                        }
                    }
                }
                Ok(Handled::Waiting(deadline)) => return Reading::Waiting(deadline),
                Ok(Handled::Stop) => return Reading::Idle,
                Err(failure) => {
                    self.fail_link(failure);
                    return Reading::Idle;
                }
            }
        }
        Reading::More
    }

    /// A receive for message `message`, or what to do while there is none.
    fn take_recv(&mut self, message: u64) -> Result<RecvWqe, Handled> {
        if let Some(recv) = self.resp.rq.pop_front() {
            self.resp.rnr_since = None;
            return Ok(recv);
        }
        let rnr_retry = self
            .link
            .as_ref()
            .and_then(|link| link.peer.as_ref())
            .and_then(|peer| peer.segment.status_line().status)
            .map_or(7, |status| status.rnr_retry);
        if rnr_retry == 7 {
            self.resp.rnr_since.get_or_insert_with(Instant::now);
            return Err(Handled::Waiting(None));
        }
        let now = Instant::now();
        let since = *self.resp.rnr_since.get_or_insert(now);
        let limit = since + rnr_timer(self.min_rnr_timer) * u32::from(rnr_retry);
        if rnr_retry > 0 && now < limit {
            return Err(Handled::Waiting(Some(limit)));
        }
        // Retries exhausted: the requester fails the message; this queue pair is unharmed.
        self.resp.rnr_since = None;
        self.nak(message, NAK_RNR_EXCEEDED);
        Err(Handled::Stop)
    }

    /// Publishes a NAK for `message` and stops reading.
    fn nak(&mut self, message: u64, reason: u8) {
        if let Some(link) = &self.link {
            link.outbox.publish_nak(message, reason);
        }
        self.resp.halted = true;
        self.published = true;
        self.published_arrival = true;
    }

    /// Completes a receive and acknowledges the message.
    fn complete_recv(
        &mut self,
        recv: &RecvWqe,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        solicited: bool,
    ) {
        let mut wc = WorkCompletion::new(recv.wr_id, WcStatus::Success, opcode, self.qpn);
        wc.byte_len = byte_len;
        wc.imm_data = imm;
        wc.solicited = solicited;
        wc.src_qp = self.dest.map_or(0, |(_, qpn)| qpn);
        self.recv_cq.push(wc);
        self.completed = true;
        self.completed_arrival = true;
        self.resp.expected += 1;
        if let Some(link) = &self.link {
            link.outbox.publish_acked(self.resp.expected);
        }
        self.published = true;
    }

    /// A receive fails on our side: it completes with `status`, the requester gets a NAK with
    /// `reason`, and this queue pair goes to ERR (as a responder NIC does).
    fn fail_recv(&mut self, recv: &RecvWqe, message: u64, status: WcStatus, reason: u8) -> Handled {
        self.recv_cq.push(WorkCompletion::new(recv.wr_id, status, WcOpcode::Recv, self.qpn));
        self.completed = true;
        self.completed_arrival = true;
        self.nak(message, reason);
        self.enter_error(None);
        Handled::Stop
    }

    fn on_send(&mut self, record: &Record, regions: &Regions) -> Result<Handled, LinkFailure> {
        let header = record.header;
        let number = header.word2 as u32;
        let imm = (header.flags & FLAG_IMM != 0).then_some((header.word2 >> 32) as u32);
        let total = header.word3 as u32;
        let offset = (header.word3 >> 32) as u32;
        let piece_end = offset.checked_add(header.len).ok_or(LinkFailure::PeerCorrupt)?;
        if u64::from(total) > MAX_MESSAGE || piece_end > total || (header.len == 0 && total != 0) {
            return Err(LinkFailure::PeerCorrupt);
        }
        let mut assembly = match self.resp.assembling.take() {
            None => {
                if offset != 0 || number != self.resp.expected as u32 {
                    return Err(LinkFailure::PeerCorrupt);
                }
                let message = self.resp.expected;
                let recv = match self.take_recv(message) {
                    Ok(recv) => recv,
                    Err(handled) => return Ok(handled),
                };
                if u64::from(total) > recv.capacity {
                    return Ok(self.fail_recv(&recv, message, WcStatus::LocLenErr, NAK_INVALID_REQUEST));
                }
                if !sge::check(recv.sges.as_slice(), regions, self.pd, true) {
                    return Ok(self.fail_recv(&recv, message, WcStatus::LocProtErr, NAK_REMOTE_OPERATION));
                }
                Assembly {
                    recv,
                    message,
                    total,
                    received: 0,
                    imm,
                    solicited: header.flags & FLAG_SOLICITED != 0,
                }
            }
            Some(assembly) => {
                let continues = number == assembly.message as u32
                    && total == assembly.total
                    && offset == assembly.received
                    && imm == assembly.imm;
                if !continues {
                    return Err(LinkFailure::PeerCorrupt);
                }
                assembly
            }
        };
        if header.len > 0 {
            let Some(peer) = self.link.as_ref().and_then(|link| link.peer.as_ref()) else {
                // Kept, so the failure flushes the receive.
                self.resp.assembling = Some(assembly);
                return Err(LinkFailure::PeerGone);
            };
            let source = peer.segment.map();
            let base = RING_OFFSET + record.payload_offset;
            let copied = sge::pieces(
                assembly.recv.sges.as_slice(),
                regions,
                self.pd,
                true,
                u64::from(offset),
                u64::from(header.len),
                |region, region_offset, rel, len| {
                    Mapping::copy(&region.map, region_offset, source, base + rel, len)
                },
            );
            if !copied {
                // A region deregistered while the message was arriving.
                let message = assembly.message;
                return Ok(self.fail_recv(
                    &assembly.recv,
                    message,
                    WcStatus::LocProtErr,
                    NAK_REMOTE_OPERATION,
                ));
            }
        }
        assembly.received = piece_end;
        if assembly.received == assembly.total {
            self.complete_recv(&assembly.recv, WcOpcode::Recv, total, assembly.imm, assembly.solicited);
        } else {
            self.resp.assembling = Some(assembly);
        }
        Ok(Handled::Consumed)
    }

    /// A direct SEND: the record lists where the bytes are in the sender's regions; copy them
    /// straight into the receive (one copy), mapping the sender's regions as needed.
    fn on_send_direct(&mut self, record: &Record, regions: &Regions) -> Result<Handled, LinkFailure> {
        let header = record.header;
        let number = header.word2 as u32;
        let imm = (header.flags & FLAG_IMM != 0).then_some((header.word2 >> 32) as u32);
        let total = header.word3 as u32;
        let len = header.len as usize;
        let valid = self.resp.assembling.is_none()
            && number == self.resp.expected as u32
            && header.word3 >> 32 == 0
            && u64::from(total) <= MAX_MESSAGE
            && len > 0
            && len.is_multiple_of(DESCRIPTOR)
            && len <= DESCRIPTOR * MAX_DESCRIPTORS;
        if !valid {
            return Err(LinkFailure::PeerCorrupt);
        }
        // Copied out once; everything below works on this copy.
        let mut raw = [0u8; DESCRIPTOR * MAX_DESCRIPTORS];
        let peer = self.link.as_ref().and_then(|link| link.peer.as_ref()).ok_or(LinkFailure::PeerGone)?;
        if !peer.segment.map().read(RING_OFFSET + record.payload_offset, &mut raw[..len]) {
            return Err(LinkFailure::PeerCorrupt);
        }
        let mut descriptors = [(0u32, 0u64, 0u64); MAX_DESCRIPTORS];
        let count = len / DESCRIPTOR;
        let mut sum = 0u64;
        for (slot, bytes) in descriptors.iter_mut().zip(raw[..len].chunks_exact(DESCRIPTOR)) {
            let field = |range: std::ops::Range<usize>| {
                let mut word = [0u8; 8];
                word[..range.len()].copy_from_slice(&bytes[range]);
                u64::from_le_bytes(word)
            };
            *slot = (field(0..4) as u32, field(4..8), field(8..16));
            sum += slot.1;
        }
        if sum != u64::from(total) {
            return Err(LinkFailure::PeerCorrupt);
        }
        let message = self.resp.expected;
        let recv = match self.take_recv(message) {
            Ok(recv) => recv,
            Err(handled) => return Ok(handled),
        };
        if u64::from(total) > recv.capacity {
            return Ok(self.fail_recv(&recv, message, WcStatus::LocLenErr, NAK_INVALID_REQUEST));
        }
        if !sge::check(recv.sges.as_slice(), regions, self.pd, true) {
            return Ok(self.fail_recv(&recv, message, WcStatus::LocProtErr, NAK_REMOTE_OPERATION));
        }
        let dqpn = self.dest.map_or(0, |(_, qpn)| qpn);
        let mut position = 0u64;
        for &(rkey, piece, offset) in &descriptors[..count] {
            // On any failure the receive goes back to the front of the queue, where the NAK
            // leaves it posted or the link failure flushes it in order.
            let found = match self.link.as_mut() {
                Some(link) => link.peer_region(rkey, dqpn),
                None => Err(LinkFailure::PeerGone),
            };
            let source = match found {
                Ok(Some(source)) if offset.checked_add(piece).is_some_and(|end| end <= source.len) => source,
                Ok(Some(_)) | Err(_) => {
                    let failure = found.err().unwrap_or(LinkFailure::PeerCorrupt);
                    self.resp.rq.push_front(recv);
                    return Err(failure);
                }
                Ok(None) => {
                    // The sender's buffer is not registered (it broke the rule that buffers
                    // stay valid until completion): its request fails, the receive stays.
                    self.resp.rq.push_front(recv);
                    self.nak(message, NAK_REMOTE_OPERATION);
                    return Ok(Handled::Stop);
                }
            };
            let base = offset as usize;
            let copied = sge::pieces(
                recv.sges.as_slice(),
                regions,
                self.pd,
                true,
                position,
                piece,
                |region, region_offset, rel, n| {
                    Mapping::copy(&region.map, region_offset, &source.map, base + rel, n)
                },
            );
            if !copied {
                return Ok(self.fail_recv(&recv, message, WcStatus::LocProtErr, NAK_REMOTE_OPERATION));
            }
            position += piece;
        }
        let solicited = header.flags & FLAG_SOLICITED != 0;
        self.complete_recv(&recv, WcOpcode::Recv, total, imm, solicited);
        Ok(Handled::Consumed)
    }

    fn on_write_imm(&mut self, record: &Record) -> Result<Handled, LinkFailure> {
        let header = record.header;
        let number = header.word2 as u32;
        let total = header.word3 as u32;
        let valid = self.resp.assembling.is_none()
            && number == self.resp.expected as u32
            && header.len == 0
            && header.flags & FLAG_IMM != 0
            && u64::from(total) <= MAX_MESSAGE
            && header.word3 >> 32 == 0;
        if !valid {
            return Err(LinkFailure::PeerCorrupt);
        }
        if self.state == QpState::Err {
            return Ok(Handled::Stop);
        }
        let message = self.resp.expected;
        let recv = match self.take_recv(message) {
            Ok(recv) => recv,
            Err(handled) => return Ok(handled),
        };
        let imm = (header.word2 >> 32) as u32;
        let solicited = header.flags & FLAG_SOLICITED != 0;
        self.complete_recv(&recv, WcOpcode::RecvRdmaWithImm, total, Some(imm), solicited);
        Ok(Handled::Consumed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rnr_timer_codes() {
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(31 + 32), rnr_timer(31), "codes are 5-bit");
    }
}
