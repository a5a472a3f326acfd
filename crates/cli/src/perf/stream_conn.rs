//! The connections `lightpath perf stream_*` measures over: a Lightpath stream (`--provider
//! soft|shm|ibverbs`, or `fallback`: Lightpath's own framed TCP fallback, forced), or a plain
//! kernel TCP socket (`--provider tcp`) — `std::net::TcpStream` and `tokio::net::TcpStream`
//! with `TCP_NODELAY`, exactly what a program without Lightpath does, so the ratios in
//! `scripts/compare.sh` are against kernel TCP and not against Lightpath's TCP path.
//!
//! The tests need, besides bytes, a few messages outside the measured iterations (the plan,
//! the server's answer, CPU probes). Lightpath streams have messages; over plain TCP a message
//! is a 4-byte big-endian length and the bytes ([`MAX_CONTROL_MESSAGE`] at most: a stranger's
//! garbage cannot make the server allocate much).

use std::future::Future;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::Plan;

/// `--provider tcp`: plain kernel TCP sockets, the baseline.
pub const KERNEL_TCP: &str = "tcp";
/// `--provider fallback`: Lightpath streams forced onto their TCP fallback.
pub const FALLBACK: &str = "fallback";

/// The largest control message a plain-TCP peer may send.
pub const MAX_CONTROL_MESSAGE: usize = 1 << 20;

/// Whether `provider` (the `--provider` value) means plain kernel TCP.
pub fn is_kernel_tcp(provider: &str) -> bool {
    provider == KERNEL_TCP
}

/// A blocking connection the tests run over.
pub trait Conn: Read + Write + Send + Sized {
    /// Sends one control message.
    fn send_msg(&mut self, msg: &[u8]) -> io::Result<()>;
    /// Receives one control message; `None` when the peer closed between messages.
    fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>>;
    /// As `TcpStream::set_read_timeout`.
    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()>;
    /// What carries the bytes, for the report.
    fn transport_name(&self) -> String;
    /// Serves a `--zero-copy` plan (registered buffers: Lightpath streams only).
    fn serve_zero_copy(self, plan: &Plan) -> Result<()>;
}

impl Conn for lightpath::Stream {
    fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        lightpath::Stream::send_msg(self, msg)
    }
    fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        lightpath::Stream::recv_msg(self)
    }
    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        lightpath::Stream::set_read_timeout(self, timeout)
    }
    fn transport_name(&self) -> String {
        self.transport().to_string()
    }
    fn serve_zero_copy(self, plan: &Plan) -> Result<()> {
        super::zero_copy::serve(self, plan)
    }
}

/// A plain kernel TCP connection with length-prefixed control messages.
#[derive(Debug)]
pub struct KernelTcp(pub TcpStream);

impl KernelTcp {
    /// Wraps a connected socket, with `TCP_NODELAY` as latency-minded programs set it.
    pub fn new(tcp: TcpStream) -> io::Result<Self> {
        tcp.set_nodelay(true)?;
        Ok(Self(tcp))
    }
}

/// The length prefix of a control message, checked.
fn message_len(prefix: [u8; 4]) -> io::Result<usize> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_CONTROL_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a control message of {len} bytes (at most {MAX_CONTROL_MESSAGE}): not a lightpath perf peer"
            ),
        ));
    }
    Ok(len)
}

fn framed(msg: &[u8]) -> io::Result<Vec<u8>> {
    let len = u32::try_from(msg.len())
        .ok()
        .filter(|&len| len as usize <= MAX_CONTROL_MESSAGE)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "control message too long"))?;
    let mut out = Vec::with_capacity(4 + msg.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
    Ok(out)
}

fn closed_inside_message() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed inside a control message")
}

impl Read for KernelTcp {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for KernelTcp {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl Conn for KernelTcp {
    fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        self.0.write_all(&framed(msg)?)
    }
    fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        let mut prefix = [0u8; 4];
        let mut have = 0;
        while have < 4 {
            match self.0.read(&mut prefix[have..])? {
                0 if have == 0 => return Ok(None),
                0 => return Err(closed_inside_message()),
                n => have += n,
            }
        }
        let mut msg = vec![0u8; message_len(prefix)?];
        self.0.read_exact(&mut msg)?;
        Ok(Some(msg))
    }
    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.0.set_read_timeout(timeout)
    }
    fn transport_name(&self) -> String {
        "kernel tcp".into()
    }
    fn serve_zero_copy(self, _plan: &Plan) -> Result<()> {
        bail!("--zero-copy needs Lightpath streams (registered buffers), not plain TCP")
    }
}

/// An async connection the request/response test and the event-loop server run over.
pub trait AsyncConn: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Sends one control message.
    fn send_msg<'a>(&'a mut self, msg: &'a [u8]) -> impl Future<Output = io::Result<()>> + Send + 'a;
    /// Receives one control message; `None` when the peer closed between messages.
    fn recv_msg(&mut self) -> impl Future<Output = io::Result<Option<Vec<u8>>>> + Send + '_;
    /// Closes cleanly (the write side first, as the tests end).
    fn close(self) -> impl Future<Output = io::Result<()>> + Send;
    /// What carries the bytes, for the report.
    fn transport_name(&self) -> String;
}

impl AsyncConn for lightpath::tokio::Stream {
    fn send_msg<'a>(&'a mut self, msg: &'a [u8]) -> impl Future<Output = io::Result<()>> + Send + 'a {
        lightpath::tokio::Stream::send_msg(self, msg)
    }
    fn recv_msg(&mut self) -> impl Future<Output = io::Result<Option<Vec<u8>>>> + Send + '_ {
        lightpath::tokio::Stream::recv_msg(self)
    }
    fn close(self) -> impl Future<Output = io::Result<()>> + Send {
        lightpath::tokio::Stream::close(self)
    }
    fn transport_name(&self) -> String {
        self.transport().to_string()
    }
}

impl AsyncConn for tokio::net::TcpStream {
    async fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        self.write_all(&framed(msg)?).await
    }
    async fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        let mut prefix = [0u8; 4];
        let mut have = 0;
        while have < 4 {
            match self.read(&mut prefix[have..]).await? {
                0 if have == 0 => return Ok(None),
                0 => return Err(closed_inside_message()),
                n => have += n,
            }
        }
        let mut msg = vec![0u8; message_len(prefix)?];
        self.read_exact(&mut msg).await?;
        Ok(Some(msg))
    }
    async fn close(mut self) -> io::Result<()> {
        self.shutdown().await
    }
    fn transport_name(&self) -> String {
        "kernel tcp".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_tcp_control_messages_round_trip_and_reject_garbage() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            let mut conn = KernelTcp::new(tcp).unwrap();
            let got = conn.recv_msg().unwrap();
            conn.send_msg(b"answer").unwrap();
            // A length no lightpath perf peer sends.
            conn.0.write_all(&u32::MAX.to_be_bytes()).unwrap();
            got
        });
        let mut conn = KernelTcp::new(TcpStream::connect(addr).unwrap()).unwrap();
        conn.send_msg(b"{\"plan\":1}").unwrap();
        assert_eq!(conn.recv_msg().unwrap().as_deref(), Some(&b"answer"[..]));
        let err = conn.recv_msg().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(peer.join().unwrap().as_deref(), Some(&b"{\"plan\":1}"[..]));
        // The peer is gone: a clean end between messages.
        assert_eq!(conn.recv_msg().unwrap(), None);
    }
}
