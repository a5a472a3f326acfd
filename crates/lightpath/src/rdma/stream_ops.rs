//! The stream operations of an RDMA connection: reading and writing bytes, messages, flush,
//! half close and the clean close.
//!
//! **Kept bytes.** A call that has committed part of a message (or of a zero-copy write copied
//! through the ring) and cannot commit the rest without waiting — nonblocking mode, or a write
//! timeout that passed — keeps the rest in [`SendState`] and returns `Ok`: the message is
//! accepted whole, as the TCP fallback keeps an accepted message. What is kept goes out before
//! anything else, pushed by every later call on the stream (writes, messages, flush, half
//! close, close, reads, `poll_ready`, and the tokio driver's retries, which wait for it);
//! until it has, writes and messages wait for it (`WouldBlock` in nonblocking mode) and the
//! stream does not report itself writable. So a nonblocking call never blocks, at most one
//! remainder is kept, and message boundaries and byte order are those of the calls.
//!
//! **Closing while the peer writes.** Once this side's own records are posted, the clean close
//! only collects their acknowledgements: it no longer answers the peer (no credit returns, no
//! wake-ups), so a peer that keeps writing is stopped by its own flow control, the close
//! finishes after one round trip, and the peer's writes fail with `BrokenPipe` once it sees the
//! goodbye. What the peer wrote and this side never read is discarded, as a TCP close discards
//! unread bytes.

use super::*;
use crate::remote::BufRegion;

/// Sending-side state a connection keeps between calls.
#[derive(Debug, Default)]
pub(super) struct SendState {
    /// Accepted bytes not yet committed (see the module docs); the first `kept_sent` of them
    /// are committed already.
    kept: Vec<u8>,
    kept_sent: usize,
    /// Whether `kept` ends a message (else it is stream bytes).
    kept_message: bool,
    /// A half close asked for while bytes were kept: the close record follows them.
    shutdown_after_kept: bool,
    /// This side shut its sending side down (`shutdown_write`), whether or not its close
    /// record could still be queued.
    write_shut: bool,
    /// A rendezvous a nonblocking call announced whose fetch that call has not yet seen (see
    /// `rendezvous`).
    pub(super) announced: Option<super::rendezvous::Announced>,
}

/// Whether `deadline` had passed when the call began. Real callers' deadlines lie ahead (a
/// timeout is never zero); an expired one is how a dropped tokio future abandons a zero-copy
/// call it started (see `crate::tokio`): such a call starts nothing.
pub(super) fn expired(deadline: Deadline) -> bool {
    matches!(deadline, Deadline::At(Some(at)) if at <= Instant::now())
}

/// One step of [`RdmaConn::read_with`] that touches the caller's buffer.
enum ReadStep {
    /// Copy `n` ring bytes at region offset `at` to the buffer's bytes `done..done + n`.
    Copy { at: usize, done: usize, n: usize },
    /// A rendezvous is at the head of the stream, nothing copied yet: fetch it into the
    /// buffer, returning how many bytes landed, or `None` if this buffer cannot take one.
    Rendezvous,
}

