//! A whole RoCE v2 UDP payload (BTH, extension headers, payload, pad, ICRC slot) as one
//! parsed value, plus the header-only emit path the engine uses to copy payload bytes straight
//! from registered memory into the datagram buffer.

use crate::aeth::{AethPacket, AethRepr};
use crate::atomic::{AtomicAckEthPacket, AtomicAckEthRepr, AtomicEthPacket, AtomicEthRepr};
use crate::bth::{BthPacket, BthRepr};
use crate::deth::{DethPacket, DethRepr};
use crate::error::{ensure_room, Error, Result};
use crate::field::read_u32;
use crate::imm::{emit_word, IETH_LEN, IMM_DT_LEN};
use crate::opcode::{HeaderSet, Opcode, OpcodeInfo, CNP_RESERVED_LEN};
use crate::reth::{RethPacket, RethRepr};

/// Bytes of ICRC at the end of every RoCE v2 UDP payload.
pub const ICRC_LEN: usize = 4;

/// Bytes of an RC Acknowledge packet: BTH, AETH, ICRC. Between two Lightpath soft devices
/// such a packet may lead an *acknowledgement bundle*, a UDP payload that goes on with a second
/// packet (see `lightpath_roce::Engine::handle_datagram`); a longer RC Acknowledge is otherwise
/// malformed.
pub const ACK_PACKET_LEN: usize = crate::bth::BthRepr::LEN + crate::aeth::AethRepr::LEN + ICRC_LEN;

/// Pad bytes that follow a payload of `payload_len` bytes (to a multiple of 4).
pub const fn pad_len(payload_len: usize) -> usize {
    payload_len.wrapping_neg() & 3
}

/// The BTH and every extension header of a packet, without payload.
///
/// Exactly the headers the opcode requires must be `Some` (see [`Opcode::info`]); `emit`
/// refuses any other combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportHeader {
    /// Base transport header.
    pub bth: BthRepr,
    /// Datagram ETH (UD).
    pub deth: Option<DethRepr>,
    /// RDMA ETH (WRITE first/only, READ request).
    pub reth: Option<RethRepr>,
    /// Atomic ETH (COMPARE_SWAP, FETCH_ADD).
    pub atomic_eth: Option<AtomicEthRepr>,
    /// ACK ETH (ACKs, atomic ACKs, READ responses except MIDDLE).
    pub aeth: Option<AethRepr>,
    /// Atomic ACK ETH (ATOMIC_ACKNOWLEDGE).
    pub atomic_ack: Option<AtomicAckEthRepr>,
    /// Immediate data, carried byte-for-byte.
    pub imm: Option<u32>,
    /// R_Key to invalidate (SEND with invalidate).
    pub ieth: Option<u32>,
}

/// A whole parsed RoCE v2 UDP payload: headers plus the payload bytes (pad and ICRC removed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportRepr<'a> {
    /// The headers.
    pub header: TransportHeader,
    /// The payload, without pad.
    pub payload: &'a [u8],
}

impl TransportHeader {
    /// A header with only a BTH; set the extension headers the opcode needs.
    pub const fn new(bth: BthRepr) -> TransportHeader {
        TransportHeader {
            bth,
            deth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack: None,
            imm: None,
            ieth: None,
        }
    }

    /// The opcode's table entry (`None` if the opcode is unknown).
    pub fn info(&self) -> Option<OpcodeInfo> {
        self.bth.opcode.info()
    }

    /// The extension headers present in this value (the CNP's reserved bytes count as present
    /// when the opcode is CNP).
    pub fn header_set(&self) -> HeaderSet {
        HeaderSet {
            reth: self.reth.is_some(),
            aeth: self.aeth.is_some(),
            atomic_eth: self.atomic_eth.is_some(),
            atomic_ack_eth: self.atomic_ack.is_some(),
            imm: self.imm.is_some(),
            ieth: self.ieth.is_some(),
            deth: self.deth.is_some(),
            cnp_reserved: self.bth.opcode == Opcode::CNP,
        }
    }

    /// BTH plus extension headers, in bytes.
    pub fn header_len(&self) -> usize {
        BthRepr::LEN + self.header_set().len()
    }

    /// Length of the whole UDP payload for a payload of `payload_len` bytes:
    /// headers + payload + pad + ICRC.
    pub fn datagram_len(&self, payload_len: usize) -> usize {
        self.header_len() + payload_len + pad_len(payload_len) + ICRC_LEN
    }

