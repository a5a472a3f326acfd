//! The tokio driver (feature `tokio`): the same streams as [`crate::Stream`], driven by
//! readiness instead of blocking. `AsyncRead`/`AsyncWrite` are implemented, so
//! `tokio::io::split`, `copy` and `copy_bidirectional` work.
//!
//! A stream waits on one file descriptor through `AsyncFd`: a duplicate of the stream's
//! readiness fd ([`crate::Stream::readiness_fd`]) — for an RDMA stream the epoll instance that
//! holds its completion queue's notification fd (armed before every wait, as a completion
//! channel is) and its TCP liveness connection; for a TCP stream the socket. Connecting and
//! accepting run the blocking negotiation on tokio's blocking pool.
//!
//! Messages and zero copy: [`Stream::send_msg`] completes once the whole message is handed to
//! the transport (a large one flows through a full ring in parts, the task sleeping between
//! them). [`Stream::register_buf`], [`Stream::write_buf`], [`Stream::send_msg_buf`],
//! [`Stream::read_buf`] and [`Stream::recv_msg_buf`] are the blocking stream's zero-copy calls
//! with the same semantics; none blocks the runtime (a rendezvous' fetch or READs in flight
//! are waited for by sleeping on the fd). Over TCP they return `Unsupported`, as the blocking
//! ones do.
//!
//! Cancel safety: dropping a `send_msg` (or small `write_buf` / `send_msg_buf`) future before
//! it completes either sent nothing or accepted the message, whose rest is then sent before
//! anything else (it is never cut short). Dropping a zero-copy future whose transfer has
//! started (the peer may be reading the buffer, or READs may be writing into it) closes the
//! connection, fencing its queue pair so that the buffer may be reused at once — as a blocking
//! write timeout does; one dropped before the transfer started changes nothing.
//!
//! Closing: dropping a stream never blocks the runtime. The clean close (everything written
//! is sent and acknowledged, then the goodbye) finishes on Lightpath's background thread, so
//! the bytes still reach a live peer. A program that needs to know they did — or that exits
//! right after — awaits [`Stream::close`] (or `AsyncWriteExt::shutdown`) first.

use std::future::poll_fn;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::OwnedFd;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::options::Options;
use crate::stream::Backend;
use crate::stream_zero_copy::ZeroCopyCall;
use crate::{RegisteredBuf, Transport};

/// An asynchronous Lightpath stream.
pub struct Stream {
    // Field order is drop order: deregister before the stream closes its fds.
    fd: AsyncFd<OwnedFd>,
    inner: crate::Stream,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tokio::Stream").field("inner", &self.inner).finish()
    }
}

#[derive(Clone, Copy)]
enum Wait {
    Read,
    Write,
}

/// Abandons a zero-copy call whose future is dropped before it completed.
struct AbandonOnDrop<'s, 'b> {
    stream: &'s mut Stream,
    call: Option<ZeroCopyCall<'b>>,
}

impl Drop for AbandonOnDrop<'_, '_> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            self.stream.inner.abandon(call);
        }
    }
}

impl Stream {
    /// Connects with default options.
    pub async fn connect(addr: impl ToSocketAddrs) -> io::Result<Stream> {
        Self::connect_with(addr, &Options::default()).await
    }

    /// Connects with the given options (negotiation runs on the blocking pool).
    pub async fn connect_with(addr: impl ToSocketAddrs, options: &Options) -> io::Result<Stream> {
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
        let options = options.clone();
        let stream = ::tokio::task::spawn_blocking(move || crate::Stream::connect_with(&addrs[..], &options))
            .await
            .map_err(io::Error::other)??;
        Self::from_std(stream)
    }

