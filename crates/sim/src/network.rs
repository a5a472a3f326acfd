//! The simulated network: endpoints identified by IP address, one link (a [`LinkConfig`]) per ordered pair of
//! endpoints, and the datagrams in flight ordered by arrival time.
//!
//! The network never calls an endpoint; the driver hands it datagrams with [`Network::send`]
//! and collects them with [`Network::pop_due`] in arrival order (ties broken by send order), so
//! a run is a pure function of its seed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::IpAddr;

use serde::Serialize;

use lightpath_wire::Endpoints;

use crate::faults::ScriptedFault;
use crate::link::{DropReason, Link, LinkConfig, Verdict};
use crate::rng::SimRng;
use crate::time::SimTime;
use crate::trace::{summarize, TraceEvent, TraceKind};

/// UDP header bytes, counted against the link MTU.
const UDP_HEADER: usize = 8;
/// The RoCE v2 UDP destination port, every datagram's.
const ROCE_PORT: u16 = 4791;

/// Counters of what the network did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NetStats {
    /// Datagrams handed to the network.
    pub sent: u64,
    /// Datagrams (including duplicates) given to an endpoint.
    pub delivered: u64,
    /// Datagrams lost at random.
    pub dropped_loss: u64,
    /// Datagrams dropped for exceeding the link MTU.
    pub dropped_mtu: u64,
    /// Datagrams dropped by a scripted fault.
    pub dropped_scripted: u64,
    /// Datagrams dropped by a partition.
    pub dropped_partition: u64,
    /// Datagrams from or to a killed endpoint.
    pub dropped_dead: u64,
    /// Datagrams to an address no endpoint has.
    pub dropped_no_route: u64,
    /// Extra copies scheduled.
    pub duplicated: u64,
    /// Datagrams damaged on the way.
    pub corrupted: u64,
    /// Datagrams held back so that later ones overtook them.
    pub reordered: u64,
}

impl NetStats {
    /// Every datagram the network dropped, for whatever reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss
            + self.dropped_mtu
            + self.dropped_scripted
            + self.dropped_partition
            + self.dropped_dead
            + self.dropped_no_route
    }

    fn count_drop(&mut self, reason: DropReason) {
        let counter = match reason {
            DropReason::Loss => &mut self.dropped_loss,
            DropReason::Mtu => &mut self.dropped_mtu,
            DropReason::Scripted => &mut self.dropped_scripted,
            DropReason::Partition => &mut self.dropped_partition,
            DropReason::Dead => &mut self.dropped_dead,
            DropReason::NoRoute => &mut self.dropped_no_route,
        };
        *counter += 1;
    }
}

/// A datagram arriving at an endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// Arrival time.
    pub at: SimTime,
    /// Index of the sending node.
    pub from: usize,
    /// Index of the receiving node.
    pub to: usize,
    /// Source IP address (the sender's).
    pub src_ip: IpAddr,
    /// Destination IP address (the receiver's).
    pub dst_ip: IpAddr,
    /// UDP source port chosen by the sender.
    pub src_port: u16,
    /// The UDP payload.
    pub bytes: Vec<u8>,
    /// Whether the network damaged it on the way (anywhere but the BTH's reserved byte,
    /// which the ICRC does not cover and the receiver ignores).
    pub corrupted: bool,
}

/// A datagram on its way, ordered by (arrival, send sequence).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: SimTime,
    seq: u64,
    from: usize,
    to: usize,
    src_port: u16,
    bytes: Vec<u8>,
    corrupted: bool,
}

/// The network connecting a fixed set of endpoints.
#[derive(Debug)]
pub struct Network {
    addresses: Vec<IpAddr>,
    /// `links[from * n + to]`.
    links: Vec<Link>,
    in_flight: BinaryHeap<Reverse<InFlight>>,
    next_seq: u64,
    scripted: Vec<ScriptedFault>,
    stats: NetStats,
    trace: Option<Vec<TraceEvent>>,
}

impl Network {
    /// A network of endpoints at `addresses`, every link direction configured as `link` and
    /// driven by its own random stream derived from `seed`.
    pub fn new(seed: u64, addresses: Vec<IpAddr>, link: &LinkConfig, scripted: Vec<ScriptedFault>) -> Self {
        let n = addresses.len();
        let links = (0..n * n)
            .map(|index| Link::new(link.clone(), SimRng::stream(seed, 0x11_4E00 + index as u64)))
            .collect();
        Self {
            addresses,
            links,
            in_flight: BinaryHeap::new(),
            next_seq: 0,
            scripted,
            stats: NetStats::default(),
            trace: None,
        }
    }

    /// Starts recording a trace of every datagram.
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// Replaces the configuration of the link direction `from → to` (e.g. an asymmetric loss).
    pub fn set_link(&mut self, from: usize, to: usize, config: LinkConfig) {
        let n = self.addresses.len();
        if let Some(link) = self.links.get_mut(from * n + to) {
            link.config = config;
        }
    }

    /// The address of node `node`.
    pub fn address(&self, node: usize) -> Option<IpAddr> {
        self.addresses.get(node).copied()
    }

    /// The node that owns `ip`.
    pub fn node_of(&self, ip: IpAddr) -> Option<usize> {
        self.addresses.iter().position(|a| *a == ip)
    }

    /// Whether `node` is still alive at `now` (not killed by a scripted fault).
    pub fn is_alive(&self, node: usize, now: SimTime) -> bool {
        !self.scripted.iter().any(|f| f.kills(node, now))
    }

    /// Counters so far.
    pub fn stats(&self) -> &NetStats {
        &self.stats
    }

