//! The engine: one RoCE v2 device with one local address. It owns the memory-region table,
//! the completion queues and the queue pairs, routes received datagrams to queue pairs,
//! schedules transmissions round-robin across queue pairs, and keeps the timer heap.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use lightpath_verbs::{
    AccessFlags, Error, Gid, QpAttr, QpCaps, QpState, RecvWr, Result, SendWr, WorkCompletion,
};
use lightpath_wire::icrc::{self, Endpoints, Ipv4IdFlags};
use lightpath_wire::transport::ICRC_LEN;
use lightpath_wire::{BthPacket, BthRepr, Error as WireError, Opcode, Transport, TransportRepr};

use crate::config::EngineConfig;
use crate::cq::{CqHandle, CqTable};
use crate::event::{Ctx, EngineEvent, Transmit};
use crate::memory::{MrKeys, MrTable, RegionMemory};
use crate::qp::{Qp, QpTable};
use crate::stats::{EngineStats, QpStats};
use crate::time::Time;

/// Largest datagram the engine emits: BTH (12) + 28 bytes of extension headers + the largest
/// payload ([`MAX_LIGHTPATH_PMTU`](lightpath_verbs::MAX_LIGHTPATH_PMTU) between Lightpath soft
/// devices; 4096 towards anybody else) + 4 ICRC, and 4 spare.
pub const MAX_DATAGRAM: usize = lightpath_verbs::MAX_LIGHTPATH_PMTU as usize + 12 + 28 + 4 + 4;

/// Bytes of an RC Acknowledge datagram (BTH, AETH, ICRC): the head of an acknowledgement
/// bundle (see [`Engine::handle_datagram`]).
pub const ACK_DATAGRAM_LEN: usize = lightpath_wire::transport::ACK_PACKET_LEN;

