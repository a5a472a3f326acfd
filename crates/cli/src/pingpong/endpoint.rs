//! Where a tool's soft RoCE device lives, shared by `pingpong` and `interop-peer`.
//!
//! A soft device is one UDP socket on one local address, and that address is its GID, which the
//! peer sends to. So it must be a specific unicast address of this host that the peer can
//! reach. Unless `--bind` names one, the tools take it from the out-of-band TCP connection: the
//! client uses its side of the connection, the server the address the client reached it at.
//! Two processes on one host that would end up on the same loopback address (a client
//! connecting to 127.0.0.1 gets 127.0.0.1 as its own side too) cannot both bind it, so such a
//! client moves to 127.0.0.2 (all of 127/8 is loopback on Linux).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use lightpath_soft::{parse_device_name, ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::{Error as VerbsError, Mtu};

/// The providers these tools can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProviderChoice {
    /// Lightpath's userspace RoCE v2 engine over a UDP socket.
    Soft,
    /// RDMA hardware (or the kernel's rxe) through rdma-core's libibverbs.
    Ibverbs,
}

/// How the user placed the soft device: `--bind`/`--udp-port`, or a soft device name (`-d`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    /// The local address, if given.
    pub bind: Option<IpAddr>,
    /// The UDP port of the RoCE endpoint (every peer must use the same one).
    pub udp_port: u16,
}

impl Placement {
    /// From the command line: `-d` (a soft device name such as `soft-10.0.0.1`,
    /// `soft-127.0.0.1-5000`, `10.0.0.1` or `10.0.0.1:5000`) or `--bind` and `--udp-port`.
    pub fn from_options(device: Option<&str>, bind: Option<IpAddr>, udp_port: u16) -> Result<Self> {
        match device {
            None => Ok(Self { bind, udp_port }),
            Some(name) => match parse_device_name(name) {
                Some(addr) => Ok(Self { bind: Some(addr.ip()), udp_port: addr.port() }),
                None => bail!(
                    "-d {name}: not a soft device (the soft provider's devices are named soft-<ip> or \
                     soft-<ip>-<udp port>; see `lightpath devices`)"
                ),
            },
        }
    }

    /// The server's address: `--bind`, else the address the client reached it at.
    pub fn server_ip(&self, connection: &TcpStream) -> Result<IpAddr> {
        match self.bind {
            Some(ip) => usable(ip),
            None => usable(connection.local_addr()?.ip().to_canonical()),
        }
    }

    /// The client's address: `--bind`, else its side of the connection (see the module doc
    /// for the loopback case).
    pub fn client_ip(&self, connection: &TcpStream) -> Result<IpAddr> {
        if let Some(ip) = self.bind {
            return usable(ip);
        }
        let mine = connection.local_addr()?.ip().to_canonical();
        let server = connection.peer_addr()?.ip().to_canonical();
        if mine == server && mine.is_loopback() {
            if mine == IpAddr::V4(Ipv4Addr::LOCALHOST) {
                return Ok(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)));
            }
            bail!("client and server would both use {mine}; pass --bind with another local address");
        }
        usable(mine)
    }
}

/// Refuses addresses a soft device cannot be reached at.
pub(crate) fn usable(ip: IpAddr) -> Result<IpAddr> {
    if ip.is_unspecified() {
        bail!("{ip} is not a usable RoCE address: a soft device needs one specific local address (it becomes its GID); pass --bind ADDR");
    }
    if ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        bail!("{ip} is not a usable RoCE address: it must be a unicast address of this host");
    }
    Ok(ip)
}

