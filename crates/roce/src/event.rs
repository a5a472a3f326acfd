//! What the engine hands back to its driver besides datagrams: [`Transmit`] descriptors and
//! [`EngineEvent`] notifications, plus the per-call context the queue-pair code uses to post
//! completions and events.

use std::collections::VecDeque;
use std::net::IpAddr;

use lightpath_verbs::WorkCompletion;

use crate::cq::{CqHandle, CqTable, Pushed};
use crate::memory::MrTable;
use crate::stats::EngineStats;

/// A datagram written by `poll_transmit`: send `len` bytes of the buffer to `dst` at UDP port
/// `dst_port`, from the engine's address and UDP port `src_port`. The ICRC is sealed for
/// exactly these ports, so the driver must not send it anywhere else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// The peer's IP address.
    pub dst: IpAddr,
    /// UDP destination port: the queue pair's address-vector `udp_dport`, or the configured
    /// [`EngineConfig::roce_port`](crate::EngineConfig::roce_port) when that is 0.
    pub dst_port: u16,
    /// UDP source port (flow entropy, as rxe chooses it, or the configured fixed port).
    pub src_port: u16,
    /// Bytes written at the start of the buffer: the whole datagram (BTH … ICRC), or with
    /// `gathered` only its headers.
    pub len: usize,
    /// The peer solves for the IPv4 identification when it checks the ICRC (the queue pair's
    /// address vector says so: `lightpath_peer`), so the driver may let the kernel segment
    /// this datagram out of a larger send.
    pub segmentable: bool,
    /// The peer takes an acknowledgement and a request in one datagram (address vector
    /// `lightpath_bundles`), and this datagram leaves room for one in front of it (the two
    /// together fit wherever a full datagram of the queue pair does): the driver may put an RC
    /// Acknowledge of [`ACK_DATAGRAM_LEN`](crate::ACK_DATAGRAM_LEN) bytes for the same queue
    /// pair in front of it and send the two as one UDP datagram (see
    /// [`Engine::handle_datagram`](crate::Engine::handle_datagram)).
    pub bundles: bool,
    /// The payload is not in the buffer: it is `gathered.len` bytes of registered memory at
    /// `gathered.addr`, followed by `gathered.trailer` zero bytes (pad and ICRC, which a
    /// Lightpath peer does not check). Only with
    /// [`EngineConfig::gather_payloads`](crate::EngineConfig::gather_payloads).
    pub gathered: Option<Gathered>,
}

/// Payload bytes a datagram takes straight from registered memory, so the driver can hand
/// them to the kernel without copying them into its buffer first (`iovec`s: headers, payload,
/// trailer). The address stays valid until the region is deregistered (`Engine::dereg_mr`), so
/// a driver that holds the engine from `poll_transmit` to its system call may pass it to the
/// kernel; the bytes themselves may change under a racing application, as with any RDMA send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gathered {
    /// Address of the first payload byte.
    pub addr: usize,
    /// Payload bytes.
    pub len: usize,
    /// Zero bytes after the payload: pad to 4 bytes and the 4-byte ICRC field.
    pub trailer: usize,
}

/// Notifications for the driver, so it can wake whoever waits.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// A completion queue gained entries (at most one pending event per CQ).
    Completion(CqHandle),
    /// A queue pair entered the error state on its own (retry exhaustion, NAK, protection
    /// error…), not because the application asked.
    QpError {
        /// The queue pair.
        qpn: u32,
    },
    /// A queue pair made a completion (one event per completion, only while
    /// [`Engine::set_qp_news`](crate::Engine::set_qp_news) is on): a driver that gives queue
    /// pairs waiters of their own wakes exactly the one whose queue pair it is.
    QpNews {
        /// The queue pair.
        qpn: u32,
        /// Something the peer sent (a receive, a READ's or atomic's result) or an error, as
        /// opposed to the acknowledgement of this side's SEND or WRITE.
        arrival: bool,
    },
}

/// The engine-wide state a queue pair touches while it works.
pub(crate) struct Ctx<'a> {
    /// The driver takes payloads straight from registered memory (`gather_payloads`).
    pub(crate) gather: bool,
    pub(crate) mrs: &'a mut MrTable,
    pub(crate) cqs: &'a mut CqTable,
    pub(crate) stats: &'a mut EngineStats,
    pub(crate) events: &'a mut VecDeque<EngineEvent>,
    /// Queue [`EngineEvent::QpNews`] for every completion.
    pub(crate) qp_news: bool,
}

impl Ctx<'_> {
    /// Posts a completion to `cq` and queues a notification if the CQ had none pending.
    pub(crate) fn complete(&mut self, cq: CqHandle, wc: WorkCompletion) {
        let (qpn, arrival) = (wc.qp_num, wc.is_arrival());
        match self.cqs.push(cq, wc) {
            Pushed::StoredNotify => self.events.push_back(EngineEvent::Completion(cq)),
            Pushed::Stored => {}
            Pushed::Overflow | Pushed::Missing => self.stats.cq_overflows += 1,
        }
        // After the queue's own event (queued now, or still waiting from before): a driver
        // that marks the queue non-empty on that event, then looks whether the queue pair's
        // waiter is armed, never misses a waiter that armed and then found the queue empty.
        if self.qp_news {
            self.events.push_back(EngineEvent::QpNews { qpn, arrival });
        }
    }
}
