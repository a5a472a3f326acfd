//! Batched datagram I/O: `sendmmsg` and `recvmmsg`, with UDP segmentation offload (a
//! `UDP_SEGMENT` control message: one message carries several equal-size datagrams that the
//! kernel splits) on send and receive offload (`UDP_GRO`: the kernel hands over coalesced
//! datagrams with their segment size) on receive.
//!
//! The kernel structures ([`libc::mmsghdr`], iovecs, addresses, control buffers) live in
//! long-lived batches whose pointers are set once, at construction, to the batch's own heap
//! arrays: an empty poll of the socket then costs the system call and nothing else. The calls
//! go through `syscall(2)` directly, which skips the C library's thread-cancellation
//! bookkeeping around `sendmmsg`/`recvmmsg` (nothing here is ever cancelled).

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::sockaddr::{from_storage, to_storage};

/// Most messages (datagrams, or coalesced groups of them) one `recvmmsg` returns.
pub(crate) const RECV_BATCH: usize = 32;
/// Most messages one `sendmmsg` carries.
pub(crate) const SEND_MESSAGES: usize = 64;
/// Most datagrams one `sendmmsg` carries, over all its messages.
pub(crate) const SEND_DATAGRAMS: usize = 64;
/// Most datagrams one segmented message may carry (the kernel's `UDP_MAX_SEGMENTS` is 64 on
/// older kernels, 128 on newer ones).
pub(crate) const MAX_SEGMENTS: usize = 64;
/// Most payload bytes of one segmented message ([`lightpath_verbs::MAX_SEGMENTED_UDP_BYTES`]).
pub(crate) const MAX_SEGMENTED_BYTES: usize = lightpath_verbs::MAX_SEGMENTED_UDP_BYTES as usize;

/// `UDP_SEGMENT` (since Linux 4.18) and `UDP_GRO` (since 5.0): `SOL_UDP` options not defined
/// by the `libc` crate for glibc targets. Kernel ABI values from `include/uapi/linux/udp.h`.
pub(crate) const UDP_SEGMENT: libc::c_int = 103;
pub(crate) const UDP_GRO: libc::c_int = 104;

/// A control buffer with the alignment `cmsghdr` needs.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct Control([u8; CONTROL_LEN]);

/// Room for a few control messages (only `UDP_GRO` is enabled; a stray one is ignored).
const CONTROL_LEN: usize = 64;
/// Bytes of a `cmsghdr` before its data (`CMSG_LEN(0)` on 64-bit Linux).
const CMSG_HEADER: usize = size_of::<libc::cmsghdr>();

fn zeroed<T>() -> T {
    // SAFETY: only instantiated (below) with C structures made of integers and raw pointers
    // (mmsghdr, iovec, sockaddr_storage), for which all-zero bytes are a valid value: null
    // pointers, zero lengths, AF_UNSPEC.
    unsafe { MaybeUninit::<T>::zeroed().assume_init() }
}

fn syscall_result(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// One received message: a datagram, or several the kernel coalesced (`segment_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Datagram<'a> {
    /// Sender, if the kernel reported an IPv4 or IPv6 address.
    pub(crate) from: Option<SocketAddr>,
    /// The bytes received (all segments, back to back).
    pub(crate) data: &'a [u8],
    /// The message was longer than the buffer and was cut.
    pub(crate) truncated: bool,
    /// With receive offload: the size of every segment but the last (which may be shorter).
    pub(crate) segment_size: Option<usize>,
}

/// Buffers and kernel structures for one `recvmmsg` of up to [`RECV_BATCH`] messages.
pub(crate) struct RecvBatch {
    headers: Box<[libc::mmsghdr]>,
    iovecs: Box<[libc::iovec]>,
    names: Box<[libc::sockaddr_storage]>,
    controls: Box<[Control]>,
    buffers: Box<[u8]>,
    buffer_len: usize,
    /// Messages the last call returned (their headers were changed by the kernel).
    received: usize,
}