    /// Checks that the opcode is known and that exactly its headers are present.
    pub fn check(&self) -> Result<OpcodeInfo> {
        let info = self.info().ok_or(Error::UnknownOpcode(self.bth.opcode.0))?;
        if self.header_set() != info.headers {
            return Err(Error::Malformed("extension headers do not match the opcode"));
        }
        Ok(info)
    }

    /// Parses the BTH and the extension headers its opcode requires from the start of a UDP
    /// payload; returns them and the header length. Checks TVer 0, a known opcode and that the
    /// datagram is long enough for the headers and the ICRC.
    pub fn parse(datagram: &[u8]) -> Result<(TransportHeader, usize)> {
        let bth = BthRepr::parse(&BthPacket::new_checked(datagram)?)?;
        if bth.tver != 0 {
            return Err(Error::UnsupportedTransportVersion(bth.tver));
        }
        let info = bth.opcode.info().ok_or(Error::UnknownOpcode(bth.opcode.0))?;
        let header_len = info.header_len();
        if datagram.len() < header_len + ICRC_LEN {
            return Err(Error::Truncated);
        }
        let mut header = TransportHeader::new(bth);
        let mut at = BthRepr::LEN;
        let headers = info.headers;
        if headers.deth {
            header.deth = Some(DethRepr::parse(&DethPacket::new_checked(&datagram[at..])?)?);
            at += DethRepr::LEN;
        }
        if headers.reth {
            header.reth = Some(RethRepr::parse(&RethPacket::new_checked(&datagram[at..])?)?);
            at += RethRepr::LEN;
        }
        if headers.atomic_eth {
            let packet = AtomicEthPacket::new_checked(&datagram[at..])?;
            header.atomic_eth = Some(AtomicEthRepr::parse(&packet)?);
            at += AtomicEthRepr::LEN;
        }
        if headers.aeth {
            header.aeth = Some(AethRepr::parse(&AethPacket::new_checked(&datagram[at..])?)?);
            at += AethRepr::LEN;
        }
        if headers.atomic_ack_eth {
            let packet = AtomicAckEthPacket::new_checked(&datagram[at..])?;
            header.atomic_ack = Some(AtomicAckEthRepr::parse(&packet)?);
            at += AtomicAckEthRepr::LEN;
        }
        if headers.imm {
            header.imm = Some(read_u32(datagram, at));
            at += IMM_DT_LEN;
        }
        if headers.ieth {
            header.ieth = Some(read_u32(datagram, at));
            at += IETH_LEN;
        }
        if headers.cnp_reserved {
            at += CNP_RESERVED_LEN;
        }
        debug_assert_eq!(at, header_len);
        Ok((header, header_len))
    }

    /// Writes the headers for a payload of `payload_len` bytes into the start of `buf`
    /// (setting BTH PadCnt from the length, whatever `bth.pad_count` says), zeroes the pad and
    /// ICRC bytes, and returns the header length. The payload area
    /// `buf[header_len .. header_len + payload_len]` is left for the caller to fill.
    pub fn emit(&self, payload_len: usize, buf: &mut [u8]) -> Result<usize> {
        // The checked header set is the one present, so the lengths follow from the opcode's
        // table entry: one look at the opcode and the options per packet, not one per length.
        let info = self.check()?;
        let header_len = BthRepr::LEN + info.headers.len();
        let pad = pad_len(payload_len);
        let total = header_len + payload_len + pad + ICRC_LEN;
        ensure_room(total, buf.len())?;
        let mut bth = self.bth;
        bth.pad_count = pad as u8;
        bth.emit(&mut BthPacket::new_unchecked(&mut buf[..]))?;
        let mut at = BthRepr::LEN;
        if let Some(deth) = &self.deth {
            deth.emit(&mut DethPacket::new_unchecked(&mut buf[at..]))?;
            at += DethRepr::LEN;
        }
        if let Some(reth) = &self.reth {
            reth.emit(&mut RethPacket::new_unchecked(&mut buf[at..]))?;
            at += RethRepr::LEN;
        }
        if let Some(atomic) = &self.atomic_eth {
            atomic.emit(&mut AtomicEthPacket::new_unchecked(&mut buf[at..]))?;
            at += AtomicEthRepr::LEN;
        }
        if let Some(aeth) = &self.aeth {
            aeth.emit(&mut AethPacket::new_unchecked(&mut buf[at..]))?;
            at += AethRepr::LEN;
        }
        if let Some(ack) = &self.atomic_ack {
            ack.emit(&mut AtomicAckEthPacket::new_unchecked(&mut buf[at..]))?;
            at += AtomicAckEthRepr::LEN;
        }
        if let Some(imm) = self.imm {
            emit_word(imm, &mut buf[at..])?;
            at += IMM_DT_LEN;
        }
        if let Some(rkey) = self.ieth {
            emit_word(rkey, &mut buf[at..])?;
            at += IETH_LEN;
        }
        if self.bth.opcode == Opcode::CNP {
            buf[at..at + CNP_RESERVED_LEN].fill(0);
            at += CNP_RESERVED_LEN;
        }
        debug_assert_eq!(at, header_len);
        buf[header_len + payload_len..total].fill(0);
        Ok(header_len)
    }
}

