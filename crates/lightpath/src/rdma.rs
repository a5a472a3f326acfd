//! The blocking driver of an RDMA connection: verbs objects around one
//! [`lightpath_stream::Conn`], generic over the provider's [`Device`].
//!
//! Memory per connection: one region `[credit slot (64 B) | receive ring]` the peer writes
//! into, and one staging region mirroring the peer's ring. Both sizes are fixed at set-up,
//! so a connection's memory is bounded whatever the traffic.
//!
//! Completions of a connection go to its own completion queue, polled by whichever thread
//! is inside a call on the stream; a blocked call spins for `Options::spin`, then sleeps in
//! the queue's `wait` in slices of [`LIVENESS_SLICE`], checking the TCP connection (the
//! liveness channel) between slices so that a peer that died is noticed promptly.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use lightpath_stream::negotiate::{Message, RdmaEndpoint};
use lightpath_stream::{Arrival, Conn, ConnConfig, CreditWord, Op, RecordKind};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, CqOf, Device, Gid, MemoryRegion, MrOf, Mtu, PdOf,
    ProtectionDomain, QpAttr, QpCaps, QpOf, QueuePair, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};

use crate::error::{from_verbs, invalid, reset};
use crate::options::Options;

/// Bytes before the ring in the receive region (the credit slot, padded to a cache line).
const SLOT_AREA: usize = 64;
/// Longest a blocked call sleeps before it looks at the TCP connection.
pub(crate) const LIVENESS_SLICE: Duration = Duration::from_millis(20);
/// Work request id of the set-up probe (outside the core's sequence numbers).
const PROBE_ID: u64 = u64::MAX;
/// Largest record this side sends.
const MAX_RECORD: u32 = 1 << 20;

/// When a blocking call gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deadline {
    /// Do not block at all.
    Now,
    /// Block until this instant (or forever).
    At(Option<Instant>),
}

impl Deadline {
    pub(crate) fn after(timeout: Option<Duration>) -> Self {
        Deadline::At(timeout.and_then(|t| Instant::now().checked_add(t)))
    }
}

/// Verbs objects of one side before the peer's endpoint is known. Field order is drop order.
pub(crate) struct RdmaSetup<D: Device> {
    qp: QpOf<D>,
    recv_mr: MrOf<D>,
    cq: CqOf<D>,
    pd: PdOf<D>,
    device: D,
    psn: u32,
    gid: Gid,
    udp_port: u16,
    mtu: Mtu,
    options: Options,
}

