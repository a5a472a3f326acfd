//! What a device reports about itself (limits, ports) and the small address records a queue pair
//! and a memory region hand to a peer so it can be reached.

use crate::{Gid, Mtu};

/// Device-wide limits, as `ibv_query_device` reports them (the subset Lightpath uses).
///
/// Every field is public so providers in other crates can fill it in; `Default` gives zeroes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Number of physical ports (ports are numbered from 1).
    pub phys_port_cnt: u8,
    /// Largest number of queue pairs.
    pub max_qp: u32,
    /// Largest `max_send_wr` / `max_recv_wr` of one queue pair.
    pub max_qp_wr: u32,
    /// Largest scatter/gather list of one work request.
    pub max_sge: u32,
    /// Largest number of completion queues.
    pub max_cq: u32,
    /// Largest number of entries of one completion queue.
    pub max_cqe: u32,
    /// Largest number of memory regions.
    pub max_mr: u32,
    /// Largest memory region, in bytes.
    pub max_mr_size: u64,
    /// Largest number of protection domains.
    pub max_pd: u32,
    /// Largest `max_dest_rd_atomic` (READ/atomic requests one QP holds as responder).
    pub max_qp_rd_atom: u32,
    /// Largest `max_rd_atomic` (READ/atomic requests one QP has outstanding as requester).
    pub max_qp_init_rd_atom: u32,
    /// Largest `max_inline_data` of one queue pair.
    pub max_inline_data: u32,
    /// Whether 8-byte atomics (compare-and-swap, fetch-and-add) are supported.
    pub atomics: bool,
}

/// Logical port state. Discriminants are libibverbs' `ibv_port_state` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PortState {
    /// No state change (`IBV_PORT_NOP`).
    Nop,
    /// The link is down.
    Down,
    /// The link is up, not yet configured.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Active, deferring (`IBV_PORT_ACTIVE_DEFER`).
    ActiveDefer,
}

impl PortState {
    /// The libibverbs numeric value.
    pub fn to_raw(self) -> u32 {
        match self {
            PortState::Nop => 0,
            PortState::Down => 1,
            PortState::Init => 2,
            PortState::Armed => 3,
            PortState::Active => 4,
            PortState::ActiveDefer => 5,
        }
    }

    /// From the libibverbs numeric value, refusing unknown values.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            0 => PortState::Nop,
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            _ => return None,
        })
    }
}

/// One port, as `ibv_query_port` reports it (the subset Lightpath uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical state; traffic flows only when `Active`.
    pub state: PortState,
    /// Largest path MTU the port supports.
    pub max_mtu: Mtu,
    /// Path MTU the link currently allows (use the smaller of both ends' values).
    pub active_mtu: Mtu,
    /// Entries in the port's GID table.
    pub gid_tbl_len: u32,
}

/// What a peer needs to address a queue pair: the GID it sends from and its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpEndpoint {
    /// The local GID the queue pair sends from (a RoCE v2 GID: an IP address).
    pub gid: Gid,
    /// Index of that GID in the port's table (the `sgid_index` to use in the address vector).
    pub gid_index: u8,
    /// The queue pair number.
    pub qpn: u32,
}

/// A memory region as a peer sees it: where it is and the key that grants remote access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the first byte, as the owner's provider reported it.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The address `offset` bytes into the region, or `None` past its end (the end itself,
    /// `offset == len`, is allowed: it is where a zero-length access may point).
    pub fn addr_at(&self, offset: u64) -> Option<u64> {
        (offset <= self.len).then(|| self.addr.wrapping_add(offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_state_raw_values() {
        for raw in 0..6 {
            assert_eq!(PortState::from_raw(raw).map(PortState::to_raw), Some(raw));
        }
        assert_eq!(PortState::from_raw(6), None);
        assert_eq!(PortState::from_raw(4), Some(PortState::Active));
    }

    #[test]
    fn remote_region_offsets() {
        let region = RemoteRegion { addr: 0x1000, len: 16, rkey: 7 };
        assert_eq!(region.addr_at(0), Some(0x1000));
        assert_eq!(region.addr_at(16), Some(0x1010));
        assert_eq!(region.addr_at(17), None);
    }
}
