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
    /// A call that has started READs into the buffer waits for them even past the read
    /// timeout or in nonblocking mode (they write into `local`); a peer that dies ends it with
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
    /// it is posted from the buffer into the peer's receive ring. The peer receives it with
    /// [`Stream::recv_msg`] or [`Stream::recv_msg_buf`].
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
    /// with [`Stream::recv_msg`] or a larger buffer.
    pub fn recv_msg_buf(&mut self, local: &RegisteredBuf, offset: usize) -> io::Result<Option<usize>> {
        let deadline = self.read_deadline();
        match &mut self.backend {
            Backend::Rdma(conn) => conn.recv_msg_buf(local, offset, deadline),
            Backend::Tcp(_) => Err(rdma_only()),
            Backend::Closed => Err(closed()),
        }
    }
}