/// A sans-I/O RoCE v2 RC transport engine. See the crate documentation for the contract.
pub struct Engine {
    config: EngineConfig,
    local_ip: IpAddr,
    stats: EngineStats,
    mrs: MrTable,
    cqs: CqTable,
    qps: QpTable,
    /// Queue pairs that may have a packet to send, served round-robin.
    ready: VecDeque<u32>,
    /// Queue pairs whose ACKs [`Engine::hold_answers`] held (entries may be stale: released
    /// since, or destroyed).
    held_answers: Vec<u32>,
    /// (deadline, QPN); entries may be stale (see `reschedule_timer`).
    timers: BinaryHeap<Reverse<(Time, u32)>>,
    events: VecDeque<EngineEvent>,
    /// Every completion also queues an [`EngineEvent::QpNews`] ([`Engine::set_qp_news`]).
    qp_news: bool,
    /// The last IPv4 datagram verified came with the IP header an `IP_PMTUDISC_DO` socket
    /// sends (ID 0, DF), so the next one is checked against that header first.
    expect_socket_default_ip_header: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("gid", &self.config.gid)
            .field("qps", &self.qps.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine with no resources yet.
    pub fn new(config: EngineConfig) -> Engine {
        Engine {
            local_ip: config.gid.to_ip(),
            stats: EngineStats::default(),
            mrs: MrTable::new(config.max_mrs),
            cqs: CqTable::new(config.max_cqs, config.max_cqe),
            qps: QpTable::new(config.max_qps),
            ready: VecDeque::new(),
            held_answers: Vec::new(),
            timers: BinaryHeap::new(),
            events: VecDeque::new(),
            qp_news: false,
            expect_socket_default_ip_header: true,
            config,
        }
    }

    /// The engine's address.
    pub fn gid(&self) -> Gid {
        self.config.gid
    }

    /// The configuration the engine was created with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// One queue pair's counters.
    pub fn qp_stats(&self, qpn: u32) -> Result<QpStats> {
        self.qps.get(qpn).map(|qp| qp.stats).ok_or(Error::NotFound("queue pair"))
    }

    fn ctx(&mut self) -> (&mut QpTable, Ctx<'_>) {
        (
            &mut self.qps,
            Ctx {
                gather: self.config.gather_payloads,
                mrs: &mut self.mrs,
                cqs: &mut self.cqs,
                stats: &mut self.stats,
                events: &mut self.events,
                qp_news: self.qp_news,
            },
        )
    }

    /// Whether every completion also queues an [`EngineEvent::QpNews`] naming its queue pair
    /// (off by default: a driver that wakes waiters per completion queue needs only
    /// [`EngineEvent::Completion`]).
    pub fn set_qp_news(&mut self, on: bool) {
        self.qp_news = on;
    }

    // ---- memory regions ----

    /// Registers `memory` as a region starting at virtual address `addr`.
    pub fn reg_mr(
        &mut self,
        memory: Arc<dyn RegionMemory>,
        addr: u64,
        access: AccessFlags,
    ) -> Result<MrKeys> {
        self.mrs.register(memory, addr, access)
    }

    /// Deregisters the region with local key `lkey`. Requests still using it fail with a
    /// protection error when they next touch it.
    pub fn dereg_mr(&mut self, lkey: u32) -> Result<()> {
        self.mrs.deregister(lkey)
    }

    // ---- completion queues ----

    /// Creates a completion queue holding up to `capacity` completions.
    pub fn create_cq(&mut self, capacity: u32) -> Result<CqHandle> {
        self.cqs.create(capacity)
    }

    /// Destroys a completion queue; `Busy` while a queue pair uses it.
    pub fn destroy_cq(&mut self, cq: CqHandle) -> Result<()> {
        self.cqs.destroy(cq)
    }

    /// Moves up to `out.len()` completions out of `cq`, oldest first.
    pub fn poll_cq(&mut self, cq: CqHandle, out: &mut [WorkCompletion]) -> usize {
        self.cqs.poll(cq, out)
    }

    /// Completions waiting in `cq` (0 for an unknown CQ).
    pub fn cq_len(&self, cq: CqHandle) -> usize {
        self.cqs.get(cq).map_or(0, |cq| cq.len())
    }

    // ---- queue pairs ----

    /// Creates an RC queue pair in RESET and returns its QPN.
    pub fn create_qp(&mut self, send_cq: CqHandle, recv_cq: CqHandle, caps: QpCaps) -> Result<u32> {
        if !self.cqs.exists(send_cq) || !self.cqs.exists(recv_cq) {
            return Err(Error::NotFound("completion queue"));
        }
        Qp::check_caps(&caps)?;
        let qpn = self.qps.allocate()?;
        self.qps.insert(Qp::new(qpn, send_cq, recv_cq, caps, self.local_ip));
        self.cqs.add_user(send_cq);
        self.cqs.add_user(recv_cq);
        Ok(qpn)
    }

    /// Changes a queue pair's state and attributes. (`now` is part of the sans-I/O contract;
    /// nothing in a transition needs the time today: timers are armed when `poll_transmit`
    /// sends.)
    pub fn modify_qp(&mut self, _now: Time, qpn: u32, attr: &QpAttr) -> Result<()> {
        let gid = self.config.gid;
        let (qps, mut ctx) = self.ctx();
        let qp = qps.get_mut(qpn).ok_or(Error::NotFound("queue pair"))?;
        let from = qp.state;
        qp.modify(&mut ctx, attr, gid)?;
        if qp.state != from {
            tracing::debug!(
                qpn,
                from = ?from,
                to = ?qp.state,
                dest_qpn = qp.params.dest_qpn,
                peer = %qp.params.peer_ip,
                pmtu = qp.params.pmtu,
                "queue pair state changed"
            );
        }
        self.after_qp_work(qpn);
        Ok(())
    }

    /// The queue pair's current state.
    pub fn qp_state(&self, qpn: u32) -> Result<QpState> {
        self.qps.get(qpn).map(|qp| qp.state).ok_or(Error::NotFound("queue pair"))
    }

    /// Destroys a queue pair. Outstanding work is discarded without completions.
    pub fn destroy_qp(&mut self, qpn: u32) -> Result<()> {
        let qp = self.qps.remove(qpn).ok_or(Error::NotFound("queue pair"))?;
        tracing::debug!(qpn, state = ?qp.state, stats = ?qp.stats, "queue pair destroyed");
        tracing::trace!(
            qpn,
            transport = ?qp.transport_state(),
            engine = ?self.stats,
            "queue pair destroyed: its transport state, and the engine's counters"
        );
        self.cqs.remove_user(qp.send_cq);
        self.cqs.remove_user(qp.recv_cq);
        self.tidy_timer_top();
        Ok(())
    }

    /// Posts a send work request. It goes out through `poll_transmit` (which arms the
    /// retransmit timer with its own `now`).
    pub fn post_send(&mut self, _now: Time, qpn: u32, wr: &SendWr<'_>) -> Result<()> {
        let (qps, mut ctx) = self.ctx();
        // (Not `ok_or`: the error would be built, and dropped, on every post.)
        let Some(qp) = qps.get_mut(qpn) else { return Err(Error::NotFound("queue pair")) };
        qp.post_send(&mut ctx, wr)?;
        self.after_qp_work(qpn);
        Ok(())
    }

    /// Posts a receive work request.
    pub fn post_recv(&mut self, qpn: u32, wr: &RecvWr<'_>) -> Result<()> {
        let (qps, mut ctx) = self.ctx();
        let Some(qp) = qps.get_mut(qpn) else { return Err(Error::NotFound("queue pair")) };
        qp.post_recv(&mut ctx, wr)
    }

    // ---- the sans-I/O surface ----

    /// A UDP payload (BTH … ICRC) arrived from IP `from` (UDP source port `src_port`) to the
    /// local IP `to`. Every datagram is either processed or counted as one kind of drop.
    ///
    /// An *acknowledgement bundle* is a datagram that starts with an RC Acknowledge of
    /// [`ACK_DATAGRAM_LEN`] bytes and goes on with a second packet (a request, or another
    /// response): a Lightpath soft peer sends the acknowledgement of this side's last message
    /// with its own next one (address vector `lightpath_bundles`). It is taken apart here and
    /// each packet handled as if it had come alone (both are counted in `rx_datagrams`, the
    /// bundle in `rx_bundles`), but only when the acknowledgement names a queue pair whose
    /// peer is a Lightpath soft device (`lightpath_peer`); towards anybody else such a
    /// datagram is a malformed acknowledgement, as before.
    pub fn handle_datagram(&mut self, now: Time, from: IpAddr, to: IpAddr, src_port: u16, datagram: &[u8]) {
        if let Some((ack, rest)) = self.split_bundle(datagram) {
            self.stats.rx_bundles += 1;
            // The packet behind the acknowledgement first: it is what the application waits
            // for (the sender puts requests before responses for the same reason).
            self.handle_packet(now, from, to, src_port, rest);
            self.handle_packet(now, from, to, src_port, ack);
        } else {
            self.handle_packet(now, from, to, src_port, datagram);
        }
    }

    /// The acknowledgement and the rest, if `datagram` is a bundle from a Lightpath peer.
    fn split_bundle<'a>(&self, datagram: &'a [u8]) -> Option<(&'a [u8], &'a [u8])> {
        if datagram.len() <= ACK_DATAGRAM_LEN || datagram[0] != Opcode::RC_ACKNOWLEDGE.0 {
            return None;
        }
        let qpn = BthPacket::new_checked(datagram).ok()?.dest_qpn();
        self.qps.get(qpn).filter(|qp| qp.params.lightpath_peer)?;
        Some(datagram.split_at(ACK_DATAGRAM_LEN))
    }

