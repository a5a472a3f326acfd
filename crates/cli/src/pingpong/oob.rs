//! rdma-core's `ibv_rc_pingpong` out-of-band exchange (digest §8.1), so that either side of a
//! ping-pong can be the real rdma-core tool.
//!
//! Over TCP (default port 18515) the client sends a 52-byte message
//! `"%04x:%06x:%06x:%s\0"` — LID, QPN, PSN and the 16 GID bytes as 32 hex digits — the server
//! answers with its own, and the client confirms with the 5 bytes `"done\0"`.
//!
//! The C tool reads each message with one `read()` and parses it with `sscanf`, so a peer that
//! is not a ping-pong makes it fail in odd ways. Here a message is checked as its bytes arrive:
//! the first byte that cannot belong to an address message ends the exchange with an error
//! naming what arrived, without waiting for the rest.

use std::io::Write;
use std::net::TcpStream;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use lightpath_verbs::Gid;

use super::tcp;

/// Size of the address message, NUL included.
pub const MESSAGE_LEN: usize = 52;
/// The client's confirmation after reading the server's address.
pub const DONE: &[u8; 5] = b"done\0";

/// Positions of the `:` separators in the address message.
const SEPARATORS: [usize; 3] = [4, 11, 18];

/// What each side tells the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerAddress {
    /// LID (always 0 on RoCE).
    pub lid: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First PSN the sender will use (24 bits).
    pub psn: u32,
    /// The sender's GID.
    pub gid: Gid,
}

