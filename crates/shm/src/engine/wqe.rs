//! Work requests as queued inside a queue pair.

use lightpath_verbs::{SendOp, WcOpcode, WcStatus};

use super::sge::SgeList;

/// Where a send request's bytes come from.
#[derive(Debug)]
pub(crate) enum Payload {
    /// Gathered from registered memory when the request is carried out.
    Sges(SgeList),
    /// Copied at post time.
    Inline(Vec<u8>),
}

/// How far a send request has got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Not carried out yet, or a message only partly in the ring.
    Pending {
        /// Message bytes already in the ring.
        pushed: u32,
        /// The message number, once its first piece is in the ring.
        message: Option<u64>,
        /// A WRITE with immediate whose data has been written already.
        data_written: bool,
    },
    /// In the peer's ring as message `message`; done when the peer acknowledges it.
    AwaitAck { message: u64 },
    /// Finished (one-sided operations finish when carried out; failures finish at once).
    Done { status: WcStatus, byte_len: u32 },
}

impl Stage {
    pub(crate) const NEW: Stage = Stage::Pending { pushed: 0, message: None, data_written: false };
}

/// A send work request.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
    pub(crate) payload: Payload,
    /// Total payload bytes.
    pub(crate) len: u32,
    pub(crate) stage: Stage,
}

impl SendWqe {
    /// The completion opcode of this request.
    pub(crate) fn opcode(&self) -> WcOpcode {
        match self.op {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => WcOpcode::Send,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
}

/// A receive work request.
#[derive(Debug)]
pub(crate) struct RecvWqe {
    pub(crate) wr_id: u64,
    pub(crate) sges: SgeList,
    /// Total bytes the entries can take.
    pub(crate) capacity: u64,
}
