//! Path MTU: the payload bytes per packet, as the InfiniBand MTU enumeration.

use std::fmt;

/// An IB path MTU (payload bytes per packet, excluding every header).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes (`IBV_MTU_256` = 1).
    Mtu256,
    /// 512 bytes (`IBV_MTU_512` = 2).
    Mtu512,
    /// 1024 bytes (`IBV_MTU_1024` = 3), the usual RoCE value on a 1500-byte link.
    Mtu1024,
    /// 2048 bytes (`IBV_MTU_2048` = 4).
    Mtu2048,
    /// 4096 bytes (`IBV_MTU_4096` = 5).
    Mtu4096,
}

impl Mtu {
    /// Every MTU, smallest first.
    pub const ALL: [Mtu; 5] = [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096];

    /// Payload bytes per packet.
    pub fn bytes(self) -> u32 {
        256 << self.to_enum_index()
    }

    /// Bytes a RoCE v2 packet adds around its payload at most: the IP header (20 for IPv4,
    /// 40 for IPv6), UDP (8), BTH (12), the largest extended headers (28: an AtomicETH, more
    /// than RETH with immediate data) and the ICRC (4).
    pub fn roce_overhead(ipv6: bool) -> u32 {
        (if ipv6 { 40 } else { 20 }) + 8 + ROCE_TRANSPORT_OVERHEAD
    }

    /// The largest path MTU whose packets fit a link of `link_mtu` bytes (as Linux rxe derives
    /// a port's active MTU from its netdev's); `None` if even 256-byte payloads do not.
    pub fn largest_for_link(link_mtu: u32, ipv6: bool) -> Option<Self> {
        let room = link_mtu.checked_sub(Self::roce_overhead(ipv6))?;
        Self::ALL.into_iter().rev().find(|m| m.bytes() <= room)
    }

    /// From a byte count; only the five IB values are accepted.
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.bytes() == bytes)
    }

    /// The libibverbs `ibv_mtu` value (1 = 256 … 5 = 4096).
    pub fn to_ibv(self) -> u32 {
        self.to_enum_index() + 1
    }

    /// From the libibverbs `ibv_mtu` value, refusing anything outside 1..=5.
    pub fn from_ibv(value: u32) -> Option<Self> {
        Self::ALL.get(value.checked_sub(1)? as usize).copied()
    }

    /// The largest MTU not above `bytes` (e.g. what fits a link of a given payload size), or
    /// `None` below 256.
    pub fn largest_fitting(bytes: u32) -> Option<Self> {
        Self::ALL.into_iter().rev().find(|m| m.bytes() <= bytes)
    }

    fn to_enum_index(self) -> u32 {
        match self {
            Mtu::Mtu256 => 0,
            Mtu::Mtu512 => 1,
            Mtu::Mtu1024 => 2,
            Mtu::Mtu2048 => 3,
            Mtu::Mtu4096 => 4,
        }
    }
}

/// The largest path MTU two Lightpath soft devices use between them
/// ([`QpAttr::lightpath_pmtu`](crate::QpAttr::lightpath_pmtu)): 32 KiB, the largest power of two
/// whose packets fit one UDP datagram on loopback (64 KiB links). Larger packets would save
/// little more and make each loss cost more.
pub const MAX_LIGHTPATH_PMTU: u32 = 32 << 10;

/// The largest RoCE v2 overhead inside the UDP payload: BTH (12 bytes), the longest run of
/// extension headers (28) and the ICRC (4).
const ROCE_TRANSPORT_OVERHEAD: u32 = 12 + 28 + 4;

/// Most UDP payload bytes of one segmented message (`UDP_SEGMENT`) a soft device sends: the
/// whole must fit one IP packet's 16-bit length (65,535 minus the IPv4 and UDP headers, with
/// room to spare for IPv6).
pub const MAX_SEGMENTED_UDP_BYTES: u32 = 65_000;

