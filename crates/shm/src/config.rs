//! How an shm device is set up: ring sizes, how long waiters spin before they sleep, when the
//! device's driver thread steps in, and who may connect.

use std::time::Duration;

/// The configuration of one [`ShmDevice`](crate::ShmDevice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Name reported by `Device::name` (default `shm`).
    pub name: Option<String>,
    /// Bytes of each queue pair's outgoing ring (a power of two, 4 KiB … 256 MiB; default 1 MiB).
    /// Larger rings let more data be in flight before a sender has to wait for its peer.
    pub ring_bytes: usize,
    /// Largest piece of a message one ring record carries (default 64 KiB; at most a quarter of
    /// the ring minus 32). Big messages move in pieces so the receiver copies one piece out
    /// while the sender copies the next one in.
    pub max_fragment: u32,
    /// SENDs of at least this many bytes (from at most 32 scatter/gather entries) are sent as
    /// descriptors of where the bytes are, and the receiver copies them straight out of the
    /// sender's region: one copy instead of two (default 32 KiB; `u32::MAX` turns it off). The
    /// receiver maps the source region read-only for this, so a peer can read the regions this
    /// side sends large messages from.
    pub direct_min: u32,
    /// How long `CompletionQueue::wait` polls before it blocks (waking a blocked thread costs
    /// microseconds, a poll a fraction of one). Only as many threads of a device spin at once
    /// as half the machine's cores (at least one); the others block at once, leaving the cores
    /// to the threads that have work.
    pub spin: Duration,
    /// When the application has not polled the device for this long, the driver thread takes
    /// over: it sleeps until a peer rings the device's doorbell, then processes arrivals so
    /// peers' sends complete and notification fds fire. While the application polls, peers
    /// never make a system call to wake anyone.
    pub idle_after: Duration,
    /// How long to wait for a peer device to answer a question (the descriptor of a memory
    /// region it owns) before the link is considered dead.
    pub rpc_timeout: Duration,
    /// Accept connections from processes of other users (default false: same user only).
    pub allow_other_users: bool,
    /// Most queue pairs.
    pub max_qps: u32,
    /// Most memory regions.
    pub max_mrs: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            name: None,
            ring_bytes: 1 << 20,
            max_fragment: 64 << 10,
            direct_min: 32 << 10,
            spin: Duration::from_micros(50),
            idle_after: Duration::from_millis(1),
            rpc_timeout: Duration::from_secs(5),
            allow_other_users: false,
            max_qps: 4096,
            max_mrs: 65536,
            max_cqe: 1 << 20,
        }
    }
}

impl ShmConfig {
    /// Smallest ring accepted.
    pub const MIN_RING: usize = 4096;
    /// Largest ring accepted.
    pub const MAX_RING: usize = 256 << 20;

    /// Checks the sizes; returns what is wrong.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !self.ring_bytes.is_power_of_two() || !(Self::MIN_RING..=Self::MAX_RING).contains(&self.ring_bytes)
        {
            return Err("ring_bytes must be a power of two between 4 KiB and 256 MiB");
        }
        if self.max_fragment == 0 || self.max_fragment > crate::ring::max_payload_for(self.ring_bytes) {
            return Err("max_fragment must be between 1 and a quarter of the ring minus 32 bytes");
        }
        Ok(())
    }
}
