//! The UDP source port of a connection, chosen as Linux rxe does (digest §1.4) so that a flow
//! hashes the same way whichever implementation sends it.

/// The flow label rxe derives from the QPN pair when the address vector's is 0. Symmetric:
/// both ends of a connection compute the same value.
pub(crate) fn flow_label(local_qpn: u32, remote_qpn: u32) -> u32 {
    let mut v = u64::from(local_qpn) * u64::from(remote_qpn);
    v ^= v >> 20;
    v ^= v >> 40;
    (v & 0xF_FFFF) as u32
}

/// `rdma_get_udp_sport`: 0xC000 | a 14-bit fold of the flow label.
pub(crate) fn udp_source_port(flow_label_or_zero: u32, local_qpn: u32, remote_qpn: u32) -> u16 {
    let fl = match flow_label_or_zero & 0xF_FFFF {
        0 => flow_label(local_qpn, remote_qpn),
        fl => fl,
    };
    (0xC000 | ((fl & 0x3FFF) ^ ((fl & 0xF_C000) >> 14))) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_digest_examples() {
        assert_eq!(udp_source_port(0, 0x11, 0x12), 0xC132);
        assert_eq!(udp_source_port(0, 0x12, 0x11), 0xC132);
        assert_eq!(udp_source_port(0, 0x1234, 0x5678), 0xC01A);
    }

    #[test]
    fn explicit_flow_label_is_used() {
        assert_eq!(udp_source_port(0x4002, 1, 2), 0xC003);
    }
}