    /// Wraps a blocking stream (it is switched to nonblocking mode).
    pub fn from_std(mut inner: crate::Stream) -> io::Result<Stream> {
        inner.set_nonblocking(true)?;
        // A duplicate, owned by the registration: it stays open exactly as long as tokio
        // watches it, and refers to the same epoll instance (or socket) as the stream's fd.
        let fd = inner.readiness_fd()?.try_clone_to_owned()?;
        let interest = if inner.transport().is_rdma() {
            // An epoll fd never reports writability (see `crate::Stream::readiness_fd`).
            Interest::READABLE
        } else {
            Interest::READABLE | Interest::WRITABLE
        };
        // SAFETY: `fd` is an `OwnedFd` moved into the registration: it is open, nothing else
        // can close or replace it while the `AsyncFd` owns it, and its `as_raw_fd` always
        // returns the same number.
        let fd = unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)?;
        Ok(Stream { fd, inner })
    }

    /// Closes the stream cleanly and waits until the peer has acknowledged everything written
    /// (RDMA) or the socket has taken it (TCP), reporting a failure to do so. Dropping a stream
    /// closes it too, without waiting (the close finishes in the background).
    pub async fn close(mut self) -> io::Result<()> {
        poll_fn(|cx| self.poll_io(cx, Wait::Write, |s| s.shutdown(std::net::Shutdown::Write))).await?;
        poll_fn(|cx| self.poll_io(cx, Wait::Write, |s| s.flush())).await
        // Dropping `self` now only says goodbye: nothing is left to wait for.
    }

    /// Which transport carries the data.
    pub fn transport(&self) -> Transport {
        self.inner.transport()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// The blocking stream inside (in nonblocking mode).
    pub fn get_ref(&self) -> &crate::Stream {
        &self.inner
    }

    /// Sends one message; completes once all of it is handed to the transport (a message
    /// larger than the peer's ring goes in parts as the peer reads). See the module docs for
    /// cancel safety.
    pub async fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        poll_fn(|cx| self.poll_io(cx, Wait::Write, |s| s.send_msg(msg))).await?;
        self.push_kept().await
    }

    /// Waits until bytes kept from an accepted message (see `crate::Stream::set_nonblocking`)
    /// have gone.
    async fn push_kept(&mut self) -> io::Result<()> {
        poll_fn(|cx| {
            self.poll_io(cx, Wait::Write, |s| match s.push_kept()? {
                true => Ok(()),
                false => Err(io::ErrorKind::WouldBlock.into()),
            })
        })
        .await
    }

    /// Registers a zero-filled buffer of `len` bytes with this stream's RDMA device, for the
    /// zero-copy calls and one-sided transfers (`Unsupported` over TCP). See
    /// [`crate::Stream::register_buf`].
    pub fn register_buf(&self, len: usize) -> io::Result<RegisteredBuf> {
        self.inner.register_buf(len)
    }

    /// Writes `len` bytes of the registered buffer `local` (from `offset`) into the stream;
    /// completes when the buffer may be reused. From the rendezvous threshold up the peer
    /// fetches them from the buffer itself. See [`crate::Stream::write_buf`] and, for cancel
    /// safety, the module docs.
    pub async fn write_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<()> {
        let call = ZeroCopyCall::Write { local, offset, len };
        self.zero_copy(call, Wait::Write, |s| s.write_buf(local, offset, len)).await?;
        self.push_kept().await
    }

    /// Sends `local[offset..offset + len]` as one message; completes when the buffer may be
    /// reused. See [`crate::Stream::send_msg_buf`] and, for cancel safety, the module docs.
    pub async fn send_msg_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<()> {
        let call = ZeroCopyCall::SendMsg { local, offset, len };
        self.zero_copy(call, Wait::Write, |s| s.send_msg_buf(local, offset, len)).await?;
        self.push_kept().await
    }

    /// Reads stream bytes into `local[offset..offset + len]`: how many once at least one is
    /// there, 0 at end of stream. A peer's rendezvous is READ straight into the buffer. See
    /// [`crate::Stream::read_buf`] and, for cancel safety, the module docs.
    pub async fn read_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<usize> {
        let call = ZeroCopyCall::Read { local, offset, len };
        self.zero_copy(call, Wait::Read, |s| s.read_buf(local, offset, len)).await
    }

    /// Receives one message into `local` from `offset`: its length, or `None` once the peer
    /// has closed; a message that does not fit is refused (`InvalidInput`) and kept. See
    /// [`crate::Stream::recv_msg_buf`] and, for cancel safety, the module docs.
    pub async fn recv_msg_buf(&mut self, local: &RegisteredBuf, offset: usize) -> io::Result<Option<usize>> {
        let call = ZeroCopyCall::RecvMsg { local, offset };
        self.zero_copy(call, Wait::Read, |s| s.recv_msg_buf(local, offset)).await
    }

    /// Runs the zero-copy `op` to completion; if the future is dropped first, `call` is
    /// abandoned (see the module docs).
    async fn zero_copy<T>(
        &mut self,
        call: ZeroCopyCall<'_>,
        wait: Wait,
        mut op: impl FnMut(&mut crate::Stream) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut guard = AbandonOnDrop { stream: self, call: Some(call) };
        let result = poll_fn(|cx| guard.stream.poll_io(cx, wait, &mut op)).await;
        guard.call = None;
        result
    }

    /// Receives one message; `None` once the peer has closed.
    pub async fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        poll_fn(|cx| self.poll_io(cx, Wait::Read, |s| s.recv_msg())).await
    }

    /// Tries `op` until it does not say `WouldBlock`, waiting for readiness in between.
    fn poll_io<T>(
        &mut self,
        cx: &mut Context<'_>,
        wait: Wait,
        mut op: impl FnMut(&mut crate::Stream) -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        loop {
            let wait = match op(&mut self.inner) {
                // Waiting for an acknowledgement or a fetch is waiting for a completion, as a
                // read is, not for room (the stream may be writable all along).
                Err(err) if crate::stream::AwaitingPeer::is(&err) => Wait::Read,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => wait,
                other => return Poll::Ready(other),
            };
            ready!(self.poll_ready(cx, &wait))?;
        }
    }

    /// Ready when the stream may have made progress (so the caller tries again).
    fn poll_ready(&mut self, cx: &mut Context<'_>, wait: &Wait) -> Poll<io::Result<()>> {
        match self.inner.backend_mut() {
            Backend::Rdma(conn) => {
                if matches!(wait, Wait::Write) {
                    // Credit returns raise no completion here unless the peer knows we wait.
                    conn.note_write_blocked();
                    if conn.writable_now() {
                        // Room came back (by a credit word, which raises no event) since the
                        // call looked: it is used now rather than slept through.
                        return Poll::Ready(Ok(()));
                    }
                }
                if !conn.arm()? {
                    return Poll::Ready(Ok(()));
                }
                let mut guard = ready!(self.fd.poll_read_ready(cx))?;
                // Cleared before draining: an event after this point wakes the task again,
                // one before it is drained below (and the caller retries its operation).
                guard.clear_ready();
                conn.take_notify();
                conn.poll_tcp();
                Poll::Ready(Ok(()))
            }
            Backend::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
            Backend::Tcp(_) => {
                let ready = match wait {
                    Wait::Read => self.fd.poll_read_ready(cx),
                    Wait::Write => self.fd.poll_write_ready(cx),
                };
                let mut guard = ready!(ready)?;
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
        }
    }
}

