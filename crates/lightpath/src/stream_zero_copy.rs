//! Zero-copy receiving and zero-copy messages on [`Stream`]: the calls that move stream bytes
//! or messages into and out of [`RegisteredBuf`]s without the application copying them.
//!
//! Together with [`Stream::write_buf`] they make large transfers zero-copy on both sides:
//! a zero-copy write of at least `Options::rendezvous_min` bytes is fetched by the peer with
//! RDMA READ from the writer's buffer — straight into the reader's registered buffer when it
//! reads with [`Stream::read_buf`] or [`Stream::recv_msg_buf`] (into a bounded bounce region
//! it copies from otherwise); smaller ones flow through the peer's receive ring as ordinary
//! records. RDMA streams only: over TCP these calls return `Unsupported`, as registered
//! buffers exist only on RDMA streams.
//!
//! In nonblocking mode (and so under tokio) a call that lent its buffer to the connection
//! returns `WouldBlock` until the transfer is over, and is repeated with the same arguments
//! (see [`Stream::set_nonblocking`]); [`ZeroCopyCall`] lets the tokio driver abandon one.

use std::io;

use crate::stream::{Backend, Stream};
use crate::RegisteredBuf;

fn rdma_only() -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, "lightpath: registered buffers need an RDMA transport")
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "lightpath: the stream is closed")
}

impl Stream {
    /// Reads stream bytes into `local[offset..offset + len]`, like [`std::io::Read::read`]:
    /// returns how many once at least one is there, 0 at end of stream. Bytes of a peer's
    /// rendezvous (a large [`Stream::write_buf`]) are fetched by RDMA READ straight into the
    /// buffer; bytes that came through the receive ring are copied once.
    ///
    /// A blocking call that has started READs into the buffer waits for them even past the read
    /// timeout (they write into `local`); in nonblocking mode it returns `WouldBlock` while
    /// they are in flight, and the same call, repeated, returns the count once they have
    /// landed (see [`Stream::set_nonblocking`]). A peer that dies ends it with
    /// `ConnectionReset`.
    pub fn read_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<usize> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.read_buf(local, offset, len, deadline),
            Backend::Tcp(_) => Err(rdma_only()),
            Backend::Closed => Err(closed()),
        }
    }

    /// Sends `local[offset..offset + len]` as one message; returns once the buffer may be
    /// reused. From `Options::rendezvous_min` bytes up the peer fetches it by RDMA READ; below,
    /// it is copied through the peer's receive ring. The peer receives it with
    /// [`Stream::recv_msg`] or [`Stream::recv_msg_buf`]. Nonblocking mode: see
    /// [`Stream::set_nonblocking`] (a rendezvous returns `WouldBlock` until fetched; a copied
    /// message that has begun to go is accepted whole).
    pub fn send_msg_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<()> {
        let deadline = self.write_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.send_msg_buf(local, offset, len, deadline),
            Backend::Tcp(_) => Err(rdma_only()),
            Backend::Closed => Err(closed()),
        }
    }

    /// Receives one message into `local` from `offset`: `Some(length)`, or `None` once the
    /// peer has closed. A rendezvous message is fetched straight into the buffer. A message
    /// longer than `local.len() - offset` is refused with `InvalidInput` and kept: receive it
    /// with [`Stream::recv_msg`] or a larger buffer. Nonblocking mode: as [`Stream::read_buf`].
    pub fn recv_msg_buf(&mut self, local: &RegisteredBuf, offset: usize) -> io::Result<Option<usize>> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.recv_msg_buf(local, offset, deadline),
            Backend::Tcp(_) => Err(rdma_only()),
            Backend::Closed => Err(closed()),
        }
    }
}

/// A zero-copy call a tokio future made (see `crate::tokio`): what to abandon if the future is
/// dropped before the call completed.
#[cfg(feature = "tokio")]
#[derive(Clone, Copy, Debug)]
pub(crate) enum ZeroCopyCall<'a> {
    /// `read_buf`.
    Read { local: &'a RegisteredBuf, offset: usize, len: usize },
    /// `recv_msg_buf`.
    RecvMsg { local: &'a RegisteredBuf, offset: usize },
    /// `write_buf`.
    Write { local: &'a RegisteredBuf, offset: usize, len: usize },
    /// `send_msg_buf`.
    SendMsg { local: &'a RegisteredBuf, offset: usize, len: usize },
}

#[cfg(feature = "tokio")]
impl Stream {
    /// Abandons `call`, which returned `WouldBlock` and will not be repeated: if it lent its
    /// buffer to the connection (READs in flight into it, or a rendezvous of it the peer has
    /// not fetched), the connection is given up, fencing its queue pair, so that the buffer
    /// may be reused as soon as this returns; otherwise nothing happens. The call is made once
    /// more with a deadline that has already passed, which the driver takes as this request.
    pub(crate) fn abandon(&mut self, call: ZeroCopyCall<'_>) {
        let Backend::Rdma(conn) = &mut self.backend else { return };
        let passed = crate::rdma::Deadline::At(Some(std::time::Instant::now()));
        let _ = match call {
            ZeroCopyCall::Read { local, offset, len } => conn.read_buf(local, offset, len, passed).map(drop),
            ZeroCopyCall::RecvMsg { local, offset } => conn.recv_msg_buf(local, offset, passed).map(drop),
            ZeroCopyCall::Write { local, offset, len } => conn.write_buf(local, offset, len, passed),
            ZeroCopyCall::SendMsg { local, offset, len } => conn.send_msg_buf(local, offset, len, passed),
        };
    }
}
