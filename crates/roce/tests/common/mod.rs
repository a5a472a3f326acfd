//! A tiny in-memory network for the engine tests: N engines, each with an IPv4 address,
//! joined by a lossless FIFO "wire" with an optional filter that may drop (or inspect) any
//! datagram, and a virtual clock advanced to the next engine deadline when the wire is idle.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};

use lightpath_roce::{CqHandle, Engine, EngineConfig, MrKeys, RegionMemory, Time, MAX_DATAGRAM};
use lightpath_verbs::{
    AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, RecvWr, SendFlags, SendOp, SendWr, Sge, WcStatus,
    WorkCompletion,
};
use lightpath_wire::{Opcode, Syndrome, TransportRepr};

/// One datagram seen on the wire.
#[derive(Clone, Debug)]
pub struct Seen {
    pub from: usize,
    pub to: usize,
    pub opcode: Opcode,
    pub psn: u32,
    pub ack_req: bool,
    pub solicited: bool,
    pub syndrome: Option<Syndrome>,
    pub msn: Option<u32>,
    pub payload_len: usize,
    pub dest_qpn: u32,
    pub src_port: u16,
    pub bytes: Vec<u8>,
}

/// What the filter decides for a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Deliver,
    Drop,
    /// Deliver after this many later datagrams have been delivered (reordering).
    Hold(usize),
}

type Filter = Box<dyn FnMut(&Seen) -> Verdict>;

pub struct Net {
    pub engines: Vec<Engine>,
    pub now: Time,
    pub trace: Vec<Seen>,
    pub filter: Option<Filter>,
    wire: VecDeque<Seen>,
    held: Vec<(usize, Seen)>,
    buf: Vec<u8>,
    v6: bool,
}

pub fn ip(index: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, index as u8 + 1))
}

/// The IPv6 address of engine `index` in a network made by [`Net::new_v6`].
pub fn ip6(index: usize) -> IpAddr {
    IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, index as u16 + 1))
}

impl Net {
    pub fn new(count: usize) -> Self {
        Self::build(count, false)
    }

    /// Engines with IPv6 addresses (RoCE v2 over IPv6, where the ICRC is checked exactly).
    pub fn new_v6(count: usize) -> Self {
        Self::build(count, true)
    }

    fn build(count: usize, v6: bool) -> Self {
        let addr = |i| if v6 { ip6(i) } else { ip(i) };
        let engines = (0..count).map(|i| Engine::new(EngineConfig::new(Gid::from_ip(addr(i))))).collect();
        Self {
            engines,
            now: Time::ZERO,
            trace: Vec::new(),
            filter: None,
            wire: VecDeque::new(),
            held: Vec::new(),
            buf: vec![0; MAX_DATAGRAM],
            v6,
        }
    }

    /// The address of engine `index`.
    pub fn addr(&self, index: usize) -> IpAddr {
        if self.v6 {
            ip6(index)
        } else {
            ip(index)
        }
    }

    pub fn set_filter(&mut self, filter: impl FnMut(&Seen) -> Verdict + 'static) {
        self.filter = Some(Box::new(filter));
    }

    pub fn clear_filter(&mut self) {
        self.filter = None;
    }

    fn index_of(&self, addr: IpAddr) -> usize {
        (0..self.engines.len()).find(|&i| self.addr(i) == addr).expect("transmit to an unknown address")
    }

    /// Moves datagrams until no engine has anything to send. Panics on a livelock.
    pub fn pump(&mut self) {
        let mut moved = 0usize;
        loop {
            self.collect_transmits();
            let Some(seen) = self.wire.pop_front() else {
                // Nothing new on the wire: held datagrams go now, oldest first.
                if self.held.is_empty() {
                    return;
                }
                let (_, due) = self.held.remove(0);
                self.hand_over(&due);
                continue;
            };
            moved += 1;
            assert!(moved < 20_000_000, "livelock: too many datagrams");
            self.trace.push(Seen { bytes: Vec::new(), ..seen.clone() });
            let verdict = self.filter.as_mut().map_or(Verdict::Deliver, |f| f(&seen));
            match verdict {
                Verdict::Deliver => {
                    self.hand_over(&seen);
                    self.tick_held();
                }
                Verdict::Drop => {}
                Verdict::Hold(n) => self.held.push((n, seen)),
            }
        }
    }

    fn collect_transmits(&mut self) {
        for from in 0..self.engines.len() {
            while let Some(t) = self.engines[from].poll_transmit(self.now, &mut self.buf) {
                let bytes = self.buf[..t.len].to_vec();
                let repr = TransportRepr::parse(&bytes).expect("the engine emitted an unparseable datagram");
                let seen = Seen {
                    from,
                    to: self.index_of(t.dst),
                    opcode: repr.header.bth.opcode,
                    psn: repr.header.bth.psn.value(),
                    ack_req: repr.header.bth.ack_req,
                    solicited: repr.header.bth.solicited,
                    syndrome: repr.header.aeth.map(|a| a.syndrome),
                    msn: repr.header.aeth.map(|a| a.msn),
                    payload_len: repr.payload.len(),
                    dest_qpn: repr.header.bth.dest_qpn,
                    src_port: t.src_port,
                    bytes: bytes.clone(),
                };
                self.wire.push_back(seen);
            }
        }
    }

