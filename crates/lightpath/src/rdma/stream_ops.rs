//! The stream operations of an RDMA connection: reading and writing bytes, messages, flush,
//! half close and the clean close.

use super::*;

/// Sending-side state a connection keeps between calls.
#[derive(Debug, Default)]
pub(super) struct SendState {}

impl<D: Device> RdmaConn<D> {
    /// Reads stream bytes.
    pub(crate) fn read(&mut self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // `wait` returns right after a pump that made progress; pumping again at once would
        // cost a system call per message for nothing.
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            let mut done = 0;
            while done < buf.len() {
                let Some(front) = self.core.front() else { break };
                if front.kind == RecordKind::Rendezvous {
                    if done == 0 {
                        done = self.read_rendezvous(buf)?;
                    }
                    break;
                }
                if front.kind != RecordKind::Data {
                    if done > 0 {
                        break;
                    }
                    return Err(invalid("the peer sent a message here; use recv_msg"));
                }
                let n = (front.contiguous as usize).min(buf.len() - done);
                let at = SLOT_AREA + front.offset as usize;
                self.recv_mr.read(at, &mut buf[done..done + n]).map_err(from_verbs)?;
                self.core.consume(n as u32);
                done += n;
            }
            if done > 0 {
                self.post_ops();
                return Ok(done);
            }
            if self.at_eof() {
                return Ok(0);
            }
            self.check_usable()?;
            if self.peer_vanished() {
                return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
            }
            self.wait(deadline)?;
            just_pumped = true;
        }
    }

    /// Writes stream bytes: returns once at least one byte is committed (as many as fit).
    pub(crate) fn write(&mut self, buf: &[u8], deadline: Deadline) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            self.check_writable()?;
            self.read_slot();
            let mut done = 0;
            while done < buf.len() {
                let Some((grant, offset)) = self.core.send_room(RecordKind::Data, buf.len() - done) else {
                    break;
                };
                self.stage(offset, &buf[done..done + grant as usize])?;
                self.core.commit(RecordKind::Data, grant);
                done += grant as usize;
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

    /// Sends one message (blocking until all of it is committed).
    pub(crate) fn send_msg(&mut self, msg: &[u8], deadline: Deadline) -> io::Result<()> {
        let mut done = 0;
        loop {
            self.check_writable()?;
            self.read_slot();
            let left = msg.len() - done;
            match self.core.send_room(RecordKind::MsgPart, left) {
                Some((grant, offset)) => {
                    self.stage(offset, &msg[done..done + grant as usize])?;
                    let kind = if grant as usize == left { RecordKind::MsgEnd } else { RecordKind::MsgPart };
                    self.core.commit(kind, grant);
                    done += grant as usize;
                    self.post_ops();
                    if kind == RecordKind::MsgEnd {
                        return Ok(());
                    }
                }
                None => {
                    if deadline == Deadline::Now && done == 0 {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    self.core.note_blocked();
                    self.post_ops();
                    // A message once started is finished even in nonblocking mode.
                    let deadline = if done > 0 { Deadline::At(None) } else { deadline };
                    self.wait(deadline)?;
                }
            }
        }
    }

    /// Receives one message; `None` at end of stream.
    pub(crate) fn recv_msg(&mut self, deadline: Deadline) -> io::Result<Option<Vec<u8>>> {
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
            if self.at_eof() {
                if !self.message.is_empty() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "lightpath: stream ended inside a message",
                    ));
                }
                return Ok(None);
            }
            self.check_usable()?;
            if self.peer_vanished() {
                return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
            }
            self.wait(deadline)?;
            just_pumped = true;
        }
    }

    /// Waits until everything written has been acknowledged by the peer.
    pub(crate) fn flush(&mut self, deadline: Deadline) -> io::Result<()> {
        self.core.uncork();
        loop {
            self.pump();
            self.check_usable()?;
            if self.core.is_flushed() {
                return Ok(());
            }
            if self.peer_vanished() {
                return Err(reset("the peer vanished before acknowledging"));
            }
            self.wait(deadline)?;
        }
    }

    /// Corking on or off (see `Stream::set_nodelay`).
    pub(crate) fn set_cork(&mut self, cork: bool) {
        self.core.set_cork_depth(if cork { 2 } else { 0 });
        self.pump();
    }

    /// Half close: the peer reads end of stream after everything written so far.
    pub(crate) fn shutdown_write(&mut self) -> io::Result<()> {
        self.core.uncork();
        self.core.shutdown();
        self.pump();
        self.check_usable()
    }

    /// Stops reading: later reads return end of stream.
    pub(crate) fn shutdown_read(&mut self) {
        self.read_shut = true;
    }

    /// Clean close: send the close record, wait (at most the linger time) for everything to
    /// be acknowledged, then say goodbye on the TCP connection with the totals sent.
    pub(crate) fn close(&mut self) {
        if self.failed.is_some() || self.peer_vanished() {
            return;
        }
        self.core.uncork();
        self.core.shutdown();
        let deadline = Deadline::At(Some(Instant::now() + self.linger));
        while self.failed.is_none() && !self.core.is_flushed() {
            self.pump();
            if self.core.is_flushed() || self.tcp_eof {
                break;
            }
            if self.wait(deadline).is_err() {
                break;
            }
        }
        if !self.core.is_flushed() {
            return;
        }
        let bye = Message::Bye { bytes: self.core.bytes_committed(), records: self.core.records_sent() };
        let _ = self.tcp.set_nonblocking(false);
        let _ = self.tcp.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = self.tcp.write_all(&bye.to_bytes());
        let _ = self.tcp.shutdown(std::net::Shutdown::Write);
    }

    /// Copies `bytes` into the staging ring at `offset`, wrapping at its end.
    pub(super) fn stage(&self, offset: u32, bytes: &[u8]) -> io::Result<()> {
        let ring = self.peer.ring_len as usize;
        let offset = offset as usize;
        let first = bytes.len().min(ring - offset);
        self.staging.write(offset, &bytes[..first]).map_err(from_verbs)?;
        if first < bytes.len() {
            self.staging.write(0, &bytes[first..]).map_err(from_verbs)?;
        }
        Ok(())
    }

    pub(super) fn check_writable(&mut self) -> io::Result<()> {
        self.check_usable()?;
        if self.core.is_shut_down() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "lightpath: the stream was shut down for writing",
            ));
        }
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
