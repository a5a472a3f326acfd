//! The ibverbs provider: RDMA hardware (ConnectX-class RoCE v2 and InfiniBand NICs, and the
//! kernel's SoftRoCE `rxe`) through rdma-core's libibverbs, behind the provider-neutral verbs
//! traits of `lightpath-verbs`.
//!
//! # Loaded at run time
//!
//! Nothing links against libibverbs. [`IbvProvider`] `dlopen`s `libibverbs.so.1` the first time
//! it is used, so one binary runs on machines with and without rdma-core; without it every call
//! returns [`lightpath_verbs::Error::Unavailable`] with the reason (library not found, no
//! devices). The data-path calls that `verbs.h` makes static inline (post send/receive, poll,
//! arm a CQ) go through the context's `ops` function table exactly as the header does
//! ([`ffi::ops`]). Structures are mirrored by hand ([`ffi::types`]) and checked against the
//! installed header by `tests/layout.rs`.
//!
//! # Objects
//!
//! | type | C object | keeps alive |
//! |---|---|---|
//! | [`IbvDevice`] | `ibv_context` (plus the chosen port and GID) | the library |
//! | [`IbvPd`] | `ibv_pd` | the device |
//! | [`IbvMr`] | `ibv_mr` over memory it owns | the domain |
//! | [`IbvCq`] | `ibv_cq` with its own `ibv_comp_channel` | the device |
//! | [`IbvQp`] | RC `ibv_qp` | the domain and both CQs |
//!
//! Dropping is destroying, and the references above make it happen in dependency order
//! whatever order the application drops its handles in.
//!
//! # GIDs
//!
//! A device opened without a GID index sends from the port's RoCE v2 IPv4-mapped GID (see
//! [`gid`]), so users never have to find the right `-g`. [`IbvConfig`] overrides it; an index
//! out of range or empty is refused when the device is opened, with the valid ones listed.
//!
//! # Memory and fork
//!
//! Regions are pages this crate maps (page aligned, zeroed, `MADV_DONTFORK`) or an application
//! `Vec` moved in; their bytes are reached only by copies, never by references, since the NIC
//! writes them by DMA. [`ForkSafety`] reports what `ibv_is_fork_initialized` says; where the
//! kernel does not protect registrations across `fork`, `reg_vec` copies instead of pinning the
//! application's heap block in place.
//!
//! # Unsafe code
//!
//! This crate exists to call C, so it has `unsafe` blocks; each states why it is sound. The safe
//! types never hand out pointers, and every integer that comes back from C is converted with a
//! checked constructor.

mod cq;
mod device;
mod error;
pub mod ffi;
pub mod gid;
mod memory;
mod mr;
mod pd;
mod provider;
mod qp;
mod wr;

pub use cq::IbvCq;
pub use device::{IbvConfig, IbvDevice};
pub use ffi::library::{LoadError, LIBRARY_ENV, LIBRARY_NAME};
/// Out-of-band connection set-up (TCP exchange of QPN, PSN, GID, MTU and region keys), usable
/// with ibverbs queue pairs.
pub use lightpath_verbs::connect;
pub use mr::IbvMr;
pub use pd::IbvPd;
pub use provider::{ForkSafety, IbvProvider};
pub use qp::IbvQp;
