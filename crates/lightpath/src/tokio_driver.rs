//! The tokio driver (feature `tokio`): the same streams as [`crate::Stream`], driven by
//! readiness instead of blocking. `AsyncRead`/`AsyncWrite` are implemented, so
//! `tokio::io::split`, `copy` and `copy_bidirectional` work.
//!
//! An RDMA stream waits on two file descriptors through `AsyncFd`: its completion queue's
//! notification fd (armed before every wait, as a completion channel is) and its TCP
//! connection (the liveness channel). A TCP stream waits on its socket. Connecting and
//! accepting run the blocking negotiation on tokio's blocking pool; dropping a stream closes
//! it as the blocking one does (it may wait up to `Options::linger` for the last
//! acknowledgements).

use std::future::poll_fn;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::options::Options;
use crate::stream::Backend;
use crate::Transport;

/// A file descriptor owned elsewhere (the completion queue's notification fd), which outlives
/// this registration because the stream holding both drops the registration first.
#[derive(Debug)]
struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// An asynchronous Lightpath stream.
pub struct Stream {
    // Field order is drop order: deregister before the stream closes its fds.
    cq_fd: Option<AsyncFd<Fd>>,
    tcp_fd: AsyncFd<std::net::TcpStream>,
    inner: crate::Stream,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tokio::Stream").field("inner", &self.inner).finish()
    }
}

enum Wait {
    Read,
    Write,
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
        let (cq_fd, tcp) = match inner.backend_mut() {
            Backend::Rdma(conn) => (conn.notify_fd(), conn.tcp().try_clone()?),
            Backend::Tcp(conn) => (None, conn.tcp().try_clone()?),
            Backend::Closed => return Err(io::ErrorKind::NotConnected.into()),
        };
        let cq_fd = match cq_fd {
            // SAFETY: the fd belongs to the stream's completion queue, which lives inside
            // `inner`; `inner` is declared after `cq_fd` in `Stream`, so the registration is
            // dropped (deregistered) before the queue can close the fd, and the queue never
            // replaces its notification fd.
            Some(fd) => Some(unsafe { AsyncFd::register(Fd(fd)) }.map_err(io::Error::from)?),
            None => None,
        };
        // SAFETY: `tcp` is a duplicate owned by the registration itself, so the fd stays open
        // and refers to the same socket for exactly as long as the `AsyncFd` exists.
        let tcp_fd = unsafe { AsyncFd::register(tcp) }.map_err(io::Error::from)?;
        Ok(Stream { cq_fd, tcp_fd, inner })
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

    /// Sends one message.
    pub async fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        poll_fn(|cx| self.poll_io(cx, Wait::Write, |s| s.send_msg(msg))).await
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
            match op(&mut self.inner) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                other => return Poll::Ready(other),
            }
            ready!(self.poll_ready(cx, &wait))?;
        }
    }

    /// Ready when the stream may have made progress (so the caller tries again).
    fn poll_ready(&mut self, cx: &mut Context<'_>, wait: &Wait) -> Poll<io::Result<()>> {
        match self.inner.backend_mut() {
            Backend::Rdma(conn) => {
                if !conn.arm()? {
                    return Poll::Ready(Ok(()));
                }
                let mut woke = false;
                if let Some(cq_fd) = &self.cq_fd {
                    if let Poll::Ready(guard) = cq_fd.poll_read_ready(cx) {
                        let mut guard = guard?;
                        conn.take_notify();
                        guard.clear_ready();
                        woke = true;
                    }
                } else {
                    // No notification fd: fall back to yielding (busy but correct).
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                if let Poll::Ready(guard) = self.tcp_fd.poll_read_ready(cx) {
                    let mut guard = guard?;
                    conn.poll_tcp();
                    guard.clear_ready();
                    woke = true;
                }
                if woke {
                    Poll::Ready(Ok(()))
                } else {
                    Poll::Pending
                }
            }
            Backend::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
            Backend::Tcp(_) => {
                let ready = match wait {
                    Wait::Read => self.tcp_fd.poll_read_ready(cx),
                    Wait::Write => self.tcp_fd.poll_write_ready(cx),
                };
                let mut guard = ready!(ready)?;
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
        }
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
