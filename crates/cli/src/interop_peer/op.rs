//! The operations of the interop protocol (interop/PROTOCOL.md) and what each one involves.

use std::fmt;

/// One kind of operation the requester runs ITERS times. The discriminant is the protocol's
/// `opnum`, which enters the data patterns and the immediate values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// SEND into the responder's receive k.
    Send = 1,
    /// SEND with immediate `imm(k)`.
    SendImm = 2,
    /// RDMA WRITE into slot k.
    Write = 3,
    /// RDMA WRITE with immediate `imm(k)` into slot k.
    WriteImm = 4,
    /// RDMA READ of slot k.
    Read = 5,
    /// ATOMIC CMP_SWAP on the responder's word (ITERS + 1 operations).
    CmpSwap = 6,
    /// ATOMIC FETCH_ADD on the responder's word.
    FetchAdd = 7,
}

impl Op {
    /// Every operation, in `opnum` order.
    pub const ALL: [Op; 7] =
        [Op::Send, Op::SendImm, Op::Write, Op::WriteImm, Op::Read, Op::CmpSwap, Op::FetchAdd];

    /// The protocol's `opnum`.
    pub fn number(self) -> u32 {
        self as u32
    }

    /// The name on the command line and in the exchange.
    pub fn name(self) -> &'static str {
        match self {
            Op::Send => "send",
            Op::SendImm => "send_imm",
            Op::Write => "write",
            Op::WriteImm => "write_imm",
            Op::Read => "read",
            Op::CmpSwap => "cmp_swap",
            Op::FetchAdd => "fetch_add",
        }
    }

    /// The operation with this name.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }

    /// A clap value parser.
    pub fn parse(name: &str) -> Result<Op, String> {
        Op::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = Op::ALL.iter().map(|op| op.name()).collect();
            format!("unknown operation {name} (one of {})", names.join(", "))
        })
    }

    /// Bytes per operation when `-s` is not given.
    pub fn default_size(self) -> u64 {
        match self {
            Op::Read => 1 << 20,
            Op::CmpSwap | Op::FetchAdd => 8,
            _ => 10000,
        }
    }

    /// Whether the operation is an 8-byte atomic.
    pub fn is_atomic(self) -> bool {
        matches!(self, Op::CmpSwap | Op::FetchAdd)
    }

    /// Whether each operation consumes a receive at the responder.
    pub fn uses_recv(self) -> bool {
        matches!(self, Op::Send | Op::SendImm | Op::WriteImm)
    }

    /// Whether each operation carries immediate data.
    pub fn has_imm(self) -> bool {
        matches!(self, Op::SendImm | Op::WriteImm)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers() {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op.number(), i as u32 + 1);
            assert_eq!(Op::from_name(op.name()), Some(op));
        }
        assert_eq!(Op::from_name("atomic"), None);
        assert!(Op::parse("writ").unwrap_err().contains("write_imm"));
        assert_eq!(Op::Read.default_size(), 1_048_576);
        assert!(Op::WriteImm.uses_recv() && Op::WriteImm.has_imm() && !Op::Write.uses_recv());
    }
}
