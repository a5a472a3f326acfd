//! Connecting two queue pairs over an out-of-band byte stream (usually TCP), for Rust programs
//! that do not use the stream layer: exchange the numbers each side needs, bring both queue
//! pairs to RTS, and make sure neither sends before the other can receive.
//!
//! Works with any provider (it only uses the [`QueuePair`] trait).
//!
//! # Message format (version 1)
//!
//! Each side sends one *hello*: ASCII lines ending in `\n`, in this order:
//!
//! ```text
//! lightpath-connect 1
//! gid 00000000000000000000ffff7f000001     32 hex digits: the 16 GID bytes in order
//! qpn 000011                               6 hex digits
//! psn 5a3c1f                               6 hex digits: the first PSN this side sends
//! mtu 1024                                 decimal: the largest path MTU this side accepts
//! region 00007f3a2c000000 0000000000100000 00000201   zero or more (at most 64):
//!                                          addr (16 hex), len (16 hex), rkey (8 hex)
//! end
//! ```
//!
//! Both sides write their hello at once and then read the peer's (the messages are far smaller
//! than any socket buffer, so this cannot deadlock). Each then moves its queue pair to RTR and
//! RTS with path MTU = the smaller of the two `mtu` values, and writes `ready\n`; a side
//! returns only after reading the peer's `ready`, so by then the peer's queue pair accepts
//! requests. Hex digits may be upper or lower case; lines are at most 128 bytes; anything else
//! is refused with an `InvalidData` I/O error. Nothing is retried: a failed exchange leaves the
//! queue pair in whatever state it reached, and the caller should move it to ERR or drop it.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::{AccessFlags, AddressVector, Error, Gid, Mtu, QpAttr, QpState, QueuePair, RemoteRegion, Result};

/// Protocol identifier and version: the first line of every hello.
const MAGIC: &str = "lightpath-connect 1";
/// Longest line accepted.
const MAX_LINE: usize = 128;
/// Most regions one hello may carry.
pub const MAX_REGIONS: usize = 64;

/// What this side offers and how its queue pair is configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Largest path MTU this side accepts (use the port's active MTU).
    pub mtu: Mtu,
    /// Regions to tell the peer about (typically targets of its WRITEs and READs).
    pub regions: Vec<RemoteRegion>,
    /// Responder access, set on RESET→INIT (ignored if the queue pair is already in INIT).
    pub access: AccessFlags,
    /// First PSN this side sends; `None` picks a random one.
    pub psn: Option<u32>,
    /// Local ACK timeout code (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR timer code this side advertises.
    pub min_rnr_timer: u8,
    /// READ/atomic requests this side may have outstanding, and accepts from the peer.
    pub max_rd_atomic: u8,
    /// Time limit for each read and write on the stream.
    pub io_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            mtu: Mtu::Mtu1024,
            regions: Vec::new(),
            access: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
            psn: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            io_timeout: Duration::from_secs(30),
        }
    }
}

/// One side's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The GID the queue pair sends from.
    pub gid: Gid,
    /// The queue pair number.
    pub qpn: u32,
    /// The first PSN the side sends.
    pub psn: u32,
    /// The largest path MTU the side accepts.
    pub mtu: Mtu,
    /// Regions the side shares.
    pub regions: Vec<RemoteRegion>,
}

impl Hello {
    /// The hello as sent on the wire.
    pub fn encode(&self) -> String {
        let mut text = format!(
            "{MAGIC}\ngid {}\nqpn {:06x}\npsn {:06x}\nmtu {}\n",
            self.gid.to_hex(),
            self.qpn,
            self.psn,
            self.mtu.bytes()
        );
        for region in &self.regions {
            text.push_str(&format!("region {:016x} {:016x} {:08x}\n", region.addr, region.len, region.rkey));
        }
        text.push_str("end\n");
        text
    }

