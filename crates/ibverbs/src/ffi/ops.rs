//! The data-path calls that `verbs.h` defines as static inline functions, done the same way:
//! through the function pointers in the `ops` table of the object's `ibv_context`.
//!
//! | inline function | what it does (verbs.h) |
//! |---|---|
//! | `ibv_post_send(qp, wr, bad)` | `qp->context->ops.post_send(qp, wr, bad)` |
//! | `ibv_post_recv(qp, wr, bad)` | `qp->context->ops.post_recv(qp, wr, bad)` |
//! | `ibv_poll_cq(cq, n, wc)` | `cq->context->ops.poll_cq(cq, n, wc)` |
//! | `ibv_req_notify_cq(cq, se)` | `cq->context->ops.req_notify_cq(cq, se)` |
//!
//! A provider that leaves one of these slots empty makes the call fail with `EOPNOTSUPP`
//! instead of jumping to address 0.

use super::types::{IbvCq, IbvQp, IbvRecvWr, IbvSendWr, IbvWc};

/// `ibv_post_send`: 0 or an errno value; `bad_wr` names the first refused request.
///
/// # Safety
/// `qp` must be a live queue pair of an open context, and `wr` a valid chain of work requests
/// whose scatter/gather lists stay valid for the call.
#[inline]
pub unsafe fn post_send(qp: *mut IbvQp, wr: *mut IbvSendWr, bad_wr: *mut *mut IbvSendWr) -> i32 {
    // SAFETY: the caller guarantees `qp` is live, so its context pointer and ops table are too.
    let post = unsafe { (*(*qp).context).ops.post_send };
    match post {
        // SAFETY: the provider's own entry point, called with the arguments it documents.
        Some(post) => unsafe { post(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_recv`: 0 or an errno value.
///
/// # Safety
/// As for [`post_send`].
#[inline]
pub unsafe fn post_recv(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad_wr: *mut *mut IbvRecvWr) -> i32 {
    // SAFETY: the caller guarantees `qp` is live, so its context pointer and ops table are too.
    let post = unsafe { (*(*qp).context).ops.post_recv };
    match post {
        // SAFETY: the provider's own entry point, called with the arguments it documents.
        Some(post) => unsafe { post(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_poll_cq`: the number of completions written to `wc` (at most `n`), or negative on error.
///
/// # Safety
/// `cq` must be a live completion queue and `wc` must have room for `n` entries.
#[inline]
pub unsafe fn poll_cq(cq: *mut IbvCq, n: i32, wc: *mut IbvWc) -> i32 {
    // SAFETY: the caller guarantees `cq` is live, so its context pointer and ops table are too.
    let poll = unsafe { (*(*cq).context).ops.poll_cq };
    match poll {
        // SAFETY: the provider's own entry point, called with the arguments it documents.
        Some(poll) => unsafe { poll(cq, n, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ibv_req_notify_cq`: 0 or an errno value.
///
/// # Safety
/// `cq` must be a live completion queue.
#[inline]
pub unsafe fn req_notify_cq(cq: *mut IbvCq, solicited_only: bool) -> i32 {
    // SAFETY: the caller guarantees `cq` is live, so its context pointer and ops table are too.
    let notify = unsafe { (*(*cq).context).ops.req_notify_cq };
    match notify {
        // SAFETY: the provider's own entry point, called with the arguments it documents.
        Some(notify) => unsafe { notify(cq, i32::from(solicited_only)) },
        None => libc::EOPNOTSUPP,
    }
}