impl<D: Device> RdmaSetup<D> {
    /// Creates the queue pair (in INIT), its completion queue and the receive region.
    pub(crate) fn new(device: D, udp_port: u16, mtu: Mtu, options: &Options) -> io::Result<Self> {
        let ring = options.ring_size.max(4096);
        let pd = device.alloc_pd().map_err(from_verbs)?;
        let cq = device.create_cq(options.send_depth + options.recv_depth + 16).map_err(from_verbs)?;
        let caps = QpCaps {
            max_send_wr: options.send_depth,
            max_recv_wr: options.recv_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        let qp = pd.create_qp(&cq, &cq, caps).map_err(from_verbs)?;
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        qp.modify(&QpAttr::to_init(access)).map_err(from_verbs)?;
        let recv_mr = pd.alloc_mr(SLOT_AREA + ring as usize, access).map_err(from_verbs)?;
        let gid = qp.endpoint().gid;
        let psn = random_psn(qp.qpn());
        let options = Options { ring_size: ring, ..options.clone() };
        Ok(Self { qp, recv_mr, cq, pd, device, psn, gid, udp_port, mtu, options })
    }

    /// What the peer needs to reach this side.
    pub(crate) fn endpoint(&self) -> RdmaEndpoint {
        let mut gid = self.gid.0;
        if self.options.fault_blackhole_rdma {
            // An address on this host where nothing listens: packets to it vanish.
            gid = Gid::from_ip("127.254.254.254".parse().expect("constant address")).0;
        }
        RdmaEndpoint {
            gid,
            udp_port: self.udp_port,
            qpn: self.qp.qpn(),
            psn: self.psn,
            mtu: self.mtu.bytes() as u16,
            ring_addr: self.recv_mr.addr() + SLOT_AREA as u64,
            ring_len: self.options.ring_size,
            ring_rkey: self.recv_mr.rkey(),
            credit_addr: self.recv_mr.addr(),
            credit_rkey: self.recv_mr.rkey(),
            recv_depth: self.options.recv_depth as u16,
        }
    }

    /// Connects the queue pair to `peer`, allocates the staging mirror and posts the initial
    /// receives. The result may receive at once; it sends only after the caller says so.
    pub(crate) fn connect(self, peer: &RdmaEndpoint, tcp: TcpStream) -> io::Result<RdmaConn<D>> {
        if peer.udp_port != 0 && self.udp_port != 0 && peer.udp_port != self.udp_port {
            return Err(io::Error::other(format!(
                "the peer's soft device is on UDP port {}, this side's on {}; both must use the same",
                peer.udp_port, self.udp_port
            )));
        }
        let mtu = Mtu::from_bytes(u32::from(peer.mtu)).unwrap_or(Mtu::Mtu1024).min(self.mtu);
        let av = AddressVector::new(Gid(peer.gid), self.qp.endpoint().gid_index);
        self.qp.modify(&QpAttr::to_rtr(av, mtu, peer.qpn, peer.psn)).map_err(from_verbs)?;
        let mut rts = QpAttr::to_rts(self.psn);
        rts.timeout = Some(15);
        self.qp.modify(&rts).map_err(from_verbs)?;
        let staging =
            self.pd.alloc_mr(peer.ring_len as usize, AccessFlags::LOCAL_WRITE).map_err(from_verbs)?;
        let depth = self.options.recv_depth;
        let recvs: Vec<RecvWr<'_>> = (0..depth).map(|i| RecvWr::new(u64::from(i), &[])).collect();
        self.qp.post_recv_batch(&recvs).map_err(|err| from_verbs(err.error))?;
        let config = ConnConfig {
            local_ring: self.options.ring_size,
            peer_ring: peer.ring_len,
            local_recv_depth: depth,
            peer_recv_depth: u32::from(peer.recv_depth),
            send_depth: self.options.send_depth,
            max_record: MAX_RECORD,
            cork_depth: if self.options.nodelay { 0 } else { 2 },
        };
        config.validate().map_err(invalid)?;
        Ok(RdmaConn {
            core: Conn::new(config),
            qp: self.qp,
            recv_mr: self.recv_mr,
            staging,
            cq: self.cq,
            _pd: self.pd,
            _device: self.device,
            peer: *peer,
            wcs: vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 32],
            failed: None,
            tcp,
            control: Vec::new(),
            peer_bye: None,
            tcp_eof: false,
            read_shut: false,
            spin: self.options.spin,
            linger: self.options.linger,
            message: Vec::new(),
        })
    }
}

fn random_psn(salt: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(salt);
    (hasher.finish() & 0xFF_FFFF) as u32
}

/// A connected RDMA stream. Field order is drop order: the queue pair goes first.
pub(crate) struct RdmaConn<D: Device> {
    core: Conn,
    qp: QpOf<D>,
    recv_mr: MrOf<D>,
    staging: MrOf<D>,
    cq: CqOf<D>,
    _pd: PdOf<D>,
    _device: D,
    peer: RdmaEndpoint,
    wcs: Vec<WorkCompletion>,
    /// Set once the connection is broken; every later call returns it.
    failed: Option<(io::ErrorKind, String)>,
    /// The TCP connection (nonblocking): liveness and the close handshake.
    tcp: TcpStream,
    control: Vec<u8>,
    /// Records the peer sent in total, from its clean-close message.
    peer_bye: Option<u64>,
    tcp_eof: bool,
    read_shut: bool,
    spin: Duration,
    linger: Duration,
    /// A message being received (kept across calls so nonblocking reads lose nothing).
    message: Vec<u8>,
}

