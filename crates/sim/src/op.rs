//! The kinds of work request the workload posts and the negative cases it injects.

use std::fmt;
use std::str::FromStr;

use lightpath_verbs::{WcOpcode, WcStatus};
use serde::Serialize;

/// A send-queue operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendImm,
    /// SEND with invalidate (of a responder R_Key).
    SendInv,
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate data.
    WriteImm,
    /// RDMA READ.
    Read,
    /// Atomic compare-and-swap.
    CmpSwap,
    /// Atomic fetch-and-add.
    FetchAdd,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 8] = [
        OpKind::Send,
        OpKind::SendImm,
        OpKind::SendInv,
        OpKind::Write,
        OpKind::WriteImm,
        OpKind::Read,
        OpKind::CmpSwap,
        OpKind::FetchAdd,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::SendImm => "send_imm",
            OpKind::SendInv => "send_inv",
            OpKind::Write => "write",
            OpKind::WriteImm => "write_imm",
            OpKind::Read => "read",
            OpKind::CmpSwap => "cmp_swap",
            OpKind::FetchAdd => "fetch_add",
        }
    }

    /// Whether the operation consumes a receive request at the responder.
    pub fn consumes_recv(self) -> bool {
        matches!(self, OpKind::Send | OpKind::SendImm | OpKind::SendInv | OpKind::WriteImm)
    }

    /// Whether the operation is an atomic.
    pub fn is_atomic(self) -> bool {
        matches!(self, OpKind::CmpSwap | OpKind::FetchAdd)
    }

    /// Whether the operation carries data from the requester (SEND or WRITE family).
    pub fn carries_payload(self) -> bool {
        matches!(self, OpKind::Send | OpKind::SendImm | OpKind::SendInv | OpKind::Write | OpKind::WriteImm)
    }

    /// Whether the operation writes responder memory through an R_Key.
    pub fn writes_remote(self) -> bool {
        matches!(self, OpKind::Write | OpKind::WriteImm | OpKind::CmpSwap | OpKind::FetchAdd)
    }

    /// Whether the operation addresses responder memory through an R_Key at all.
    pub fn is_remote_access(self) -> bool {
        self.writes_remote() || self == OpKind::Read
    }

    /// The opcode of the requester's completion.
    pub fn send_wc_opcode(self) -> WcOpcode {
        match self {
            OpKind::Send | OpKind::SendImm | OpKind::SendInv => WcOpcode::Send,
            OpKind::Write | OpKind::WriteImm => WcOpcode::RdmaWrite,
            OpKind::Read => WcOpcode::RdmaRead,
            OpKind::CmpSwap => WcOpcode::CompSwap,
            OpKind::FetchAdd => WcOpcode::FetchAdd,
        }
    }

    /// The opcode of the responder's receive completion, for kinds that consume a receive.
    pub fn recv_wc_opcode(self) -> Option<WcOpcode> {
        match self {
            OpKind::Send | OpKind::SendImm | OpKind::SendInv => Some(WcOpcode::Recv),
            OpKind::WriteImm => Some(WcOpcode::RecvRdmaWithImm),
            _ => None,
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OpKind {
    type Err = String;

    /// Accepts the report names and a few spellings of them (case-insensitive, `-` or `_`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let key = s.trim().to_ascii_lowercase().replace('-', "_");
        let kind = match key.as_str() {
            "send" => OpKind::Send,
            "send_imm" | "send_with_imm" => OpKind::SendImm,
            "send_inv" | "send_with_inv" => OpKind::SendInv,
            "write" | "rdma_write" => OpKind::Write,
            "write_imm" | "write_with_imm" | "rdma_write_imm" => OpKind::WriteImm,
            "read" | "rdma_read" => OpKind::Read,
            "cmp_swap" | "compare_swap" | "cas" => OpKind::CmpSwap,
            "fetch_add" | "faa" => OpKind::FetchAdd,
            _ => {
                let names: Vec<&str> = OpKind::ALL.iter().map(|k| k.name()).collect();
                return Err(format!("unknown operation {s:?} (expected one of {})", names.join(", ")));
            }
        };
        Ok(kind)
    }
}

/// A deliberately invalid remote access whose outcome is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Negative {
    /// An R_Key the responder never issued.
    BadRkey,
    /// A range that runs past the end of the region.
    OutOfBounds,
    /// A region registered without the needed remote permission.
    NoPermission,
    /// An atomic whose address is not 8-byte aligned.
    MisalignedAtomic,
}

impl Negative {
    /// The requester's completion status (digest §6.10: NAK 0x62 for keys, bounds and
    /// permissions, NAK 0x61 for a misaligned atomic).
    pub fn expected_status(self) -> WcStatus {
        match self {
            Negative::BadRkey | Negative::OutOfBounds | Negative::NoPermission => WcStatus::RemAccessErr,
            Negative::MisalignedAtomic => WcStatus::RemInvReqErr,
        }
    }

    /// The negative cases that apply to `kind`.
    pub fn applicable(kind: OpKind) -> &'static [Negative] {
        match kind {
            OpKind::Write | OpKind::Read => {
                &[Negative::BadRkey, Negative::OutOfBounds, Negative::NoPermission]
            }
            OpKind::CmpSwap | OpKind::FetchAdd => &[
                Negative::BadRkey,
                Negative::OutOfBounds,
                Negative::NoPermission,
                Negative::MisalignedAtomic,
            ],
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in OpKind::ALL {
            assert_eq!(kind.name().parse::<OpKind>(), Ok(kind));
        }
        assert_eq!("RDMA-WRITE".parse::<OpKind>(), Ok(OpKind::Write));
        assert!("nop".parse::<OpKind>().unwrap_err().contains("fetch_add"));
    }

    #[test]
    fn classes() {
        assert!(OpKind::WriteImm.consumes_recv());
        assert!(!OpKind::Write.consumes_recv());
        assert_eq!(OpKind::WriteImm.recv_wc_opcode(), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(OpKind::Read.recv_wc_opcode(), None);
        assert!(Negative::applicable(OpKind::Send).is_empty());
        assert_eq!(Negative::MisalignedAtomic.expected_status(), WcStatus::RemInvReqErr);
    }
}