// SAFETY: the raw pointers inside the headers and iovecs point only into the heap arrays this
// struct owns (set in `new`, never shared); moving the struct to another thread moves the
// ownership of those arrays with it, exactly like the `Box`es themselves.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    /// A batch whose every message buffer holds `buffer_len` bytes.
    pub(crate) fn new(buffer_len: usize) -> Self {
        let mut batch = Self {
            headers: (0..RECV_BATCH).map(|_| zeroed()).collect(),
            iovecs: (0..RECV_BATCH).map(|_| zeroed()).collect(),
            names: (0..RECV_BATCH).map(|_| zeroed()).collect(),
            controls: vec![Control([0; CONTROL_LEN]); RECV_BATCH].into_boxed_slice(),
            buffers: vec![0u8; RECV_BATCH * buffer_len].into_boxed_slice(),
            buffer_len,
            received: RECV_BATCH,
        };
        let buffers = batch.buffers.as_mut_ptr();
        for i in 0..RECV_BATCH {
            // In bounds: `buffers` holds RECV_BATCH * buffer_len bytes.
            let base = buffers.wrapping_add(i * buffer_len);
            batch.iovecs[i] = libc::iovec { iov_base: base.cast(), iov_len: buffer_len };
            let header = &mut batch.headers[i].msg_hdr;
            header.msg_iov = &mut batch.iovecs[i];
            header.msg_iovlen = 1;
            header.msg_name = (&mut batch.names[i] as *mut libc::sockaddr_storage).cast();
            header.msg_control = batch.controls[i].0.as_mut_ptr().cast();
        }
        batch
    }

    /// Receives what is waiting (up to `limit` messages, at most [`RECV_BATCH`]) without
    /// blocking. Returns how many arrived (0 when none was waiting); read them with
    /// [`RecvBatch::get`].
    pub(crate) fn recv(&mut self, fd: BorrowedFd<'_>, limit: usize) -> io::Result<usize> {
        let limit = limit.clamp(1, RECV_BATCH);
        // Only the headers the previous call returned were changed by the kernel.
        for entry in &mut self.headers[..self.received] {
            entry.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            entry.msg_hdr.msg_controllen = CONTROL_LEN;
            entry.msg_hdr.msg_flags = 0;
            entry.msg_len = 0;
        }
        self.received = 0;
        loop {
            // SAFETY: every header points (since `new`) to its own name slot, control buffer
            // and iovec, and each iovec to `buffer_len` writable bytes of `buffers`; all of them
            // are owned by `self`, which is exclusively borrowed for the call, and their lengths
            // are the ones reset above. The count is at most the length of `headers`; the
            // timeout may be null.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_recvmmsg,
                    fd.as_raw_fd(),
                    self.headers.as_mut_ptr(),
                    limit as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut::<libc::timespec>(),
                )
            };
            match syscall_result(ret) {
                Ok(count) => {
                    self.received = count.min(limit);
                    return Ok(self.received);
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(err) => return Err(err),
            }
        }
    }

    /// Bytes each message buffer holds.
    pub(crate) fn buffer_len(&self) -> usize {
        self.buffer_len
    }

    /// The `i`th message of the last [`RecvBatch::recv`].
    pub(crate) fn get(&self, i: usize) -> Option<Datagram<'_>> {
        if i >= self.received {
            return None;
        }
        let entry = &self.headers[i];
        let header = &entry.msg_hdr;
        let len = (entry.msg_len as usize).min(self.buffer_len);
        let start = i * self.buffer_len;
        let control_len = header.msg_controllen.min(CONTROL_LEN);
        Some(Datagram {
            from: from_storage(&self.names[i], header.msg_namelen),
            data: &self.buffers[start..start + len],
            truncated: header.msg_flags & libc::MSG_TRUNC != 0,
            segment_size: gro_segment_size(&self.controls[i].0[..control_len]),
        })
    }
}