    /// One packet: a datagram, or one of a bundle's two.
    fn handle_packet(&mut self, now: Time, from: IpAddr, to: IpAddr, src_port: u16, datagram: &[u8]) {
        self.stats.rx_datagrams += 1;
        self.stats.rx_bytes += datagram.len() as u64;
        let repr = match TransportRepr::parse(datagram) {
            Ok(repr) => repr,
            Err(WireError::UnknownOpcode(_)) => {
                self.stats.drops_unsupported += 1;
                return;
            }
            Err(_) => {
                self.stats.drops_malformed += 1;
                return;
            }
        };
        let bth = repr.header.bth;
        let info = match bth.opcode.info() {
            Some(info) if bth.opcode.transport() == Transport::Rc => info,
            _ => {
                self.stats.drops_unsupported += 1;
                return;
            }
        };
        // P_Key: the low 15 bits must be the default partition (rxe).
        if bth.pkey & 0x7FFF != 0x7FFF {
            self.stats.drops_malformed += 1;
            return;
        }
        if to != self.local_ip {
            self.stats.drops_wrong_peer += 1;
            return;
        }
        let Some(qp) = self.qps.get(bth.dest_qpn) else {
            self.stats.drops_unknown_qp += 1;
            return;
        };
        let accepted = if info.is_request() {
            matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
        } else {
            matches!(qp.state, QpState::Rts | QpState::Sqd)
        };
        if !accepted {
            self.stats.drops_bad_state += 1;
            return;
        }
        if from != qp.params.peer_ip {
            self.stats.drops_wrong_peer += 1;
            return;
        }
        // Between two Lightpath soft devices (the queue pair's address vector says
        // `lightpath_peer`) the ICRC is neither computed nor checked: the datagrams travel in
        // UDP with the kernel's checksum, which covers the same bytes end to end (computed,
        // or offloaded to the NIC, on every UDP socket), so the ICRC's two CRC passes over
        // every byte would buy nothing. Towards rxe and RNICs it is computed and checked.
        if self.config.verify_icrc && !qp.params.lightpath_peer {
            // The datagram came to the port this engine receives on, whatever port the peer
            // sent it from (a soft peer sends from its own receive port, rxe from an entropy
            // port), so only the destination port is taken from the configuration.
            let endpoints = Endpoints { src: from, dst: to, src_port, dst_port: self.config.roce_port };
            if !self.icrc_ok(&endpoints, datagram) {
                self.stats.drops_icrc += 1;
                self.note_icrc_failure(&endpoints, bth.dest_qpn, bth.psn.value(), datagram.len());
                return;
            }
        }
        let qpn = bth.dest_qpn;
        let (qps, mut ctx) = self.ctx();
        let Some(qp) = qps.get_mut(qpn) else { return };
        qp.stats.rx_datagrams += 1;
        qp.stats.rx_bytes += datagram.len() as u64;
        if info.is_request() {
            qp.handle_request(&mut ctx, &repr.header, info, repr.payload);
        } else {
            qp.handle_response(&mut ctx, now, &repr.header, info.kind, info.position, repr.payload);
        }
        self.after_qp_work(qpn);
    }

