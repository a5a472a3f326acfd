//! The Base Transport Header (BTH, 12 bytes, digest §2) that starts every RoCE v2 UDP payload.

use crate::error::{ensure_room, Error, Result};
use crate::field::{read_u16, read_u24, write_u16, write_u24};
use crate::opcode::Opcode;
use crate::psn::Psn;

mod field {
    pub const OPCODE: usize = 0;
    /// SE(7) | M(6) | PadCnt(5:4) | TVer(3:0)
    pub const FLAGS: usize = 1;
    pub const PKEY: usize = 2;
    /// FECN(7) | BECN(6) | Resv6(5:0); masked out of the ICRC as a whole byte.
    pub const FECN_BECN: usize = 4;
    pub const DEST_QPN: usize = 5;
    /// AckReq(7) | Resv7(6:0)
    pub const ACK_REQ: usize = 8;
    pub const PSN: usize = 9;
}

const SE: u8 = 0x80;
const MIG_REQ: u8 = 0x40;
const PAD_SHIFT: u32 = 4;
const PAD_MASK: u8 = 0x30;
const TVER_MASK: u8 = 0x0F;
const FECN: u8 = 0x80;
const BECN: u8 = 0x40;
const RESV6_MASK: u8 = 0x3F;
const ACK_REQ: u8 = 0x80;
const RESV7_MASK: u8 = 0x7F;

/// Byte offset of the BTH byte that the ICRC masks (FECN, BECN, Resv6).
pub const ICRC_MASKED_BYTE: usize = field::FECN_BECN;

/// A read/write view of a BTH at the start of a buffer.
#[derive(Debug, Clone)]
pub struct BthPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> BthPacket<T> {
    /// Wraps a buffer without checking its length; accessors may panic on a short buffer.
    pub const fn new_unchecked(buffer: T) -> BthPacket<T> {
        BthPacket { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole BTH.
    pub fn new_checked(buffer: T) -> Result<BthPacket<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Checks that the buffer holds a whole BTH; after this no accessor panics.
    pub fn check_len(&self) -> Result<()> {
        if self.buffer.as_ref().len() < BthRepr::LEN {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.buffer.as_ref()[field::OPCODE])
    }

    /// The solicited-event bit.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & SE != 0
    }

    /// The MigReq bit (rxe sends 0, ConnectX often 1; ignored on receive).
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & MIG_REQ != 0
    }