/// The segment size of a `UDP_GRO` control message in `control`, if there is one.
fn gro_segment_size(control: &[u8]) -> Option<usize> {
    let mut offset = 0;
    while offset + CMSG_HEADER <= control.len() {
        let field = |at: usize, len: usize| &control[offset + at..offset + at + len];
        let cmsg_len = usize::from_ne_bytes(field(0, size_of::<usize>()).try_into().ok()?);
        let level = i32::from_ne_bytes(field(8, 4).try_into().ok()?);
        let kind = i32::from_ne_bytes(field(12, 4).try_into().ok()?);
        if cmsg_len < CMSG_HEADER || offset + cmsg_len > control.len() {
            return None;
        }
        if level == libc::SOL_UDP && kind == UDP_GRO && cmsg_len >= CMSG_HEADER + 4 {
            let size = i32::from_ne_bytes(field(CMSG_HEADER, 4).try_into().ok()?);
            return usize::try_from(size).ok().filter(|&size| size > 0);
        }
        offset += cmsg_len.next_multiple_of(size_of::<usize>());
    }
    None
}

/// One message of a send batch: `count` datagrams, all to `dst`, taken in order from the
/// batch's datagram list starting at position `first`. With `segment_size`, they go as one
/// segmented message: every datagram but the last must be exactly `segment_size` bytes and
/// the last no longer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OutMessage {
    pub(crate) dst: SocketAddr,
    pub(crate) first: usize,
    pub(crate) count: usize,
    pub(crate) segment_size: Option<u16>,
}

/// Most iovecs one datagram takes: its buffered bytes, bytes left in place, zeros.
const IOVECS_PER_DATAGRAM: usize = 3;
/// The zero bytes a datagram may end with (pad and an ICRC field nobody checks).
static ZEROS: [u8; 8] = [0; 8];

/// One datagram of a send batch: bytes in a buffer, then maybe bytes the caller leaves where
/// they are (registered memory: one copy fewer), then up to 8 zero bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DatagramParts<'a> {
    head: &'a [u8],
    in_place: Option<(usize, usize)>,
    zeros: usize,
}

impl<'a> DatagramParts<'a> {
    /// A datagram that is all in `bytes`.
    pub(crate) fn buffered(bytes: &'a [u8]) -> Self {
        Self { head: bytes, in_place: None, zeros: 0 }
    }

    /// `head`, then `len` bytes at address `addr`, then `zeros` (at most 8) zero bytes.
    ///
    /// # Safety
    /// `addr..addr + len` must be readable memory that stays allocated until the
    /// [`SendBatch::send`] given this datagram returns (the kernel reads it during the call;
    /// concurrent writes to it only change what is sent).
    pub(crate) unsafe fn with_in_place(head: &'a [u8], addr: usize, len: usize, zeros: usize) -> Self {
        Self { head, in_place: Some((addr, len)), zeros: zeros.min(ZEROS.len()) }
    }
}

/// `UDP_SEGMENT` control message: a `cmsghdr` followed by the 16-bit segment size, padded.
const SEGMENT_CONTROL_LEN: usize = CMSG_HEADER + 8;

/// Kernel structures for one `sendmmsg` of up to [`SEND_MESSAGES`] messages.
pub(crate) struct SendBatch {
    headers: Box<[libc::mmsghdr]>,
    iovecs: Box<[libc::iovec]>,
    names: Box<[libc::sockaddr_storage]>,
    controls: Box<[Control]>,
}

// SAFETY: as for `RecvBatch`: the pointers the headers hold between calls point only into
// this struct's own heap arrays (and are rewritten before every call).
unsafe impl Send for SendBatch {}

impl SendBatch {
    pub(crate) fn new() -> Self {
        Self {
            headers: (0..SEND_MESSAGES).map(|_| zeroed()).collect(),
            iovecs: (0..SEND_DATAGRAMS * IOVECS_PER_DATAGRAM).map(|_| zeroed()).collect(),
            names: (0..SEND_MESSAGES).map(|_| zeroed()).collect(),
            controls: vec![Control([0; CONTROL_LEN]); SEND_MESSAGES].into_boxed_slice(),
        }
    }

