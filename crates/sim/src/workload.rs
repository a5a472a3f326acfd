//! The random workload of a seed: which operations each requester posts, when, with which
//! buffers, and the initial contents of every region.
//!
//! Generation is a pure function of (config, seed). Each direction of a connection (requester
//! node → responder node) owns its own regions, so the two directions never touch the same
//! memory and the expected result of each operation follows from the operations before it on
//! the same queue pair alone. Within a direction, a WRITE or atomic never overlaps the range of
//! an earlier READ: a lost READ response makes the responder re-read memory, so a later write
//! to that range could legitimately change what the READ returns (IBA leaves that undefined
//! without a fence).

use lightpath_verbs::Mtu;

use crate::config::{AddressFamily, SimConfig, WorkloadConfig};
use crate::op::{Negative, OpKind};
use crate::rng::SimRng;
use crate::time::SimTime;

/// Label of the workload's random stream (links use other labels).
const WORKLOAD_STREAM: u64 = 0x574F_524B;
/// Size of the always-present part of a target region.
const TARGET_BASE: usize = 64 * 1024;
/// Atomics prefer these words so that they act on each other's results.
const HOT_WORDS: usize = 8;
/// Size of the regions used for permission errors and of each region a SEND invalidates.
const SMALL_REGION: usize = 4096;

/// `len` bytes at `offset` of a local region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Offset from the start of the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Where a SEND or WRITE takes its bytes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    /// Given inline at post time.
    Inline,
    /// Gathered from these spans of the requester's source region.
    Gather(Vec<Span>),
}

/// Which responder region a remote access names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteRegion {
    /// The direction's target region (all remote permissions).
    Target,
    /// A region without remote write permission.
    NoWrite,
    /// A region without remote read or atomic permission.
    NoRead,
}

/// Where a remote access points, relative to a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteOffset {
    /// At this offset.
    At(usize),
    /// So that the access ends `overhang` bytes past the end of the region.
    PastEnd { overhang: usize },
    /// This many bytes before the start of the region.
    BeforeStart(usize),
}

/// A remote access of a WRITE, READ or atomic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRef {
    /// The region named.
    pub region: RemoteRegion,
    /// The address within (or outside) it.
    pub offset: RemoteOffset,
    /// Use an R_Key the responder never issued.
    pub bad_rkey: bool,
}

/// Operands of an atomic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicArgs {
    /// Compare value (compare-and-swap only).
    pub compare: u64,
    /// Swap value or addend.
    pub operand: u64,
}

/// One send work request of the workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedOp {
    /// Position in its send queue.
    pub index: usize,
    /// What it is.
    pub kind: OpKind,
    /// Message length in bytes (8 for atomics).
    pub len: usize,
    /// The bytes a SEND or WRITE carries.
    pub data: Vec<u8>,
    /// Where a SEND or WRITE takes its bytes from.
    pub payload: Option<Payload>,
    /// Where a READ or atomic puts its result (requester's sink region).
    pub sink: Vec<Span>,
    /// The remote access of a WRITE, READ or atomic.
    pub remote: Option<RemoteRef>,
    /// Which of the responder's invalidatable regions a SEND with invalidate names.
    pub invalidate: Option<usize>,
    /// Immediate data.
    pub imm: Option<u32>,
    /// Atomic operands.
    pub atomic: Option<AtomicArgs>,
    /// Whether a successful completion is reported.
    pub signaled: bool,
    /// The deliberate error this request carries, if any.
    pub negative: Option<Negative>,
    /// When the requester posts it.
    pub post_at: SimTime,
    /// The receive request it consumes at the responder.
    pub recv: Option<usize>,
}

/// One receive work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedRecv {
    /// Buffers in the responder's receive region.
    pub sges: Vec<Span>,
    /// When the responder posts it.
    pub post_at: SimTime,
    /// The operation that consumes it.
    pub op: usize,
}

impl PlannedRecv {
    /// Total buffer bytes.
    pub fn capacity(&self) -> usize {
        self.sges.iter().map(|s| s.len).sum()
    }
}

