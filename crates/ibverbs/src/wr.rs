//! Work requests in their C form: Lightpath's [`SendWr`]/[`RecvWr`] turned into
//! `ibv_send_wr`/`ibv_recv_wr` with their scatter/gather arrays, checked against the queue
//! pair's granted sizes first (so that what is refused is refused with a clear error instead of
//! the device's `EINVAL`).

use lightpath_verbs::{Error, QpCaps, RecvWr, Result, SendOp, SendPayload, SendWr, Sge};

use crate::ffi::types::{
    wr_opcode, IbvAtomicWr, IbvRdmaWr, IbvRecvWr, IbvSendWr, IbvSendWrUnion, IbvSge, SEND_INLINE,
};

/// Largest message RC carries (2^31 bytes).
const MAX_MESSAGE: u64 = 1 << 31;

fn sge(sge: &Sge) -> IbvSge {
    IbvSge { addr: sge.addr, length: sge.length, lkey: sge.lkey }
}

/// Checks a send request against the queue pair's sizes.
pub(crate) fn check_send(wr: &SendWr<'_>, caps: &QpCaps) -> Result<()> {
    match wr.payload {
        SendPayload::Sges(sges) if sges.len() > caps.max_send_sge as usize => {
            return Err(Error::TooLarge("more scatter/gather entries than max_send_sge"));
        }
        SendPayload::Inline(bytes) if bytes.len() > caps.max_inline_data as usize => {
            return Err(Error::TooLarge("inline data larger than max_inline_data"));
        }
        _ => {}
    }
    if wr.payload.len() > MAX_MESSAGE {
        return Err(Error::TooLarge("message longer than 2^31 bytes"));
    }
    if wr.op.is_atomic() && wr.payload.len() != 8 {
        return Err(Error::InvalidAttribute("atomics need one 8-byte local buffer"));
    }
    Ok(())
}

/// Checks a receive request against the queue pair's sizes.
pub(crate) fn check_recv(wr: &RecvWr<'_>, caps: &QpCaps) -> Result<()> {
    if wr.sges.len() > caps.max_recv_sge as usize {
        return Err(Error::TooLarge("more scatter/gather entries than max_recv_sge"));
    }
    Ok(())
}

/// The C scatter/gather entries of a send request's payload (inline bytes become one entry
/// pointing at them: the device copies them while posting and needs no key for them).
pub(crate) fn send_sges<'a>(wr: &'a SendWr<'_>) -> impl Iterator<Item = IbvSge> + 'a {
    let (list, inline): (&[Sge], Option<&[u8]>) = match wr.payload {
        SendPayload::Sges(list) => (list, None),
        SendPayload::Inline(bytes) => (&[], (!bytes.is_empty()).then_some(bytes)),
    };
    list.iter().map(sge).chain(inline.map(|bytes| IbvSge {
        addr: bytes.as_ptr() as u64,
        length: bytes.len() as u32,
        lkey: 0,
    }))
}

/// Appends the C scatter/gather entries of `wr` to `sges` and returns the C request, whose
/// `sg_list` the caller points at the appended entries once `sges` no longer grows.
pub(crate) fn send_wr(wr: &SendWr<'_>, sges: &mut Vec<IbvSge>) -> IbvSendWr {
    let before = sges.len();
    sges.extend(send_sges(wr));
    send_header(wr, sges.len() - before)
}

/// The C send request for `wr` with `num_sge` entries (its `sg_list` still to be set).
pub(crate) fn send_header(wr: &SendWr<'_>, num_sge: usize) -> IbvSendWr {
    let mut flags = wr.flags.bits() & !SEND_INLINE;
    if matches!(wr.payload, SendPayload::Inline(_)) {
        flags |= SEND_INLINE;
    }
    let rdma = |remote_addr: u64, rkey: u32| IbvSendWrUnion { rdma: IbvRdmaWr { remote_addr, rkey } };
    let (opcode, imm, union) = match wr.op {
        SendOp::Send => (wr_opcode::SEND, 0, rdma(0, 0)),
        // Immediates travel big endian; Lightpath's field holds the value.
        SendOp::SendWithImm { imm } => (wr_opcode::SEND_WITH_IMM, imm.to_be(), rdma(0, 0)),
        SendOp::SendWithInv { rkey } => (wr_opcode::SEND_WITH_INV, rkey, rdma(0, 0)),
        SendOp::Write { remote_addr, rkey } => (wr_opcode::RDMA_WRITE, 0, rdma(remote_addr, rkey)),
        SendOp::WriteWithImm { remote_addr, rkey, imm } => {
            (wr_opcode::RDMA_WRITE_WITH_IMM, imm.to_be(), rdma(remote_addr, rkey))
        }
        SendOp::Read { remote_addr, rkey } => (wr_opcode::RDMA_READ, 0, rdma(remote_addr, rkey)),
        SendOp::CompareSwap { remote_addr, rkey, compare, swap } => (
            wr_opcode::ATOMIC_CMP_AND_SWP,
            0,
            IbvSendWrUnion { atomic: IbvAtomicWr { remote_addr, compare_add: compare, swap, rkey } },
        ),
        SendOp::FetchAdd { remote_addr, rkey, add } => (
            wr_opcode::ATOMIC_FETCH_AND_ADD,
            0,
            IbvSendWrUnion { atomic: IbvAtomicWr { remote_addr, compare_add: add, swap: 0, rkey } },
        ),
    };
    IbvSendWr {
        wr_id: wr.wr_id,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: num_sge as i32,
        opcode,
        send_flags: flags,
        imm_data_or_invalidate_rkey: imm,
        wr: union,
        qp_type_xrc_remote_srqn: 0,
        bind_mw_or_tso: [0; 6],
    }
}

