//! Conversions between `std::net::SocketAddr` and the C `sockaddr_storage` the batched calls use.

use std::mem::size_of;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Writes `addr` into `storage`; returns the length to pass to the kernel.
pub(super) fn to_storage(addr: &SocketAddr, storage: &mut libc::sockaddr_storage) -> libc::socklen_t {
    match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in (that
            // is its purpose), and `storage` is a live, exclusively borrowed value.
            unsafe {
                std::ptr::write((storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>(), sin)
            };
            size_of::<libc::sockaddr_in>() as libc::socklen_t
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo().to_be(),
                sin6_addr: libc::in6_addr { s6_addr: v6.ip().octets() },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe {
                std::ptr::write((storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>(), sin6)
            };
            size_of::<libc::sockaddr_in6>() as libc::socklen_t
        }
    }
}

/// Reads the address the kernel wrote into `storage` (`len` bytes of it), if it is IPv4 or
/// IPv6.
pub(super) fn from_storage(storage: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match libc::c_int::from(storage.ss_family) {
        libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the kernel wrote a sockaddr_in, which fits in and is
            // aligned for sockaddr_storage; we only read it.
            let sin = unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            let port = u16::from_be(sin6.sin6_port);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                port,
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for text in ["127.0.0.2:4791", "[fe80::1%3]:4791", "[::1]:9"] {
            let addr: SocketAddr = text.parse().expect("address");
            // SAFETY: an all-zero sockaddr_storage is a valid (AF_UNSPEC) value.
            let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let len = to_storage(&addr, &mut storage);
            assert_eq!(from_storage(&storage, len), Some(addr));
            assert_eq!(from_storage(&storage, len - 1), None, "a cut address is no address");
        }
        // SAFETY: as above.
        let unspec: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        assert_eq!(from_storage(&unspec, size_of::<libc::sockaddr_storage>() as libc::socklen_t), None);
    }
}
