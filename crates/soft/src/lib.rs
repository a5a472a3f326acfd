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
//! they are safe (`SoftConfig::udp_offload`): runs of equal-size datagrams leave as one
//! segmented message towards loopback and IPv6 peers and towards peers whose address vector
//! says `lightpath_peer` (a Lightpath soft device, which solves for the IP ID the kernel
//! renumbers in the segments it cuts; rxe and RNICs would drop them), and coalesced datagrams
//! arrive as one. Queue pairs towards Lightpath peers also keep up to 1,024 PSNs in flight
//! instead of rxe's 128. The UDP source port of every datagram is the bound
//! port (the engine's per-QP entropy port cannot be chosen per datagram on one socket; rxe
//! accepts any source port), and the engine seals the ICRC for that port
//! (`EngineConfig::fixed_src_port`), so each datagram is checksummed once.
//!
//! The port's active MTU never exceeds what the link holding the device's address carries
//! (as rxe derives it from the netdev's MTU: 1024 on a 1500-byte link, 4096 on a 9000-byte
//! one or loopback); `modify_qp` refuses a larger path MTU at once, naming both MTUs.
//!
//! # Progress
//!
//! By default a progress thread owns the engine's timers and, when nobody else does, the
//! socket's receive side; it sleeps in `ppoll` until a datagram, a timer, an eventfd wake-up
//! or the hand-over timer, and at most 100 ms. Posting threads transmit their own packets. A
//! thread blocked in `wait` on a completion queue watches the socket itself (one at a time):
//! it busy-polls it for `SoftConfig::wait_spin` after the last datagram while that pays
//! (yielding the core past the first microseconds), then sleeps on it, and drives the engine
//! when a datagram arrives — so a completion that arrives by the network costs at most one
//! wake-up, and none in a ping-pong. When its arrivals complete its own work, the engine's
//! answers (ACKs) are held back and leave with its next post, in the same `sendmmsg` as its
//! reply. The progress thread takes the socket back only once it has gone unwatched for 1 ms
//! (a one-shot timer armed by the watcher that leaves), so a thread between two waits does
//! not hand it over and back for every message, and held answers go out within that time
//! even if the application goes quiet; an event loop that goes to sleep on its completion
//! notification (it never reads the socket) hands the socket over at once
//! (`CompletionQueue::consumer_idle`), or its news would wait out that time. In
//! [`ProgressMode::Polling`], `poll`/`wait` on a completion queue drive the engine themselves
//! (receive, timers, transmit), spinning before they block, and a helper thread steps in when
//! the application has not driven the device for a while, or at once when an event loop goes
//! to sleep on its notification (`consumer_idle` again); answers are held back the same way.
//!
//! A queue pair whose waiter gives it a doorbell (`QueuePair::set_waiter_fd`; Lightpath's
//! streams do by default) receives on a UDP port of its own instead
//! ([`SoftConfig::max_qp_ports`]): the peer is told to send there (`QueuePair::own_udp_port`),
//! the waiter sleeps on that socket beside its doorbell (`QueuePair::waiter_poll_fd`), and
//! the kernel wakes exactly it; it then runs the engine itself (`QueuePair::arm_waiter`). An
//! event loop so wakes once per message instead of twice (the progress thread, then the loop).
//! The progress thread still drains a port its owner leaves unread (at once after a quiet
//! spell; while ports are busy, a port found unread on two of its 1 ms looks in a row), so the
//! peer's requests are always acknowledged.
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
mod spin;
mod sys;

pub use config::{default_max_qp_ports, ProgressMode, SoftConfig, ROCE_PORT};
pub use cq::SoftCq;
pub use device::SoftDevice;
pub use driver::{DriverStats, SoftStats};
pub use mr::SoftMr;
pub use pd::SoftPd;
pub use provider::{parse_device_name, SoftProvider};
pub use qp::SoftQp;
pub use spin::AdaptiveSpin;

pub use lightpath_roce::{EngineStats, QpStats};
/// Out-of-band connection set-up (TCP exchange of QPN, PSN, GID, MTU and region keys), usable
/// with soft queue pairs; see the module for the message format.
pub use lightpath_verbs::connect;
