//! The blocking driver of an RDMA connection: verbs objects around one
//! [`lightpath_stream::Conn`], generic over the provider's [`Device`].
//!
//! Memory per connection: one region `[credit slot (64 B) | receive ring]` the peer writes
//! into, and one staging region mirroring the peer's ring. Both sizes are fixed at set-up,
//! so a connection's memory is bounded whatever the traffic. Providers that reach the peer's
//! memory themselves (shm, `QueuePair::write_direct`) need no staging: the writer copies the
//! caller's bytes straight into the peer's ring, and the ring is twice `Options::ring_size`
//! (the same memory).
//!
//! Completions of a connection arrive through a completion queue its device shares among
//! many connections (`crate::completions`), polled by whichever thread is inside a call on
//! the stream; a blocked call spins for `Options::spin`, then sleeps on its doorbell and its
//! TCP connection (the liveness channel), so that a peer's goodbye or death ends the sleep at
//! once (where the wait cannot watch the TCP connection, in slices of [`LIVENESS_SLICE`] with
//! a look at it between them).

use std::io::{self, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use lightpath_stream::negotiate::{Message, RdmaEndpoint};
use lightpath_stream::{Arrival, Conn, ConnConfig, CreditWord, Op, RecordKind};
use lightpath_verbs::{
    AccessFlags, AddressVector, Device, Gid, MemoryRegion, MrOf, Mtu, PdOf, ProtectionDomain, QpAttr, QpCaps,
    QpOf, QueuePair, RecvWr, SendOp, SendWr, Sge, WakeFor, WcOpcode, WcStatus, WorkCompletion,
};

use crate::completions::{ConnCompletions, HubPool, PortLook};
use crate::error::{from_verbs, invalid, reset};
use crate::options::Options;

mod dynamic;
mod one_sided;
mod rendezvous;
mod setup;
mod stream_ops;
#[cfg(test)]
mod tests;
mod zero_copy;

pub(crate) use dynamic::{PendingSetup, RdmaStream};
pub(crate) use setup::RdmaSetup;

/// Bytes before the ring in the receive region (the credit slot, padded to a cache line).
const SLOT_AREA: usize = 64;
/// Longest a blocked call sleeps before it looks at the TCP connection, where its sleep
/// cannot watch it (see `RdmaConn::sleep`).
pub(crate) const LIVENESS_SLICE: Duration = Duration::from_millis(20);
/// Longest a blocked call sleeps while it watches the TCP connection beside its doorbell: a
/// safety net only, since everything the call waits for wakes it.
const WATCHED_SLICE: Duration = Duration::from_secs(1);
/// Blocked calls of this process asleep in slices (their sleep cannot watch the TCP
/// connection).
static SLICED_SLEEPERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Sliced sleepers per `LIVENESS_SLICE` of slice: beyond this many, each one's slice grows
/// with their number (up to `WATCHED_SLICE`), so that together they wake at most about
/// 2,500 times a second. 2,500 threads blocked on soft connections at 20 ms slices woke
/// 320,000 times a second, and the server ran a few thousand requests a second.
const SLICED_SLEEPERS_PER_SLICE: usize = 50;

/// The slice of a sleep that cannot watch the TCP connection, with `sleepers` such sleeps
/// under way in the process: how long a peer's end may go unnoticed.
fn liveness_slice(sleepers: usize) -> Duration {
    let factor = u32::try_from(sleepers / SLICED_SLEEPERS_PER_SLICE).unwrap_or(u32::MAX).max(1);
    LIVENESS_SLICE.saturating_mul(factor).min(WATCHED_SLICE)
}

/// A sliced sleep under way, counted in `SLICED_SLEEPERS` until dropped.
struct SlicedSleep;

impl SlicedSleep {
    /// Counts this sleep and returns its slice.
    fn begin() -> (SlicedSleep, Duration) {
        let sleepers = SLICED_SLEEPERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        (SlicedSleep, liveness_slice(sleepers))
    }
}

impl Drop for SlicedSleep {
    fn drop(&mut self) {
        SLICED_SLEEPERS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
/// Work request id of the set-up probe (outside the core's sequence numbers).
const PROBE_ID: u64 = u64::MAX;
/// How long a nonblocking call that finds nothing may rely on the last look at the TCP
/// connection (see `RdmaConn::wait_woken_by`): as long as a blocked call sleeps between looks.
/// At 1 ms, a request/response connection spent a `recv` on every second or third message.
const TCP_RECHECK: Duration = LIVENESS_SLICE;
#[cfg(test)]
mod liveness_slice_tests {
    use super::*;

    #[test]
    fn the_slice_grows_with_the_sleepers_up_to_the_watched_slice() {
        assert_eq!(liveness_slice(1), LIVENESS_SLICE);
        assert_eq!(liveness_slice(SLICED_SLEEPERS_PER_SLICE - 1), LIVENESS_SLICE);
        assert_eq!(liveness_slice(2 * SLICED_SLEEPERS_PER_SLICE), 2 * LIVENESS_SLICE);
        assert_eq!(liveness_slice(1_000), Duration::from_millis(400));
        assert_eq!(liveness_slice(100_000), WATCHED_SLICE);
        assert_eq!(liveness_slice(usize::MAX), WATCHED_SLICE);
    }
}

/// Largest record this side sends.
const MAX_RECORD: u32 = 1 << 20;
/// Records a peer's ring holds at the largest record size: the reader sees a record only once
/// it is whole, so a record as large as the ring would make writer and reader take turns (the
/// writer fills the ring, then waits while the reader empties it). With a record at most an
/// eighth of the ring the reader copies one record out while the writer fills the next one
/// (measured on shm, `stream_bw` 1 MiB writes: 5.6 GB/s with ring-sized records, 8.5 GB/s
/// with 64 KiB ones in the default 512 KiB ring).
const RECORDS_PER_RING: u32 = 8;
/// Smallest cap [`max_record_for`] picks (below it a record's completion costs more than the
/// overlap wins).
const MIN_RECORD_CAP: u32 = 16 << 10;

/// The largest record this side sends into a peer ring of `peer_ring` bytes.
fn max_record_for(peer_ring: u32) -> u32 {
    (peer_ring / RECORDS_PER_RING).clamp(MIN_RECORD_CAP, MAX_RECORD)
}

/// When a blocking call gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deadline {
    /// Do not block at all.
    Now,
    /// Block until this instant (or forever).
    At(Option<Instant>),
}

impl Deadline {
    pub(crate) fn after(timeout: Option<Duration>) -> Self {
        Deadline::At(timeout.and_then(|t| Instant::now().checked_add(t)))
    }
}

/// A connected RDMA stream. Field order is drop order: the queue pair goes first.
pub(crate) struct RdmaConn<D: Device> {
    /// Unique in the process: which connection a [`crate::RegisteredBuf`] belongs to.
    id: u64,
    core: Conn,
    qp: QpOf<D>,
    recv_mr: MrOf<D>,
    /// The mirror of the peer's ring records are posted from; `None` when the provider writes
    /// the caller's bytes straight into the peer's ring (`QueuePair::write_direct`, shm).
    staging: Option<MrOf<D>>,
    cq: ConnCompletions<D>,
    _pd: PdOf<D>,
    _device: D,
    peer: RdmaEndpoint,
    wcs: Vec<WorkCompletion>,
    /// Set once the connection is broken; every later call returns it.
    failed: Option<(io::ErrorKind, String)>,
    /// The TCP connection (nonblocking): liveness and the close handshake.
    tcp: TcpStream,
    control: Vec<u8>,
    /// Records the peer sent in total, from its clean-close message.
    peer_bye: Option<u64>,
    tcp_eof: bool,
    /// When `check_tcp` last looked (see `wait_woken_by`).
    tcp_checked_at: Option<Instant>,
    /// The caller watches the TCP connection's readiness itself and looks at it when it had
    /// news (the tokio driver: `RdmaConn::set_tcp_watched`).
    tcp_watched: bool,
    /// The last arming (`arm`) asked the queue pair's doorbell for what the peer sends only
    /// (see `wait_woken_by`).
    armed_for_arrivals: bool,
    read_shut: bool,
    spin: Duration,
    linger: Duration,
    /// See `Options::event_loop_spin`.
    event_loop_spin: Duration,
    /// A message being received (kept across calls so nonblocking reads lose nothing).
    message: Vec<u8>,
    /// Large zero-copy transfers (see `rendezvous`).
    rendezvous: rendezvous::Rendezvous<D>,
    /// Sending-side state kept across calls (see `stream_ops`).
    send_state: stream_ops::SendState,
    /// Completions handled and credit words that gave room, counted: an event-loop driver
    /// compares it across a call to learn that the call changed what the other direction
    /// waits for (see `crate::tokio`).
    events: u64,
    /// The part of `events` a reader waits for: the peer's records, the completion of a
    /// rendezvous fetch, a failure or the peer's goodbye — not the acknowledgement of this
    /// side's own writes nor returned credit, which only a writer needs. The tokio driver wakes
    /// a waiting reader when a writer's call handled one of these (waking it for every
    /// completion of its own writes rescheduled hyper's connection task after each request).
    arrivals: u64,
}

impl<D: Device> RdmaConn<D> {
    /// The connection's queue pair.
    pub(crate) fn queue_pair_ref(&self) -> &QpOf<D> {
        &self.qp
    }

    /// Negotiation is over: the TCP connection becomes the (nonblocking) liveness channel.
    pub(crate) fn activate(&mut self) -> io::Result<()> {
        self.tcp.set_read_timeout(None)?;
        self.tcp.set_nonblocking(true)
    }

    fn fail(&mut self, kind: io::ErrorKind, what: String) {
        if self.failed.is_none() {
            self.arrivals += 1;
            self.failed = Some((kind, what));
        }
    }

    fn failure(&self) -> Option<io::Error> {
        self.failed.as_ref().map(|(kind, what)| io::Error::new(*kind, format!("lightpath: {what}")))
    }

    /// Polls completions, reads the credit slot and posts what the core wants. Returns
    /// whether anything happened.
    fn pump(&mut self) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let mut progressed = false;
        loop {
            let n = match self.cq.poll(&mut self.wcs) {
                Ok(n) => n,
                Err(err) => {
                    self.fail(io::ErrorKind::Other, format!("polling the completion queue: {err}"));
                    return true;
                }
            };
            self.handle_taken(n);
            progressed |= n > 0;
            if n < self.wcs.len() {
                break;
            }
        }
        self.post_allowed();
        progressed
    }

    /// After a look that took `n` completions into `wcs` (handled; an arming's, or a sleep's):
    /// a poll now would look again for nothing (anything later rings the doorbell, or is found
    /// by the next call), so only what those completions allow is done. It polls when they
    /// filled `wcs` (there is more), and with `poll_if_none` when there were none (a sleep that
    /// ran out).
    fn after_look(&mut self, n: usize, poll_if_none: bool) {
        if n == self.wcs.len() || (n == 0 && poll_if_none) {
            self.pump();
        } else {
            self.post_allowed();
        }
    }

    /// What `pump` does after its polls: reads the credit slot when credits run low and posts
    /// what the core wants.
    fn post_allowed(&mut self) {
        if self.core.credit_low() {
            self.read_slot();
        }
        self.post_ops();
    }

    fn read_slot(&mut self) -> bool {
        let mut word = [0u8; 8];
        if self.recv_mr.read(0, &mut word).is_err() {
            return false;
        }
        let progressed = self.core.on_credit_word(CreditWord::from_bytes(word));
        self.events += u64::from(progressed);
        progressed
    }

    fn handle(&mut self, wc: WorkCompletion) {
        self.events += 1;
        if !wc.status.is_success() {
            if self.core.is_rendezvous_read(wc.wr_id)
                && matches!(wc.status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr)
            {
                let what = format!(
                    "the peer's rendezvous names memory it does not let us read ({}): a bad address, length or key",
                    wc.status
                );
                return self.fail(io::ErrorKind::InvalidData, what);
            }
            if wc.status != WcStatus::WrFlushErr || self.failed.is_none() {
                // Retries run out when the peer's queue pair stopped answering: if its TCP
                // connection ended too, the peer went away, which says more than the status.
                if wc.status == WcStatus::RetryExcErr && self.failed.is_none() {
                    // Only read it: this runs inside a loop over `wcs`, which collecting
                    // completions here would overwrite.
                    self.read_tcp();
                }
                let what = if self.tcp_eof && wc.status == WcStatus::RetryExcErr {
                    format!(
                        "the peer vanished: RDMA transfer failed ({}{})",
                        wc.status,
                        vendor_detail(wc.vendor_err)
                    )
                } else {
                    format!("RDMA transfer failed ({}{})", wc.status, vendor_detail(wc.vendor_err))
                };
                self.fail(io::ErrorKind::ConnectionReset, what);
            }
            return;
        }
        match wc.opcode {
            WcOpcode::RecvRdmaWithImm => match self.core.on_recv(wc.imm_data.unwrap_or(0), wc.byte_len) {
                Ok(Arrival::Credit) => {
                    self.read_slot();
                }
                Ok(_) => self.arrivals += 1,
                Err(err) => self.fail(io::ErrorKind::InvalidData, format!("protocol violation: {err}")),
            },
            WcOpcode::Recv => self.fail(io::ErrorKind::InvalidData, "peer sent a SEND".into()),
            _ => {
                if self.core.is_rendezvous_read(wc.wr_id) {
                    self.arrivals += 1;
                }
                self.core.on_send_complete(wc.wr_id)
            }
        }
    }

    /// Handles the first `n` completions of `wcs` (what a poll, wait or arming just put
    /// there).
    fn handle_taken(&mut self, n: usize) {
        for i in 0..n {
            let wc = self.wcs[i];
            self.handle(wc);
        }
    }

    fn post_ops(&mut self) {
        while self.failed.is_none() {
            let Some(op) = self.core.poll_op() else { break };
            if let Err(err) = self.post(op) {
                self.fail(io::ErrorKind::ConnectionReset, format!("posting a work request: {err}"));
            }
        }
    }

    fn post(&mut self, op: Op) -> lightpath_verbs::Result<()> {
        match op {
            Op::PostRecv { count } => {
                let recvs: Vec<RecvWr<'_>> = (0..count).map(|_| RecvWr::new(0, &[])).collect();
                self.qp.post_recv_batch(&recvs).map_err(|err| err.error)
            }
            Op::Write { seq, pos, len, imm, signaled } => {
                let offset = pos % u64::from(self.peer.ring_len);
                let remote_addr = self.peer.ring_addr + offset;
                let rkey = self.peer.ring_rkey;
                let op = match imm {
                    Some(imm) => SendOp::WriteWithImm { remote_addr, rkey, imm },
                    None => SendOp::Write { remote_addr, rkey },
                };
                // Written directly (no staging): a zero-length request announces the bytes.
                let sge = self.staging.as_ref().map(|staging| [staging.sge(offset as usize, len)]);
                let sges: &[Sge] = match &sge {
                    Some(sge) if len > 0 => sge,
                    _ => &[],
                };
                let flags = if signaled {
                    lightpath_verbs::SendFlags::SIGNALED
                } else {
                    lightpath_verbs::SendFlags::NONE
                };
                self.qp.post_send(&SendWr::new(seq, op, sges).with_flags(flags))
            }
            Op::Credit { seq, word, imm, signaled } => {
                let (remote_addr, rkey) = (self.peer.credit_addr, self.peer.credit_rkey);
                let op = match imm {
                    Some(imm) => SendOp::WriteWithImm { remote_addr, rkey, imm },
                    None => SendOp::Write { remote_addr, rkey },
                };
                let bytes = word.to_bytes();
                let mut wr = SendWr::inline(seq, op, &bytes);
                if !signaled {
                    wr.flags = lightpath_verbs::SendFlags::INLINE;
                }
                self.qp.post_send(&wr)
            }
        }
    }

    /// Reads what the TCP connection has (the peer's clean close, an error, or EOF) and
    /// collects what that makes due (see `settle_after_tcp`).
    fn check_tcp(&mut self) {
        let ended_before = self.tcp_eof;
        self.read_tcp();
        self.settle_after_tcp(ended_before);
    }

    /// Reads what the TCP connection has: the peer's clean close, an error, or EOF.
    fn read_tcp(&mut self) {
        self.tcp_checked_at = Some(Instant::now());
        // Never block here, whatever mode another handle of this socket left it in: each read
        // says so itself (one system call per look; an event loop looks after every wake-up).
        let mut buf = [0u8; 512];
        loop {
            match rustix::net::recv(&self.tcp, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
                Ok((0, _)) => {
                    self.arrivals += u64::from(!self.tcp_eof);
                    self.tcp_eof = true;
                    break;
                }
                Ok((n, _)) => self.control.extend_from_slice(&buf[..n]),
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    self.arrivals += u64::from(!self.tcp_eof);
                    self.tcp_eof = true;
                    break;
                }
            }
        }
        loop {
            match Message::parse(&self.control) {
                Ok(Some((message, used))) => {
                    self.control.drain(..used);
                    match message {
                        Message::Bye { records, .. } => {
                            self.arrivals += 1;
                            self.peer_bye = Some(records)
                        }
                        Message::Error(text) => {
                            self.fail(io::ErrorKind::ConnectionReset, format!("peer: {text}"))
                        }
                        other => self.fail(
                            io::ErrorKind::InvalidData,
                            format!("unexpected {:?} message on the liveness channel", other.message_type()),
                        ),
                    }
                }
                Ok(None) => break,
                Err(err) => {
                    self.fail(io::ErrorKind::InvalidData, format!("liveness channel: {err}"));
                    break;
                }
            }
        }
    }

    /// After a look at the TCP connection (`ended_before`: its end was known before the look):
    /// collects the completions a goodbye or the connection's end makes due.
    fn settle_after_tcp(&mut self, ended_before: bool) {
        if self.peer_bye.is_some() {
            // Everything the peer sent was acknowledged before its goodbye: collect it.
            self.pump();
        } else if self.tcp_eof && !ended_before {
            // No goodbye: the peer's process ended, or it closed its socket without a clean
            // close. What it sent before (a close record after a half close) reached this side
            // before its TCP connection's end, but on a queue pair with a port of its own it
            // may still wait there unread: take it in before anyone judges the peer vanished
            // (a tokio reader woken by the end of the TCP connection read "the peer vanished"
            // instead of the end of the stream).
            self.take_in_own_port();
        }
    }

    /// Takes in and handles what waits in the queue pair's own port (see
    /// `ConnCompletions::take_in_own_port`).
    fn take_in_own_port(&mut self) {
        let taken = self.cq.take_in_own_port(&self.qp, &mut self.wcs);
        self.after_widened_arming(taken, "taking in the queue pair's port");
    }

    /// After an arming for anything (`widen_arming`, `take_in_own_port`): handles the
    /// completions it took (`taken` of `wcs`) and what they make due, or fails with what it
    /// was `doing`.
    fn after_widened_arming(&mut self, taken: lightpath_verbs::Result<usize>, doing: &str) {
        self.armed_for_arrivals = false;
        match taken {
            Ok(n) => {
                self.handle_taken(n);
                self.pump();
            }
            Err(err) => self.fail(io::ErrorKind::Other, format!("{doing}: {err}")),
        }
    }

    /// Whether the peer is gone for good (its process died or it closed without goodbye).
    fn peer_vanished(&self) -> bool {
        self.tcp_eof && self.peer_bye.is_none()
    }

    /// For a read that found nothing to take: `Ok(false)` at end of stream; an error if the
    /// connection broke or the peer vanished; otherwise one blocking step, then `Ok(true)`
    /// (look again).
    fn wait_readable(&mut self, deadline: Deadline) -> io::Result<bool> {
        if self.at_eof() {
            return Ok(false);
        }
        self.check_usable()?;
        if self.peer_vanished() {
            return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
        }
        if let Err(err) = self.wait_woken_by(deadline, self.reader_wake()) {
            self.cq.note_wait(|| format!("read's wait failed ({err}): {:?}", self.core));
            return Err(err);
        }
        Ok(true)
    }

    /// What a reader that found nothing waits for: only what the peer sends, unless this side
    /// needs its own requests acknowledged to go on (see `Conn::needs_acks`).
    pub(crate) fn reader_wake(&self) -> WakeFor {
        if self.core.needs_acks() {
            WakeFor::Anything
        } else {
            WakeFor::Arrivals
        }
    }

    /// End of stream for a message reader: an error if it came inside a message.
    fn end_of_messages(&self) -> io::Result<()> {
        if self.message.is_empty() {
            return Ok(());
        }
        Err(io::Error::new(io::ErrorKind::UnexpectedEof, "lightpath: stream ended inside a message"))
    }

    /// Whether the peer will send nothing more and everything it sent has been read.
    fn at_eof(&self) -> bool {
        if self.read_shut || self.core.at_eof() {
            return true;
        }
        match self.peer_bye {
            Some(records) => self.core.records_received() >= records && self.core.front().is_none(),
            None => false,
        }
    }

    /// One blocking step: spin, then sleep on the completion queue for at most a slice, and
    /// look at the TCP connection. Errors with `TimedOut` past the deadline.
    fn wait(&mut self, deadline: Deadline) -> io::Result<()> {
        self.wait_woken_by(deadline, WakeFor::Anything)
    }

    /// `wait`, woken only for what `wake` says.
    fn wait_woken_by(&mut self, deadline: Deadline, wake: WakeFor) -> io::Result<()> {
        let Deadline::At(deadline) = deadline else {
            // A nonblocking call that found nothing: look at the TCP connection unless that was
            // done a moment ago. An event loop looks on every wake-up (`poll_ready`, the tokio
            // driver: `poll_tcp`) and then retries, so a look here too cost a second system
            // call per message for nothing; a caller that only retries still sees the peer's
            // goodbye or death within `TCP_RECHECK`.
            //
            // Both looks may take in completions (a peer's goodbye makes this side collect
            // what the peer had acknowledged; a widened arming takes what came before it).
            // Those raise no event any more, so if anything was taken in the caller looks
            // again at once (`Ok`) rather than wait for one: it may be just what the call
            // waits for (a tokio close's flush slept for good once when its last
            // acknowledgement was collected by the look at the peer's goodbye).
            let before = self.progress_mark();
            if !self.tcp_watched && self.tcp_checked_at.is_none_or(|at| at.elapsed() >= TCP_RECHECK) {
                self.check_tcp();
            }
            if wake == WakeFor::Anything && self.armed_for_arrivals {
                self.widen_arming();
            }
            if self.progress_mark() != before {
                return Ok(());
            }
            return Err(io::ErrorKind::WouldBlock.into());
        };
        let spin_until = Instant::now() + self.spin;
        while Instant::now() < spin_until {
            if self.pump() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let n = self.sleep(Deadline::At(deadline), wake)?;
        self.after_look(n, true);
        if n == 0 {
            self.check_tcp();
        }
        Ok(())
    }

    /// Sleeps until completions arrive (handled, and their count returned), the TCP
    /// connection has news, or a slice passes (0 then; the caller looks at the TCP
    /// connection). `TimedOut` past the deadline.
    ///
    /// Where the wait goes straight to the queue pair's doorbell, the sleep watches the TCP
    /// connection too (until its end is known: a closed socket stays readable), so a peer's
    /// goodbye or death ends it at once and the slice is only a safety net
    /// ([`WATCHED_SLICE`]). Otherwise the sleep is cut into [`LIVENESS_SLICE`]s, longer when
    /// many such sleeps are under way in the process ([`liveness_slice`]). Waking every 20 ms
    /// to look cost each blocked thread 50 wake-ups a second: with a thread per connection and
    /// 1,000 connections, 50,000 a second on an idle server.
    pub(super) fn sleep(&mut self, deadline: Deadline, wake: WakeFor) -> io::Result<usize> {
        let watch = !self.tcp_eof && self.cq.can_watch();
        let sliced = (!watch).then(SlicedSleep::begin);
        let cap = sliced.as_ref().map_or(WATCHED_SLICE, |(_, slice)| *slice);
        let now = Instant::now();
        let slice = match deadline {
            Deadline::At(Some(at)) if at <= now => return Err(io::ErrorKind::TimedOut.into()),
            Deadline::At(Some(at)) => (at - now).min(cap),
            Deadline::At(None) => cap,
            Deadline::Now => LIVENESS_SLICE,
        };
        let n = if watch {
            use std::os::fd::AsFd;
            self.cq.wait_watching(&self.qp, &mut self.wcs, slice, wake, self.tcp.as_fd())
        } else {
            self.cq.wait(&self.qp, &mut self.wcs, slice, wake)
        }
        .map_err(from_verbs)?;
        self.handle_taken(n);
        Ok(n)
    }

    fn check_usable(&mut self) -> io::Result<()> {
        if let Some(err) = self.failure() {
            return Err(err);
        }
        Ok(())
    }

    /// Whether the close handshake finished (the queue pair must then outlive this call
    /// until the peer closes too, see `reaper`).
    pub(crate) fn closed_cleanly(&self) -> bool {
        self.failed.is_none() && self.core.is_flushed() && !self.tcp_eof
    }

    /// How long a closed connection waits for its peer.
    pub(crate) fn linger(&self) -> Duration {
        self.linger
    }

    /// The TCP connection.
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The fd that announces this connection's completions once armed (see `arm`).
    pub(crate) fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        self.cq.notify_fd()
    }

    /// Whether an event loop's task can wait without `notify_fd` (see
    /// `ConnCompletions::wakes_tasks`).
    pub(crate) fn wakes_tasks(&self) -> bool {
        self.cq.wakes_tasks()
    }

    /// The device's task doorbell this connection is woken through, if it is (see
    /// `ConnCompletions::task_doorbell`).
    pub(crate) fn task_doorbell(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskDoorbell>> {
        self.cq.task_doorbell().cloned()
    }

    /// The device's look at its event loops' queue pairs, if its provider has one (soft:
    /// their ports), for an event loop that spins after this connection's task went to wait.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn task_spin(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskSpin>> {
        self.qp.task_spin()
    }

    /// How long the dispatcher of this connection's task doorbell spins (see
    /// `Options::event_loop_spin`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn event_loop_spin(&self) -> Duration {
        self.event_loop_spin
    }

    /// Whether a wake-up came since the last call; leaves `waker` for the next one otherwise
    /// (see `ConnCompletions::poll_woken`).
    pub(crate) fn poll_woken(&self, waker: &std::task::Waker) -> bool {
        self.cq.poll_woken(waker)
    }

    /// The queue pair's own descriptor, to watch beside `notify_fd` (see
    /// `ConnCompletions::poll_fd`).
    pub(crate) fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        self.cq.poll_fd()
    }

    /// Consumes a pending notification; returns whether there was one.
    pub(crate) fn take_notify(&mut self) -> bool {
        self.cq.take_notify()
    }

    /// Whether a read would not block (data, end of stream or an error).
    pub(crate) fn readable_now(&self) -> bool {
        self.front_ready() || self.at_eof() || self.failed.is_some() || self.peer_vanished()
    }

    /// An event loop armed the readiness fd for what the peer sends (`Stream::poll_ready` does
    /// unless this side needs its own completions, see `reader_wake`: arming for everything
    /// woke a request/response peer twice per message, once when the other side took its
    /// request and once with the answer), then a nonblocking call gave up waiting for
    /// something this side's own requests bring (an acknowledgement a flush waits for, room
    /// behind records in flight). The arming is widened to everything before the call returns
    /// `WouldBlock`, so the loop's sleep ends when that comes; if it came already, the call
    /// looks again instead of returning (see `wait_woken_by`).
    fn widen_arming(&mut self) {
        let taken = self.cq.widen_to_anything(&self.qp, &mut self.wcs);
        self.after_widened_arming(taken, "arming the completion queue");
    }

    /// What a look of a nonblocking call may have changed that no event will announce:
    /// completions and credit returns handled, a failure. (What the TCP connection brought —
    /// the goodbye, its end — is left out: its readiness stays set for the event loop, and a
    /// caller looking again at once would judge the peer gone before an arming took in the
    /// records it sent just before, still waiting on its queue pair's own port: a tokio read
    /// then reported a reset for a peer that had half-closed and exited.)
    fn progress_mark(&self) -> (u64, bool) {
        (self.events, self.failed.is_some())
    }

    /// Whether a write would not block.
    pub(crate) fn writable_now(&mut self) -> bool {
        self.read_slot();
        self.failed.is_some()
            || self.core.is_shut_down()
            || self.tcp_eof
            || self.core.send_room(RecordKind::Data, 1).is_some()
    }

    /// How many completions and credit returns this connection has handled so far.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn events(&self) -> u64 {
        self.events
    }

    /// How many of those were what a reader waits for (see the `arrivals` field).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn arrivals(&self) -> u64 {
        self.arrivals
    }

    /// Nonblocking look at the TCP connection (for event-loop drivers).
    pub(crate) fn poll_tcp(&mut self) {
        self.check_tcp();
    }

    /// Whether the caller watches the TCP connection's readiness and calls `poll_tcp` when it
    /// had news (the tokio driver does): then a nonblocking call that finds nothing does not
    /// look at it every `TCP_RECHECK` as well. With many connections that look was a `recv`
    /// per request (1,000 connections, each answering every 20-25 ms: every request found its
    /// last look older than `TCP_RECHECK`).
    pub(crate) fn set_tcp_watched(&mut self, watched: bool) {
        self.tcp_watched = watched;
    }

    /// Whether a look at the TCP connection found its end (EOF or an error): nothing further
    /// can come on it, though it may report readable (or closed) for good.
    #[cfg_attr(not(any(feature = "tokio", test)), allow(dead_code))] // the tokio driver, tests
    pub(crate) fn tcp_ended(&self) -> bool {
        self.tcp_eof
    }
}

