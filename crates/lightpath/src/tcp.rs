//! Data over the TCP connection itself: framed records between two Lightpath peers (the
//! fallback), or raw bytes with a peer that does not speak Lightpath.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;

use lightpath_stream::frame::{FrameHeader, FrameNeed, FrameReader, HEADER_LEN, MAX_FRAME_LEN};
use lightpath_stream::RecordKind;

use crate::error::{invalid, reset};

/// How long closing may block on a message the socket has not taken yet.
const CLOSE_WRITE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Appends to `out` the first `limit` bytes of `bufs` (empty slices left out).
fn push_limited<'a>(out: &mut Vec<IoSlice<'a>>, bufs: &'a [IoSlice<'_>], mut limit: usize) {
    for buf in bufs {
        if limit == 0 {
            break;
        }
        let take = buf.len().min(limit);
        if take > 0 {
            out.push(IoSlice::new(&buf[..take]));
            limit -= take;
        }
    }
}

/// A TCP transport.
#[derive(Debug)]
pub(crate) struct TcpConn {
    tcp: TcpStream,
    /// Records (both peers speak Lightpath) or raw bytes.
    framed: bool,
    /// Bytes read before the transport was chosen (a plain client's first bytes).
    prefix: Vec<u8>,
    reader: FrameReader,
    /// Header bytes of the current outgoing record not yet written.
    header_out: Vec<u8>,
    /// A whole message record (header and payload) accepted by `send_msg` whose tail the
    /// socket has not taken yet (nonblocking mode): it goes out before anything else.
    message_out: Vec<u8>,
    message_sent: usize,
    /// A half close whose close record waits behind owed bytes (in `header_out`): the FIN
    /// follows once they are out.
    fin_after_owed: bool,
    /// Payload bytes the current outgoing data record still expects.
    payload_left: u32,
    read_shut: bool,
    write_closed: bool,
    message: Vec<u8>,
    /// How long a blocking read busy-polls the socket before it sleeps in the kernel
    /// (`Options::spin`, as RDMA streams spin on their completion queues).
    spin: std::time::Duration,
    nonblocking: bool,
}

impl TcpConn {
    pub(crate) fn new(tcp: TcpStream, framed: bool, prefix: Vec<u8>) -> Self {
        Self {
            tcp,
            framed,
            prefix,
            reader: FrameReader::default(),
            header_out: Vec::new(),
            message_out: Vec::new(),
            message_sent: 0,
            fin_after_owed: false,
            payload_left: 0,
            read_shut: false,
            write_closed: false,
            message: Vec::new(),
            spin: std::time::Duration::ZERO,
            nonblocking: false,
        }
    }

    /// Busy-polls blocking reads for `spin` before sleeping.
    pub(crate) fn with_spin(mut self, spin: std::time::Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Records the stream's mode (the socket's own flag is set by the caller).
    pub(crate) fn set_nonblocking_mode(&mut self, nonblocking: bool) {
        self.nonblocking = nonblocking;
    }

