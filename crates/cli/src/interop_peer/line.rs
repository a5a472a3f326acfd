//! The protocol's text lines over TCP: each side's `LP1 …` endpoint line, then `DONE` and
//! `RESULT` (interop/PROTOCOL.md, "The exchange"), and a reader that never waits past a
//! deadline.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lightpath_verbs::Gid;

use super::op::Op;
use crate::pingpong::tcp;

/// Protocol tag and version.
pub const TAG: &str = "LP1";
/// Longest line accepted, `\n` excluded (verbs_peer's buffer is 256 bytes with the NUL).
pub const MAX_LINE: usize = 254;

/// What each side tells the other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointLine {
    pub op: Op,
    pub qpn: u32,
    pub psn: u32,
    pub gid: Gid,
    /// The sender's `-m` (validated when connecting, as verbs_peer does).
    pub mtu: u32,
    pub addr: u64,
    pub rkey: u32,
    pub size: u64,
    pub iters: u32,
}

impl EndpointLine {
    /// The line as sent, `\n` included.
    pub fn format(&self) -> String {
        format!(
            "{TAG} {} {:06x} {:06x} {} {} {:016x} {:08x} {} {}\n",
            self.op,
            self.qpn,
            self.psn,
            self.gid.to_hex(),
            self.mtu,
            self.addr,
            self.rkey,
            self.size,
            self.iters
        )
    }

    /// Parses a line (without its `\n`). Hex fields may have any width that fits, as
    /// verbs_peer's `sscanf` allows; the GID must be 32 hex digits.
    pub fn parse(line: &str) -> Result<Self> {
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let [tag, op, qpn, psn, gid, mtu, addr, rkey, size, iters] = fields[..] else {
            bail!("expected 10 fields, got {}", fields.len());
        };
        if tag != TAG {
            bail!("not an {TAG} line (tag {tag:?})");
        }
        let op = Op::from_name(op).with_context(|| format!("unknown operation {op:?}"))?;
        let hex32 = |text: &str, what: &str| {
            u32::from_str_radix(text, 16).with_context(|| format!("bad {what} {text:?}"))
        };
        let (qpn, psn) = (hex32(qpn, "QPN")?, hex32(psn, "PSN")?);
        if qpn > 0xFF_FFFF || psn > 0xFF_FFFF {
            bail!("QPN and PSN are 24-bit");
        }
        Ok(Self {
            op,
            qpn,
            psn,
            gid: Gid::from_hex(gid).with_context(|| format!("bad GID {gid:?}"))?,
            mtu: mtu.parse().with_context(|| format!("bad MTU {mtu:?}"))?,
            addr: u64::from_str_radix(addr, 16).with_context(|| format!("bad address {addr:?}"))?,
            rkey: hex32(rkey, "rkey")?,
            size: size.parse().with_context(|| format!("bad size {size:?}"))?,
            iters: iters.parse().with_context(|| format!("bad iteration count {iters:?}"))?,
        })
    }
}

/// One side of the TCP connection, read line by line.
#[derive(Debug)]
pub struct LineStream {
    stream: TcpStream,
    buffered: Vec<u8>,
    closed: bool,
}

impl LineStream {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> Self {
        Self { stream, buffered: Vec::new(), closed: false }
    }

    /// Sends `line`, which ends in `\n`.
    pub fn send(&mut self, line: &str) -> Result<()> {
        self.stream.write_all(line.as_bytes()).context("TCP write to the peer")
    }

    /// The next line (without `\n`), or `None` if none arrived before `deadline`. The peer
    /// closing the connection, an over-long line or text that is not UTF-8 are errors.
    pub fn read_line(&mut self, deadline: Instant) -> Result<Option<String>> {
        loop {
            if let Some(end) = self.buffered.iter().position(|&b| b == b'\n') {
                let rest = self.buffered.split_off(end + 1);
                let mut line = std::mem::replace(&mut self.buffered, rest);
                line.pop();
                return String::from_utf8(line).map(Some).context("the peer sent a line that is not text");
            }
            if self.buffered.len() > MAX_LINE {
                bail!("the peer sent a line longer than {MAX_LINE} bytes");
            }
            if self.closed {
                bail!("the peer closed the connection");
            }
            let mut chunk = [0u8; 512];
            match tcp::read_some(&mut self.stream, &mut chunk, deadline) {
                Ok(0) => self.closed = true,
                Ok(count) => self.buffered.extend_from_slice(&chunk[..count]),
                Err(err) if err.kind() == std::io::ErrorKind::TimedOut => return Ok(None),
                Err(err) => return Err(err).context("TCP read from the peer"),
            }
        }
    }

    /// A line if one is (about to be) there, without waiting more than a moment.
    pub fn poll_line(&mut self) -> Result<Option<String>> {
        self.read_line(Instant::now() + Duration::from_millis(1))
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, TcpListener};

    use super::*;

    fn example() -> EndpointLine {
        EndpointLine {
            op: Op::Write,
            qpn: 0x11,
            psn: 0x5a3c1f,
            gid: "10.78.0.2".parse().unwrap(),
            mtu: 1024,
            addr: 0x0000_55d0_c8a3_e000,
            rkey: 0x1234,
            size: 10000,
            iters: 5,
        }
    }

    #[test]
    fn protocol_example() {
        let text =
            "LP1 write 000011 5a3c1f 00000000000000000000ffff0a4e0002 1024 000055d0c8a3e000 00001234 10000 5";
        assert_eq!(example().format(), format!("{text}\n"));
        assert_eq!(EndpointLine::parse(text).unwrap(), example());
    }

    #[test]
    fn bad_lines_are_refused() {
        let good = example().format();
        let good = good.trim_end();
        assert!(EndpointLine::parse(&good.replace("LP1", "LP2")).is_err());
        assert!(EndpointLine::parse(&good.replace("write", "wrote")).is_err());
        assert!(EndpointLine::parse(&good.replace("000011", "1000000")).is_err());
        assert!(EndpointLine::parse(&good.replace("ffff0a4e0002", "ffff0a4e00")).is_err());
        assert!(EndpointLine::parse(&format!("{good} extra")).is_err());
        assert!(EndpointLine::parse("DONE PASS").is_err());
        assert!(EndpointLine::parse("").is_err());
    }

    #[test]
    fn lines_over_tcp() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let mut server = LineStream::new(listener.accept().unwrap().0);
        assert_eq!(server.poll_line().unwrap(), None);
        client.write_all(b"DONE PA").unwrap();
        client.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(server.poll_line().unwrap(), None);
        client.write_all(b"SS\nRESULT FAIL\n").unwrap();
        assert_eq!(server.read_line(deadline).unwrap().as_deref(), Some("DONE PASS"));
        assert_eq!(server.read_line(deadline).unwrap().as_deref(), Some("RESULT FAIL"));
        client.write_all(&[b'x'; 300]).unwrap();
        assert!(server.read_line(deadline).unwrap_err().to_string().contains("longer than"));
        drop(client);
    }

    #[test]
    fn a_closed_connection_is_an_error() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let mut server = LineStream::new(listener.accept().unwrap().0);
        client.write_all(b"partial").unwrap();
        drop(client);
        let err = server.read_line(Instant::now() + Duration::from_secs(10)).unwrap_err();
        assert!(err.to_string().contains("closed"), "{err}");
    }
}
