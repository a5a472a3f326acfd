//! The RoCE v2 Invariant CRC (digest §5): CRC-32 (zlib) over 8 bytes of 0xFF, the IP and UDP
//! headers with their variant fields masked to ones, the BTH with byte 4 masked, and the rest
//! of the transport packet; stored little-endian in the last 4 bytes of the UDP payload.
//!
//! A user-space endpoint on an ordinary UDP socket knows every covered field except, for IPv4,
//! the identification and flags the kernel writes. [`seal`] assumes what a socket with
//! `IP_PMTUDISC_DO` sends (ID 0, DF); [`verify`] solves for the received ID and flags over
//! GF(2) (see [`ipv4_solve`]).

pub mod ipv4_solve;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::bth::ICRC_MASKED_BYTE;
use crate::error::{Error, Result};
use crate::ipv4::{self, Ipv4Packet, FLAG_DONT_FRAG, PROTOCOL_UDP};
use crate::ipv6::{self, Ipv6Packet};
use crate::transport::ICRC_LEN;
use crate::udp::{self, UdpPacket};

pub use ipv4_solve::{solve_ipv4_id_flags, Ipv4IdFlags};

/// The addresses and ports of a datagram, as a UDP socket reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoints {
    /// Source IP address.
    pub src: IpAddr,
    /// Destination IP address.
    pub dst: IpAddr,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port (4791 for RoCE v2).
    pub dst_port: u16,
}

/// The IP family the ICRC pseudo-header is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    V4(Ipv4Addr, Ipv4Addr),
    V6(Ipv6Addr, Ipv6Addr),
}

impl Endpoints {
    /// IPv4 if both addresses are IPv4 or IPv4-mapped IPv6 (`::ffff:a.b.c.d`, the form of a
    /// RoCE v2 GID for an IPv4 address), IPv6 otherwise.
    pub(crate) fn family(&self) -> Family {
        let as_v4 = |addr: IpAddr| match addr {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(v6) => v6.to_ipv4_mapped(),
        };
        let as_v6 = |addr: IpAddr| match addr {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        match (as_v4(self.src), as_v4(self.dst)) {
            (Some(src), Some(dst)) => Family::V4(src, dst),
            _ => Family::V6(as_v6(self.src), as_v6(self.dst)),
        }
    }

    /// True if the ICRC of these endpoints uses the IPv4 pseudo-header.
    pub fn is_ipv4(&self) -> bool {
        matches!(self.family(), Family::V4(..))
    }
}

/// Bytes of 0xFF that stand in for the InfiniBand LRH.
const LRH_STANDIN: [u8; 8] = [0xFF; 8];
/// 8 bytes of 0xFF + 20 bytes of IPv4 + 8 bytes of UDP.
pub(crate) const V4_PREFIX_LEN: usize = 8 + ipv4::HEADER_LEN + udp::HEADER_LEN;
/// 8 bytes of 0xFF + 40 bytes of IPv6 + 8 bytes of UDP.
const V6_PREFIX_LEN: usize = 8 + ipv6::HEADER_LEN + udp::HEADER_LEN;
/// Smallest UDP payload that has a BTH and an ICRC.
const MIN_DATAGRAM: usize = crate::bth::BthRepr::LEN + ICRC_LEN;

/// The UDP length of a datagram, or an error if it does not fit the 16-bit field.
fn udp_len(datagram: &[u8], ip_header_len: usize) -> Result<u16> {
    if datagram.len() < MIN_DATAGRAM {
        return Err(Error::Truncated);
    }
    let len = udp::HEADER_LEN + datagram.len();
    if ip_header_len + len > usize::from(u16::MAX) {
        return Err(Error::Malformed("datagram too long for an IP packet"));
    }
    Ok(len as u16)
}

fn masked_udp(src_port: u16, dst_port: u16, len: u16) -> [u8; 8] {
    let [s0, s1] = src_port.to_be_bytes();
    let [d0, d1] = dst_port.to_be_bytes();
    let [l0, l1] = len.to_be_bytes();
    [s0, s1, d0, d1, l0, l1, 0xFF, 0xFF]
}

/// The masked pseudo-header prefix for IPv4: 0xFF×8, IPv4 header (TOS, TTL, checksum masked),
/// UDP header (checksum masked).
pub(crate) fn ipv4_prefix(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    ident: u16,
    flags_frag: u16,
    src_port: u16,
    dst_port: u16,
    udp_len: u16,
) -> [u8; V4_PREFIX_LEN] {
    let mut p = [0u8; V4_PREFIX_LEN];
    p[..8].copy_from_slice(&LRH_STANDIN);
    let ip = &mut p[8..8 + ipv4::HEADER_LEN];
    ip[0] = 0x45;
    ip[1] = 0xFF;
    ip[2..4].copy_from_slice(&(ipv4::HEADER_LEN as u16 + udp_len).to_be_bytes());
    ip[4..6].copy_from_slice(&ident.to_be_bytes());
    ip[6..8].copy_from_slice(&flags_frag.to_be_bytes());
    ip[8] = 0xFF;
    ip[9] = PROTOCOL_UDP;
    ip[10] = 0xFF;
    ip[11] = 0xFF;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    p[28..].copy_from_slice(&masked_udp(src_port, dst_port, udp_len));
    p
}

fn ipv6_prefix(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    src_port: u16,
    dst_port: u16,
    udp_len: u16,
) -> [u8; V6_PREFIX_LEN] {
    let mut p = [0u8; V6_PREFIX_LEN];
    p[..8].copy_from_slice(&LRH_STANDIN);
    let ip = &mut p[8..8 + ipv6::HEADER_LEN];
    // Version 6, then traffic class and flow label masked to ones.
    ip[..4].copy_from_slice(&[0x6F, 0xFF, 0xFF, 0xFF]);
    ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
    ip[6] = PROTOCOL_UDP;
    ip[7] = 0xFF;
    ip[8..24].copy_from_slice(&src.octets());
    ip[24..40].copy_from_slice(&dst.octets());
    p[48..].copy_from_slice(&masked_udp(src_port, dst_port, udp_len));
    p
}

/// CRC-32 of `prefix` followed by the datagram without its ICRC, BTH byte 4 masked.
/// `datagram.len() >= MIN_DATAGRAM` is the caller's to check.
pub(crate) fn crc_with_prefix(prefix: &[u8], datagram: &[u8]) -> u32 {
    let covered = &datagram[..datagram.len() - ICRC_LEN];
    let mut bth = [0u8; crate::bth::BthRepr::LEN];
    bth.copy_from_slice(&covered[..crate::bth::BthRepr::LEN]);
    bth[ICRC_MASKED_BYTE] = 0xFF;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(prefix);
    hasher.update(&bth);
    hasher.update(&covered[crate::bth::BthRepr::LEN..]);
    hasher.finalize()
}

/// The ICRC stored in the last 4 bytes of a datagram (little-endian on the wire).
pub fn found(datagram: &[u8]) -> Option<u32> {
    let tail = datagram.len().checked_sub(ICRC_LEN).map(|at| &datagram[at..])?;
    Some(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]))
}