/// Appends the C scatter/gather entries of `wr` to `sges` and returns the C request (its
/// `sg_list` is set by the caller, as for [`send_wr`]).
pub(crate) fn recv_wr(wr: &RecvWr<'_>, sges: &mut Vec<IbvSge>) -> IbvRecvWr {
    sges.extend(wr.sges.iter().map(sge));
    IbvRecvWr {
        wr_id: wr.wr_id,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: wr.sges.len() as i32,
    }
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::SendFlags;

    use super::*;

    fn caps() -> QpCaps {
        QpCaps { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 2, max_recv_sge: 1, max_inline_data: 64 }
    }

    #[test]
    fn atomics_fill_the_atomic_member() {
        let local = [Sge { addr: 0x1000, length: 8, lkey: 5 }];
        let op = SendOp::CompareSwap { remote_addr: 0x2000, rkey: 9, compare: 1, swap: 2 };
        let mut sges = Vec::new();
        let c = send_wr(&SendWr::new(3, op, &local), &mut sges);
        assert_eq!((c.opcode, c.num_sge, c.send_flags), (wr_opcode::ATOMIC_CMP_AND_SWP, 1, 2));
        // SAFETY: the atomic member was the one written.
        let atomic = unsafe { c.wr.atomic };
        assert_eq!((atomic.remote_addr, atomic.compare_add, atomic.swap, atomic.rkey), (0x2000, 1, 2, 9));
        assert_eq!((sges[0].addr, sges[0].length, sges[0].lkey), (0x1000, 8, 5));
    }

    #[test]
    fn immediates_are_big_endian_and_inline_sets_its_flag() {
        let mut sges = Vec::new();
        let op = SendOp::WriteWithImm { remote_addr: 8, rkey: 1, imm: 0x0102_0304 };
        let c = send_wr(&SendWr::inline(1, op, b"abc"), &mut sges);
        assert_eq!(c.imm_data_or_invalidate_rkey.to_ne_bytes(), [1, 2, 3, 4]);
        assert_eq!(c.send_flags, SendFlags::SIGNALED.bits() | SEND_INLINE);
        assert_eq!(sges[0].length, 3);
        let empty = send_wr(&SendWr::inline(2, SendOp::Send, b""), &mut sges);
        assert_eq!(empty.num_sge, 0);
    }

    #[test]
    fn oversized_requests_are_refused_before_the_device_sees_them() {
        let three = [Sge::default(); 3];
        assert!(matches!(
            check_send(&SendWr::new(1, SendOp::Send, &three), &caps()),
            Err(Error::TooLarge(_))
        ));
        let big = [0u8; 65];
        assert!(matches!(
            check_send(&SendWr::inline(1, SendOp::Send, &big), &caps()),
            Err(Error::TooLarge(_))
        ));
        let two = [Sge::default(); 2];
        assert!(matches!(check_recv(&RecvWr::new(1, &two), &caps()), Err(Error::TooLarge(_))));
        let short = [Sge { addr: 0, length: 4, lkey: 0 }];
        let op = SendOp::FetchAdd { remote_addr: 0, rkey: 0, add: 1 };
        assert!(matches!(check_send(&SendWr::new(1, op, &short), &caps()), Err(Error::InvalidAttribute(_))));
        assert!(check_send(&SendWr::new(1, SendOp::Send, &two), &caps()).is_ok());
    }
}
