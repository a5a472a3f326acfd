//! Pairing across hosts (or network namespaces): which peers to try, the hello that finds the
//! peer's process, and the relay that hands it on.
//!
//! Abstract Unix socket names only reach processes of one network namespace. For a connection
//! whose peer address is not one of this namespace's own, and only when the peer is named by
//! the rule `LIGHTPATH_PRELOAD_PEERS` (a comma-separated list of addresses and CIDR prefixes,
//! or `all`; opt-in, as libsdp's and XLIO's rule files are, since it makes this process accept
//! a side connection from the peer's host), the two ends split the work by the same order
//! both compute (the connection's two addresses, sorted as the rendezvous name sorts them):
//!
//! * the *lower* end opens a TCP listener on its connection's local address and sends a UDP
//!   [`Hello`] (both addresses and that listener's port) to the peer's address at the
//!   rendezvous port (`LIGHTPATH_PRELOAD_PORT`, default [`DEFAULT_PORT`]), again every 100 ms
//!   while it waits;
//! * the *higher* end listens on the connection's abstract name, as on one host, and makes
//!   sure some process of its namespace holds the rendezvous port: the first preloaded process
//!   that needs it binds it and keeps it (the *relay*), a later one binds it if that process
//!   has gone.
//!
//! The relay checks that a hello comes from the address it claims for its sender, derives the
//! connection's abstract name and tells whoever listens there ([`RelayMessage`]) where to
//! connect: the higher end then connects to the lower end's listener (accepted only from the
//! connection's peer address) and the two run Lightpath's negotiation over that side
//! connection, which picks soft (or ibverbs) between hosts. A peer without the library never
//! answers: both ends give up after the rendezvous wait and stay TCP, as on one host.
//!
//! Trust: the side connection is accepted from the peer's IP address only, and Lightpath's
//! negotiation then runs over it; a process on the peer's host that knows the connection's
//! addresses could pose as the peer (as with rsockets or SDP). The rule names the hosts to
//! trust so.

use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};

use lightpath::options::PeerRule;
use std::sync::OnceLock;

/// The rendezvous UDP port unless `LIGHTPATH_PRELOAD_PORT` says otherwise (RoCE v2's 4791,
/// plus one).
pub(crate) const DEFAULT_PORT: u16 = 4792;

/// The rendezvous UDP port of every host.
pub(crate) fn port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        std::env::var("LIGHTPATH_PRELOAD_PORT")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_PORT)
    })
}

/// The process's rule, read once (a line in the report names entries it could not read).
pub(crate) fn rule() -> &'static PeerRule {
    static RULE: OnceLock<PeerRule> = OnceLock::new();
    RULE.get_or_init(|| {
        let text = std::env::var("LIGHTPATH_PRELOAD_PEERS").unwrap_or_default();
        let (rule, bad) = PeerRule::parse(&text);
        if !bad.is_empty() {
            crate::report::line(format_args!(
                "LIGHTPATH_PRELOAD_PEERS: ignored {bad:?} (not ADDRESS or ADDRESS/BITS)"
            ));
        }
        rule
    })
}

/// Whether `ip` is an address of this network namespace (a socket can be bound to it).
pub(crate) fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Whether this end is the lower of the connection's two (the order the rendezvous name
/// sorts them by): it sends the hello; the higher end waits on the name.
pub(crate) fn is_lower(local: SocketAddr, peer: SocketAddr) -> bool {
    local.to_string() < peer.to_string()
}

const HELLO_MAGIC: [u8; 8] = *b"LPPREH2\0";

/// The lower end's announcement: the connection's addresses as the sender sees them, and the
/// port of the sender's side listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) sender: SocketAddr,
    pub(crate) receiver: SocketAddr,
    pub(crate) side_port: u16,
}

impl Hello {
    pub(crate) const LEN: usize = 8 + 18 + 18 + 2;

