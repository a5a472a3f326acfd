//! Engine counters. Every datagram the engine refuses is counted under exactly one `drops_*`
//! reason, so a driver (or the simulator) can account for every byte it handed in.

/// Counters, including a count for every kind of dropped datagram.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Datagrams handed to `handle_datagram`.
    pub rx_datagrams: u64,
    /// Bytes (UDP payload: BTH to ICRC) of the datagrams handed to `handle_datagram`.
    pub rx_bytes: u64,
    /// Acknowledgement bundles among the datagrams handed in: each held two packets, and
    /// both are counted in `rx_datagrams` (see `Engine::handle_datagram`).
    pub rx_bundles: u64,
    /// Datagrams returned by `poll_transmit`.
    pub tx_datagrams: u64,
    /// Bytes (UDP payload: BTH to ICRC) of the datagrams returned by `poll_transmit`.
    pub tx_bytes: u64,
    /// Not a parseable RoCE v2 RC packet (truncated, bad lengths, unknown opcode, bad P_Key…).
    pub drops_malformed: u64,
    /// The ICRC did not match.
    pub drops_icrc: u64,
    /// No queue pair with the destination QPN.
    pub drops_unknown_qp: u64,
    /// The queue pair's state does not accept this packet (e.g. a request before RTR).
    pub drops_bad_state: u64,
    /// Source or destination IP does not match the queue pair's path.
    pub drops_wrong_peer: u64,
    /// A valid RoCE opcode this engine does not serve (UD, UC, CNP, FLUSH, …).
    pub drops_unsupported: u64,
    /// A response (ACK, read response, atomic ACK) that matches no outstanding request, or
    /// does not fit the request it names.
    pub drops_unexpected_response: u64,
    /// Requests dropped silently after a PSN sequence NAK, until the gap is filled.
    pub drops_out_of_sequence: u64,
    /// Duplicate READ/atomic requests with no matching responder resource (rxe drops these).
    pub drops_stale_duplicate: u64,
    /// Requests dropped because the responder's output queue was full (the requester retries).
    pub drops_responder_busy: u64,
    /// Responses older than anything outstanding (duplicate ACKs and the like), ignored.
    pub stale_responses: u64,
    /// Duplicate requests (answered without re-executing SEND/WRITE/atomics).
    pub duplicates: u64,
    /// Request packets sent again (go-back-N after a timeout, NAK or RNR NAK).
    pub retransmits: u64,
    /// Retransmit-timer expiries that found requests outstanding.
    pub timeouts: u64,
    /// ACKs sent (not counting NAKs).
    pub acks_sent: u64,
    /// NAKs sent (sequence error, invalid request, remote access and operational errors).
    pub naks_sent: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// NAKs received (all kinds except RNR).
    pub naks_received: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Completions dropped because their completion queue was full.
    pub cq_overflows: u64,
    /// Datagrams built but not handed out because their ICRC could not be computed (an
    /// address pair the ICRC cannot cover; not expected in practice).
    pub tx_errors: u64,
}

impl EngineStats {
    /// Every datagram the engine refused, whatever the reason (the sum of the `drops_*`
    /// counters; drivers can compare it with `rx_datagrams` without listing the fields).
    pub fn total_drops(&self) -> u64 {
        self.drops_malformed
            + self.drops_icrc
            + self.drops_unknown_qp
            + self.drops_bad_state
            + self.drops_wrong_peer
            + self.drops_unsupported
            + self.drops_unexpected_response
            + self.drops_out_of_sequence
            + self.drops_stale_duplicate
            + self.drops_responder_busy
    }
}

/// Counters of one queue pair: what a connection sent and received, and what recovery it
/// needed. Datagrams that never reach a queue pair (malformed, unknown QPN, wrong peer) are
/// only in the engine's [`EngineStats`]; an ICRC failure is counted here too when the
/// datagram named this queue pair and came from its peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpStats {
    /// Datagrams from the peer that passed the checks and reached the queue pair.
    pub rx_datagrams: u64,
    /// Their bytes (UDP payload: BTH to ICRC).
    pub rx_bytes: u64,
    /// Datagrams the queue pair sent.
    pub tx_datagrams: u64,
    /// Their bytes (UDP payload: BTH to ICRC).
    pub tx_bytes: u64,
    /// Request packets sent again.
    pub retransmits: u64,
    /// Retransmit-timer expiries that found requests outstanding.
    pub timeouts: u64,
    /// NAKs sent (all kinds except RNR).
    pub naks_sent: u64,
    /// NAKs received (all kinds except RNR).
    pub naks_received: u64,
    /// RNR NAKs sent (a request found no posted receive).
    pub rnr_naks_sent: u64,
    /// RNR NAKs received: each is one wait before the requester resumes.
    pub rnr_naks_received: u64,
    /// Datagrams from the peer for this queue pair whose ICRC did not match (dropped).
    pub drops_icrc: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_drops_sums_every_drop_counter() {
        let stats = EngineStats {
            drops_malformed: 1,
            drops_icrc: 2,
            drops_unknown_qp: 4,
            drops_bad_state: 8,
            drops_wrong_peer: 16,
            drops_unsupported: 32,
            drops_unexpected_response: 64,
            drops_out_of_sequence: 128,
            drops_stale_duplicate: 256,
            drops_responder_busy: 512,
            duplicates: 1024,
            stale_responses: 2048,
            ..EngineStats::default()
        };
        assert_eq!(stats.total_drops(), 1023);
    }
}
