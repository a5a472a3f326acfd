//! Provider-neutral verbs for Lightpath.
//!
//! This crate is the contract between everything above the transport (streams, collectives,
//! tools) and every provider below it (the soft RoCE v2 engine, rdma-core's libibverbs, shared
//! memory). It holds the plain data types of the verbs model — GIDs, MTUs, access flags, work
//! requests, work completions, queue-pair states and attributes, errors — whose numeric values
//! follow libibverbs so that a provider wrapping the C library converts them without surprises.
//!
//! Integers that come from C or from the network are converted with checked constructors
//! (`from_raw` returning `Option`), never transmuted.
#![forbid(unsafe_code)]

mod access;
pub mod conformance;
pub mod connect;
pub mod copy;
mod device;
mod error;
mod gid;
mod mtu;
mod provider;
mod qp;
mod wc;
mod wr;

pub use access::AccessFlags;
pub use device::{DeviceAttr, PortAttr, PortState, QpEndpoint, RemoteRegion};
pub use error::{Error, Result};
pub use gid::Gid;
pub use mtu::{
    lightpath_pmtu_for_link, Mtu, MAX_LIGHTPATH_PMTU, MAX_SEGMENTED_UDP_BYTES, PREFERRED_LIGHTPATH_PMTU,
};
pub use provider::{
    BatchError, CompletionHook, CompletionQueue, CqOf, Device, MemoryRegion, MrOf, PdOf, ProtectionDomain,
    Provider, QpOf, QueuePair, TaskDoorbell, TaskSpin, TaskWake, WakeFor,
};
pub use qp::{AddressVector, QpAttr, QpCaps, QpState};
pub use wc::{WcOpcode, WcStatus, WorkCompletion};
pub use wr::{RecvWr, SendFlags, SendOp, SendPayload, SendWr, Sge};

/// How many CPUs this process may run on (`std::thread::available_parallelism`, which honours
/// affinity and cgroup quotas; 1 if unknown), asked once per process. Providers size spinning
/// and spreading by it; the first ask reads cgroup files (about 50-100 µs here), which every
/// device open and so every process's first connection used to pay again.
pub fn available_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
