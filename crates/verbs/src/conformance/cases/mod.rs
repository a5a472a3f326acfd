//! The conformance cases: one public function per case, generic over the fixture, so the
//! [`conformance_tests!`](crate::conformance_tests) macro can turn each into a named `#[test]`.

mod completion_queue;
mod device;
mod errors_local;
mod errors_remote;
mod memory;
mod messaging;
mod queues;
mod rdma;
mod state;

pub use completion_queue::{cq_notify, cq_wait_many_blocked_threads, cq_wait_wakes, teardown_any_order};
pub use device::device_query;
pub use errors_local::{
    local_protection_error, local_write_required, recv_buffer_too_small, rnr_retry_exceeded,
};
pub use errors_remote::{
    remote_bad_rkey, remote_misaligned_atomic, remote_no_permission, remote_out_of_bounds,
};
pub use memory::{mr_access_combinations, mr_byte_accessors};
pub use messaging::{
    batched_posts, inline_send, send_gather_scatter, send_recv_one_mib, send_recv_small_sizes, send_with_imm,
    unsignaled_requests,
};
pub use queues::{many_qps_one_cq, psn_wrap, recv_queue_full, send_queue_full};
pub use rdma::{
    atomic_compare_swap, atomic_fetch_add, rdma_read_multi_packet, rdma_write, rdma_write_with_imm,
    write_direct_or_none,
};
pub use state::{modify_err_flushes_receives, modify_refusals, post_before_rts_refused};