/// The ICRC of a datagram carried in IPv4 with the given identification and flags/fragment
/// word (TOS and TTL are masked, so they do not matter).
pub fn compute_ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    ident: u16,
    flags_frag: u16,
    src_port: u16,
    dst_port: u16,
    datagram: &[u8],
) -> Result<u32> {
    let len = udp_len(datagram, ipv4::HEADER_LEN)?;
    let prefix = ipv4_prefix(src, dst, ident, flags_frag, src_port, dst_port, len);
    Ok(crc_with_prefix(&prefix, datagram))
}

/// The ICRC of a datagram carried in IPv6 (traffic class, flow label and hop limit masked).
pub fn compute_ipv6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    src_port: u16,
    dst_port: u16,
    datagram: &[u8],
) -> Result<u32> {
    let len = udp_len(datagram, 0)?;
    let prefix = ipv6_prefix(src, dst, src_port, dst_port, len);
    Ok(crc_with_prefix(&prefix, datagram))
}

/// The ICRC [`seal`] writes: for IPv4 as sent with ID 0 and DF.
pub fn compute(endpoints: &Endpoints, datagram: &[u8]) -> Result<u32> {
    match endpoints.family() {
        Family::V4(src, dst) => {
            compute_ipv4(src, dst, 0, FLAG_DONT_FRAG, endpoints.src_port, endpoints.dst_port, datagram)
        }
        Family::V6(src, dst) => compute_ipv6(src, dst, endpoints.src_port, endpoints.dst_port, datagram),
    }
}

