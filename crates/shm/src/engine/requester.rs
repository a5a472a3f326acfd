//! The requester side of a queue pair: carrying out send requests in order (ring messages,
//! one-sided operations on the peer's mapped regions), reading the peer's acknowledgements,
//! and retiring finished requests into completions.

use std::collections::VecDeque;

use lightpath_verbs::{AccessFlags, QpState, SendOp, WcStatus, WorkCompletion};

use super::link::{Link, LinkFailure};
use super::qp::QpCore;
use super::sge::{self, Regions};
use super::wqe::{Payload, SendWqe, Stage};
use crate::region::PeerRegion;
use crate::ring::{RecordHeader, RingError};
use crate::segment::{PeerStatus, OFF_HEAD};
use crate::sys::Mapping;

/// Ring record kinds (the ring itself reserves 0xFF).
pub(crate) const KIND_SEND: u8 = 1;
pub(crate) const KIND_WRITE_IMM: u8 = 2;
pub(crate) const KIND_SEND_DIRECT: u8 = 3;
/// Bytes of one source descriptor of a direct SEND: rkey (u32), length (u32), offset (u64).
pub(crate) const DESCRIPTOR: usize = 16;
/// Most scatter/gather entries a direct SEND describes (larger lists go through the ring).
pub(crate) const MAX_DESCRIPTORS: usize = 32;
/// Record flags.
pub(crate) const FLAG_IMM: u8 = 1;
pub(crate) const FLAG_SOLICITED: u8 = 2;

/// NAK reasons a responder publishes.
pub(crate) const NAK_INVALID_REQUEST: u8 = 1;
pub(crate) const NAK_REMOTE_OPERATION: u8 = 3;
pub(crate) const NAK_RNR_EXCEEDED: u8 = 4;

/// The completion status a requester reports for a NAK reason.
fn nak_status(reason: u8) -> Option<WcStatus> {
    Some(match reason {
        NAK_INVALID_REQUEST => WcStatus::RemInvReqErr,
        2 => WcStatus::RemAccessErr,
        NAK_REMOTE_OPERATION => WcStatus::RemOpErr,
        NAK_RNR_EXCEEDED => WcStatus::RnrRetryExcErr,
        _ => return None,
    })
}

/// Send-queue bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    pub(crate) sq: VecDeque<SendWqe>,
    /// Requests at the front of `sq` that have been carried out (fully in the ring, or done).
    issued: usize,
    /// The number the next ring message gets.
    next_message: u64,
    /// Requests waiting for the peer's acknowledgement.
    awaiting: usize,
    /// The peer's acknowledgement count as last read.
    acked: u64,
    /// The peer's NAK has been acted on.
    nak_seen: bool,
    /// A request failed: nothing after it is carried out.
    stopped: bool,
}

impl Requester {
    /// Forgets the queue's bookkeeping after a flush emptied it.
    pub(crate) fn clear_queue(&mut self) {
        self.issued = 0;
        self.awaiting = 0;
        self.stopped = true;
    }
}

/// What carrying out one request achieved.
enum Step {
    /// Done or fully in the ring; go on with the next.
    Issued,
    /// Waiting for ring space.
    Blocked,
}

/// Remote access requested by an operation.
fn remote_access(op: &SendOp) -> AccessFlags {
    match op {
        SendOp::Read { .. } => AccessFlags::REMOTE_READ,
        SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => AccessFlags::REMOTE_ATOMIC,
        _ => AccessFlags::REMOTE_WRITE,
    }
}

/// The checks a responder NIC makes before a one-sided access, against the peer queue pair's
/// published status and the region; `Ok(offset)` into the region.
fn check_remote(
    status: Option<PeerStatus>,
    region: Option<&PeerRegion>,
    op: &SendOp,
    remote_addr: u64,
    len: u64,
) -> Result<usize, WcStatus> {
    let status = status.ok_or(WcStatus::RetryExcErr)?;
    if !matches!(status.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
        // A responder that is not ready drops requests; RC retries until it gives up.
        return Err(WcStatus::RetryExcErr);
    }
    let need = remote_access(op);
    let region = region.ok_or(WcStatus::RemAccessErr)?;
    if !status.access.contains(need) || !region.access.contains(need) {
        return Err(WcStatus::RemAccessErr);
    }
    region.offset_of(remote_addr, len).ok_or(WcStatus::RemAccessErr)
}

