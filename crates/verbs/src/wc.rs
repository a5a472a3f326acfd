//! Work completions: what a completion queue reports when a work request finishes.

use std::fmt;

/// Completion status. Discriminants are libibverbs' `ibv_wc_status` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// The request completed.
    Success,
    /// A local length error: e.g. a received SEND larger than the posted receive buffers.
    LocLenErr,
    /// A local queue-pair operation error (malformed work request).
    LocQpOpErr,
    /// A local protection error: an lkey that is invalid or does not cover the buffer.
    LocProtErr,
    /// The request was flushed because the queue pair entered the error state.
    WrFlushErr,
    /// The response did not match the request.
    BadRespErr,
    /// A local access error at the responder side of the receive.
    LocAccessErr,
    /// The peer NAKed the request as invalid (NAK 0x61).
    RemInvReqErr,
    /// The peer NAKed a remote access: bad R_Key, bounds or permissions (NAK 0x62).
    RemAccessErr,
    /// The peer could not complete the operation (NAK 0x63).
    RemOpErr,
    /// Transport retries (timeouts and sequence NAKs) exhausted `retry_cnt`.
    RetryExcErr,
    /// RNR NAK retries exhausted `rnr_retry`.
    RnrRetryExcErr,
    /// A fatal provider error.
    FatalErr,
    /// A status value this crate does not know, as reported by a provider.
    Other(u32),
}

impl WcStatus {
    /// The libibverbs numeric value.
    pub fn to_raw(self) -> u32 {
        match self {
            WcStatus::Success => 0,
            WcStatus::LocLenErr => 1,
            WcStatus::LocQpOpErr => 2,
            WcStatus::LocProtErr => 4,
            WcStatus::WrFlushErr => 5,
            WcStatus::BadRespErr => 7,
            WcStatus::LocAccessErr => 8,
            WcStatus::RemInvReqErr => 9,
            WcStatus::RemAccessErr => 10,
            WcStatus::RemOpErr => 11,
            WcStatus::RetryExcErr => 12,
            WcStatus::RnrRetryExcErr => 13,
            WcStatus::FatalErr => 19,
            WcStatus::Other(raw) => raw,
        }
    }

    /// From the libibverbs numeric value; unknown values are kept as [`WcStatus::Other`].
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            0 => WcStatus::Success,
            1 => WcStatus::LocLenErr,
            2 => WcStatus::LocQpOpErr,
            4 => WcStatus::LocProtErr,
            5 => WcStatus::WrFlushErr,
            7 => WcStatus::BadRespErr,
            8 => WcStatus::LocAccessErr,
            9 => WcStatus::RemInvReqErr,
            10 => WcStatus::RemAccessErr,
            11 => WcStatus::RemOpErr,
            12 => WcStatus::RetryExcErr,
            13 => WcStatus::RnrRetryExcErr,
            19 => WcStatus::FatalErr,
            other => WcStatus::Other(other),
        }
    }

    /// Whether this is [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }

    /// The string libibverbs' `ibv_wc_status_str` gives.
    pub fn as_str(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::FatalErr => "fatal error",
            WcStatus::Other(_) => "unknown",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Other(raw) => write!(f, "unknown status {raw}"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// The kind of request a completion belongs to. Discriminants are libibverbs' `ibv_wc_opcode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND (any variant) completed at the requester.
    Send,
    /// An RDMA WRITE (with or without immediate) completed at the requester.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// An atomic compare-and-swap completed.
    CompSwap,
    /// An atomic fetch-and-add completed.
    FetchAdd,
    /// A SEND arrived into a receive request.
    Recv,
    /// An RDMA WRITE with immediate arrived, consuming a receive request.
    RecvRdmaWithImm,
    /// An opcode this crate does not know, as reported by a provider.
    Other(u32),
}

impl WcOpcode {
    /// The libibverbs numeric value.
    pub fn to_raw(self) -> u32 {
        match self {
            WcOpcode::Send => 0,
            WcOpcode::RdmaWrite => 1,
            WcOpcode::RdmaRead => 2,
            WcOpcode::CompSwap => 3,
            WcOpcode::FetchAdd => 4,
            WcOpcode::Recv => 128,
            WcOpcode::RecvRdmaWithImm => 129,
            WcOpcode::Other(raw) => raw,
        }
    }

    /// From the libibverbs numeric value; unknown values are kept as [`WcOpcode::Other`].
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            0 => WcOpcode::Send,
            1 => WcOpcode::RdmaWrite,
            2 => WcOpcode::RdmaRead,
            3 => WcOpcode::CompSwap,
            4 => WcOpcode::FetchAdd,
            128 => WcOpcode::Recv,
            129 => WcOpcode::RecvRdmaWithImm,
            other => WcOpcode::Other(other),
        }
    }
}

