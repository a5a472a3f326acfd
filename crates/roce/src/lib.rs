//! `lightpath-roce`: a sans-I/O RoCE v2 Reliable Connected (RC) transport engine.
//!
//! An [`Engine`] is one RoCE v2 "device" with one local address (GID index 0). It owns the
//! queue pairs, the completion queues and the table of registered memory regions, and it is
//! driven entirely from outside — it never opens a socket, reads a clock, starts a thread or
//! draws a random number, so the same inputs always give the same outputs:
//!
//! | driver calls | meaning |
//! |---|---|
//! | [`Engine::handle_datagram`] | a UDP payload (BTH … ICRC) arrived from IP `from` to local IP `to` |
//! | [`Engine::poll_transmit`] | the next datagram to send, written into the caller's buffer |
//! | [`Engine::poll_timeout`] / [`Engine::handle_timeout`] | when to call back for timers, and the call |
//! | [`Engine::poll_event`] | notifications (a CQ gained entries, a QP failed) to wake waiters |
//! | `reg_mr`, `create_cq`, `create_qp`, `modify_qp`, `post_send`, `post_recv`, `poll_cq` | verbs |
//!
//! After any call that may produce output (`post_send`, `handle_datagram`, `handle_timeout`,
//! `modify_qp`) the driver calls `poll_transmit` until it returns `None`, sends each datagram
//! to its `dst` and `dst_port` (the queue pair's address-vector `udp_dport`, or the configured
//! RoCE port, 4791, when that is 0) from the engine's own IP and the given UDP source port,
//! and then sleeps until `poll_timeout` (or the next datagram). Received datagrams are
//! matched to queue pairs by QPN and peer IP, never by UDP port. [`Time`] is a
//! nanosecond count from an epoch the driver chooses.
//!
//! # Structure
//!
//! The engine follows quinn-proto's split between a deterministic protocol core and thin
//! drivers, and rxe's split of a queue pair into three parts:
//!
//! * **requester** (`qp/requester.rs`): turns send work requests into request packets —
//!   segmentation by path MTU, 24-bit PSN assignment, AckReq on the last packet of every
//!   message and on every 64th packet of long ones, the 128-PSN window, `max_rd_atomic`,
//!   fences, and resumption mid-message after go-back-N (SEND/WRITE continue with
//!   MIDDLE/LAST; a READ is reissued for the remaining sub-range);
//! * **completer** (`qp/completer.rs`): matches ACKs, NAKs, READ responses and atomic ACKs with
//!   outstanding requests, writes READ data and atomic results into local memory, completes
//!   work requests in order, and drives recovery: the retransmit timer
//!   (4.096 µs × 2^`timeout`, 0 = none), `retry_cnt`, RNR waits and `rnr_retry`;
//! * **responder** (`qp/responder.rs`, `qp/responses.rs`): checks and executes incoming
//!   requests (PSN, opcode sequence, the QP's access flags, receive resources, lengths,
//!   R_Key/bounds/permissions, atomic alignment), posts receive completions, and queues
//!   coalesced ACKs, NAKs, READ responses and atomic ACKs in execution order. Duplicates are
//!   re-ACKed (PSN = ePSN − 1), duplicate READs re-executed from the responder resources
//!   (sub-ranges allowed) and duplicate atomics answered from the stored original value.
//!
//! Around them: `qp/state.rs` (the RESET→INIT→RTR→RTS/SQD/ERR state machine),
//! `memory.rs` (the region table: every access is checked against key, bounds and flags
//! before [`RegionMemory`] is called), `cq.rs`, `engine.rs` (routing by QPN in O(1),
//! round-robin transmit scheduling, the timer heap) and `stats.rs`.
//!
//! # Guarantees
//!
//! * Nothing panics on network input: every datagram is either processed or counted under
//!   exactly one `drops_*` counter of [`EngineStats`] (malformed, bad ICRC, unknown QPN,
//!   wrong state, wrong peer address, unsupported opcode, unexpected response, …).
//! * Memory is bounded per queue pair by its capabilities: send/receive rings are allocated
//!   at creation, the responder's resource ring and output queue at RTR. Steady-state
//!   traffic allocates nothing per packet.
//! * Payload is copied once on each side: from registered memory straight into the datagram
//!   buffer, and from the datagram straight into registered memory.
//! * ICRCs are sealed on transmit (as sent from an unconnected UDP socket with
//!   `IP_PMTUDISC_DO`: IPv4 ID 0, DF) and verified on receive when
//!   [`EngineConfig::verify_icrc`] is set.
//!
//! # Choices where the specifications leave room (or rxe differs)
//!
//! * **Unsignaled WRs** are released when they are acknowledged (not when a later signaled
//!   WR completes); they report errors and flushes like signaled ones.
//! * **`retry_cnt` = 7** is a count of seven retries, as the verbs specification says. rxe
//!   treats 7 as infinite; an application that relies on that against this engine gets
//!   RETRY_EXC_ERR after eight transmissions. **`rnr_retry` = 7** is infinite (both agree).
//! * **Receive buffer too small** for an incoming SEND: the receive completes with
//!   LOC_LEN_ERR (the specification's status; rxe reports REM_INV_REQ_ERR), the sender gets
//!   NAK invalid request (REM_INV_REQ_ERR), and both queue pairs go to ERR.
//! * **SEND with invalidate** withdraws all remote access from the region whose rkey it
//!   names, until that region is deregistered and registered again; local access stays. An
//!   rkey that names no region gets NAK remote access error and the receive fails with
//!   LOC_PROT_ERR.
//! * **Responder errors** (class C: invalid request, remote access, operational) NAK and move
//!   the responder's queue pair to ERR, as rxe does. Access the QP itself does not allow
//!   (its INIT access flags), misaligned atomics and bad lengths are "invalid request"
//!   (0x61); a bad R_Key, a range outside the region or a missing region permission is
//!   "remote access error" (0x62).
//! * **Responses that arrive out of order** (a later READ response packet, the answer to a
//!   later atomic) are kept and placed at once (rxe drops them). When the responder has
//!   executed past a READ/atomic whose response is missing — a later response, an **ACK past
//!   it** or a NAK arrived first — that request alone is asked for again at once, as rxe
//!   does, but at most once per round trip, and a READ only for its first missing run; such
//!   fast retries spend no `retry_cnt`. A **fatal NAK** behind an unanswered READ/atomic is
//!   kept while that request is retried: if its answer was only overtaken, the NAKed request
//!   then fails with its own error; if it was lost, the oldest request ends in
//!   RETRY_EXC_ERR. No flush is ever reported before an error.
//! * **Go-back-N** resends from the PSN a sequence NAK names (not from an earlier READ still
//!   being answered), follows at most one sequence NAK per round trip, halves the send window
//!   (every acknowledged PSN widens it again, up to rxe's 128), and if the answers stop during
//!   the recovery it resends after a few round trips (backing off, spending no retry) instead
//!   of waiting for the retransmit timer. None of this changes the wire format; it keeps
//!   reordering and loss from turning into floods of retransmissions or RETRY_EXC_ERR.
//! * **Keys**: an lkey and the rkey of the same region differ (bit 31), so one used in the
//!   other's place is refused.
#![forbid(unsafe_code)]

mod config;
mod cq;
mod engine;
mod event;
mod memory;
mod qp;
mod sgl;
mod sport;
mod stats;
mod time;

pub use config::EngineConfig;
pub use cq::CqHandle;
pub use engine::{Engine, ACK_DATAGRAM_LEN, MAX_DATAGRAM};
pub use event::{EngineEvent, Gathered, Transmit};
pub use memory::{MrKeys, RegionMemory, VecMemory};
pub use stats::{EngineStats, QpStats};
pub use time::Time;

#[cfg(test)]
mod tests {
    #[test]
    fn engine_can_move_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Engine>();
        assert_send_sync::<crate::VecMemory>();
    }
}