impl PeerAddress {
    /// The 52-byte wire form.
    pub fn encode(&self) -> [u8; MESSAGE_LEN] {
        let text = format!(
            "{:04x}:{:06x}:{:06x}:{}",
            self.lid,
            self.qpn & 0xFF_FFFF,
            self.psn & 0xFF_FFFF,
            self.gid.to_hex()
        );
        let mut out = [0u8; MESSAGE_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    /// Parses the wire form, with the leniency of the C tool's `sscanf("%x:%x:%x:%s")` but
    /// refusing anything that does not fit the fields.
    pub fn decode(message: &[u8]) -> Result<Self> {
        let end = message.iter().position(|&b| b == 0).unwrap_or(message.len());
        let text = std::str::from_utf8(&message[..end]).context("address message is not text")?;
        let mut fields = text.split(':');
        let mut next_hex = |name: &str, max: u32| -> Result<u32> {
            let field = fields.next().with_context(|| format!("address message lacks the {name}"))?;
            let value = u32::from_str_radix(field, 16).with_context(|| format!("bad {name} {field:?}"))?;
            if value > max {
                bail!("{name} {value:#x} out of range");
            }
            Ok(value)
        };
        let lid = next_hex("LID", 0xFFFF)? as u16;
        let qpn = next_hex("QPN", 0xFF_FFFF)?;
        let psn = next_hex("PSN", 0xFF_FFFF)?;
        let gid_text = fields.next().context("address message lacks the GID")?;
        let gid = Gid::from_hex(gid_text).with_context(|| format!("bad GID {gid_text:?}"))?;
        if fields.next().is_some() {
            bail!("address message has extra fields: {text:?}");
        }
        Ok(Self { lid, qpn, psn, gid })
    }

    /// Whether the GID's interface ID (its low 8 bytes) is set: `ibv_rc_pingpong` builds a
    /// global route only then, and RoCE has no other kind. A peer started without `-g` sends
    /// an all-zero GID.
    pub fn has_global_route(&self) -> bool {
        self.gid.0[8..] != [0u8; 8]
    }
}

/// Whether `byte` may appear at `position` of an address message as rdma-core writes it
/// (fixed-width lower-case hex fields; upper case is accepted too).
fn fits_at(position: usize, byte: u8) -> bool {
    if SEPARATORS.contains(&position) {
        byte == b':'
    } else if position == MESSAGE_LEN - 1 {
        byte == 0
    } else {
        byte.is_ascii_hexdigit()
    }
}

/// The offset of the first byte that cannot be part of an address message, if any.
pub fn first_misfit(prefix: &[u8]) -> Option<usize> {
    prefix.iter().enumerate().position(|(i, &b)| !fits_at(i, b))
}

/// Reads one address message, giving up at `deadline`.
pub fn read_address(stream: &mut TcpStream, deadline: Instant) -> Result<PeerAddress> {
    let mut buf = [0u8; MESSAGE_LEN];
    let mut got = 0;
    while got < MESSAGE_LEN {
        let count = tcp::read_some(stream, &mut buf[got..], deadline).map_err(|err| {
            anyhow::anyhow!("no address message from the peer ({got} of {MESSAGE_LEN} bytes received): {err}")
        })?;
        if count == 0 {
            bail!(
                "the peer closed the connection after {got} of the {MESSAGE_LEN} bytes of an address message \
                 ({}): it is not an ibv_rc_pingpong peer",
                shown(&buf[..got])
            );
        }
        got += count;
        if let Some(bad) = first_misfit(&buf[..got]) {
            bail!(
                "the peer is not an ibv_rc_pingpong: its address message has {:?} at byte {bad} ({})",
                char::from(buf[bad]),
                shown(&buf[..got])
            );
        }
    }
    PeerAddress::decode(&buf).context("bad address message from the peer")
}

/// Writes one address message.
pub fn write_address(stream: &mut TcpStream, address: &PeerAddress) -> Result<()> {
    stream.write_all(&address.encode()).context("sending our address to the peer")
}

/// The server's last step: reads the client's `"done\0"`.
pub fn read_done(stream: &mut TcpStream, deadline: Instant) -> Result<()> {
    let mut buf = [0u8; DONE.len()];
    let mut got = 0;
    while got < DONE.len() {
        let count = tcp::read_some(stream, &mut buf[got..], deadline)
            .map_err(|err| anyhow::anyhow!("no \"done\" from the client: {err}"))?;
        if count == 0 {
            bail!("the client closed the connection without sending \"done\" ({})", shown(&buf[..got]));
        }
        got += count;
        if buf[..got] != DONE[..got] {
            bail!("the client sent {} instead of \"done\\0\"", shown(&buf[..got]));
        }
    }
    Ok(())
}

/// The client's confirmation.
pub fn write_done(stream: &mut TcpStream) -> Result<()> {
    stream.write_all(DONE).context("sending \"done\" to the server")
}

/// Received bytes as an escaped string for error messages.
fn shown(bytes: &[u8]) -> String {
    format!("\"{}\"", bytes.escape_ascii())
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, TcpListener};
    use std::time::Duration;

    use super::*;

    #[test]
    fn matches_digest_example() {
        let address =
            PeerAddress { lid: 0, qpn: 0x11, psn: 0x5a3c1f, gid: "192.168.122.10".parse().unwrap() };
        let wire = address.encode();
        assert_eq!(&wire[..51], b"0000:000011:5a3c1f:00000000000000000000ffffc0a87a0a");
        assert_eq!(wire[51], 0);
        assert_eq!(first_misfit(&wire), None);
        assert_eq!(PeerAddress::decode(&wire).unwrap(), address);
        assert!(address.has_global_route());
        assert!(!PeerAddress { gid: Gid::ZERO, ..address }.has_global_route());
    }

    #[test]
    fn refuses_garbage() {
        assert!(PeerAddress::decode(b"hello").is_err());
        assert!(PeerAddress::decode(b"0000:1000000:000001:00000000000000000000ffffc0a87a0a\0").is_err());
        assert!(PeerAddress::decode(b"0000:000011:5a3c1f:zz000000000000000000ffffc0a87a0a\0").is_err());
        assert!(PeerAddress::decode(b"0000:000011:5a3c1f:00000000000000000000ffffc0a87a0a:x").is_err());
        assert!(PeerAddress::decode(&[0xff; MESSAGE_LEN]).is_err());
    }

    #[test]
    fn misfits_are_found_early() {
        assert_eq!(first_misfit(b"GET / HTTP/1.0"), Some(0));
        assert_eq!(first_misfit(b"0000-"), Some(4));
        assert_eq!(first_misfit(b"0000:00001"), None);
        let mut wire = PeerAddress { lid: 0, qpn: 1, psn: 2, gid: Gid::ZERO }.encode();
        wire[51] = b'0';
        assert_eq!(first_misfit(&wire), Some(51));
    }

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    #[test]
    fn exchange_over_tcp() {
        let (mut client, mut server) = pair();
        let deadline = Instant::now() + Duration::from_secs(10);
        let address = PeerAddress { lid: 0, qpn: 0xabcdef, psn: 0x123456, gid: "10.0.0.1".parse().unwrap() };
        // Split across writes: the reader must reassemble.
        let wire = address.encode();
        client.write_all(&wire[..20]).unwrap();
        client.flush().unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            client.write_all(&wire[20..]).unwrap();
            write_done(&mut client).unwrap();
        });
        assert_eq!(read_address(&mut server, deadline).unwrap(), address);
        read_done(&mut server, deadline).unwrap();
    }

    #[test]
    fn garbage_is_refused_without_waiting_for_52_bytes() {
        let (mut client, mut server) = pair();
        // The peer keeps the connection open: only the content can end the read.
        client.write_all(b"SSH-2.0-OpenSSH\r\n").unwrap();
        let err = read_address(&mut server, Instant::now() + Duration::from_secs(30)).unwrap_err();
        assert!(err.to_string().contains("not an ibv_rc_pingpong"), "{err}");
        assert!(err.to_string().contains("SSH-2.0"), "{err}");
        drop(client);
    }

    #[test]
    fn short_message_and_wrong_done_are_refused() {
        let (mut client, mut server) = pair();
        let deadline = Instant::now() + Duration::from_secs(10);
        client.write_all(b"0000:0000").unwrap();
        drop(client);
        let err = read_address(&mut server, deadline).unwrap_err();
        assert!(err.to_string().contains("closed the connection after 9 of the 52 bytes"), "{err}");

        let (mut client, mut server) = pair();
        client.write_all(b"dune\0").unwrap();
        let err = read_done(&mut server, deadline).unwrap_err();
        assert!(err.to_string().contains("instead of \"done"), "{err}");
    }
}
