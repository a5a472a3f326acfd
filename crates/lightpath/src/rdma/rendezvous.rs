//! The verbs side of rendezvous (the protocol and its bookkeeping are
//! `lightpath_stream::rendezvous`): the sender's descriptor record and its wait for the done
//! record, the receiver's RDMA READs from the sender's buffer — straight into an application's
//! registered buffer (a *direct* read) or into the bounce region that plain reads copy from —
//! and how both give up when the peer dies or lies.
//!
//! Nonblocking calls: a zero-copy write that announced its rendezvous returns `WouldBlock`
//! until the peer has fetched it, and a zero-copy read that posted direct READs returns
//! `WouldBlock` until they have landed; the caller repeats the same call (same buffer and
//! range) to learn the outcome, and meanwhile the buffer belongs to the connection. Other
//! receiving calls are refused while such a read is unfinished (its bytes are owed to that
//! call). A repeated call with a deadline that had already passed abandons it: the queue pair
//! is fenced, so that the buffer may be reused at once (how a dropped tokio future lets go).
//!
//! Memory: the bounce region (`BOUNCE`, 256 KiB) is allocated the first time a plain read
//! meets a rendezvous and kept for the connection's life, so a connection holds at most its
//! ring, its staging mirror and this region. Direct reads use the application's buffer only.

use super::*;
use crate::options::RendezvousLie;
use crate::remote::BufRegion;
use lightpath_stream::rendezvous::{BounceGeometry, Descriptor, ReadRequest, ReadTarget, DESCRIPTOR_LEN};
use lightpath_verbs::QpState;

/// The bounce region: four 64 KiB slots, each filled by one READ ahead of the reader, so a
/// plain reader keeps up to four READs in flight.
const BOUNCE: BounceGeometry = BounceGeometry { slot_len: 64 << 10, slots: 4 };
/// Largest READ of a direct read: small enough that a lost packet costs little to re-read,
/// large enough that posting is cheap.
const DIRECT_CHUNK: u32 = 1 << 20;
/// Direct READs in flight (the queue pair allows 16 outstanding READs).
const DIRECT_IN_FLIGHT: usize = 8;

/// The driver's rendezvous state of one connection.
pub(super) struct Rendezvous<D: Device> {
    /// Zero-copy writes of at least this many bytes go by rendezvous.
    pub(super) min: usize,
    bounce: Option<MrOf<D>>,
    lie: Option<RendezvousLie>,
    /// A direct read a nonblocking call started and has not yet returned.
    direct_call: Option<DirectCall>,
    /// The last direct READ posted (every earlier one completes before it).
    last_direct_read: u64,
}

impl<D: Device> Rendezvous<D> {
    pub(super) fn new(options: &Options) -> Self {
        // `devices::setup` resolved the provider's default.
        let min = options.rendezvous_min.unwrap_or(usize::MAX).max(1);
        Self { min, bounce: None, lie: options.fault_rendezvous, direct_call: None, last_direct_read: 0 }
    }
}

/// A rendezvous a nonblocking zero-copy write announced: the call, to know it when repeated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Announced {
    addr: u64,
    len: u64,
    rkey: u32,
    message: bool,
}

/// A zero-copy receiving call: its buffer, offset and length (`None` for `recv_msg_buf`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ReceiveCall {
    addr: u64,
    rkey: u32,
    offset: usize,
    len: Option<usize>,
}

impl ReceiveCall {
    pub(super) fn new(local: &dyn BufRegion, offset: usize, len: Option<usize>) -> Self {
        Self { addr: local.addr(), rkey: local.rkey(), offset, len }
    }
}

/// A direct read whose READs a nonblocking call posted and left in flight.
#[derive(Clone, Copy, Debug)]
struct DirectCall {
    call: ReceiveCall,
    /// Where in the buffer the direct read starts.
    base: usize,
    /// What the call returns once the READs have landed.
    returns: usize,
}

