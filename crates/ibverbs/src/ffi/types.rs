//! Hand-written mirrors of the libibverbs structures Lightpath uses, field for field as in
//! rdma-core's `<infiniband/verbs.h>` (x86_64 and aarch64 Linux, LP64).
//!
//! Only the structures and fields that are read or written are mirrored; opaque objects
//! (`ibv_device`, `ibv_pd`) are never dereferenced. Every layout here is checked against the real
//! header by `tests/layout.rs` (a C program compiled with gcc prints `sizeof`/`offsetof`, compared
//! with [`crate::ffi::layout::rust_layout`]) wherever libibverbs-dev is installed.
//!
//! C enums are kept as plain `u32` fields; they become Rust enums only through checked
//! `from_raw` conversions (for example [`lightpath_verbs::QpState::from_raw`]).

use std::ffi::c_void;

/// `union ibv_gid`: 16 bytes in network order, 8-byte aligned (its other member is a pair of
/// `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IbvGid {
    pub raw: [u8; 16],
}

/// `struct ibv_gid_entry` (rdma-core ≥ 31).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvGidEntry {
    pub gid: IbvGid,
    pub gid_index: u32,
    pub port_num: u32,
    /// `enum ibv_gid_type`: [`GID_TYPE_IB`], [`GID_TYPE_ROCE_V1`], [`GID_TYPE_ROCE_V2`].
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// `IBV_GID_TYPE_IB`.
pub const GID_TYPE_IB: u32 = 0;
/// `IBV_GID_TYPE_ROCE_V1`.
pub const GID_TYPE_ROCE_V1: u32 = 1;
/// `IBV_GID_TYPE_ROCE_V2`.
pub const GID_TYPE_ROCE_V2: u32 = 2;

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvDeviceAttr {
    pub fw_ver: [u8; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub device_cap_flags: u32,
    pub max_sge: i32,
    pub max_sge_rd: i32,
    pub max_cq: i32,
    pub max_cqe: i32,
    pub max_mr: i32,
    pub max_pd: i32,
    pub max_qp_rd_atom: i32,
    pub max_ee_rd_atom: i32,
    pub max_res_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
    pub max_ee_init_rd_atom: i32,
    /// `enum ibv_atomic_cap`: 0 none, 1 HCA, 2 global.
    pub atomic_cap: u32,
    pub max_ee: i32,
    pub max_rdd: i32,
    pub max_mw: i32,
    pub max_raw_ipv6_qp: i32,
    pub max_raw_ethy_qp: i32,
    pub max_mcast_grp: i32,
    pub max_mcast_qp_attach: i32,
    pub max_total_mcast_qp_attach: i32,
    pub max_ah: i32,
    pub max_fmr: i32,
    pub max_map_per_fmr: i32,
    pub max_srq: i32,
    pub max_srq_wr: i32,
    pub max_srq_sge: i32,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

impl Default for IbvDeviceAttr {
    fn default() -> Self {
        // Every field is an integer or an array of integers: all zeroes is a valid value.
        Self {
            fw_ver: [0; 64],
            node_guid: 0,
            sys_image_guid: 0,
            max_mr_size: 0,
            page_size_cap: 0,
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: 0,
            max_qp_wr: 0,
            device_cap_flags: 0,
            max_sge: 0,
            max_sge_rd: 0,
            max_cq: 0,
            max_cqe: 0,
            max_mr: 0,
            max_pd: 0,
            max_qp_rd_atom: 0,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 0,
            max_qp_init_rd_atom: 0,
            max_ee_init_rd_atom: 0,
            atomic_cap: 0,
            max_ee: 0,
            max_rdd: 0,
            max_mw: 0,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: 0,
            max_mcast_qp_attach: 0,
            max_total_mcast_qp_attach: 0,
            max_ah: 0,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: 0,
            max_srq_wr: 0,
            max_srq_sge: 0,
            max_pkeys: 0,
            local_ca_ack_delay: 0,
            phys_port_cnt: 0,
        }
    }
}

/// `struct ibv_port_attr`, followed by spare room.
///
/// The exported `ibv_query_port` writes the structure as the *loaded* library knows it, which
/// may be newer and longer than the header this mirror follows (rdma-core 47 appended
/// `active_speed_ex`). The spare bytes at the end absorb such growth; the fields Lightpath reads
/// all sit in the stable prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvPortAttr {
    /// `enum ibv_port_state`.
    pub state: u32,
    /// `enum ibv_mtu`.
    pub max_mtu: u32,
    /// `enum ibv_mtu`.
    pub active_mtu: u32,
    pub gid_tbl_len: i32,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    /// `IBV_LINK_LAYER_*`: 0 unspecified, 1 InfiniBand, 2 Ethernet.
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    /// Room for fields newer libraries append (32-bit words, so that it starts where the
    /// header's structure ends, after its tail padding).
    pub spare: [u32; 16],
}

/// `IBV_LINK_LAYER_INFINIBAND`.
pub const LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub const LINK_LAYER_ETHERNET: u8 = 2;

/// `struct ibv_context_ops`: the per-device function table. The data-path calls that
/// `verbs.h` implements as static inline functions (`ibv_post_send`, `ibv_post_recv`,
/// `ibv_poll_cq`, `ibv_req_notify_cq`) are calls through these pointers; the `_compat_*` slots
/// are placeholders for entry points that moved elsewhere and are never called.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvContextOps {
    pub compat_query_device: *mut c_void,
    pub compat_query_port: *mut c_void,
    pub compat_alloc_pd: *mut c_void,
    pub compat_dealloc_pd: *mut c_void,
    pub compat_reg_mr: *mut c_void,
    pub compat_rereg_mr: *mut c_void,
    pub compat_dereg_mr: *mut c_void,
    pub alloc_mw: *mut c_void,
    pub bind_mw: *mut c_void,
    pub dealloc_mw: *mut c_void,
    pub compat_create_cq: *mut c_void,
    pub poll_cq: Option<unsafe extern "C" fn(cq: *mut IbvCq, num_entries: i32, wc: *mut IbvWc) -> i32>,
    pub req_notify_cq: Option<unsafe extern "C" fn(cq: *mut IbvCq, solicited_only: i32) -> i32>,
    pub compat_cq_event: *mut c_void,
    pub compat_resize_cq: *mut c_void,
    pub compat_destroy_cq: *mut c_void,
    pub compat_create_srq: *mut c_void,
    pub compat_modify_srq: *mut c_void,
    pub compat_query_srq: *mut c_void,
    pub compat_destroy_srq: *mut c_void,
    pub post_srq_recv: *mut c_void,
    pub compat_create_qp: *mut c_void,
    pub compat_query_qp: *mut c_void,
    pub compat_modify_qp: *mut c_void,
    pub compat_destroy_qp: *mut c_void,
    pub post_send:
        Option<unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvSendWr, bad_wr: *mut *mut IbvSendWr) -> i32>,
    pub post_recv:
        Option<unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad_wr: *mut *mut IbvRecvWr) -> i32>,
    pub compat_create_ah: *mut c_void,
    pub compat_destroy_ah: *mut c_void,
    pub compat_attach_mcast: *mut c_void,
    pub compat_detach_mcast: *mut c_void,
    pub compat_async_event: *mut c_void,
}

