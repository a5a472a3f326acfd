//! The in-memory model of RDMA that the two-side tests wire connection cores through: each
//! side has its core and its memory (staging, ring, credit slot, posted receives, and for
//! rendezvous a registered buffer, a bounce region and a direct-read destination); every
//! operation a core asks for becomes a packet on an in-order wire, and delivering a packet
//! applies it to the peer's memory and completes it at the sender, in order.

// Each test binary that includes this module uses only part of it (pair.rs has no rendezvous).
#![allow(dead_code)]

use std::collections::VecDeque;

use lightpath_stream::rendezvous::{BounceGeometry, Descriptor, ReadRequest, ReadTarget, DESCRIPTOR_LEN};
use lightpath_stream::{Arrival, Conn, ConnConfig, CreditWord, Op, RecordKind};

/// Address and key of the sender's registered buffer in the model.
pub const EXPOSED_ADDR: u64 = 0x7000_0000;
pub const EXPOSED_RKEY: u32 = 77;

/// One side: its core and its memory.
pub struct Side {
    pub conn: Conn,
    pub staging: Vec<u8>,
    pub ring: Vec<u8>,
    pub credit_slot: [u8; 8],
    /// Receive requests posted and not consumed.
    pub recvs: u64,
    /// Signaled sends (and READs) whose completion is due.
    pub send_done: VecDeque<u64>,
    /// The registered buffer a rendezvous of this side names.
    pub exposed: Vec<u8>,
    pub bounce: Vec<u8>,
    /// Destination of the direct read in progress.
    pub direct: Vec<u8>,
    /// READs of this side the peer refused (bad key or range): a remote access error.
    pub access_errors: u32,
    /// See [`Pair::ring_touched`].
    pub touched: usize,
}

/// What travels from one side to the other, in order.
pub enum Packet {
    Ring { pos: u64, bytes: Vec<u8>, imm: Option<u32>, done: Option<u64> },
    Credit { word: [u8; 8], imm: Option<u32>, done: Option<u64> },
    Read(ReadRequest),
}

pub struct Pair {
    pub sides: [Side; 2],
    pub wires: [VecDeque<Packet>; 2],
    /// The bounce region's shape; `None` for a pair that never reads a rendezvous.
    geometry: Option<BounceGeometry>,
}

/// Both sides take ring restarts (protocol version 4).
pub fn config(ring: u32, depth: u32, cork: u32) -> ConnConfig {
    ConnConfig {
        local_ring: ring,
        peer_ring: ring,
        local_recv_depth: depth,
        peer_recv_depth: depth,
        send_depth: 16,
        max_record: ring,
        cork_depth: cork,
        ring_restarts: true,
    }
}

impl Pair {
    /// A pair for stream and message bytes only.
    pub fn new(ring: u32, depth: u32, cork: u32) -> Self {
        Self::build(ring, depth, cork, None)
    }

    /// [`Pair::new`] with ring restarts on (`restarts`, both sides' configuration) or off (the
    /// sides speak protocol version 3).
    pub fn with_restarts(ring: u32, depth: u32, cork: u32, restarts: bool) -> Self {
        let mut pair = Self::new(ring, depth, cork);
        for side in &mut pair.sides {
            side.conn = Conn::new(ConnConfig { ring_restarts: restarts, ..config(ring, depth, cork) });
        }
        pair
    }

    /// The highest ring offset side `i` has had bytes written at so far, plus one: how much of
    /// its ring the peer has touched.
    pub fn ring_touched(&self, i: usize) -> usize {
        self.sides[i].touched
    }

    /// A pair that can also read rendezvous, through a bounce region of `geometry`.
    pub fn with_bounce(ring: u32, depth: u32, geometry: BounceGeometry) -> Self {
        Self::build(ring, depth, 0, Some(geometry))
    }

    fn build(ring: u32, depth: u32, cork: u32, geometry: Option<BounceGeometry>) -> Self {
        let side = || Side {
            conn: Conn::new(config(ring, depth, cork)),
            staging: vec![0; ring as usize],
            ring: vec![0; ring as usize],
            credit_slot: [0; 8],
            recvs: u64::from(depth),
            send_done: VecDeque::new(),
            exposed: Vec::new(),
            bounce: vec![0; geometry.map_or(0, |geometry| geometry.len())],
            direct: Vec::new(),
            access_errors: 0,
            touched: 0,
        };
        Self { sides: [side(), side()], wires: [VecDeque::new(), VecDeque::new()], geometry }
    }