    /// Whether some queue pair has a datagram to send ([`Engine::poll_transmit`] would
    /// produce one, or find that the queue pair had nothing after all). Held answers
    /// ([`Engine::hold_answers`]) do not count.
    pub fn has_output(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Holds queue pair `qpn`'s pending acknowledgements back for its next request: until the
    /// application posts one (which then leaves with the ACK in front of it, one datagram
    /// where the peer takes bundles) or [`Engine::release_answers`] /
    /// [`Engine::release_all_answers`], they do not make the queue pair ready to transmit.
    /// For a driver whose application is about to answer what it just received — an event
    /// loop's reply — so that each side sends one datagram per request and response, as TCP
    /// sends one segment with its ACK inside, instead of an ACK and a reply. Only plain ACKs
    /// wait (a NAK, an RNR NAK, READ data and atomic answers never do), and only in RTS/SQD;
    /// more requests arriving meanwhile coalesce into the held ACK. The driver bounds how
    /// long anything is held (the peer's retransmission timer is far longer). Returns whether
    /// anything is held now.
    pub fn hold_answers(&mut self, qpn: u32) -> bool {
        let Some(qp) = self.qps.get_mut(qpn) else { return false };
        let was_held = qp.answers_held;
        let held = qp.hold_answers();
        let newly_held = qp.answers_held && !was_held;
        let leaves_ready = held && qp.in_ready_list && !qp.wants_transmit();
        if leaves_ready {
            qp.in_ready_list = false;
            self.ready.retain(|&q| q != qpn);
        }
        if newly_held {
            if self.held_answers.len() > 2 * self.qps.len() as usize + 64 {
                let qps = &self.qps;
                self.held_answers.retain(|&q| qps.get(q).is_some_and(|qp| qp.answers_held));
            }
            self.held_answers.push(qpn);
        }
        held
    }

    /// Lets queue pair `qpn`'s held acknowledgements go with the next transmit. Returns
    /// whether any were held (and are owed now).
    pub fn release_answers(&mut self, qpn: u32) -> bool {
        let Some(qp) = self.qps.get_mut(qpn) else { return false };
        if !qp.answers_held {
            return false;
        }
        qp.answers_held = false;
        let owed = qp.has_response_output();
        self.after_qp_work(qpn);
        owed
    }

    /// [`Engine::release_answers`] for every queue pair. Returns how many had answers owed.
    pub fn release_all_answers(&mut self) -> usize {
        let mut held = std::mem::take(&mut self.held_answers);
        let owed = held.iter().filter(|&&qpn| self.release_answers(qpn)).count();
        held.clear();
        self.held_answers = held;
        owed
    }

    /// Whether some queue pair may hold acknowledgements ([`Engine::hold_answers`]).
    pub fn has_held_answers(&self) -> bool {
        !self.held_answers.is_empty()
    }

    /// Writes the next datagram to send into `buf` (which must hold [`MAX_DATAGRAM`] bytes;
    /// a smaller buffer gets nothing) and says where it goes. The ICRC is sealed for the
    /// ports in the returned [`Transmit`]: the source port (the configured fixed port, if any)
    /// and the destination port (the queue pair's `udp_dport`, else the configured RoCE port).
    pub fn poll_transmit(&mut self, now: Time, buf: &mut [u8]) -> Option<Transmit> {
        if buf.len() < MAX_DATAGRAM {
            return None;
        }
        let (fixed_src_port, default_dst_port) = (self.config.fixed_src_port, self.config.roce_port);
        while let Some(qpn) = self.ready.pop_front() {
            let (qps, mut ctx) = self.ctx();
            let Some(qp) = qps.get_mut(qpn) else { continue };
            qp.in_ready_list = false;
            let produced = qp.produce(&mut ctx, now, buf);
            let gathered = qp.gathered.take();
            let src_port = fixed_src_port.unwrap_or(qp.params.src_port);
            let dst_port = match qp.params.dst_port {
                0 => default_dst_port,
                port => port,
            };
            let (dst, local_ip, segmentable, bundles, pmtu) = (
                qp.params.peer_ip,
                qp.params.local_ip,
                qp.params.lightpath_peer,
                qp.params.lightpath_bundles,
                qp.params.pmtu,
            );
            // The datagram's bytes on the wire: a gathered payload (and its trailer) is not in
            // `buf`, only the headers are.
            let wire_len = produced.map_or(0, |len| len + gathered.map_or(0, |g| g.len + g.trailer));
            if produced.is_some() {
                qp.stats.tx_datagrams += 1;
                qp.stats.tx_bytes += wire_len as u64;
            }
            self.after_qp_work(qpn);
            let Some(len) = produced else { continue };
            let endpoints = Endpoints { src: local_ip, dst, src_port, dst_port };
            if gathered.is_some() {
                // Headers only; the driver appends the payload and a zero trailer.
            } else if segmentable {
                // A Lightpath soft peer neither needs nor checks the ICRC (see
                // `handle_datagram`): the field stays zero, and a CRC pass over every byte
                // is saved on both sides.
                let at = len - lightpath_wire::transport::ICRC_LEN;
                buf[at..len].fill(0);
            } else if seal(&endpoints, &mut buf[..len]).is_err() {
                self.stats.tx_errors += 1;
                continue;
            }
            self.stats.tx_datagrams += 1;
            self.stats.tx_bytes += wire_len as u64;
            // A bundle (an acknowledgement in front of this datagram) must fit wherever a full
            // datagram of this queue pair does: a middle packet (BTH, a path MTU of payload,
            // ICRC) is the smallest full one.
            let bundles = bundles && wire_len + ACK_DATAGRAM_LEN <= pmtu as usize + BthRepr::LEN + ICRC_LEN;
            return Some(Transmit { dst, dst_port, src_port, len, segmentable, bundles, gathered });
        }
        None
    }

    /// Counts an ICRC failure against the queue pair it named and reports it: the first
    /// from a queue pair's peer as a warning (a broken or hostile peer, or a path that
    /// corrupts packets), the rest at debug level, so a flood of bad datagrams does not
    /// flood the log.
    #[cold]
    fn note_icrc_failure(&mut self, endpoints: &Endpoints, qpn: u32, psn: u32, len: usize) {
        let Some(qp) = self.qps.get_mut(qpn) else { return };
        qp.stats.drops_icrc += 1;
        let (from, src_port, drops) = (endpoints.src, endpoints.src_port, qp.stats.drops_icrc);
        if drops == 1 {
            tracing::warn!(qpn, %from, src_port, psn, len, drops, "datagram dropped: ICRC mismatch");
        } else {
            tracing::debug!(qpn, %from, src_port, psn, len, drops, "datagram dropped: ICRC mismatch");
        }
    }

    /// Checks a received datagram's ICRC. An IPv4 datagram sent as a socket with
    /// `IP_PMTUDISC_DO` sends it (ID 0, DF: every Lightpath peer) matches exactly in one CRC
    /// pass; others (Linux rxe numbers its IDs) need the solve for ID and flags, which also
    /// tells which kind the peer is, so the exact check is tried only while it keeps matching.
    fn icrc_ok(&mut self, endpoints: &Endpoints, datagram: &[u8]) -> bool {
        let (IpAddr::V4(src), IpAddr::V4(dst)) = (endpoints.src, endpoints.dst) else {
            return icrc::verify(endpoints, datagram);
        };
        let default = Ipv4IdFlags::SOCKET_DEFAULT;
        if self.expect_socket_default_ip_header {
            let computed = icrc::compute_ipv4(
                src,
                dst,
                default.ident,
                default.flags_frag,
                endpoints.src_port,
                endpoints.dst_port,
                datagram,
            );
            if computed.is_ok_and(|crc| icrc::found(datagram) == Some(crc)) {
                return true;
            }
        }
        match icrc::solve_ipv4_id_flags(endpoints, datagram) {
            Some(header) => {
                self.expect_socket_default_ip_header = header == default;
                true
            }
            None => false,
        }
    }

    /// When `handle_timeout` must next be called (it may be called earlier; a spurious call
    /// does nothing).
    pub fn poll_timeout(&self) -> Option<Time> {
        self.timers.peek().map(|Reverse((deadline, _))| *deadline)
    }

    /// Fires every timer due at `now` (retransmissions, RNR waits).
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(&Reverse((deadline, qpn))) = self.timers.peek() {
            if deadline > now {
                break;
            }
            self.timers.pop();
            let (qps, mut ctx) = self.ctx();
            let Some(qp) = qps.get_mut(qpn) else { continue };
            if qp.timer_queued != Some(deadline) {
                continue; // superseded by an earlier entry for the same queue pair
            }
            qp.timer_queued = None;
            qp.handle_timeout(&mut ctx, now);
            self.after_qp_work(qpn);
        }
    }