/// Dropping never blocks the runtime: the clean close is handed to Lightpath's background
/// thread (see the module documentation and [`Stream::close`]).
impl Drop for Stream {
    fn drop(&mut self) {
        self.inner.hand_off_close();
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = ready!(this.poll_io(cx, Wait::Read, |s| s.read(buf.initialize_unfilled())))?;
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().poll_io(cx, Wait::Write, |s| s.write(buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_io(cx, Wait::Write, |s| s.flush())
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_io(cx, Wait::Write, |s| s.shutdown(std::net::Shutdown::Write)))?;
        this.poll_io(cx, Wait::Write, |s| s.flush())
    }
}

/// An asynchronous listener (negotiations run on the blocking listener's threads).
#[derive(Debug, Clone)]
pub struct Listener {
    inner: Arc<crate::Listener>,
}

impl Listener {
    /// Listens with default options.
    pub async fn bind(addr: impl ToSocketAddrs) -> io::Result<Listener> {
        Self::bind_with(addr, Options::default()).await
    }

    /// Listens with the given options.
    pub async fn bind_with(addr: impl ToSocketAddrs, options: Options) -> io::Result<Listener> {
        Ok(Listener { inner: Arc::new(crate::Listener::bind_with(addr, options)?) })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// The next negotiated connection.
    pub async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        let inner = Arc::clone(&self.inner);
        let (stream, peer) =
            ::tokio::task::spawn_blocking(move || inner.accept()).await.map_err(io::Error::other)??;
        Ok((Stream::from_std(stream)?, peer))
    }
}
