//! Classic pcap files (not pcapng): a reader for any byte order and micro- or nanosecond
//! timestamps, and a writer (nanosecond, little-endian) for tools that record traffic.

use crate::error::{Error, Result};

const MAGIC_MICROS: u32 = 0xA1B2_C3D4;
const MAGIC_NANOS: u32 = 0xA1B2_3C4D;
/// First four bytes of a pcapng file (its section header block type).
const PCAPNG_MAGIC: [u8; 4] = [0x0A, 0x0D, 0x0D, 0x0A];
const FILE_HEADER_LEN: usize = 24;
const RECORD_HEADER_LEN: usize = 16;

/// Link type of Ethernet frames.
pub const LINKTYPE_ETHERNET: u32 = 1;
/// Link type of bare IPv4/IPv6 packets.
pub const LINKTYPE_RAW: u32 = 101;
/// Link type of bare IPv4 packets.
pub const LINKTYPE_IPV4: u32 = 228;
/// Link type of bare IPv6 packets.
pub const LINKTYPE_IPV6: u32 = 229;
/// Link type of Linux "cooked" captures (`tcpdump -i any`).
pub const LINKTYPE_LINUX_SLL: u32 = 113;

/// Where the packets of a link type start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkStart {
    /// Each record is an Ethernet frame.
    Ethernet,
    /// Each record is an IP packet.
    Ip,
    /// Each record starts with a 16-byte Linux cooked header, then an IP packet.
    LinuxSll,
}

/// How to read the records of a link type; `None` for link types this reader does not know.
pub fn link_start(link_type: u32) -> Option<LinkStart> {
    match link_type {
        LINKTYPE_ETHERNET => Some(LinkStart::Ethernet),
        LINKTYPE_RAW | LINKTYPE_IPV4 | LINKTYPE_IPV6 => Some(LinkStart::Ip),
        LINKTYPE_LINUX_SLL => Some(LinkStart::LinuxSll),
        _ => None,
    }
}

/// One captured packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// 1-based position in the file.
    pub number: usize,
    /// Capture time in nanoseconds since the Unix epoch.
    pub timestamp_nanos: u64,
    /// Length of the packet on the wire (may exceed `data.len()` if the capture truncated it).
    pub orig_len: u32,
    /// The captured bytes.
    pub data: &'a [u8],
}

/// Iterates over the records of a classic pcap file held in memory.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    data: &'a [u8],
    offset: usize,
    number: usize,
    big_endian: bool,
    nanos: bool,
    link_type: u32,
}

