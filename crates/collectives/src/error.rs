//! Errors. Every failure of a call names the rank at fault (a world rank), the operation and
//! the call's sequence number on this communicator (the n-th collective call, counted alike
//! on every rank), so that a job's logs say which call on which rank went wrong.

use std::time::Duration;

/// A collective call's failure.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A peer's process ended or its connection broke while this call needed it.
    PeerFailed {
        /// World rank of the peer.
        rank: usize,
        /// The operation this rank was running.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// What was seen.
        detail: String,
    },
    /// A peer this call waits for made no progress within the configured timeout.
    Timeout {
        /// World rank of the peer waited for.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The timeout.
        after: Duration,
    },
    /// Another rank saw a failure and aborted the job; `rank` is the one it blamed.
    Aborted {
        /// World rank that failed, as reported.
        rank: usize,
        /// World rank that reported it.
        reporter: usize,
        /// The operation this rank was running.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The reporter's description.
        detail: String,
    },
    /// Ranks called different collectives, or the same with different counts, types or roots
    /// (found by the fingerprint check, `LIGHTPATH_COLL_DEBUG=1`).
    Mismatch {
        /// World rank whose call differs from this rank's.
        rank: usize,
        /// This rank's operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// Both calls, described.
        detail: String,
    },
    /// The call's arguments are inconsistent on this rank (nothing was sent).
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// Joining the job failed (environment, store, connections).
    Bootstrap {
        /// What failed.
        detail: String,
    },
    /// A failure inside this process: a call panicked (a bug in Lightpath; the communicator
    /// fails every later call), or the system refused a nonblocking call its thread (nothing
    /// was sent then).
    Internal {
        /// The operation.
        op: &'static str,
        /// What happened.
        detail: String,
    },
}

impl Error {
    /// The world rank the error names, if any.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Error::PeerFailed { rank, .. }
            | Error::Timeout { rank, .. }
            | Error::Aborted { rank, .. }
            | Error::Mismatch { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// The operation the error happened in, if any.
    pub fn op(&self) -> Option<&'static str> {
        match self {
            Error::PeerFailed { op, .. }
            | Error::Timeout { op, .. }
            | Error::Aborted { op, .. }
            | Error::Mismatch { op, .. }
            | Error::InvalidArgument { op, .. }
            | Error::Internal { op, .. } => Some(op),
            Error::Bootstrap { .. } => None,
        }
    }

    /// The call's sequence number, if any.
    pub fn seq(&self) -> Option<u64> {
        match self {
            Error::PeerFailed { seq, .. }
            | Error::Timeout { seq, .. }
            | Error::Aborted { seq, .. }
            | Error::Mismatch { seq, .. } => Some(*seq),
            _ => None,
        }
    }

    pub(crate) fn bootstrap(detail: impl std::fmt::Display) -> Error {
        Error::Bootstrap { detail: detail.to_string() }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::PeerFailed { rank, op, seq, detail } => {
                write!(f, "{op} #{seq}: rank {rank} failed: {detail}")
            }
            Error::Timeout { rank, op, seq, after } => {
                write!(f, "{op} #{seq}: rank {rank} made no progress for {after:?}")
            }
            Error::Aborted { rank, reporter, op, seq, detail } => {
                write!(f, "{op} #{seq}: job aborted by rank {reporter}, which blames rank {rank}: {detail}")
            }
            Error::Mismatch { rank, op, seq, detail } => {
                write!(f, "{op} #{seq}: rank {rank} called something else: {detail}")
            }
            Error::InvalidArgument { op, detail } => write!(f, "{op}: invalid argument: {detail}"),
            Error::Bootstrap { detail } => write!(f, "joining the job failed: {detail}"),
            Error::Internal { op, detail } => write!(f, "{op}: internal error: {detail}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        let kind = match e {
            Error::Timeout { .. } => std::io::ErrorKind::TimedOut,
            Error::InvalidArgument { .. } => std::io::ErrorKind::InvalidInput,
            Error::Mismatch { .. } => std::io::ErrorKind::InvalidData,
            _ => std::io::ErrorKind::ConnectionAborted,
        };
        std::io::Error::new(kind, e)
    }
}