    /// The next notification for the driver.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        let event = self.events.pop_front()?;
        match event {
            EngineEvent::Completion(cq) => self.cqs.event_delivered(cq),
            EngineEvent::QpError { qpn } => {
                if let Some(qp) = self.qps.get_mut(qpn) {
                    qp.error_event_pending = false;
                }
            }
            EngineEvent::QpNews { .. } => {}
        }
        Some(event)
    }

    /// After a queue pair did something: put it on the ready list if it has output, and make
    /// sure the timer heap holds its earliest deadline.
    fn after_qp_work(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(qpn) else { return };
        if !qp.in_ready_list && qp.wants_transmit() {
            qp.in_ready_list = true;
            self.ready.push_back(qpn);
        }
        if let Some(deadline) = qp.next_deadline() {
            // Only an earlier deadline needs a new entry: a later one is found when the
            // current entry fires early and is rescheduled.
            if qp.timer_queued.is_none_or(|queued| deadline < queued) {
                qp.timer_queued = Some(deadline);
                self.timers.push(Reverse((deadline, qpn)));
                self.compact_timers_if_needed();
            }
        }
        self.tidy_timer_top();
    }

    /// Keeps the heap's top exact, so `poll_timeout` never asks for a pointless wake-up:
    /// entries of destroyed queue pairs or superseded deadlines are dropped, and a deadline
    /// that moved later (the retransmit timer re-armed by an ACK) is pushed at its new time.
    fn tidy_timer_top(&mut self) {
        while let Some(&Reverse((deadline, qpn))) = self.timers.peek() {
            let Some(qp) = self.qps.get_mut(qpn) else {
                self.timers.pop();
                continue;
            };
            if qp.timer_queued != Some(deadline) {
                self.timers.pop();
                continue;
            }
            match qp.next_deadline() {
                Some(actual) if actual <= deadline => return,
                actual => {
                    self.timers.pop();
                    qp.timer_queued = actual;
                    if let Some(actual) = actual {
                        self.timers.push(Reverse((actual, qpn)));
                    }
                }
            }
        }
    }

    /// Stale heap entries are skipped lazily; if they pile up, rebuild the heap from the
    /// queue pairs so its size stays proportional to the number of queue pairs.
    fn compact_timers_if_needed(&mut self) {
        if self.timers.len() <= 4 * self.qps.len() as usize + 64 {
            return;
        }
        self.timers = self
            .qps
            .iter()
            .filter_map(|qp| qp.timer_queued.map(|deadline| Reverse((deadline, qp.qpn))))
            .collect();
    }
}