impl<'a> Reader<'a> {
    /// Reads the file header. pcapng files are refused with an error that says so.
    pub fn new(data: &'a [u8]) -> Result<Reader<'a>> {
        if data.len() >= 4 && data[..4] == PCAPNG_MAGIC {
            return Err(Error::Malformed(
                "this is a pcapng file; only classic pcap is read (convert it with \
                 `editcap -F pcap in.pcapng out.pcap` or capture with `tcpdump -w`)",
            ));
        }
        if data.len() < FILE_HEADER_LEN {
            return Err(Error::Truncated);
        }
        let le = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let be = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
        let (big_endian, nanos) = match (le, be) {
            (MAGIC_MICROS, _) => (false, false),
            (MAGIC_NANOS, _) => (false, true),
            (_, MAGIC_MICROS) => (true, false),
            (_, MAGIC_NANOS) => (true, true),
            _ => return Err(Error::Malformed("not a pcap file (unknown magic number)")),
        };
        let mut reader = Reader { data, offset: FILE_HEADER_LEN, number: 0, big_endian, nanos, link_type: 0 };
        reader.link_type = reader.u32_at(20);
        Ok(reader)
    }

    /// The link type of every record (1 = Ethernet).
    pub fn link_type(&self) -> u32 {
        self.link_type
    }

    fn u32_at(&self, at: usize) -> u32 {
        let b = [self.data[at], self.data[at + 1], self.data[at + 2], self.data[at + 3]];
        if self.big_endian {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    }
}

impl<'a> Iterator for Reader<'a> {
    type Item = Result<Record<'a>>;

    fn next(&mut self) -> Option<Result<Record<'a>>> {
        let remaining = self.data.len() - self.offset;
        if remaining == 0 {
            return None;
        }
        if remaining < RECORD_HEADER_LEN {
            self.offset = self.data.len();
            return Some(Err(Error::Truncated));
        }
        let at = self.offset;
        let seconds = u64::from(self.u32_at(at));
        let fraction = u64::from(self.u32_at(at + 4));
        let incl_len = self.u32_at(at + 8) as usize;
        let orig_len = self.u32_at(at + 12);
        let start = at + RECORD_HEADER_LEN;
        let Some(end) = start.checked_add(incl_len).filter(|&end| end <= self.data.len()) else {
            self.offset = self.data.len();
            return Some(Err(Error::Truncated));
        };
        self.offset = end;
        self.number += 1;
        let sub_second = if self.nanos { fraction } else { fraction * 1000 };
        Some(Ok(Record {
            number: self.number,
            timestamp_nanos: seconds * 1_000_000_000 + sub_second,
            orig_len,
            data: &self.data[start..end],
        }))
    }
}

/// Appends a pcap file header (little-endian, nanosecond timestamps) to `out`.
pub fn write_header(out: &mut Vec<u8>, link_type: u32) {
    out.extend_from_slice(&MAGIC_NANOS.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&0i32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&65_535u32.to_le_bytes());
    out.extend_from_slice(&link_type.to_le_bytes());
}

/// Appends one record to `out` (packets longer than 4 GiB do not exist on any link).
pub fn write_record(out: &mut Vec<u8>, timestamp_nanos: u64, data: &[u8]) {
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&((timestamp_nanos / 1_000_000_000) as u32).to_le_bytes());
    out.extend_from_slice(&((timestamp_nanos % 1_000_000_000) as u32).to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&data[..len as usize]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_read() {
        let mut file = Vec::new();
        write_header(&mut file, LINKTYPE_ETHERNET);
        write_record(&mut file, 1_500_000_123, &[1, 2, 3]);
        write_record(&mut file, 2_000_000_000, &[]);
        let reader = Reader::new(&file).unwrap();
        assert_eq!(reader.link_type(), LINKTYPE_ETHERNET);
        let records: Vec<_> = reader.map(Result::unwrap).collect();
        assert_eq!(records.len(), 2);
        assert_eq!(
            (records[0].number, records[0].timestamp_nanos, records[0].data),
            (1, 1_500_000_123, &[1u8, 2, 3][..])
        );
        assert_eq!((records[1].number, records[1].orig_len), (2, 0));
    }

    #[test]
    fn reads_big_endian_microseconds() {
        let mut file = vec![0xA1, 0xB2, 0xC3, 0xD4, 0, 2, 0, 4];
        file.extend_from_slice(&[0; 12]);
        file.extend_from_slice(&101u32.to_be_bytes());
        file.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 5, 0, 0, 0, 2, 0, 0, 0, 9, 0x45, 0]);
        let mut reader = Reader::new(&file).unwrap();
        assert_eq!(link_start(reader.link_type()), Some(LinkStart::Ip));
        let record = reader.next().unwrap().unwrap();
        assert_eq!(
            (record.timestamp_nanos, record.orig_len, record.data),
            (1_000_005_000, 9, &[0x45u8, 0][..])
        );
        assert!(reader.next().is_none());
    }

    #[test]
    fn refuses_pcapng_and_garbage_and_reports_truncation() {
        let err = Reader::new(&[0x0A, 0x0D, 0x0D, 0x0A, 0, 0, 0, 0]).unwrap_err();
        assert!(matches!(err, Error::Malformed(m) if m.contains("pcapng")));
        assert!(Reader::new(&[0u8; 24]).is_err());
        assert_eq!(Reader::new(&[0xD4, 0xC3]).unwrap_err(), Error::Truncated);
        let mut file = Vec::new();
        write_header(&mut file, LINKTYPE_ETHERNET);
        write_record(&mut file, 0, &[1, 2, 3, 4]);
        file.truncate(file.len() - 1);
        let mut reader = Reader::new(&file).unwrap();
        assert_eq!(reader.next(), Some(Err(Error::Truncated)));
        assert_eq!(reader.next(), None);
    }
}
