//! One-sided operations on registered buffers: RDMA WRITE (with an optional notification) and
//! RDMA READ, each waited for until it completes.

use super::*;
use crate::remote::BufRegion;

impl<D: Device> RdmaConn<D> {
    /// Waits until the signaled request `seq` completes.
    fn wait_for(&mut self, seq: u64, deadline: Deadline) -> io::Result<()> {
        loop {
            self.pump();
            self.check_usable()?;
            if self.core.is_complete(seq) {
                return Ok(());
            }
            if self.peer_vanished() {
                return Err(reset("the peer vanished"));
            }
            let deadline = if deadline == Deadline::Now { Deadline::At(None) } else { deadline };
            self.wait(deadline)?;
        }
    }

    /// Writes `len` bytes of `local` at `local_offset` into the peer's `remote` buffer at
    /// `remote_offset` (one-sided), with a notification if `notify` is set; returns once the
    /// peer has acknowledged the write.
    // The public `Stream::write_remote` has six plain arguments, like a work request; the
    // deadline is the seventh here and the buffer the eighth.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_remote(
        &mut self,
        local: &dyn BufRegion,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        notify: Option<u32>,
        deadline: Deadline,
    ) -> io::Result<()> {
        let remote_addr = remote.range(remote_offset, u64::from(len))?;
        if local_offset.checked_add(len as usize).is_none_or(|end| end > local.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "lightpath: range outside the local buffer",
            ));
        }
        if notify.is_some_and(|value| value > lightpath_stream::record::MAX_RECORD_LEN) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "lightpath: notification values have 27 bits",
            ));
        }
        let (seq, op) = loop {
            self.pump();
            self.check_writable()?;
            match notify {
                Some(value) if self.core.can_notify() => {
                    let (imm, seq) = self.core.notify_seq(value);
                    break (seq, SendOp::WriteWithImm { remote_addr, rkey: remote.rkey, imm });
                }
                None => {
                    if let Some(seq) = self.core.plain_seq() {
                        break (seq, SendOp::Write { remote_addr, rkey: remote.rkey });
                    }
                }
                Some(_) => self.core.note_blocked(),
            }
            self.post_ops();
            self.wait(deadline)?;
        };
        let sge = [local.sge(local_offset, len)];
        self.qp.post_send(&SendWr::new(seq, op, &sge)).map_err(from_verbs)?;
        self.wait_for(seq, deadline)
    }

    /// Reads `len` bytes of the peer's `remote` buffer at `remote_offset` into `local` at
    /// `local_offset` (one-sided RDMA READ); returns once they have arrived.
    pub(crate) fn read_remote(
        &mut self,
        local: &dyn BufRegion,
        local_offset: usize,
        remote: &crate::RemoteBuf,
        remote_offset: u64,
        len: u32,
        deadline: Deadline,
    ) -> io::Result<()> {
        let remote_addr = remote.range(remote_offset, u64::from(len))?;
        if local_offset.checked_add(len as usize).is_none_or(|end| end > local.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "lightpath: range outside the local buffer",
            ));
        }
        let seq = loop {
            self.pump();
            self.check_usable()?;
            if let Some(seq) = self.core.plain_seq() {
                break seq;
            }
            self.wait(deadline)?;
        };
        let sge = [local.sge(local_offset, len)];
        let op = SendOp::Read { remote_addr, rkey: remote.rkey };
        self.qp.post_send(&SendWr::new(seq, op, &sge)).map_err(from_verbs)?;
        self.wait_for(seq, deadline)
    }

    /// The next notification from a peer's one-sided write.
    pub(crate) fn recv_notify(&mut self, deadline: Deadline) -> io::Result<u32> {
        loop {
            self.pump();
            if let Some(value) = self.core.take_notify() {
                return Ok(value);
            }
            self.check_usable()?;
            if self.at_eof() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "lightpath: the peer closed"));
            }
            if self.peer_vanished() {
                return Err(reset("the peer vanished"));
            }
            self.wait(deadline)?;
        }
    }

    /// A buffer registered with this connection's device.
    pub(crate) fn register(&self, len: usize) -> io::Result<MrOf<D>> {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        self._pd.alloc_mr(len, access).map_err(from_verbs)
    }

    /// Writes `len` stream bytes of a registered buffer. From `Options::rendezvous_min` up the
    /// peer fetches them from `local` itself (see `rendezvous`), and this returns once it has;
    /// smaller writes are copied into staging like `write` (a copy of a few hundred KiB costs
    /// less than waiting for the peer before the buffer may be reused). Either way the buffer
    /// may be reused when this returns.
    pub(crate) fn write_buf(
        &mut self,
        local: &dyn BufRegion,
        local_offset: usize,
        len: usize,
        deadline: Deadline,
    ) -> io::Result<()> {
        if local_offset.checked_add(len).is_none_or(|end| end > local.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "lightpath: range outside the local buffer",
            ));
        }
        if len >= self.rendezvous.min {
            return self.write_rendezvous(local, local_offset, len, false, deadline);
        }
        if len == 0 {
            return Ok(());
        }
        self.send_copied(local, local_offset, len, false, deadline)
    }
}
