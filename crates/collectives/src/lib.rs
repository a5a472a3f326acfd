//! Collective operations for Lightpath: allreduce, reduce, broadcast, allgather(v),
//! reduce-scatter, alltoall(v), barrier and send/recv among the ranks of a job.
//!
//! Layers, bottom up:
//!
//! * [`dtype`]: element types, operators and the reduction kernels.
//! * [`schedule`]: sans-I/O plans. For one call, a rank's plan is a list of rounds of steps
//!   ("send these bytes to rank r", "receive from r and reduce into here", "copy"), built
//!   deterministically from (rank, size, counts, algorithm). Every algorithm lives here and
//!   nowhere else.
//! * [`sim`]: runs every rank's plan on an in-memory network with no buffering, which is how
//!   the plans are tested (every algorithm × sizes × world sizes 1..16 against a reference).
//! * the driver and [`Communicator`]: runs a plan over a full mesh of Lightpath streams (shm
//!   between ranks of one host, soft or ibverbs between hosts, TCP as a last resort), with a
//!   TCP side channel per peer that reports a dead rank at once and carries aborts.
//! * [`store`] and [`bootstrap`]: a rendezvous key-value store speaking c10d TCPStore's
//!   protocol, and the launcher environments (torchrun, Open MPI's mpirun, Slurm's srun,
//!   `lightpath launch`) that say who is rank 0 and where its store is.
#![forbid(unsafe_code)]

pub mod bootstrap;
mod comm;
pub mod dtype;
mod error;
pub mod launch;
mod mesh;
pub mod schedule;
pub mod sim;
pub mod store;

pub use comm::{
    choose_allreduce, choose_allreduce_on, choose_broadcast, choose_broadcast_on, CallBuffers, Communicator,
    Config, Request, Started, MESH_RING,
};
pub use dtype::{DType, Element, ReduceOp};
pub use error::Error;
/// `half`'s 16-bit float types, re-exported for [`Element`] buffers.
pub use half::{bf16, f16};
pub use schedule::{AllreduceAlgo, BroadcastAlgo, Collective, Topology};
