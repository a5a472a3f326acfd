//! The provider conformance suite: verbs behaviour written once, run against every provider.
//!
//! A provider crate supplies a [`ConformanceFixture`] (how to open two fresh devices that can
//! reach each other) and expands [`conformance_tests!`](crate::conformance_tests) in an
//! integration test, which generates one `#[test]` per case, named after the case:
//!
//! ```ignore
//! struct Fixture;
//! impl lightpath_verbs::conformance::ConformanceFixture for Fixture {
//!     type Device = my_provider::MyDevice;
//!     fn open_pair() -> (Self::Device, Self::Device) { /* two connected devices */ }
//! }
//! lightpath_verbs::conformance_tests!(Fixture);
//! ```
//!
//! Every case builds its own devices, so cases run in parallel. Cases wait for completions with
//! a generous deadline ([`harness::DEADLINE`]) so that a broken provider fails instead of
//! hanging; no case measures speed. Where verbs implementations legitimately differ (for example
//! which status the *receiver* of a too-long SEND reports: the IBA says `LocLenErr`, Linux rxe
//! says `RemInvReqErr`), a case accepts each documented variant and nothing else.

pub mod cases;
pub mod harness;

use crate::Device;

/// What a provider supplies to run the suite.
pub trait ConformanceFixture: 'static {
    /// The provider's device type.
    type Device: Device;

    /// Opens two fresh devices that can reach each other (a queue pair on one can connect to a
    /// queue pair on the other). Called once per case, possibly from several threads at once.
    fn open_pair() -> (Self::Device, Self::Device);
}

/// The names and entry points of every case, for a fixture `F`.
pub fn cases<F: ConformanceFixture>() -> Vec<(&'static str, fn())> {
    crate::__lightpath_conformance_cases!(@list table F)
}

/// Runs every case in turn (the macro is preferred: it names each failure).
pub fn run_all<F: ConformanceFixture>() {
    for (_, case) in cases::<F>() {
        case();
    }
}

/// Generates one `#[test]` per conformance case for the fixture type given.
#[macro_export]
macro_rules! conformance_tests {
    ($fixture:ty) => {
        $crate::__lightpath_conformance_cases!(@list tests $fixture);
    };
}

/// The single list of cases; `conformance_tests!` and [`cases`] both expand from it.
#[doc(hidden)]
#[macro_export]
macro_rules! __lightpath_conformance_cases {
    (@list $mode:ident $fixture:ty) => {
        $crate::__lightpath_conformance_cases! { @ $mode $fixture;
            device_query,
            mr_access_combinations,
            mr_byte_accessors,
            send_recv_small_sizes,
            send_recv_one_mib,
            send_with_imm,
            send_gather_scatter,
            inline_send,
            batched_posts,
            unsignaled_requests,
            rdma_write,
            rdma_write_with_imm,
            write_direct_or_none,
            rdma_read_multi_packet,
            atomic_compare_swap,
            atomic_fetch_add,
            remote_bad_rkey,
            remote_out_of_bounds,
            remote_no_permission,
            remote_misaligned_atomic,
            local_protection_error,
            local_write_required,
            recv_buffer_too_small,
            rnr_retry_exceeded,
            post_before_rts_refused,
            modify_refusals,
            modify_err_flushes_receives,
            recv_queue_full,
            send_queue_full,
            psn_wrap,
            many_qps_one_cq,
            cq_wait_wakes,
            cq_wait_many_blocked_threads,
            cq_notify,
            teardown_any_order,
        }
    };
    (@tests $fixture:ty; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::cases::$case::<$fixture>();
            }
        )*
    };
    (@table $fixture:ty; $($case:ident),* $(,)?) => {
        vec![$((stringify!($case), $crate::conformance::cases::$case::<$fixture> as fn())),*]
    };
}
