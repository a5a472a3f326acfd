//! rdma-core's `ibv_rc_pingpong` out-of-band exchange (digest §8.1), so that either side of a
//! ping-pong can be the real rdma-core tool.
//!
//! Over TCP (default port 18515) the client sends a 52-byte message
//! `"%04x:%06x:%06x:%s\0"` — LID, QPN, PSN and the 16 GID bytes as 32 hex digits — the server
//! answers with its own, and the client confirms with the 5 bytes `"done\0"`.

use std::io::{Read, Write};

use anyhow::{bail, Context, Result};
use lightpath_verbs::Gid;

/// Size of the address message, NUL included.
pub const MESSAGE_LEN: usize = 52;
/// The client's confirmation after reading the server's address.
pub const DONE: &[u8; 5] = b"done\0";

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
        let text = format!("{:04x}:{:06x}:{:06x}:{}", self.lid, self.qpn & 0xFF_FFFF, self.psn & 0xFF_FFFF, self.gid.to_hex());
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
}

/// Reads exactly one address message (the C tool sends it with one write).
pub fn read_address(stream: &mut impl Read) -> Result<PeerAddress> {
    let mut buf = [0u8; MESSAGE_LEN];
    stream.read_exact(&mut buf).context("peer closed before sending its address")?;
    PeerAddress::decode(&buf)
}

/// Writes one address message.
pub fn write_address(stream: &mut impl Write, address: &PeerAddress) -> Result<()> {
    stream.write_all(&address.encode())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_digest_example() {
        let address = PeerAddress { lid: 0, qpn: 0x11, psn: 0x5a3c1f, gid: "192.168.122.10".parse().unwrap() };
        let wire = address.encode();
        assert_eq!(&wire[..51], b"0000:000011:5a3c1f:00000000000000000000ffffc0a87a0a");
        assert_eq!(wire[51], 0);
        assert_eq!(PeerAddress::decode(&wire).unwrap(), address);
    }

    #[test]
    fn refuses_garbage() {
        assert!(PeerAddress::decode(b"hello").is_err());
        assert!(PeerAddress::decode(b"0000:1000000:000001:00000000000000000000ffffc0a87a0a\0").is_err());
        assert!(PeerAddress::decode(b"0000:000011:5a3c1f:zz000000000000000000ffffc0a87a0a\0").is_err());
        assert!(PeerAddress::decode(b"0000:000011:5a3c1f:00000000000000000000ffffc0a87a0a:x").is_err());
        assert!(PeerAddress::decode(&[0xff; MESSAGE_LEN]).is_err());
    }
}
