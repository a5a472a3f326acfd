//! The device's UDP socket and the buffers that batch datagrams through it.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};

use lightpath_roce::{Engine, Gathered, Time, ACK_DATAGRAM_LEN, MAX_DATAGRAM};
use lightpath_wire::{BthPacket, Opcode};

use super::stats::DriverStats;
use crate::sys::{
    self, DatagramParts, OutMessage, RecvBatch, SendBatch, MAX_SEGMENTED_BYTES, MAX_SEGMENTS, SEND_DATAGRAMS,
};

/// Receive buffers are a little larger than the largest RoCE datagram, so that an oversized
/// datagram shows up as truncated instead of looking like a valid one.
const RX_BUFFER: usize = MAX_DATAGRAM + 64;
/// With receive offload a message holds up to 64 KiB of coalesced datagrams.
const RX_BUFFER_GRO: usize = (64 << 10) + 64;

/// One unconnected UDP socket bound to the device's address, set up as digest §5.1a requires.
#[derive(Debug)]
pub(crate) struct RoceSocket {
    socket: UdpSocket,
    local: SocketAddr,
    /// The kernel hands over coalesced datagrams (`UDP_GRO` is on).
    gro: bool,
}

impl RoceSocket {
    /// Binds `local` (a specific address) with path-MTU discovery forced on and large buffers,
    /// and with receive offload if `offload` and the kernel has it.
    pub(crate) fn bind(
        local: SocketAddr,
        recv_buffer: usize,
        send_buffer: usize,
        offload: bool,
    ) -> io::Result<Self> {
        if local.ip().is_unspecified() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a soft device needs a specific local address (it is the device's GID)",
            ));
        }
        let socket = UdpSocket::bind(local)?;
        sys::set_pmtu_discovery_do(socket.as_fd(), local.is_ipv6())?;
        sys::set_buffer_sizes(socket.as_fd(), recv_buffer, send_buffer);
        let gro = offload && sys::set_udp_gro(socket.as_fd()).is_ok();
        let local = socket.local_addr()?;
        Ok(Self { socket, local, gro })
    }

    /// The bound address (with the real port if 0 was asked for).
    pub(crate) fn local(&self) -> SocketAddr {
        self.local
    }

    /// Whether the kernel hands over coalesced datagrams.
    pub(crate) fn gro(&self) -> bool {
        self.gro
    }
}

impl AsFd for RoceSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// Buffers for one `recvmmsg` batch.
pub(crate) struct RxBuffers {
    batch: RecvBatch,
}

impl RxBuffers {
    pub(crate) fn new(socket: &RoceSocket) -> Self {
        Self { batch: RecvBatch::new(Self::buffer_len_for(socket)) }
    }

    /// Bytes of each message buffer for `socket`: a coalesced message with receive offload,
    /// one datagram without.
    fn buffer_len_for(socket: &RoceSocket) -> usize {
        if socket.gro {
            RX_BUFFER_GRO
        } else {
            RX_BUFFER
        }
    }

    /// Receives what is waiting (up to `limit` messages, at most
    /// [`RECV_BATCH`](crate::sys::RECV_BATCH)) and feeds it to the engine. Returns how many
    /// messages arrived (a message may hold several coalesced datagrams); as many as `limit`
    /// means more may be waiting.
    pub(crate) fn receive(
        &mut self,
        socket: &RoceSocket,
        engine: &mut Engine,
        now: Time,
        stats: &mut DriverStats,
        limit: usize,
    ) -> usize {
        let received = self.recv_only(socket, limit);
        self.deliver_received(socket, engine, now, stats, received)
    }

    /// Whether these buffers fit `socket` (sized for its receive offload or not).
    pub(crate) fn fits(&self, socket: &RoceSocket) -> bool {
        self.batch.buffer_len() == Self::buffer_len_for(socket)
    }

    /// The system-call half of [`RxBuffers::receive`]: takes what waits in `socket` (up to
    /// `limit` messages) without handing it to the engine yet, so that it needs no lock.
    /// Returns how many messages arrived.
    pub(crate) fn recv_only(&mut self, socket: &RoceSocket, limit: usize) -> io::Result<usize> {
        self.batch.recv(socket.as_fd(), limit)
    }

