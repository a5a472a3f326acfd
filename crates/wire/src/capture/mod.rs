//! Reading (and writing) packet captures: classic pcap files and the hex-text formats people
//! paste (tcpdump/xxd-style offset dumps, plain hex with whitespace, colons or `0x`).
//!
//! Pure byte parsing, no I/O: the caller reads the file.

pub mod hex_text;
pub mod pcap;
