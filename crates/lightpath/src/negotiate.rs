//! The blocking negotiation over a fresh TCP connection (see `docs/stream-protocol.md`):
//! the client offers providers, the server picks one and both set up queue pairs, the client
//! probes the RDMA path, and on any failure both sides keep the TCP connection for the data.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::devices;
use crate::error::invalid;
use crate::options::Options;
use crate::rdma::{PendingSetup, RdmaStream};
use crate::Transport;
use lightpath_stream::negotiate::{
    match_magic, pick_version, Choice, FallbackReason, MagicMatch, Message, ProviderId, CLIENT_MAGIC,
    SERVER_MAGIC, VERSION,
};

/// How a negotiation ended.
pub(crate) enum Negotiated {
    /// RDMA over `provider`.
    Rdma { conn: Box<dyn RdmaStream>, provider: ProviderId },
    /// Data over the TCP connection.
    Tcp { tcp: TcpStream, framed: bool, prefix: Vec<u8>, transport: Transport },
}

fn tcp_outcome(tcp: TcpStream, reason: FallbackReason) -> Negotiated {
    let framed = reason != FallbackReason::VersionMismatch;
    let transport = if framed { Transport::Tcp(reason) } else { Transport::PlainTcp };
    Negotiated::Tcp { tcp, framed, prefix: Vec::new(), transport }
}

/// Reads from `tcp` until one message parses; `what` names the peer in errors.
fn read_message(tcp: &mut TcpStream, pending: &mut Vec<u8>) -> io::Result<Message> {
    let mut chunk = [0u8; 1024];
    loop {
        match Message::parse(pending) {
            Ok(Some((message, used))) => {
                pending.drain(..used);
                return Ok(message);
            }
            Ok(None) => {}
            Err(err) => return Err(invalid(format!("negotiation: {err}"))),
        }
        let n = match tcp.read(&mut chunk) {
            Ok(n) => n,
            Err(err) if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "lightpath: the peer stopped answering during negotiation",
                ))
            }
            Err(err) => return Err(err),
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "lightpath: the peer closed the connection during negotiation",
            ));
        }
        pending.extend_from_slice(&chunk[..n]);
    }
}

fn send(tcp: &mut TcpStream, message: &Message) -> io::Result<()> {
    tcp.write_all(&message.to_bytes())
}

/// The client side, on a connected TCP stream.
pub(crate) fn client(mut tcp: TcpStream, options: &Options) -> io::Result<Negotiated> {
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(options.handshake_timeout))?;
    let (min_version, max_version) = options.fault_versions.unwrap_or((VERSION, VERSION));
    let providers: Vec<ProviderId> =
        options.providers.iter().copied().filter(|p| devices::usable(*p, &tcp)).collect();
    let mut host_id = devices::shm::host_id();
    if options.fault_other_host {
        host_id[0] ^= 0xFF;
    }
    let hello = Message::ClientHello { min_version, max_version, providers: providers.clone(), host_id };
    let mut out = CLIENT_MAGIC.to_vec();
    hello.emit(&mut out);
    tcp.write_all(&out).map_err(|err| match err.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => not_lightpath_closed(),
        _ => err,
    })?;

    let mut magic = Vec::with_capacity(8);
    let mut byte = [0u8; 8];
    while magic.len() < 8 {
        let n = match tcp.read(&mut byte[..8 - magic.len()]) {
            Ok(0) => return Err(not_lightpath_closed()),
            Err(err) if matches!(err.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe) => {
                return Err(not_lightpath_closed())
            }
            Ok(n) => n,
            Err(err) if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "lightpath: no Lightpath answer within {:?}: the server is not a Lightpath listener (or is stuck)",
                        options.handshake_timeout
                    ),
                ))
            }
            Err(err) => return Err(err),
        };
        magic.extend_from_slice(&byte[..n]);
        match match_magic(&magic, &SERVER_MAGIC) {
            MagicMatch::Mismatch if match_magic(&magic, &CLIENT_MAGIC) != MagicMatch::Mismatch => {
                return Err(invalid("the server echoed the hello back: it is not a Lightpath listener"))
            }
            MagicMatch::Mismatch => {
                let shown = String::from_utf8_lossy(&magic).escape_debug().to_string();
                return Err(invalid(format!("the server is not a Lightpath listener (it sent \"{shown}\")")));
            }
            _ => {}
        }
    }
    let mut pending = Vec::new();
    let choice = match read_message(&mut tcp, &mut pending)? {
        Message::ServerHello { choice, .. } => choice,
        Message::Error(text) => return Err(invalid(format!("the server refused: {text}"))),
        other => return Err(invalid(format!("expected the server's hello, got {:?}", other.message_type()))),
    };
    let (provider, server_endpoint) = match choice {
        Choice::Tcp(reason) => return finish_tcp(tcp, reason),
        Choice::Rdma(provider, endpoint) => (provider, endpoint),
    };
    if !providers.contains(&provider) {
        send(
            &mut tcp,
            &Message::Fallback { reason: FallbackReason::NoCommonProvider, detail: String::new() },
        )?;
        return finish_tcp(tcp, FallbackReason::NoCommonProvider);
    }
    let setup = match devices::setup(provider, &tcp, options) {
        Ok(setup) => setup,
        Err(err) => {
            send(&mut tcp, &Message::Fallback { reason: FallbackReason::NoDevice, detail: err.to_string() })?;
            return finish_tcp(tcp, FallbackReason::NoDevice);
        }
    };
    let endpoint = setup.endpoint();
    let mut conn = match tcp.try_clone().and_then(|clone| setup.connect(&server_endpoint, clone)) {
        Ok(conn) => conn,
        Err(err) => {
            send(
                &mut tcp,
                &Message::Fallback { reason: FallbackReason::SetupFailed, detail: err.to_string() },
            )?;
            return finish_tcp(tcp, FallbackReason::SetupFailed);
        }
    };
    send(&mut tcp, &Message::Connect(endpoint))?;
    match read_message(&mut tcp, &mut pending)? {
        Message::Ready => {}
        Message::Fallback { reason, .. } => return finish_tcp(tcp, reason),
        Message::Error(text) => return Err(invalid(format!("the server refused: {text}"))),
        other => return Err(invalid(format!("expected Ready, got {:?}", other.message_type()))),
    }
    if let Err(err) = conn.probe(options.probe_timeout) {
        drop(conn);
        send(&mut tcp, &Message::Fallback { reason: FallbackReason::PathFailed, detail: err.to_string() })?;
        return finish_tcp(tcp, FallbackReason::PathFailed);
    }
    send(&mut tcp, &Message::Confirm)?;
    conn.activate()?;
    Ok(Negotiated::Rdma { conn, provider })
}