    /// Number of pad bytes after the payload (0..=3).
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] & PAD_MASK) >> PAD_SHIFT
    }

    /// The transport header version (must be 0).
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & TVER_MASK
    }

    /// The partition key.
    pub fn pkey(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::PKEY)
    }

    /// The FECN bit.
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[field::FECN_BECN] & FECN != 0
    }

    /// The BECN bit (set in CNPs).
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[field::FECN_BECN] & BECN != 0
    }

    /// The six reserved bits after FECN/BECN (should be 0).
    pub fn resv6(&self) -> u8 {
        self.buffer.as_ref()[field::FECN_BECN] & RESV6_MASK
    }

    /// The 24-bit destination QP number.
    pub fn dest_qpn(&self) -> u32 {
        read_u24(self.buffer.as_ref(), field::DEST_QPN)
    }

    /// The AckReq bit.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & ACK_REQ != 0
    }

    /// The seven reserved bits after AckReq (should be 0; unlike Resv6 they are covered by
    /// the ICRC).
    pub fn resv7(&self) -> u8 {
        self.buffer.as_ref()[field::ACK_REQ] & RESV7_MASK
    }

    /// The packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(read_u24(self.buffer.as_ref(), field::PSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> BthPacket<T> {
    fn set_bits(&mut self, at: usize, mask: u8, value: u8) {
        let byte = &mut self.buffer.as_mut()[at];
        *byte = (*byte & !mask) | (value & mask);
    }

    /// Sets the opcode.
    pub fn set_opcode(&mut self, opcode: Opcode) {
        self.buffer.as_mut()[field::OPCODE] = opcode.0;
    }

    /// Sets the solicited-event bit.
    pub fn set_solicited(&mut self, value: bool) {
        self.set_bits(field::FLAGS, SE, if value { SE } else { 0 });
    }

    /// Sets the MigReq bit.
    pub fn set_mig_req(&mut self, value: bool) {
        self.set_bits(field::FLAGS, MIG_REQ, if value { MIG_REQ } else { 0 });
    }

    /// Sets the pad count (only the low two bits are used).
    pub fn set_pad_count(&mut self, value: u8) {
        self.set_bits(field::FLAGS, PAD_MASK, value << PAD_SHIFT);
    }

    /// Sets the transport version (only the low four bits are used).
    pub fn set_tver(&mut self, value: u8) {
        self.set_bits(field::FLAGS, TVER_MASK, value);
    }

    /// Sets the partition key.
    pub fn set_pkey(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::PKEY, value);
    }

    /// Sets the FECN bit.
    pub fn set_fecn(&mut self, value: bool) {
        self.set_bits(field::FECN_BECN, FECN, if value { FECN } else { 0 });
    }

    /// Sets the BECN bit.
    pub fn set_becn(&mut self, value: bool) {
        self.set_bits(field::FECN_BECN, BECN, if value { BECN } else { 0 });
    }

    /// Sets the six reserved bits of byte 4.
    pub fn set_resv6(&mut self, value: u8) {
        self.set_bits(field::FECN_BECN, RESV6_MASK, value);
    }

    /// Sets the destination QP number (low 24 bits).
    pub fn set_dest_qpn(&mut self, value: u32) {
        write_u24(self.buffer.as_mut(), field::DEST_QPN, value);
    }

    /// Sets the AckReq bit.
    pub fn set_ack_req(&mut self, value: bool) {
        self.set_bits(field::ACK_REQ, ACK_REQ, if value { ACK_REQ } else { 0 });
    }

    /// Sets the seven reserved bits of byte 8.
    pub fn set_resv7(&mut self, value: u8) {
        self.set_bits(field::ACK_REQ, RESV7_MASK, value);
    }

    /// Sets the PSN.
    pub fn set_psn(&mut self, value: Psn) {
        write_u24(self.buffer.as_mut(), field::PSN, value.value());
    }
}

