//! Errors returned by verbs calls (as opposed to work-completion statuses, which report how an
//! accepted work request ended).

use std::fmt;

use crate::QpState;

/// Result of a verbs call.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a verbs call was refused. Nothing was posted or changed when an error is returned.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The queue pair is in a state that does not allow the call (e.g. post_send before RTS).
    InvalidState(QpState),
    /// The requested state transition does not exist.
    InvalidTransition { from: QpState, to: QpState },
    /// A transition lacks an attribute it requires.
    MissingAttribute { transition: (QpState, QpState), attribute: &'static str },
    /// An attribute or argument is out of range.
    InvalidAttribute(&'static str),
    /// The send or receive queue (or a completion queue) is full.
    QueueFull,
    /// Too many scatter/gather entries, or inline data larger than `max_inline_data`.
    TooLarge(&'static str),
    /// An lkey, rkey, queue pair number or completion queue that does not exist.
    NotFound(&'static str),
    /// A resource is still in use (e.g. destroying a CQ that QPs still reference).
    Busy(&'static str),
    /// The provider cannot do this (operation or option unsupported).
    Unsupported(&'static str),
    /// The device or provider is unavailable, with the reason.
    Unavailable(String),
    /// A path MTU larger than the port's active MTU, which the link below cannot carry (its
    /// packets would be refused or dropped); `why` says what limits it.
    PathMtuTooLarge { requested: u32, active: u32, why: String },
    /// An operating-system error from the provider.
    Io(std::io::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidState(state) => write!(f, "not allowed in QP state {state:?}"),
            Error::InvalidTransition { from, to } => write!(f, "no QP transition from {from:?} to {to:?}"),
            Error::MissingAttribute { transition: (from, to), attribute } => {
                write!(f, "QP transition {from:?}->{to:?} requires attribute `{attribute}`")
            }
            Error::InvalidAttribute(what) => write!(f, "invalid attribute: {what}"),
            Error::QueueFull => f.write_str("queue full"),
            Error::TooLarge(what) => write!(f, "too large: {what}"),
            Error::NotFound(what) => write!(f, "not found: {what}"),
            Error::Busy(what) => write!(f, "busy: {what}"),
            Error::Unsupported(what) => write!(f, "unsupported: {what}"),
            Error::Unavailable(why) => write!(f, "unavailable: {why}"),
            Error::PathMtuTooLarge { requested, active, why } => {
                write!(f, "path MTU {requested} is larger than the port's active MTU {active}: {why}")
            }
            Error::Io(err) => write!(f, "I/O error: {err}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(err) => Some(err),
            _ => None,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Self {
        Error::Io(err)
    }
}