fn busy() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        "lightpath: a zero-copy read that returned WouldBlock is still fetching into its buffer; repeat \
         that call (same buffer, offset and length) until it completes",
    )
}

fn unexpected(what: &str) -> io::Error {
    io::Error::other(format!("lightpath: internal error: {what}"))
}

impl<D: Device> RdmaConn<D> {
    /// Moves the queue pair to the error state: nothing posted touches memory any more and the
    /// peer can no longer read this side's buffers. For giving up while a READ into an
    /// application's buffer, or the peer's READ of one, may still be under way.
    pub(super) fn fence(&mut self) {
        let _ = self.qp.modify(&QpAttr::state(QpState::Err));
    }

    /// Fences, marks the connection broken and returns the error.
    pub(super) fn give_up(&mut self, kind: io::ErrorKind, what: &str) -> io::Error {
        self.fence();
        self.rendezvous.direct_call = None;
        self.send_state.announced = None;
        self.fail(kind, what.to_string());
        self.failure().unwrap_or_else(|| io::Error::new(kind, what.to_string()))
    }

    // ---- sending -------------------------------------------------------------------------

    /// Announces `len` bytes of `local` as a rendezvous (a whole message if `message`) and
    /// waits until the peer has fetched them. Once the descriptor is out the peer may read the
    /// buffer at any moment, so this does not end early: in nonblocking mode it returns
    /// `WouldBlock` and the caller repeats the call until it returns `Ok` (see the module
    /// docs); a write timeout that expires closes the connection (fencing the queue pair) so
    /// that the buffer may be reused when the error is returned. Kept bytes go first.
    pub(super) fn write_rendezvous(
        &mut self,
        local: &dyn BufRegion,
        offset: usize,
        len: usize,
        message: bool,
        deadline: Deadline,
    ) -> io::Result<()> {
        let call =
            Announced { addr: local.addr() + offset as u64, len: len as u64, rkey: local.rkey(), message };
        if let Some(announced) = self.send_state.announced {
            if announced == call {
                return self.await_rendezvous(deadline);
            }
            if !self.core.rendezvous_outstanding() {
                // Fetched, and its caller moved on without asking again.
                self.send_state.announced = None;
            }
        }
        if stream_ops::expired(deadline) {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.check_not_shut_down()?;
        self.clear_kept(deadline)?;
        let mut desc = Descriptor { addr: call.addr, len: call.len, rkey: call.rkey, message };
        match self.rendezvous.lie {
            Some(RendezvousLie::Key) => desc.rkey ^= 0x00A5_5A00,
            Some(RendezvousLie::PastTheEnd) => desc.len += 4096,
            Some(RendezvousLie::Huge) => desc.len = 1 << 60,
            None => {}
        }
        loop {
            self.pump();
            self.check_writable()?;
            self.read_slot();
            if let Some(at) = self.core.rendezvous_room() {
                let staged = self.stage(at, &desc.encode());
                self.staged(staged)?;
                self.core.commit_rendezvous();
                self.post_ops();
                break;
            }
            let free = self.core.ring_free();
            if free > 0 && free < u64::from(DESCRIPTOR_LEN) && !self.core.rendezvous_outstanding() {
                // The peer's ring has room for less than a descriptor. This one write goes
                // through the ring instead, using the sliver: an event loop judges a stream
                // writable by any free byte, so waiting here for a descriptor's worth would
                // have it retry at once, forever.
                return self.send_copied(local, offset, len, message, deadline);
            }
            self.core.note_blocked_for(DESCRIPTOR_LEN);
            self.post_ops();
            self.wait(deadline)?;
        }
        self.send_state.announced = Some(call);
        self.await_rendezvous(deadline)
    }

    /// Waits until the announced rendezvous has been fetched (`WouldBlock` in nonblocking
    /// mode while it has not); gives the connection up if that cannot happen.
    fn await_rendezvous(&mut self, deadline: Deadline) -> io::Result<()> {
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            if !self.core.rendezvous_outstanding() {
                self.send_state.announced = None;
                return Ok(());
            }
            if let Some(err) = self.failure() {
                self.fence();
                self.send_state.announced = None;
                return Err(err);
            }
            if self.peer_vanished() {
                return Err(
                    self.give_up(io::ErrorKind::ConnectionReset, "the peer vanished during a rendezvous")
                );
            }
            if self.peer_bye.is_some() || self.tcp_eof {
                return Err(
                    self.give_up(io::ErrorKind::BrokenPipe, "the peer closed before fetching a rendezvous")
                );
            }
            match self.wait(deadline) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    return Err(crate::stream::AwaitingPeer::would_block())
                }
                Err(err) if err.kind() == io::ErrorKind::TimedOut => {
                    return Err(self.give_up(
                        io::ErrorKind::TimedOut,
                        "the peer did not fetch a rendezvous within the write timeout (the connection is \
                         closed, so the buffer may be reused)",
                    ));
                }
                Err(err) => return Err(self.give_up(err.kind(), &format!("waiting for a rendezvous: {err}"))),
            }
            just_pumped = true;
        }
    }

    // ---- receiving -----------------------------------------------------------------------

    /// Whether the head of the stream has something a read returns without waiting: ring
    /// bytes, or a rendezvous whose bounced bytes landed (or that no READ serves yet: a read
    /// would start them). While bounce READs are only in flight it is not, so an event loop
    /// sleeps until their completion rather than spinning on `WouldBlock`.
    pub(super) fn front_ready(&self) -> bool {
        if self.rendezvous.direct_call.is_some() {
            // Readable once the direct READs in flight have landed (their completion wakes the
            // fd); the repeated call then posts the next ones or returns.
            return self.core.is_complete(self.rendezvous.last_direct_read);
        }
        match self.core.front() {
            Some(front) if front.kind == RecordKind::Rendezvous => {
                self.core.rendezvous_bounced().is_some()
                    || self.core.incoming().is_none_or(|incoming| !incoming.bounce_pending())
            }
            Some(_) => true,
            None => false,
        }
    }

    /// The descriptor of the rendezvous at the head of the stream, accepting it first if
    /// needed. A malformed descriptor breaks the connection (`InvalidData`).
    pub(super) fn accept_front(&mut self) -> io::Result<Descriptor> {
        if let Some(incoming) = self.core.incoming() {
            return Ok(*incoming.descriptor());
        }
        let front = self.core.front().ok_or_else(|| unexpected("no rendezvous at the head"))?;
        let mut bytes = [0u8; DESCRIPTOR_LEN as usize];
        let first = (front.contiguous as usize).min(bytes.len());
        self.recv_mr.read(SLOT_AREA + front.offset as usize, &mut bytes[..first]).map_err(from_verbs)?;
        if first < bytes.len() {
            // The descriptor wraps the end of the ring.
            self.recv_mr.read(SLOT_AREA, &mut bytes[first..]).map_err(from_verbs)?;
        }
        match self.core.accept_rendezvous(&bytes) {
            Ok(Some(desc)) => {
                self.post_ops();
                Ok(desc)
            }
            Ok(None) => Err(unexpected("the rendezvous at the head was not accepted")),
            Err(err) => {
                self.fail(io::ErrorKind::InvalidData, format!("protocol violation: {err}"));
                Err(self.failure().unwrap_or_else(|| invalid(err)))
            }
        }
    }

    /// Posts one READ of the rendezvous; `direct` is the application's buffer and the offset
    /// its direct read starts at.
    pub(super) fn post_read(
        &mut self,
        request: ReadRequest,
        direct: Option<(&dyn BufRegion, usize)>,
    ) -> io::Result<()> {
        let sge = match (request.target, direct) {
            (ReadTarget::Bounce { offset }, _) => match &self.rendezvous.bounce {
                Some(bounce) => bounce.sge(offset as usize, request.len),
                None => return Err(self.give_up(io::ErrorKind::Other, "a READ into a missing bounce region")),
            },
            (ReadTarget::Direct { offset }, Some((local, base))) => {
                self.rendezvous.last_direct_read = request.seq;
                local.sge(base + offset as usize, request.len)
            }
            (ReadTarget::Direct { .. }, None) => {
                return Err(self.give_up(io::ErrorKind::Other, "a direct READ without a destination"))
            }
        };
        let op = SendOp::Read { remote_addr: request.remote_addr, rkey: request.rkey };
        if let Err(err) = self.qp.post_send(&SendWr::new(request.seq, op, &[sge])) {
            return Err(
                self.give_up(io::ErrorKind::ConnectionReset, &format!("posting a rendezvous READ: {err}"))
            );
        }
        Ok(())
    }

    /// Keeps the bounce region's free slots filled with READs ahead of the reader.
    fn prefetch(&mut self) -> io::Result<()> {
        if self.rendezvous.bounce.is_none() {
            let bounce = self._pd.alloc_mr(BOUNCE.len(), AccessFlags::LOCAL_WRITE).map_err(from_verbs)?;
            self.rendezvous.bounce = Some(bounce);
        }
        while let Some(request) = self.core.rendezvous_prefetch(BOUNCE) {
            self.post_read(request, None)?;
        }
        Ok(())
    }

    /// Runs `f` on the bounce region.
    pub(super) fn with_bounce<R>(&self, f: impl FnOnce(&MrOf<D>) -> io::Result<R>) -> io::Result<R> {
        match &self.rendezvous.bounce {
            Some(bounce) => f(bounce),
            None => Err(unexpected("bounced bytes without a bounce region")),
        }
    }

    /// Plain `read` of the rendezvous at the head: copies what the bounce region holds into
    /// `buf` and keeps its slots busy. 0 means nothing has landed yet (READs are in flight).
    pub(super) fn read_rendezvous(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.accept_front()?.message {
            return Err(invalid("the peer sent a message here; use recv_msg"));
        }
        let mut done = 0;
        while done < buf.len() {
            let Some((at, len)) = self.core.rendezvous_bounced() else { break };
            let n = (len as usize).min(buf.len() - done);
            let dst = &mut buf[done..done + n];
            self.with_bounce(|bounce| bounce.read(at as usize, dst).map_err(from_verbs))?;
            done += n;
            if self.core.rendezvous_take_bounced(n as u32) {
                break;
            }
        }
        if self.core.incoming().is_some() {
            self.prefetch()?;
        }
        self.post_ops();
        Ok(done)
    }

    /// `recv_msg` of a rendezvous message: gathers it through the bounce region (the vector
    /// grows only as bytes arrive, whatever length the peer announced). `None`: not complete
    /// yet, READs are in flight.
    pub(super) fn recv_msg_rendezvous(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.core.incoming().is_none() && !self.message.is_empty() {
            self.fail(io::ErrorKind::InvalidData, "protocol violation: a rendezvous inside a message".into());
            return Err(self.failure().unwrap_or_else(|| invalid("a rendezvous inside a message")));
        }
        if !self.accept_front()?.message {
            return Err(invalid("the peer sent stream bytes here; use read"));
        }
        while let Some((at, len)) = self.core.rendezvous_bounced() {
            let start = self.message.len();
            self.message.resize(start + len as usize, 0);
            let mut message = std::mem::take(&mut self.message);
            let copied = self
                .with_bounce(|bounce| bounce.read(at as usize, &mut message[start..]).map_err(from_verbs));
            self.message = message;
            copied?;
            if self.core.rendezvous_take_bounced(len) {
                self.post_ops();
                return Ok(Some(std::mem::take(&mut self.message)));
            }
        }
        self.prefetch()?;
        self.post_ops();
        Ok(None)
    }

    /// Reads the direct read the core began straight into `local` from `base`. The READs
    /// write into the application's buffer, so a blocking call waits for every one of them
    /// whatever its deadline, and a nonblocking one (`nonblocking`) posts what it can and
    /// returns `false` while some are in flight (the caller records the call). A peer that
    /// dies ends it (the queue pair is fenced first). `true` once every byte has landed.
    pub(super) fn direct_read(
        &mut self,
        local: &dyn BufRegion,
        base: usize,
        nonblocking: bool,
    ) -> io::Result<bool> {
        // A nonblocking call collects completions once, then returns: an event loop (or the
        // tokio runtime) gets its thread back between rounds of READs.
        let mut pumped = false;
        loop {
            while let Some(request) = self.core.rendezvous_direct(DIRECT_CHUNK, DIRECT_IN_FLIGHT) {
                self.post_read(request, Some((local, base)))?;
            }
            if self.core.rendezvous_finish_direct().is_some() {
                self.post_ops();
                return Ok(true);
            }
            if let Some(err) = self.failure() {
                self.fence();
                return Err(err);
            }
            if self.peer_vanished() {
                return Err(
                    self.give_up(io::ErrorKind::ConnectionReset, "the peer vanished during a rendezvous")
                );
            }
            if nonblocking {
                if pumped {
                    self.check_tcp();
                    if !self.peer_vanished() && self.failed.is_none() {
                        return Ok(false);
                    }
                }
                self.pump();
                pumped = true;
                continue;
            }
            if let Err(err) = self.wait(Deadline::At(None)) {
                return Err(self.give_up(err.kind(), &format!("waiting for rendezvous READs: {err}")));
            }
        }
    }

    /// Starts (or finishes) the direct read the core just began for the receiving `call`:
    /// `Ok(())` once its bytes have landed; `WouldBlock` in nonblocking mode while READs are
    /// in flight, the call recorded so that repeating it finishes it (it then returns
    /// `returns`).
    pub(super) fn direct_read_for(
        &mut self,
        call: ReceiveCall,
        local: &dyn BufRegion,
        base: usize,
        returns: usize,
        deadline: Deadline,
    ) -> io::Result<()> {
        if self.direct_read(local, base, deadline == Deadline::Now)? {
            return Ok(());
        }
        self.rendezvous.direct_call = Some(DirectCall { call, base, returns });
        Err(io::ErrorKind::WouldBlock.into())
    }

    /// Before a receiving call (`call`, or `None` for plain reads): continues a direct read an
    /// earlier nonblocking call left in flight. `Some(what that call returns)` when `call` is
    /// it and its bytes have landed; `WouldBlock` while they have not; other calls are refused
    /// while it is unfinished. `None`: no direct read is pending. A repeated call whose
    /// deadline had passed abandons it (fencing the queue pair: see the module docs).
    pub(super) fn resume_direct(
        &mut self,
        call: Option<(ReceiveCall, &dyn BufRegion)>,
        deadline: Deadline,
    ) -> io::Result<Option<usize>> {
        let Some(pending) = self.rendezvous.direct_call else { return Ok(None) };
        if let Some(err) = self.failure() {
            self.rendezvous.direct_call = None;
            return Err(err);
        }
        let Some((_, local)) = call.filter(|(call, _)| *call == pending.call) else { return Err(busy()) };
        if stream_ops::expired(deadline) {
            return Err(self.give_up(
                io::ErrorKind::TimedOut,
                "a zero-copy read was abandoned while its READs were in flight (the connection is closed, so \
                 the buffer may be reused)",
            ));
        }
        if !self.direct_read(local, pending.base, deadline == Deadline::Now)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.rendezvous.direct_call = None;
        Ok(Some(pending.returns))
    }

    /// Refuses a plain receiving call while a zero-copy read is unfinished.
    pub(super) fn check_no_direct_call(&self) -> io::Result<()> {
        match self.rendezvous.direct_call {
            Some(_) => Err(busy()),
            None => Ok(()),
        }
    }
}