/// Seals a datagram as `icrc::seal` does (IPv4: as sent with ID 0 and DF), without working
/// out the address family again for the common all-IPv4 case.
fn seal(endpoints: &Endpoints, datagram: &mut [u8]) -> lightpath_wire::Result<()> {
    let crc = match (endpoints.src, endpoints.dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let default = Ipv4IdFlags::SOCKET_DEFAULT;
            let (sport, dport) = (endpoints.src_port, endpoints.dst_port);
            icrc::compute_ipv4(src, dst, default.ident, default.flags_frag, sport, dport, datagram)?
        }
        _ => return icrc::seal(endpoints, datagram),
    };
    let at = datagram.len() - lightpath_wire::transport::ICRC_LEN;
    datagram[at..].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use lightpath_verbs::{AddressVector, Mtu, SendOp, WcStatus};

    use super::*;

    /// One engine's queue pair in RTS towards `peer` (at UDP port `udp_dport`, 0: the default).
    fn ready_engine(config: EngineConfig, peer: IpAddr, udp_dport: u16) -> (Engine, u32) {
        let mut engine = Engine::new(config);
        let cq = engine.create_cq(16).expect("cq");
        let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
        let access = AccessFlags::LOCAL_WRITE;
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(access)).expect("init");
        let av = AddressVector { udp_dport, ..AddressVector::new(Gid::from_ip(peer), 0) };
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, 0x99, 0)).expect("rtr");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(0)).expect("rts");
        (engine, qpn)
    }

    fn first_send(fixed_src_port: Option<u16>) -> (Transmit, Vec<u8>, IpAddr, IpAddr) {
        let config = |local| EngineConfig { fixed_src_port, ..EngineConfig::new(Gid::from_ip(local)) };
        first_send_with(config, 0)
    }

    /// The first datagram of a SEND on a fresh queue pair from 10.0.0.1 to 10.0.0.2.
    fn first_send_with(
        config: impl FnOnce(IpAddr) -> EngineConfig,
        udp_dport: u16,
    ) -> (Transmit, Vec<u8>, IpAddr, IpAddr) {
        let (local, peer) = (IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        let (mut engine, qpn) = ready_engine(config(local), peer, udp_dport);
        engine.post_send(Time::ZERO, qpn, &SendWr::inline(1, SendOp::Send, b"hello")).expect("post");
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let transmit = engine.poll_transmit(Time::ZERO, &mut buf).expect("a SEND to transmit");
        buf.truncate(transmit.len);
        (transmit, buf, local, peer)
    }

    #[test]
    fn fixed_source_port_is_reported_and_sealed() {
        let (transmit, datagram, local, peer) = first_send(Some(4791));
        assert_eq!(transmit.src_port, 4791);
        let sealed_for =
            |src_port| Endpoints { src: local, dst: peer, src_port, dst_port: EngineConfig::ROCE_PORT };
        assert!(icrc::verify(&sealed_for(4791), &datagram));
        let (entropy, _, _, _) = first_send(None);
        assert_ne!(entropy.src_port, 4791, "without the option the per-QP port is used");
        assert!(!icrc::verify(&sealed_for(entropy.src_port), &datagram), "the ICRC covers the source port");
    }

    #[test]
    fn address_vector_port_is_the_destination_and_is_sealed() {
        let config = |local| EngineConfig::new(Gid::from_ip(local));
        let (transmit, datagram, local, peer) = first_send_with(config, 6000);
        assert_eq!(transmit.dst_port, 6000);
        let sealed_for =
            |dst_port| Endpoints { src: local, dst: peer, src_port: transmit.src_port, dst_port };
        assert!(icrc::verify(&sealed_for(6000), &datagram));
        assert!(!icrc::verify(&sealed_for(EngineConfig::ROCE_PORT), &datagram), "the ICRC covers the port");
    }

    #[test]
    fn port_zero_sends_to_the_configured_roce_port() {
        let (transmit, datagram, local, peer) =
            first_send_with(|local| EngineConfig::new(Gid::from_ip(local)), 0);
        assert_eq!(transmit.dst_port, EngineConfig::ROCE_PORT);
        let endpoints = |dst_port| Endpoints { src: local, dst: peer, src_port: transmit.src_port, dst_port };
        assert!(icrc::verify(&endpoints(EngineConfig::ROCE_PORT), &datagram));
        // An engine listening elsewhere sends to its own port, as every soft device did before.
        let on_5811 = |local| EngineConfig { roce_port: 5811, ..EngineConfig::new(Gid::from_ip(local)) };
        let (transmit, datagram, _, _) = first_send_with(on_5811, 0);
        assert_eq!(transmit.dst_port, 5811);
        let sealed = Endpoints { src: local, dst: peer, src_port: transmit.src_port, dst_port: 5811 };
        assert!(icrc::verify(&sealed, &datagram));
    }

    /// Engines A (10.0.0.1) and B (10.0.0.2) with connected queue pairs; B has `recvs`
    /// receives posted. Returns the engines, their QPNs and B's completion queue.
    fn connected_pair(recvs: u64) -> ([Engine; 2], [u32; 2], CqHandle) {
        let ips = [IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))];
        let config = |ip| EngineConfig { fixed_src_port: Some(4791), ..EngineConfig::new(Gid::from_ip(ip)) };
        let mut engines = ips.map(|ip| Engine::new(config(ip)));
        let mut cqs = [CqHandle(0); 2];
        let mut qpns = [0; 2];
        for i in 0..2 {
            cqs[i] = engines[i].create_cq(16).expect("cq");
            qpns[i] = engines[i].create_qp(cqs[i], cqs[i], QpCaps::default()).expect("qp");
            engines[i]
                .modify_qp(Time::ZERO, qpns[i], &QpAttr::to_init(AccessFlags::LOCAL_WRITE))
                .expect("init");
        }
        for i in 0..2 {
            let av = AddressVector::new(Gid::from_ip(ips[1 - i]), 0);
            let rtr = QpAttr::to_rtr(av, Mtu::Mtu1024, qpns[1 - i], 0);
            engines[i].modify_qp(Time::ZERO, qpns[i], &rtr).expect("rtr");
            engines[i].modify_qp(Time::ZERO, qpns[i], &QpAttr::to_rts(0)).expect("rts");
        }
        let memory = Arc::new(crate::VecMemory::new(64));
        let keys = engines[1].reg_mr(memory, 0x1000, AccessFlags::LOCAL_WRITE).expect("mr");
        let sge = [lightpath_verbs::Sge { addr: 0x1000, length: 64, lkey: keys.lkey }];
        for wr_id in 0..recvs {
            engines[1].post_recv(qpns[1], &RecvWr::new(wr_id, &sge)).expect("recv");
        }
        (engines, qpns, cqs[1])
    }

    /// Re-seals `datagram` as if its IPv4 header had had identification `ident` and DF.
    fn reseal_with_ident(datagram: &mut [u8], ident: u16) {
        let (src, dst) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let flags = Ipv4IdFlags::SOCKET_DEFAULT.flags_frag;
        let (sport, dport) = (4791, EngineConfig::ROCE_PORT);
        let crc = icrc::compute_ipv4(src, dst, ident, flags, sport, dport, datagram).expect("crc");
        let at = datagram.len() - 4;
        datagram[at..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn ipv4_icrc_check_takes_any_identification_and_refuses_corruption() {
        let (mut engines, qpns, b_cq) = connected_pair(3);
        let [a, b] = &mut engines;
        let mut datagrams = Vec::new();
        for i in 0..3u8 {
            a.post_send(Time::ZERO, qpns[0], &SendWr::inline(u64::from(i), SendOp::Send, &[i; 8]))
                .expect("post");
            let mut buf = vec![0u8; MAX_DATAGRAM];
            let t = a.poll_transmit(Time::ZERO, &mut buf).expect("a SEND");
            buf.truncate(t.len);
            datagrams.push(buf);
        }
        let (from, to) = (IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        let src_port = 4791;
        let corrupt = |datagram: &[u8]| {
            let mut bad = datagram.to_vec();
            bad[14] ^= 0x10;
            bad
        };
        // As rxe sends it (a numbered ID), then one corrupted, then the real one (ID 0).
        reseal_with_ident(&mut datagrams[0], 0x1234);
        b.handle_datagram(Time::ZERO, from, to, src_port, &datagrams[0]);
        b.handle_datagram(Time::ZERO, from, to, src_port, &corrupt(&datagrams[1]));
        b.handle_datagram(Time::ZERO, from, to, src_port, &datagrams[1]);
        // Corrupted while the ID-0 check is expected to match, then a numbered ID again.
        reseal_with_ident(&mut datagrams[2], 7);
        b.handle_datagram(Time::ZERO, from, to, src_port, &corrupt(&datagrams[2]));
        b.handle_datagram(Time::ZERO, from, to, src_port, &datagrams[2]);
        assert_eq!(b.stats().drops_icrc, 2);
        let mut wcs = [WorkCompletion::new(9, WcStatus::WrFlushErr, lightpath_verbs::WcOpcode::Send, 0); 4];
        assert_eq!(b.poll_cq(b_cq, &mut wcs), 3);
        assert!(wcs[..3].iter().all(|wc| wc.status == WcStatus::Success), "{wcs:?}");
    }

    /// Every datagram `engine` has to send now.
    fn drain(engine: &mut Engine) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; MAX_DATAGRAM];
        while let Some(t) = engine.poll_transmit(Time::ZERO, &mut buf) {
            out.push(buf[..t.len].to_vec());
        }
        out
    }

    /// The datagram of A's SEND of eight `byte`s.
    fn send_of(a: &mut Engine, qpn: u32, byte: u8) -> Vec<u8> {
        a.post_send(Time::ZERO, qpn, &SendWr::inline(u64::from(byte), SendOp::Send, &[byte; 8]))
            .expect("post");
        let mut sent = drain(a);
        assert_eq!(sent.len(), 1);
        sent.remove(0)
    }

    /// `datagram` from A (10.0.0.1) handed to B (10.0.0.2).
    fn hand_to_b(b: &mut Engine, datagram: &[u8]) {
        let (from, to) = (IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        b.handle_datagram(Time::ZERO, from, to, 4791, datagram);
    }

    /// A's SEND of `byte` handed to B.
    fn deliver_send(engines: &mut [Engine; 2], qpns: [u32; 2], byte: u8) {
        let [a, b] = engines;
        let datagram = send_of(a, qpns[0], byte);
        hand_to_b(b, &datagram);
    }

    #[test]
    fn held_acks_wait_for_the_next_request_and_leave_in_front_of_it() {
        let (mut engines, qpns, _) = connected_pair(4);
        deliver_send(&mut engines, qpns, 1);
        let b = &mut engines[1];
        assert!(b.has_output(), "the SEND is acknowledged");
        assert!(b.hold_answers(qpns[1]));
        assert!(!b.has_output() && b.poll_transmit(Time::ZERO, &mut vec![0u8; MAX_DATAGRAM]).is_none());
        // A second request meanwhile coalesces into the held ACK.
        deliver_send(&mut engines, qpns, 2);
        let b = &mut engines[1];
        assert!(b.hold_answers(qpns[1]), "still held: a plain ACK");
        assert!(!b.has_output());
        // The reply takes it along: the ACK first (the driver bundles the two).
        b.post_send(Time::ZERO, qpns[1], &SendWr::inline(7, SendOp::Send, b"reply")).expect("post");
        let out = drain(b);
        let opcodes: Vec<u8> = out.iter().map(|d| d[0]).collect();
        assert_eq!(opcodes, [Opcode::RC_ACKNOWLEDGE.0, Opcode::RC_SEND_ONLY.0], "one ACK, then the reply");
        assert_eq!(b.stats().acks_sent, 1, "the two requests were acknowledged once");
        assert_eq!(b.release_all_answers(), 0, "nothing is held after the reply");
    }

    #[test]
    fn held_acks_are_released_on_demand_and_nak_never_waits() {
        let (mut engines, qpns, _) = connected_pair(4);
        deliver_send(&mut engines, qpns, 1);
        assert!(engines[1].hold_answers(qpns[1]));
        assert!(engines[1].has_held_answers());
        assert!(engines[1].release_answers(qpns[1]), "the ACK was owed");
        assert!(!engines[1].release_answers(qpns[1]), "released once");
        assert_eq!(drain(&mut engines[1]).len(), 1);

        deliver_send(&mut engines, qpns, 2);
        assert!(engines[1].hold_answers(qpns[1]));
        assert_eq!(engines[1].release_all_answers(), 1);
        assert_eq!(drain(&mut engines[1]).len(), 1);
        assert_eq!(engines[1].release_all_answers(), 0);

        // A request out of sequence (the one before it lost) draws a NAK, which is not held.
        let [a, b] = &mut engines;
        let _lost = send_of(a, qpns[0], 3);
        hand_to_b(b, &send_of(a, qpns[0], 4));
        assert!(!b.hold_answers(qpns[1]), "a NAK was held");
        assert!(b.has_output());
        let out = drain(b);
        assert_eq!(out.len(), 1);
        assert_eq!(b.stats().naks_sent, 1);
    }

    #[test]
    fn entropy_source_port_is_sealed_by_default() {
        let (transmit, datagram, local, peer) = first_send(None);
        assert!(transmit.src_port >= 0xC000, "rxe's entropy range");
        let endpoints = Endpoints {
            src: local,
            dst: peer,
            src_port: transmit.src_port,
            dst_port: EngineConfig::ROCE_PORT,
        };
        assert!(icrc::verify(&endpoints, &datagram));
    }
}