/// `struct ibv_context` up to the fields Lightpath reads (the library allocates it; Lightpath
/// only reads through a pointer, so a shorter mirror is safe).
#[repr(C)]
#[derive(Debug)]
pub struct IbvContext {
    pub device: *mut c_void,
    pub ops: IbvContextOps,
    pub cmd_fd: i32,
    pub async_fd: i32,
    pub num_comp_vectors: i32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: i32,
    pub refcnt: i32,
}

/// `struct ibv_cq` up to `cqe` (read only through a library-owned pointer).
#[repr(C)]
#[derive(Debug)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: i32,
}

/// `struct ibv_qp` up to `qp_type` (read only through a library-owned pointer).
#[repr(C)]
#[derive(Debug)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    /// `enum ibv_qp_state` as last known to the library (not updated by the device).
    pub state: u32,
    /// `enum ibv_qp_type`.
    pub qp_type: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `wr.rdma` member of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvRdmaWr {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// The `wr.atomic` member of `struct ibv_send_wr` (the largest member of that union).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvAtomicWr {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// The `wr` union of `struct ibv_send_wr` (its `ud` member is not used by RC).
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvSendWrUnion {
    pub rdma: IbvRdmaWr,
    pub atomic: IbvAtomicWr,
}

impl std::fmt::Debug for IbvSendWrUnion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IbvSendWrUnion { .. }")
    }
}

