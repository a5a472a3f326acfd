//! Work requests: what an application posts to a queue pair's send and receive queues.

use std::ops::{BitOr, BitOrAssign};

/// A scatter/gather element: `length` bytes at virtual address `addr` inside the memory region
/// whose local key is `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Sge {
    /// Virtual address (as the provider reported it for the region) of the first byte.
    pub addr: u64,
    /// Number of bytes.
    pub length: u32,
    /// Local key of the region that holds the bytes.
    pub lkey: u32,
}

/// Send flags (values as in libibverbs `ibv_send_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SendFlags(u32);

impl SendFlags {
    /// No flags: unsignaled, not solicited.
    pub const NONE: Self = Self(0);
    /// Wait for every earlier READ and atomic on this queue pair to complete first.
    pub const FENCE: Self = Self(1);
    /// Generate a work completion when the request completes successfully (errors always do).
    pub const SIGNALED: Self = Self(1 << 1);
    /// Set the solicited-event bit on the last packet (SEND and WRITE with immediate).
    pub const SOLICITED: Self = Self(1 << 2);
    /// The payload was given inline (see [`SendPayload::Inline`]); accepted for symmetry with
    /// libibverbs, which expresses inline data with this flag.
    pub const INLINE: Self = Self(1 << 3);

    /// Whether every flag in `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw libibverbs bit mask.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// From a raw libibverbs mask; unknown bits are refused.
    pub fn from_raw(bits: u32) -> Option<Self> {
        (bits & !0b1111 == 0).then_some(Self(bits))
    }
}

impl BitOr for SendFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for SendFlags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

/// The operation of a send work request and its operation-specific fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// Two-sided SEND, consuming a receive request at the peer.
    Send,
    /// SEND carrying 32 bits of immediate data (network byte order as given, passed through).
    SendWithImm { imm: u32 },
    /// SEND that invalidates the peer's memory window / region with key `rkey`.
    SendWithInv { rkey: u32 },
    /// One-sided RDMA WRITE to `remote_addr` in the peer region with key `rkey`.
    Write { remote_addr: u64, rkey: u32 },
    /// RDMA WRITE followed by a completion with `imm` at the peer (consumes a receive).
    WriteWithImm { remote_addr: u64, rkey: u32, imm: u32 },
    /// One-sided RDMA READ from the peer region into the local scatter list.
    Read { remote_addr: u64, rkey: u32 },
    /// 8-byte atomic compare-and-swap at an 8-byte aligned `remote_addr`; the original value is
    /// written to the local 8-byte scatter entry.
    CompareSwap { remote_addr: u64, rkey: u32, compare: u64, swap: u64 },
    /// 8-byte atomic fetch-and-add; the original value is written locally.
    FetchAdd { remote_addr: u64, rkey: u32, add: u64 },
}

impl SendOp {
    /// Whether the operation is a READ or an atomic (counted against `max_rd_atomic`).
    pub fn is_read_or_atomic(&self) -> bool {
        matches!(self, SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }

    /// Whether the operation is an atomic.
    pub fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
}

/// Where a send takes its bytes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendPayload<'a> {
    /// Gathered from registered memory at the time the provider transmits (zero copy).
    Sges(&'a [Sge]),
    /// Copied by the provider when the request is posted; the caller may reuse the buffer as
    /// soon as `post_send` returns. Limited by the queue pair's `max_inline_data`.
    Inline(&'a [u8]),
}

impl SendPayload<'_> {
    /// Total payload length in bytes (saturating; providers reject lengths over 2^31).
    pub fn len(&self) -> u64 {
        match self {
            SendPayload::Sges(sges) => sges.iter().map(|s| u64::from(s.length)).sum(),
            SendPayload::Inline(bytes) => bytes.len() as u64,
        }
    }

    /// Whether there is no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A send work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// Returned unchanged in the work completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The local bytes: source for SEND/WRITE, destination for READ and atomics (8 bytes).
    pub payload: SendPayload<'a>,
    /// Signaled, solicited, fence.
    pub flags: SendFlags,
}

impl<'a> SendWr<'a> {
    /// A signaled request with the given operation and scatter/gather list.
    pub fn new(wr_id: u64, op: SendOp, sges: &'a [Sge]) -> Self {
        Self { wr_id, op, payload: SendPayload::Sges(sges), flags: SendFlags::SIGNALED }
    }

    /// A signaled request whose payload is copied at post time.
    pub fn inline(wr_id: u64, op: SendOp, bytes: &'a [u8]) -> Self {
        Self {
            wr_id,
            op,
            payload: SendPayload::Inline(bytes),
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        }
    }

    /// Replaces the flags.
    pub fn with_flags(mut self, flags: SendFlags) -> Self {
        self.flags = flags;
        self
    }
}

/// A receive work request: where an incoming SEND (or WRITE with immediate's completion) lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr<'a> {
    /// Returned unchanged in the work completion.
    pub wr_id: u64,
    /// Destination buffers, filled in order.
    pub sges: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A receive request into `sges`.
    pub fn new(wr_id: u64, sges: &'a [Sge]) -> Self {
        Self { wr_id, sges }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_length_sums_sges() {
        let sges = [Sge { addr: 0, length: 10, lkey: 1 }, Sge { addr: 10, length: 4, lkey: 1 }];
        assert_eq!(SendPayload::Sges(&sges).len(), 14);
        assert_eq!(SendPayload::Inline(b"abc").len(), 3);
        assert!(SendPayload::Sges(&[]).is_empty());
    }

    #[test]
    fn flags() {
        let f = SendFlags::SIGNALED | SendFlags::SOLICITED;
        assert!(f.contains(SendFlags::SIGNALED));
        assert!(!f.contains(SendFlags::FENCE));
        assert_eq!(SendFlags::from_raw(f.bits()), Some(f));
        assert_eq!(SendFlags::from_raw(1 << 9), None);
        assert!(SendWr::inline(1, SendOp::Send, b"x").flags.contains(SendFlags::INLINE));
    }

    #[test]
    fn op_classes() {
        assert!(SendOp::Read { remote_addr: 0, rkey: 0 }.is_read_or_atomic());
        assert!(SendOp::FetchAdd { remote_addr: 0, rkey: 0, add: 1 }.is_atomic());
        assert!(!SendOp::Send.is_read_or_atomic());
    }
}