    /// The engine half of [`RxBuffers::receive`]: hands the messages that
    /// [`RxBuffers::recv_only`] took from `socket` (its result, `received`) to the engine and
    /// counts the call. Returns how many messages there were (0 after an error).
    pub(crate) fn deliver_received(
        &self,
        socket: &RoceSocket,
        engine: &mut Engine,
        now: Time,
        stats: &mut DriverStats,
        received: io::Result<usize>,
    ) -> usize {
        let count = received.unwrap_or_else(|_| {
            stats.rx_errors += 1;
            0
        });
        if count > 0 {
            stats.rx_batches += 1;
        }
        let to = socket.local().ip();
        for i in 0..count {
            let Some(message) = self.batch.get(i) else { break };
            if message.truncated {
                stats.drops_oversized += 1;
                continue;
            }
            let from = match message.from {
                Some(from) if from.is_ipv4() == to.is_ipv4() => from,
                _ => {
                    stats.drops_bad_source += 1;
                    continue;
                }
            };
            match message.segment_size {
                None => deliver(engine, now, from, to, message.data, stats),
                Some(size) => {
                    stats.rx_coalesced += 1;
                    for datagram in message.data.chunks(size) {
                        deliver(engine, now, from, to, datagram, stats);
                    }
                }
            }
        }
        count
    }
}

/// Hands one datagram to the engine, unless no RoCE packet can be that long.
fn deliver(
    engine: &mut Engine,
    now: Time,
    from: SocketAddr,
    to: IpAddr,
    datagram: &[u8],
    stats: &mut DriverStats,
) {
    if datagram.len() > MAX_DATAGRAM {
        stats.drops_oversized += 1;
    } else {
        engine.handle_datagram(now, from.ip(), to, from.port(), datagram);
    }
}

/// Where one datagram of a send batch goes.
#[derive(Clone, Copy, Debug)]
struct Outgoing {
    dst: SocketAddr,
    /// The whole datagram's length.
    len: usize,
    /// Its bytes in the buffer: all of them, or the headers when `gathered`.
    head_len: usize,
    /// The payload stays in registered memory ([`lightpath_roce::Transmit::gathered`]).
    gathered: Option<Gathered>,
    /// An ACK, NAK or READ/atomic response (the responder's stream), as opposed to a request.
    response: bool,
    /// The peer tolerates renumbered IPv4 identifications ([`lightpath_roce::Transmit::segmentable`]).
    segmentable: bool,
    /// The peer takes an acknowledgement in front of this datagram
    /// ([`lightpath_roce::Transmit::bundles`]).
    bundles: bool,
    /// An RC Acknowledge of [`ACK_DATAGRAM_LEN`] bytes to such a peer: it may ride in front of
    /// a request (see [`TxBuffers::plan`]).
    bundled_ack: bool,
    /// The queue pair it is for: an acknowledgement rides only with a request to the same one
    /// (the peer takes the bundle apart by the acknowledgement's queue pair).
    dest_qpn: u32,
}

/// [`TxBuffers::partner`] of a datagram that goes alone.
const ALONE: usize = usize::MAX;
/// [`TxBuffers::partner`] of an acknowledgement that rides in front of a request.
const PAIRED: usize = usize::MAX - 1;

/// Buffers for one `sendmmsg` batch.
pub(crate) struct TxBuffers {
    /// One buffer per datagram of a batch, made on first use (see `fill`).
    bufs: Vec<Box<[u8]>>,
    outgoing: Vec<Outgoing>,
    /// Send order: positions into `bufs`.
    order: Vec<usize>,
    messages: Vec<OutMessage>,
    /// Per datagram of the batch (see [`TxBuffers::pair_acknowledgements`]): for a request, the
    /// acknowledgement that rides in front of it; [`PAIRED`] for that acknowledgement;
    /// [`ALONE`] for everything else.
    partner: Vec<usize>,
    batch: SendBatch,
    /// Segmentation offload is allowed and has not failed.
    segmentation: bool,
    /// Which queue pairs the device has been sending to lately (see [`FlowMix`]).
    flows: FlowMix,
    /// Acknowledgements ride in front of requests even with one flow (see
    /// [`TxBuffers::pair_acknowledgements`]): set in polling mode.
    always_join: bool,
    /// The sending counters (`tx_*`, `segmentation_failures`; the rest stay 0): kept here
    /// because batches go out without the engine lock (see `Shared::transmit`).
    pub(crate) stats: DriverStats,
}

impl TxBuffers {
    pub(crate) fn new(offload: bool, always_join: bool) -> Self {
        Self {
            // Made as batches first need them (see `fill`): most batches are a datagram or two,
            // and all of them at once (2 MiB, written to zero) cost a device's first connection a
            // millisecond of page faults.
            bufs: Vec::with_capacity(SEND_DATAGRAMS),
            outgoing: Vec::with_capacity(SEND_DATAGRAMS),
            order: Vec::with_capacity(SEND_DATAGRAMS),
            messages: Vec::with_capacity(SEND_DATAGRAMS),
            partner: Vec::with_capacity(SEND_DATAGRAMS),
            batch: SendBatch::new(),
            segmentation: offload,
            flows: FlowMix::default(),
            always_join,
            stats: DriverStats::default(),
        }
    }

