//! The driver: builds one engine per node, registers the workload's regions, connects the
//! queue pairs, then steps engines and network in virtual time until every work request has
//! finished (or the run hangs), and records what it observed.
//!
//! Stepping follows the sans-I/O contract: after any call that may produce output the driver
//! drains `poll_transmit` (with a `receive_batch` interval, only after handing over every
//! datagram that arrived in the interval, as a driver reading with `recvmmsg` does), and it
//! calls `handle_timeout` when `poll_timeout` says so. Events at the same virtual time are processed in a fixed order (posts, then
//! arrivals in arrival order, then timers by node index), so a run is deterministic.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use lightpath_roce::{CqHandle, Engine, EngineConfig, EngineStats, MrKeys, RegionMemory, Time, MAX_DATAGRAM};
use lightpath_verbs::{
    AccessFlags, AddressVector, Gid, QpAttr, QpCaps, QpState, RecvWr, SendFlags, SendOp, SendPayload, SendWr,
    Sge, WorkCompletion,
};

use crate::config::SimConfig;
use crate::memory::GuardedMemory;
use crate::network::{NetStats, Network};
use crate::op::OpKind;
use crate::rng::SimRng;
use crate::time::SimTime;
use crate::trace::TraceEvent;
use crate::workload::{Payload, PlannedOp, RemoteOffset, RemoteRegion, Span, Workload};

/// Label of the driver's random stream (region addresses).
const DRIVER_STREAM: u64 = 0x4452_4956;

/// A region as registered with an engine.
#[derive(Clone, Debug)]
pub struct Region {
    /// Its memory (with guards).
    pub memory: Arc<GuardedMemory>,
    /// The virtual address it was registered at.
    pub addr: u64,
    /// Its keys.
    pub keys: MrKeys,
}

impl Region {
    fn sges(&self, spans: &[Span]) -> Vec<Sge> {
        spans
            .iter()
            .map(|s| Sge { addr: self.addr + s.offset as u64, length: s.len as u32, lkey: self.keys.lkey })
            .collect()
    }
}

/// The regions of one direction.
#[derive(Clone, Debug)]
pub struct DirectionRegions {
    /// Requester: payload source.
    pub src: Region,
    /// Requester: READ/atomic destination.
    pub sink: Region,
    /// Responder: WRITE/READ/atomic target.
    pub target: Region,
    /// Responder: receive buffers.
    pub recv_area: Region,
    /// Responder: no remote write.
    pub no_write: Region,
    /// Responder: no remote read/atomic.
    pub no_read: Region,
    /// Responder: regions SENDs with invalidate name.
    pub invalidatable: Vec<Region>,
}

/// A post call the engine refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The error, formatted.
    pub error: String,
    /// The QP's state at the time (if the engine could tell).
    pub qp_state: Option<QpState>,
}

/// What the driver saw of one direction.
#[derive(Clone, Debug, Default)]
pub struct DirectionObservation {
    /// The requester's QP number.
    pub requester_qpn: u32,
    /// The responder's QP number.
    pub responder_qpn: u32,
    /// Completions from the requester's send CQ, in the order polled.
    pub send_wcs: Vec<WorkCompletion>,
    /// Completions from the responder's receive CQ, in the order polled.
    pub recv_wcs: Vec<WorkCompletion>,
    /// Per operation: whether it was handed to `post_send`.
    pub posted: Vec<bool>,
    /// Per operation: the refusal, if `post_send` refused it.
    pub refused: Vec<Option<Refusal>>,
    /// Per receive: whether it was handed to `post_recv`.
    pub recvs_posted: Vec<bool>,
    /// Per receive: the refusal, if `post_recv` refused it.
    pub recv_refused: Vec<Option<Refusal>>,
    /// Final QP states (requester, responder), when the node is alive.
    pub final_states: (Option<QpState>, Option<QpState>),
    /// The rkey each SEND with invalidate named, by invalidatable-region index.
    pub invalidated_rkeys: Vec<u32>,
    /// The regions (present once setup succeeded).
    pub regions: Option<DirectionRegions>,
}