/// Everything one requester → responder direction does, with its regions' initial contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectionPlan {
    /// Index of the connection.
    pub connection: usize,
    /// Node that posts the operations.
    pub requester: usize,
    /// Node that executes them.
    pub responder: usize,
    /// First PSN the requester uses (the responder's expected PSN).
    pub sq_psn: u32,
    /// The requester's `max_rd_atomic`.
    pub max_rd_atomic: u8,
    /// The responder's `max_dest_rd_atomic` (≥ `max_rd_atomic`).
    pub max_dest_rd_atomic: u8,
    /// Send work requests in posting order.
    pub ops: Vec<PlannedOp>,
    /// Receive work requests in posting order.
    pub recvs: Vec<PlannedRecv>,
    /// Requester: source of gathered payloads.
    pub src: Vec<u8>,
    /// Requester: destination of READ data and atomic results.
    pub sink: Vec<u8>,
    /// Responder: region for WRITE, READ and atomics.
    pub target: Vec<u8>,
    /// Responder: receive buffers.
    pub recv_area: Vec<u8>,
    /// Responder: region without remote write permission.
    pub no_write: Vec<u8>,
    /// Responder: region without remote read/atomic permission.
    pub no_read: Vec<u8>,
    /// Responder: one region per SEND with invalidate.
    pub invalidatable: Vec<Vec<u8>>,
}

impl DirectionPlan {
    /// Index of the negative operation, if the direction has one.
    pub fn negative_index(&self) -> Option<usize> {
        self.ops.iter().position(|op| op.negative.is_some())
    }
}

/// A connection between two nodes (one RC QP on each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionPlan {
    /// First node.
    pub a: usize,
    /// Second node.
    pub b: usize,
    /// Path MTU of both QPs.
    pub mtu: Mtu,
}

/// The whole workload of a seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Whether GIDs are IPv6 (else IPv4-mapped).
    pub ipv6: bool,
    /// Connections.
    pub connections: Vec<ConnectionPlan>,
    /// Directions: `2 * c` is connection c's a → b, `2 * c + 1` its b → a.
    pub directions: Vec<DirectionPlan>,
}

impl Workload {
    /// Generates the workload of `seed`.
    pub fn generate(config: &SimConfig, seed: u64) -> Workload {
        let mut rng = SimRng::stream(seed, WORKLOAD_STREAM);
        let ipv6 = match config.family {
            AddressFamily::V4 => false,
            AddressFamily::V6 => true,
            AddressFamily::Random => config.link.corrupt > 0.0 || rng.chance(0.5),
        };
        let mut connections = Vec::new();
        let mut directions = Vec::new();
        for (index, (a, b)) in config.connections().into_iter().enumerate() {
            let mtu = config.qp.mtu.unwrap_or_else(|| *rng.pick(&Mtu::ALL).unwrap_or(&Mtu::Mtu1024));
            connections.push(ConnectionPlan { a, b, mtu });
            let negative_side = rng.chance(config.workload.negative).then(|| rng.range_usize(0, 1));
            let late_recvs = rng.chance(config.workload.late_recvs);
            for (side, (requester, responder)) in [(a, b), (b, a)].into_iter().enumerate() {
                let shape = DirectionShape {
                    connection: index,
                    requester,
                    responder,
                    mtu: mtu.bytes() as usize,
                    with_negative: negative_side == Some(side),
                    late_recvs,
                };
                directions.push(generate_direction(&mut rng, config, &shape));
            }
        }
        Workload { ipv6, connections, directions }
    }
}

struct DirectionShape {
    connection: usize,
    requester: usize,
    responder: usize,
    mtu: usize,
    with_negative: bool,
    late_recvs: bool,
}

/// A start PSN: anywhere, or (a quarter of the time) just before the 24-bit wrap.
fn start_psn(rng: &mut SimRng) -> u32 {
    if rng.chance(0.25) {
        0x00FF_FFFF - rng.range_u64(0, 40) as u32
    } else {
        rng.u32() & 0x00FF_FFFF
    }
}

/// A message length: mostly small, often a few MTUs, sometimes zero, rarely large.
fn message_len(rng: &mut SimRng, workload: &WorkloadConfig, mtu: usize) -> usize {
    let max = workload.max_message as usize;
    let len = if rng.chance(workload.big_message) {
        rng.range_usize(256 * 1024, max.max(256 * 1024))
    } else {
        match rng.range_u64(0, 99) {
            0..=3 => 0,
            4..=24 => rng.range_usize(1, 64),
            25..=54 => rng.range_usize(65, mtu),
            55..=84 => rng.range_usize(mtu + 1, 8 * mtu),
            _ => rng.range_usize(8 * mtu + 1, 64 * 1024),
        }
    };
    len.min(max)
}