    /// Posts every op side `i` has.
    pub fn post(&mut self, i: usize) {
        while let Some(op) = self.sides[i].conn.poll_op() {
            let side = &mut self.sides[i];
            match op {
                Op::PostRecv { count } => side.recvs += u64::from(count),
                Op::Write { seq, pos, len, imm, signaled } => {
                    let ring = side.staging.len() as u64;
                    let offset = (pos % ring) as usize;
                    assert!(offset + len as usize <= side.staging.len(), "a write never wraps");
                    let bytes = side.staging[offset..offset + len as usize].to_vec();
                    self.wires[i].push_back(Packet::Ring { pos, bytes, imm, done: signaled.then_some(seq) });
                }
                Op::Credit { seq, word, imm, signaled } => {
                    let done = signaled.then_some(seq);
                    self.wires[i].push_back(Packet::Credit { word: word.to_bytes(), imm, done });
                }
            }
        }
    }

    /// Queues a READ of side `i` (the driver's job).
    pub fn post_read(&mut self, i: usize, request: ReadRequest) {
        self.wires[i].push_back(Packet::Read(request));
    }

    /// Delivers up to `n` packets from side `i` to the other; returns how many moved.
    pub fn deliver(&mut self, i: usize, n: usize) -> usize {
        let mut moved = 0;
        while moved < n {
            let Some(packet) = self.wires[i].pop_front() else { break };
            moved += 1;
            let (imm, done) = match packet {
                Packet::Ring { pos, bytes, imm, done } => {
                    let peer = &mut self.sides[1 - i];
                    let ring = peer.ring.len() as u64;
                    let offset = (pos % ring) as usize;
                    peer.ring[offset..offset + bytes.len()].copy_from_slice(&bytes);
                    peer.touched = peer.touched.max(offset + bytes.len());
                    (imm.map(|imm| (imm, bytes.len() as u32)), done)
                }
                Packet::Credit { word, imm, done } => {
                    self.sides[1 - i].credit_slot = word;
                    (imm.map(|imm| (imm, 8)), done)
                }
                Packet::Read(request) => {
                    if !self.carry_out_read(i, &request) {
                        self.sides[i].access_errors += 1;
                        continue;
                    }
                    (None, Some(request.seq))
                }
            };
            // The sender's completion: acknowledged once delivered.
            self.sides[i].send_done.extend(done);
            let peer = &mut self.sides[1 - i];
            if let Some((imm, len)) = imm {
                assert!(peer.recvs > 0, "a record arrived with no receive posted (RNR)");
                peer.recvs -= 1;
                match peer.conn.on_recv(imm, len).expect("the peer follows the protocol") {
                    Arrival::Credit => {
                        peer.conn.on_credit_word(CreditWord::from_bytes(peer.credit_slot));
                    }
                    Arrival::Bytes | Arrival::Closed | Arrival::Notify(_) => {}
                }
            }
        }
        let side = &mut self.sides[i];
        while let Some(seq) = side.send_done.pop_front() {
            side.conn.on_send_complete(seq);
        }
        moved
    }

    /// A READ by side `i` of the peer's exposed buffer: the peer's responder checks key and
    /// range, then the bytes land at side `i`. Returns whether the peer allowed it.
    fn carry_out_read(&mut self, i: usize, request: &ReadRequest) -> bool {
        let exposed = &self.sides[1 - i].exposed;
        let start = request.remote_addr.wrapping_sub(EXPOSED_ADDR) as usize;
        let end = start.checked_add(request.len as usize);
        let valid = request.rkey == EXPOSED_RKEY
            && request.remote_addr >= EXPOSED_ADDR
            && end.is_some_and(|end| end <= exposed.len());
        if !valid {
            return false;
        }
        let bytes = exposed[start..start + request.len as usize].to_vec();
        let side = &mut self.sides[i];
        let target = match request.target {
            ReadTarget::Bounce { offset } => &mut side.bounce[offset as usize..],
            ReadTarget::Direct { offset } => &mut side.direct[offset as usize..],
        };
        target[..bytes.len()].copy_from_slice(&bytes);
        true
    }

    /// Ring bytes `[offset, offset + len)` of side `i`, wrapping.
    pub fn ring_bytes(&self, i: usize, offset: u32, len: u32) -> Vec<u8> {
        let ring = &self.sides[i].ring;
        (0..len as usize).map(|k| ring[(offset as usize + k) % ring.len()]).collect()
    }

    /// The application on side `i` reads up to `max` stream bytes; any record but data is a
    /// failure.
    pub fn read(&mut self, i: usize, max: usize) -> Vec<u8> {
        self.read_records(i, max, None)
    }

    /// The application on side `i` reads up to `max` bytes of data and rendezvous, the latter
    /// `direct` into its own buffer (a direct read, which may need several steps to land) or
    /// through the bounce region, in READs of up to `chunk` bytes. Returns what it got in this
    /// step.
    pub fn read_mixed(&mut self, i: usize, max: usize, direct: bool, chunk: u32) -> Vec<u8> {
        self.read_records(i, max, Some((direct, chunk)))
    }