    /// Before a blocking read: poll the socket for up to `spin` so that a reply arriving within
    /// it costs no sleep and wake-up (tens of µs on a busy machine).
    fn spin_for_data(&self) {
        if self.spin.is_zero() || self.nonblocking || self.tcp.set_nonblocking(true).is_err() {
            return;
        }
        let until = std::time::Instant::now() + self.spin;
        let mut probe = [0u8; 1];
        loop {
            match self.tcp.peek(&mut probe) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock && std::time::Instant::now() < until => {
                    std::hint::spin_loop()
                }
                _ => break,
            }
        }
        let _ = self.tcp.set_nonblocking(false);
    }

    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Whether a read has an answer without the socket: a buffered prefix, reading shut down,
    /// or the peer's close record already taken in.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn input_without_socket(&self) -> bool {
        !self.prefix.is_empty() || self.read_shut || self.reader.need() == FrameNeed::Closed
    }

    /// How many bytes the next read can return at most, so an event loop offers (and zeroes)
    /// no more of its buffer than that: the buffered prefix, or the rest of the current data
    /// record, whose header is read first if it is not yet (the read would begin with it
    /// anyway; `WouldBlock` if it has not arrived). Raw streams and other records: `fallback`.
    #[cfg(feature = "tokio")]
    pub(crate) fn read_size_hint(&mut self, fallback: usize) -> io::Result<usize> {
        if !self.prefix.is_empty() {
            return Ok(self.prefix.len());
        }
        if !self.framed || self.read_shut {
            return Ok(fallback);
        }
        loop {
            match self.reader.need() {
                FrameNeed::Header => {
                    let n = self.tcp.read(self.reader.header_space())?;
                    if n == 0 {
                        return Err(Self::vanished());
                    }
                    self.reader.header_filled(n).map_err(invalid)?;
                }
                FrameNeed::Payload(RecordKind::Data, left) => return Ok((left as usize).max(1)),
                FrameNeed::Payload(..) | FrameNeed::Closed => return Ok(fallback),
            }
        }
    }

    /// Whether a read would not block (buffered prefix, or the socket has bytes or EOF).
    pub(crate) fn readable_now(&self, nonblocking: bool) -> io::Result<bool> {
        if !self.prefix.is_empty() || self.read_shut {
            return Ok(true);
        }
        self.tcp.set_nonblocking(true)?;
        let mut probe = [0u8; 1];
        let ready = match self.tcp.peek(&mut probe) {
            Ok(_) => true,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => false,
            Err(_) => true,
        };
        self.tcp.set_nonblocking(nonblocking)?;
        Ok(ready)
    }

    fn vanished() -> io::Error {
        reset("the peer vanished (its TCP connection ended without a clean close)")
    }

    /// Sends what is owed of an accepted message (and a deferred half close) without waiting
    /// longer than the socket does: `Ok(true)` once nothing is owed, `Ok(false)` while a
    /// nonblocking socket is full.
    pub(crate) fn push_kept(&mut self) -> io::Result<bool> {
        match self.flush_header() {
            Ok(()) => Ok(true),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Before a read in nonblocking mode: pushes an owed message along (its errors are the
    /// sending side's, reported by the next send).
    fn push_kept_quietly(&mut self) {
        if self.nonblocking && (!self.message_out.is_empty() || self.fin_after_owed) {
            let _ = self.push_kept();
        }
    }

    fn write_closed_error() -> io::Error {
        io::Error::new(io::ErrorKind::BrokenPipe, "lightpath: the stream was shut down for writing")
    }

    pub(crate) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.read_shut {
            return Ok(0);
        }
        self.push_kept_quietly();
        if !self.prefix.is_empty() {
            let n = buf.len().min(self.prefix.len());
            buf[..n].copy_from_slice(&self.prefix[..n]);
            self.prefix.drain(..n);
            return Ok(n);
        }
        self.spin_for_data();
        if !self.framed {
            return self.tcp.read(buf);
        }
        loop {
            match self.reader.need() {
                FrameNeed::Closed => return Ok(0),
                FrameNeed::Header => {
                    let n = self.tcp.read(self.reader.header_space())?;
                    if n == 0 {
                        return Err(Self::vanished());
                    }
                    self.reader.header_filled(n).map_err(invalid)?;
                }
                FrameNeed::Payload(RecordKind::Data, left) => {
                    let want = buf.len().min(left as usize);
                    let n = self.tcp.read(&mut buf[..want])?;
                    if n == 0 {
                        return Err(Self::vanished());
                    }
                    self.reader.payload_consumed(n as u32);
                    return Ok(n);
                }
                FrameNeed::Payload(..) => return Err(invalid("the peer sent a message here; use recv_msg")),
            }
        }
    }

    /// Sends what is owed of an accepted message and of a started record's header (or a
    /// deferred close record, then the FIN).
    fn flush_header(&mut self) -> io::Result<()> {
        while self.message_sent < self.message_out.len() {
            let n = self.tcp.write(&self.message_out[self.message_sent..])?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            self.message_sent += n;
        }
        if !self.message_out.is_empty() {
            self.message_out = Vec::new();
            self.message_sent = 0;
        }
        while !self.header_out.is_empty() {
            let n = self.tcp.write(&self.header_out)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            self.header_out.drain(..n);
        }
        if std::mem::take(&mut self.fin_after_owed) {
            match self.tcp.shutdown(std::net::Shutdown::Write) {
                // The peer had closed cleanly and its kernel answered our close record with a
                // reset (its socket was gone): the close is complete, as a plain TCP peer's
                // FIN-for-FIN would be. (hyper servers reported every such connection.)
                Err(err)
                    if err.kind() == io::ErrorKind::NotConnected
                        && self.reader.need() == FrameNeed::Closed => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Writes the slices in turn, as far as the socket takes them: framed, as one record (its
    /// header and every slice in one `writev`).
    pub(crate) fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|buf| buf.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        if self.write_closed {
            return Err(Self::write_closed_error());
        }
        if !self.framed {
            return self.tcp.write_vectored(bufs);
        }
        self.flush_header()?;
        if self.payload_left == 0 {
            let len = total.min(MAX_FRAME_LEN as usize) as u32;
            let header = FrameHeader { kind: RecordKind::Data, len }.encode();
            // Header and payload in one system call when the socket takes them. The record
            // exists only once some of its header went out (an error here sent nothing).
            let mut slices = Vec::with_capacity(bufs.len() + 1);
            slices.push(IoSlice::new(&header));
            push_limited(&mut slices, bufs, len as usize);
            let n = self.tcp.write_vectored(&slices)?;
            if n > 0 {
                self.payload_left = len;
            }
            if n < HEADER_LEN {
                self.header_out.extend_from_slice(&header[n..]);
                return if n == 0 {
                    Err(io::ErrorKind::WriteZero.into())
                } else {
                    self.write_rest_or_block(bufs)
                };
            }
            let payload = n - HEADER_LEN;
            self.payload_left -= payload as u32;
            if payload > 0 {
                return Ok(payload);
            }
            return self.write_rest_or_block(bufs);
        }
        self.write_payload(bufs)
    }

    /// Writes bytes of the data record under way (at most what it still expects).
    fn write_payload(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut slices = Vec::with_capacity(bufs.len());
        push_limited(&mut slices, bufs, self.payload_left as usize);
        let n = self.tcp.write_vectored(&slices)?;
        self.payload_left -= n as u32;
        Ok(n)
    }

    /// After only (part of) a header went out: finish it and write some payload.
    fn write_rest_or_block(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.flush_header()?;
        self.write_payload(bufs)
    }

    /// Blocking: completes a data record still expecting payload by padding is impossible
    /// (the bytes are the application's), so callers finish writes before other records.
    fn ensure_record_boundary(&self) -> io::Result<()> {
        if self.payload_left > 0 || !self.header_out.is_empty() {
            // (An accepted message's tail is not a partial write: it is sent first.)
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "lightpath: a partial write must be completed before sending a message or closing",
            ));
        }
        Ok(())
    }

    pub(crate) fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        if !self.framed {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "lightpath: messages need a Lightpath peer (this one speaks plain TCP)",
            ));
        }
        if self.write_closed {
            return Err(Self::write_closed_error());
        }
        self.ensure_record_boundary()?;
        let len = u32::try_from(msg.len()).ok().filter(|&l| l <= MAX_FRAME_LEN);
        let len =
            len.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "lightpath: message above 1 GiB"))?;
        // An earlier message still going out comes first; until it has, this one is refused
        // (WouldBlock in nonblocking mode), so at most one message is buffered.
        self.flush_header()?;
        let header = FrameHeader { kind: RecordKind::MsgEnd, len }.encode();
        let mut out = Vec::with_capacity(HEADER_LEN + msg.len());
        out.extend_from_slice(&header);
        out.extend_from_slice(msg);
        // From here the message is accepted: what the socket does not take now is sent before
        // anything else, by later calls (or by the close).
        self.message_out = out;
        self.message_sent = 0;
        match self.flush_header() {
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(()),
            other => other,
        }
    }

    pub(crate) fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        if !self.framed {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "lightpath: messages need a Lightpath peer (this one speaks plain TCP)",
            ));
        }
        self.push_kept_quietly();
        self.spin_for_data();
        loop {
            match self.reader.need() {
                FrameNeed::Closed => {
                    if !self.message.is_empty() {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "lightpath: stream ended inside a message",
                        ));
                    }
                    return Ok(None);
                }
                FrameNeed::Header => {
                    let n = self.tcp.read(self.reader.header_space())?;
                    if n == 0 {
                        return Err(Self::vanished());
                    }
                    self.reader.header_filled(n).map_err(invalid)?;
                }
                FrameNeed::Payload(RecordKind::Data, _) => {
                    return Err(invalid("the peer sent stream bytes here; use read"))
                }
                FrameNeed::Payload(kind, 0) => {
                    self.reader.finish_record();
                    if kind == RecordKind::MsgEnd {
                        return Ok(Some(std::mem::take(&mut self.message)));
                    }
                }
                FrameNeed::Payload(_, left) => {
                    let start = self.message.len();
                    let want = (left as usize).min(1 << 20);
                    self.message.resize(start + want, 0);
                    let n = self.tcp.read(&mut self.message[start..]);
                    let n = match n {
                        Ok(n) => n,
                        Err(err) => {
                            self.message.truncate(start);
                            return Err(err);
                        }
                    };
                    self.message.truncate(start + n);
                    if n == 0 {
                        return Err(Self::vanished());
                    }
                    self.reader.payload_consumed(n as u32);
                }
            }
        }
    }

    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.flush_header()?;
        self.tcp.flush()
    }

    /// Half close. With a message still owed (nonblocking mode), the close record and the
    /// FIN are queued behind it and sent by later calls, as over RDMA.
    pub(crate) fn shutdown_write(&mut self) -> io::Result<()> {
        if self.write_closed {
            return Ok(());
        }
        if self.framed {
            self.ensure_record_boundary()?;
            self.header_out.extend_from_slice(&FrameHeader { kind: RecordKind::Close, len: 0 }.encode());
        }
        self.write_closed = true;
        self.fin_after_owed = true;
        match self.flush_header() {
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(()),
            other => other,
        }
    }

    pub(crate) fn shutdown_read(&mut self) {
        self.read_shut = true;
    }

    /// Clean close: a close record (framed), so the peer can tell it from a crash.
    pub(crate) fn close(&mut self) {
        let owed = !self.message_out.is_empty() || !self.header_out.is_empty() || self.fin_after_owed;
        let open = self.framed && !self.write_closed && self.ensure_record_boundary().is_ok();
        if !open && !owed {
            return;
        }
        let _ = self.tcp.set_nonblocking(false);
        // A message still owed to the peer goes first, but a peer that stopped reading
        // cannot hold the closing thread forever.
        let _ = self.tcp.set_write_timeout(Some(CLOSE_WRITE_LIMIT));
        if self.flush_header().is_ok() && open {
            let close = FrameHeader { kind: RecordKind::Close, len: 0 }.encode();
            let _ = self.tcp.write_all(&close);
        }
    }
}