    /// Sends `messages`, whose datagrams are `datagram(order[position])` for the positions
    /// each message names, blocking while the socket buffer is full. Returns how many
    /// messages the kernel took: fewer than asked only if one failed, and then the error is
    /// about the message after the last one sent (the next call starting there returns it).
    /// Messages beyond the batch limits, or naming datagrams that do not exist, are not sent.
    pub(crate) fn send<'a>(
        &mut self,
        fd: BorrowedFd<'_>,
        datagram: impl Fn(usize) -> Option<DatagramParts<'a>>,
        order: &[usize],
        messages: &[OutMessage],
    ) -> io::Result<usize> {
        let mut iov_used = 0;
        let mut datagrams = 0;
        let mut count = 0;
        for (i, message) in messages.iter().take(SEND_MESSAGES).enumerate() {
            let Some(positions) =
                message.first.checked_add(message.count).and_then(|end| order.get(message.first..end))
            else {
                break;
            };
            if message.count == 0 || datagrams + message.count > SEND_DATAGRAMS {
                break;
            }
            let iov_start = iov_used;
            let mut complete = true;
            for &index in positions {
                let Some(parts) = datagram(index) else {
                    complete = false;
                    break;
                };
                // The kernel only reads through these pointers for a send, despite `*mut`.
                let mut push = |base: *const u8, len: usize| {
                    if len > 0 {
                        self.iovecs[iov_used] =
                            libc::iovec { iov_base: base as *mut libc::c_void, iov_len: len };
                        iov_used += 1;
                    }
                };
                push(parts.head.as_ptr(), parts.head.len());
                if let Some((addr, len)) = parts.in_place {
                    push(addr as *const u8, len);
                }
                push(ZEROS.as_ptr(), parts.zeros);
            }
            if !complete {
                break;
            }
            datagrams += message.count;
            let name_len = to_storage(&message.dst, &mut self.names[i]);
            let header = &mut self.headers[i].msg_hdr;
            header.msg_name = (&mut self.names[i] as *mut libc::sockaddr_storage).cast();
            header.msg_namelen = name_len;
            header.msg_iov = &mut self.iovecs[iov_start];
            header.msg_iovlen = iov_used - iov_start;
            header.msg_flags = 0;
            match message.segment_size {
                Some(size) if message.count > 1 => {
                    write_segment_control(&mut self.controls[i], size);
                    header.msg_control = self.controls[i].0.as_mut_ptr().cast();
                    header.msg_controllen = SEGMENT_CONTROL_LEN;
                }
                _ => {
                    header.msg_control = std::ptr::null_mut();
                    header.msg_controllen = 0;
                }
            }
            count += 1;
        }
        if count == 0 {
            return Ok(0);
        }
        loop {
            // SAFETY: `headers[..count]` were all written above: each points to a name slot
            // and control buffer of `self` (or no control), and to a run of `self.iovecs`
            // within bounds (at most IOVECS_PER_DATAGRAM per datagram, SEND_DATAGRAMS
            // datagrams), each iovec pointing into a datagram borrowed from the caller for the
            // whole call, into `ZEROS`, or into memory `DatagramParts::with_in_place`'s caller
            // keeps allocated until this call returns. `self` is exclusively borrowed, so nothing changes them meanwhile.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_sendmmsg,
                    fd.as_raw_fd(),
                    self.headers.as_mut_ptr(),
                    count as libc::c_uint,
                    0 as libc::c_int,
                )
            };
            match syscall_result(ret) {
                Ok(sent) => return Ok(sent.min(count)),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(err),
            }
        }
    }
}