impl<D: Device + 'static> RdmaConn<D> {
    /// Arms the notification fd; returns `false` if something is ready already (the caller
    /// then does not wait). `look`: whether the queue pair's own descriptor is taken in too
    /// (see `PortLook`).
    pub(crate) fn arm(&mut self, wake: WakeFor, look: PortLook) -> io::Result<bool> {
        self.armed_for_arrivals = wake == WakeFor::Arrivals;
        let progressed = match self.cq.request_notify(&self.qp, &mut self.wcs, wake, look)? {
            // The doorbell's arming looked at the queue pair and took what was there.
            Some(n) => {
                self.handle_taken(n);
                self.after_look(n, false);
                n > 0
            }
            None => self.pump(),
        };
        // A reader armed for what the peer sends that found only its own requests'
        // acknowledgements (and what they freed) has still nothing to read: it stays armed.
        // Saying "ready" sent an event loop round once more (the read, `WouldBlock`, another
        // arming and its look at the socket) for every acknowledgement that came with a
        // request.
        if progressed && wake == WakeFor::Arrivals && !self.readable_now() {
            return Ok(true);
        }
        Ok(!progressed)
    }
}

impl<D: Device + 'static> crate::reaper::Parked for RdmaConn<D> {
    fn peer_done(&mut self) -> bool {
        self.check_tcp();
        self.tcp_eof
    }
}

/// What a completion's vendor error says, for the message of a failed transfer ("" for none):
/// the shm provider's say why its link went down (the flushes after it carry the same value).
fn vendor_detail(vendor_err: u32) -> String {
    match vendor_err {
        0 => String::new(),
        lightpath_shm::VENDOR_ERR_PEER_GONE => ", the peer's queue pair went away".into(),
        lightpath_shm::VENDOR_ERR_PEER_CORRUPT => ", the peer broke the shm protocol".into(),
        other => format!(", vendor error {other:#x}"),
    }
}
