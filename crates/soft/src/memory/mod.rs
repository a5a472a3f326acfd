//! Memory behind the soft provider's regions.
//!
//! # Aliasing model
//!
//! A region's bytes are reached from two sides: the application (through the
//! [`MemoryRegion`](lightpath_verbs::MemoryRegion) accessors of [`SoftMr`](crate::SoftMr)) and
//! the engine, which copies payloads in and out on behalf of the remote peer (incoming SEND,
//! WRITE, READ responses, atomics) exactly where a NIC would DMA. Unlike a NIC, the engine goes
//! through a reader-writer lock per region ([`RegionBytes`]): every copy in either direction,
//! and every atomic, happens with the lock held, so no two accesses ever race at the language
//! level and no Rust reference to the bytes outlives a lock guard. What the lock cannot
//! provide is *meaning*: as with real RDMA, bytes the peer is writing are in an unspecified
//! mix of old and new until the completion that reports their arrival, so applications read a
//! receive buffer or a WRITE target only after that completion (or an application-level
//! signal that follows it). Atomics are atomic with respect to each other and to any other
//! access, because they also hold the lock.
//!
//! The lock is per region and held only for one copy (at most one packet's payload, or one
//! application accessor call), so the engine and the application contend only when they touch
//! the same region at the same moment.

mod pages;
mod region;

pub(crate) use pages::PageBuffer;
pub use region::RegionBytes;