    fn hand_over(&mut self, seen: &Seen) {
        let (src, dst) = (self.addr(seen.from), self.addr(seen.to));
        self.engines[seen.to].handle_datagram(self.now, src, dst, seen.src_port, &seen.bytes);
    }

    /// One more datagram was delivered: held ones whose count ran out follow it.
    fn tick_held(&mut self) {
        for entry in &mut self.held {
            entry.0 = entry.0.saturating_sub(1);
        }
        while let Some(i) = self.held.iter().position(|(n, _)| *n == 0) {
            let (_, due) = self.held.remove(i);
            self.hand_over(&due);
        }
    }

    /// Pumps, then advances the clock to the next deadline and fires timers, until nothing is
    /// pending or the clock would pass `limit_nanos` past the start.
    pub fn run_for(&mut self, limit_nanos: u64) {
        let end = self.now.as_nanos().saturating_add(limit_nanos);
        loop {
            self.pump();
            let Some(next) = self.engines.iter().filter_map(|e| e.poll_timeout()).min() else { return };
            if next.as_nanos() > end {
                return;
            }
            if next > self.now {
                self.now = next;
            }
            for engine in &mut self.engines {
                engine.handle_timeout(self.now);
            }
        }
    }

    /// Runs for up to 100 virtual seconds.
    pub fn run(&mut self) {
        self.run_for(100_000_000_000);
    }

    /// Delivers raw bytes to engine `to` as if sent by engine `from`.
    pub fn inject(&mut self, from: usize, to: usize, src_port: u16, bytes: &[u8]) {
        let (src, dst) = (self.addr(from), self.addr(to));
        self.engines[to].handle_datagram(self.now, src, dst, src_port, bytes);
    }

    pub fn count(&self, opcode: Opcode) -> usize {
        self.trace.iter().filter(|s| s.opcode == opcode).count()
    }

    pub fn naks(&self, syndrome: Syndrome) -> usize {
        self.trace
            .iter()
            .filter(|s| s.syndrome == Some(syndrome) && s.opcode == Opcode::RC_ACKNOWLEDGE)
            .count()
    }
}

/// Connection options for [`connect`].
#[derive(Clone, Copy, Debug)]
pub struct Opts {
    pub mtu: Mtu,
    pub psn_a: u32,
    pub psn_b: u32,
    pub access: AccessFlags,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub caps: QpCaps,
    pub cq_size: u32,
    /// Both ends are Lightpath soft devices using this path MTU (`QpAttr::lightpath_pmtu`).
    pub lightpath_pmtu: Option<u32>,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            mtu: Mtu::Mtu1024,
            psn_a: 0x1000,
            psn_b: 0x2000,
            access: AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            caps: QpCaps {
                max_send_wr: 512,
                max_recv_wr: 512,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 256,
            },
            cq_size: 4096,
            lightpath_pmtu: None,
        }
    }
}

/// One end of a connection.
#[derive(Clone, Copy, Debug)]
pub struct End {
    pub engine: usize,
    pub qpn: u32,
    pub send_cq: CqHandle,
    pub recv_cq: CqHandle,
}

#[derive(Clone, Copy, Debug)]
pub struct Conn {
    pub a: End,
    pub b: End,
}

pub fn create_end(net: &mut Net, engine: usize, opts: &Opts) -> End {
    let e = &mut net.engines[engine];
    let send_cq = e.create_cq(opts.cq_size).unwrap();
    let recv_cq = e.create_cq(opts.cq_size).unwrap();
    let qpn = e.create_qp(send_cq, recv_cq, opts.caps).unwrap();
    e.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(opts.access)).unwrap();
    End { engine, qpn, send_cq, recv_cq }
}

/// Brings `end` to RTS towards `peer`.
pub fn bring_up(net: &mut Net, end: End, peer: End, rq_psn: u32, sq_psn: u32, opts: &Opts) {
    let now = net.now;
    let peer_gid = Gid::from_ip(net.addr(peer.engine));
    let e = &mut net.engines[end.engine];
    let av =
        AddressVector { lightpath_peer: opts.lightpath_pmtu.is_some(), ..AddressVector::new(peer_gid, 0) };
    let mut rtr = QpAttr::to_rtr(av, opts.mtu, peer.qpn, rq_psn);
    rtr.lightpath_pmtu = opts.lightpath_pmtu;
    rtr.max_dest_rd_atomic = Some(opts.max_dest_rd_atomic);
    rtr.min_rnr_timer = Some(opts.min_rnr_timer);
    e.modify_qp(now, end.qpn, &rtr).unwrap();
    let mut rts = QpAttr::to_rts(sq_psn);
    rts.timeout = Some(opts.timeout);
    rts.retry_cnt = Some(opts.retry_cnt);
    rts.rnr_retry = Some(opts.rnr_retry);
    rts.max_rd_atomic = Some(opts.max_rd_atomic);
    e.modify_qp(now, end.qpn, &rts).unwrap();
}

