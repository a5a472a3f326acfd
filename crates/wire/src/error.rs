//! The error type shared by every parser and emitter of this crate.
//!
//! Parsers never panic on malformed input; they return one of these instead.

use core::fmt;

use crate::opcode::PayloadRule;

/// Why a packet could not be parsed, emitted or checked.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// The buffer is shorter than the header (or the lengths it announces) requires.
    Truncated,
    /// A field holds a value that the format does not allow; the text says which.
    Malformed(&'static str),
    /// The BTH opcode is reserved, or belongs to a transport this crate does not parse.
    UnknownOpcode(u8),
    /// The BTH transport version is not 0 (rxe drops such packets).
    UnsupportedTransportVersion(u8),
    /// An output buffer is too small for what was asked to be written into it.
    BufferTooSmall {
        /// Bytes the emitter needs.
        needed: usize,
        /// Bytes the caller provided.
        available: usize,
    },
    /// A payload length breaks the opcode's rule for the path MTU (digest §4).
    BadPayloadLength {
        /// The payload length in bytes (pad excluded).
        len: usize,
        /// The rule the opcode imposes.
        rule: PayloadRule,
        /// The path MTU the rule was checked against.
        pmtu: usize,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = core::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => f.write_str("packet truncated"),
            Error::Malformed(what) => write!(f, "malformed packet: {what}"),
            Error::UnknownOpcode(code) => write!(f, "unknown or unsupported BTH opcode {code:#04x}"),
            Error::UnsupportedTransportVersion(v) => {
                write!(f, "BTH transport version {v} (only 0 exists)")
            }
            Error::BufferTooSmall { needed, available } => {
                write!(f, "buffer too small: need {needed} bytes, have {available}")
            }
            Error::BadPayloadLength { len, rule, pmtu } => {
                write!(f, "payload of {len} bytes breaks the rule {rule:?} at PMTU {pmtu}")
            }
        }
    }
}

impl std::error::Error for Error {}

/// Checks that an output buffer holds at least `needed` bytes.
pub(crate) fn ensure_room(needed: usize, available: usize) -> Result<()> {
    if available < needed {
        Err(Error::BufferTooSmall { needed, available })
    } else {
        Ok(())
    }
}