/// Splits `len` bytes into one to `max_pieces` spans appended to `area` (random contents),
/// with random gaps between them so gathers and scatters cross discontiguous addresses.
fn place_spans(rng: &mut SimRng, area: &mut Vec<u8>, len: usize, max_pieces: usize) -> Vec<Span> {
    if len == 0 {
        // Both spellings of "no bytes": no SGE at all, or one empty SGE.
        return if rng.chance(0.5) { Vec::new() } else { vec![Span { offset: area.len(), len: 0 }] };
    }
    let pieces = rng.range_usize(1, max_pieces.max(1).min(len));
    let mut cuts: Vec<usize> = (1..pieces).map(|_| rng.range_usize(1, len - 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut spans = Vec::new();
    let mut start = 0;
    for end in cuts.into_iter().chain(std::iter::once(len)) {
        let gap = rng.range_usize(0, 24);
        area.extend(rng.bytes(gap));
        spans.push(Span { offset: area.len(), len: end - start });
        area.extend(rng.bytes(end - start));
        start = end;
    }
    spans
}

/// Appends `len` random bytes to `area`, 8-byte aligned, and returns their offset.
fn place_aligned(rng: &mut SimRng, area: &mut Vec<u8>, len: usize) -> usize {
    while !area.len().is_multiple_of(8) {
        area.push(rng.u32() as u8);
    }
    let offset = area.len();
    area.extend(rng.bytes(len));
    offset
}

fn gather(area: &[u8], spans: &[Span]) -> Vec<u8> {
    spans.iter().flat_map(|s| area[s.offset..s.offset + s.len].iter().copied()).collect()
}

fn overlaps(ranges: &[(usize, usize)], start: usize, len: usize) -> bool {
    ranges.iter().any(|&(s, e)| start < e && s < start + len)
}

/// Target-region layout while generating: the initial contents, the contents after every
/// planned operation so far (used to choose compare values that match), and the READ ranges
/// later writes must avoid.
struct TargetLayout {
    base_len: usize,
    initial: Vec<u8>,
    current: Vec<u8>,
    read_ranges: Vec<(usize, usize)>,
}

impl TargetLayout {
    fn new(rng: &mut SimRng, base_len: usize) -> Self {
        let initial = rng.bytes(base_len);
        Self { base_len, current: initial.clone(), initial, read_ranges: Vec::new() }
    }

    /// Grows the region by `len` fresh bytes (8-aligned) and returns their offset.
    fn grow(&mut self, rng: &mut SimRng, len: usize) -> usize {
        let offset = self.initial.len();
        let fresh = rng.bytes(len.div_ceil(8) * 8 + 8);
        self.initial.extend_from_slice(&fresh);
        self.current.extend_from_slice(&fresh);
        offset
    }

    /// A range for a write of `len` bytes (aligned to `align`) that avoids every earlier READ.
    fn write_offset(&mut self, rng: &mut SimRng, len: usize, align: usize, prefer_hot: bool) -> usize {
        for _ in 0..8 {
            let offset = if prefer_hot && rng.chance(0.6) {
                rng.range_usize(0, HOT_WORDS - 1) * 64
            } else {
                rng.range_usize(0, (self.base_len - len) / align) * align
            };
            if !overlaps(&self.read_ranges, offset, len) {
                return offset;
            }
        }
        self.grow(rng, len)
    }

    fn word(&self, offset: usize) -> u64 {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&self.current[offset..offset + 8]);
        u64::from_ne_bytes(bytes)
    }

    fn set_word(&mut self, offset: usize, value: u64) {
        self.current[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }
}

fn generate_direction(rng: &mut SimRng, config: &SimConfig, shape: &DirectionShape) -> DirectionPlan {
    let workload = &config.workload;
    let kinds = workload.kinds();
    let max_sge = config.qp.max_sge as usize;
    let count = rng.range_usize(workload.min_ops.max(1), workload.max_ops.max(workload.min_ops.max(1)));

    // Pass 1: kinds, lengths, flags, timing.
    let mut ops: Vec<PlannedOp> = Vec::with_capacity(count);
    let mut post_at = SimTime::ZERO;
    for index in 0..count {
        let kind = *rng.pick(&kinds).unwrap_or(&OpKind::Send);
        let len = if kind.is_atomic() { 8 } else { message_len(rng, workload, shape.mtu) };
        if workload.spread_posts && rng.chance(0.3) {
            post_at += std::time::Duration::from_micros(rng.range_u64(1, 300));
        }
        let signaled = index + 1 == count || !rng.chance(workload.unsignaled);
        let imm = matches!(kind, OpKind::SendImm | OpKind::WriteImm).then(|| rng.u32());
        ops.push(PlannedOp {
            index,
            kind,
            len,
            data: Vec::new(),
            payload: None,
            sink: Vec::new(),
            remote: None,
            invalidate: None,
            imm,
            atomic: None,
            signaled,
            negative: None,
            post_at,
            recv: None,
        });
    }
    if shape.with_negative {
        let candidates: Vec<usize> =
            ops.iter().filter(|op| !Negative::applicable(op.kind).is_empty()).map(|op| op.index).collect();
        if let Some(&index) = rng.pick(&candidates) {
            let op = &mut ops[index];
            op.negative = rng.pick(Negative::applicable(op.kind)).copied();
            if !op.kind.is_atomic() {
                // A zero-length access checks no range; give the error something to find.
                op.len = op.len.clamp(16, (4 * shape.mtu).min(SMALL_REGION / 2));
            }
        }
    }

    // Pass 2: local buffers, payload bytes and receives.
    let mut src = Vec::new();
    let mut sink = Vec::new();
    let mut recv_area = Vec::new();
    let mut recvs = Vec::new();
    let mut invalidatable = Vec::new();
    for op in &mut ops {
        if op.kind.carries_payload() {
            if op.len <= config.qp.max_inline_data as usize && rng.chance(workload.inline) {
                op.data = rng.bytes(op.len);
                op.payload = Some(Payload::Inline);
            } else {
                let spans = place_spans(rng, &mut src, op.len, max_sge);
                op.data = gather(&src, &spans);
                op.payload = Some(Payload::Gather(spans));
            }
        }
        if op.kind == OpKind::Read {
            op.sink = place_spans(rng, &mut sink, op.len, max_sge);
        } else if op.kind.is_atomic() {
            op.sink = vec![Span { offset: place_aligned(rng, &mut sink, 8), len: 8 }];
        }
        if op.kind == OpKind::SendInv {
            op.invalidate = Some(invalidatable.len());
            invalidatable.push(rng.bytes(SMALL_REGION));
        }
        if op.kind.consumes_recv() {
            let slack = rng.range_usize(0, 64);
            let capacity = if op.kind == OpKind::WriteImm { slack } else { op.len + slack };
            let sges = place_spans(rng, &mut recv_area, capacity, max_sge);
            let post_at = if shape.late_recvs && rng.chance(0.5) {
                SimTime::from_micros(rng.range_u64(200, 3000))
            } else {
                SimTime::ZERO
            };
            op.recv = Some(recvs.len());
            recvs.push(PlannedRecv { sges, post_at, op: op.index });
        }
    }
    // Receives are posted in order, so a late one delays the ones after it.
    let mut latest = SimTime::ZERO;
    for recv in &mut recvs {
        latest = latest.max(recv.post_at);
        recv.post_at = latest;
    }

    // Pass 3: remote addresses, following the memory the operations leave behind.
    let largest = ops.iter().filter(|op| op.kind.is_remote_access()).map(|op| op.len).max().unwrap_or(0);
    let base_len = TARGET_BASE.max(largest.div_ceil(8) * 8 + 64);
    let mut target = TargetLayout::new(rng, base_len);
    for op in &mut ops {
        if op.negative.is_some() || !op.kind.is_remote_access() {
            continue;
        }
        let offset = match op.kind {
            OpKind::Read => {
                let offset = rng.range_usize(0, base_len - op.len);
                target.read_ranges.push((offset, offset + op.len));
                offset
            }
            OpKind::Write | OpKind::WriteImm => {
                let offset = target.write_offset(rng, op.len, 1, false);
                target.current[offset..offset + op.len].copy_from_slice(&op.data);
                offset
            }
            _ => {
                let offset = target.write_offset(rng, 8, 8, true);
                let old = target.word(offset);
                let args = if op.kind == OpKind::CmpSwap {
                    let compare = if rng.chance(0.5) { old } else { rng.u64() };
                    let operand = rng.u64();
                    target.set_word(offset, if old == compare { operand } else { old });
                    AtomicArgs { compare, operand }
                } else {
                    let operand = if rng.chance(0.5) { rng.range_u64(0, 1000) } else { rng.u64() };
                    target.set_word(offset, old.wrapping_add(operand));
                    AtomicArgs { compare: 0, operand }
                };
                op.atomic = Some(args);
                offset
            }
        };
        op.remote = Some(RemoteRef {
            region: RemoteRegion::Target,
            offset: RemoteOffset::At(offset),
            bad_rkey: false,
        });
    }
    for op in &mut ops {
        if let Some(negative) = op.negative {
            op.remote = Some(negative_ref(rng, negative, op, base_len));
            if op.kind.is_atomic() {
                op.atomic = Some(AtomicArgs { compare: rng.u64(), operand: rng.u64() });
            }
        }
    }

    let max_rd_atomic = *rng.pick(&[1u8, 2, 4, 16]).unwrap_or(&16);
    let max_dest_rd_atomic = max_rd_atomic.max(*rng.pick(&[1u8, 4, 16]).unwrap_or(&16));
    DirectionPlan {
        connection: shape.connection,
        requester: shape.requester,
        responder: shape.responder,
        sq_psn: start_psn(rng),
        max_rd_atomic,
        max_dest_rd_atomic,
        ops,
        recvs,
        src,
        sink,
        target: target.initial,
        recv_area,
        no_write: rng.bytes(SMALL_REGION),
        no_read: rng.bytes(SMALL_REGION),
        invalidatable,
    }
}

/// The remote reference of a negative operation.
fn negative_ref(rng: &mut SimRng, negative: Negative, op: &PlannedOp, base_len: usize) -> RemoteRef {
    let aligned_in = |rng: &mut SimRng, region_len: usize| rng.range_usize(0, (region_len - 8) / 8) * 8;
    let mut reference =
        RemoteRef { region: RemoteRegion::Target, offset: RemoteOffset::At(0), bad_rkey: false };
    match negative {
        Negative::BadRkey => {
            reference.bad_rkey = true;
            reference.offset = RemoteOffset::At(aligned_in(rng, base_len - op.len.max(8)));
        }
        Negative::OutOfBounds => {
            reference.offset = if rng.chance(0.5) {
                // Atomics lie wholly past the end so that they stay aligned.
                let overhang = if op.kind.is_atomic() { 8 } else { rng.range_usize(1, op.len - 1) };
                RemoteOffset::PastEnd { overhang }
            } else {
                RemoteOffset::BeforeStart(8 * rng.range_usize(1, 8))
            };
        }
        Negative::NoPermission => {
            reference.region = if op.kind.writes_remote() && !op.kind.is_atomic() {
                RemoteRegion::NoWrite
            } else {
                RemoteRegion::NoRead
            };
            reference.offset = RemoteOffset::At(aligned_in(rng, SMALL_REGION - op.len.max(8) + 8));
        }
        Negative::MisalignedAtomic => {
            reference.offset = RemoteOffset::At(aligned_in(rng, base_len) + rng.range_usize(1, 7));
        }
    }
    reference
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SimConfig {
        let mut config = SimConfig::default();
        config.workload.max_ops = 40;
        config.workload.negative = 0.5;
        config
    }

    #[test]
    fn generation_is_a_pure_function_of_the_seed() {
        let config = config();
        assert_eq!(Workload::generate(&config, 42), Workload::generate(&config, 42));
        assert_ne!(Workload::generate(&config, 42), Workload::generate(&config, 43));
    }

    #[test]
    fn writes_never_overlap_earlier_reads_and_buffers_fit() {
        let config = config();
        for seed in 0..200 {
            let workload = Workload::generate(&config, seed);
            for dir in &workload.directions {
                let mut reads: Vec<(usize, usize)> = Vec::new();
                for op in &dir.ops {
                    let Some(RemoteRef {
                        offset: RemoteOffset::At(offset),
                        region: RemoteRegion::Target,
                        ..
                    }) = op.remote
                    else {
                        continue;
                    };
                    if op.negative.is_some() {
                        continue;
                    }
                    assert!(offset + op.len <= dir.target.len(), "seed {seed}: target range past the end");
                    if op.kind == OpKind::Read {
                        reads.push((offset, offset + op.len));
                    } else {
                        assert!(!overlaps(&reads, offset, op.len), "seed {seed}: write over an earlier READ");
                    }
                    if op.kind.is_atomic() {
                        assert_eq!(offset % 8, 0);
                    }
                }
                for recv in &dir.recvs {
                    let op = &dir.ops[recv.op];
                    if op.kind != OpKind::WriteImm {
                        assert!(recv.capacity() >= op.len);
                    }
                }
                assert!(dir.recvs.windows(2).all(|w| w[0].post_at <= w[1].post_at));
                assert!(dir.ops.last().is_some_and(|op| op.signaled));
                assert!(dir.ops.iter().filter(|op| op.negative.is_some()).count() <= 1);
            }
        }
    }

    #[test]
    fn gathered_payloads_match_the_source_region() {
        let config = config();
        let workload = Workload::generate(&config, 9);
        for dir in &workload.directions {
            for op in &dir.ops {
                if let Some(Payload::Gather(spans)) = &op.payload {
                    assert_eq!(gather(&dir.src, spans), op.data);
                    assert_eq!(op.data.len(), op.len);
                }
            }
        }
    }
}