/// Opens a soft device on `ip` and `udp_port`, explaining the usual reasons it cannot be.
pub(crate) fn open_soft(ip: IpAddr, udp_port: u16, mtu: Mtu, mode: ProgressMode) -> Result<SoftDevice> {
    let mut config = SoftConfig::with_addr(SocketAddr::new(ip, udp_port));
    config.mtu = mtu;
    config.mode = mode;
    SoftDevice::open(config).map_err(|err| {
        let hint = match &err {
            VerbsError::Io(io) if io.kind() == io::ErrorKind::AddrInUse => {
                "; another RoCE endpoint (rxe, or another soft device) already uses this address and UDP \
                 port: pass --bind with another local address or --udp-port"
            }
            VerbsError::Io(io) if io.kind() == io::ErrorKind::AddrNotAvailable => {
                "; it is not an address of this host (pass --bind with one that is)"
            }
            _ => "",
        };
        anyhow::anyhow!("cannot open a soft RoCE device on {ip} UDP port {udp_port}: {err}{hint}")
    })
}

/// A random 24-bit initial PSN, as rdma-core's examples draw with `lrand48() & 0xffffff`.
pub(crate) fn random_psn() -> u32 {
    // RandomState is seeded from the OS per process; mixing in the time varies it per call.
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    (hasher.finish() & 0xFF_FFFF) as u32
}

/// Parses an unsigned number as C's `strtoul(s, NULL, 0)` does for the usual forms: decimal or
/// `0x` hexadecimal (rdma-core's tools accept both).
pub(crate) fn parse_c_number(text: &str) -> Result<u64, String> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse::<u64>(),
    };
    parsed.map_err(|_| format!("{text:?} is not a number"))
}

/// A clap value parser for a C-style number that must fit `T`.
pub(crate) fn c_number<T: TryFrom<u64>>(text: &str) -> Result<T, String> {
    let value = parse_c_number(text)?;
    T::try_from(value).map_err(|_| format!("{text} is out of range"))
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn device_names_place_the_device() {
        let placement = Placement::from_options(Some("soft-127.0.0.9-5000"), None, 4791).unwrap();
        assert_eq!(placement, Placement { bind: Some("127.0.0.9".parse().unwrap()), udp_port: 5000 });
        let placement = Placement::from_options(Some("10.1.2.3"), None, 4791).unwrap();
        assert_eq!(placement.udp_port, 4791);
        let err = Placement::from_options(Some("rxe0"), None, 4791).unwrap_err();
        assert!(err.to_string().contains("not a soft device"), "{err}");
    }

    #[test]
    fn unusable_addresses_are_refused() {
        assert!(usable("0.0.0.0".parse().unwrap()).is_err());
        assert!(usable("::".parse().unwrap()).is_err());
        assert!(usable("224.0.0.1".parse().unwrap()).is_err());
        assert!(usable("255.255.255.255".parse().unwrap()).is_err());
        assert!(usable("10.0.0.1".parse().unwrap()).is_ok());
    }

    #[test]
    fn loopback_client_moves_off_the_servers_address() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let placement = Placement { bind: None, udp_port: 4791 };
        assert_eq!(placement.client_ip(&client).unwrap(), IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)));
        assert_eq!(placement.server_ip(&server).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        let bound = Placement { bind: Some("127.0.0.7".parse().unwrap()), udp_port: 4791 };
        assert_eq!(bound.client_ip(&client).unwrap(), "127.0.0.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn an_address_in_use_is_explained() {
        let first = open_soft("127.0.0.1".parse().unwrap(), 0, Mtu::Mtu1024, ProgressMode::Thread).unwrap();
        let port = first.local_addr().port();
        let err =
            open_soft("127.0.0.1".parse().unwrap(), port, Mtu::Mtu1024, ProgressMode::Thread).unwrap_err();
        assert!(err.to_string().contains("already uses this address"), "{err}");
    }

    #[test]
    fn psns_are_24_bit_and_vary() {
        let psns: Vec<u32> = (0..16).map(|_| random_psn()).collect();
        assert!(psns.iter().all(|&psn| psn <= 0xFF_FFFF));
        assert!(psns.iter().any(|&psn| psn != psns[0]), "{psns:?}");
    }

    #[test]
    fn c_numbers() {
        assert_eq!(parse_c_number("4096"), Ok(4096));
        assert_eq!(parse_c_number("0x1000"), Ok(4096));
        assert!(parse_c_number("12k").is_err());
        assert_eq!(c_number::<u8>("300"), Err("300 is out of range".to_string()));
    }
}