    /// Datagrams currently on their way.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Arrival time of the next datagram, if any.
    pub fn next_arrival(&self) -> Option<SimTime> {
        self.in_flight.peek().map(|Reverse(d)| d.at)
    }

    /// The recorded trace (empty unless [`Network::enable_trace`] was called).
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Node `from` sends `bytes` (a UDP payload) to `dst` at `now`.
    pub fn send(&mut self, now: SimTime, from: usize, dst: IpAddr, src_port: u16, bytes: &[u8]) {
        self.stats.sent += 1;
        let to = self.node_of(dst);
        self.record(now, from, to.unwrap_or(usize::MAX), TraceKind::Sent, src_port, bytes);
        let Some(to) = to else {
            return self.drop_datagram(now, from, usize::MAX, DropReason::NoRoute, src_port, bytes);
        };
        if !self.is_alive(from, now) || !self.is_alive(to, now) {
            return self.drop_datagram(now, from, to, DropReason::Dead, src_port, bytes);
        }
        let n = self.addresses.len();
        let Some(link) = self.links.get_mut(from * n + to) else {
            return self.drop_datagram(now, from, to, DropReason::NoRoute, src_port, bytes);
        };
        let index = link.offered;
        link.offered += 1;
        let scripted_drop = self.scripted.iter().find_map(|fault| {
            let reason = match fault {
                ScriptedFault::Partition { .. } => DropReason::Partition,
                _ => DropReason::Scripted,
            };
            fault.drops(from, to, now, index).then_some(reason)
        });
        if let Some(reason) = scripted_drop {
            return self.drop_datagram(now, from, to, reason, src_port, bytes);
        }
        let ip_header = if dst.is_ipv4() { 20 } else { 40 };
        let wire_len = ip_header + UDP_HEADER + bytes.len();
        let mut owned = bytes.to_vec();
        match link.carry(now, wire_len, &mut owned) {
            Verdict::Drop(reason) => self.drop_datagram(now, from, to, reason, src_port, bytes),
            Verdict::Deliver { arrival, duplicate_arrival, corrupted, reordered } => {
                if corrupted {
                    self.stats.corrupted += 1;
                    self.record(now, from, to, TraceKind::Corrupted, src_port, &owned);
                }
                // Byte 4 of the BTH (reserved) is masked out of the ICRC and ignored by the
                // receiver: damage confined to it is undetectable and harmless.
                let corrupted = corrupted
                    && owned.iter().zip(bytes).enumerate().any(|(i, (new, old))| i != 4 && new != old);
                if reordered {
                    self.stats.reordered += 1;
                    self.record(now, from, to, TraceKind::Reordered, src_port, &owned);
                }
                if let Some(again) = duplicate_arrival {
                    self.stats.duplicated += 1;
                    self.record(now, from, to, TraceKind::Duplicated, src_port, &owned);
                    self.enqueue(again, from, to, src_port, owned.clone(), corrupted);
                }
                self.enqueue(arrival, from, to, src_port, owned, corrupted);
            }
        }
    }

    /// The earliest datagram due by `now`, if any. Datagrams whose destination died while they
    /// were on their way are dropped here.
    pub fn pop_due(&mut self, now: SimTime) -> Option<Delivery> {
        loop {
            let Reverse(head) = self.in_flight.peek()?;
            if head.at > now {
                return None;
            }
            let Reverse(datagram) = self.in_flight.pop()?;
            if !self.is_alive(datagram.to, datagram.at) {
                let bytes = datagram.bytes;
                let (at, from, to, port) = (datagram.at, datagram.from, datagram.to, datagram.src_port);
                self.drop_datagram(at, from, to, DropReason::Dead, port, &bytes);
                continue;
            }
            self.stats.delivered += 1;
            let (at, from, to, port) = (datagram.at, datagram.from, datagram.to, datagram.src_port);
            self.record(at, from, to, TraceKind::Delivered, port, &datagram.bytes);
            let (Some(src_ip), Some(dst_ip)) = (self.address(datagram.from), self.address(datagram.to))
            else {
                continue;
            };
            return Some(Delivery {
                at: datagram.at,
                from: datagram.from,
                to: datagram.to,
                src_ip,
                dst_ip,
                src_port: datagram.src_port,
                bytes: datagram.bytes,
                corrupted: datagram.corrupted,
            });
        }
    }

    fn enqueue(
        &mut self,
        at: SimTime,
        from: usize,
        to: usize,
        src_port: u16,
        bytes: Vec<u8>,
        corrupted: bool,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.in_flight.push(Reverse(InFlight { at, seq, from, to, src_port, bytes, corrupted }));
    }

    fn drop_datagram(
        &mut self,
        now: SimTime,
        from: usize,
        to: usize,
        reason: DropReason,
        src_port: u16,
        bytes: &[u8],
    ) {
        self.stats.count_drop(reason);
        self.record(now, from, to, TraceKind::Dropped(reason), src_port, bytes);
    }

    fn record(&mut self, at: SimTime, from: usize, to: usize, kind: TraceKind, src_port: u16, bytes: &[u8]) {
        if self.trace.is_none() {
            return;
        }
        let endpoints = match (self.address(from), self.address(to)) {
            (Some(src), Some(dst)) => Some(Endpoints { src, dst, src_port, dst_port: ROCE_PORT }),
            _ => None,
        };
        let summary = summarize(bytes, endpoints.as_ref());
        if let Some(trace) = self.trace.as_mut() {
            trace.push(TraceEvent { at, from, to, kind, summary });
        }
    }
}
