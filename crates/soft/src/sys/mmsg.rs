//! Batched datagram I/O: `sendmmsg` and `recvmmsg` move up to [`BATCH`] datagrams per system
//! call. The C structures are built on the stack for each call, pointing into the caller's
//! buffers, so nothing self-referential outlives a call.

use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::sockaddr::{from_storage, to_storage};

/// Most datagrams moved by one call.
pub(crate) const BATCH: usize = 32;

/// One received datagram's metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Received {
    /// Bytes stored in the buffer.
    pub(crate) len: usize,
    /// Sender, if the kernel reported an IPv4 or IPv6 address.
    pub(crate) from: Option<SocketAddr>,
    /// The datagram was longer than the buffer and was cut.
    pub(crate) truncated: bool,
}

fn zeroed_storage() -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (AF_UNSPEC) value.
    unsafe { MaybeUninit::<libc::sockaddr_storage>::zeroed().assume_init() }
}

fn empty_header() -> libc::mmsghdr {
    // SAFETY: mmsghdr is plain old data (pointers, lengths, flags); all-zero means "no name,
    // no buffers, no control data", which every field we do not set should be.
    unsafe { MaybeUninit::<libc::mmsghdr>::zeroed().assume_init() }
}

/// Sends `bufs[i][..lens[i]]` to `dsts[i]` for each `i`, blocking while the socket buffer is
/// full. Returns how many were handed to the kernel (fewer than asked only on an error, which
/// is then about the datagram after the last one sent).
pub(crate) fn send_batch(
    fd: BorrowedFd<'_>,
    bufs: &[impl AsRef<[u8]>],
    dsts: &[SocketAddr],
    lens: &[usize],
) -> io::Result<usize> {
    let count = bufs.len().min(dsts.len()).min(lens.len()).min(BATCH);
    if count == 0 {
        return Ok(0);
    }
    let mut names = [zeroed_storage(); BATCH];
    let mut iovecs = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; BATCH];
    let mut headers = [empty_header(); BATCH];
    for i in 0..count {
        let data = bufs[i].as_ref();
        let len = lens[i].min(data.len());
        let name_len = to_storage(&dsts[i], &mut names[i]);
        // The kernel only reads through this pointer for a send, despite the `*mut` type.
        iovecs[i] = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: len };
        headers[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_storage).cast();
        headers[i].msg_hdr.msg_namelen = name_len;
        headers[i].msg_hdr.msg_iov = &mut iovecs[i];
        headers[i].msg_hdr.msg_iovlen = 1;
    }
    loop {
        // SAFETY: `headers[..count]` are initialised; each points to a name and one iovec in
        // arrays that live until the call returns, and each iovec points into a caller buffer
        // of at least `iov_len` bytes that is borrowed for the whole call.
        let ret = unsafe { libc::sendmmsg(fd.as_raw_fd(), headers.as_mut_ptr(), count as libc::c_uint, 0) };
        if ret >= 0 {
            return Ok(ret as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives up to `bufs.len()` datagrams without blocking, filling `out[i]` for `bufs[i]`.
/// Returns how many arrived (0 when none was waiting).
pub(crate) fn recv_batch(
    fd: BorrowedFd<'_>,
    bufs: &mut [impl AsMut<[u8]>],
    out: &mut [Received],
) -> io::Result<usize> {
    let count = bufs.len().min(out.len()).min(BATCH);
    if count == 0 {
        return Ok(0);
    }
    let mut names = [zeroed_storage(); BATCH];
    let mut iovecs = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; BATCH];
    let mut headers = [empty_header(); BATCH];
    for (i, buf) in bufs.iter_mut().take(count).enumerate() {
        let data = buf.as_mut();
        iovecs[i] = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() };
        headers[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_storage).cast();
        headers[i].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        headers[i].msg_hdr.msg_iov = &mut iovecs[i];
        headers[i].msg_hdr.msg_iovlen = 1;
    }
    let received = loop {
        // SAFETY: as for sendmmsg; here the iovecs point into exclusively borrowed caller
        // buffers of `iov_len` writable bytes, and each name slot is a writable
        // sockaddr_storage whose size is given in `msg_namelen`. A null timeout is allowed.
        let ret = unsafe {
            libc::recvmmsg(
                fd.as_raw_fd(),
                headers.as_mut_ptr(),
                count as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if ret >= 0 {
            break ret as usize;
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(err),
        }
    };
    for i in 0..received {
        let header = &headers[i];
        out[i] = Received {
            len: (header.msg_len as usize).min(iovecs[i].iov_len),
            from: from_storage(&names[i]),
            truncated: header.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
        };
    }
    Ok(received)
}

#[cfg(test)]
mod tests {
    use std::net::UdpSocket;
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn batch_round_trip_over_loopback() {
        let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let dst = rx.local_addr().expect("addr");
        let payloads: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 10 + usize::from(i)]).collect();
        let lens: Vec<usize> = payloads.iter().map(Vec::len).collect();
        let sent = send_batch(tx.as_fd(), &payloads, &[dst; 5], &lens).expect("send");
        assert_eq!(sent, 5);

        // One buffer too small to show truncation.
        let mut bufs: Vec<Vec<u8>> =
            vec![vec![0; 64], vec![0; 64], vec![0; 5], vec![0; 64], vec![0; 64], vec![0; 64]];
        let mut out = [Received { len: 0, from: None, truncated: false }; 6];
        let mut got = 0;
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
        // The datagrams are already queued on loopback; read until all five are in.
        for _ in 0..1000 {
            got += recv_batch(rx.as_fd(), &mut bufs[got..], &mut out[got..]).expect("recv");
            if got >= 5 {
                break;
            }
            std::thread::yield_now();
        }
        assert_eq!(got, 5);
        assert_eq!(out[0].from, Some(tx.local_addr().expect("addr")));
        assert_eq!((out[1].len, out[1].truncated), (11, false));
        assert_eq!(&bufs[1][..11], &payloads[1][..]);
        assert_eq!((out[2].len, out[2].truncated), (5, true));
        assert_eq!(recv_batch(rx.as_fd(), &mut bufs, &mut out).expect("recv"), 0, "nothing more waiting");
    }
}