impl<D: Device> RdmaConn<D> {
    /// Sends a probe over the queue pair and waits for its acknowledgement: proof that the
    /// RDMA path works both ways.
    pub(crate) fn probe(&mut self, timeout: Duration) -> io::Result<()> {
        let word = CreditWord::new(0, u64::from(self.core.config().local_recv_depth)).to_bytes();
        let op = SendOp::Write { remote_addr: self.peer.credit_addr, rkey: self.peer.credit_rkey };
        self.qp.post_send(&SendWr::inline(PROBE_ID, op, &word)).map_err(from_verbs)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the RDMA probe was not acknowledged"));
            }
            let n = self.cq.wait(&mut self.wcs[..1], left).map_err(from_verbs)?;
            if n == 1 {
                let wc = self.wcs[0];
                if wc.wr_id == PROBE_ID {
                    return if wc.status.is_success() {
                        Ok(())
                    } else {
                        Err(io::Error::other(format!("the RDMA probe failed: {}", wc.status)))
                    };
                }
            }
        }
    }

    /// Negotiation is over: the TCP connection becomes the (nonblocking) liveness channel.
    pub(crate) fn activate(&mut self) -> io::Result<()> {
        self.tcp.set_read_timeout(None)?;
        self.tcp.set_nonblocking(true)
    }

    fn fail(&mut self, kind: io::ErrorKind, what: String) {
        if self.failed.is_none() {
            self.failed = Some((kind, what));
        }
    }

    fn failure(&self) -> Option<io::Error> {
        self.failed.as_ref().map(|(kind, what)| io::Error::new(*kind, format!("lightpath: {what}")))
    }

    /// Polls completions, reads the credit slot and posts what the core wants. Returns
    /// whether anything happened.
    fn pump(&mut self) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let mut progressed = false;
        loop {
            let n = match self.cq.poll(&mut self.wcs) {
                Ok(n) => n,
                Err(err) => {
                    self.fail(io::ErrorKind::Other, format!("polling the completion queue: {err}"));
                    return true;
                }
            };
            for i in 0..n {
                let wc = self.wcs[i];
                self.handle(wc);
            }
            progressed |= n > 0;
            if n < self.wcs.len() {
                break;
            }
        }
        self.post_ops();
        progressed
    }

    fn read_slot(&mut self) -> bool {
        let mut word = [0u8; 8];
        if self.recv_mr.read(0, &mut word).is_err() {
            return false;
        }
        self.core.on_credit_word(CreditWord::from_bytes(word))
    }

    fn handle(&mut self, wc: WorkCompletion) {
        if !wc.status.is_success() {
            if wc.status != WcStatus::WrFlushErr || self.failed.is_none() {
                self.fail(io::ErrorKind::ConnectionReset, format!("RDMA transfer failed ({})", wc.status));
            }
            return;
        }
        match wc.opcode {
            WcOpcode::RecvRdmaWithImm => match self.core.on_recv(wc.imm_data.unwrap_or(0), wc.byte_len) {
                Ok(Arrival::Credit) => {
                    self.read_slot();
                }
                Ok(_) => {}
                Err(err) => self.fail(io::ErrorKind::InvalidData, format!("protocol violation: {err}")),
            },
            WcOpcode::Recv => self.fail(io::ErrorKind::InvalidData, "peer sent a SEND".into()),
            _ => self.core.on_send_complete(wc.wr_id),
        }
    }

    fn post_ops(&mut self) {
        while self.failed.is_none() {
            let Some(op) = self.core.poll_op() else { break };
            if let Err(err) = self.post(op) {
                self.fail(io::ErrorKind::ConnectionReset, format!("posting a work request: {err}"));
            }
        }
    }

    fn post(&self, op: Op) -> lightpath_verbs::Result<()> {
        match op {
            Op::PostRecv { count } => {
                let recvs: Vec<RecvWr<'_>> = (0..count).map(|_| RecvWr::new(0, &[])).collect();
                self.qp.post_recv_batch(&recvs).map_err(|err| err.error)
            }
            Op::Write { seq, pos, len, imm, signaled } => {
                let offset = pos % u64::from(self.peer.ring_len);
                let remote_addr = self.peer.ring_addr + offset;
                let rkey = self.peer.ring_rkey;
                let op = match imm {
                    Some(imm) => SendOp::WriteWithImm { remote_addr, rkey, imm },
                    None => SendOp::Write { remote_addr, rkey },
                };
                let sge = [self.staging.sge(offset as usize, len)];
                let sges: &[Sge] = if len == 0 { &[] } else { &sge };
                let flags = if signaled {
                    lightpath_verbs::SendFlags::SIGNALED
                } else {
                    lightpath_verbs::SendFlags::NONE
                };
                self.qp.post_send(&SendWr::new(seq, op, sges).with_flags(flags))
            }
            Op::Credit { seq, word, imm, signaled } => {
                let (remote_addr, rkey) = (self.peer.credit_addr, self.peer.credit_rkey);
                let op = match imm {
                    Some(imm) => SendOp::WriteWithImm { remote_addr, rkey, imm },
                    None => SendOp::Write { remote_addr, rkey },
                };
                let bytes = word.to_bytes();
                let mut wr = SendWr::inline(seq, op, &bytes);
                if !signaled {
                    wr.flags = lightpath_verbs::SendFlags::INLINE;
                }
                self.qp.post_send(&wr)
            }
        }
    }

    /// Reads what the TCP connection has: the peer's clean close, an error, or EOF.
    fn check_tcp(&mut self) {
        // Never block here, whatever mode another handle of this socket left it in.
        if self.tcp.set_nonblocking(true).is_err() {
            self.tcp_eof = true;
            return;
        }
        let mut buf = [0u8; 512];
        loop {
            match self.tcp.read(&mut buf) {
                Ok(0) => {
                    self.tcp_eof = true;
                    break;
                }
                Ok(n) => self.control.extend_from_slice(&buf[..n]),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.tcp_eof = true;
                    break;
                }
            }
        }
        loop {
            match Message::parse(&self.control) {
                Ok(Some((message, used))) => {
                    self.control.drain(..used);
                    match message {
                        Message::Bye { records, .. } => self.peer_bye = Some(records),
                        Message::Error(text) => {
                            self.fail(io::ErrorKind::ConnectionReset, format!("peer: {text}"))
                        }
                        other => self.fail(
                            io::ErrorKind::InvalidData,
                            format!("unexpected {:?} message on the liveness channel", other.message_type()),
                        ),
                    }
                }
                Ok(None) => break,
                Err(err) => {
                    self.fail(io::ErrorKind::InvalidData, format!("liveness channel: {err}"));
                    break;
                }
            }
        }
        if self.peer_bye.is_some() {
            // Everything the peer sent was acknowledged before its goodbye: collect it.
            self.pump();
        }
    }

    /// Whether the peer is gone for good (its process died or it closed without goodbye).
    fn peer_vanished(&self) -> bool {
        self.tcp_eof && self.peer_bye.is_none()
    }

    /// Whether the peer will send nothing more and everything it sent has been read.
    fn at_eof(&self) -> bool {
        if self.read_shut || self.core.at_eof() {
            return true;
        }
        match self.peer_bye {
            Some(records) => self.core.records_received() >= records && self.core.front().is_none(),
            None => false,
        }
    }

    /// One blocking step: spin, then sleep on the completion queue for at most a slice, and
    /// look at the TCP connection. Errors with `TimedOut` past the deadline.
    fn wait(&mut self, deadline: Deadline) -> io::Result<()> {
        let Deadline::At(deadline) = deadline else {
            self.check_tcp();
            return Err(io::ErrorKind::WouldBlock.into());
        };
        let spin_until = Instant::now() + self.spin;
        while Instant::now() < spin_until {
            if self.pump() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let now = Instant::now();
        let slice = match deadline {
            Some(deadline) if deadline <= now => return Err(io::ErrorKind::TimedOut.into()),
            Some(deadline) => (deadline - now).min(LIVENESS_SLICE),
            None => LIVENESS_SLICE,
        };
        let n = self.cq.wait(&mut self.wcs, slice).map_err(from_verbs)?;
        for i in 0..n {
            let wc = self.wcs[i];
            self.handle(wc);
        }
        self.pump();
        if n == 0 {
            self.check_tcp();
        }
        Ok(())
    }

    fn check_usable(&mut self) -> io::Result<()> {
        if let Some(err) = self.failure() {
            return Err(err);
        }
        Ok(())
    }

    /// Reads stream bytes.
    pub(crate) fn read(&mut self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // `wait` returns right after a pump that made progress; pumping again at once would
        // cost a system call per message for nothing.
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            let mut done = 0;
            while done < buf.len() {
                let Some(front) = self.core.front() else { break };
                if front.kind != RecordKind::Data {
                    if done > 0 {
                        break;
                    }
                    return Err(invalid("the peer sent a message here; use recv_msg"));
                }
                let n = (front.contiguous as usize).min(buf.len() - done);
                let at = SLOT_AREA + front.offset as usize;
                self.recv_mr.read(at, &mut buf[done..done + n]).map_err(from_verbs)?;
                self.core.consume(n as u32);
                done += n;
            }
            if done > 0 {
                self.post_ops();
                return Ok(done);
            }
            if self.at_eof() {
                return Ok(0);
            }
            self.check_usable()?;
            if self.peer_vanished() {
                return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
            }
            self.wait(deadline)?;
            just_pumped = true;
        }
    }

    fn check_writable(&mut self) -> io::Result<()> {
        self.check_usable()?;
        if self.core.is_shut_down() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "lightpath: the stream was shut down for writing",
            ));
        }
        if self.peer_vanished() {
            return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
        }
        if self.peer_bye.is_some() || self.tcp_eof {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "lightpath: the peer closed the connection",
            ));
        }
        Ok(())
    }

    /// Copies `bytes` into the staging ring at `offset`, wrapping at its end.
    fn stage(&self, offset: u32, bytes: &[u8]) -> io::Result<()> {
        let ring = self.peer.ring_len as usize;
        let offset = offset as usize;
        let first = bytes.len().min(ring - offset);
        self.staging.write(offset, &bytes[..first]).map_err(from_verbs)?;
        if first < bytes.len() {
            self.staging.write(0, &bytes[first..]).map_err(from_verbs)?;
        }
        Ok(())
    }

    /// Writes stream bytes: returns once at least one byte is committed (as many as fit).
    pub(crate) fn write(&mut self, buf: &[u8], deadline: Deadline) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            self.check_writable()?;
            self.read_slot();
            let mut done = 0;
            while done < buf.len() {
                let Some((grant, offset)) = self.core.send_room(RecordKind::Data, buf.len() - done) else {
                    break;
                };
                self.stage(offset, &buf[done..done + grant as usize])?;
                self.core.commit(RecordKind::Data, grant);
                done += grant as usize;
            }
            if done > 0 {
                self.post_ops();
                return Ok(done);
            }
            self.core.note_blocked();
            self.post_ops();
            self.wait(deadline)?;
        }
    }

    /// Sends one message (blocking until all of it is committed).
    pub(crate) fn send_msg(&mut self, msg: &[u8], deadline: Deadline) -> io::Result<()> {
        let mut done = 0;
        loop {
            self.check_writable()?;
            self.read_slot();
            let left = msg.len() - done;
            match self.core.send_room(RecordKind::MsgPart, left) {
                Some((grant, offset)) => {
                    self.stage(offset, &msg[done..done + grant as usize])?;
                    let kind = if grant as usize == left { RecordKind::MsgEnd } else { RecordKind::MsgPart };
                    self.core.commit(kind, grant);
                    done += grant as usize;
                    self.post_ops();
                    if kind == RecordKind::MsgEnd {
                        return Ok(());
                    }
                }
                None => {
                    if deadline == Deadline::Now && done == 0 {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    self.core.note_blocked();
                    self.post_ops();
                    // A message once started is finished even in nonblocking mode.
                    let deadline = if done > 0 { Deadline::At(None) } else { deadline };
                    self.wait(deadline)?;
                }
            }
        }
    }

    /// Receives one message; `None` at end of stream.
    pub(crate) fn recv_msg(&mut self, deadline: Deadline) -> io::Result<Option<Vec<u8>>> {
        let mut just_pumped = false;
        loop {
            if !just_pumped {
                self.pump();
            }
            while let Some(front) = self.core.front() {
                if !front.kind.is_message() {
                    return Err(invalid("the peer sent stream bytes here; use read"));
                }
                let start = self.message.len();
                self.message.resize(start + front.contiguous as usize, 0);
                let at = SLOT_AREA + front.offset as usize;
                self.recv_mr.read(at, &mut self.message[start..]).map_err(from_verbs)?;
                if self.core.consume(front.contiguous) {
                    self.post_ops();
                    return Ok(Some(std::mem::take(&mut self.message)));
                }
            }
            self.post_ops();
            if self.at_eof() {
                if !self.message.is_empty() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "lightpath: stream ended inside a message",
                    ));
                }
                return Ok(None);
            }
            self.check_usable()?;
            if self.peer_vanished() {
                return Err(reset("the peer vanished (its TCP connection closed without a clean close)"));
            }
            self.wait(deadline)?;
            just_pumped = true;
        }
    }

    /// Waits until everything written has been acknowledged by the peer.
    pub(crate) fn flush(&mut self, deadline: Deadline) -> io::Result<()> {
        self.core.uncork();
        loop {
            self.pump();
            self.check_usable()?;
            if self.core.is_flushed() {
                return Ok(());
            }
            if self.peer_vanished() {
                return Err(reset("the peer vanished before acknowledging"));
            }
            self.wait(deadline)?;
        }
    }

    /// Corking on or off (see `Stream::set_nodelay`).
    pub(crate) fn set_cork(&mut self, cork: bool) {
        self.core.set_cork_depth(if cork { 2 } else { 0 });
        self.pump();
    }

    /// Half close: the peer reads end of stream after everything written so far.
    pub(crate) fn shutdown_write(&mut self) -> io::Result<()> {
        self.core.uncork();
        self.core.shutdown();
        self.pump();
        self.check_usable()
    }

    /// Stops reading: later reads return end of stream.
    pub(crate) fn shutdown_read(&mut self) {
        self.read_shut = true;
    }

    /// Clean close: send the close record, wait (at most the linger time) for everything to
    /// be acknowledged, then say goodbye on the TCP connection with the totals sent.
    pub(crate) fn close(&mut self) {
        if self.failed.is_some() || self.peer_vanished() {
            return;
        }
        self.core.uncork();
        self.core.shutdown();
        let deadline = Deadline::At(Some(Instant::now() + self.linger));
        while self.failed.is_none() && !self.core.is_flushed() {
            self.pump();
            if self.core.is_flushed() || self.tcp_eof {
                break;
            }
            if self.wait(deadline).is_err() {
                break;
            }
        }
        if !self.core.is_flushed() {
            return;
        }
        let bye = Message::Bye { bytes: self.core.bytes_committed(), records: self.core.records_sent() };
        let _ = self.tcp.set_nonblocking(false);
        let _ = self.tcp.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = self.tcp.write_all(&bye.to_bytes());
        let _ = self.tcp.shutdown(std::net::Shutdown::Write);
    }

    /// Whether the close handshake finished (the queue pair must then outlive this call
    /// until the peer closes too, see `reaper`).
    pub(crate) fn closed_cleanly(&self) -> bool {
        self.failed.is_none() && self.core.is_flushed() && !self.tcp_eof
    }

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
        local: &MrOf<D>,
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
        local: &MrOf<D>,
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

    /// How long a closed connection waits for its peer.
    pub(crate) fn linger(&self) -> Duration {
        self.linger
    }

    /// The TCP connection.
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Arms the completion queue's notification and returns the fds to wait on (queue,
    /// TCP); `false` in the second field means something is ready already.
    pub(crate) fn arm(&mut self) -> io::Result<bool> {
        self.cq.request_notify().map_err(from_verbs)?;
        Ok(!self.pump())
    }

    /// The completion queue's notification fd, if the provider has one.
    pub(crate) fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        self.cq.notify_fd()
    }

    /// Consumes a pending notification.
    pub(crate) fn take_notify(&mut self) {
        let _ = self.cq.take_notify();
    }

    /// Whether a read would not block (data, end of stream or an error).
    pub(crate) fn readable_now(&self) -> bool {
        self.core.front().is_some() || self.at_eof() || self.failed.is_some() || self.peer_vanished()
    }

    /// Whether a write would not block.
    pub(crate) fn writable_now(&mut self) -> bool {
        self.read_slot();
        self.failed.is_some()
            || self.core.is_shut_down()
            || self.tcp_eof
            || self.core.send_room(RecordKind::Data, 1).is_some()
    }

    /// Nonblocking look at the TCP connection (for event-loop drivers).
    pub(crate) fn poll_tcp(&mut self) {
        self.check_tcp();
    }
}

impl<D: Device + 'static> crate::reaper::Parked for RdmaConn<D> {
    fn peer_done(&mut self) -> bool {
        self.check_tcp();
        self.tcp_eof
    }
}