/// The parsed fields of a BTH. Reserved bits are not represented: they are emitted as zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    /// The opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// MigReq.
    pub mig_req: bool,
    /// Pad bytes after the payload (0..=3).
    pub pad_count: u8,
    /// Transport version (0).
    pub tver: u8,
    /// Partition key (0xFFFF by default).
    pub pkey: u16,
    /// FECN.
    pub fecn: bool,
    /// BECN.
    pub becn: bool,
    /// Destination QP number (24 bits).
    pub dest_qpn: u32,
    /// AckReq.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// Length of a BTH in bytes.
    pub const LEN: usize = 12;
    /// The default partition key, the only one rxe accepts.
    pub const DEFAULT_PKEY: u16 = 0xFFFF;

    /// A BTH with the defaults rxe uses (P_Key 0xFFFF, every flag clear, pad 0).
    pub const fn new(opcode: Opcode, dest_qpn: u32, psn: Psn) -> BthRepr {
        BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            tver: 0,
            pkey: Self::DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qpn,
            ack_req: false,
            psn,
        }
    }

    /// Reads every field of a checked BTH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &BthPacket<&T>) -> Result<BthRepr> {
        packet.check_len()?;
        Ok(BthRepr {
            opcode: packet.opcode(),
            solicited: packet.solicited(),
            mig_req: packet.mig_req(),
            pad_count: packet.pad_count(),
            tver: packet.tver(),
            pkey: packet.pkey(),
            fecn: packet.fecn(),
            becn: packet.becn(),
            dest_qpn: packet.dest_qpn(),
            ack_req: packet.ack_req(),
            psn: packet.psn(),
        })
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        Self::LEN
    }

    /// Writes every field (reserved bits zero) into a view of at least [`BthRepr::LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut BthPacket<T>) -> Result<()> {
        ensure_room(Self::LEN, packet.buffer.as_ref().len())?;
        let flags = (if self.solicited { SE } else { 0 })
            | (if self.mig_req { MIG_REQ } else { 0 })
            | ((self.pad_count << PAD_SHIFT) & PAD_MASK)
            | (self.tver & TVER_MASK);
        let buf = packet.buffer.as_mut();
        buf[field::OPCODE] = self.opcode.0;
        buf[field::FLAGS] = flags;
        write_u16(buf, field::PKEY, self.pkey);
        buf[field::FECN_BECN] = (if self.fecn { FECN } else { 0 }) | (if self.becn { BECN } else { 0 });
        write_u24(buf, field::DEST_QPN, self.dest_qpn);
        buf[field::ACK_REQ] = if self.ack_req { ACK_REQ } else { 0 };
        write_u24(buf, field::PSN, self.psn.value());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The BTH of the rxe SEND_ONLY capture (two-vm-rc-send-only.txt, frame offset 42).
    const SEND_ONLY: [u8; 12] = [0x04, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x60, 0x6a, 0xf9];
    // The BTH of the ConnectX CNP (digest §5.3).
    const CNP: [u8; 12] = [0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0x00, 0x00, 0x00, 0x00];
    // The BTH of scapy's UC packet: M = 1, PadCnt = 2.
    const UC: [u8; 12] = [0x24, 0x60, 0xff, 0xff, 0x00, 0x00, 0x00, 0xd3, 0x00, 0xcf, 0x17, 0x10];

    #[test]
    fn parses_rxe_send_only() {
        let packet = BthPacket::new_checked(&SEND_ONLY[..]).unwrap();
        let repr = BthRepr::parse(&packet).unwrap();
        let mut expected = BthRepr::new(Opcode::RC_SEND_ONLY, 0x11, Psn::new(0x606af9));
        expected.ack_req = true;
        assert_eq!(repr, expected);
    }

    #[test]
    fn parses_flags_of_cnp_and_uc() {
        let cnp = BthPacket::new_checked(&CNP[..]).unwrap();
        assert!(cnp.becn() && !cnp.fecn());
        assert_eq!((cnp.opcode(), cnp.dest_qpn(), cnp.psn()), (Opcode::CNP, 0x118, Psn::new(0)));
        let uc = BthPacket::new_checked(&UC[..]).unwrap();
        assert!(uc.mig_req() && !uc.solicited());
        assert_eq!((uc.pad_count(), uc.tver(), uc.dest_qpn()), (2, 0, 211));
        assert_eq!(uc.psn().value(), 13_571_856);
    }

    #[test]
    fn emit_reproduces_the_bytes() {
        for bytes in [SEND_ONLY, CNP, UC] {
            let repr = BthRepr::parse(&BthPacket::new_checked(&bytes[..]).unwrap()).unwrap();
            let mut out = [0xAAu8; 12];
            repr.emit(&mut BthPacket::new_unchecked(&mut out[..])).unwrap();
            assert_eq!(out, bytes);
        }
    }

    #[test]
    fn setters_touch_only_their_bits() {
        let mut bytes = [0u8; 12];
        let mut packet = BthPacket::new_unchecked(&mut bytes[..]);
        packet.set_pad_count(3);
        packet.set_tver(0xF);
        packet.set_solicited(true);
        packet.set_resv6(0x3F);
        packet.set_fecn(true);
        packet.set_resv7(0x7F);
        packet.set_psn(Psn::new(0xFF_FFFF));
        packet.set_dest_qpn(0x1234_5678);
        assert_eq!(bytes, [0, 0xBF, 0, 0, 0xBF, 0x34, 0x56, 0x78, 0x7F, 0xff, 0xff, 0xff]);
        let mut packet = BthPacket::new_unchecked(&mut bytes[..]);
        packet.set_pad_count(0);
        packet.set_fecn(false);
        assert_eq!((bytes[1], bytes[4]), (0x8F, 0x3F));
    }

    #[test]
    fn short_buffers_are_rejected() {
        assert_eq!(BthPacket::new_checked(&SEND_ONLY[..11]).err(), Some(Error::Truncated));
        let repr = BthRepr::new(Opcode::RC_SEND_ONLY, 1, Psn::new(1));
        let mut small = [0u8; 11];
        assert!(repr.emit(&mut BthPacket::new_unchecked(&mut small[..])).is_err());
    }
}