    /// Whether answers join the requests of a batch planned `now` (see
    /// [`TxBuffers::pair_acknowledgements`]): with several queue pairs lately, and always in
    /// polling mode. There one rank of a collective talks to one peer (a 2-rank allreduce of
    /// 8 B over soft, p50 8.6-9.6 -> 4.9-5.5 us with the ACK in front of the next message) and
    /// a one-connection `stream_rr --polling` lost nothing (15.8-16.8 against 15.9-16.4 us);
    /// the pinned one-connection loss that keeps it off otherwise was in progress-thread mode.
    fn join_answers(&self, now: Time) -> bool {
        self.always_join || self.flows.several_lately(now)
    }

    /// Sends everything the engine has to send, one batch per system call.
    pub(crate) fn transmit_all(&mut self, socket: &RoceSocket, engine: &mut Engine, now: Time) {
        loop {
            let filled = self.fill(socket, engine, now);
            self.send_filled(socket);
            if filled < SEND_DATAGRAMS {
                return;
            }
        }
    }

    /// Takes up to one batch of datagrams out of the engine (it then need not stay locked
    /// while [`TxBuffers::send_filled`] sends them); returns how many it took.
    pub(crate) fn fill(&mut self, socket: &RoceSocket, engine: &mut Engine, now: Time) -> usize {
        let stats = &mut self.stats;
        self.outgoing.clear();
        while self.outgoing.len() < SEND_DATAGRAMS {
            let slot = self.outgoing.len();
            if slot == self.bufs.len() {
                if !engine.has_output() {
                    break;
                }
                self.bufs.push(vec![0u8; MAX_DATAGRAM].into_boxed_slice());
            }
            let buf = &mut self.bufs[slot];
            let Some(transmit) = engine.poll_transmit(now, buf) else { break };
            let Some(dst) = destination(socket.local(), transmit.dst, transmit.dst_port) else {
                stats.tx_errors += 1;
                continue;
            };
            let response =
                buf.first().and_then(|&op| Opcode(op).info()).is_some_and(|info| info.is_response());
            let dest_qpn = BthPacket::new_checked(&buf[..]).map_or(0, |bth| bth.dest_qpn());
            self.flows.note(dst, dest_qpn, now);
            let segmentable = transmit.segmentable;
            let gathered = transmit.gathered;
            let len = transmit.len + gathered.map_or(0, |g| g.len + g.trailer);
            let bundled_ack = transmit.bundles
                && len == ACK_DATAGRAM_LEN
                && gathered.is_none()
                && buf.first() == Some(&Opcode::RC_ACKNOWLEDGE.0);
            self.outgoing.push(Outgoing {
                dst,
                len,
                head_len: transmit.len,
                gathered,
                response,
                segmentable,
                bundles: transmit.bundles,
                bundled_ack,
                dest_qpn,
            });
        }
        let filled = self.outgoing.len();
        if filled > 0 {
            self.plan(self.join_answers(now));
        }
        filled
    }

    /// Sends the batch [`TxBuffers::fill`] took (nothing if it took none). A datagram whose
    /// payload is gathered from region memory reads that memory now: the caller holds the
    /// device's sending lock, which deregistering a region takes too.
    pub(crate) fn send_filled(&mut self, socket: &RoceSocket) {
        if !self.messages.is_empty() {
            self.send(socket);
        }
        self.outgoing.clear();
        self.messages.clear();
    }

    /// Orders the batch and groups it into messages.
    ///
    /// Requests go before responses: the two are independent streams (each keeps its own
    /// order), and a request is usually what the peer's application waits for, while an ACK
    /// that travels in the same call as a reply only completes a send the peer is not waiting
    /// on. Runs of equal-size datagrams to one peer become one segmented message where that is
    /// safe (see [`segmentation_safe`]); with `join_answers`, an ACK (or another response)
    /// shorter than the requests before it ends their message (see [`joins`]).
    ///
    /// First, with `join_answers`, each acknowledgement to a peer that takes bundles goes in
    /// front of the last request to the same queue pair, if one has room for it: the two
    /// leave as one datagram (an *acknowledgement bundle*, see `Engine::handle_datagram`).
    /// Nothing joins a bundle and a bundle joins nothing.
    fn plan(&mut self, join_answers: bool) {
        self.pair_acknowledgements(join_answers);
        self.order.clear();
        let (outgoing, partner) = (&self.outgoing, &self.partner);
        for i in (0..outgoing.len()).filter(|&i| !outgoing[i].response) {
            if partner[i] != ALONE {
                self.order.push(partner[i]);
            }
            self.order.push(i);
        }
        self.order.extend((0..outgoing.len()).filter(|&i| outgoing[i].response && partner[i] == ALONE));
        self.messages.clear();
        let mut position = 0;
        while position < self.order.len() {
            let index = self.order[position];
            let datagram = outgoing[index];
            if partner[index] == PAIRED {
                self.messages.push(OutMessage {
                    dst: datagram.dst,
                    first: position,
                    count: 2,
                    segment_size: None,
                });
                position += 2;
                continue;
            }
            position += 1;
            let position = position - 1;
            if let Some(last) = self.messages.last_mut() {
                if self.segmentation && joins(last, datagram, outgoing, &self.order, join_answers) {
                    last.count += 1;
                    continue;
                }
            }
            let segment_size = u16::try_from(datagram.len).ok().filter(|_| segmentation_safe(datagram));
            self.messages.push(OutMessage { dst: datagram.dst, first: position, count: 1, segment_size });
        }
    }