/// One completed work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The `wr_id` the request was posted with.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was. For flushed requests providers report the posted opcode where known.
    pub opcode: WcOpcode,
    /// Bytes transferred: received bytes for receives, bytes read for READ, 8 for atomics.
    pub byte_len: u32,
    /// Immediate data of SEND/WRITE with immediate, as carried on the wire.
    pub imm_data: Option<u32>,
    /// R_Key invalidated by a SEND with invalidate.
    pub invalidated_rkey: Option<u32>,
    /// The local queue pair number.
    pub qp_num: u32,
    /// The remote queue pair number (receives only; for RC it is the connected peer).
    pub src_qp: u32,
    /// The solicited-event bit of the arriving message (receives only).
    pub solicited: bool,
    /// Provider-specific detail, 0 when none.
    pub vendor_err: u32,
}

impl WorkCompletion {
    /// Whether this is something a reader waits for: what the peer sent (a receive), a READ's
    /// or atomic's result, or an error; not the acknowledgement of this side's SEND or WRITE
    /// (see [`WakeFor::Arrivals`](crate::WakeFor::Arrivals)).
    pub fn is_arrival(&self) -> bool {
        !self.status.is_success() || !matches!(self.opcode, WcOpcode::Send | WcOpcode::RdmaWrite)
    }

    /// A completion with the given identity and status, every other field empty.
    pub fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Self {
        Self {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm_data: None,
            invalidated_rkey: None,
            qp_num,
            src_qp: 0,
            solicited: false,
            vendor_err: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_what_the_peer_sent_or_errors() {
        let wc = |status, opcode| WorkCompletion::new(1, status, opcode, 7);
        assert!(!wc(WcStatus::Success, WcOpcode::Send).is_arrival());
        assert!(!wc(WcStatus::Success, WcOpcode::RdmaWrite).is_arrival());
        assert!(wc(WcStatus::Success, WcOpcode::Recv).is_arrival());
        assert!(wc(WcStatus::Success, WcOpcode::RecvRdmaWithImm).is_arrival());
        assert!(wc(WcStatus::Success, WcOpcode::RdmaRead).is_arrival());
        assert!(wc(WcStatus::RetryExcErr, WcOpcode::Send).is_arrival());
    }

    #[test]
    fn status_raw_round_trip() {
        for raw in 0..32 {
            assert_eq!(WcStatus::from_raw(raw).to_raw(), raw);
        }
        assert_eq!(WcStatus::from_raw(12), WcStatus::RetryExcErr);
        assert_eq!(WcStatus::from_raw(3), WcStatus::Other(3));
        assert_eq!(WcStatus::RnrRetryExcErr.to_string(), "RNR retry counter exceeded");
    }

    #[test]
    fn opcode_raw_round_trip() {
        for raw in [0, 1, 2, 3, 4, 5, 128, 129, 130] {
            assert_eq!(WcOpcode::from_raw(raw).to_raw(), raw);
        }
        assert_eq!(WcOpcode::from_raw(129), WcOpcode::RecvRdmaWithImm);
    }
}