impl<'a> TransportRepr<'a> {
    /// Parses a whole UDP payload including the 4 ICRC bytes (the ICRC is NOT checked here).
    ///
    /// Checks the length, TVer 0, a known opcode, the opcode's extension headers, that the pad
    /// count fits in the payload area and that payload + pad is a multiple of 4; strips the pad.
    /// Payload length rules that depend on the path MTU are checked by
    /// [`TransportRepr::check_payload_len`]. Never panics.
    pub fn parse(datagram: &'a [u8]) -> Result<TransportRepr<'a>> {
        let (header, header_len) = TransportHeader::parse(datagram)?;
        let area = datagram.len() - header_len - ICRC_LEN;
        let pad = usize::from(header.bth.pad_count);
        if pad > area {
            return Err(Error::Malformed("pad count exceeds the payload area"));
        }
        if !area.is_multiple_of(4) {
            return Err(Error::Malformed("payload + pad is not a multiple of 4 bytes"));
        }
        Ok(TransportRepr { header, payload: &datagram[header_len..header_len + area - pad] })
    }

    /// Length of the whole UDP payload: headers + payload + pad + ICRC.
    pub fn buffer_len(&self) -> usize {
        self.header.datagram_len(self.payload.len())
    }

    /// Writes headers, payload, zero pad and a zeroed ICRC slot; returns the total length.
    /// Seal it afterwards with [`crate::icrc::seal`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let header_len = self.header.emit(self.payload.len(), buf)?;
        buf[header_len..header_len + self.payload.len()].copy_from_slice(self.payload);
        Ok(self.buffer_len())
    }

    /// Checks the payload length against the opcode's rule for a path MTU in bytes
    /// (FIRST/MIDDLE exactly PMTU, LAST 1..=PMTU, ONLY 0..=PMTU, none for READ requests, ACKs,
    /// atomics and CNPs).
    pub fn check_payload_len(&self, pmtu: usize) -> Result<()> {
        let info = self.header.check()?;
        info.check_payload_len(self.payload.len(), pmtu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aeth::Syndrome;
    use crate::psn::Psn;

    /// UDP payload of the self-made RC SEND_ONLY vector of digest §5.3 ("hello", AckReq).
    const SEND_HELLO: &[u8] = &[
        0x04, 0x30, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x12, 0x34, 0x56, b'h', b'e', b'l', b'l', b'o',
        0, 0, 0, 0x38, 0xd5, 0xd2, 0x62,
    ];
    /// UDP payload of the digest's RC ACK vector (syndrome 0x1F, MSN 1).
    const ACK: &[u8] = &[
        0x11, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x12, 0x00, 0x12, 0x34, 0x56, 0x1f, 0x00, 0x00, 0x01, 0xab,
        0xa9, 0x68, 0x87,
    ];

    #[test]
    fn parses_send_only_and_strips_the_pad() {
        let repr = TransportRepr::parse(SEND_HELLO).unwrap();
        assert_eq!(repr.payload, b"hello");
        assert_eq!(repr.header.bth.opcode, Opcode::RC_SEND_ONLY);
        assert_eq!(repr.header.bth.pad_count, 3);
        assert!(repr.header.bth.ack_req);
        assert_eq!(repr.header.bth.psn, Psn::new(0x123456));
        assert_eq!(repr.header.header_set(), HeaderSet::default());
        assert_eq!(repr.buffer_len(), SEND_HELLO.len());
        assert!(repr.check_payload_len(256).is_ok());
        assert!(repr.check_payload_len(4).is_err());
    }

    #[test]
    fn parses_ack() {
        let repr = TransportRepr::parse(ACK).unwrap();
        assert_eq!(repr.header.aeth, Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 1 }));
        assert!(repr.payload.is_empty());
        assert_eq!(repr.header.header_len(), 16);
    }