    /// Fills `partner`: each acknowledgement that may ride in front of a request
    /// ([`Outgoing::bundled_ack`]) gets the last request of the batch to its destination and
    /// queue pair that has room for it ([`Outgoing::bundles`]) and no acknowledgement yet. The last one, since
    /// earlier requests to a peer often form a segmented run that the pair would cut short.
    ///
    /// Only with `join_answers` (several queue pairs lately, or polling mode: see
    /// [`TxBuffers::join_answers`]), as for joining a segmented message: otherwise, with one
    /// busy connection, its ACK still travels alone, ahead of nothing.
    /// Bundling that one too cost a one-connection stream_rr with server and client pinned to
    /// a core each up to half its rate (5.1-14.3 against 12.7-19.2 k requests/s; unpinned it
    /// gained), for reasons not found (see docs/architecture.md); with several connections
    /// bundles won (16 connections 35.9-54.2 against 33.4-46.6 k, less CPU).
    fn pair_acknowledgements(&mut self, join_answers: bool) {
        let outgoing = &self.outgoing;
        let partner = &mut self.partner;
        partner.clear();
        partner.resize(outgoing.len(), ALONE);
        if !join_answers {
            return;
        }
        for ack in (0..outgoing.len()).filter(|&i| outgoing[i].bundled_ack) {
            let (dst, qpn) = (outgoing[ack].dst, outgoing[ack].dest_qpn);
            let request = (0..outgoing.len()).rev().find(|&i| {
                let request = &outgoing[i];
                !request.response
                    && request.bundles
                    && request.dst == dst
                    && request.dest_qpn == qpn
                    && partner[i] == ALONE
            });
            if let Some(request) = request {
                partner[request] = ack;
                partner[ack] = PAIRED;
            }
        }
    }

    fn send(&mut self, socket: &RoceSocket) {
        let stats = &mut self.stats;
        let (bufs, outgoing) = (&self.bufs, &self.outgoing);
        let datagram = |i: usize| {
            let out = outgoing.get(i)?;
            let head = bufs.get(i)?.get(..out.head_len)?;
            Some(match out.gathered {
                // SAFETY: the engine checked the range against a registered region whose
                // memory stays in place, and the region stays registered (so its memory
                // allocated) until the engine's `dereg_mr`, which cannot run while a batch is
                // being sent: the sender holds the device's sending lock from `fill` to the end
                // of `send_filled`, and `SoftMr`'s drop takes that lock around `dereg_mr`.
                Some(g) => unsafe { DatagramParts::with_in_place(head, g.addr, g.len, g.trailer) },
                None => DatagramParts::buffered(head),
            })
        };
        let mut start = 0;
        while start < self.messages.len() {
            stats.tx_batches += 1;
            match self.batch.send(socket.as_fd(), datagram, &self.order, &self.messages[start..]) {
                Ok(0) => break,
                Ok(sent) => {
                    for message in &self.messages[start..start + sent] {
                        match (message.count, message.segment_size) {
                            (1, _) => {}
                            (_, Some(_)) => stats.tx_segmented += 1,
                            (_, None) => stats.tx_bundles += 1,
                        }
                    }
                    start += sent;
                }
                // A segmented message the kernel refuses (no checksum offload on the route, an
                // old kernel): stop segmenting on this device and send its datagrams one by one.
                // A bundle the kernel refuses goes as its two datagrams, bundles go on.
                Err(_) if self.messages[start].count > 1 => {
                    if self.messages[start].segment_size.is_some() {
                        self.segmentation = false;
                        stats.segmentation_failures += 1;
                    }
                    let failed = self.messages[start];
                    let singles = (0..failed.count).map(|k| OutMessage {
                        first: failed.first + k,
                        count: 1,
                        segment_size: None,
                        ..failed
                    });
                    self.messages.splice(start..=start, singles);
                }
                // The datagram at `start` cannot go (no route, host unreachable…): it counts as
                // lost, and the engine's retransmission deals with it like any loss.
                Err(_) => {
                    stats.tx_errors += 1;
                    start += 1;
                }
            }
        }
    }
}

