//! Building the headers of outgoing packets, and mapping (operation, position) to opcodes.

use lightpath_verbs::SendOp;
use lightpath_wire::{BthRepr, Opcode, Position, Psn, TransportHeader};

/// The BTH every packet of this engine carries: P_Key 0xFFFF, TVer 0, M 0, FECN/BECN 0 (the
/// pad count is filled in by `TransportHeader::emit` from the payload length).
pub(crate) fn header(
    opcode: Opcode,
    dest_qpn: u32,
    psn: Psn,
    ack_req: bool,
    solicited: bool,
) -> TransportHeader {
    TransportHeader {
        bth: BthRepr {
            opcode,
            solicited,
            mig_req: false,
            pad_count: 0,
            tver: 0,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            dest_qpn,
            ack_req,
            psn,
        },
        deth: None,
        reth: None,
        atomic_eth: None,
        aeth: None,
        atomic_ack: None,
        imm: None,
        ieth: None,
    }
}

/// Where packet `index` of an `count`-packet message sits.
pub(crate) fn position(index: u32, count: u32) -> Position {
    if count <= 1 {
        Position::Only
    } else if index == 0 {
        Position::First
    } else if index + 1 >= count {
        Position::Last
    } else {
        Position::Middle
    }
}

/// The opcode of a SEND or WRITE packet at `position`.
pub(crate) fn request_opcode(op: SendOp, position: Position) -> Opcode {
    use Position::*;
    match (op, position) {
        (SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. }, First) => {
            Opcode::RC_SEND_FIRST
        }
        (SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. }, Middle) => {
            Opcode::RC_SEND_MIDDLE
        }
        (SendOp::SendWithImm { .. }, Last) => Opcode::RC_SEND_LAST_WITH_IMMEDIATE,
        (SendOp::SendWithImm { .. }, Only) => Opcode::RC_SEND_ONLY_WITH_IMMEDIATE,
        (SendOp::SendWithInv { .. }, Last) => Opcode::RC_SEND_LAST_WITH_INVALIDATE,
        (SendOp::SendWithInv { .. }, Only) => Opcode::RC_SEND_ONLY_WITH_INVALIDATE,
        (SendOp::Send, Last) => Opcode::RC_SEND_LAST,
        (SendOp::Send, Only) => Opcode::RC_SEND_ONLY,
        (SendOp::WriteWithImm { .. }, Last) => Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
        (SendOp::WriteWithImm { .. }, Only) => Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        (_, First) => Opcode::RC_RDMA_WRITE_FIRST,
        (_, Middle) => Opcode::RC_RDMA_WRITE_MIDDLE,
        (_, Last) => Opcode::RC_RDMA_WRITE_LAST,
        (_, Only) => Opcode::RC_RDMA_WRITE_ONLY,
    }
}

/// The opcode of a READ response packet at `position`.
pub(crate) fn read_response_opcode(position: Position) -> Opcode {
    match position {
        Position::First => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
        Position::Middle => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
        Position::Last => Opcode::RC_RDMA_READ_RESPONSE_LAST,
        Position::Only => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
    }
}

/// Packets (and PSNs) a message of `length` bytes takes at path MTU `pmtu`:
/// max(1, ceil(length / pmtu)).
pub(crate) fn packet_count(length: u64, pmtu: u32) -> u32 {
    length.div_ceil(u64::from(pmtu)).max(1) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_and_counts() {
        assert_eq!(packet_count(0, 256), 1);
        assert_eq!(packet_count(256, 256), 1);
        assert_eq!(packet_count(257, 256), 2);
        assert_eq!(packet_count(1 << 31, 256), 1 << 23);
        assert_eq!(position(0, 1), Position::Only);
        assert_eq!(position(0, 3), Position::First);
        assert_eq!(position(1, 3), Position::Middle);
        assert_eq!(position(2, 3), Position::Last);
    }

    #[test]
    fn opcodes_by_operation() {
        let write = SendOp::Write { remote_addr: 0, rkey: 0 };
        let write_imm = SendOp::WriteWithImm { remote_addr: 0, rkey: 0, imm: 0 };
        assert_eq!(request_opcode(SendOp::Send, Position::Only), Opcode::RC_SEND_ONLY);
        assert_eq!(request_opcode(SendOp::SendWithImm { imm: 1 }, Position::First), Opcode::RC_SEND_FIRST);
        assert_eq!(
            request_opcode(SendOp::SendWithInv { rkey: 1 }, Position::Last),
            Opcode::RC_SEND_LAST_WITH_INVALIDATE
        );
        assert_eq!(request_opcode(write, Position::Middle), Opcode::RC_RDMA_WRITE_MIDDLE);
        assert_eq!(request_opcode(write_imm, Position::Only), Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE);
        assert_eq!(request_opcode(write_imm, Position::First), Opcode::RC_RDMA_WRITE_FIRST);
        assert_eq!(read_response_opcode(Position::Middle), Opcode::RC_RDMA_READ_RESPONSE_MIDDLE);
    }
}
