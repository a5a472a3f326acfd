//! Records over TCP (the fallback transport between two Lightpath peers): an 8-byte header
//! followed by `len` payload bytes.
//!
//! ```text
//! +------+-------+----------+----------------+
//! | kind | flags | reserved | len (u32, BE)  |
//! +------+-------+----------+----------------+
//!    1       1        2            4
//! ```
//!
//! `kind` uses the codes of [`RecordKind`]; only the kinds that make sense on a byte pipe are
//! allowed (data, message parts, close). `flags` and `reserved` must be zero. Framing the
//! fallback stream, rather than passing raw bytes, keeps message boundaries and lets a reader
//! tell a clean close (a close record) from a peer that vanished (EOF without one).

use crate::record::RecordKind;

/// Header length in bytes.
pub const HEADER_LEN: usize = 8;
/// Largest payload one TCP record may carry (writers split larger writes).
pub const MAX_FRAME_LEN: u32 = 1 << 30;

/// A record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What follows.
    pub kind: RecordKind,
    /// Payload bytes that follow the header.
    pub len: u32,
}

/// Why a header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Unknown kind code, or a kind that has no meaning over TCP.
    Kind(u8),
    /// Non-zero flags or reserved bytes.
    Reserved,
    /// Longer than [`MAX_FRAME_LEN`], or a close record with a payload.
    Length(u32),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Kind(code) => write!(f, "record kind {code} is not valid on a TCP stream"),
            FrameError::Reserved => f.write_str("record header has non-zero reserved bits"),
            FrameError::Length(len) => write!(f, "record length {len} is out of range"),
        }
    }
}

impl std::error::Error for FrameError {}

impl FrameHeader {
    /// The header's bytes.
    pub fn encode(self) -> [u8; HEADER_LEN] {
        let len = self.len.to_be_bytes();
        [self.kind.code(), 0, 0, 0, len[0], len[1], len[2], len[3]]
    }

    /// Parses a header received from the peer.
    pub fn parse(bytes: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        let kind = match RecordKind::from_code(bytes[0]) {
            // Rendezvous needs RDMA READ: a TCP stream carries its bytes inline.
            Some(
                kind @ (RecordKind::Data | RecordKind::MsgPart | RecordKind::MsgEnd | RecordKind::Close),
            ) => kind,
            _ => return Err(FrameError::Kind(bytes[0])),
        };
        if bytes[1..4] != [0, 0, 0] {
            return Err(FrameError::Reserved);
        }
        let len = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if len > MAX_FRAME_LEN || (kind == RecordKind::Close && len != 0) {
            return Err(FrameError::Length(len));
        }
        Ok(Self { kind, len })
    }
}

/// Reading side of a framed TCP stream: where the reader is inside the current record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameReader {
    header: [u8; HEADER_LEN],
    header_filled: usize,
    current: Option<(RecordKind, u32)>,
    closed: bool,
}

/// What the reader needs next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameNeed {
    /// Header bytes: read into [`FrameReader::header_space`] and call
    /// [`FrameReader::header_filled`].
    Header,
    /// Up to this many payload bytes of a record of this kind.
    Payload(RecordKind, u32),
    /// The peer closed its sending side cleanly.
    Closed,
}

impl FrameReader {
    /// What to read next.
    pub fn need(&self) -> FrameNeed {
        if self.closed {
            return FrameNeed::Closed;
        }
        match self.current {
            Some((kind, left)) => FrameNeed::Payload(kind, left),
            None => FrameNeed::Header,
        }
    }

    /// The unfilled part of the header buffer.
    pub fn header_space(&mut self) -> &mut [u8] {
        &mut self.header[self.header_filled..]
    }

    /// Records that `n` header bytes were read; parses the header once complete.
    pub fn header_filled(&mut self, n: usize) -> Result<(), FrameError> {
        self.header_filled = (self.header_filled + n).min(HEADER_LEN);
        if self.header_filled < HEADER_LEN {
            return Ok(());
        }
        self.header_filled = 0;
        let header = FrameHeader::parse(&self.header)?;
        if header.kind == RecordKind::Close {
            self.closed = true;
        } else {
            self.current = Some((header.kind, header.len));
            self.finish_if_empty_data();
        }
        Ok(())
    }