impl<D: Device> RdmaConn<D> {
    /// Reads stream bytes.
    pub(crate) fn read(&mut self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize> {
        let read = self.read_with(buf.len(), deadline, |conn, step| match step {
            ReadStep::Copy { at, done, n } => {
                conn.recv_mr.read(at, &mut buf[done..done + n]).map_err(from_verbs).map(|()| Some(n))
            }
            ReadStep::Rendezvous => conn.read_rendezvous(buf).map(Some),
        })?;
        Ok(read.unwrap_or(0))
    }

    /// [`RdmaConn::read`] into memory not yet initialised (an event loop's spare buffer
    /// capacity, which need not be zeroed first): `Some(n)` once the first `n` bytes of `buf`
    /// hold stream bytes (0: the peer closed); `None`, with nothing written, when a
    /// rendezvous is at the head of the stream (it lands through `read`).
    pub(crate) fn read_uninit(
        &mut self,
        buf: &mut [std::mem::MaybeUninit<u8>],
        deadline: Deadline,
    ) -> io::Result<Option<usize>> {
        self.read_with(buf.len(), deadline, |conn, step| match step {
            ReadStep::Copy { at, done, n } => {
                conn.recv_mr.read_uninit(at, &mut buf[done..done + n]).map_err(from_verbs)?;
                Ok(Some(n))
            }
            ReadStep::Rendezvous => Ok(None),
        })
    }

    /// The reading loop of [`RdmaConn::read`] for a buffer of `len` bytes, which `step`
    /// writes (a copy's value is not looked at; a rendezvous' is the bytes that landed).
    /// `None` when `step` could not take a rendezvous.
    fn read_with(
        &mut self,
        len: usize,
        deadline: Deadline,
        mut step: impl FnMut(&mut Self, ReadStep) -> io::Result<Option<usize>>,
    ) -> io::Result<Option<usize>> {
        self.check_no_direct_call()?;
        if len == 0 {
            return Ok(Some(0));
        }
        self.push_kept_quietly();
        // `wait` returns right after a pump that made progress; pumping again at once would
        // cost a system call per message for nothing.
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            let mut done = 0;
            while done < len {
                let Some(front) = self.core.front() else { break };
                if front.kind == RecordKind::Rendezvous {
                    if done == 0 {
                        match step(self, ReadStep::Rendezvous)? {
                            Some(n) => done = n,
                            None => return Ok(None),
                        }
                    }
                    break;
                }
                if front.kind != RecordKind::Data {
                    if done > 0 {
                        break;
                    }
                    return Err(invalid("the peer sent a message here; use recv_msg"));
                }
                let n = (front.contiguous as usize).min(len - done);
                let at = SLOT_AREA + front.offset as usize;
                step(self, ReadStep::Copy { at, done, n })?;
                self.core.consume(n as u32);
                done += n;
            }
            if done > 0 {
                self.post_ops();
                return Ok(Some(done));
            }
            if !self.wait_readable(deadline)? {
                return Ok(Some(0));
            }
            just_pumped = true;
        }
    }

    /// Writes stream bytes: returns once at least one byte is committed (as many as fit).
    /// Kept bytes go first. An empty `buf` only pushes them: `Ok(0)` once nothing is kept,
    /// `WouldBlock` (nonblocking) while some is — how `Stream::poll_ready`, the tokio driver
    /// and the background close push them through the `RdmaStream` trait.
    pub(crate) fn write(&mut self, buf: &[u8], deadline: Deadline) -> io::Result<usize> {
        self.write_vectored(&[io::IoSlice::new(buf)], deadline)
    }