    #[test]
    fn emit_reproduces_everything_but_the_icrc() {
        for bytes in [SEND_HELLO, ACK] {
            let repr = TransportRepr::parse(bytes).unwrap();
            let mut out = vec![0xEE; repr.buffer_len()];
            assert_eq!(repr.emit(&mut out).unwrap(), bytes.len());
            let n = bytes.len() - ICRC_LEN;
            assert_eq!(out[..n], bytes[..n]);
            assert_eq!(out[n..], [0, 0, 0, 0]);
        }
    }

    #[test]
    fn header_emit_leaves_the_payload_area_alone() {
        let mut bth = BthRepr::new(Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, 0x12, Psn::new(7));
        bth.pad_count = 0; // recomputed from the payload length
        let mut header = TransportHeader::new(bth);
        header.reth = Some(RethRepr { va: 0x1000, rkey: 0x42, dma_len: 6 });
        header.imm = Some(0xCAFE_F00D);
        let mut buf = [0x77u8; 32 + 6 + 2 + 4];
        assert_eq!(header.emit(6, &mut buf).unwrap(), 32);
        assert_eq!(buf[32..38], [0x77; 6]);
        assert_eq!(buf[38..], [0; 6]);
        assert_eq!(buf[1] >> 4 & 3, 2);
        buf[32..38].copy_from_slice(b"abcdef");
        let repr = TransportRepr::parse(&buf).unwrap();
        assert_eq!(repr.payload, b"abcdef");
        assert_eq!(repr.header.imm, Some(0xCAFE_F00D));
        assert_eq!(buf[28..32], [0xCA, 0xFE, 0xF0, 0x0D]);
    }

    #[test]
    fn emit_rejects_wrong_headers_and_small_buffers() {
        let mut header = TransportHeader::new(BthRepr::new(Opcode::RC_ACKNOWLEDGE, 1, Psn::new(0)));
        let mut buf = [0u8; 64];
        assert!(matches!(header.emit(0, &mut buf), Err(Error::Malformed(_))));
        header.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: 0 });
        header.imm = Some(1);
        assert!(header.emit(0, &mut buf).is_err());
        header.imm = None;
        assert_eq!(header.emit(0, &mut buf[..20]), Ok(16));
        assert_eq!(header.emit(0, &mut buf[..19]), Err(Error::BufferTooSmall { needed: 20, available: 19 }));
        let unknown = TransportHeader::new(BthRepr::new(Opcode(0x15), 1, Psn::new(0)));
        assert_eq!(unknown.emit(0, &mut buf), Err(Error::UnknownOpcode(0x15)));
    }

    #[test]
    fn parse_rejects_bad_datagrams() {
        assert_eq!(TransportRepr::parse(&ACK[..19]), Err(Error::Truncated));
        assert_eq!(TransportRepr::parse(&SEND_HELLO[..15]), Err(Error::Truncated));
        let mut bad = SEND_HELLO.to_vec();
        bad[1] |= 0x01;
        assert_eq!(TransportRepr::parse(&bad), Err(Error::UnsupportedTransportVersion(1)));
        bad[1] = 0x30;
        bad[0] = 0x15;
        assert_eq!(TransportRepr::parse(&bad), Err(Error::UnknownOpcode(0x15)));
        // 12-byte BTH, pad 3, ICRC: a payload area of 0 bytes cannot hold 3 pad bytes.
        let mut short = SEND_HELLO[..12].to_vec();
        short.extend_from_slice(&[0; 4]);
        assert!(matches!(TransportRepr::parse(&short), Err(Error::Malformed(_))));
        // A payload area of 5 bytes is not 4-aligned.
        let mut odd = SEND_HELLO[..17].to_vec();
        odd[1] = 0;
        odd.extend_from_slice(&[0; 4]);
        assert!(matches!(TransportRepr::parse(&odd), Err(Error::Malformed(_))));
    }

    #[test]
    fn cnp_has_sixteen_reserved_bytes() {
        let mut bth = BthRepr::new(Opcode::CNP, 0x118, Psn::new(0));
        bth.becn = true;
        let repr = TransportRepr { header: TransportHeader::new(bth), payload: &[] };
        assert_eq!(repr.buffer_len(), 32);
        let mut buf = [0xFFu8; 32];
        repr.emit(&mut buf).unwrap();
        assert_eq!(buf[12..], [0; 20]);
        assert_eq!(TransportRepr::parse(&buf).unwrap(), repr);
    }

    #[test]
    fn pad_lengths() {
        assert_eq!([0, 1, 2, 3, 4, 5].map(pad_len), [0, 3, 2, 1, 0, 3]);
    }
}