/// Computes the ICRC of `datagram` (a UDP payload whose last 4 bytes are the ICRC slot) as sent
/// from an unconnected UDP socket with IP_PMTUDISC_DO (IPv4 ID 0, DF; TOS/TTL masked anyway)
/// and writes it into the last 4 bytes. IPv4 if both addresses are IPv4 (or IPv4-mapped),
/// IPv6 otherwise.
pub fn seal(endpoints: &Endpoints, datagram: &mut [u8]) -> Result<()> {
    let crc = compute(endpoints, datagram)?;
    let at = datagram.len() - ICRC_LEN;
    datagram[at..].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Checks a received datagram's ICRC: exactly for IPv6; for IPv4, where a UDP socket does
/// not reveal the IP ID and flags, by solving for them over GF(2) (digest §5.1a), which accepts
/// a corrupted packet with probability about 2^-15 (16 ID bits and DF unknown; MF and the
/// reserved flag must be clear). False for datagrams too short to have one.
pub fn verify(endpoints: &Endpoints, datagram: &[u8]) -> bool {
    match endpoints.family() {
        Family::V4(..) => solve_ipv4_id_flags(endpoints, datagram).is_some(),
        Family::V6(src, dst) => {
            match compute_ipv6(src, dst, endpoints.src_port, endpoints.dst_port, datagram) {
                Ok(crc) => found(datagram) == Some(crc),
                Err(_) => false,
            }
        }
    }
}

/// ICRC of a whole IPv4/IPv6 packet (IP header … ICRC), as found in a capture; returns
/// (computed, found_on_wire). The datagram ends where the UDP length says (Ethernet padding
/// after it is ignored). IPv4 options, fragments and IPv6 extension headers are refused.
pub fn check_ip_packet(packet: &[u8]) -> Result<(u32, u32)> {
    let (prefix, datagram): (Vec<u8>, &[u8]) = match packet.first().map(|b| b >> 4) {
        Some(4) => {
            let ip = Ipv4Packet::new_checked(packet)?;
            crate::ipv4::Ipv4Repr::parse(&ip)?;
            if ip.protocol() != PROTOCOL_UDP {
                return Err(Error::Malformed("IPv4 payload is not UDP"));
            }
            let udp = UdpPacket::new_checked(ip.payload())?;
            let mut prefix = Vec::with_capacity(V4_PREFIX_LEN);
            prefix.extend_from_slice(&LRH_STANDIN);
            prefix.extend_from_slice(&packet[..ipv4::HEADER_LEN]);
            prefix[8 + ipv4::TOS_OFFSET] = 0xFF;
            prefix[8 + ipv4::TTL_OFFSET] = 0xFF;
            prefix[8 + ipv4::CHECKSUM_OFFSET..8 + ipv4::CHECKSUM_OFFSET + 2].fill(0xFF);
            prefix.extend_from_slice(&masked_udp(udp.src_port(), udp.dst_port(), udp.len()));
            let end = ipv4::HEADER_LEN + usize::from(udp.len());
            (prefix, &packet[ipv4::HEADER_LEN + udp::HEADER_LEN..end])
        }
        Some(6) => {
            let ip = Ipv6Packet::new_checked(packet)?;
            if ip.next_header() != PROTOCOL_UDP {
                return Err(Error::Malformed("IPv6 next header is not UDP"));
            }
            let udp = UdpPacket::new_checked(ip.payload())?;
            let mut prefix = Vec::with_capacity(V6_PREFIX_LEN);
            prefix.extend_from_slice(&LRH_STANDIN);
            prefix.extend_from_slice(&packet[..ipv6::HEADER_LEN]);
            prefix[8] |= 0x0F;
            prefix[9..12].fill(0xFF);
            prefix[8 + ipv6::HOP_LIMIT_OFFSET] = 0xFF;
            prefix.extend_from_slice(&masked_udp(udp.src_port(), udp.dst_port(), udp.len()));
            let end = ipv6::HEADER_LEN + usize::from(udp.len());
            (prefix, &packet[ipv6::HEADER_LEN + udp::HEADER_LEN..end])
        }
        Some(_) => return Err(Error::Malformed("not an IPv4 or IPv6 packet")),
        None => return Err(Error::Truncated),
    };
    if datagram.len() < MIN_DATAGRAM {
        return Err(Error::Truncated);
    }
    let computed = crc_with_prefix(&prefix, datagram);
    let on_wire = found(datagram).ok_or(Error::Truncated)?;
    Ok((computed, on_wire))
}

#[cfg(test)]
mod tests;
