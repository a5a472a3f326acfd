//! The host's interface addresses (`getifaddrs`), for listing the devices one could open.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One address of an interface that is up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct InterfaceAddr {
    pub(crate) interface: String,
    pub(crate) ip: IpAddr,
}

/// Every IPv4 and IPv6 address of every interface that is up.
pub(crate) fn interface_addrs() -> io::Result<Vec<InterfaceAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`, which is a valid out-pointer.
    super::check(unsafe { libc::getifaddrs(&mut head) })?;
    let mut out = Vec::new();
    let mut cursor = head;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_flags & libc::IFF_UP as libc::c_uint == 0
            || entry.ifa_addr.is_null()
            || entry.ifa_name.is_null()
        {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family field is valid.
        let family = libc::c_int::from(unsafe { (*entry.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: the family says this is a sockaddr_in.
                let sin = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in>() };
                IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says this is a sockaddr_in6.
                let sin6 = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in6>() };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        // SAFETY: ifa_name is a non-null, NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(entry.ifa_name) };
        out.push(InterfaceAddr { interface: name.to_string_lossy().into_owned(), ip });
    }
    // SAFETY: `head` came from getifaddrs and is freed exactly once; no reference into the
    // list survives (names were copied).
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed() {
        let addrs = interface_addrs().expect("getifaddrs");
        assert!(addrs.iter().any(|a| a.ip == IpAddr::V4(Ipv4Addr::LOCALHOST)), "{addrs:?}");
    }
}
