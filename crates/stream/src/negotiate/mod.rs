//! Negotiation: the messages two Lightpath endpoints exchange over their TCP connection to
//! agree on a transport (an RDMA provider, or TCP) before any application byte moves.
//!
//! Byte layout (all integers big-endian):
//!
//! ```text
//! client → server   CLIENT_MAGIC (8 bytes) then frames
//! server → client   SERVER_MAGIC (8 bytes) then frames
//! frame             type (u8) | body length (u16) | body
//! ```
//!
//! The magics start with 0x89, a byte no text protocol begins with, so a plain TCP client
//! that reaches a Lightpath listener is recognised by its first byte, and a Lightpath client
//! that reaches any other server sees a reply that cannot be a server magic. See
//! `docs/stream-protocol.md` for the sequence.

mod endpoint;
mod message;

pub use endpoint::{ProviderId, RdmaEndpoint, ENDPOINT_LEN};
pub use message::{Choice, FallbackReason, Message, MessageType, ParseError, MAX_BODY};

/// What a Lightpath client sends first.
pub const CLIENT_MAGIC: [u8; 8] = *b"\x89LPATH/C";
/// What a Lightpath server sends first.
pub const SERVER_MAGIC: [u8; 8] = *b"\x89LPATH/S";
/// The newest protocol version this implementation speaks. Version 2 added rendezvous
/// (record kinds 8 and 9, a fourth reserved receive credit); a version-1 peer would reset the
/// connection on the first of those records, so the two are not mixed: a version-1 client
/// gets `ServerHello{Tcp(VersionMismatch)}` and both sides fall back to raw TCP. Version 3
/// changes nothing on the stream itself: it says that the side's soft device takes
/// acknowledgement bundles (an RC Acknowledge and a request in one datagram; the address
/// vector's `lightpath_bundles`), so two version-3 soft peers send them and a version-2 peer
/// never gets one. Version 4 adds ring restarts (bit 27 of a ring-bytes record's immediate,
/// see `Conn`'s module docs): a version-3 receiver would take the flagged length for 2^27
/// bytes and reset the connection, so only a version-4 sender facing a version-4 receiver
/// sets it (`ConnConfig::ring_restarts`); the stream is otherwise unchanged, so versions 2 to 4
/// all connect.
pub const VERSION: u8 = 4;

/// The oldest protocol version this implementation speaks (see [`VERSION`]).
pub const MIN_VERSION: u8 = 2;

/// The first version whose soft peers take acknowledgement bundles (see [`VERSION`]).
pub const BUNDLES_VERSION: u8 = 3;

/// The first version whose receivers take ring restarts (see [`VERSION`]).
pub const RESTARTS_VERSION: u8 = 4;

/// How a received prefix compares with an expected magic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MagicMatch {
    /// All 8 bytes match.
    Complete,
    /// The bytes so far match; more are needed.
    Partial,
    /// A byte differs: the peer does not speak this protocol.
    Mismatch,
}

/// Compares the bytes received so far with `magic`.
pub fn match_magic(received: &[u8], magic: &[u8; 8]) -> MagicMatch {
    let n = received.len().min(magic.len());
    if received[..n] != magic[..n] {
        MagicMatch::Mismatch
    } else if n == magic.len() {
        MagicMatch::Complete
    } else {
        MagicMatch::Partial
    }
}

/// Picks the version both sides speak: the highest in both ranges.
pub fn pick_version(peer_min: u8, peer_max: u8) -> Option<u8> {
    let highest = peer_max.min(VERSION);
    (highest >= peer_min.max(MIN_VERSION)).then_some(highest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_matching() {
        assert_eq!(match_magic(b"", &CLIENT_MAGIC), MagicMatch::Partial);
        assert_eq!(match_magic(b"\x89LP", &CLIENT_MAGIC), MagicMatch::Partial);
        assert_eq!(match_magic(&CLIENT_MAGIC, &CLIENT_MAGIC), MagicMatch::Complete);
        assert_eq!(match_magic(b"GET / HTTP/1.1\r\n", &CLIENT_MAGIC), MagicMatch::Mismatch);
        assert_eq!(match_magic(&CLIENT_MAGIC, &SERVER_MAGIC), MagicMatch::Mismatch);
    }

    #[test]
    fn versions() {
        assert_eq!(pick_version(2, 2), Some(2), "a version-2 peer: no bundles");
        assert_eq!(pick_version(2, 3), Some(3), "a version-3 peer: no ring restarts");
        assert_eq!(pick_version(0, 3), Some(3));
        assert_eq!(pick_version(3, 4), Some(4));
        assert_eq!(pick_version(3, 5), Some(4), "a newer peer that still speaks 4");
        assert_eq!(pick_version(1, 1), None, "version 1 has no rendezvous");
        assert_eq!(pick_version(5, 6), None);
        assert_eq!(pick_version(3, 2), None, "an empty range");
    }
}
