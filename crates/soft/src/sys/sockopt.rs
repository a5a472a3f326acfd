//! Socket options: `IP_MTU_DISCOVER = IP_PMTUDISC_DO` (so IPv4 datagrams leave with DF set and
//! ID 0, which makes the ICRC computable before sending), receive/send buffer sizes and UDP
//! receive offload.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

fn set_int(fd: BorrowedFd<'_>, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor for the duration of the borrow; the option value
    // points to a live `c_int` and the length passed is exactly its size.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    check(ret).map(drop)
}

/// Sets "do path-MTU discovery, never fragment" on an IPv4 or IPv6 UDP socket.
///
/// For IPv4 this is what makes the kernel send ID 0 with DF on an unconnected socket (see the
/// RoCE digest §5.1a); for IPv6 it stops the kernel from fragmenting locally.
pub(crate) fn set_pmtu_discovery_do(fd: BorrowedFd<'_>, ipv6: bool) -> io::Result<()> {
    if ipv6 {
        set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO)
    } else {
        set_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)
    }
}

/// Asks for `recv` and `send` bytes of socket buffer. Tries the privileged `*BUFFORCE` options
/// first (they ignore `rmem_max`/`wmem_max`), then the ordinary ones, which the kernel caps.
pub(crate) fn set_buffer_sizes(fd: BorrowedFd<'_>, recv: usize, send: usize) {
    let clamp = |n: usize| libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
    for (force, plain, size) in
        [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, recv), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, send)]
    {
        // Failure of both is harmless: the default buffers only make loss under bursts likelier.
        if set_int(fd, libc::SOL_SOCKET, force, clamp(size)).is_err() {
            let _ = set_int(fd, libc::SOL_SOCKET, plain, clamp(size));
        }
    }
}

/// Asks the kernel to hand over coalesced datagrams with their segment size (`UDP_GRO`, Linux
/// 5.0+). Fails on kernels without it, which then deliver every datagram on its own.
pub(crate) fn set_udp_gro(fd: BorrowedFd<'_>) -> io::Result<()> {
    set_int(fd, libc::SOL_UDP, super::mmsg::UDP_GRO, 1)
}