impl QpCore {
    /// Carries out queued send requests in order until one has to wait for ring space or an
    /// error stops the queue.
    pub(crate) fn issue(&mut self, regions: &Regions) {
        while self.req.issued < self.req.sq.len() && !self.req.stopped && self.state == QpState::Rts {
            if self.link.as_ref().is_none_or(|link| link.peer.is_none()) {
                return;
            }
            let index = self.req.issued;
            match self.issue_one(index, regions) {
                Ok(Step::Issued) => {
                    self.req.issued += 1;
                    match self.req.sq[index].stage {
                        Stage::AwaitAck { .. } => self.req.awaiting += 1,
                        Stage::Done { status, .. } if !status.is_success() => self.req.stopped = true,
                        _ => {}
                    }
                }
                Ok(Step::Blocked) => return,
                Err(failure) => {
                    self.fail_link(failure);
                    return;
                }
            }
        }
    }

    /// Copies `bytes` straight into the peer's region `rkey` at `remote_addr`, with the checks
    /// an RDMA WRITE gets (see `QueuePair::write_direct`): one copy from the caller's memory,
    /// no request, no completion. A peer that has gone (or spoiled its status line) fails the
    /// link as a posted request would.
    /// `InvalidState` unless in RTS.
    pub(crate) fn check_rts(&self) -> lightpath_verbs::Result<()> {
        if self.state != QpState::Rts {
            return Err(lightpath_verbs::Error::InvalidState(self.state));
        }
        Ok(())
    }

    /// Where a direct write of `len` bytes at the peer's `remote_addr` goes: the peer's region
    /// (shared, so the caller copies after releasing the device lock) and the offset in it;
    /// `Ok(None)` while the peer has not attached yet.
    pub(crate) fn direct_target(
        &mut self,
        remote_addr: u64,
        rkey: u32,
        len: u64,
    ) -> lightpath_verbs::Result<Option<(std::sync::Arc<crate::region::PeerRegion>, usize)>> {
        use lightpath_verbs::Error;
        if self.state != QpState::Rts {
            return Err(Error::InvalidState(self.state));
        }
        let (Some(link), Some((_, dqpn))) = (self.link.as_mut(), self.dest) else {
            return Err(Error::Unavailable("the queue pair has no peer".into()));
        };
        if link.peer.is_none() {
            return Ok(None);
        }
        let op = SendOp::Write { remote_addr, rkey };
        let status = link.peer.as_ref().and_then(|peer| peer.segment.status_line().status);
        let region = match link.peer_region(rkey, dqpn) {
            Ok(region) => region,
            Err(failure) => {
                self.fail_link(failure);
                return Err(Error::Unavailable("the peer is gone".into()));
            }
        };
        match (check_remote(status, region.map(|r| &**r), &op, remote_addr, len), region) {
            (Ok(offset), Some(region)) => Ok(Some((std::sync::Arc::clone(region), offset))),
            (Ok(_), None) => {
                Err(Error::Unavailable(format!("the peer refuses the write ({})", WcStatus::RemAccessErr)))
            }
            (Err(status), _) => Err(Error::Unavailable(format!("the peer refuses the write ({status})"))),
        }
    }

