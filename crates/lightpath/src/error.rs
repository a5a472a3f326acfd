//! Turning verbs and protocol errors into `std::io::Error`s with clear messages.

use std::io;

/// A verbs error as an I/O error (its own I/O errors pass through unchanged).
pub(crate) fn from_verbs(err: lightpath_verbs::Error) -> io::Error {
    match err {
        lightpath_verbs::Error::Io(err) => err,
        other => io::Error::other(format!("RDMA: {other}")),
    }
}

/// The peer broke the protocol.
pub(crate) fn invalid(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("lightpath: {what}"))
}

/// The connection was lost.
pub(crate) fn reset(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, format!("lightpath: {what}"))
}