/// `struct ibv_send_wr`. The trailing `bind_mw`/`tso` union (48 bytes, 8-aligned) is kept as
/// opaque words: RC sends never use it, but the structure must have its full size.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: i32,
    /// `enum ibv_wr_opcode`.
    pub opcode: u32,
    pub send_flags: u32,
    /// `imm_data` (big endian) or `invalidate_rkey`.
    pub imm_data_or_invalidate_rkey: u32,
    pub wr: IbvSendWrUnion,
    /// The `qp_type.xrc.remote_srqn` union.
    pub qp_type_xrc_remote_srqn: u32,
    pub bind_mw_or_tso: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: i32,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvWc {
    pub wr_id: u64,
    /// `enum ibv_wc_status`.
    pub status: u32,
    /// `enum ibv_wc_opcode`.
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (big endian) or `invalidated_rkey`, as `wc_flags` says.
    pub imm_data_or_invalidated_rkey: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub cap: IbvQpCap,
    /// `enum ibv_qp_type`.
    pub qp_type: u32,
    pub sq_sig_all: i32,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvGlobalRoute {
    pub dgid: IbvGid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IbvQpAttr {
    /// `enum ibv_qp_state`.
    pub qp_state: u32,
    pub cur_qp_state: u32,
    /// `enum ibv_mtu`.
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `IBV_QPT_RC`.
pub const QPT_RC: u32 = 2;

/// `enum ibv_qp_attr_mask` bits.
pub mod qp_mask {
    pub const STATE: i32 = 1 << 0;
    pub const ACCESS_FLAGS: i32 = 1 << 3;
    pub const PKEY_INDEX: i32 = 1 << 4;
    pub const PORT: i32 = 1 << 5;
    pub const AV: i32 = 1 << 7;
    pub const PATH_MTU: i32 = 1 << 8;
    pub const TIMEOUT: i32 = 1 << 9;
    pub const RETRY_CNT: i32 = 1 << 10;
    pub const RNR_RETRY: i32 = 1 << 11;
    pub const RQ_PSN: i32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: i32 = 1 << 13;
    pub const MIN_RNR_TIMER: i32 = 1 << 15;
    pub const SQ_PSN: i32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
    pub const CAP: i32 = 1 << 19;
    pub const DEST_QPN: i32 = 1 << 20;
}

/// `enum ibv_wr_opcode` values.
pub mod wr_opcode {
    pub const RDMA_WRITE: u32 = 0;
    pub const RDMA_WRITE_WITH_IMM: u32 = 1;
    pub const SEND: u32 = 2;
    pub const SEND_WITH_IMM: u32 = 3;
    pub const RDMA_READ: u32 = 4;
    pub const ATOMIC_CMP_AND_SWP: u32 = 5;
    pub const ATOMIC_FETCH_AND_ADD: u32 = 6;
    pub const SEND_WITH_INV: u32 = 9;
}

/// `enum ibv_send_flags` bit for inline data (the other flags share Lightpath's values).
pub const SEND_INLINE: u32 = 1 << 3;

/// `enum ibv_wc_flags` bits.
pub mod wc_flags {
    pub const WITH_IMM: u32 = 1 << 1;
    pub const WITH_INV: u32 = 1 << 3;
}

/// `enum ibv_fork_status`.
pub mod fork_status {
    pub const DISABLED: u32 = 0;
    pub const ENABLED: u32 = 1;
    pub const UNNEEDED: u32 = 2;
}