    fn issue_one(&mut self, index: usize, regions: &Regions) -> Result<Step, LinkFailure> {
        let QpCore { req, link, pd, dest, published, published_arrival, direct_min, .. } = self;
        // Records are arrivals for the peer (see `crate::activity::Wake`).
        let mut pushed = false;
        let (Some(link), Some((_, dqpn))) = (link.as_mut(), *dest) else { return Ok(Step::Blocked) };
        let wqe = &mut req.sq[index];
        let pd = *pd;
        let step = match wqe.op {
            SendOp::Send | SendOp::SendWithImm { .. } if goes_direct(wqe, *direct_min) => {
                push_direct(wqe, link, regions, pd, &mut req.next_message, &mut pushed)?
            }
            SendOp::Send | SendOp::SendWithImm { .. } => {
                push_message(wqe, link, regions, pd, &mut req.next_message, &mut pushed)?
            }
            SendOp::WriteWithImm { remote_addr, rkey, .. } => {
                if let Stage::Pending { data_written: false, .. } = wqe.stage {
                    if let Err(status) = write(wqe, link, regions, pd, dqpn, remote_addr, rkey)? {
                        wqe.stage = Stage::Done { status, byte_len: 0 };
                        return Ok(Step::Issued);
                    }
                    wqe.stage = Stage::Pending { pushed: 0, message: None, data_written: true };
                }
                push_message(wqe, link, regions, pd, &mut req.next_message, &mut pushed)?
            }
            SendOp::Write { remote_addr, rkey } => {
                wqe.stage = match write(wqe, link, regions, pd, dqpn, remote_addr, rkey)? {
                    Ok(()) => Stage::Done { status: WcStatus::Success, byte_len: wqe.len },
                    Err(status) => Stage::Done { status, byte_len: 0 },
                };
                Step::Issued
            }
            SendOp::Read { remote_addr, rkey } => {
                wqe.stage = match read(wqe, link, regions, pd, dqpn, remote_addr, rkey)? {
                    Ok(()) => Stage::Done { status: WcStatus::Success, byte_len: wqe.len },
                    Err(status) => Stage::Done { status, byte_len: 0 },
                };
                Step::Issued
            }
            SendOp::CompareSwap { remote_addr, rkey, .. } | SendOp::FetchAdd { remote_addr, rkey, .. } => {
                wqe.stage = match atomic(wqe, link, regions, pd, dqpn, remote_addr, rkey)? {
                    Ok(()) => Stage::Done { status: WcStatus::Success, byte_len: 8 },
                    Err(status) => Stage::Done { status, byte_len: 0 },
                };
                Step::Issued
            }
            SendOp::SendWithInv { .. } => {
                wqe.stage = Stage::Done { status: WcStatus::LocQpOpErr, byte_len: 0 };
                Step::Issued
            }
        };
        if pushed {
            *published = true;
            *published_arrival = true;
        }
        Ok(step)
    }

