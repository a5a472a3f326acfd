//! Lightpath's socket-like API: programs written for TCP sockets move to RDMA with a few
//! lines changed.
//!
//! ```no_run
//! use std::io::{Read, Write};
//!
//! let listener = lightpath::Listener::bind("127.0.0.1:7000")?;
//! std::thread::spawn(move || {
//!     let (mut stream, _) = listener.accept().unwrap();
//!     let mut buf = [0u8; 5];
//!     stream.read_exact(&mut buf).unwrap();
//!     stream.write_all(&buf).unwrap();
//! });
//! let mut stream = lightpath::Stream::connect("127.0.0.1:7000")?;
//! stream.write_all(b"hello")?;
//! let mut echo = [0u8; 5];
//! stream.read_exact(&mut echo)?;
//! println!("{:?} over {}", echo, stream.transport());
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! A connection starts as a kernel TCP connection to the given address. The two sides
//! negotiate over it ([`lightpath_stream::negotiate`]) and, if both have a usable RDMA path,
//! move their data over an RC queue pair (RDMA WRITE with immediate into the peer's receive
//! ring, credits returned by plain RDMA WRITEs; see `docs/stream-protocol.md`). Otherwise the
//! same TCP connection carries the data, and [`Stream::transport`] says why. The TCP
//! connection stays open as the liveness channel: a peer that dies is noticed within
//! milliseconds, not after RDMA retries.
//!
//! Providers ([`ProviderId`]), chosen per connection by the negotiation: shm between
//! processes of one host, ibverbs where an RDMA NIC has a RoCE v2 GID for the connection's
//! local address, soft (the userspace RoCE v2 engine over UDP) otherwise; [`Options`] and
//! `LIGHTPATH_PROVIDERS` change the list.
//!
//! Many connections: the connections of one device share its completion queues (a router
//! hands each completion to its connection; blocked threads take turns watching the queue),
//! so a server with a thousand connections polls one queue, not a thousand.

mod completions;
pub mod counters;
mod devices;
mod error;
mod listener;
mod negotiate;
pub mod options;
mod rdma;
mod readiness;
mod reaper;
mod remote;
mod stream;
mod stream_zero_copy;
mod tcp;
#[cfg(feature = "tokio")]
#[path = "tokio_driver.rs"]
pub mod tokio;

pub use counters::{soft_device_stats, SoftDeviceStats};
pub use lightpath_soft::{ProgressMode, QpStats, SoftStats};
pub use lightpath_stream::negotiate::{FallbackReason, ProviderId};
pub use listener::Listener;
pub use options::Options;
pub use remote::{RegisteredBuf, RemoteBuf};
pub use stream::{Driven, Readiness, Signalled, Stream, Transport};

/// For diagnosing a stall: the state of every shared completion queue and of the connections
/// routed from it (queued completions, armed flags, counters) as text. Not a stable format.
#[doc(hidden)]
pub fn diagnostics() -> String {
    completions::diagnostics::snapshot()
}

/// From now on, [`diagnostics`] has more to show: connections count the completions handed
/// to them, the wake-ups asked for and the completions taken, and those waiting for their
/// peer's acknowledgement leave their protocol state (a formatted string per such wait).
#[doc(hidden)]
pub fn enable_diagnostics() {
    completions::diagnostics::enable()
}
