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

/// The MTU of the interface that holds address `ip` (as `ip link` shows it), with the
/// interface's name; `None` if no interface that is up has that address. A loopback address
/// that no interface lists (127.0.0.2: Linux routes all of 127.0.0.0/8 to `lo`, which lists
/// only 127.0.0.1/8) is on the interface holding a loopback address of its family.
pub(crate) fn link_mtu_of(ip: IpAddr) -> io::Result<Option<(String, u32)>> {
    let addrs = interface_addrs()?;
    let holder = addrs.iter().find(|entry| entry.ip == ip).or_else(|| {
        addrs
            .iter()
            .find(|entry| ip.is_loopback() && entry.ip.is_loopback() && entry.ip.is_ipv4() == ip.is_ipv4())
    });
    let Some(entry) = holder.cloned() else {
        return Ok(None);
    };
    let mtu = interface_mtu(&entry.interface)?;
    Ok(Some((entry.interface, mtu)))
}

/// `SIOCGIFMTU` on a throwaway datagram socket (of the caller's network namespace).
fn interface_mtu(name: &str) -> io::Result<u32> {
    let bytes = name.as_bytes();
    // SAFETY: ifreq is plain old data (a name array and a union of integers/sockaddrs), for
    // which all-zero bytes are a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    if bytes.len() >= request.ifr_name.len() || bytes.contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad interface name {name:?}")));
    }
    for (slot, &byte) in request.ifr_name.iter_mut().zip(bytes) {
        *slot = byte as libc::c_char;
    }
    // Bound to the wildcard address, which needs no interface to be up (not even lo).
    let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .or_else(|_| std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)))?;
    use std::os::fd::AsRawFd;
    // SAFETY: the socket is open for the call, `request` is a live ifreq with a NUL-terminated
    // name (zeroed beyond it), and SIOCGIFMTU writes only its `ifru_mtu` field.
    super::check(unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFMTU, &mut request) })?;
    // SAFETY: SIOCGIFMTU succeeded, so the union holds the MTU.
    let mtu = unsafe { request.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).map_err(|_| io::Error::other(format!("interface {name} reports MTU {mtu}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_link_mtu() {
        let (name, mtu) = link_mtu_of(IpAddr::V4(Ipv4Addr::LOCALHOST)).expect("ioctl").expect("lo is up");
        assert_eq!(name, "lo");
        assert!(mtu >= 1280, "lo MTU {mtu}");
        assert_eq!(link_mtu_of("192.0.2.77".parse().expect("ip")).expect("lookup"), None);
        // Any 127/8 address is on lo, though lo lists only 127.0.0.1.
        assert_eq!(
            link_mtu_of("127.0.0.2".parse().expect("ip")).expect("ioctl").map(|(name, _)| name),
            Some(name.clone())
        );
        assert!(interface_mtu("no-such-if0").is_err());
        assert!(interface_mtu("a-name-far-too-long-for-linux").is_err());
    }

    #[test]
    fn loopback_is_listed() {
        let addrs = interface_addrs().expect("getifaddrs");
        assert!(addrs.iter().any(|a| a.ip == IpAddr::V4(Ipv4Addr::LOCALHOST)), "{addrs:?}");
    }
}