    /// Whether part of a header has been read (EOF now means a truncated record).
    pub fn mid_record(&self) -> bool {
        self.header_filled > 0 || self.current.is_some_and(|(_, left)| left > 0)
    }

    /// Records that `n` payload bytes of the current record were consumed.
    pub fn payload_consumed(&mut self, n: u32) {
        if let Some((kind, left)) = self.current {
            let left = left.saturating_sub(n);
            self.current = Some((kind, left));
            if left == 0 && kind != RecordKind::MsgEnd && kind != RecordKind::MsgPart {
                self.current = None;
            }
        }
    }

    /// Leaves a message record whose payload has been consumed (the caller has seen its end).
    pub fn finish_record(&mut self) {
        if self.current.is_some_and(|(_, left)| left == 0) {
            self.current = None;
        }
    }

    fn finish_if_empty_data(&mut self) {
        if let Some((RecordKind::Data, 0)) = self.current {
            self.current = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bytes() {
        let header = FrameHeader { kind: RecordKind::MsgEnd, len: 0x0102_0304 };
        assert_eq!(header.encode(), [2, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(FrameHeader::parse(&header.encode()), Ok(header));
    }

    #[test]
    fn bad_headers() {
        assert_eq!(FrameHeader::parse(&[4, 0, 0, 0, 0, 0, 0, 0]), Err(FrameError::Kind(4)));
        assert_eq!(FrameHeader::parse(&[8, 0, 0, 0, 0, 0, 0, 24]), Err(FrameError::Kind(8)));
        assert_eq!(FrameHeader::parse(&[9, 0, 0, 0, 0, 0, 0, 0]), Err(FrameError::Kind(9)));
        assert_eq!(FrameHeader::parse(&[10, 0, 0, 0, 0, 0, 0, 0]), Err(FrameError::Kind(10)));
        assert_eq!(FrameHeader::parse(&[0, 1, 0, 0, 0, 0, 0, 0]), Err(FrameError::Reserved));
        assert_eq!(FrameHeader::parse(&[0, 0, 0, 0, 0x40, 0, 0, 1]), Err(FrameError::Length(0x4000_0001)));
        assert_eq!(FrameHeader::parse(&[3, 0, 0, 0, 0, 0, 0, 1]), Err(FrameError::Length(1)));
    }

    #[test]
    fn reader_walks_records() {
        let mut reader = FrameReader::default();
        assert_eq!(reader.need(), FrameNeed::Header);
        let header = FrameHeader { kind: RecordKind::Data, len: 5 }.encode();
        reader.header_space()[..3].copy_from_slice(&header[..3]);
        reader.header_filled(3).unwrap();
        assert!(reader.mid_record());
        reader.header_space().copy_from_slice(&header[3..]);
        reader.header_filled(5).unwrap();
        assert_eq!(reader.need(), FrameNeed::Payload(RecordKind::Data, 5));
        reader.payload_consumed(2);
        assert_eq!(reader.need(), FrameNeed::Payload(RecordKind::Data, 3));
        reader.payload_consumed(3);
        assert_eq!(reader.need(), FrameNeed::Header);
        assert!(!reader.mid_record());
        let header = FrameHeader { kind: RecordKind::MsgEnd, len: 1 }.encode();
        reader.header_space().copy_from_slice(&header);
        reader.header_filled(8).unwrap();
        reader.payload_consumed(1);
        assert_eq!(reader.need(), FrameNeed::Payload(RecordKind::MsgEnd, 0), "message end stays visible");
        reader.finish_record();
        let close = FrameHeader { kind: RecordKind::Close, len: 0 }.encode();
        reader.header_space().copy_from_slice(&close);
        reader.header_filled(8).unwrap();
        assert_eq!(reader.need(), FrameNeed::Closed);
    }
}