    /// Reads the peer's acknowledgements and NAK; finishes the requests they cover.
    pub(crate) fn poll_acks(&mut self) -> Result<(), LinkFailure> {
        if self.req.awaiting == 0 {
            return Ok(());
        }
        let Some(peer) = self.link.as_ref().and_then(|link| link.peer.as_ref()) else { return Ok(()) };
        let line = peer.segment.status_line();
        let status = line.status.ok_or(LinkFailure::PeerCorrupt)?;
        let req = &mut self.req;
        if line.acked < req.acked || line.acked > req.next_message {
            return Err(LinkFailure::PeerCorrupt);
        }
        req.acked = line.acked;
        if line.nak != 0 && !req.nak_seen {
            let message = (line.nak >> 8).checked_sub(1).ok_or(LinkFailure::PeerCorrupt)?;
            let status = nak_status(line.nak as u8).ok_or(LinkFailure::PeerCorrupt)?;
            if message != req.acked || message >= req.next_message {
                return Err(LinkFailure::PeerCorrupt);
            }
            req.nak_seen = true;
            req.fail_message(message, status);
        } else if req.acked < req.next_message
            && !matches!(status.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
        {
            // The peer stopped receiving with our messages unread: RC would retry and give up.
            let first = req.acked;
            req.fail_message(first, WcStatus::RetryExcErr);
        }
        Ok(())
    }

    /// Turns finished requests at the front of the queue into completions, in order; a failed
    /// one moves the queue pair to ERR.
    pub(crate) fn retire(&mut self) {
        while let Some(front) = self.req.sq.front() {
            let (status, byte_len) = match front.stage {
                Stage::Done { status, byte_len } => (status, byte_len),
                Stage::AwaitAck { message } if message < self.req.acked => (WcStatus::Success, front.len),
                _ => return,
            };
            let Some(wqe) = self.req.sq.pop_front() else { return };
            self.req.issued -= 1;
            if matches!(wqe.stage, Stage::AwaitAck { .. }) {
                self.req.awaiting -= 1;
            }
            if !status.is_success() || wqe.signaled {
                let mut wc = WorkCompletion::new(wqe.wr_id, status, wqe.opcode(), self.qpn);
                wc.byte_len = byte_len;
                self.send_cq.push(wc);
                self.completed = true;
                // An acknowledged request is no arrival; a failure or a READ's data is.
                self.completed_arrival |=
                    !status.is_success() || !matches!(wqe.stage, Stage::AwaitAck { .. });
            }
            if !status.is_success() {
                self.enter_error(None);
                return;
            }
        }
    }
}

impl Requester {
    /// Ends ring message `message` with `status` and stops the queue behind it.
    fn fail_message(&mut self, message: u64, status: WcStatus) {
        if let Some(wqe) = self.sq.iter_mut().find(|w| w.stage == Stage::AwaitAck { message }) {
            wqe.stage = Stage::Done { status, byte_len: 0 };
            self.awaiting -= 1;
        }
        self.stopped = true;
    }
}

/// Whether a SEND should travel as source descriptors (the receiver copies straight out of
/// our region) instead of through the ring: big enough that one copy instead of two pays for
/// the receiver's region lookup, and not yet started.
fn goes_direct(wqe: &SendWqe, direct_min: u32) -> bool {
    let Payload::Sges(sges) = &wqe.payload else { return false };
    wqe.len > 0
        && wqe.len >= direct_min
        && sges.as_slice().len() <= MAX_DESCRIPTORS
        && wqe.stage == Stage::NEW
}

/// Puts a direct SEND into the ring: one record listing where the bytes are in our regions.
fn push_direct(
    wqe: &mut SendWqe,
    link: &mut Link,
    regions: &Regions,
    pd: u32,
    next_message: &mut u64,
    published: &mut bool,
) -> Result<Step, LinkFailure> {
    let Payload::Sges(sges) = &wqe.payload else { return Ok(Step::Blocked) };
    let mut descriptors = [0u8; DESCRIPTOR * MAX_DESCRIPTORS];
    let mut count = 0;
    for sge in sges.as_slice().iter().filter(|sge| sge.length > 0) {
        let Some((region, offset)) = sge::resolve(sge, regions, pd, false) else {
            wqe.stage = Stage::Done { status: WcStatus::LocProtErr, byte_len: 0 };
            return Ok(Step::Issued);
        };
        let slot = &mut descriptors[count * DESCRIPTOR..(count + 1) * DESCRIPTOR];
        slot[0..4].copy_from_slice(&region.rkey.to_le_bytes());
        slot[4..8].copy_from_slice(&sge.length.to_le_bytes());
        slot[8..16].copy_from_slice(&(offset as u64).to_le_bytes());
        count += 1;
    }
    let Some(peer) = link.peer.as_ref() else { return Ok(Step::Blocked) };
    let imm = match wqe.op {
        SendOp::SendWithImm { imm } => Some(imm),
        _ => None,
    };
    let mut flags = if imm.is_some() { FLAG_IMM } else { 0 };
    if wqe.solicited {
        flags |= FLAG_SOLICITED;
    }
    let number = *next_message;
    let bytes = &descriptors[..count * DESCRIPTOR];
    let header = RecordHeader {
        kind: KIND_SEND_DIRECT,
        flags,
        len: bytes.len() as u32,
        word2: u64::from(number as u32) | u64::from(imm.unwrap_or(0)) << 32,
        word3: u64::from(wqe.len),
    };
    let ring = link.outbox.ring();
    let map = link.outbox.map();
    let fill = |offset: usize| {
        let written = map.write(ring.segment_offset(offset), bytes);
        debug_assert!(written);
    };
    match link.producer.try_push(&ring, &peer.segment.word(OFF_HEAD), header, fill) {
        Ok(true) => {}
        Ok(false) => return Ok(Step::Blocked),
        Err(_) => return Err(LinkFailure::PeerCorrupt),
    }
    *published = true;
    *next_message += 1;
    wqe.stage = Stage::AwaitAck { message: number };
    Ok(Step::Issued)
}

/// Puts a SEND (or the record of a WRITE with immediate) into the ring, piece by piece.
fn push_message(
    wqe: &mut SendWqe,
    link: &mut Link,
    regions: &Regions,
    pd: u32,
    next_message: &mut u64,
    published: &mut bool,
) -> Result<Step, LinkFailure> {
    let Stage::Pending { mut pushed, mut message, data_written } = wqe.stage else { return Ok(Step::Issued) };
    let write_imm = matches!(wqe.op, SendOp::WriteWithImm { .. });
    if message.is_none() && !write_imm {
        if let Payload::Sges(sges) = &wqe.payload {
            if !sge::check(sges.as_slice(), regions, pd, false) {
                wqe.stage = Stage::Done { status: WcStatus::LocProtErr, byte_len: 0 };
                return Ok(Step::Issued);
            }
        }
    }
    let Some(peer) = link.peer.as_ref() else { return Ok(Step::Blocked) };
    let (kind, imm) = match wqe.op {
        SendOp::SendWithImm { imm } => (KIND_SEND, Some(imm)),
        SendOp::WriteWithImm { imm, .. } => (KIND_WRITE_IMM, Some(imm)),
        _ => (KIND_SEND, None),
    };
    let mut flags = if imm.is_some() { FLAG_IMM } else { 0 };
    if wqe.solicited {
        flags |= FLAG_SOLICITED;
    }
    loop {
        let number = message.unwrap_or(*next_message);
        // A WRITE with immediate carries no payload in the ring (the data is in place).
        let piece = if write_imm { 0 } else { (wqe.len - pushed).min(link.producer.max_payload()) };
        let header = RecordHeader {
            kind,
            flags,
            len: piece,
            word2: u64::from(number as u32) | u64::from(imm.unwrap_or(0)) << 32,
            word3: u64::from(wqe.len) | u64::from(pushed) << 32,
        };
        let ring = link.outbox.ring();
        let head = peer.segment.word(OFF_HEAD);
        let map = link.outbox.map();
        let mut copied = true;
        let fill = |offset: usize| {
            let base = ring.segment_offset(offset);
            copied = match &wqe.payload {
                _ if piece == 0 => true,
                Payload::Inline(bytes) => {
                    map.write(base, &bytes[pushed as usize..pushed as usize + piece as usize])
                }
                Payload::Sges(sges) => sge::pieces(
                    sges.as_slice(),
                    regions,
                    pd,
                    false,
                    u64::from(pushed),
                    u64::from(piece),
                    |region, region_offset, rel, len| {
                        Mapping::copy_to_peer(map, base + rel, &region.map, region_offset, len)
                    },
                ),
            };
        };
        match link.producer.try_push(&ring, &head, header, fill) {
            Ok(true) => {}
            Ok(false) => {
                wqe.stage = Stage::Pending { pushed, message, data_written };
                return Ok(Step::Blocked);
            }
            Err(RingError::BadHead | RingError::BadLength | RingError::BadSkip) => {
                return Err(LinkFailure::PeerCorrupt)
            }
        }
        debug_assert!(copied, "entries were checked under the same lock");
        *published = true;
        if message.is_none() {
            message = Some(number);
            *next_message += 1;
        }
        pushed += piece;
        if pushed == wqe.len || write_imm {
            wqe.stage = Stage::AwaitAck { message: number };
            return Ok(Step::Issued);
        }
    }
}

/// Looks up the peer's region and checks the access; `Ok(Err(status))` for a request that
/// fails, `Err` when the link itself failed.
fn remote_target<'l>(
    link: &'l mut Link,
    op: &SendOp,
    dqpn: u32,
    remote_addr: u64,
    rkey: u32,
    len: u64,
) -> Result<Result<(&'l Mapping, usize), WcStatus>, LinkFailure> {
    let status = link.peer.as_ref().and_then(|peer| peer.segment.status_line().status);
    let region = link.peer_region(rkey, dqpn)?;
    Ok(match (check_remote(status, region.map(|r| &**r), op, remote_addr, len), region) {
        (Ok(offset), Some(region)) => Ok((&region.map, offset)),
        (Ok(_), None) => Err(WcStatus::RemAccessErr),
        (Err(status), _) => Err(status),
    })
}