    /// [`RdmaConn::write`] of the slices in turn, as far as they fit: consecutive bytes
    /// committed before the record is posted join one record, so a header and a body in
    /// separate buffers go as one write with immediate (one completion and at most one
    /// doorbell at the peer) rather than two.
    pub(crate) fn write_vectored(
        &mut self,
        bufs: &[io::IoSlice<'_>],
        deadline: Deadline,
    ) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|buf| buf.len()).sum();
        if total > 0 {
            self.check_not_shut_down()?;
        }
        self.clear_kept(deadline)?;
        if total == 0 {
            return Ok(0);
        }
        // A writer that never waits (the ring has room) still learns of the peer's goodbye or
        // death, within `TCP_RECHECK` (one look per interval, not per write), and its writes
        // then fail as a TCP writer's do after the peer closed; before, such writes were
        // accepted and dropped for as long as the peer's queue pair lived.
        if !self.tcp_watched && self.tcp_checked_at.is_none_or(|at| at.elapsed() >= TCP_RECHECK) {
            self.check_tcp();
        }
        loop {
            self.check_writable()?;
            self.read_slot();
            let mut done = 0;
            'slices: for buf in bufs.iter().filter(|buf| !buf.is_empty()) {
                let mut from = 0;
                while from < buf.len() {
                    let Some((grant, offset)) = self.core.send_room(RecordKind::Data, buf.len() - from)
                    else {
                        break 'slices;
                    };
                    let staged = self.stage(offset, &buf[from..from + grant as usize]);
                    self.staged(staged)?;
                    self.core.commit(RecordKind::Data, grant);
                    from += grant as usize;
                    done += grant as usize;
                }
            }
            if done > 0 {
                self.post_ops();
                return Ok(done);
            }
            self.core.note_blocked();
            self.post_ops();
            self.wait(deadline)?;
        }
    }

    /// Sends one message. Once part of it is committed the message is accepted: if the rest
    /// does not fit before the deadline (at once, in nonblocking mode) it is kept and sent by
    /// later calls, and this returns `Ok`.
    pub(crate) fn send_msg(&mut self, msg: &[u8], deadline: Deadline) -> io::Result<()> {
        self.check_not_shut_down()?;
        self.clear_kept(deadline)?;
        let mut done = 0;
        loop {
            self.check_writable()?;
            self.read_slot();
            while let Some((grant, offset)) = self.core.send_room(RecordKind::MsgPart, msg.len() - done) {
                let last = grant as usize == msg.len() - done;
                let staged = self.stage(offset, &msg[done..done + grant as usize]);
                self.staged(staged)?;
                self.core.commit(if last { RecordKind::MsgEnd } else { RecordKind::MsgPart }, grant);
                done += grant as usize;
                if last {
                    self.post_ops();
                    return Ok(());
                }
            }
            self.core.note_blocked();
            self.post_ops();
            if let Err(err) = self.wait(deadline) {
                if done == 0 {
                    return Err(err);
                }
                return self.keep_or_fail(err, msg[done..].to_vec(), true);
            }
        }
    }

    /// After part of a message or zero-copy write was committed and waiting for room ended in
    /// `err`: keeps `rest` if the wait only gave up (nonblocking, timeout), or breaks the
    /// connection (the peer would otherwise see the record cut short).
    pub(super) fn keep_or_fail(&mut self, err: io::Error, rest: Vec<u8>, message: bool) -> io::Result<()> {
        if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            self.send_state.kept = rest;
            self.send_state.kept_sent = 0;
            self.send_state.kept_message = message;
            return Ok(());
        }
        self.fail(err.kind(), format!("waiting for room in the middle of a record: {err}"));
        Err(err)
    }

    /// Copies `len` bytes of `local` from `offset` into a kept remainder (see
    /// [`RdmaConn::keep_or_fail`]).
    pub(super) fn keep_region_or_fail(
        &mut self,
        err: io::Error,
        local: &dyn BufRegion,
        offset: usize,
        len: usize,
        message: bool,
    ) -> io::Result<()> {
        let mut rest = vec![0u8; len];
        local.read(offset, &mut rest).map_err(from_verbs)?;
        self.keep_or_fail(err, rest, message)
    }

    /// Commits as much of the kept bytes as fits now. `Ok(true)` once nothing is kept (at
    /// once if nothing was); `Ok(false)` while some is (the peer has been asked to wake this
    /// side when room returns); an error if the connection can send nothing any more.
    pub(super) fn push_kept(&mut self) -> io::Result<bool> {
        if self.send_state.kept.is_empty() {
            return Ok(true);
        }
        self.check_peer_writable()?;
        self.read_slot();
        let message = self.send_state.kept_message;
        let part = if message { RecordKind::MsgPart } else { RecordKind::Data };
        loop {
            let left = self.send_state.kept.len() - self.send_state.kept_sent;
            let Some((grant, offset)) = self.core.send_room(part, left) else { break };
            let from = self.send_state.kept_sent;
            let staged = self.stage(offset, &self.send_state.kept[from..from + grant as usize]);
            self.staged(staged)?;
            let last = grant as usize == left;
            self.core.commit(if message && last { RecordKind::MsgEnd } else { part }, grant);
            self.send_state.kept_sent += grant as usize;
            if last {
                self.send_state.kept = Vec::new();
                self.send_state.kept_sent = 0;
                if std::mem::take(&mut self.send_state.shutdown_after_kept) {
                    self.core.shutdown();
                }
                self.post_ops();
                return Ok(true);
            }
        }
        self.core.note_blocked();
        self.post_ops();
        Ok(false)
    }

    /// Waits (within `deadline`) until nothing is kept.
    pub(super) fn clear_kept(&mut self, deadline: Deadline) -> io::Result<()> {
        while !self.push_kept()? {
            self.wait(deadline)?;
        }
        Ok(())
    }

    /// Pushes kept bytes without waiting, for calls whose own result does not depend on them
    /// (reads): an error here is the sending side's, reported by the next send.
    pub(super) fn push_kept_quietly(&mut self) {
        if !self.send_state.kept.is_empty() {
            let _ = self.push_kept();
        }
    }

    /// Forgets kept bytes that can never be sent (the peer closed or the connection failed).
    fn drop_kept(&mut self) {
        self.send_state.kept = Vec::new();
        self.send_state.kept_sent = 0;
        if std::mem::take(&mut self.send_state.shutdown_after_kept) {
            self.core.shutdown();
        }
    }

    /// Receives one message; `None` at end of stream.
    pub(crate) fn recv_msg(&mut self, deadline: Deadline) -> io::Result<Option<Vec<u8>>> {
        self.check_no_direct_call()?;
        self.push_kept_quietly();
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            while let Some(front) = self.core.front() {
                if front.kind == RecordKind::Rendezvous {
                    match self.recv_msg_rendezvous()? {
                        Some(message) => return Ok(Some(message)),
                        None => break,
                    }
                }
                if !front.kind.is_message() {
                    return Err(invalid("the peer sent stream bytes here; use read"));
                }
                let start = self.message.len();
                self.message.resize(start + front.contiguous as usize, 0);
                let at = SLOT_AREA + front.offset as usize;
                self.recv_mr.read(at, &mut self.message[start..]).map_err(from_verbs)?;
                if self.core.consume(front.contiguous) {
                    self.post_ops();
                    return Ok(Some(std::mem::take(&mut self.message)));
                }
            }
            self.post_ops();
            if !self.wait_readable(deadline)? {
                return self.end_of_messages().map(|()| None);
            }
            just_pumped = true;
        }
    }

    /// Waits until everything written has been acknowledged by the peer: kept bytes sent,
    /// every record acknowledged, and a rendezvous a nonblocking call announced fetched.
    ///
    /// Once that holds, a failure that came after it does not fail the flush: a peer that read
    /// everything, closed its side and went away (its queue pair gone, so ours flushes its
    /// receives) has had all of it, as a TCP socket's data acknowledged before a reset was.
    ///
    /// Nor does a close wait once the peer has closed too: after this side's shutdown, the
    /// peer's goodbye (it closed fully and reads nothing more) ends the flush, whatever became
    /// of the connection since. Its queue pair would still acknowledge what is in flight while
    /// its process lives, but a peer whose process ended right after its goodbye never will,
    /// and the close then waited for the retries to run out (about two seconds, for every
    /// client process that exited: seen behind `lightpath perf`'s event-loop server).
    pub(crate) fn flush(&mut self, deadline: Deadline) -> io::Result<()> {
        self.core.uncork();
        loop {
            if self.closed_after_peer_bye() {
                return Ok(());
            }
            let clear = self.push_kept()?;
            self.pump();
            if clear && self.core.is_flushed() && !self.core.rendezvous_outstanding() {
                return Ok(());
            }
            if self.closed_after_peer_bye() {
                return Ok(());
            }
            self.check_usable()?;
            if self.peer_vanished() {
                return Err(reset("the peer vanished before acknowledging"));
            }
            match self.wait(deadline) {
                // Nothing kept: what is missing is the peer's acknowledgement, not room.
                Err(err) if clear && err.kind() == io::ErrorKind::WouldBlock => {
                    self.cq.note_wait(|| format!("flush awaiting the peer: {:?}", self.core));
                    return Err(crate::stream::AwaitingPeer::would_block());
                }
                Err(err) => {
                    self.cq.note_wait(|| format!("flush's wait failed ({err}): {:?}", self.core));
                    return Err(err);
                }
                Ok(()) => {}
            }
        }
    }

    /// This side shut its sending side down and the peer has closed fully (its goodbye came):
    /// nothing this side sent needs acknowledging any more (see `flush`). Not while a
    /// rendezvous this side announced may still be fetched from the caller's buffer.
    ///
    /// A connection that failed meanwhile (shm notices a peer's exit at once) first looks at
    /// the TCP connection for that goodbye, which may not have been read yet.
    fn closed_after_peer_bye(&mut self) -> bool {
        if !self.send_state.write_shut || self.core.rendezvous_outstanding() {
            return false;
        }
        if self.peer_bye.is_none() && self.failed.is_some() && !self.tcp_eof {
            self.read_tcp();
        }
        self.peer_bye.is_some()
    }

    /// One nonblocking step for busy-polling drivers (`Stream::drive`): pushes kept bytes,
    /// reaps completions, posts queued records; no system call on the TCP connection.
    ///
    /// A failed connection (the peer died, its queue pair stopped answering) still reports
    /// what happened before the failure, as a TCP socket lets the bytes that arrived before a
    /// reset be read: records that landed stay readable (`read` returns them, then the
    /// error), and writes whose records were all posted count as handed over. The error is
    /// returned here only once neither holds (a later `read` or `write` reports it too).
    pub(crate) fn drive(&mut self) -> io::Result<crate::stream::Driven> {
        let kept_clear = if self.failed.is_none() {
            let kept_clear = self.push_kept()?;
            self.pump();
            kept_clear
        } else {
            self.send_state.kept.is_empty()
        };
        if let Some(err) = self.failure() {
            let handed_over = kept_clear && !self.core.has_pending();
            if !handed_over && !self.front_ready() {
                return Err(err);
            }
            return Ok(crate::stream::Driven { readable: true, writable: true, handed_over });
        }
        Ok(crate::stream::Driven {
            readable: self.readable_now(),
            writable: self.writable_now(),
            handed_over: kept_clear && !self.core.has_pending(),
        })
    }

    /// Whether everything written is in the transport's hands, from what this side knows
    /// without a look (no completions reaped, nothing posted): when this says so, `drive`'s
    /// `handed_over` would too. `false` on a failed connection (`drive` then tells).
    pub(crate) fn handed_over_now(&self) -> bool {
        self.failed.is_none() && self.send_state.kept.is_empty() && !self.core.has_pending()
    }

    /// Posts corked records and pushes kept bytes without waiting: whether everything
    /// written is now in the transport's hands (see `Stream::hand_over`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn hand_over(&mut self) -> io::Result<bool> {
        self.core.uncork();
        Ok(self.drive()?.handed_over)
    }

    /// Corking on or off (see `Stream::set_nodelay`).
    pub(crate) fn set_cork(&mut self, cork: bool) {
        self.core.set_cork_depth(if cork { 2 } else { 0 });
        self.pump();
    }

    /// Holding writes on or off (see `Stream::set_hold`); turned off, what was held is posted.
    pub(crate) fn set_hold(&mut self, hold: bool) {
        self.core.set_hold(hold);
        self.pump();
    }

    /// Half close: the peer reads end of stream after everything written so far. With bytes
    /// kept, the close record is queued behind them (later calls send both).
    pub(crate) fn shutdown_write(&mut self) -> io::Result<()> {
        self.send_state.write_shut = true;
        self.core.uncork();
        match self.push_kept() {
            Ok(true) => self.core.shutdown(),
            Ok(false) => self.send_state.shutdown_after_kept = true,
            // Nothing kept can go any more (the peer closed, or the connection failed).
            Err(_) => self.drop_kept(),
        }
        self.pump();
        if self.closed_after_peer_bye() {
            // The peer had closed fully: what became of its queue pair since (gone with its
            // process, say) concerns no one (see `flush`), as a socket's shutdown after its
            // peer's close succeeds.
            return Ok(());
        }
        self.check_usable()
    }

    /// Stops reading: later reads return end of stream.
    pub(crate) fn shutdown_read(&mut self) {
        self.read_shut = true;
    }

    /// Clean close: kept bytes, then the close record; waits (at most the linger time) for
    /// everything to be acknowledged (see the module docs for a peer that keeps writing), then
    /// says goodbye on the TCP connection with the totals sent.
    pub(crate) fn close(&mut self) {
        if self.failed.is_some() || self.peer_vanished() {
            return;
        }
        if self.core.rendezvous_outstanding() {
            // A nonblocking zero-copy write was left unfinished: the peer may still read its
            // buffer, which the application may reuse or free once the stream is gone. Give the
            // connection up (fencing the queue pair) rather than wait for a reader, possibly
            // on the background thread.
            self.give_up(
                io::ErrorKind::BrokenPipe,
                "closed while the peer had not fetched a zero-copy write (the connection is given up)",
            );
            return;
        }
        self.core.uncork();
        let deadline = Deadline::At(Some(Instant::now() + self.linger));
        loop {
            match self.push_kept() {
                Ok(true) => break,
                Ok(false) => {
                    if self.wait(deadline).is_err() {
                        return;
                    }
                }
                Err(_) if self.failed.is_some() || self.peer_vanished() => return,
                Err(_) => {
                    // The peer has closed: it reads nothing more.
                    self.drop_kept();
                    break;
                }
            }
        }
        self.core.shutdown();
        while self.failed.is_none() && !self.tcp_eof {
            if self.core.has_pending() {
                // Our own records still need room and credits: answer the peer as usual.
                self.pump();
                if self.core.has_pending() {
                    if self.wait(deadline).is_err() {
                        break;
                    }
                    continue;
                }
            }
            self.collect_completions();
            if self.core.is_flushed() {
                break;
            }
            if self.wait_collecting(deadline).is_err() {
                break;
            }
        }
        if self.failed.is_some() || !self.core.is_flushed() {
            return;
        }
        let bye = Message::Bye { bytes: self.core.bytes_committed(), records: self.core.records_sent() };
        let _ = self.tcp.set_nonblocking(false);
        let _ = self.tcp.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = self.tcp.write_all(&bye.to_bytes());
        let _ = self.tcp.shutdown(std::net::Shutdown::Write);
    }

    /// Handles the completions that arrived, posting nothing (closing: see the module docs).
    pub(super) fn collect_completions(&mut self) {
        while let Ok(n) = self.cq.poll(&mut self.wcs) {
            self.handle_taken(n);
            if n < self.wcs.len() {
                break;
            }
        }
    }

    /// Sleeps until a completion arrives (at most a liveness slice), handles it and posts
    /// nothing; looks at the TCP connection when none came. `TimedOut` past the deadline.
    fn wait_collecting(&mut self, deadline: Deadline) -> io::Result<()> {
        let n = self.sleep(deadline, WakeFor::Anything)?;
        if n == 0 {
            self.check_tcp();
        }
        Ok(())
    }

    /// Copies `bytes` to ring offset `offset`, wrapping at the ring's end: into the staging
    /// mirror, or (providers that reach the peer's memory, see `setup`) straight into the
    /// peer's ring. Either way the record's WRITE WITH IMMEDIATE, posted later, announces them.
    pub(super) fn stage(&self, offset: u32, bytes: &[u8]) -> io::Result<()> {
        let ring = self.peer.ring_len as usize;
        let offset = offset as usize;
        let first = bytes.len().min(ring - offset);
        self.copy_to_ring(offset, &bytes[..first])?;
        if first < bytes.len() {
            self.copy_to_ring(0, &bytes[first..])?;
        }
        Ok(())
    }

    /// The outcome of a `stage`: a failed copy into the peer's ring (a peer that went away,
    /// or one that announced a ring it does not let this side write) breaks the connection,
    /// since a record may already be partly committed.
    pub(super) fn staged(&mut self, staged: io::Result<()>) -> io::Result<()> {
        if let Err(err) = &staged {
            self.fail(err.kind(), err.to_string().trim_start_matches("lightpath: ").to_string());
        }
        staged
    }

    fn copy_to_ring(&self, offset: usize, bytes: &[u8]) -> io::Result<()> {
        if let Some(staging) = &self.staging {
            return staging.write(offset, bytes).map_err(from_verbs);
        }
        match self.qp.write_direct(self.peer.ring_addr + offset as u64, self.peer.ring_rkey, bytes) {
            Some(Ok(())) => Ok(()),
            Some(Err(err)) => Err(reset(format!("writing into the peer's ring failed: {err}"))),
            None => Err(reset("the provider stopped writing into the peer's ring directly")),
        }
    }

    /// Whether new bytes or records may be written: the connection works, this side has not
    /// shut down writing, and the peer is still there to read them.
    pub(super) fn check_writable(&mut self) -> io::Result<()> {
        self.check_not_shut_down()?;
        self.check_peer_writable()
    }

    /// `BrokenPipe` once this side has shut down writing (even while the close record waits
    /// behind kept bytes); a broken connection's own error first.
    pub(super) fn check_not_shut_down(&mut self) -> io::Result<()> {
        if self.core.is_shut_down() || self.send_state.shutdown_after_kept {
            self.check_usable()?;
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "lightpath: the stream was shut down for writing",
            ));
        }
        Ok(())
    }

    /// Whether anything may still be sent: the connection works and the peer reads.
    fn check_peer_writable(&mut self) -> io::Result<()> {
        self.check_usable()?;
        if self.peer_vanished() {
            return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
        }
        if self.peer_bye.is_some() || self.tcp_eof {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "lightpath: the peer closed the connection",
            ));
        }
        Ok(())
    }
}
