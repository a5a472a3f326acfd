//! Turning the C library's failures (NULL pointers with `errno`, or returned errno values) into
//! [`lightpath_verbs::Error`]s that say what was being done.

use std::io;

use lightpath_verbs::Error;

/// The error for a call that returned `rc` (an errno value, as libibverbs' verbs return them;
/// negative values are accepted as well).
pub(crate) fn from_rc(what: &'static str, rc: i32) -> Error {
    with_context(what, io::Error::from_raw_os_error(rc.saturating_abs()))
}

/// The error for a call that failed and left its reason in `errno` (the calls returning
/// pointers). A NULL result with `errno` 0 is reported as an unspecified failure.
pub(crate) fn from_errno(what: &'static str) -> Error {
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(0) {
        return Error::Io(io::Error::other(format!("{what} failed (no reason given)")));
    }
    with_context(what, err)
}

fn with_context(what: &'static str, err: io::Error) -> Error {
    Error::Io(io::Error::new(err.kind(), format!("{what}: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_values_are_named_with_the_call() {
        let err = from_rc("ibv_modify_qp", libc::EINVAL);
        let text = err.to_string();
        assert!(text.contains("ibv_modify_qp") && text.contains("Invalid argument"), "{text}");
        let negative = from_rc("ibv_poll_cq", -libc::EIO);
        assert!(negative.to_string().contains("Input/output error"), "{negative}");
    }
}