fn write(
    wqe: &SendWqe,
    link: &mut Link,
    regions: &Regions,
    pd: u32,
    dqpn: u32,
    remote_addr: u64,
    rkey: u32,
) -> Result<Result<(), WcStatus>, LinkFailure> {
    if let Payload::Sges(sges) = &wqe.payload {
        if !sge::check(sges.as_slice(), regions, pd, false) {
            return Ok(Err(WcStatus::LocProtErr));
        }
    }
    if wqe.len == 0 {
        // A zero-length WRITE checks no remote key (IBA 9.4.1.1).
        return Ok(Ok(()));
    }
    let (target, offset) = match remote_target(link, &wqe.op, dqpn, remote_addr, rkey, u64::from(wqe.len))? {
        Ok(found) => found,
        Err(status) => return Ok(Err(status)),
    };
    let copied = match &wqe.payload {
        Payload::Inline(bytes) => target.write(offset, bytes),
        Payload::Sges(sges) => sge::pieces(
            sges.as_slice(),
            regions,
            pd,
            false,
            0,
            u64::from(wqe.len),
            |region, region_offset, rel, len| {
                Mapping::copy_to_peer(target, offset + rel, &region.map, region_offset, len)
            },
        ),
    };
    Ok(if copied { Ok(()) } else { Err(WcStatus::RemAccessErr) })
}

