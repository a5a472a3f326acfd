//! The operating-system calls the soft provider needs that `std` does not offer: socket options
//! (path-MTU discovery, buffer sizes, UDP offloads), batched datagram I/O
//! (`sendmmsg`/`recvmmsg` with segmentation offload), eventfds, one-shot timers,
//! `ppoll`, `mlock` and `getifaddrs`. Every `unsafe` block of the crate outside the page allocator lives here,
//! behind safe functions, each with a `// SAFETY:` note.

mod eventfd;
mod ifaddrs;
mod mlock;
mod mmsg;
mod poll;
mod sockaddr;
mod sockopt;
mod timer;

pub(crate) use eventfd::EventFd;
pub(crate) use ifaddrs::{interface_addrs, link_mtu_of};
pub(crate) use mlock::{map_zeroed, mlock, munlock, unmap};
pub(crate) use mmsg::{
    DatagramParts, OutMessage, RecvBatch, SendBatch, MAX_SEGMENTED_BYTES, MAX_SEGMENTS, RECV_BATCH,
    SEND_DATAGRAMS,
};
pub(crate) use poll::wait_readable;
pub(crate) use sockopt::{set_buffer_sizes, set_pmtu_discovery_do, set_udp_gro};
pub(crate) use timer::OneShotTimer;

use std::io;

/// Turns a `-1` return into the thread's `errno` as an error.
fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}
