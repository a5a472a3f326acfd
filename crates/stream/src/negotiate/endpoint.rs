//! What one side tells the other about its RDMA endpoint: queue pair, path, ring and credit
//! slot.

/// An RDMA provider, as negotiated. Codes are part of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderId {
    /// Lightpath's RoCE v2 engine over UDP.
    Soft,
    /// RDMA hardware through libibverbs.
    Ibverbs,
    /// Shared memory between processes of one host.
    Shm,
}

impl ProviderId {
    /// The protocol code.
    pub fn code(self) -> u8 {
        match self {
            ProviderId::Soft => 1,
            ProviderId::Ibverbs => 2,
            ProviderId::Shm => 3,
        }
    }

    /// From the protocol code (unknown codes are `None`: a newer peer's provider is simply not
    /// one this side can use).
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => ProviderId::Soft,
            2 => ProviderId::Ibverbs,
            3 => ProviderId::Shm,
            _ => return None,
        })
    }

    /// A short name ("soft", "ibverbs", "shm").
    pub fn name(self) -> &'static str {
        match self {
            ProviderId::Soft => "soft",
            ProviderId::Ibverbs => "ibverbs",
            ProviderId::Shm => "shm",
        }
    }
}

/// Encoded length of an [`RdmaEndpoint`].
pub const ENDPOINT_LEN: usize = 16 + 2 + 4 + 4 + 2 + 8 + 4 + 4 + 8 + 4 + 2;

/// One side's RDMA endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// The GID its queue pair sends from (for RoCE, an IPv4-mapped or IPv6 address).
    pub gid: [u8; 16],
    /// UDP port its soft device listens on (0 for providers without one).
    pub udp_port: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number it sends (24 bits).
    pub psn: u32,
    /// Largest path MTU it accepts, in bytes: one of InfiniBand's sizes (256…4096, a power of
    /// two), or — from a soft device, which advertises its UDP port — any size from 256 up
    /// (the Lightpath extension `QpAttr::lightpath_pmtu`, used when both sides are soft
    /// devices; an IB peer takes the largest IB size not above it).
    pub mtu: u16,
    /// Address of its receive ring.
    pub ring_addr: u64,
    /// Length of its receive ring.
    pub ring_len: u32,
    /// Remote key of the ring.
    pub ring_rkey: u32,
    /// Address of its 8-byte credit slot.
    pub credit_addr: u64,
    /// Remote key of the credit slot.
    pub credit_rkey: u32,
    /// Receive requests it posts before the first record.
    pub recv_depth: u16,
}

/// Why an endpoint was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointError {
    /// Wrong length.
    Length,
    /// QPN or PSN above 24 bits.
    Range,
    /// MTU below 256, or (without a UDP port: not a soft device) not an IB size.
    Mtu,
    /// Ring shorter than 64 bytes or receive depth below 8.
    Sizes,
}

impl RdmaEndpoint {
    /// Appends the encoding to `out`.
    pub fn emit(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.udp_port.to_be_bytes());
        out.extend_from_slice(&self.qpn.to_be_bytes());
        out.extend_from_slice(&self.psn.to_be_bytes());
        out.extend_from_slice(&self.mtu.to_be_bytes());
        out.extend_from_slice(&self.ring_addr.to_be_bytes());
        out.extend_from_slice(&self.ring_len.to_be_bytes());
        out.extend_from_slice(&self.ring_rkey.to_be_bytes());
        out.extend_from_slice(&self.credit_addr.to_be_bytes());
        out.extend_from_slice(&self.credit_rkey.to_be_bytes());
        out.extend_from_slice(&self.recv_depth.to_be_bytes());
    }

    /// Parses exactly [`ENDPOINT_LEN`] bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, EndpointError> {
        let bytes: &[u8; ENDPOINT_LEN] = bytes.try_into().map_err(|_| EndpointError::Length)?;
        let mut at = 0;
        let mut take = |n: usize| {
            let field = &bytes[at..at + n];
            at += n;
            field
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(take(16));
        let u16_at = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
        let u32_at = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let u64_at = |b: &[u8]| u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        let endpoint = RdmaEndpoint {
            gid,
            udp_port: u16_at(take(2)),
            qpn: u32_at(take(4)),
            psn: u32_at(take(4)),
            mtu: u16_at(take(2)),
            ring_addr: u64_at(take(8)),
            ring_len: u32_at(take(4)),
            ring_rkey: u32_at(take(4)),
            credit_addr: u64_at(take(8)),
            credit_rkey: u32_at(take(4)),
            recv_depth: u16_at(take(2)),
        };
        if endpoint.qpn >= 1 << 24 || endpoint.psn >= 1 << 24 {
            return Err(EndpointError::Range);
        }
        let ib_size = matches!(endpoint.mtu, 256 | 512 | 1024 | 2048 | 4096);
        if endpoint.mtu < 256 || (endpoint.udp_port == 0 && !ib_size) {
            return Err(EndpointError::Mtu);
        }
        if endpoint.ring_len < 64 || endpoint.recv_depth < 8 {
            return Err(EndpointError::Sizes);
        }
        Ok(endpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> RdmaEndpoint {
        RdmaEndpoint {
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1],
            udp_port: 4791,
            qpn: 0x11,
            psn: 0xabcdef,
            mtu: 4096,
            ring_addr: 0x7f00_0000_1000,
            ring_len: 1 << 18,
            ring_rkey: 0x1234,
            credit_addr: 0x7f00_0000_0000,
            credit_rkey: 0x5678,
            recv_depth: 64,
        }
    }

    #[test]
    fn round_trip_and_length() {
        let mut out = Vec::new();
        sample().emit(&mut out);
        assert_eq!(out.len(), ENDPOINT_LEN);
        assert_eq!(&out[16..18], &4791u16.to_be_bytes());
        assert_eq!(RdmaEndpoint::parse(&out), Ok(sample()));
        assert_eq!(RdmaEndpoint::parse(&out[1..]), Err(EndpointError::Length));
    }

    #[test]
    fn out_of_range_fields() {
        let encode = |e: RdmaEndpoint| {
            let mut out = Vec::new();
            e.emit(&mut out);
            out
        };
        assert_eq!(
            RdmaEndpoint::parse(&encode(RdmaEndpoint { qpn: 1 << 24, ..sample() })),
            Err(EndpointError::Range)
        );
        assert_eq!(
            RdmaEndpoint::parse(&encode(RdmaEndpoint { mtu: 1500, udp_port: 0, ..sample() })),
            Err(EndpointError::Mtu)
        );
        assert_eq!(
            RdmaEndpoint::parse(&encode(RdmaEndpoint { mtu: 255, ..sample() })),
            Err(EndpointError::Mtu)
        );
        // A soft device (UDP port set) may offer any size from 256: the Lightpath extension.
        assert_eq!(
            RdmaEndpoint::parse(&encode(RdmaEndpoint { mtu: 1408, ..sample() })),
            Ok(RdmaEndpoint { mtu: 1408, ..sample() })
        );
        assert_eq!(
            RdmaEndpoint::parse(&encode(RdmaEndpoint { ring_len: 8, ..sample() })),
            Err(EndpointError::Sizes)
        );
        assert_eq!(
            RdmaEndpoint::parse(&encode(RdmaEndpoint { recv_depth: 1, ..sample() })),
            Err(EndpointError::Sizes)
        );
    }
}