/// Whether `datagram` can ride in the segmented message `last` (its datagrams are
/// `order[last.first..][..last.count]`): same peer, same stream, room left, and every datagram
/// but the last of a message exactly the segment size.
///
/// A response (an ACK, mostly) joins the requests before it only with `join_answers`: a
/// segmented message reaches the peer as one unit, so the ACK holds the reply back until it is
/// through the stack too (+0.5 to 1.5 µs on an 8-byte ping-pong over loopback). While the
/// device serves several queue pairs, the cost per message counts instead: the pair goes
/// through each network stack once rather than twice (stream_rr 64 B over 16 connections,
/// event-loop server: about 18% more requests per second).
fn joins(
    last: &OutMessage,
    datagram: Outgoing,
    outgoing: &[Outgoing],
    order: &[usize],
    join_answers: bool,
) -> bool {
    let Some(size) = last.segment_size.map(usize::from) else { return false };
    let tail = order.get(last.first + last.count - 1).and_then(|&i| outgoing.get(i));
    // A request never follows a response (requests are planned first); a response follows a
    // request only when answers join.
    let may_follow = |tail: &Outgoing| {
        tail.response == datagram.response || (join_answers && !tail.response && datagram.response)
    };
    last.dst == datagram.dst
        && tail.is_some_and(|tail| {
            tail.len == size && may_follow(tail) && tail.segmentable == datagram.segmentable
        })
        && datagram.len <= size
        && last.count < MAX_SEGMENTS
        && size * last.count + datagram.len <= MAX_SEGMENTED_BYTES
}

/// Whether the kernel may split a segmented message for this datagram's peer without breaking
/// the ICRC.
///
/// The kernel numbers the IPv4 identification of the segments it cuts from one message (0, 1,
/// 2, …), and the ICRC covers that field: a peer that checks the ICRC against the real header
/// (Linux rxe, RNICs) would drop every segment but the first. A Lightpath soft device solves
/// for the ID (its queue pair's address vector says `lightpath_peer`, which the stream
/// negotiation sets for soft peers); loopback never reaches such a peer with a cut message —
/// the kernel hands the message whole to a receiver with `UDP_GRO`, and Lightpath receivers
/// without it solve for the ID anyway — and IPv6 has no identification field.
fn segmentation_safe(datagram: Outgoing) -> bool {
    datagram.segmentable || datagram.dst.ip().is_loopback() || datagram.dst.is_ipv6()
}

/// Whether a device's datagrams have been going to more than one queue pair lately (within
/// [`FlowMix::LATELY`]): then it serves several connections, and the cost per message counts
/// for more than a microsecond of one message's latency (see [`joins`]).
#[derive(Clone, Copy, Debug, Default)]
struct FlowMix {
    /// The peer and queue pair of the last datagram.
    last: Option<(SocketAddr, u32)>,
    /// When the last datagram went to another queue pair than the one before it (ns).
    changed_at: Option<u64>,
}

impl FlowMix {
    const LATELY: std::time::Duration = std::time::Duration::from_millis(1);

    fn note(&mut self, dst: SocketAddr, qpn: u32, now: Time) {
        let flow = Some((dst, qpn));
        if self.last != flow {
            if self.last.is_some() {
                self.changed_at = Some(now.as_nanos());
            }
            self.last = flow;
        }
    }

    fn several_lately(&self, now: Time) -> bool {
        self.changed_at.is_some_and(|at| now.as_nanos().saturating_sub(at) < Self::LATELY.as_nanos() as u64)
    }
}