/// Everything a run produced.
#[derive(Debug, Default)]
pub struct Observation {
    /// Per direction.
    pub directions: Vec<DirectionObservation>,
    /// Why the run could not finish normally (setup error, hang, panic), if it did not.
    pub abort: Option<String>,
    /// Virtual time when all work had finished (or the run stopped).
    pub finished_at: SimTime,
    /// Whether each node was alive at the end.
    pub alive: Vec<bool>,
    /// Engine counters per node.
    pub engine_stats: Vec<EngineStats>,
    /// Network counters.
    pub net: NetStats,
    /// The datagram trace (when enabled).
    pub trace: Vec<TraceEvent>,
    /// Driver steps taken.
    pub steps: u64,
    /// Damaged datagrams an engine processed instead of dropping (sender, receiver). Over
    /// IPv4 the ICRC check cannot see the IP ID and flags, so about 2^-15 of corruptions pass
    /// it (see the architecture notes); what such a datagram does is beyond any model.
    pub undetected_corruption: Vec<(usize, usize)>,
}

/// Something the driver does at a scheduled virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Action {
    PostRecv { direction: usize, index: usize },
    PostSend { direction: usize, index: usize },
}

fn node_address(node: usize, ipv6: bool) -> IpAddr {
    let low = u16::try_from(node + 1).unwrap_or(u16::MAX);
    if ipv6 {
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, low))
    } else {
        IpAddr::V4(Ipv4Addr::new(10, 77, (low >> 8) as u8, low as u8))
    }
}

fn now_engine(now: SimTime) -> Time {
    Time::from_nanos(now.as_nanos())
}

/// Per-node setup: hands out region addresses.
struct NodeSetup {
    next_addr: u64,
}

struct Runner<'a> {
    config: &'a SimConfig,
    workload: &'a Workload,
    engines: Vec<Engine>,
    network: Network,
    obs: Observation,
    /// (send CQ of the requester, receive CQ of the responder) per direction.
    cqs: Vec<(CqHandle, CqHandle)>,
    actions: Vec<(SimTime, Action)>,
    next_action: usize,
    buf: Vec<u8>,
    wcs: Vec<WorkCompletion>,
}

/// Runs `workload` under `config` and reports what happened. `seed` selects the network's and
/// the driver's random streams.
pub fn drive(config: &SimConfig, workload: &Workload, seed: u64) -> Observation {
    let addresses: Vec<IpAddr> = (0..config.nodes).map(|n| node_address(n, workload.ipv6)).collect();
    let mut network = Network::new(seed, addresses.clone(), &config.link, config.scripted.clone());
    if config.trace {
        network.enable_trace();
    }
    let engines = addresses.iter().map(|ip| Engine::new(EngineConfig::new(Gid::from_ip(*ip)))).collect();
    let mut runner = Runner {
        config,
        workload,
        engines,
        network,
        obs: Observation::default(),
        cqs: Vec::new(),
        actions: Vec::new(),
        next_action: 0,
        buf: vec![0; MAX_DATAGRAM],
        wcs: vec![
            WorkCompletion::new(
                0,
                lightpath_verbs::WcStatus::Success,
                lightpath_verbs::WcOpcode::Send,
                0
            );
            64
        ],
    };
    match runner.setup(seed) {
        Ok(()) => runner.run(),
        Err(reason) => runner.obs.abort = Some(format!("setup failed: {reason}")),
    }
    runner.finish()
}