/// Connects a QP on engine `a` with one on engine `b` (both to RTS).
pub fn connect(net: &mut Net, a: usize, b: usize, opts: &Opts) -> Conn {
    let end_a = create_end(net, a, opts);
    let end_b = create_end(net, b, opts);
    bring_up(net, end_a, end_b, opts.psn_b, opts.psn_a, opts);
    bring_up(net, end_b, end_a, opts.psn_a, opts.psn_b, opts);
    Conn { a: end_a, b: end_b }
}

/// A region with guard bytes on both sides: the engine sees only the middle, and
/// [`Guarded::guards_intact`] proves nothing outside it was written.
pub struct Guarded {
    bytes: Mutex<Vec<u8>>,
    len: usize,
}

pub const GUARD: usize = 64;
pub const GUARD_BYTE: u8 = 0xEE;

impl Guarded {
    pub fn new(contents: Vec<u8>) -> Arc<Self> {
        let len = contents.len();
        let mut bytes = vec![GUARD_BYTE; GUARD];
        bytes.extend(contents);
        bytes.extend(vec![GUARD_BYTE; GUARD]);
        Arc::new(Self { bytes: Mutex::new(bytes), len })
    }

    pub fn contents(&self) -> Vec<u8> {
        self.bytes.lock().unwrap()[GUARD..GUARD + self.len].to_vec()
    }

    pub fn guards_intact(&self) -> bool {
        let bytes = self.bytes.lock().unwrap();
        bytes[..GUARD].iter().chain(&bytes[GUARD + self.len..]).all(|&b| b == GUARD_BYTE)
    }

    fn check(&self, offset: usize, len: usize) -> usize {
        assert!(offset + len <= self.len, "engine accessed {offset}+{len} of a {}-byte region", self.len);
        GUARD + offset
    }
}

impl RegionMemory for Guarded {
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, offset: usize, dst: &mut [u8]) {
        let at = self.check(offset, dst.len());
        dst.copy_from_slice(&self.bytes.lock().unwrap()[at..at + dst.len()]);
    }
    fn write(&self, offset: usize, src: &[u8]) {
        let at = self.check(offset, src.len());
        self.bytes.lock().unwrap()[at..at + src.len()].copy_from_slice(src);
    }
    fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> u64 {
        let at = self.check(offset, 8);
        let mut bytes = self.bytes.lock().unwrap();
        let old = u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap());
        if old == compare {
            bytes[at..at + 8].copy_from_slice(&swap.to_ne_bytes());
        }
        old
    }
    fn fetch_add(&self, offset: usize, add: u64) -> u64 {
        let at = self.check(offset, 8);
        let mut bytes = self.bytes.lock().unwrap();
        let old = u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap());
        bytes[at..at + 8].copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
        old
    }
}

/// A registered buffer.
pub struct Buf {
    pub mem: Arc<Guarded>,
    pub keys: MrKeys,
    pub addr: u64,
    pub len: usize,
}

impl Buf {
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge { addr: self.addr + offset as u64, length: len as u32, lkey: self.keys.lkey }
    }
    pub fn all(&self) -> Sge {
        self.sge(0, self.len)
    }
    pub fn contents(&self) -> Vec<u8> {
        self.mem.contents()
    }
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 8) as u8)).collect()
}

pub fn reg(net: &mut Net, engine: usize, contents: Vec<u8>, addr: u64, access: AccessFlags) -> Buf {
    let len = contents.len();
    let mem = Guarded::new(contents);
    let keys = net.engines[engine].reg_mr(mem.clone(), addr, access).unwrap();
    Buf { mem, keys, addr, len }
}

pub fn rw() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

pub fn poll_all(net: &mut Net, engine: usize, cq: CqHandle) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut batch = [WorkCompletion::new(0, WcStatus::Success, lightpath_verbs::WcOpcode::Send, 0); 16];
    loop {
        let n = net.engines[engine].poll_cq(cq, &mut batch);
        out.extend_from_slice(&batch[..n]);
        if n < batch.len() {
            return out;
        }
    }
}

pub fn send_wr(wr_id: u64, op: SendOp, sges: &[Sge]) -> SendWr<'_> {
    SendWr::new(wr_id, op, sges)
}

pub fn post_send(net: &mut Net, end: End, wr: &SendWr<'_>) {
    let now = net.now;
    net.engines[end.engine].post_send(now, end.qpn, wr).unwrap();
}

pub fn post_recv(net: &mut Net, end: End, wr_id: u64, sges: &[Sge]) {
    net.engines[end.engine].post_recv(end.qpn, &RecvWr::new(wr_id, sges)).unwrap();
}

pub fn unsignaled() -> SendFlags {
    SendFlags::NONE
}
