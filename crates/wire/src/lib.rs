//! RoCE v2 wire formats for Lightpath, in the style of smoltcp's `wire` module.
//!
//! Every header has a zero-copy view (`XxxPacket<T: AsRef<[u8]>>`: `new_unchecked`,
//! `new_checked`, `check_len`, getters, and setters when `T: AsMut<[u8]>`) and a parsed value
//! (`XxxRepr`: `parse`, `emit`, `buffer_len`). Once `check_len` has passed no accessor panics,
//! and no parser panics on any input.
//!
//! The transport layer (the UDP payload of RoCE v2) is parsed and emitted as a whole by
//! [`TransportRepr`]; [`opcode`] holds the table of which headers and payload each opcode
//! carries; [`icrc`] computes and verifies the invariant CRC; [`pretty`] renders packets for
//! humans. IPv4, IPv6, UDP and Ethernet are here for decoding captures and building whole
//! packets in tests. No I/O, no unsafe code.

#![forbid(unsafe_code)]

mod field;

pub mod aeth;
pub mod atomic;
pub mod bth;
pub mod capture;
pub mod deth;
pub mod error;
pub mod ethernet;
pub mod icrc;
pub mod imm;
pub mod ipv4;
pub mod ipv6;
pub mod opcode;
pub mod pretty;
pub mod psn;
pub mod reth;
pub mod transport;
pub mod udp;

pub use aeth::{AethPacket, AethRepr, NakCode, Syndrome};
pub use atomic::{AtomicAckEthPacket, AtomicAckEthRepr, AtomicEthPacket, AtomicEthRepr};
pub use bth::{BthPacket, BthRepr};
pub use deth::{DethPacket, DethRepr};
pub use error::{Error, Result};
pub use ethernet::{EthernetAddress, EthernetFrame, EthernetRepr, VlanTag};
pub use icrc::Endpoints;
pub use imm::{IethPacket, ImmDtPacket};
pub use ipv4::{Ipv4Packet, Ipv4Repr};
pub use ipv6::{Ipv6Packet, Ipv6Repr};
pub use opcode::{HeaderSet, OpKind, Opcode, OpcodeInfo, PayloadRule, Position, Transport};
pub use psn::Psn;
pub use reth::{RethPacket, RethRepr};
pub use transport::{TransportHeader, TransportRepr, ICRC_LEN};
pub use udp::{UdpPacket, UdpRepr, ROCE_V2_PORT};