fn not_lightpath_closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionRefused,
        "lightpath: the server closed the connection without answering: it is not a Lightpath listener",
    )
}

fn finish_tcp(tcp: TcpStream, reason: FallbackReason) -> io::Result<Negotiated> {
    tcp.set_read_timeout(None)?;
    Ok(tcp_outcome(tcp, reason))
}

/// What a listener does with a new TCP connection.
pub(crate) enum Accepted {
    /// A stream for the application.
    Stream(Negotiated),
    /// Nothing: the client went away or spoke garbage (it was told why, if it can parse it).
    Dropped,
}

/// The server side, on an accepted TCP stream.
pub(crate) fn server(mut tcp: TcpStream, options: &Options) -> Accepted {
    let mut magic_sent = false;
    match server_inner(&mut tcp, options, &mut magic_sent) {
        Ok(negotiated) => Accepted::Stream(negotiated),
        Err(err) => {
            if err.kind() == io::ErrorKind::InvalidData {
                // Tell the client why, in a form it parses: after the server magic.
                let mut out = if magic_sent { Vec::new() } else { SERVER_MAGIC.to_vec() };
                Message::Error(err.to_string()).emit(&mut out);
                let _ = tcp.write_all(&out);
            }
            Accepted::Dropped
        }
    }
}