    /// Reads one hello from `reader`.
    pub fn decode(reader: &mut impl BufRead) -> io::Result<Hello> {
        expect_line(reader, MAGIC)?;
        let gid = Gid::from_hex(&field(reader, "gid")?).ok_or_else(|| invalid("gid is not 32 hex digits"))?;
        let qpn = parse_hex24(&field(reader, "qpn")?, "qpn")?;
        let psn = parse_hex24(&field(reader, "psn")?, "psn")?;
        let mtu = field(reader, "mtu")?
            .parse::<u32>()
            .ok()
            .and_then(Mtu::from_bytes)
            .ok_or_else(|| invalid("mtu is not one of 256, 512, 1024, 2048, 4096"))?;
        let mut regions = Vec::new();
        loop {
            let line = read_line(reader)?;
            if line == "end" {
                break;
            }
            let rest = line.strip_prefix("region ").ok_or_else(|| invalid("expected `region` or `end`"))?;
            if regions.len() == MAX_REGIONS {
                return Err(invalid("more than 64 regions"));
            }
            regions.push(parse_region(rest)?);
        }
        Ok(Hello { gid, qpn, psn, mtu, regions })
    }
}

/// The outcome of a successful exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connection {
    /// What the peer sent.
    pub peer: Hello,
    /// The path MTU both queue pairs use.
    pub mtu: Mtu,
    /// The first PSN this side sends.
    pub local_psn: u32,
}

/// Connects to `addr` over TCP and runs the exchange for `qp`.
pub fn connect<Q: QueuePair>(
    addr: impl ToSocketAddrs,
    qp: &Q,
    options: &ConnectOptions,
) -> Result<Connection> {
    let stream = TcpStream::connect(addr)?;
    exchange(stream, qp, options)
}

/// Accepts one TCP connection on `listener` and runs the exchange for `qp`.
pub fn accept<Q: QueuePair>(listener: &TcpListener, qp: &Q, options: &ConnectOptions) -> Result<Connection> {
    let (stream, _) = listener.accept()?;
    exchange(stream, qp, options)
}

/// Runs the exchange over an established stream (the same on both sides). The queue pair must
/// be in RESET (it is moved to INIT with `options.access`) or INIT (receives posted before
/// connecting are kept, so the peer's first SEND finds one).
pub fn exchange<Q: QueuePair>(stream: TcpStream, qp: &Q, options: &ConnectOptions) -> Result<Connection> {
    stream.set_read_timeout(Some(options.io_timeout))?;
    stream.set_write_timeout(Some(options.io_timeout))?;
    stream.set_nodelay(true)?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream.take(64 * 1024));
    exchange_over(&mut reader, &mut writer, qp, options)
}

/// [`exchange`] over any reader and writer (for streams other than TCP).
pub fn exchange_over<Q: QueuePair>(
    reader: &mut impl BufRead,
    writer: &mut impl Write,
    qp: &Q,
    options: &ConnectOptions,
) -> Result<Connection> {
    match qp.state()? {
        QpState::Reset => qp.modify(&QpAttr::to_init(options.access))?,
        QpState::Init => {}
        other => return Err(Error::InvalidState(other)),
    }
    let endpoint = qp.endpoint();
    let local_psn = options.psn.map_or_else(random_psn, |psn| psn & 0xFF_FFFF);
    let hello = Hello {
        gid: endpoint.gid,
        qpn: endpoint.qpn,
        psn: local_psn,
        mtu: options.mtu,
        regions: options.regions.clone(),
    };
    writer.write_all(hello.encode().as_bytes())?;
    writer.flush()?;
    let peer = Hello::decode(reader)?;
    let mtu = options.mtu.min(peer.mtu);

    let mut rtr = QpAttr::to_rtr(AddressVector::new(peer.gid, endpoint.gid_index), mtu, peer.qpn, peer.psn);
    rtr.min_rnr_timer = Some(options.min_rnr_timer);
    rtr.max_dest_rd_atomic = Some(options.max_rd_atomic);
    qp.modify(&rtr)?;
    let mut rts = QpAttr::to_rts(local_psn);
    rts.timeout = Some(options.timeout);
    rts.retry_cnt = Some(options.retry_cnt);
    rts.rnr_retry = Some(options.rnr_retry);
    rts.max_rd_atomic = Some(options.max_rd_atomic);
    qp.modify(&rts)?;

    writer.write_all(b"ready\n")?;
    writer.flush()?;
    expect_line(reader, "ready")?;
    Ok(Connection { peer, mtu, local_psn })
}

fn random_psn() -> u32 {
    // RandomState is seeded from the OS once per process and advanced per instance, which is
    // plenty for a PSN (it only has to differ between connections, not be secret).
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(std::process::id().into());
    (hasher.finish() & 0xFF_FFFF) as u32
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("connect exchange: {what}"))
}

fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    let read = reader.by_ref().take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line)?;
    if read == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connect exchange: peer closed the stream"));
    }
    if line.pop() != Some(b'\n') {
        return Err(invalid("line too long or unterminated"));
    }
    String::from_utf8(line).map_err(|_| invalid("line is not UTF-8"))
}

fn expect_line(reader: &mut impl BufRead, expected: &str) -> io::Result<()> {
    let line = read_line(reader)?;
    if line == expected {
        Ok(())
    } else {
        Err(invalid(&format!("expected {expected:?}, got {line:?}")))
    }
}

fn field(reader: &mut impl BufRead, name: &str) -> io::Result<String> {
    let line = read_line(reader)?;
    match line.split_once(' ') {
        Some((key, value)) if key == name => Ok(value.to_owned()),
        _ => Err(invalid(&format!("expected `{name} …`, got {line:?}"))),
    }
}

fn parse_hex24(text: &str, what: &str) -> io::Result<u32> {
    match u32::from_str_radix(text, 16) {
        Ok(value) if value < 1 << 24 && text.len() <= 6 => Ok(value),
        _ => Err(invalid(&format!("{what} is not a 24-bit hex number"))),
    }
}

fn parse_region(text: &str) -> io::Result<RemoteRegion> {
    let mut parts = text.split(' ');
    let mut hex64 = |digits: usize| -> io::Result<u64> {
        let part =
            parts.next().filter(|p| p.len() == digits).ok_or_else(|| invalid("malformed region line"))?;
        u64::from_str_radix(part, 16).map_err(|_| invalid("malformed region line"))
    };
    let addr = hex64(16)?;
    let len = hex64(16)?;
    let rkey = hex64(8)? as u32;
    if parts.next().is_some() {
        return Err(invalid("malformed region line"));
    }
    Ok(RemoteRegion { addr, len, rkey })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Hello {
        Hello {
            gid: "127.0.0.1".parse().expect("gid"),
            qpn: 0x11,
            psn: 0x5a3c1f,
            mtu: Mtu::Mtu1024,
            regions: vec![RemoteRegion { addr: 0x7f3a_2c00_0000, len: 1 << 20, rkey: 0x8000_0201 }],
        }
    }

    #[test]
    fn hello_round_trip_and_layout() {
        let hello = sample();
        let text = hello.encode();
        assert_eq!(
            text,
            "lightpath-connect 1\ngid 00000000000000000000ffff7f000001\nqpn 000011\npsn 5a3c1f\nmtu 1024\n\
             region 00007f3a2c000000 0000000000100000 80000201\nend\n"
        );
        let decoded = Hello::decode(&mut text.as_bytes()).expect("decode");
        assert_eq!(decoded, hello);
        let no_regions = Hello { regions: Vec::new(), ..hello };
        assert_eq!(Hello::decode(&mut no_regions.encode().as_bytes()).expect("decode"), no_regions);
    }

    #[test]
    fn malformed_hellos_are_refused() {
        let good = sample().encode();
        let cases = [
            String::new(),
            good.replace("lightpath-connect 1", "lightpath-connect 2"),
            good.replace("qpn 000011", "qpn 1000000"),
            good.replace("psn 5a3c1f", "psn zz"),
            good.replace("mtu 1024", "mtu 1500"),
            good.replace("gid 0000", "gid 00"),
            good.replace("end\n", "region 1 2 3\nend\n"),
            good.replace("end\n", ""),
            good.replace("end\n", &format!("{}\n", "x".repeat(500))),
            good.replace("mtu 1024\n", ""),
        ];
        for text in cases {
            let err = Hello::decode(&mut text.as_bytes()).expect_err(&text);
            assert!(
                matches!(err.kind(), io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof),
                "{text:?}: {err}"
            );
        }
        let too_many = good
            .replace("end\n", &"region 0000000000000000 0000000000000001 00000001\n".repeat(MAX_REGIONS + 1))
            + "end\n";
        assert!(Hello::decode(&mut too_many.as_bytes()).is_err());
    }

    #[test]
    fn random_psns_are_24_bit() {
        for _ in 0..100 {
            assert!(random_psn() < 1 << 24);
        }
    }
}