impl Runner<'_> {
    fn setup(&mut self, seed: u64) -> Result<(), String> {
        let mut rng = SimRng::stream(seed, DRIVER_STREAM);
        let mut nodes: Vec<NodeSetup> = (0..self.config.nodes)
            .map(|n| NodeSetup { next_addr: 0x0010_0000_0000 * (n as u64 + 1) })
            .collect();
        let all_remote = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC;

        // Regions, per direction.
        for dir in &self.workload.directions {
            let (req, resp) = (dir.requester, dir.responder);
            let mut reg = |node: usize, contents: &[u8], access: AccessFlags| -> Result<Region, String> {
                let setup = &mut nodes[node];
                // 8-aligned so atomics can be aligned, at a varying offset within a page.
                let addr = setup.next_addr + 8 * rng.range_u64(0, 511);
                setup.next_addr = (addr + contents.len() as u64 + 8192) & !4095;
                let memory = Arc::new(GuardedMemory::new(contents));
                let shared: Arc<dyn RegionMemory> = memory.clone();
                let keys = self.engines[node]
                    .reg_mr(shared, addr, access)
                    .map_err(|e| format!("reg_mr on node {node} ({} bytes): {e}", contents.len()))?;
                Ok(Region { memory, addr, keys })
            };
            let regions = DirectionRegions {
                src: reg(req, &dir.src, AccessFlags::LOCAL_WRITE)?,
                sink: reg(req, &dir.sink, AccessFlags::LOCAL_WRITE)?,
                target: reg(resp, &dir.target, all_remote)?,
                recv_area: reg(resp, &dir.recv_area, AccessFlags::LOCAL_WRITE)?,
                no_write: reg(resp, &dir.no_write, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?,
                no_read: reg(resp, &dir.no_read, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?,
                invalidatable: dir
                    .invalidatable
                    .iter()
                    .map(|contents| {
                        reg(
                            resp,
                            contents,
                            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
                        )
                    })
                    .collect::<Result<_, _>>()?,
            };
            let observation = DirectionObservation {
                posted: vec![false; dir.ops.len()],
                refused: vec![None; dir.ops.len()],
                recvs_posted: vec![false; dir.recvs.len()],
                recv_refused: vec![None; dir.recvs.len()],
                invalidated_rkeys: regions.invalidatable.iter().map(|r| r.keys.rkey).collect(),
                regions: Some(regions),
                ..DirectionObservation::default()
            };
            self.obs.directions.push(observation);
        }

        // Queue pairs: one per node per connection; direction 2c is a → b, 2c + 1 is b → a.
        let max_wr = (self.config.workload.max_ops as u32 + 8).max(16);
        let caps = QpCaps {
            max_send_wr: max_wr,
            max_recv_wr: max_wr,
            max_send_sge: self.config.qp.max_sge,
            max_recv_sge: self.config.qp.max_sge,
            max_inline_data: self.config.qp.max_inline_data,
        };
        for (c, conn) in self.workload.connections.iter().enumerate() {
            let mut qpns = [0u32; 2];
            let mut cq_pairs = [(CqHandle(0), CqHandle(0)); 2];
            for (side, node) in [conn.a, conn.b].into_iter().enumerate() {
                let engine = &mut self.engines[node];
                let send_cq =
                    engine.create_cq(4 * max_wr).map_err(|e| format!("create_cq on node {node}: {e}"))?;
                let recv_cq =
                    engine.create_cq(4 * max_wr).map_err(|e| format!("create_cq on node {node}: {e}"))?;
                qpns[side] = engine
                    .create_qp(send_cq, recv_cq, caps)
                    .map_err(|e| format!("create_qp on node {node}: {e}"))?;
                cq_pairs[side] = (send_cq, recv_cq);
            }
            let gids = [conn.a, conn.b]
                .map(|n| Gid::from_ip(self.network.address(n).unwrap_or(node_address(n, true))));
            for side in 0..2 {
                let node = if side == 0 { conn.a } else { conn.b };
                let peer = 1 - side;
                let outgoing = &self.workload.directions[2 * c + side];
                let incoming = &self.workload.directions[2 * c + peer];
                let qp = &self.config.qp;
                let mut rtr =
                    QpAttr::to_rtr(AddressVector::new(gids[peer], 0), conn.mtu, qpns[peer], incoming.sq_psn);
                rtr.max_dest_rd_atomic = Some(incoming.max_dest_rd_atomic);
                rtr.min_rnr_timer = Some(qp.min_rnr_timer);
                let mut rts = QpAttr::to_rts(outgoing.sq_psn);
                rts.timeout = Some(qp.timeout);
                rts.retry_cnt = Some(qp.retry_cnt);
                rts.rnr_retry = Some(qp.rnr_retry);
                rts.max_rd_atomic = Some(outgoing.max_rd_atomic);
                let engine = &mut self.engines[node];
                for attr in [QpAttr::to_init(all_remote), rtr, rts] {
                    engine
                        .modify_qp(Time::ZERO, qpns[side], &attr)
                        .map_err(|e| format!("modify_qp to {:?} on node {node}: {e}", attr.state))?;
                }
            }
            for side in 0..2 {
                let d = 2 * c + side;
                self.obs.directions[d].requester_qpn = qpns[side];
                self.obs.directions[d].responder_qpn = qpns[1 - side];
            }
            self.cqs.push((cq_pairs[0].0, cq_pairs[1].1));
            self.cqs.push((cq_pairs[1].0, cq_pairs[0].1));
        }

        // The schedule: receives first at equal times, so "posted at 0" means before any SEND.
        for (d, dir) in self.workload.directions.iter().enumerate() {
            for (index, recv) in dir.recvs.iter().enumerate() {
                self.actions.push((recv.post_at, Action::PostRecv { direction: d, index }));
            }
            for op in &dir.ops {
                self.actions.push((op.post_at, Action::PostSend { direction: d, index: op.index }));
            }
        }
        self.actions.sort();
        Ok(())
    }

    /// When the driver hands over a datagram that arrives at `at`: at once, or at the end of
    /// the receive-batch interval it falls into.
    fn receive_time(&self, at: SimTime) -> SimTime {
        let quantum = u64::try_from(self.config.receive_batch.as_nanos()).unwrap_or(u64::MAX);
        if quantum == 0 {
            return at;
        }
        SimTime::from_nanos(at.as_nanos().div_ceil(quantum).saturating_mul(quantum))
    }

    fn alive(&self, node: usize, now: SimTime) -> bool {
        self.network.is_alive(node, now)
    }

    /// Hands every datagram a node wants to send to the network.
    fn flush(&mut self, node: usize, now: SimTime) {
        let engine = &mut self.engines[node];
        while let Some(transmit) = engine.poll_transmit(now_engine(now), &mut self.buf) {
            let len = transmit.len.min(self.buf.len());
            self.network.send(now, node, transmit.dst, transmit.src_port, &self.buf[..len]);
        }
        while engine.poll_event().is_some() {}
    }

    fn poll_completions(&mut self) {
        for (d, &(send_cq, recv_cq)) in self.cqs.iter().enumerate() {
            let dir = &self.workload.directions[d];
            for (node, cq, is_send) in [(dir.requester, send_cq, true), (dir.responder, recv_cq, false)] {
                loop {
                    let n = self.engines[node].poll_cq(cq, &mut self.wcs).min(self.wcs.len());
                    let target = &mut self.obs.directions[d];
                    let list = if is_send { &mut target.send_wcs } else { &mut target.recv_wcs };
                    list.extend_from_slice(&self.wcs[..n]);
                    if n < self.wcs.len() {
                        break;
                    }
                }
            }
        }
    }

    fn perform(&mut self, action: Action, now: SimTime) {
        match action {
            Action::PostRecv { direction, index } => {
                let workload = self.workload;
                let dir = &workload.directions[direction];
                if !self.alive(dir.responder, now) {
                    return;
                }
                let obs = &mut self.obs.directions[direction];
                let Some(regions) = obs.regions.as_ref() else { return };
                let sges = regions.recv_area.sges(&dir.recvs[index].sges);
                let wr = RecvWr::new(recv_wr_id(direction, index), &sges);
                let qpn = obs.responder_qpn;
                obs.recvs_posted[index] = true;
                let engine = &mut self.engines[dir.responder];
                if let Err(e) = engine.post_recv(qpn, &wr) {
                    obs.recv_refused[index] =
                        Some(Refusal { error: e.to_string(), qp_state: engine.qp_state(qpn).ok() });
                }
                self.flush(dir.responder, now);
            }
            Action::PostSend { direction, index } => {
                let workload = self.workload;
                let dir = &workload.directions[direction];
                if !self.alive(dir.requester, now) {
                    return;
                }
                let op = &dir.ops[index];
                let bad_rkey = match op.remote {
                    Some(remote) if remote.bad_rkey => {
                        bad_rkey_for(&self.obs.directions, dir.responder, workload)
                    }
                    _ => 0,
                };
                let obs = &mut self.obs.directions[direction];
                let Some(regions) = obs.regions.as_ref() else { return };
                let engine = &mut self.engines[dir.requester];
                let result = post_op(engine, now, obs.requester_qpn, direction, op, regions, bad_rkey);
                obs.posted[index] = true;
                if let Err(refusal) = result {
                    obs.refused[index] = Some(refusal);
                }
                self.flush(dir.requester, now);
            }
        }
    }

    /// Whether every scheduled post happened and every live requester's last accepted
    /// operation has a completion (completions are in order, so all earlier ones are done).
    fn work_done(&self, now: SimTime) -> bool {
        if self.next_action < self.actions.len() {
            return false;
        }
        self.workload.directions.iter().zip(&self.obs.directions).enumerate().all(|(d, (dir, obs))| {
            if !self.alive(dir.requester, now) {
                return true;
            }
            let last_accepted = (0..dir.ops.len()).rev().find(|&i| obs.posted[i] && obs.refused[i].is_none());
            match last_accepted {
                None => true,
                Some(i) => {
                    let id = send_wr_id(d, i);
                    obs.send_wcs.iter().any(|wc| wc.wr_id == id)
                }
            }
        })
    }

    fn run(&mut self) {
        let mut now = SimTime::ZERO;
        let mut drain_until: Option<SimTime> = None;
        let hard_stop = SimTime::ZERO + self.config.max_virtual_time;
        loop {
            self.obs.steps += 1;
            if self.obs.steps > self.config.max_steps {
                self.obs.abort = Some(format!(
                    "hang: more than {} driver steps (livelock?) at {now}",
                    self.config.max_steps
                ));
                break;
            }
            self.poll_completions();
            if drain_until.is_none() && self.work_done(now) {
                self.obs.finished_at = now;
                drain_until = Some(now + self.config.drain);
            }
            let timers = (0..self.engines.len())
                .filter(|&n| self.alive(n, now))
                .filter_map(|n| self.engines[n].poll_timeout())
                .map(|t| SimTime::from_nanos(t.as_nanos()))
                .min();
            let next_action = self.actions.get(self.next_action).map(|(t, _)| *t);
            let arrival = self.network.next_arrival().map(|at| self.receive_time(at));
            let next = [arrival, timers, next_action].into_iter().flatten().min();
            let Some(next) = next else {
                if drain_until.is_none() {
                    self.obs.finished_at = now;
                    self.obs.abort = Some(format!(
                        "hang: nothing in flight and no timer armed at {now}, but work requests are unfinished"
                    ));
                }
                break;
            };
            if let Some(end) = drain_until {
                if next > end {
                    if self.network.in_flight() > 0 {
                        self.obs.abort = Some(format!(
                            "no quiescence: {} datagrams still in flight {:?} after all work finished",
                            self.network.in_flight(),
                            self.config.drain
                        ));
                    }
                    break;
                }
            }
            if next > hard_stop {
                self.obs.finished_at = now;
                self.obs.abort = Some(format!(
                    "hang: work requests unfinished at the virtual-time bound ({:?})",
                    self.config.max_virtual_time
                ));
                break;
            }
            now = next.max(now);
            while let Some(&(at, action)) = self.actions.get(self.next_action) {
                if at > now {
                    break;
                }
                self.next_action += 1;
                self.perform(action, now);
            }
            let mut received = Vec::new();
            while let Some(delivery) = self.network.pop_due(now) {
                let engine = &mut self.engines[delivery.to];
                let drops_before = engine.stats().total_drops();
                engine.handle_datagram(
                    now_engine(now),
                    delivery.src_ip,
                    delivery.dst_ip,
                    delivery.src_port,
                    &delivery.bytes,
                );
                if delivery.corrupted && engine.stats().total_drops() == drops_before {
                    self.obs.undetected_corruption.push((delivery.from, delivery.to));
                }
                if self.config.receive_batch.is_zero() {
                    self.flush(delivery.to, now);
                } else if !received.contains(&delivery.to) {
                    received.push(delivery.to);
                }
            }
            received.sort_unstable();
            for node in received {
                self.flush(node, now);
            }
            for node in 0..self.engines.len() {
                if !self.alive(node, now) {
                    continue;
                }
                let due = self.engines[node].poll_timeout().is_some_and(|t| t.as_nanos() <= now.as_nanos());
                if due {
                    self.engines[node].handle_timeout(now_engine(now));
                    self.flush(node, now);
                }
            }
        }
        self.poll_completions();
        if drain_until.is_none() && self.obs.abort.is_none() {
            self.obs.finished_at = now;
        }
        let end = now;
        for (dir, obs) in self.workload.directions.iter().zip(self.obs.directions.iter_mut()) {
            let state = |node: usize, qpn: u32| {
                self.network.is_alive(node, end).then(|| self.engines[node].qp_state(qpn).ok()).flatten()
            };
            obs.final_states =
                (state(dir.requester, obs.requester_qpn), state(dir.responder, obs.responder_qpn));
        }
        self.obs.alive = (0..self.engines.len()).map(|n| self.network.is_alive(n, end)).collect();
    }

    fn finish(mut self) -> Observation {
        self.obs.engine_stats = self.engines.iter().map(|e| e.stats().clone()).collect();
        self.obs.net = self.network.stats().clone();
        self.obs.trace = self.network.take_trace();
        self.obs
    }
}

/// The `wr_id` of send operation `index` of direction `direction`.
pub fn send_wr_id(direction: usize, index: usize) -> u64 {
    ((direction as u64) << 32) | index as u64
}

/// The `wr_id` of receive `index` of direction `direction`.
pub fn recv_wr_id(direction: usize, index: usize) -> u64 {
    (1 << 63) | ((direction as u64) << 32) | index as u64
}

/// An rkey that no region of `node` has.
fn bad_rkey_for(directions: &[DirectionObservation], node: usize, workload: &Workload) -> u32 {
    let mut issued = HashSet::new();
    for (dir, obs) in workload.directions.iter().zip(directions) {
        let Some(r) = obs.regions.as_ref() else { continue };
        if dir.responder == node {
            for region in
                [&r.target, &r.recv_area, &r.no_write, &r.no_read].into_iter().chain(&r.invalidatable)
            {
                issued.insert(region.keys.rkey);
            }
        }
        if dir.requester == node {
            issued.insert(r.src.keys.rkey);
            issued.insert(r.sink.keys.rkey);
        }
    }
    let mut candidate = 0x5EED_0BAD_u32;
    while issued.contains(&candidate) {
        candidate = candidate.wrapping_add(0x0101);
    }
    candidate
}

/// The remote address of `op`'s access.
fn remote_addr(op: &PlannedOp, regions: &DirectionRegions) -> Option<(u64, u32, bool)> {
    let remote = op.remote?;
    let region = match remote.region {
        RemoteRegion::Target => &regions.target,
        RemoteRegion::NoWrite => &regions.no_write,
        RemoteRegion::NoRead => &regions.no_read,
    };
    let len = region.memory.len() as u64;
    let addr = match remote.offset {
        RemoteOffset::At(offset) => region.addr + offset as u64,
        RemoteOffset::PastEnd { overhang } => {
            (region.addr + len + overhang as u64).wrapping_sub(op.len as u64)
        }
        RemoteOffset::BeforeStart(bytes) => region.addr.wrapping_sub(bytes as u64),
    };
    Some((addr, region.keys.rkey, remote.bad_rkey))
}

fn post_op(
    engine: &mut Engine,
    now: SimTime,
    qpn: u32,
    direction: usize,
    op: &PlannedOp,
    regions: &DirectionRegions,
    bad_rkey: u32,
) -> Result<(), Refusal> {
    let (remote_addr, rkey) = match remote_addr(op, regions) {
        Some((addr, rkey, bad)) => (addr, if bad { bad_rkey } else { rkey }),
        None => (0, 0),
    };
    let atomic = op.atomic.unwrap_or(crate::workload::AtomicArgs { compare: 0, operand: 0 });
    let send_op = match op.kind {
        OpKind::Send => SendOp::Send,
        OpKind::SendImm => SendOp::SendWithImm { imm: op.imm.unwrap_or(0) },
        OpKind::SendInv => SendOp::SendWithInv {
            rkey: op.invalidate.and_then(|i| regions.invalidatable.get(i)).map_or(0, |r| r.keys.rkey),
        },
        OpKind::Write => SendOp::Write { remote_addr, rkey },
        OpKind::WriteImm => SendOp::WriteWithImm { remote_addr, rkey, imm: op.imm.unwrap_or(0) },
        OpKind::Read => SendOp::Read { remote_addr, rkey },
        OpKind::CmpSwap => {
            SendOp::CompareSwap { remote_addr, rkey, compare: atomic.compare, swap: atomic.operand }
        }
        OpKind::FetchAdd => SendOp::FetchAdd { remote_addr, rkey, add: atomic.operand },
    };
    let sges: Vec<Sge> = match &op.payload {
        Some(Payload::Gather(spans)) => regions.src.sges(spans),
        Some(Payload::Inline) => Vec::new(),
        None => regions.sink.sges(&op.sink),
    };
    let mut flags = if op.signaled { SendFlags::SIGNALED } else { SendFlags::NONE };
    let payload = if op.payload == Some(Payload::Inline) {
        flags |= SendFlags::INLINE;
        SendPayload::Inline(&op.data)
    } else {
        SendPayload::Sges(&sges)
    };
    let wr = SendWr { wr_id: send_wr_id(direction, op.index), op: send_op, payload, flags };
    engine
        .post_send(now_engine(now), qpn, &wr)
        .map_err(|e| Refusal { error: e.to_string(), qp_state: engine.qp_state(qpn).ok() })
}
