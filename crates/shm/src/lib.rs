//! The shm provider: Lightpath verbs between processes on one host, at memory speed.
//!
//! Several ranks of a job often share a host; between them a NIC (or kernel TCP) is a detour.
//! An [`ShmDevice`] implements the `lightpath-verbs` traits over shared memory, so everything
//! written against those traits (the perf tool, the stream layer, applications) runs over it
//! unchanged, and it passes the provider conformance suite.
//!
//! Beside the verbs, [`pipe`] offers a one-way message ring between two processes with no
//! verbs objects at all (the collectives carry their small same-host messages in it, and
//! large ones as descriptors the receiver reads straight out of the sender's memory).
//!
//! # How it works
//!
//! - **Memory regions are memfds** mapped into the owner and, on first use, into each peer
//!   allowed to reach them: RDMA WRITE, READ and atomics are carried out by the *requester*,
//!   directly on the peer's pages (atomics are real `AtomicU64` operations on the shared
//!   mapping), after the checks a responder NIC makes (rkey, registration, protection domain,
//!   bounds, access of the region and of the peer queue pair). Regions without remote write
//!   access are sealed so peers can only map them read-only. `QueuePair::write_direct` does
//!   such a WRITE at once from the caller's own buffer (no local region, no request, one
//!   copy): how the stream layer puts a writer's bytes into the peer's receive ring. Large
//!   copies into a peer's memory use streaming stores while this process measures them to be
//!   cheaper (cores that share no cache; see `outbound_copy`).
//! - **Each queue pair has a shared segment** it alone writes: a single-producer ring of
//!   records (small SEND payloads in pieces; for large SENDs only descriptors of where the bytes
//!   are, which the receiver copies straight out of the sender's region; WRITE-with-immediate
//!   notices) and a status line
//!   (acknowledgement count, NAK, state). Its peer maps it read-only and validates everything
//!   it reads, so a broken or hostile peer can fail its own connection but not corrupt or crash
//!   this process. See [`ring`] for the memory-ordering design (model-checked with loom).
//! - **Connecting**: a device's GID is random and names the abstract Unix socket it listens on
//!   ([`address`]); at INIT→RTR a queue pair introduces itself on its device's *link* to the
//!   destination's device (one Unix socket per pair of devices and direction, opened by the
//!   first queue pair and shared by all, as SMC-R's link groups) and hands over its segment,
//!   its device's doorbell eventfd and its device's activity area (with its slot there); a
//!   queue pair that goes says goodbye on the link. No file is ever created, so nothing
//!   outlives the processes, crash or not. Because the GID is the address, the ordinary
//!   out-of-band exchange ([`connect`], re-exported from `lightpath-verbs`) connects shm queue
//!   pairs of two processes as it does soft ones.
//! - **Work in proportion to what happened**: each device has an *activity area*, a memfd its
//!   peers map writable (see [`activity`]). After publishing anything for a queue pair, a peer
//!   marks that queue pair's slot there, so a call that drives the device looks only at the
//!   queue pairs marked (plus those it owes a look: records left over, an RNR deadline), not
//!   at all of them: a thousand connections on one device cost no more per call than one. A
//!   device with at most four queue pairs looks at all of them instead and tells peers not to
//!   mark (a mark moves a cache line between the processes); as a safety net for marks a
//!   hostile peer cleared, a device looks at every queue pair at most every 100 ms. Polling an
//!   idle device takes no lock.
//! - **A lock per queue pair**: posting, a direct write, polling a queue with few queue pairs
//!   and arming a queue pair's waiter lock that queue pair only (and look at it alone,
//!   whatever its mark says), so a server's threads, one per connection, do not queue up
//!   behind one device lock; the device lock is for what spans queue pairs (the table, the
//!   marks, sleepers). See `engine` for the lock order.
//! - **Polling fits the machine**: the application's `poll` does the work directly (no thread
//!   hop, no system call on the data path); `wait` spins briefly (only as many threads at once
//!   as half the cores; past a few µs, or at once while the core is contended, yielding the
//!   core between looks, so a peer queued on the same core runs instead of waiting out the
//!   spin), then sleeps on the device's doorbell, which peers ring only while
//!   someone sleeps (the area's state word says so; one ring per sleep, whatever the number of
//!   queue pairs); `request_notify` hands progress to the driver thread at once, so an
//!   epoll/tokio program that only waits on the notification fd gets its completions. Each device has two helper threads (module `helper`): a socket thread
//!   accepts connections, answers region lookups and notices dead peers (socket hang-up: the
//!   survivor's queue pair goes to ERR with flush completions), and a driver thread takes over
//!   progress when the application is idle. The socket thread never waits on anything, so a
//!   device that asks itself — or two devices asking each other at once — always gets its
//!   answer. With nothing to do both block without a timeout.
//! - **Same host**: [`HostIdentity`] (boot id and namespaces, as text or as 16 bytes with
//!   [`HostIdentity::to_bytes`]) tells a transport negotiation whether two processes can use
//!   shm; [`probe`] checks that a given device answers. A negotiation that picked shm then
//!   opens an [`ShmDevice`], exchanges GIDs and queue-pair numbers over its existing connection
//!   (or runs [`connect::exchange`] over it) and moves the queue pairs to RTS: the GID is the
//!   rendezvous, nothing else needs exchanging.
//!
//! # Unsafe code
//!
//! Only in `sys::mapping` (mmap and raw accesses to shared pages), each block with a
//! `// SAFETY:` note; no Rust reference to shared memory is ever formed.

pub mod activity;
pub mod address;
mod config;
mod cq;
mod device;
mod engine;
#[doc(hidden)]
pub mod fault;
mod helper;
mod host;
mod mr;
mod outbound_copy;
mod pd;
pub mod pipe;
mod provider;
mod qp;
mod region;
mod registry;
pub mod ring;
mod segment;
mod sync;
mod sys;
mod wire;

pub use config::ShmConfig;
pub use cq::ShmCq;
pub use device::ShmDevice;
pub use helper::helper_thread_names;
pub use host::HostIdentity;
pub use mr::ShmMr;
pub use pd::ShmPd;
pub use provider::{probe, ShmProvider, DEVICE_NAME};
pub use qp::ShmQp;

/// Out-of-band connection set-up (TCP exchange of QPN, GID and region keys), usable with shm
/// queue pairs: the GID it exchanges is the shm device's address.
pub use lightpath_verbs::connect;

/// Largest `max_inline_data` a queue pair can have.
pub const MAX_INLINE: u32 = 1024;

/// `vendor_err` of completions flushed because the peer went away (process exit or crash,
/// queue pair destroyed or reset).
pub const VENDOR_ERR_PEER_GONE: u32 = 0x5348_0001;
/// `vendor_err` of completions flushed because the peer wrote something the protocol forbids
/// into shared memory or its socket.
pub const VENDOR_ERR_PEER_CORRUPT: u32 = 0x5348_0002;