fn read(
    wqe: &SendWqe,
    link: &mut Link,
    regions: &Regions,
    pd: u32,
    dqpn: u32,
    remote_addr: u64,
    rkey: u32,
) -> Result<Result<(), WcStatus>, LinkFailure> {
    let Payload::Sges(sges) = &wqe.payload else { return Ok(Err(WcStatus::LocQpOpErr)) };
    if !sge::check(sges.as_slice(), regions, pd, true) {
        return Ok(Err(WcStatus::LocProtErr));
    }
    if wqe.len == 0 {
        return Ok(Ok(()));
    }
    let (source, offset) = match remote_target(link, &wqe.op, dqpn, remote_addr, rkey, u64::from(wqe.len))? {
        Ok(found) => found,
        Err(status) => return Ok(Err(status)),
    };
    let copied = sge::pieces(
        sges.as_slice(),
        regions,
        pd,
        true,
        0,
        u64::from(wqe.len),
        |region, region_offset, rel, len| {
            Mapping::copy(&region.map, region_offset, source, offset + rel, len)
        },
    );
    Ok(if copied { Ok(()) } else { Err(WcStatus::LocProtErr) })
}

fn atomic(
    wqe: &SendWqe,
    link: &mut Link,
    regions: &Regions,
    pd: u32,
    dqpn: u32,
    remote_addr: u64,
    rkey: u32,
) -> Result<Result<(), WcStatus>, LinkFailure> {
    let Payload::Sges(sges) = &wqe.payload else { return Ok(Err(WcStatus::LocQpOpErr)) };
    if !sge::check(sges.as_slice(), regions, pd, true) {
        return Ok(Err(WcStatus::LocProtErr));
    }
    if wqe.len != 8 {
        return Ok(Err(WcStatus::LocLenErr));
    }
    if !remote_addr.is_multiple_of(8) {
        return Ok(Err(WcStatus::RemInvReqErr));
    }
    let (target, offset) = match remote_target(link, &wqe.op, dqpn, remote_addr, rkey, 8)? {
        Ok(found) => found,
        Err(status) => return Ok(Err(status)),
    };
    let original = match wqe.op {
        SendOp::CompareSwap { compare, swap, .. } => target.compare_swap_u64(offset, compare, swap),
        SendOp::FetchAdd { add, .. } => target.fetch_add_u64(offset, add),
        _ => None,
    };
    let Some(original) = original else { return Ok(Err(WcStatus::RemAccessErr)) };
    let bytes = original.to_ne_bytes();
    let written = sge::pieces(sges.as_slice(), regions, pd, true, 0, 8, |region, region_offset, rel, len| {
        region.map.write(region_offset, &bytes[rel..rel + len])
    });
    Ok(if written { Ok(()) } else { Err(WcStatus::LocProtErr) })
}