/// Where a datagram for peer `ip` goes: the peer's IP at the port the engine sealed it for
/// (the queue pair's `udp_dport`, or our own port), with our scope for link-local IPv6. `None`
/// if the families differ.
fn destination(local: SocketAddr, ip: IpAddr, port: u16) -> Option<SocketAddr> {
    match (local, ip) {
        (SocketAddr::V4(_), IpAddr::V4(ip)) => Some(SocketAddr::new(IpAddr::V4(ip), port)),
        (SocketAddr::V6(local), IpAddr::V6(ip)) => {
            let scope = if ip.is_unicast_link_local() { local.scope_id() } else { 0 };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(ip, port, 0, scope)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram of a batch: `len` bytes to `dst`, all in the buffer, no flag set.
    fn outgoing(dst: &str, len: usize, response: bool) -> Outgoing {
        Outgoing {
            dst: dst.parse().expect("addr"),
            len,
            head_len: len,
            gathered: None,
            response,
            segmentable: false,
            bundles: false,
            bundled_ack: false,
            dest_qpn: 0,
        }
    }

    fn planned(offload: bool, batch: &[(&str, usize, bool)]) -> (Vec<usize>, Vec<OutMessage>) {
        planned_joining(offload, false, batch)
    }

    fn planned_joining(
        offload: bool,
        join_answers: bool,
        batch: &[(&str, usize, bool)],
    ) -> (Vec<usize>, Vec<OutMessage>) {
        let mut tx = TxBuffers::new(offload, false);
        for &(dst, len, response) in batch {
            tx.outgoing.push(outgoing(dst, len, response));
        }
        tx.plan(join_answers);
        (tx.order, tx.messages)
    }

    fn message(dst: &str, first: usize, count: usize, segment_size: Option<u16>) -> OutMessage {
        OutMessage { dst: dst.parse().expect("addr"), first, count, segment_size }
    }

    #[test]
    fn requests_go_before_responses_each_in_order() {
        let lo = "127.0.0.2:4791";
        let batch = [(lo, 16, true), (lo, 40, false), (lo, 20, true), (lo, 44, false)];
        let (order, messages) = planned(false, &batch);
        assert_eq!(order, [1, 3, 0, 2]);
        let singles: Vec<OutMessage> =
            (0..4).map(|i| message(lo, i, 1, Some(batch[order[i]].1 as u16))).collect();
        assert_eq!(messages, singles, "no segmentation when offload is off");
    }

    #[test]
    fn equal_sizes_to_one_loopback_peer_are_segmented() {
        let (lo, other_lo) = ("127.0.0.2:4791", "127.0.0.3:4791");
        let batch = [
            (lo, 4128, false), // WRITE FIRST (with RETH): a segment of its own size
            (lo, 4112, false), // shorter: may end that message
            (lo, 4112, false), // but then the message is closed
            (lo, 4112, false),
            (lo, 100, false), // a short last segment
            (lo, 100, false), // cannot follow a short one
            (other_lo, 100, false),
            (other_lo, 100, true), // a response (sent last) never joins a request
            (other_lo, 100, true),
        ];
        let (order, messages) = planned(true, &batch);
        assert_eq!(order, [0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            messages,
            [
                message(lo, 0, 2, Some(4128)),
                message(lo, 2, 3, Some(4112)),
                message(lo, 5, 1, Some(100)),
                message(other_lo, 6, 1, Some(100)),
                message(other_lo, 7, 2, Some(100)),
            ]
        );
    }

    #[test]
    fn segmented_messages_stay_within_the_kernel_limits() {
        let lo = "[::1]:4791";
        let (_, messages) = planned(true, &[(lo, 4112, false); 40]);
        let counts: Vec<usize> = messages.iter().map(|m| m.count).collect();
        assert_eq!(counts, [15, 15, 10], "15 × 4112 bytes is the most under 65,000");
        let (_, small) = planned(true, &[(lo, 24, true); SEND_DATAGRAMS]);
        assert!(small.iter().all(|m| m.count <= MAX_SEGMENTS), "{small:?}");
    }

    #[test]
    fn remote_ipv4_peers_never_get_segmented_messages() {
        let (_, messages) = planned(true, &[("10.0.0.2:4791", 1024, false); 4]);
        assert_eq!(messages.iter().map(|m| (m.count, m.segment_size)).collect::<Vec<_>>(), [(1, None); 4]);
        let (_, v6) = planned(true, &[("[2001:db8::2]:4791", 1024, false); 4]);
        assert_eq!(v6.len(), 1, "IPv6 has no identification field to renumber");
    }

    #[test]
    fn remote_ipv4_peers_that_solve_for_the_id_get_segmented_messages() {
        let mut tx = TxBuffers::new(true, false);
        let remote = "10.0.0.2:4791";
        for segmentable in [true, true, true, false, false] {
            tx.outgoing.push(Outgoing { segmentable, ..outgoing(remote, 1052, false) });
        }
        tx.plan(false);
        let shape: Vec<(usize, Option<u16>)> =
            tx.messages.iter().map(|m| (m.count, m.segment_size)).collect();
        assert_eq!(shape, [(3, Some(1052)), (1, None), (1, None)], "only the flagged run is segmented");
        let mut off = TxBuffers::new(false, false);
        for _ in 0..3 {
            off.outgoing.push(Outgoing { segmentable: true, ..outgoing(remote, 1052, false) });
        }
        off.plan(false);
        assert!(off.messages.iter().all(|m| m.count == 1), "offload off: never segmented");
    }

    #[test]
    fn destinations() {
        let v4: SocketAddr = "127.0.0.1:4791".parse().expect("addr");
        assert_eq!(
            destination(v4, "10.0.0.2".parse().expect("ip"), 6000),
            Some("10.0.0.2:6000".parse().expect("addr"))
        );
        assert_eq!(destination(v4, "::1".parse().expect("ip"), 4791), None);
        let v6: SocketAddr = "[fe80::1%7]:5000".parse().expect("addr");
        let dst = destination(v6, "fe80::2".parse().expect("ip"), 5001).expect("same family");
        assert_eq!(dst, "[fe80::2%7]:5001".parse().expect("addr"));
        let global = destination(v6, "2001:db8::2".parse().expect("ip"), 5000).expect("same family");
        assert_eq!(global, "[2001:db8::2]:5000".parse().expect("addr"));
    }

    #[test]
    fn with_join_answers_an_ack_ends_the_message_of_the_requests_before_it() {
        let (lo, other_lo) = ("127.0.0.2:4791", "127.0.0.3:4791");
        let batch = [
            (lo, 108, false),      // a reply (a request of ours)
            (lo, 20, true),        // the ACK of the peer's request: shorter, so it ends the message
            (other_lo, 108, true), // a response to another peer: as usual, on its own
        ];
        let (order, messages) = planned_joining(true, true, &batch);
        assert_eq!(order, [0, 1, 2]);
        assert_eq!(messages, [message(lo, 0, 2, Some(108)), message(other_lo, 2, 1, Some(108))]);
        // Without it (one connection busy: latency first), the ACK travels alone.
        let (_, messages) = planned_joining(true, false, &batch);
        assert_eq!(
            messages,
            [message(lo, 0, 1, Some(108)), message(lo, 1, 1, Some(20)), message(other_lo, 2, 1, Some(108))]
        );
        // A response longer than the requests' segments, or to another peer, never joins.
        let (_, messages) = planned_joining(true, true, &[(lo, 108, false), (lo, 200, true)]);
        assert_eq!(messages, [message(lo, 0, 1, Some(108)), message(lo, 1, 1, Some(200))]);
        let (_, messages) = planned_joining(true, true, &[(lo, 108, false), (other_lo, 20, true)]);
        assert_eq!(messages.len(), 2);
    }

    /// A batch of (destination, queue pair, length, response, room for an acknowledgement in
    /// front, acknowledgement that may ride in front), offload on, not planned yet.
    fn bundling_batch(batch: &[(&str, u32, usize, bool, bool, bool)]) -> TxBuffers {
        let mut tx = TxBuffers::new(true, false);
        for &(dst, dest_qpn, len, response, bundles, bundled_ack) in batch {
            let datagram = outgoing(dst, len, response);
            tx.outgoing.push(Outgoing { segmentable: true, bundles, bundled_ack, dest_qpn, ..datagram });
        }
        tx
    }

    /// [`bundling_batch`] planned with answers joining (several queue pairs lately: bundles
    /// are made only then).
    fn planned_bundling(batch: &[(&str, u32, usize, bool, bool, bool)]) -> (Vec<usize>, Vec<OutMessage>) {
        let mut tx = bundling_batch(batch);
        tx.plan(true);
        (tx.order, tx.messages)
    }

    #[test]
    fn an_acknowledgement_rides_in_front_of_the_last_request_to_its_queue_pair() {
        let (lo, other_lo) = ("127.0.0.2:4791", "127.0.0.3:4791");
        let batch = [
            (lo, 7, 108, false, true, false),        // 0: a request with room
            (lo, 7, 108, false, true, false),        // 1: the last one to lo's 7: it takes the ACK
            (other_lo, 7, 108, false, false, false), // 2: no room (or a peer without bundles)
            (lo, 7, 20, true, true, true),           // 3: the ACK to lo's 7
            (other_lo, 7, 20, true, true, true),     // 4: an ACK with no request to ride with
        ];
        let (order, messages) = planned_bundling(&batch);
        assert_eq!(order, [0, 3, 1, 2, 4], "the bundle's ACK goes first, where its request was");
        assert_eq!(
            messages,
            [
                message(lo, 0, 1, Some(108)),
                message(lo, 1, 2, None), // one datagram: no segment size
                // No room for a bundle: the ACK joins the request's segmented message instead.
                message(other_lo, 3, 2, Some(108)),
            ]
        );
        // With one queue pair busy (answers do not join), every ACK travels alone.
        let mut tx = bundling_batch(&batch);
        tx.plan(false);
        assert!(tx.messages.iter().all(|m| m.segment_size.is_some()), "no bundle: {:?}", tx.messages);
        // Two ACKs for one request: the second goes alone; a request takes one ACK at most.
        let batch =
            [(lo, 7, 64, false, true, false), (lo, 7, 20, true, true, true), (lo, 7, 20, true, true, true)];
        let (order, messages) = planned_bundling(&batch);
        assert_eq!(order, [1, 0, 2]);
        assert_eq!(messages, [message(lo, 0, 2, None), message(lo, 2, 1, Some(20))]);
        // An ACK for another queue pair behind the same port never rides with the request.
        let batch = [(lo, 7, 64, false, true, false), (lo, 8, 20, true, true, true)];
        let (order, messages) = planned_bundling(&batch);
        assert_eq!(order, [0, 1]);
        assert!(messages.iter().all(|m| m.segment_size.is_some()), "{messages:?}");
        // Nothing joins a bundle, even a run of equal requests to the same peer.
        let batch = [
            (lo, 7, 100, false, true, false),
            (lo, 7, 100, false, true, false),
            (lo, 7, 100, false, true, false),
            (lo, 7, 20, true, true, true),
        ];
        let (order, messages) = planned_bundling(&batch);
        assert_eq!(order, [0, 1, 3, 2]);
        assert_eq!(messages, [message(lo, 0, 2, Some(100)), message(lo, 2, 2, None)]);
    }

    #[test]
    fn several_queue_pairs_lately_is_what_joins_answers() {
        let (a, b): (SocketAddr, SocketAddr) =
            ("127.0.0.2:4791".parse().expect("a"), "127.0.0.2:5000".parse().expect("b"));
        let at = |us: u64| Time::from_nanos(us * 1_000);
        let mut mix = FlowMix::default();
        mix.note(a, 17, at(0));
        mix.note(a, 17, at(10));
        assert!(!mix.several_lately(at(20)), "one queue pair only");
        mix.note(a, 18, at(30));
        assert!(mix.several_lately(at(40)), "another queue pair of the same peer device");
        assert!(!mix.several_lately(at(1_100)), "a millisecond later, with only that one since");
        mix.note(b, 18, at(1_200));
        assert!(mix.several_lately(at(1_300)), "another port of the peer");
    }

    #[test]
    fn answers_join_with_one_queue_pair_only_in_polling_mode() {
        let at = |nanos: u64| Time::from_nanos(nanos);
        let peer: SocketAddr = "127.0.0.2:4791".parse().expect("addr");
        for always_join in [false, true] {
            let mut tx = TxBuffers::new(true, always_join);
            tx.flows.note(peer, 7, at(1_000));
            tx.flows.note(peer, 7, at(2_000));
            assert_eq!(tx.join_answers(at(3_000)), always_join, "one queue pair, always_join {always_join}");
            tx.flows.note(peer, 8, at(3_000));
            assert!(tx.join_answers(at(3_100)), "two queue pairs lately join either way");
        }
    }

    #[test]
    fn datagram_buffers_are_made_as_batches_first_need_them() {
        use lightpath_roce::EngineConfig;
        use lightpath_verbs::{AccessFlags, AddressVector, Gid, Mtu, QpAttr, QpCaps, SendOp, SendWr};
        let socket = RoceSocket::bind("127.0.0.1:0".parse().expect("addr"), 1 << 16, 1 << 16, false)
            .expect("a UDP socket on loopback");
        let local = socket.local().ip();
        let mut engine = Engine::new(EngineConfig::new(Gid::from_ip(local)));
        let cq = engine.create_cq(16).expect("cq");
        let qpn = engine.create_qp(cq, cq, QpCaps::default()).expect("qp");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("init");
        // Towards a port nobody listens on: what is sent is dropped by the kernel.
        let av = AddressVector { udp_dport: 9, ..AddressVector::new(Gid::from_ip(local), 0) };
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rtr(av, Mtu::Mtu1024, 0x99, 0)).expect("rtr");
        engine.modify_qp(Time::ZERO, qpn, &QpAttr::to_rts(0)).expect("rts");
        let mut tx = TxBuffers::new(false, false);
        assert!(tx.bufs.is_empty(), "a new device holds no datagram buffers");
        let post = |engine: &mut Engine, n: u64| {
            for id in 0..n {
                engine.post_send(Time::ZERO, qpn, &SendWr::inline(id, SendOp::Send, b"hello")).expect("post");
            }
        };
        post(&mut engine, 3);
        assert_eq!(tx.fill(&socket, &mut engine, Time::ZERO), 3);
        assert_eq!(tx.bufs.len(), 3, "one buffer per datagram of the batch");
        tx.send_filled(&socket);
        post(&mut engine, 1);
        assert_eq!(tx.fill(&socket, &mut engine, Time::ZERO), 1);
        assert_eq!(tx.bufs.len(), 3, "buffers are kept for the batches after");
        tx.send_filled(&socket);
        assert_eq!(tx.fill(&socket, &mut engine, Time::ZERO), 0);
        assert_eq!(tx.bufs.len(), 3);
    }
}