    /// `rendezvous` is how to read a rendezvous (direct, chunk), `None` if none may come.
    fn read_records(&mut self, i: usize, max: usize, rendezvous: Option<(bool, u32)>) -> Vec<u8> {
        {
            let side = &mut self.sides[i];
            side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        }
        let mut out = Vec::new();
        while out.len() < max {
            let Some(front) = self.sides[i].conn.front() else { break };
            match (front.kind, rendezvous) {
                (RecordKind::Data, _) => {
                    let side = &mut self.sides[i];
                    let n = (front.contiguous as usize).min(max - out.len());
                    let start = front.offset as usize;
                    out.extend_from_slice(&side.ring[start..start + n]);
                    side.conn.consume(n as u32);
                }
                (RecordKind::Rendezvous, Some((direct, chunk))) => {
                    if front.left > 0 {
                        let bytes = self.ring_bytes(i, front.offset, front.left);
                        let desc = self.sides[i].conn.accept_rendezvous(&bytes).expect("a valid descriptor");
                        assert!(desc.is_some(), "an unaccepted rendezvous at the head is accepted");
                        continue;
                    }
                    if !self.rendezvous_step(i, max - out.len(), direct, chunk, &mut out) {
                        break;
                    }
                }
                (other, _) => panic!("unexpected record {other:?}"),
            }
        }
        out
    }

    /// One step of reading the rendezvous at the head; `false` when it must wait for READs.
    fn rendezvous_step(&mut self, i: usize, max: usize, direct: bool, chunk: u32, out: &mut Vec<u8>) -> bool {
        let geometry = self.geometry.expect("a pair that reads rendezvous has a bounce region");
        let conn = &mut self.sides[i].conn;
        let incoming = conn.incoming().expect("accepted").clone();
        if incoming.direct_in_progress() {
            let mut requests = Vec::new();
            while let Some(request) = conn.rendezvous_direct(chunk, 3) {
                requests.push(request);
            }
            for request in requests {
                self.post_read(i, request);
            }
            let side = &mut self.sides[i];
            return match side.conn.rendezvous_finish_direct() {
                Some((n, _)) => {
                    out.extend_from_slice(&side.direct[..n as usize]);
                    true
                }
                None => false,
            };
        }
        if let Some((at, len)) = conn.rendezvous_bounced() {
            let n = len.min(max as u32);
            out.extend_from_slice(&self.sides[i].bounce[at as usize..(at + n) as usize]);
            self.sides[i].conn.rendezvous_take_bounced(n);
            return true;
        }
        if direct && !incoming.bounce_pending() {
            let want = conn.rendezvous_begin_direct(max as u64);
            assert!(want > 0 && want <= max as u64);
            self.sides[i].direct = vec![0; want as usize];
            return true;
        }
        let mut requests = Vec::new();
        while let Some(request) = conn.rendezvous_prefetch(geometry) {
            requests.push(request);
        }
        for request in requests {
            self.post_read(i, request);
        }
        // Waiting for a READ: the caller delivers packets and comes back.
        false
    }

    /// The application on side `i` writes as much of `data` as fits; returns how much.
    pub fn write(&mut self, i: usize, data: &[u8], kind: RecordKind) -> usize {
        let side = &mut self.sides[i];
        side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        let mut done = 0;
        loop {
            let Some((grant, offset)) = side.conn.send_room(kind, data.len() - done) else {
                if done < data.len() {
                    side.conn.note_blocked();
                }
                break;
            };
            let ring = side.staging.len();
            for k in 0..grant as usize {
                side.staging[(offset as usize + k) % ring] = data[done + k];
            }
            side.conn.commit(kind, grant);
            done += grant as usize;
            if done == data.len() {
                break;
            }
        }
        done
    }

    /// Side `i` announces `data` as a rendezvous if there is room; returns whether it did.
    /// `desc_override` replaces the true descriptor (to tell lies).
    pub fn start_rendezvous(&mut self, i: usize, data: &[u8], desc_override: Option<Descriptor>) -> bool {
        let side = &mut self.sides[i];
        side.conn.on_credit_word(CreditWord::from_bytes(side.credit_slot));
        let Some(offset) = side.conn.rendezvous_room() else {
            side.conn.note_blocked_for(DESCRIPTOR_LEN);
            return false;
        };
        side.exposed = data.to_vec();
        let desc = desc_override.unwrap_or(Descriptor {
            addr: EXPOSED_ADDR,
            len: data.len() as u64,
            rkey: EXPOSED_RKEY,
            message: false,
        });
        let ring = side.staging.len();
        for (k, byte) in desc.encode().iter().enumerate() {
            side.staging[(offset as usize + k) % ring] = *byte;
        }
        side.conn.commit_rendezvous();
        true
    }

    /// Whether nothing is in flight either way.
    pub fn idle(&self) -> bool {
        self.wires.iter().all(VecDeque::is_empty)
    }
}
