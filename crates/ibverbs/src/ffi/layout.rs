//! Sizes, offsets and constants of the mirrored C definitions, each paired with the C expression
//! that gives the same number from rdma-core's real header. `tests/layout.rs` compiles those
//! expressions with gcc where `<infiniband/verbs.h>` is installed and compares.

use std::mem::{offset_of, size_of};

use lightpath_verbs::{AccessFlags, Mtu, PortState, QpState, SendFlags, WcOpcode, WcStatus};

use super::types::*;

/// One number to check: a label, the C expression computing it, and the value Rust uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutFact {
    /// A short name for messages.
    pub label: &'static str,
    /// A C expression (with `<infiniband/verbs.h>` and `<stddef.h>` included).
    pub c_expr: &'static str,
    /// What the Rust side uses.
    pub rust: u64,
}

macro_rules! fact {
    ($label:literal, $c:literal, $rust:expr) => {
        LayoutFact { label: $label, c_expr: $c, rust: ($rust) as u64 }
    };
}

/// Every fact the provider relies on.
pub fn rust_layout() -> Vec<LayoutFact> {
    let ops = offset_of!(IbvContext, ops);
    vec![
        // Structures passed by value or allocated by Lightpath: full size and every field used.
        fact!("sizeof ibv_gid", "sizeof(union ibv_gid)", size_of::<IbvGid>()),
        fact!("sizeof ibv_gid_entry", "sizeof(struct ibv_gid_entry)", size_of::<IbvGidEntry>()),
        fact!(
            "ibv_gid_entry.gid_index",
            "offsetof(struct ibv_gid_entry, gid_index)",
            offset_of!(IbvGidEntry, gid_index)
        ),
        fact!(
            "ibv_gid_entry.gid_type",
            "offsetof(struct ibv_gid_entry, gid_type)",
            offset_of!(IbvGidEntry, gid_type)
        ),
        fact!("sizeof ibv_device_attr", "sizeof(struct ibv_device_attr)", size_of::<IbvDeviceAttr>()),
        fact!(
            "ibv_device_attr.max_mr_size",
            "offsetof(struct ibv_device_attr, max_mr_size)",
            offset_of!(IbvDeviceAttr, max_mr_size)
        ),
        fact!(
            "ibv_device_attr.max_qp",
            "offsetof(struct ibv_device_attr, max_qp)",
            offset_of!(IbvDeviceAttr, max_qp)
        ),
        fact!(
            "ibv_device_attr.max_qp_init_rd_atom",
            "offsetof(struct ibv_device_attr, max_qp_init_rd_atom)",
            offset_of!(IbvDeviceAttr, max_qp_init_rd_atom)
        ),
        fact!(
            "ibv_device_attr.atomic_cap",
            "offsetof(struct ibv_device_attr, atomic_cap)",
            offset_of!(IbvDeviceAttr, atomic_cap)
        ),
        fact!(
            "ibv_device_attr.phys_port_cnt",
            "offsetof(struct ibv_device_attr, phys_port_cnt)",
            offset_of!(IbvDeviceAttr, phys_port_cnt)
        ),
        // The port attribute mirror carries spare room after the header's fields.
        fact!("sizeof ibv_port_attr", "sizeof(struct ibv_port_attr)", offset_of!(IbvPortAttr, spare)),
        fact!(
            "ibv_port_attr.gid_tbl_len",
            "offsetof(struct ibv_port_attr, gid_tbl_len)",
            offset_of!(IbvPortAttr, gid_tbl_len)
        ),
        fact!(
            "ibv_port_attr.link_layer",
            "offsetof(struct ibv_port_attr, link_layer)",
            offset_of!(IbvPortAttr, link_layer)
        ),
        fact!(
            "ibv_port_attr.port_cap_flags2",
            "offsetof(struct ibv_port_attr, port_cap_flags2)",
            offset_of!(IbvPortAttr, port_cap_flags2)
        ),
        // The ops table, reached through library-owned contexts: offsets of the slots called.
        fact!("sizeof ibv_context_ops", "sizeof(struct ibv_context_ops)", size_of::<IbvContextOps>()),
        fact!(
            "ibv_context.ops.poll_cq",
            "offsetof(struct ibv_context, ops.poll_cq)",
            ops + offset_of!(IbvContextOps, poll_cq)
        ),
        fact!(
            "ibv_context.ops.req_notify_cq",
            "offsetof(struct ibv_context, ops.req_notify_cq)",
            ops + offset_of!(IbvContextOps, req_notify_cq)
        ),
        fact!(
            "ibv_context.ops.post_send",
            "offsetof(struct ibv_context, ops.post_send)",
            ops + offset_of!(IbvContextOps, post_send)
        ),
        fact!(
            "ibv_context.ops.post_recv",
            "offsetof(struct ibv_context, ops.post_recv)",
            ops + offset_of!(IbvContextOps, post_recv)
        ),
        fact!(
            "ibv_context.num_comp_vectors",
            "offsetof(struct ibv_context, num_comp_vectors)",
            offset_of!(IbvContext, num_comp_vectors)
        ),
        fact!("ibv_comp_channel.fd", "offsetof(struct ibv_comp_channel, fd)", offset_of!(IbvCompChannel, fd)),
        fact!("ibv_cq.context", "offsetof(struct ibv_cq, context)", offset_of!(IbvCq, context)),
        fact!("ibv_cq.cqe", "offsetof(struct ibv_cq, cqe)", offset_of!(IbvCq, cqe)),
        fact!("ibv_qp.context", "offsetof(struct ibv_qp, context)", offset_of!(IbvQp, context)),
        fact!("ibv_qp.qp_num", "offsetof(struct ibv_qp, qp_num)", offset_of!(IbvQp, qp_num)),
        fact!("ibv_mr.addr", "offsetof(struct ibv_mr, addr)", offset_of!(IbvMr, addr)),
        fact!("ibv_mr.length", "offsetof(struct ibv_mr, length)", offset_of!(IbvMr, length)),
        fact!("ibv_mr.lkey", "offsetof(struct ibv_mr, lkey)", offset_of!(IbvMr, lkey)),
        fact!("ibv_mr.rkey", "offsetof(struct ibv_mr, rkey)", offset_of!(IbvMr, rkey)),
        fact!("sizeof ibv_sge", "sizeof(struct ibv_sge)", size_of::<IbvSge>()),
        fact!("ibv_sge.lkey", "offsetof(struct ibv_sge, lkey)", offset_of!(IbvSge, lkey)),
        fact!("sizeof ibv_send_wr", "sizeof(struct ibv_send_wr)", size_of::<IbvSendWr>()),
        fact!("ibv_send_wr.next", "offsetof(struct ibv_send_wr, next)", offset_of!(IbvSendWr, next)),
        fact!("ibv_send_wr.sg_list", "offsetof(struct ibv_send_wr, sg_list)", offset_of!(IbvSendWr, sg_list)),
        fact!("ibv_send_wr.num_sge", "offsetof(struct ibv_send_wr, num_sge)", offset_of!(IbvSendWr, num_sge)),
        fact!("ibv_send_wr.opcode", "offsetof(struct ibv_send_wr, opcode)", offset_of!(IbvSendWr, opcode)),
        fact!(
            "ibv_send_wr.send_flags",
            "offsetof(struct ibv_send_wr, send_flags)",
            offset_of!(IbvSendWr, send_flags)
        ),
        fact!(
            "ibv_send_wr.imm_data",
            "offsetof(struct ibv_send_wr, imm_data)",
            offset_of!(IbvSendWr, imm_data_or_invalidate_rkey)
        ),
        fact!(
            "ibv_send_wr.wr.rdma.remote_addr",
            "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)",
            offset_of!(IbvSendWr, wr) + offset_of!(IbvRdmaWr, remote_addr)
        ),
        fact!(
            "ibv_send_wr.wr.rdma.rkey",
            "offsetof(struct ibv_send_wr, wr.rdma.rkey)",
            offset_of!(IbvSendWr, wr) + offset_of!(IbvRdmaWr, rkey)
        ),
        fact!(
            "ibv_send_wr.wr.atomic.compare_add",
            "offsetof(struct ibv_send_wr, wr.atomic.compare_add)",
            offset_of!(IbvSendWr, wr) + offset_of!(IbvAtomicWr, compare_add)
        ),
        fact!(
            "ibv_send_wr.wr.atomic.swap",
            "offsetof(struct ibv_send_wr, wr.atomic.swap)",
            offset_of!(IbvSendWr, wr) + offset_of!(IbvAtomicWr, swap)
        ),
        fact!(
            "ibv_send_wr.wr.atomic.rkey",
            "offsetof(struct ibv_send_wr, wr.atomic.rkey)",
            offset_of!(IbvSendWr, wr) + offset_of!(IbvAtomicWr, rkey)
        ),
        fact!(
            "ibv_send_wr.qp_type",
            "offsetof(struct ibv_send_wr, qp_type)",
            offset_of!(IbvSendWr, qp_type_xrc_remote_srqn)
        ),
        fact!(
            "ibv_send_wr.bind_mw",
            "offsetof(struct ibv_send_wr, bind_mw)",
            offset_of!(IbvSendWr, bind_mw_or_tso)
        ),
        fact!("sizeof ibv_recv_wr", "sizeof(struct ibv_recv_wr)", size_of::<IbvRecvWr>()),
        fact!("ibv_recv_wr.num_sge", "offsetof(struct ibv_recv_wr, num_sge)", offset_of!(IbvRecvWr, num_sge)),
        fact!("sizeof ibv_wc", "sizeof(struct ibv_wc)", size_of::<IbvWc>()),
        fact!("ibv_wc.status", "offsetof(struct ibv_wc, status)", offset_of!(IbvWc, status)),
        fact!("ibv_wc.byte_len", "offsetof(struct ibv_wc, byte_len)", offset_of!(IbvWc, byte_len)),
        fact!(
            "ibv_wc.imm_data",
            "offsetof(struct ibv_wc, imm_data)",
            offset_of!(IbvWc, imm_data_or_invalidated_rkey)
        ),
        fact!("ibv_wc.src_qp", "offsetof(struct ibv_wc, src_qp)", offset_of!(IbvWc, src_qp)),
        fact!("ibv_wc.wc_flags", "offsetof(struct ibv_wc, wc_flags)", offset_of!(IbvWc, wc_flags)),
        fact!("sizeof ibv_qp_cap", "sizeof(struct ibv_qp_cap)", size_of::<IbvQpCap>()),
        fact!("sizeof ibv_qp_init_attr", "sizeof(struct ibv_qp_init_attr)", size_of::<IbvQpInitAttr>()),
        fact!(
            "ibv_qp_init_attr.cap",
            "offsetof(struct ibv_qp_init_attr, cap)",
            offset_of!(IbvQpInitAttr, cap)
        ),
        fact!(
            "ibv_qp_init_attr.qp_type",
            "offsetof(struct ibv_qp_init_attr, qp_type)",
            offset_of!(IbvQpInitAttr, qp_type)
        ),
        fact!("sizeof ibv_global_route", "sizeof(struct ibv_global_route)", size_of::<IbvGlobalRoute>()),
        fact!("sizeof ibv_ah_attr", "sizeof(struct ibv_ah_attr)", size_of::<IbvAhAttr>()),
        fact!(
            "ibv_ah_attr.is_global",
            "offsetof(struct ibv_ah_attr, is_global)",
            offset_of!(IbvAhAttr, is_global)
        ),
        fact!(
            "ibv_ah_attr.port_num",
            "offsetof(struct ibv_ah_attr, port_num)",
            offset_of!(IbvAhAttr, port_num)
        ),
        fact!("sizeof ibv_qp_attr", "sizeof(struct ibv_qp_attr)", size_of::<IbvQpAttr>()),
        fact!(
            "ibv_qp_attr.dest_qp_num",
            "offsetof(struct ibv_qp_attr, dest_qp_num)",
            offset_of!(IbvQpAttr, dest_qp_num)
        ),
        fact!(
            "ibv_qp_attr.qp_access_flags",
            "offsetof(struct ibv_qp_attr, qp_access_flags)",
            offset_of!(IbvQpAttr, qp_access_flags)
        ),
        fact!("ibv_qp_attr.ah_attr", "offsetof(struct ibv_qp_attr, ah_attr)", offset_of!(IbvQpAttr, ah_attr)),
        fact!(
            "ibv_qp_attr.pkey_index",
            "offsetof(struct ibv_qp_attr, pkey_index)",
            offset_of!(IbvQpAttr, pkey_index)
        ),
        fact!(
            "ibv_qp_attr.max_rd_atomic",
            "offsetof(struct ibv_qp_attr, max_rd_atomic)",
            offset_of!(IbvQpAttr, max_rd_atomic)
        ),
        fact!(
            "ibv_qp_attr.rnr_retry",
            "offsetof(struct ibv_qp_attr, rnr_retry)",
            offset_of!(IbvQpAttr, rnr_retry)
        ),
        fact!(
            "ibv_qp_attr.rate_limit",
            "offsetof(struct ibv_qp_attr, rate_limit)",
            offset_of!(IbvQpAttr, rate_limit)
        ),
        // Constants: the ones this crate defines and the verbs crate's libibverbs values.
        fact!("IBV_QPT_RC", "IBV_QPT_RC", QPT_RC),
        fact!("IBV_GID_TYPE_ROCE_V2", "IBV_GID_TYPE_ROCE_V2", GID_TYPE_ROCE_V2),
        fact!("IBV_LINK_LAYER_ETHERNET", "IBV_LINK_LAYER_ETHERNET", LINK_LAYER_ETHERNET),
        fact!("IBV_LINK_LAYER_INFINIBAND", "IBV_LINK_LAYER_INFINIBAND", LINK_LAYER_INFINIBAND),
        fact!("IBV_QP_STATE", "IBV_QP_STATE", qp_mask::STATE),
        fact!("IBV_QP_ACCESS_FLAGS", "IBV_QP_ACCESS_FLAGS", qp_mask::ACCESS_FLAGS),
        fact!("IBV_QP_PKEY_INDEX", "IBV_QP_PKEY_INDEX", qp_mask::PKEY_INDEX),
        fact!("IBV_QP_PORT", "IBV_QP_PORT", qp_mask::PORT),
        fact!("IBV_QP_AV", "IBV_QP_AV", qp_mask::AV),
        fact!("IBV_QP_PATH_MTU", "IBV_QP_PATH_MTU", qp_mask::PATH_MTU),
        fact!("IBV_QP_TIMEOUT", "IBV_QP_TIMEOUT", qp_mask::TIMEOUT),
        fact!("IBV_QP_RETRY_CNT", "IBV_QP_RETRY_CNT", qp_mask::RETRY_CNT),
        fact!("IBV_QP_RNR_RETRY", "IBV_QP_RNR_RETRY", qp_mask::RNR_RETRY),
        fact!("IBV_QP_RQ_PSN", "IBV_QP_RQ_PSN", qp_mask::RQ_PSN),
        fact!("IBV_QP_MAX_QP_RD_ATOMIC", "IBV_QP_MAX_QP_RD_ATOMIC", qp_mask::MAX_QP_RD_ATOMIC),
        fact!("IBV_QP_MIN_RNR_TIMER", "IBV_QP_MIN_RNR_TIMER", qp_mask::MIN_RNR_TIMER),
        fact!("IBV_QP_SQ_PSN", "IBV_QP_SQ_PSN", qp_mask::SQ_PSN),
        fact!("IBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_MAX_DEST_RD_ATOMIC", qp_mask::MAX_DEST_RD_ATOMIC),
        fact!("IBV_QP_CAP", "IBV_QP_CAP", qp_mask::CAP),
        fact!("IBV_QP_DEST_QPN", "IBV_QP_DEST_QPN", qp_mask::DEST_QPN),
        fact!("IBV_WR_RDMA_WRITE", "IBV_WR_RDMA_WRITE", wr_opcode::RDMA_WRITE),
        fact!("IBV_WR_RDMA_WRITE_WITH_IMM", "IBV_WR_RDMA_WRITE_WITH_IMM", wr_opcode::RDMA_WRITE_WITH_IMM),
        fact!("IBV_WR_SEND", "IBV_WR_SEND", wr_opcode::SEND),
        fact!("IBV_WR_SEND_WITH_IMM", "IBV_WR_SEND_WITH_IMM", wr_opcode::SEND_WITH_IMM),
        fact!("IBV_WR_RDMA_READ", "IBV_WR_RDMA_READ", wr_opcode::RDMA_READ),
        fact!("IBV_WR_ATOMIC_CMP_AND_SWP", "IBV_WR_ATOMIC_CMP_AND_SWP", wr_opcode::ATOMIC_CMP_AND_SWP),
        fact!("IBV_WR_ATOMIC_FETCH_AND_ADD", "IBV_WR_ATOMIC_FETCH_AND_ADD", wr_opcode::ATOMIC_FETCH_AND_ADD),
        fact!("IBV_WR_SEND_WITH_INV", "IBV_WR_SEND_WITH_INV", wr_opcode::SEND_WITH_INV),
        fact!("IBV_SEND_INLINE", "IBV_SEND_INLINE", SEND_INLINE),
        fact!("IBV_SEND_FENCE", "IBV_SEND_FENCE", SendFlags::FENCE.bits()),
        fact!("IBV_SEND_SIGNALED", "IBV_SEND_SIGNALED", SendFlags::SIGNALED.bits()),
        fact!("IBV_SEND_SOLICITED", "IBV_SEND_SOLICITED", SendFlags::SOLICITED.bits()),
        fact!("IBV_WC_WITH_IMM", "IBV_WC_WITH_IMM", wc_flags::WITH_IMM),
        fact!("IBV_WC_WITH_INV", "IBV_WC_WITH_INV", wc_flags::WITH_INV),
        fact!("IBV_FORK_UNNEEDED", "IBV_FORK_UNNEEDED", fork_status::UNNEEDED),
        fact!("IBV_FORK_ENABLED", "IBV_FORK_ENABLED", fork_status::ENABLED),
        fact!("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_LOCAL_WRITE", AccessFlags::LOCAL_WRITE.bits()),
        fact!("IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_WRITE", AccessFlags::REMOTE_WRITE.bits()),
        fact!("IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_READ", AccessFlags::REMOTE_READ.bits()),
        fact!("IBV_ACCESS_REMOTE_ATOMIC", "IBV_ACCESS_REMOTE_ATOMIC", AccessFlags::REMOTE_ATOMIC.bits()),
        fact!("IBV_QPS_RTS", "IBV_QPS_RTS", QpState::Rts.to_raw()),
        fact!("IBV_QPS_ERR", "IBV_QPS_ERR", QpState::Err.to_raw()),
        fact!("IBV_MTU_1024", "IBV_MTU_1024", Mtu::Mtu1024.to_ibv()),
        fact!("IBV_MTU_4096", "IBV_MTU_4096", Mtu::Mtu4096.to_ibv()),
        fact!("IBV_PORT_ACTIVE", "IBV_PORT_ACTIVE", PortState::Active.to_raw()),
        fact!("IBV_WC_LOC_PROT_ERR", "IBV_WC_LOC_PROT_ERR", WcStatus::LocProtErr.to_raw()),
        fact!("IBV_WC_WR_FLUSH_ERR", "IBV_WC_WR_FLUSH_ERR", WcStatus::WrFlushErr.to_raw()),
        fact!("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_ACCESS_ERR", WcStatus::RemAccessErr.to_raw()),
        fact!("IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR", WcStatus::RnrRetryExcErr.to_raw()),
        fact!("IBV_WC_FATAL_ERR", "IBV_WC_FATAL_ERR", WcStatus::FatalErr.to_raw()),
        fact!("IBV_WC_RECV", "IBV_WC_RECV", WcOpcode::Recv.to_raw()),
        fact!("IBV_WC_RECV_RDMA_WITH_IMM", "IBV_WC_RECV_RDMA_WITH_IMM", WcOpcode::RecvRdmaWithImm.to_raw()),
        fact!("IBV_WC_FETCH_ADD", "IBV_WC_FETCH_ADD", WcOpcode::FetchAdd.to_raw()),
    ]
}