/// The path MTU a Lightpath soft device offers where its link carries more (loopback's 64 KiB):
/// 32,448 bytes, the largest multiple of 64 two of whose packets (each with the largest RoCE
/// overhead, 44 bytes of BTH, extension headers and ICRC) fit one segmented message of
/// [`MAX_SEGMENTED_UDP_BYTES`]. With 32 KiB packets every message carried one packet: each
/// took its own trip through the kernel's UDP stack, in a buffer of its own rather than the
/// socket's recycled pages. Measured on loopback, `lightpath perf write_bw -s 1048576 -m M`,
/// alternated: 3.9-4.0 GB/s with 32,768, 4.6-4.7 with 32,448. Larger sizes, up to
/// [`MAX_LIGHTPATH_PMTU`], stay accepted when asked for.
pub const PREFERRED_LIGHTPATH_PMTU: u32 = (MAX_SEGMENTED_UDP_BYTES / 2 - ROCE_TRANSPORT_OVERHEAD) / 64 * 64;

/// The largest path MTU two Lightpath soft devices can use on a link of `link_mtu` bytes: what
/// is left after the RoCE v2 headers ([`Mtu::roce_overhead`]), rounded down to 64 bytes, at
/// most [`MAX_LIGHTPATH_PMTU`]; `None` if even 256-byte payloads do not fit. What a device
/// offers is at most [`PREFERRED_LIGHTPATH_PMTU`].
pub fn lightpath_pmtu_for_link(link_mtu: u32, ipv6: bool) -> Option<u32> {
    let room = link_mtu.checked_sub(Mtu::roce_overhead(ipv6))? / 64 * 64;
    (room >= 256).then_some(room.min(MAX_LIGHTPATH_PMTU))
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lightpath_pmtu_for_links() {
        assert_eq!(lightpath_pmtu_for_link(1500, false), Some(1408), "1500 - 72 = 1428, down to 64 bytes");
        assert_eq!(lightpath_pmtu_for_link(1500, true), Some(1408));
        assert_eq!(lightpath_pmtu_for_link(9000, false), Some(8896));
        assert_eq!(lightpath_pmtu_for_link(65536, false), Some(MAX_LIGHTPATH_PMTU), "loopback");
        assert_eq!(PREFERRED_LIGHTPATH_PMTU, 32_448);
        // Two packets per segmented message, and the largest such size.
        const { assert!(2 * (PREFERRED_LIGHTPATH_PMTU + ROCE_TRANSPORT_OVERHEAD) <= MAX_SEGMENTED_UDP_BYTES) };
        const { assert!(2 * (PREFERRED_LIGHTPATH_PMTU + 64 + ROCE_TRANSPORT_OVERHEAD) > MAX_SEGMENTED_UDP_BYTES) };
        assert_eq!(lightpath_pmtu_for_link(256 + 72, false), Some(256));
        assert_eq!(lightpath_pmtu_for_link(256 + 71, false), None);
        assert_eq!(lightpath_pmtu_for_link(10, false), None);
    }

    #[test]
    fn largest_for_link() {
        assert_eq!(Mtu::largest_for_link(1500, false), Some(Mtu::Mtu1024), "as rxe on Ethernet");
        assert_eq!(Mtu::largest_for_link(9000, false), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::largest_for_link(65536, false), Some(Mtu::Mtu4096), "loopback");
        assert_eq!(Mtu::largest_for_link(4096 + 72, false), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::largest_for_link(4096 + 71, false), Some(Mtu::Mtu2048));
        assert_eq!(Mtu::largest_for_link(2048 + 92, true), Some(Mtu::Mtu2048));
        assert_eq!(Mtu::largest_for_link(2048 + 91, true), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::largest_for_link(300, false), None);
        assert_eq!(Mtu::largest_for_link(0, true), None);
    }

    #[test]
    fn values() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::Mtu1024.to_ibv(), 3);
        assert_eq!(Mtu::from_ibv(5), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::from_ibv(0), None);
        assert_eq!(Mtu::from_ibv(6), None);
        assert_eq!(Mtu::from_bytes(2048), Some(Mtu::Mtu2048));
        assert_eq!(Mtu::from_bytes(1500), None);
        // rxe: a 1500-byte link gives 1420 usable bytes, hence 1024.
        assert_eq!(Mtu::largest_fitting(1420), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::largest_fitting(100), None);
    }
}
