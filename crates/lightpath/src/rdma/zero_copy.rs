//! Zero-copy stream and message calls on registered buffers: `read_buf` and `recv_msg_buf`
//! (ring bytes are copied into the buffer once; a rendezvous is READ straight into it) and
//! `send_msg_buf` (a small message is posted from the buffer into the peer's ring, a large one
//! goes by rendezvous). `write_buf` lives with the one-sided operations and hands large writes
//! to [`RdmaConn::write_rendezvous`].
//!
//! In nonblocking mode none of them blocks: a read whose direct READs are in flight returns
//! `WouldBlock` and is finished by repeating it (see `rendezvous`), and a copied send that
//! committed part of its bytes keeps the rest (see `stream_ops`).

use super::*;
use crate::remote::BufRegion;
use rendezvous::ReceiveCall;

fn outside() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "lightpath: range outside the local buffer")
}

fn too_long(total: u64, room: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "lightpath: the message ({total} bytes or more) is larger than the buffer ({room} bytes from the \
             offset); it is kept for recv_msg or a larger buffer"
        ),
    )
}

impl<D: Device> RdmaConn<D> {
    /// Reads stream bytes into `local[offset..offset + len]`: returns how many (0 at end of
    /// stream) once at least one is there.
    pub(crate) fn read_buf(
        &mut self,
        local: &dyn BufRegion,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<usize> {
        if offset.checked_add(len).is_none_or(|end| end > local.len()) {
            return Err(outside());
        }
        let call = ReceiveCall::new(local, offset, Some(len));
        if let Some(n) = self.resume_direct(Some((call, local)), deadline)? {
            return Ok(n);
        }
        if len == 0 {
            return Ok(0);
        }
        if stream_ops::expired(deadline) {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.push_kept_quietly();
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            let mut done = 0;
            while done < len {
                let Some(front) = self.core.front() else { break };
                match front.kind {
                    RecordKind::Data => {
                        let n = (front.contiguous as usize).min(len - done);
                        let at = SLOT_AREA + front.offset as usize;
                        let ring = &self.recv_mr;
                        local
                            .fill_dyn(offset + done, n, &mut |dst| ring.read(at, dst))
                            .map_err(from_verbs)?;
                        self.core.consume(n as u32);
                        done += n;
                    }
                    // A rendezvous starts only in a call that has nothing else to return, so the
                    // bytes before it are not held back by its READs.
                    RecordKind::Rendezvous if done == 0 => {
                        done = self.read_buf_rendezvous(call, local, offset, len, deadline)?;
                        break;
                    }
                    _ if done > 0 => break,
                    _ => return Err(invalid("the peer sent a message here; use recv_msg")),
                }
            }
            if done > 0 {
                self.post_ops();
                return Ok(done);
            }
            if !self.wait_readable(deadline)? {
                return Ok(0);
            }
            just_pumped = true;
        }
    }

    /// `read_buf` of the rendezvous at the head: bytes already in the bounce region first
    /// (an earlier plain read fetched them), then a direct read of the rest that fits. 0 means
    /// bounce READs must land first.
    fn read_buf_rendezvous(
        &mut self,
        call: ReceiveCall,
        local: &dyn BufRegion,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<usize> {
        if self.accept_front()?.message {
            return Err(invalid("the peer sent a message here; use recv_msg_buf"));
        }
        let mut done = 0;
        while done < len {
            let Some((at, n)) = self.core.rendezvous_bounced() else { break };
            let n = (n as usize).min(len - done);
            self.with_bounce(|bounce| {
                local.fill_dyn(offset + done, n, &mut |dst| bounce.read(at as usize, dst)).map_err(from_verbs)
            })?;
            done += n;
            if self.core.rendezvous_take_bounced(n as u32) {
                return Ok(done);
            }
        }
        if done == len || self.core.incoming().is_none_or(|incoming| incoming.bounce_pending()) {
            return Ok(done);
        }
        let want = self.core.rendezvous_begin_direct((len - done) as u64) as usize;
        if want > 0 {
            self.direct_read_for(call, local, offset + done, done + want, deadline)?;
        }
        Ok(done + want)
    }

    /// Receives one message into `local` from `offset`: its length, or `None` at end of
    /// stream. A message that does not fit is refused (`InvalidInput`) and kept.
    pub(crate) fn recv_msg_buf(
        &mut self,
        local: &dyn BufRegion,
        offset: usize,
        deadline: Deadline,
    ) -> io::Result<Option<usize>> {
        if offset > local.len() {
            return Err(outside());
        }
        let call = ReceiveCall::new(local, offset, None);
        if let Some(total) = self.resume_direct(Some((call, local)), deadline)? {
            // The held bytes were copied into the buffer when the direct read began.
            self.message.clear();
            return Ok(Some(total));
        }
        if stream_ops::expired(deadline) {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.push_kept_quietly();
        let room = local.len() - offset;
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            if let Some(front) = self.core.front() {
                let received = match front.kind {
                    RecordKind::Rendezvous => {
                        self.recv_msg_buf_rendezvous(call, local, offset, room, deadline)?
                    }
                    kind if kind.is_message() => self.recv_msg_buf_ring(local, offset, room)?,
                    _ => return Err(invalid("the peer sent stream bytes here; use read_buf")),
                };
                if received.is_some() {
                    return Ok(received);
                }
            }
            if !self.wait_readable(deadline)? {
                return self.end_of_messages().map(|()| None);
            }
            just_pumped = true;
        }
    }

    /// Copies ring message parts into `local` behind the bytes an earlier call kept in
    /// `self.message`. `Some(total)` at the message's end; otherwise what was taken is kept in
    /// `self.message`, so a later call (of either form) continues where this one stopped.
    fn recv_msg_buf_ring(
        &mut self,
        local: &dyn BufRegion,
        offset: usize,
        room: usize,
    ) -> io::Result<Option<usize>> {
        let held = self.message.len();
        let mut got = 0usize;
        let outcome = loop {
            let Some(front) = self.core.front() else { break Ok(None) };
            if !front.kind.is_message() {
                break Err(invalid("the peer sent stream bytes inside a message"));
            }
            let n = front.contiguous as usize;
            if held + got + n > room {
                break Err(too_long((held + got + n) as u64, room));
            }
            let at = SLOT_AREA + front.offset as usize;
            let ring = &self.recv_mr;
            if let Err(err) = local.fill_dyn(offset + held + got, n, &mut |dst| ring.read(at, dst)) {
                break Err(from_verbs(err));
            }
            got += n;
            if self.core.consume(front.contiguous) {
                local.write(offset, &self.message).map_err(from_verbs)?;
                self.message.clear();
                self.post_ops();
                return Ok(Some(held + got));
            }
        };
        if got > 0 {
            self.message.resize(held + got, 0);
            local.read(offset + held, &mut self.message[held..]).map_err(from_verbs)?;
        }
        self.post_ops();
        outcome
    }

    /// `recv_msg_buf` of a rendezvous message: checked against the room first (nothing is
    /// taken if it does not fit), bounced bytes an earlier `recv_msg` started are gathered
    /// first, then the rest is READ straight into `local`.
    fn recv_msg_buf_rendezvous(
        &mut self,
        call: ReceiveCall,
        local: &dyn BufRegion,
        offset: usize,
        room: usize,
        deadline: Deadline,
    ) -> io::Result<Option<usize>> {
        if self.core.incoming().is_none() && !self.message.is_empty() {
            self.fail(io::ErrorKind::InvalidData, "protocol violation: a rendezvous inside a message".into());
            return Err(self.failure().unwrap_or_else(|| invalid("a rendezvous inside a message")));
        }
        if !self.accept_front()?.message {
            return Err(invalid("the peer sent stream bytes here; use read_buf"));
        }
        let total =
            self.message.len() as u64 + self.core.incoming().map_or(0, |incoming| incoming.remaining());
        if total > room as u64 {
            return Err(too_long(total, room));
        }
        if self.core.incoming().is_some_and(|incoming| incoming.bounce_pending()) {
            // An earlier recv_msg began fetching through the bounce region: finish that way.
            return Ok(match self.recv_msg_rendezvous()? {
                Some(message) => {
                    local.write(offset, &message).map_err(from_verbs)?;
                    Some(message.len())
                }
                None => None,
            });
        }
        let held = self.message.len();
        local.write(offset, &self.message).map_err(from_verbs)?;
        let want = self.core.rendezvous_begin_direct(total - held as u64);
        if want > 0 {
            // While READs are in flight the held bytes stay in `self.message` (other receiving
            // calls are refused meanwhile); the repeated call clears them.
            self.direct_read_for(call, local, offset + held, total as usize, deadline)?;
        }
        self.message.clear();
        Ok(Some(total as usize))
    }

    /// Sends `len` bytes of `local` as one message: by rendezvous from `Options::rendezvous_min`
    /// up, else as message records posted straight from the buffer. Returns once the buffer
    /// may be reused.
    pub(crate) fn send_msg_buf(
        &mut self,
        local: &dyn BufRegion,
        offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > local.len()) {
            return Err(outside());
        }
        if len >= self.rendezvous.min {
            return self.write_rendezvous(local, offset, len, true, deadline);
        }
        self.send_copied(local, offset, len, true, deadline)
    }

    /// Sends `len` bytes of `local` (stream bytes, or one message if `message`) through the
    /// peer's ring, copied into staging as `write` and `send_msg` do: below the rendezvous
    /// threshold one copy costs less than holding the buffer until the peer acknowledges it.
    /// Returns once every byte is staged or kept (the buffer may be reused): once some are
    /// committed, what does not fit before the deadline (at once, in nonblocking mode) is
    /// copied into the kept remainder (see `stream_ops`), so stream bytes and messages alike
    /// are accepted whole. Kept bytes of an earlier call go first.
    pub(super) fn send_copied(
        &mut self,
        local: &dyn BufRegion,
        offset: usize,
        len: usize,
        message: bool,
        deadline: Deadline,
    ) -> io::Result<()> {
        if stream_ops::expired(deadline) {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.check_not_shut_down()?;
        self.clear_kept(deadline)?;
        let part = if message { RecordKind::MsgPart } else { RecordKind::Data };
        let mut done = 0;
        loop {
            self.check_writable()?;
            self.read_slot();
            while let Some((grant, at)) = self.core.send_room(part, len - done) {
                let n = grant as usize;
                let mut staged = Ok(());
                local
                    .view_dyn(offset + done, n, &mut |bytes| staged = self.stage(at, bytes))
                    .map_err(from_verbs)?;
                self.staged(staged)?;
                let last = done + n == len;
                self.core.commit(if message && last { RecordKind::MsgEnd } else { part }, grant);
                done += n;
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
                return self.keep_region_or_fail(err, local, offset + done, len - done, message);
            }
        }
    }
}
