//! The soft provider: Lightpath's RoCE v2 engine (`lightpath-roce`) driven over ordinary UDP
//! sockets, behind the provider-neutral verbs traits of `lightpath-verbs`.
//!
//! One [`SoftDevice`] is one engine with one UDP socket bound to one local address and port
//! (4791 by default; port 0 takes a free one, which [`SoftDevice::local_addr`] reports).
//! Its one GID (index 0) is the bound address: `::ffff:a.b.c.d` for IPv4, the address itself
//! for IPv6. A queue pair sends to the UDP port its address vector names
//! (`AddressVector::udp_dport`), or to the device's own port when that is 0 — so devices in
//! several processes can share one address on distinct ports, as long as each tells its
//! peers its port; rxe and RNICs listen on 4791 only. Received datagrams are matched to queue
//! pairs by QPN and peer address whatever port they come from.
//!
//! # On the wire
//!
//! The socket is unconnected and has `IP_MTU_DISCOVER = IP_PMTUDISC_DO`, so the kernel sends
//! every IPv4 datagram with DF set and IP ID 0, which lets the engine compute the ICRC before
//! sending (RoCE digest §5.1a); Linux rxe accepted such datagrams in every run of §11. On
//! receive the engine verifies the ICRC: exactly for IPv6, and for IPv4 — whose ID and flags a
//! UDP socket does not report — by solving for those 19 bits over GF(2), which accepts a
//! corrupted datagram with probability around 2^-13 instead of 2^-32. Datagrams move in batches
//! (up to 64 per `sendmmsg`, 32 messages per `recvmmsg`), with the kernel's UDP offloads where
//! they are safe (`SoftConfig::udp_offload`): runs of equal-size datagrams to a loopback or
//! IPv6 peer leave as one segmented message, and coalesced datagrams arrive as one. The UDP source port of every datagram is the bound
//! port (the engine's per-QP entropy port cannot be chosen per datagram on one socket; rxe
//! accepts any source port), and the engine seals the ICRC for that port
//! (`EngineConfig::fixed_src_port`), so each datagram is checksummed once.
//!
//! # Progress
//!
//! By default a progress thread owns the socket's receive side and the engine's timers; it
//! sleeps in `ppoll` until a datagram, a timer or an eventfd wake-up. Posting threads transmit
//! their own packets, and a thread blocked in `wait` on a completion queue watches the socket
//! itself (the progress thread leaves it to such threads), so a completion that arrives by
//! the network costs one wake-up, not two. In [`ProgressMode::Polling`], `poll`/`wait` on a completion queue drive
//! the engine themselves (receive, timers, transmit), spinning before they block, and a helper
//! thread steps in only when the application has not driven the device for a while. A poll
//! that receives a message returns its completion before the engine's answer (the ACK) is
//! sent; the ACK leaves with the application's next post — in the same `sendmmsg` as a reply —
//! or at the start of its next poll.
//!
//! # Memory
//!
//! Regions are allocated by the provider (page aligned, zero-filled, `mlock`ed best effort) or
//! moved in from a `Vec<u8>`; see [`memory`] for the aliasing model. The one other place with
//! `unsafe` code is the small `sys` module of system calls.
//!
//! # Connecting
//!
//! [`connect`] (re-exported from `lightpath-verbs`) exchanges queue-pair numbers, PSNs,
//! GIDs, MTUs and region keys over TCP and brings both queue pairs to RTS.
//!
//! # Limits
//!
//! Protection domains group and keep objects alive but do not isolate keys from each other
//! (the engine has one region table per device). The device has one port and one GID.

pub mod config;
mod cq;
mod device;
mod driver;
pub mod memory;
mod mr;
mod pd;
mod provider;
mod qp;
mod sys;

pub use config::{ProgressMode, SoftConfig, ROCE_PORT};
pub use cq::SoftCq;
pub use device::SoftDevice;
pub use driver::{DriverStats, SoftStats};
pub use mr::SoftMr;
pub use pd::SoftPd;
pub use provider::{parse_device_name, SoftProvider};
pub use qp::SoftQp;

pub use lightpath_roce::EngineStats;
/// Out-of-band connection set-up (TCP exchange of QPN, PSN, GID, MTU and region keys), usable
/// with soft queue pairs; see the module for the message format.
pub use lightpath_verbs::connect;