    pub(crate) fn emit(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&HELLO_MAGIC);
        put_addr(&mut out[8..26], self.sender);
        put_addr(&mut out[26..44], self.receiver);
        out[44..46].copy_from_slice(&self.side_port.to_be_bytes());
        out
    }

    /// A hello, or `None` for anything else (a datagram of another length or magic).
    pub(crate) fn parse(bytes: &[u8]) -> Option<Hello> {
        if bytes.len() != Self::LEN || bytes[..8] != HELLO_MAGIC {
            return None;
        }
        let side_port = u16::from_be_bytes([bytes[44], bytes[45]]);
        let hello = Hello { sender: get_addr(&bytes[8..26]), receiver: get_addr(&bytes[26..44]), side_port };
        (side_port != 0 && hello.sender.port() != 0 && hello.receiver.port() != 0).then_some(hello)
    }
}

/// What the relay (or a local peer) tells the end listening on a connection's abstract name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RelayMessage {
    /// A peer of this namespace: it waits for the port of a side listener.
    Local,
    /// A peer on another host: connect to its side listener at this address.
    Remote(SocketAddr),
}

impl RelayMessage {
    pub(crate) const LEN: usize = 1 + 18;

    pub(crate) fn emit(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        match self {
            RelayMessage::Local => out[0] = b'L',
            RelayMessage::Remote(target) => {
                out[0] = b'R';
                put_addr(&mut out[1..], *target);
            }
        }
        out
    }

    pub(crate) fn parse(bytes: &[u8; Self::LEN]) -> Option<RelayMessage> {
        match bytes[0] {
            b'L' => Some(RelayMessage::Local),
            b'R' => Some(RelayMessage::Remote(get_addr(&bytes[1..]))),
            _ => None,
        }
    }
}

fn put_addr(out: &mut [u8], address: SocketAddr) {
    let ip = match address.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    out[..16].copy_from_slice(&ip.octets());
    out[16..18].copy_from_slice(&address.port().to_be_bytes());
}

fn get_addr(bytes: &[u8]) -> SocketAddr {
    let mut octets = [0u8; 16];
    octets.copy_from_slice(&bytes[..16]);
    let ip = IpAddr::V6(Ipv6Addr::from(octets)).to_canonical();
    SocketAddr::new(ip, u16::from_be_bytes([bytes[16], bytes[17]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_and_relay_messages_round_trip_and_refuse_other_bytes() {
        let hello = Hello {
            sender: "10.77.0.1:5000".parse().unwrap(),
            receiver: "[fd00::2]:40000".parse().unwrap(),
            side_port: 41000,
        };
        let bytes = hello.emit();
        assert_eq!(Hello::parse(&bytes), Some(hello));
        assert_eq!(Hello::parse(&bytes[..Hello::LEN - 1]), None);
        let mut other = bytes;
        other[0] ^= 1;
        assert_eq!(Hello::parse(&other), None);
        let mut no_port = bytes;
        no_port[44..46].fill(0);
        assert_eq!(Hello::parse(&no_port), None);
        for message in [RelayMessage::Local, RelayMessage::Remote("10.77.0.1:41000".parse().unwrap())] {
            assert_eq!(RelayMessage::parse(&message.emit()), Some(message));
        }
        assert_eq!(RelayMessage::parse(&[b'X'; RelayMessage::LEN]), None);
    }

    #[test]
    fn exactly_one_end_is_lower() {
        let a: SocketAddr = "10.77.0.1:5000".parse().unwrap();
        let b: SocketAddr = "10.77.0.2:40000".parse().unwrap();
        assert!(is_lower(a, b) != is_lower(b, a));
    }

    #[test]
    fn loopback_is_local_and_a_foreign_address_is_not() {
        assert!(is_local("127.0.0.1".parse().unwrap()));
        assert!(!is_local("192.0.2.1".parse().unwrap()), "TEST-NET-1 is on no interface here");
    }
}