/// Writes a `UDP_SEGMENT` control message for `size`-byte segments into `control`.
fn write_segment_control(control: &mut Control, size: u16) {
    let bytes = &mut control.0;
    bytes[..SEGMENT_CONTROL_LEN].fill(0);
    // cmsg_len counts the header and the data, without the trailing padding (CMSG_LEN(2)).
    bytes[0..8].copy_from_slice(&(CMSG_HEADER + 2).to_ne_bytes());
    bytes[8..12].copy_from_slice(&libc::SOL_UDP.to_ne_bytes());
    bytes[12..16].copy_from_slice(&UDP_SEGMENT.to_ne_bytes());
    bytes[CMSG_HEADER..CMSG_HEADER + 2].copy_from_slice(&size.to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use std::net::UdpSocket;
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use super::*;

    /// Receives into `batch` until `want` messages arrived (the datagrams are already queued
    /// on loopback; this only guards against a slow scheduler), returning their copies.
    fn receive(batch: &mut RecvBatch, socket: &UdpSocket, want: usize) -> Vec<(Datagram<'static>, Vec<u8>)> {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < want && Instant::now() < deadline {
            let n = batch.recv(socket.as_fd(), RECV_BATCH).expect("recv");
            for i in 0..n {
                let d = batch.get(i).expect("received");
                let owned = Datagram { data: &[], ..d };
                got.push((owned, d.data.to_vec()));
            }
            if n == 0 {
                std::thread::yield_now();
            }
        }
        got
    }

    /// Datagrams whose middle stays in the caller's memory arrive whole (head, the bytes in
    /// place, zeros), also cut from one segmented message.
    #[test]
    fn bytes_left_in_place_are_sent_between_head_and_zeros() {
        let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let dst = rx.local_addr().expect("addr");
        let heads: Vec<[u8; 4]> = (0..3u8).map(|i| [0xA0 + i; 4]).collect();
        let memory: Vec<u8> = (0..24u8).collect();
        let parts = |i: usize| {
            let head = heads.get(i)?;
            // SAFETY: `memory` outlives every send below and i * 8 + 8 <= 24.
            Some(unsafe { DatagramParts::with_in_place(head, memory.as_ptr() as usize + i * 8, 8, 4) })
        };
        let messages = [OutMessage { dst, first: 0, count: 3, segment_size: Some(16) }];
        let mut send = SendBatch::new();
        assert_eq!(send.send(tx.as_fd(), parts, &[0, 1, 2], &messages).expect("send"), 1);
        let mut batch = RecvBatch::new(64);
        let got = receive(&mut batch, &rx, 3);
        let bytes: Vec<u8> = got.iter().flat_map(|(_, data)| data.clone()).collect();
        let mut expected = Vec::new();
        for i in 0..3u8 {
            expected.extend_from_slice(&[0xA0 + i; 4]);
            expected.extend(i * 8..i * 8 + 8);
            expected.extend_from_slice(&[0; 4]);
        }
        assert_eq!(bytes, expected);
    }

    #[test]
    fn batch_round_trip_over_loopback() {
        let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let dst = rx.local_addr().expect("addr");
        let payloads: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 10 + usize::from(i)]).collect();
        let datagrams: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        // Sent in reverse order, one message each.
        let order = [4, 3, 2, 1, 0];
        let messages: Vec<OutMessage> =
            (0..5).map(|first| OutMessage { dst, first, count: 1, segment_size: None }).collect();
        let mut send = SendBatch::new();
        assert_eq!(
            send.send(
                tx.as_fd(),
                |i| datagrams.get(i).copied().map(DatagramParts::buffered),
                &order,
                &messages
            )
            .expect("send"),
            5
        );

        let mut batch = RecvBatch::new(12);
        let got = receive(&mut batch, &rx, 5);
        assert_eq!(got.len(), 5);
        assert_eq!(got[0].0.from, Some(tx.local_addr().expect("addr")));
        assert_eq!(got[0].1, payloads[4][..12], "cut to the buffer");
        assert!(got[0].0.truncated, "14 bytes into a 12-byte buffer");
        assert_eq!((got[3].1.as_slice(), got[3].0.truncated), (&payloads[1][..], false));
        assert_eq!(got[3].0.segment_size, None, "no receive offload asked for");
        assert_eq!(batch.recv(rx.as_fd(), RECV_BATCH).expect("recv"), 0, "nothing more waiting");
        assert!(batch.get(0).is_none());
    }

    /// Splits received messages back into datagrams by their segment size.
    fn datagrams_of(messages: &[(Datagram<'static>, Vec<u8>)]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for (meta, bytes) in messages {
            match meta.segment_size {
                Some(size) => out.extend(bytes.chunks(size).map(<[u8]>::to_vec)),
                None => out.push(bytes.clone()),
            }
        }
        out
    }

    #[test]
    fn segmented_message_arrives_as_its_datagrams() {
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let with_gro = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let without_gro = UdpSocket::bind("127.0.0.1:0").expect("bind");
        crate::sys::set_udp_gro(with_gro.as_fd()).expect("UDP_GRO (Linux 5.0+)");
        let payloads: Vec<Vec<u8>> =
            [(1u8, 100), (2, 100), (3, 50), (4, 7)].map(|(b, n)| vec![b; n]).to_vec();
        let datagrams: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        let mut send = SendBatch::new();
        for rx in [&with_gro, &without_gro] {
            let dst = rx.local_addr().expect("addr");
            let messages = [
                OutMessage { dst, first: 0, count: 3, segment_size: Some(100) },
                OutMessage { dst, first: 3, count: 1, segment_size: Some(7) },
            ];
            assert_eq!(
                send.send(
                    tx.as_fd(),
                    |i| datagrams.get(i).copied().map(DatagramParts::buffered),
                    &[0, 1, 2, 3],
                    &messages
                )
                .expect("send"),
                2
            );
        }
        let mut batch = RecvBatch::new(64 << 10);
        let coalesced = receive(&mut batch, &with_gro, 2);
        assert_eq!(coalesced.len(), 2, "loopback hands the segmented message over whole");
        assert_eq!((coalesced[0].0.segment_size, coalesced[0].1.len()), (Some(100), 250));
        assert_eq!(datagrams_of(&coalesced), payloads);
        let split = receive(&mut batch, &without_gro, 4);
        assert!(split.iter().all(|(meta, _)| meta.segment_size.is_none()));
        assert_eq!(datagrams_of(&split), payloads, "the kernel cuts it for a socket without UDP_GRO");
    }

    #[test]
    fn bad_positions_are_not_sent() {
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let dst = tx.local_addr().expect("addr");
        let data: [&[u8]; 1] = [b"x"];
        let mut send = SendBatch::new();
        let past_order = OutMessage { dst, first: 1, count: 1, segment_size: None };
        assert_eq!(
            send.send(tx.as_fd(), |i| data.get(i).copied().map(DatagramParts::buffered), &[0], &[past_order])
                .expect("nothing sent"),
            0
        );
        let no_datagram = OutMessage { dst, first: 0, count: 1, segment_size: None };
        assert_eq!(
            send.send(
                tx.as_fd(),
                |i| data.get(i).copied().map(DatagramParts::buffered),
                &[3],
                &[no_datagram]
            )
            .expect("nothing sent"),
            0
        );
        let overflow = OutMessage { dst, first: usize::MAX, count: 2, segment_size: None };
        assert_eq!(
            send.send(tx.as_fd(), |i| data.get(i).copied().map(DatagramParts::buffered), &[0], &[overflow])
                .expect("nothing sent"),
            0
        );
    }

    #[test]
    fn control_messages_are_parsed_defensively() {
        let mut control = Control([0; CONTROL_LEN]);
        write_segment_control(&mut control, 4112);
        assert_eq!(gro_segment_size(&control.0), None, "a UDP_SEGMENT message is not UDP_GRO");
        control.0[12..16].copy_from_slice(&UDP_GRO.to_ne_bytes());
        control.0[0..8].copy_from_slice(&(CMSG_HEADER + 4).to_ne_bytes());
        control.0[CMSG_HEADER..CMSG_HEADER + 4].copy_from_slice(&4112i32.to_ne_bytes());
        assert_eq!(gro_segment_size(&control.0), Some(4112));
        assert_eq!(gro_segment_size(&control.0[..CMSG_HEADER + 2]), None, "cut short");
        control.0[0..8].copy_from_slice(&1000usize.to_ne_bytes());
        assert_eq!(gro_segment_size(&control.0), None, "length beyond the buffer");
        assert_eq!(gro_segment_size(&[]), None);
    }
}
