//! Unix `SOCK_SEQPACKET` sockets in the abstract namespace: how shm devices find each other and
//! hand each other file descriptors.
//!
//! Abstract names (a leading NUL byte) are never files: they vanish when the last socket using
//! them closes, so a crashed process leaves nothing behind. They are scoped to the network
//! namespace, which is why the host identity includes it. Sequenced packets keep message
//! boundaries, so every control message is one `send` and one `recv`.

use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    accept_with, bind, connect, listen, recvmsg, sendmsg, socket_with, sockopt, AddressFamily,
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

/// Most descriptors one message carries.
pub(crate) const MAX_FDS: usize = 5;

/// A listening socket bound to an abstract name.
#[derive(Debug)]
pub(crate) struct Listener(OwnedFd);

impl Listener {
    /// Binds `name` (without the leading NUL) and listens; non-blocking.
    pub(crate) fn bind_abstract(name: &[u8]) -> io::Result<Self> {
        let fd = socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        bind(&fd, &SocketAddrUnix::new_abstract_name(name)?)?;
        listen(&fd, 128)?;
        Ok(Self(fd))
    }

    /// Accepts one pending connection, or `None` if there is none.
    pub(crate) fn accept(&self) -> io::Result<Option<SeqPacket>> {
        match accept_with(&self.0, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
            Ok(fd) => Ok(Some(SeqPacket(fd))),
            Err(rustix::io::Errno::AGAIN) => Ok(None),
            Err(err) => Err(err.into()),
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// One message taken from a socket.
#[derive(Debug)]
pub(crate) struct Received {
    /// Bytes of the message (0 means the peer closed the connection).
    pub(crate) len: usize,
    /// Descriptors that came with it, already owned (closed on drop).
    pub(crate) fds: Vec<OwnedFd>,
}

/// A connected, non-blocking sequenced-packet socket.
#[derive(Debug)]
pub(crate) struct SeqPacket(OwnedFd);

impl SeqPacket {
    /// Connects to the listener bound to abstract `name`.
    pub(crate) fn connect_abstract(name: &[u8]) -> io::Result<Self> {
        let fd = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        connect(&fd, &SocketAddrUnix::new_abstract_name(name)?)?;
        let flags = rustix::fs::fcntl_getfl(&fd)?;
        rustix::fs::fcntl_setfl(&fd, flags | rustix::fs::OFlags::NONBLOCK)?;
        Ok(Self(fd))
    }

    /// Sends one message with `fds` attached. Never blocks: a peer that does not drain its
    /// socket gets `WouldBlock`, which callers treat as a broken link.
    pub(crate) fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one message"));
        }
        let sent = sendmsg(
            &self.0,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        )?;
        if sent != bytes.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short send on a packet socket"));
        }
        Ok(())
    }

    /// Takes one message if one is waiting (`None` if none). A message longer than `buf` or
    /// with more descriptors than [`MAX_FDS`] is an error (its descriptors are closed).
    pub(crate) fn recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let result = recvmsg(
            &self.0,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        );
        let msg = match result {
            Ok(msg) => msg,
            Err(rustix::io::Errno::AGAIN) => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "oversized control message"));
        }
        Ok(Some(Received { len: msg.bytes, fds }))
    }

    /// The user id of the process at the other end (as it was when it connected).
    pub(crate) fn peer_uid(&self) -> io::Result<u32> {
        Ok(sockopt::socket_peercred(&self.0)?.uid.as_raw())
    }
}

impl AsFd for SeqPacket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique_name(tag: &str) -> Vec<u8> {
        format!("lightpath-shm-test/{tag}/{}/{:x}", std::process::id(), crate::sys::random_u64()).into_bytes()
    }

    #[test]
    fn messages_carry_descriptors_and_keep_boundaries() {
        let name = unique_name("fds");
        let listener = Listener::bind_abstract(&name).expect("bind");
        let client = SeqPacket::connect_abstract(&name).expect("connect");
        let server = listener.accept().expect("accept").expect("pending connection");
        let memfd = crate::sys::Memfd::create("test", 4096).expect("memfd");
        client.send(b"first", &[memfd.as_fd()]).expect("send");
        client.send(b"second message", &[]).expect("send");
        let mut buf = [0u8; 64];
        let first = server.recv(&mut buf).expect("recv").expect("message");
        assert_eq!((&buf[..first.len], first.fds.len()), (&b"first"[..], 1));
        let second = server.recv(&mut buf).expect("recv").expect("message");
        assert_eq!((&buf[..second.len], second.fds.len()), (&b"second message"[..], 0));
        assert!(server.recv(&mut buf).expect("recv").is_none(), "no third message");
        assert_eq!(server.peer_uid().expect("uid"), rustix::process::getuid().as_raw());
        drop(client);
        assert_eq!(server.recv(&mut buf).expect("recv").expect("eof").len, 0, "EOF after close");
    }

    #[test]
    fn oversized_messages_are_errors_and_names_vanish_with_the_listener() {
        let name = unique_name("big");
        let listener = Listener::bind_abstract(&name).expect("bind");
        let client = SeqPacket::connect_abstract(&name).expect("connect");
        let server = listener.accept().expect("accept").expect("pending connection");
        client.send(&[7u8; 100], &[]).expect("send");
        let mut small = [0u8; 10];
        assert!(server.recv(&mut small).is_err());
        drop((server, listener));
        assert!(SeqPacket::connect_abstract(&name).is_err(), "name still bound after close");
    }
}