fn server_inner(tcp: &mut TcpStream, options: &Options, magic_sent: &mut bool) -> io::Result<Negotiated> {
    tcp.set_nodelay(true)?;
    // Is this a Lightpath client? Read the magic; any other first byte is a plain client.
    let mut prefix = Vec::with_capacity(8);
    let started = Instant::now();
    let mut buf = [0u8; 8];
    while prefix.len() < 8 {
        let left = options.plain_client_wait.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
        tcp.set_read_timeout(Some(left))?;
        match tcp.read(&mut buf[..8 - prefix.len()]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "client left before speaking")),
            Ok(n) => prefix.extend_from_slice(&buf[..n]),
            Err(err) if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                // A client that waits for the server to speak first: plain TCP.
                tcp.set_read_timeout(None)?;
                return plain(tcp, prefix);
            }
            Err(err) => return Err(err),
        }
        if match_magic(&prefix, &CLIENT_MAGIC) == MagicMatch::Mismatch {
            tcp.set_read_timeout(None)?;
            return plain(tcp, prefix);
        }
    }
    tcp.set_read_timeout(Some(options.handshake_timeout))?;
    let mut pending = Vec::new();
    let (min_version, max_version, offered, client_host) = match read_message(tcp, &mut pending)? {
        Message::ClientHello { min_version, max_version, providers, host_id } => {
            (min_version, max_version, providers, host_id)
        }
        other => return Err(invalid(format!("expected a client hello, got {:?}", other.message_type()))),
    };
    let mut out = SERVER_MAGIC.to_vec();
    let Some(version) = pick_version(min_version, max_version) else {
        Message::ServerHello { version: VERSION, choice: Choice::Tcp(FallbackReason::VersionMismatch) }
            .emit(&mut out);
        tcp.write_all(&out)?;
        *magic_sent = true;
        return finish_tcp(tcp.try_clone()?, FallbackReason::VersionMismatch);
    };
    let fallback = |reason| Message::ServerHello { version, choice: Choice::Tcp(reason) };
    let (provider, announced, setup) = match choose_provider(tcp, options, &offered, client_host) {
        Ok(chosen) => chosen,
        Err(reason) => {
            fallback(reason).emit(&mut out);
            tcp.write_all(&out)?;
            *magic_sent = true;
            return finish_tcp(tcp.try_clone()?, reason);
        }
    };
    Message::ServerHello { version, choice: Choice::Rdma(announced, setup.endpoint()) }.emit(&mut out);
    tcp.write_all(&out)?;
    *magic_sent = true;
    let client_endpoint = match read_message(tcp, &mut pending)? {
        Message::Connect(endpoint) => endpoint,
        Message::Fallback { reason, .. } => return finish_tcp(tcp.try_clone()?, reason),
        other => return Err(invalid(format!("expected Connect, got {:?}", other.message_type()))),
    };
    let mut conn = match setup.connect(&client_endpoint, tcp.try_clone()?) {
        Ok(conn) => conn,
        Err(err) => {
            send(tcp, &Message::Fallback { reason: FallbackReason::SetupFailed, detail: err.to_string() })?;
            return finish_tcp(tcp.try_clone()?, FallbackReason::SetupFailed);
        }
    };
    send(tcp, &Message::Ready)?;
    // The probe may take up to the client's probe timeout.
    tcp.set_read_timeout(Some(options.handshake_timeout + options.probe_timeout))?;
    match read_message(tcp, &mut pending)? {
        Message::Confirm => {}
        Message::Fallback { reason, .. } => {
            drop(conn);
            return finish_tcp(tcp.try_clone()?, reason);
        }
        other => return Err(invalid(format!("expected Confirm, got {:?}", other.message_type()))),
    }
    // Anything after the confirmation is the liveness channel's (a client that closes at
    // once sends its goodbye right behind it).
    conn.take_control_bytes(pending);
    conn.activate()?;
    Ok(Negotiated::Rdma { conn, provider })
}

/// The server's pick: the first of its own providers, in its order of preference, that fits
/// the client's offer (shm only between processes of one host and namespace) and whose device
/// opens here. Returns the provider this side uses, the one the client is told to use and the
/// set-up. They differ in one case: soft and RoCE hardware speak the same RoCE v2 wire
/// protocol, so a server with an RDMA NIC serves a soft-only client from its ibverbs device.
fn choose_provider(
    tcp: &TcpStream,
    options: &Options,
    offered: &[ProviderId],
    client_host: [u8; 16],
) -> Result<(ProviderId, ProviderId, Box<dyn PendingSetup>), FallbackReason> {
    if options.providers.is_empty() || offered.is_empty() {
        return Err(FallbackReason::Disabled);
    }
    let same_host = client_host != [0; 16] && client_host == devices::shm::host_id();
    let mut candidates = Vec::new();
    for &provider in &options.providers {
        if offered.contains(&provider) && (provider != ProviderId::Shm || same_host) {
            candidates.push((provider, provider));
        } else if provider == ProviderId::Ibverbs
            && offered.contains(&ProviderId::Soft)
            && devices::ibverbs::serves_roce(tcp)
        {
            candidates.push((ProviderId::Ibverbs, ProviderId::Soft));
        }
    }
    if candidates.is_empty() {
        return Err(FallbackReason::NoCommonProvider);
    }
    candidates
        .into_iter()
        .find_map(|(local, announced)| {
            devices::setup(local, tcp, options).ok().map(|setup| (local, announced, setup))
        })
        .ok_or(FallbackReason::NoDevice)
}

fn plain(tcp: &TcpStream, prefix: Vec<u8>) -> io::Result<Negotiated> {
    Ok(Negotiated::Tcp { tcp: tcp.try_clone()?, framed: false, prefix, transport: Transport::PlainTcp })
}
