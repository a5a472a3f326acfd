//! The GID table of a port and the automatic choice of the GID to send from.
//!
//! On RoCE ports every IP address of the network device appears in the GID table, usually
//! twice (RoCE v1 and RoCE v2), next to the link-local IPv6 GIDs, so the index of "the RoCE v2
//! GID of my IPv4 address" differs from machine to machine (the `ibv_rc_pingpong -g 3` people
//! guess at). [`choose`] picks it: on an Ethernet port the first RoCE v2 GID that is an
//! IPv4-mapped address, else the first RoCE v2 global IPv6 GID, else the first RoCE v2 GID of
//! any kind; on an InfiniBand port index 0 (the port GID).

use lightpath_verbs::Gid;

use crate::ffi::types::{GID_TYPE_IB, GID_TYPE_ROCE_V1, GID_TYPE_ROCE_V2};

/// What kind of GID an entry is (`enum ibv_gid_type`), from a checked conversion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GidKind {
    /// An InfiniBand GID.
    Ib,
    /// RoCE v1 (Ethernet, no IP header): not what Lightpath's soft provider speaks.
    RoceV1,
    /// RoCE v2 (UDP/IP).
    RoceV2,
    /// A value this crate does not know.
    Other(u32),
}

impl GidKind {
    /// From the libibverbs value.
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            GID_TYPE_IB => GidKind::Ib,
            GID_TYPE_ROCE_V1 => GidKind::RoceV1,
            GID_TYPE_ROCE_V2 => GidKind::RoceV2,
            other => GidKind::Other(other),
        }
    }

    /// From the text of sysfs `gid_attrs/types/<index>` ("IB/RoCE v1", "RoCE v2").
    pub fn from_sysfs(text: &str) -> Self {
        match text.trim() {
            "RoCE v2" => GidKind::RoceV2,
            "IB/RoCE v1" => GidKind::RoceV1,
            "IB" => GidKind::Ib,
            _ => GidKind::Other(u32::MAX),
        }
    }
}

impl std::fmt::Display for GidKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GidKind::Ib => f.write_str("IB"),
            GidKind::RoceV1 => f.write_str("RoCE v1"),
            GidKind::RoceV2 => f.write_str("RoCE v2"),
            GidKind::Other(raw) => write!(f, "GID type {raw}"),
        }
    }
}

/// One valid (non-zero) GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index in the port's table (the `sgid_index` of an address vector).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its kind.
    pub kind: GidKind,
}

/// Why no GID could be chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoGid {
    /// The table has no valid entry at all.
    Empty,
    /// An Ethernet port with no RoCE v2 entry (no IP address on the network device, or RoCE v1
    /// only).
    NoRoceV2,
}

impl std::fmt::Display for NoGid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoGid::Empty => f.write_str("the port's GID table is empty"),
            NoGid::NoRoceV2 => f.write_str(
                "the port has no RoCE v2 GID: give its network device an IP address (RoCE v2 GIDs are the \
                 device's IP addresses)",
            ),
        }
    }
}

/// The GID Lightpath sends from on a port whose link layer is Ethernet (`ethernet`) or
/// InfiniBand, out of its valid entries.
pub fn choose(entries: &[GidEntry], ethernet: bool) -> Result<GidEntry, NoGid> {
    if entries.is_empty() {
        return Err(NoGid::Empty);
    }
    if !ethernet {
        return Ok(entries.iter().find(|e| e.index == 0).copied().unwrap_or(entries[0]));
    }
    let v2 = || entries.iter().filter(|e| e.kind == GidKind::RoceV2);
    let global_v6 = |e: &&GidEntry| {
        let first = u16::from_be_bytes([e.gid.0[0], e.gid.0[1]]);
        (first & 0xffc0) != 0xfe80
    };
    v2().find(|e| e.gid.is_ipv4_mapped())
        .or_else(|| v2().find(global_v6))
        .or_else(|| v2().next())
        .copied()
        .ok_or(NoGid::NoRoceV2)
}

/// The table as [`lightpath_verbs::Device::gids`] returns it: entry `i` is index `i`, unset
/// entries are zero, up to the highest valid index.
pub fn dense_table(entries: &[GidEntry]) -> Vec<Gid> {
    let len = entries.iter().map(|e| e.index as usize + 1).max().unwrap_or(0);
    let mut table = vec![Gid::ZERO; len];
    for entry in entries {
        table[entry.index as usize] = entry.gid;
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid: &str, kind: GidKind) -> GidEntry {
        GidEntry { index, gid: gid.parse().expect("gid"), kind }
    }

    /// The table of a typical RoCE NIC port with one IPv4 and one global IPv6 address.
    fn typical() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::5054:ff:fe4c:5002", GidKind::RoceV1),
            entry(1, "fe80::5054:ff:fe4c:5002", GidKind::RoceV2),
            entry(2, "2001:db8::2", GidKind::RoceV1),
            entry(3, "2001:db8::2", GidKind::RoceV2),
            entry(4, "10.78.0.2", GidKind::RoceV1),
            entry(5, "10.78.0.2", GidKind::RoceV2),
        ]
    }

    #[test]
    fn roce_v2_ipv4_is_preferred() {
        let chosen = choose(&typical(), true).expect("a GID");
        assert_eq!((chosen.index, chosen.gid.to_string().as_str()), (5, "::ffff:10.78.0.2"));
    }

    #[test]
    fn then_global_ipv6_then_any_v2() {
        let without_v4: Vec<_> = typical().into_iter().filter(|e| e.index < 4).collect();
        assert_eq!(choose(&without_v4, true).expect("a GID").index, 3);
        let link_local_only: Vec<_> = typical().into_iter().filter(|e| e.index < 2).collect();
        assert_eq!(choose(&link_local_only, true).expect("a GID").index, 1);
    }

    #[test]
    fn v1_only_and_empty_tables_are_explained() {
        let v1_only: Vec<_> = typical().into_iter().filter(|e| e.kind == GidKind::RoceV1).collect();
        assert_eq!(choose(&v1_only, true), Err(NoGid::NoRoceV2));
        assert_eq!(choose(&[], true), Err(NoGid::Empty));
        assert!(NoGid::NoRoceV2.to_string().contains("IP address"));
    }

    #[test]
    fn infiniband_uses_the_port_gid() {
        let ib = vec![entry(0, "fe80::2:c903:a:b", GidKind::Ib), entry(1, "fe80::2:c903:a:c", GidKind::Ib)];
        assert_eq!(choose(&ib, false).expect("a GID").index, 0);
    }

    #[test]
    fn kinds_from_c_and_sysfs() {
        assert_eq!(GidKind::from_raw(2), GidKind::RoceV2);
        assert_eq!(GidKind::from_raw(9), GidKind::Other(9));
        assert_eq!(GidKind::from_sysfs("RoCE v2\n"), GidKind::RoceV2);
        assert_eq!(GidKind::from_sysfs("IB/RoCE v1"), GidKind::RoceV1);
    }

    #[test]
    fn dense_table_has_zero_holes() {
        let sparse = vec![entry(0, "fe80::1", GidKind::RoceV2), entry(3, "10.0.0.1", GidKind::RoceV2)];
        let table = dense_table(&sparse);
        assert_eq!(table.len(), 4);
        assert!(table[1].is_zero() && table[2].is_zero());
        assert_eq!(table[3], "10.0.0.1".parse().expect("gid"));
    }
}
