//! Counters of the UDP driver (the engine keeps its own, including every kind of drop).

use lightpath_roce::EngineStats;

/// What the driver saw on the socket, beyond what the engine counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// `recvmmsg` calls that returned at least one datagram.
    pub rx_batches: u64,
    /// `sendmmsg` calls.
    pub tx_batches: u64,
    /// Datagrams longer than any RoCE packet can be (cut by the kernel), dropped.
    pub drops_oversized: u64,
    /// Datagrams from an address family the socket should not see, dropped.
    pub drops_bad_source: u64,
    /// Datagrams the engine emitted that could not be sent (no route, wrong address family).
    pub tx_errors: u64,
    /// Socket receive errors.
    pub rx_errors: u64,
    /// Times the polling-mode helper thread drove the device because the application did not.
    pub assists: u64,
    /// Received messages that held several coalesced datagrams (receive offload).
    pub rx_coalesced: u64,
    /// Sent messages that carried several datagrams (segmentation offload).
    pub tx_segmented: u64,
    /// Sent datagrams that carried an acknowledgement in front of a request (bundles).
    pub tx_bundles: u64,
    /// Segmented sends the kernel refused (segmentation is then turned off for the device).
    pub segmentation_failures: u64,
    /// Times a queue pair's owner armed the queue pair's own UDP port to wait
    /// (`QueuePair::arm_waiter`, which takes a look at the port, or
    /// `QueuePair::arm_waiter_without_look`): its waits.
    pub port_armings: u64,
    /// Times the progress thread drained a queue pair's port because nobody had read it for a
    /// tick (its owner computed elsewhere, or was not woken): those datagrams waited one to
    /// two ticks (`PORT_TICK`, 1 ms) for their owner.
    pub port_rescues: u64,
    /// Times the progress thread sent answers (ACKs) held for a reply no reply took: those of
    /// one queue pair an arming held (counted per queue pair), or those its own drive held
    /// (counted once). They left up to a tick later than without the hold.
    pub late_answers: u64,
}

/// A snapshot of a soft device's counters.
#[derive(Clone, Debug, Default)]
pub struct SoftStats {
    /// The engine's counters (datagrams in and out, drops by reason, retransmissions, …).
    pub engine: EngineStats,
    /// The UDP driver's counters.
    pub driver: DriverStats,
}

impl SoftStats {
    /// Every received datagram the device dropped, whatever the reason (hostile or broken
    /// input, and the out-of-sequence and stale packets of normal loss recovery).
    pub fn total_drops(&self) -> u64 {
        let e = &self.engine;
        e.drops_malformed
            + e.drops_icrc
            + e.drops_unknown_qp
            + e.drops_bad_state
            + e.drops_wrong_peer
            + e.drops_unsupported
            + e.drops_unexpected_response
            + e.drops_out_of_sequence
            + e.drops_stale_duplicate
            + e.drops_responder_busy
            + self.driver.drops_oversized
            + self.driver.drops_bad_source
    }
}
