//! Global identifiers: the 16-byte addresses of RoCE v2, which are IPv6 addresses (IPv4 ones are
//! carried as IPv4-mapped `::ffff:a.b.c.d`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// A 16-byte GID, stored in network order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID (what verbs reports for an unset entry).
    pub const ZERO: Self = Self([0; 16]);

    /// The GID of an IP address: IPv6 as is, IPv4 as `::ffff:a.b.c.d`.
    pub fn from_ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Self(v6.octets()),
        }
    }

    /// The IP address this GID stands for on the wire: IPv4 for an IPv4-mapped GID (which means
    /// RoCE v2 over IPv4), IPv6 otherwise.
    pub fn to_ip(self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }

    /// The IPv4 address if this GID is IPv4-mapped.
    pub fn to_ipv4(self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// Whether the GID is IPv4-mapped, i.e. selects IPv4 encapsulation.
    pub fn is_ipv4_mapped(self) -> bool {
        self.to_ipv4().is_some()
    }

    /// Whether this is the all-zero GID.
    pub fn is_zero(self) -> bool {
        self.0 == [0; 16]
    }

    /// The 32 lower-case hex digits that rdma-core's examples exchange (`ibv_rc_pingpong`).
    pub fn to_hex(self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 32 hex digits (either case) as written by [`Gid::to_hex`].
    pub fn from_hex(text: &str) -> Option<Self> {
        let text = text.as_bytes();
        if text.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, pair) in text.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(Self(out))
    }
}

impl From<IpAddr> for Gid {
    fn from(ip: IpAddr) -> Self {
        Self::from_ip(ip)
    }
}

impl From<Ipv4Addr> for Gid {
    fn from(ip: Ipv4Addr) -> Self {
        Self::from_ip(IpAddr::V4(ip))
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(ip: Ipv6Addr) -> Self {
        Self(ip.octets())
    }
}

impl fmt::Display for Gid {
    /// Formats as an IPv6 address, the way `ibv_devinfo -v` and `show_gids` do.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Ipv6Addr::from(self.0))
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl FromStr for Gid {
    type Err = String;

    /// Accepts an IPv6 address, an IPv4 address (mapped), or 32 hex digits.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Self::from_ip(ip));
        }
        Self::from_hex(s).ok_or_else(|| format!("not a GID (IPv6, IPv4 or 32 hex digits): {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_layout_matches_roce_digest() {
        let gid = Gid::from(Ipv4Addr::new(192, 168, 122, 10));
        assert_eq!(gid.to_hex(), "00000000000000000000ffffc0a87a0a");
        assert_eq!(gid.to_ip(), IpAddr::V4(Ipv4Addr::new(192, 168, 122, 10)));
        assert!(gid.is_ipv4_mapped());
        assert_eq!(gid.to_string(), "::ffff:192.168.122.10");
    }

    #[test]
    fn ipv6_gid_stays_ipv6() {
        let ip: Ipv6Addr = "fe80::5054:ff:fe77:2".parse().unwrap();
        let gid = Gid::from(ip);
        assert!(!gid.is_ipv4_mapped());
        assert_eq!(gid.to_ip(), IpAddr::V6(ip));
    }

    #[test]
    fn parse_forms() {
        let a: Gid = "10.77.0.2".parse().unwrap();
        let b: Gid = "00000000000000000000FFFF0a4d0002".parse().unwrap();
        let c: Gid = "::ffff:10.77.0.2".parse().unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert!("xyz".parse::<Gid>().is_err());
        assert!(Gid::from_hex("00").is_none());
        assert!(Gid::from_hex("0000000000000000000000000000000g").is_none());
    }
}
