//! The out-of-band control channel between the two `lightpath perf` processes.
//!
//! Messages are JSON objects framed by a 4-byte big-endian length, so that raw test data can
//! follow on the same TCP connection without any read-ahead buffering getting in the way. The
//! first message names the protocol (`"magic": "lightpath-perf"`), so that a perftest binary or
//! any other program reaching the port gets a clear error instead of a hang.

use std::io::{Read, Write};
use std::net::TcpStream;

use anyhow::{bail, Context, Result};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::args::{PerfTest, ProviderKind};

/// Identifies the protocol in the first message.
pub const MAGIC: &str = "lightpath-perf";
/// Protocol version; both sides must match.
pub const VERSION: u32 = 2;
/// Largest control message accepted (anything larger is not from a peer speaking this protocol).
const MAX_MESSAGE: u32 = 64 * 1024;

/// The client's opening message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub magic: String,
    pub version: u32,
    pub test: PerfTest,
    pub provider: ProviderKind,
    /// Sizes the client will run, in order, with their iteration counts.
    pub plan: Vec<(usize, u64)>,
    pub tx_depth: u32,
    /// Provider-specific connection data (e.g. the soft provider's QPN, PSN, GID, buffer keys).
    pub endpoint: Option<serde_json::Value>,
    /// The client wants the server's CPU time of each size (the tcp baseline sends it after
    /// each size's data; the RDMA providers in their verdict). Absent from older clients.
    #[serde(default)]
    pub cpu: bool,
}

/// The server's answer to [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Answer {
    /// Go ahead; provider-specific connection data of the server.
    Accept { endpoint: Option<serde_json::Value> },
    /// The server refuses, and says why.
    Reject { reason: String },
}

/// Sends one framed JSON message.
pub fn send<T: Serialize>(stream: &mut TcpStream, message: &T) -> Result<()> {
    let body = serde_json::to_vec(message)?;
    let len = u32::try_from(body.len()).context("control message too large")?;
    stream.write_all(&len.to_be_bytes())?;
    stream.write_all(&body)?;
    Ok(())
}

/// Receives one framed JSON message, refusing anything that is not a plausible control message.
pub fn recv<T: DeserializeOwned>(stream: &mut TcpStream) -> Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).context("peer closed the control connection")?;
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE {
        bail!("peer is not a `lightpath perf` process (control frame of {len} bytes)");
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body).context("peer closed the control connection")?;
    serde_json::from_slice(&body).context("peer is not a `lightpath perf` process (bad control message)")
}

/// Checks a client's hello against what this server was started for.
pub fn check_hello(hello: &Hello, test: PerfTest, provider: ProviderKind) -> std::result::Result<(), String> {
    if hello.magic != MAGIC {
        return Err(format!("unknown protocol {:?}", hello.magic));
    }
    if hello.version != VERSION {
        return Err(format!("protocol version {} (this server speaks {VERSION})", hello.version));
    }
    if hello.test != test {
        return Err(format!("client runs {} but this server runs {}", hello.test, test));
    }
    if !hello.provider.interoperates_with(provider) {
        return Err(format!(
            "client uses provider {} but this server uses {} (they do not share a wire protocol)",
            hello.provider.name(),
            provider.name()
        ));
    }
    if hello.plan.is_empty() {
        return Err("empty test plan".into());
    }
    if let Some((size, _)) = hello.plan.iter().find(|(size, _)| *size == 0 || *size > super::args::MAX_SIZE) {
        return Err(format!("message size {size} out of range"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn hello() -> Hello {
        Hello {
            magic: MAGIC.into(),
            version: VERSION,
            test: PerfTest::SendLat,
            provider: ProviderKind::Tcp,
            plan: vec![(2, 10)],
            tx_depth: 1,
            endpoint: None,
            cpu: true,
        }
    }

    #[test]
    fn hello_checks() {
        assert!(check_hello(&hello(), PerfTest::SendLat, ProviderKind::Tcp).is_ok());
        let err = check_hello(&hello(), PerfTest::WriteBw, ProviderKind::Tcp).unwrap_err();
        assert!(err.contains("write_bw"), "{err}");
        let mut bad = hello();
        bad.plan = vec![(0, 1)];
        assert!(check_hello(&bad, PerfTest::SendLat, ProviderKind::Tcp).is_err());
        bad = hello();
        bad.version = 99;
        assert!(check_hello(&bad, PerfTest::SendLat, ProviderKind::Tcp).unwrap_err().contains("version"));
    }

    /// soft and ibverbs are one wire (RoCE v2), so either client meets either server; shm and
    /// tcp meet only themselves.
    #[test]
    fn providers_sharing_a_wire_are_accepted() {
        use ProviderKind::*;
        let all = [Soft, Ibverbs, Shm, Tcp];
        for client in all {
            for server in all {
                let mut h = hello();
                h.provider = client;
                let verdict = check_hello(&h, PerfTest::SendLat, server);
                let roce = |p| matches!(p, Soft | Ibverbs);
                let compatible = client == server || (roce(client) && roce(server));
                assert_eq!(verdict.is_ok(), compatible, "{client:?} client, {server:?} server: {verdict:?}");
                if let Err(reason) = verdict {
                    assert!(reason.contains(client.name()) && reason.contains(server.name()), "{reason}");
                }
            }
        }
    }

    #[test]
    fn framing_round_trip_and_foreign_peer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).unwrap();
            send(&mut stream, &hello()).unwrap();
            // A foreign peer: perftest starts with a 16-byte version string.
            stream.write_all(b"6.22\0\0\0\0\0\0\0\0\0\0\0\0").unwrap();
        });
        let (mut stream, _) = listener.accept().unwrap();
        let got: Hello = recv(&mut stream).unwrap();
        assert_eq!(got, hello());
        let err = recv::<Hello>(&mut stream).unwrap_err();
        assert!(err.to_string().contains("not a `lightpath perf`"), "{err}");
        client.join().unwrap();
    }
}
