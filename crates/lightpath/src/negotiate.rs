//! The negotiation over a fresh TCP connection (see `docs/stream-protocol.md`): the client
//! offers providers, the server picks one and both set up queue pairs, the client probes the
//! RDMA path, and on any failure both sides keep the TCP connection for the data.
//!
//! One state machine, two drivers (the shape of rustls' connection with its blocking and
//! async I/O around it). [`Handshake`] holds where a negotiation is and does the local work
//! (opening devices, setting up and connecting queue pairs, starting the probe), but never
//! waits: it says what it needs next ([`Need`]) — bytes written, bytes read before a
//! deadline, the probe's acknowledgement — and is fed the outcome. [`client`] and [`server`]
//! drive it with blocking socket calls (the blocking [`crate::Stream`]'s connect and
//! `negotiate_server`); [`advance`] moves it on over a nonblocking socket as far as it goes,
//! the step that [`crate::Listener`]'s acceptor (one `poll` loop over every negotiation in
//! progress) and `crate::tokio` (on the runtime's reactor, so an async accept or connect never
//! occupies a thread and can be dropped at any point) both wait around.
//!
//! The machine reads exactly as many bytes as the current step needs (the magic's 8, then
//! one message at a time, whose 3-byte header says its length), so nothing the peer sends
//! after the negotiation — data over a TCP fallback, a goodbye on the liveness channel — is
//! ever taken by it.

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
    MIN_VERSION, SERVER_MAGIC, VERSION,
};

/// How a negotiation ended.
pub(crate) enum Negotiated {
    /// RDMA over `provider`.
    Rdma { conn: Box<dyn RdmaStream>, provider: ProviderId },
    /// Data over the TCP connection.
    Tcp { tcp: TcpStream, framed: bool, prefix: Vec<u8>, transport: Transport },
}

/// Bytes of a negotiation frame's header (type, body length).
const FRAME_HEADER: usize = 3;

/// What a [`Handshake`] needs from its driver next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    /// Write [`Handshake::outgoing`] (report how much went with [`Handshake::sent`]); a peer
    /// that takes nothing by `deadline` is given up ([`Handshake::write_failed`]).
    Write { deadline: Instant },
    /// Read at most `max` bytes and pass them to [`Handshake::received`] (0 bytes: the peer
    /// closed); if none come by `deadline`, call [`Handshake::timed_out`].
    Read { max: usize, deadline: Instant },
    /// Wait for the probe's acknowledgement ([`Handshake::probe_conn`]) until `deadline`,
    /// then report it with [`Handshake::probe_finished`].
    Probe { deadline: Instant },
    /// Over: [`Handshake::finish`].
    Done,
}

/// Where a negotiation is.
enum State {
    /// Client: waiting for the server's magic; `providers` is what the hello offered.
    ClientMagic { providers: Vec<ProviderId> },
    /// Client: waiting for the server's hello.
    ClientHello { providers: Vec<ProviderId> },
    /// Client: Connect sent, waiting for Ready (or a fallback).
    ClientReady { conn: Box<dyn RdmaStream>, provider: ProviderId },
    /// Client: the probe is out.
    ClientProbe { conn: Box<dyn RdmaStream>, provider: ProviderId },
    /// Server: waiting for the client's magic (a plain client never sends it).
    ServerMagic,
    /// Server: waiting for the client's hello.
    ServerHello,
    /// Server: hello answered with an endpoint (in protocol `version`), waiting for the
    /// client's Connect.
    ServerConnect { provider: ProviderId, setup: Box<dyn PendingSetup>, version: u8 },
    /// Server: Ready sent, waiting for the client's confirmation that its probe passed.
    ServerConfirm { conn: Box<dyn RdmaStream>, provider: ProviderId },
    /// Over, once `out` has gone.
    Finished(Outcome),
    /// Failed; a server still sends what is in `out` (its reason, for the client) first.
    Failed(io::Error),
    /// Taken by `finish`.
    Gone,
}

/// A finished negotiation, before the TCP connection is put back with it.
enum Outcome {
    Rdma {
        conn: Box<dyn RdmaStream>,
        provider: ProviderId,
    },
    /// Framed data over TCP between Lightpath peers (raw for a version mismatch).
    Tcp(FallbackReason),
    /// A client that does not speak Lightpath: raw TCP, its first bytes kept.
    Plain(Vec<u8>),
}

/// One side of a negotiation, as a state machine (see the module docs).
pub(crate) struct Handshake {
    state: State,
    options: Options,
    /// Bytes to send, and how many of them went.
    out: Vec<u8>,
    out_sent: usize,
    /// Bytes of the magic or message being received.
    input: Vec<u8>,
    /// When the current wait gives up.
    deadline: Instant,
    /// Server: whether its magic has gone into `out` (an error is sent after it).
    magic_sent: bool,
    /// Which side this is.
    is_client: bool,
    /// The connection's span: negotiation, provider choice and the fallback reason are
    /// reported in it.
    span: tracing::Span,
    /// Why the connection falls back to TCP, in words, when a step said more than the reason
    /// code (an error text, or the peer's detail); and whether the peer decided it.
    fallback_detail: String,
    fallback_by_peer: bool,
    /// The newest protocol version this side offers (a client) or speaks (a server).
    max_version: u8,
    /// A client that has not yet looked whether to open a device while the server works on
    /// its hello (see [`Handshake::before_waiting`]).
    warm_pending: bool,
}

/// The span of one connection, named after its side and addresses. The addresses (two
/// system calls) are asked for only when a subscriber takes the span.
fn connection_span(role: &'static str, tcp: &TcpStream) -> tracing::Span {
    let span = tracing::debug_span!(
        "lightpath_connection",
        role,
        peer = tracing::field::Empty,
        local = tracing::field::Empty
    );
    if !span.is_disabled() {
        if let Ok(peer) = tcp.peer_addr() {
            span.record("peer", tracing::field::display(peer));
        }
        if let Ok(local) = tcp.local_addr() {
            span.record("local", tracing::field::display(local));
        }
    }
    span
}

impl Handshake {
    /// The client side on a connected TCP stream: the hello is ready to be written.
    pub(crate) fn client(tcp: &TcpStream, options: &Options) -> io::Result<Handshake> {
        tcp.set_nodelay(true)?;
        let (min_version, max_version) = options.fault_versions.unwrap_or((MIN_VERSION, VERSION));
        let providers: Vec<ProviderId> =
            options.providers.iter().copied().filter(|p| devices::usable(*p, tcp)).collect();
        let mut host_id = devices::shm::host_id();
        if options.fault_other_host {
            host_id[0] ^= 0xFF;
        }
        let span = connection_span("client", tcp);
        tracing::debug!(parent: &span, offered = ?providers, "negotiation: client hello");
        let hello = Message::ClientHello { min_version, max_version, providers: providers.clone(), host_id };
        let mut out = CLIENT_MAGIC.to_vec();
        hello.emit(&mut out);
        Ok(Handshake {
            state: State::ClientMagic { providers },
            options: options.clone(),
            out,
            out_sent: 0,
            input: Vec::new(),
            deadline: Instant::now() + options.handshake_timeout,
            magic_sent: false,
            is_client: true,
            span,
            fallback_detail: String::new(),
            fallback_by_peer: false,
            max_version,
            warm_pending: true,
        })
    }

    /// The server side on an accepted TCP stream: waits for the client to speak.
    pub(crate) fn server(tcp: &TcpStream, options: &Options) -> io::Result<Handshake> {
        tcp.set_nodelay(true)?;
        Ok(Handshake {
            state: State::ServerMagic,
            options: options.clone(),
            out: Vec::new(),
            out_sent: 0,
            input: Vec::new(),
            deadline: Instant::now() + options.plain_client_wait,
            magic_sent: false,
            is_client: false,
            span: connection_span("server", tcp),
            fallback_detail: String::new(),
            fallback_by_peer: false,
            max_version: VERSION,
            warm_pending: false,
        })
    }

    /// What to do next.
    pub(crate) fn need(&self) -> Need {
        let deadline = self.deadline;
        if self.out_sent < self.out.len() {
            return Need::Write { deadline };
        }
        match &self.state {
            State::ClientMagic { .. } | State::ServerMagic => {
                Need::Read { max: CLIENT_MAGIC.len() - self.input.len(), deadline }
            }
            State::ClientHello { .. }
            | State::ClientReady { .. }
            | State::ServerHello
            | State::ServerConnect { .. }
            | State::ServerConfirm { .. } => Need::Read { max: self.frame_missing(), deadline },
            State::ClientProbe { .. } => Need::Probe { deadline },
            State::Finished(_) | State::Failed(_) | State::Gone => Need::Done,
        }
    }

    /// Bytes the frame being received still lacks, as far as its header tells.
    fn frame_missing(&self) -> usize {
        match self.input.get(1..FRAME_HEADER) {
            None => FRAME_HEADER - self.input.len(),
            Some(len) => {
                let body = usize::from(u16::from_be_bytes([len[0], len[1]]));
                (FRAME_HEADER + body).saturating_sub(self.input.len()).max(1)
            }
        }
    }

    /// The bytes to write now.
    pub(crate) fn outgoing(&self) -> &[u8] {
        &self.out[self.out_sent..]
    }

    /// `n` bytes of [`Handshake::outgoing`] were written.
    pub(crate) fn sent(&mut self, n: usize) {
        self.out_sent = (self.out_sent + n).min(self.out.len());
        if self.out_sent == self.out.len() {
            self.out.clear();
            self.out_sent = 0;
        }
    }

    /// Writing failed with `err`.
    pub(crate) fn write_failed(&mut self, err: io::Error) {
        self.out.clear();
        self.out_sent = 0;
        if matches!(self.state, State::Failed(_)) {
            // Only the reason for the peer failed to go; the failure stands.
            return;
        }
        let err = match err.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe if self.is_client => {
                not_lightpath_closed()
            }
            _ => err,
        };
        self.state = State::Failed(err);
    }

    /// Reading failed with `err` (not `WouldBlock`: the driver waits for those).
    pub(crate) fn read_failed(&mut self, err: io::Error) {
        let err = match (&self.state, err.kind()) {
            (State::ClientMagic { .. }, io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe) => {
                not_lightpath_closed()
            }
            _ => err,
        };
        self.fail(err);
    }

    /// Nothing came before the deadline [`Need::Read`] or [`Need::Probe`] named.
    pub(crate) fn timed_out(&mut self) {
        match std::mem::replace(&mut self.state, State::Gone) {
            // A client that waits for the server to speak first: plain TCP.
            State::ServerMagic => self.state = State::Finished(Outcome::Plain(std::mem::take(&mut self.input))),
            State::ClientMagic { .. } => {
                self.state = State::Failed(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "lightpath: no Lightpath answer within {:?}: the server is not a Lightpath listener (or is stuck)",
                        self.options.handshake_timeout
                    ),
                ))
            }
            State::ClientProbe { conn, provider } => {
                self.state = State::ClientProbe { conn, provider };
                self.probe_finished(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the RDMA probe was not acknowledged",
                )));
            }
            other => {
                self.state = other;
                self.fail(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "lightpath: the peer stopped answering during negotiation",
                ));
            }
        }
    }

    /// Called by the drivers before they wait to read: a client whose hello has gone opens
    /// the device of the provider the server will likely pick, if none is open yet, so that a
    /// process's first connection opens it while the server opens its own (each took 0.3 to
    /// 0.5 ms on this VM) rather than after the server's answer. A wrong guess costs a device
    /// that stays unused; errors are left for the real set-up to meet.
    pub(crate) fn before_waiting(&mut self, tcp: &TcpStream) {
        if !self.warm_pending || !self.out.is_empty() {
            return;
        }
        self.warm_pending = false;
        if let State::ClientMagic { providers } = &self.state {
            devices::warm_likely_pick(providers, tcp, &self.options);
        }
    }

    /// Bytes read from the peer; empty means it closed the connection. Does the local work
    /// the step calls for (device set-up, queue-pair connection) on `tcp`.
    pub(crate) fn received(&mut self, bytes: &[u8], tcp: &TcpStream) {
        if bytes.is_empty() {
            let err = match self.state {
                State::ClientMagic { .. } => not_lightpath_closed(),
                State::ServerMagic => {
                    io::Error::new(io::ErrorKind::UnexpectedEof, "lightpath: the client left before speaking")
                }
                _ => io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "lightpath: the peer closed the connection during negotiation",
                ),
            };
            return self.fail(err);
        }
        self.input.extend_from_slice(bytes);
        if let Err(err) = self.step(tcp) {
            self.fail(err);
        }
    }

    /// Ends the negotiation with `err`. A server tells a client that spoke garbage why, in a
    /// form the client parses (after the server magic).
    fn fail(&mut self, err: io::Error) {
        if matches!(self.state, State::Failed(_)) {
            return;
        }
        self.out.clear();
        self.out_sent = 0;
        if !self.is_client && err.kind() == io::ErrorKind::InvalidData {
            if !self.magic_sent {
                self.out.extend_from_slice(&SERVER_MAGIC);
            }
            Message::Error(err.to_string()).emit(&mut self.out);
        }
        self.state = State::Failed(err);
    }

    fn send(&mut self, message: &Message) {
        message.emit(&mut self.out);
    }

    /// The message now complete in `input`, if it is.
    fn take_message(&mut self) -> io::Result<Option<Message>> {
        match Message::parse(&self.input) {
            Ok(Some((message, used))) => {
                self.input.drain(..used);
                Ok(Some(message))
            }
            Ok(None) => Ok(None),
            Err(err) => Err(invalid(format!("negotiation: {err}"))),
        }
    }

    /// Advances as far as the bytes received allow.
    fn step(&mut self, tcp: &TcpStream) -> io::Result<()> {
        // Device set-up and queue-pair events of this step belong to the connection.
        let span = self.span.clone();
        let _entered = span.enter();
        let state = std::mem::replace(&mut self.state, State::Gone);
        self.state = match state {
            State::ClientMagic { providers } => match match_magic(&self.input, &SERVER_MAGIC) {
                MagicMatch::Mismatch if match_magic(&self.input, &CLIENT_MAGIC) != MagicMatch::Mismatch => {
                    return Err(invalid("the server echoed the hello back: it is not a Lightpath listener"))
                }
                MagicMatch::Mismatch => {
                    let shown = String::from_utf8_lossy(&self.input).escape_debug().to_string();
                    return Err(invalid(format!(
                        "the server is not a Lightpath listener (it sent \"{shown}\")"
                    )));
                }
                MagicMatch::Partial => State::ClientMagic { providers },
                MagicMatch::Complete => {
                    self.input.clear();
                    State::ClientHello { providers }
                }
            },
            State::ClientHello { providers } => match self.take_message()? {
                None => State::ClientHello { providers },
                Some(message) => self.client_hello_answered(message, providers, tcp)?,
            },
            State::ClientReady { conn, provider } => match self.take_message()? {
                None => State::ClientReady { conn, provider },
                // Between shm devices the path is proven already: the queue pair's introduction
                // reached the server's device over its Unix socket (same host and network
                // namespace, same user), and whatever is posted waits for the server's own
                // introduction. The probe would only wait for the helper threads to apply it
                // (a wake-up chain through both processes per connection).
                Some(Message::Ready) if provider == ProviderId::Shm => {
                    let mut conn = conn;
                    conn.activate()?;
                    self.send(&Message::Confirm);
                    State::Finished(Outcome::Rdma { conn, provider })
                }
                Some(Message::Ready) => {
                    let mut conn = conn;
                    conn.start_probe()?;
                    self.deadline = Instant::now() + self.options.probe_timeout;
                    State::ClientProbe { conn, provider }
                }
                Some(Message::Fallback { reason, detail }) => self.peer_fell_back(reason, detail),
                Some(Message::Error(text)) => return Err(invalid(format!("the server refused: {text}"))),
                Some(other) => {
                    return Err(invalid(format!("expected Ready, got {:?}", other.message_type())))
                }
            },
            State::ServerMagic => match match_magic(&self.input, &CLIENT_MAGIC) {
                // Any other first bytes: a plain client.
                MagicMatch::Mismatch => State::Finished(Outcome::Plain(std::mem::take(&mut self.input))),
                MagicMatch::Partial => State::ServerMagic,
                MagicMatch::Complete => {
                    self.input.clear();
                    self.deadline = Instant::now() + self.options.handshake_timeout;
                    State::ServerHello
                }
            },
            State::ServerHello => match self.take_message()? {
                None => State::ServerHello,
                Some(Message::ClientHello { min_version, max_version, providers, host_id }) => {
                    self.server_hello(min_version, max_version, &providers, host_id, tcp)
                }
                Some(other) => {
                    return Err(invalid(format!("expected a client hello, got {:?}", other.message_type())))
                }
            },
            State::ServerConnect { provider, setup, version } => match self.take_message()? {
                None => State::ServerConnect { provider, setup, version },
                Some(Message::Connect(endpoint)) => {
                    match tcp.try_clone().and_then(|clone| setup.connect(&endpoint, clone, version)) {
                        Ok(conn) => {
                            self.send(&Message::Ready);
                            // The client's probe may take up to its probe timeout.
                            self.deadline =
                                Instant::now() + self.options.handshake_timeout + self.options.probe_timeout;
                            State::ServerConfirm { conn, provider }
                        }
                        Err(err) => {
                            self.fallback_detail = err.to_string();
                            self.send(&Message::Fallback {
                                reason: FallbackReason::SetupFailed,
                                detail: err.to_string(),
                            });
                            State::Finished(Outcome::Tcp(FallbackReason::SetupFailed))
                        }
                    }
                }
                Some(Message::Fallback { reason, detail }) => self.peer_fell_back(reason, detail),
                Some(other) => {
                    return Err(invalid(format!("expected Connect, got {:?}", other.message_type())))
                }
            },
            State::ServerConfirm { conn, provider } => match self.take_message()? {
                None => State::ServerConfirm { conn, provider },
                Some(Message::Confirm) => {
                    let mut conn = conn;
                    conn.activate()?;
                    State::Finished(Outcome::Rdma { conn, provider })
                }
                Some(Message::Fallback { reason, detail }) => self.peer_fell_back(reason, detail),
                Some(other) => {
                    return Err(invalid(format!("expected Confirm, got {:?}", other.message_type())))
                }
            },
            other => other,
        };
        Ok(())
    }

    /// The client's step after the server's hello: TCP, or a queue pair connected to the
    /// server's and the Connect message.
    fn client_hello_answered(
        &mut self,
        message: Message,
        providers: Vec<ProviderId>,
        tcp: &TcpStream,
    ) -> io::Result<State> {
        let (provider, server_endpoint, version) = match message {
            Message::ServerHello { choice: Choice::Tcp(reason), .. } => {
                return Ok(self.peer_fell_back(reason, String::new()))
            }
            Message::ServerHello { choice: Choice::Rdma(provider, endpoint), version } => {
                (provider, endpoint, version)
            }
            Message::Error(text) => return Err(invalid(format!("the server refused: {text}"))),
            other => {
                return Err(invalid(format!("expected the server's hello, got {:?}", other.message_type())))
            }
        };
        tracing::debug!(parent: &self.span, ?provider, "negotiation: the server chose a provider");
        let fallback = |handshake: &mut Handshake, reason, detail: String| {
            handshake.fallback_detail.clone_from(&detail);
            handshake.send(&Message::Fallback { reason, detail });
            State::Finished(Outcome::Tcp(reason))
        };
        if !providers.contains(&provider) {
            return Ok(fallback(self, FallbackReason::NoCommonProvider, String::new()));
        }
        if devices::short_of_descriptors(tcp) {
            let detail = "the client keeps its last file descriptors for its established connections";
            return Ok(fallback(self, FallbackReason::Resources, detail.into()));
        }
        // A server that advertises no UDP port is hardware (ibverbs, announced as soft): it
        // always sends to the RoCE v2 port, so the soft side uses its device on that port and
        // its queue pair takes no port of its own (the peer could not address it, and
        // libibverbs refuses any other port).
        let set_up = if provider == ProviderId::Soft && server_endpoint.udp_port == 0 {
            devices::setup_towards_hardware(tcp, &self.options)
        } else {
            devices::setup(provider, tcp, &self.options)
        };
        let setup = match set_up {
            Ok(setup) => setup,
            Err(err) => return Ok(fallback(self, FallbackReason::NoDevice, err.to_string())),
        };
        let endpoint = setup.endpoint();
        // The server picked the version; one this side did not offer (above its newest) gets
        // nothing newer than the oldest, as it did when only bundles depended on it.
        let version = if version <= self.max_version { version } else { MIN_VERSION };
        match tcp.try_clone().and_then(|clone| setup.connect(&server_endpoint, clone, version)) {
            Ok(conn) => {
                self.send(&Message::Connect(endpoint));
                self.deadline = Instant::now() + self.options.handshake_timeout;
                Ok(State::ClientReady { conn, provider })
            }
            Err(err) => Ok(fallback(self, FallbackReason::SetupFailed, err.to_string())),
        }
    }

    /// The server's answer to a client hello.
    fn server_hello(
        &mut self,
        min_version: u8,
        max_version: u8,
        offered: &[ProviderId],
        client_host: [u8; 16],
        tcp: &TcpStream,
    ) -> State {
        self.out.extend_from_slice(&SERVER_MAGIC);
        self.magic_sent = true;
        let Some(version) = pick_version(min_version, max_version) else {
            let reason = FallbackReason::VersionMismatch;
            self.send(&Message::ServerHello { version: VERSION, choice: Choice::Tcp(reason) });
            return State::Finished(Outcome::Tcp(reason));
        };
        match choose_provider(tcp, &self.options, offered, client_host) {
            Ok((provider, announced, setup)) => {
                tracing::debug!(
                    parent: &self.span,
                    ?offered,
                    ?provider,
                    ?announced,
                    "negotiation: provider chosen"
                );
                self.send(&Message::ServerHello {
                    version,
                    choice: Choice::Rdma(announced, setup.endpoint()),
                });
                self.deadline = Instant::now() + self.options.handshake_timeout;
                State::ServerConnect { provider, setup, version }
            }
            Err(reason) => {
                self.send(&Message::ServerHello { version, choice: Choice::Tcp(reason) });
                State::Finished(Outcome::Tcp(reason))
            }
        }
    }

    /// The connection whose probe [`Need::Probe`] waits for.
    pub(crate) fn probe_conn(&mut self) -> Option<&mut Box<dyn RdmaStream>> {
        match &mut self.state {
            State::ClientProbe { conn, .. } => Some(conn),
            _ => None,
        }
    }

    /// The probe's outcome: on success the client confirms and the connection is ready; on
    /// failure both sides fall back to TCP.
    pub(crate) fn probe_finished(&mut self, result: io::Result<()>) {
        let span = self.span.clone();
        let _entered = span.enter();
        let State::ClientProbe { mut conn, provider } = std::mem::replace(&mut self.state, State::Gone)
        else {
            return;
        };
        self.state = match result.and_then(|()| conn.activate()) {
            Ok(()) => {
                self.send(&Message::Confirm);
                State::Finished(Outcome::Rdma { conn, provider })
            }
            Err(err) => {
                drop(conn);
                self.fallback_detail = err.to_string();
                self.send(&Message::Fallback { reason: FallbackReason::PathFailed, detail: err.to_string() });
                State::Finished(Outcome::Tcp(FallbackReason::PathFailed))
            }
        };
    }

    /// The peer decided to fall back (its hello or a Fallback message).
    fn peer_fell_back(&mut self, reason: FallbackReason, detail: String) -> State {
        self.fallback_detail = detail;
        self.fallback_by_peer = true;
        State::Finished(Outcome::Tcp(reason))
    }

    /// Reports how the negotiation ended, in the connection's span.
    fn report_outcome(&self) {
        let _entered = self.span.enter();
        match &self.state {
            State::Finished(Outcome::Rdma { provider, .. }) => {
                tracing::debug!(?provider, "negotiation: RDMA connection ready")
            }
            State::Finished(Outcome::Tcp(FallbackReason::Disabled)) => tracing::debug!(
                reason = ?FallbackReason::Disabled,
                by_peer = self.fallback_by_peer,
                "negotiation: data goes over TCP (RDMA is disabled)"
            ),
            State::Finished(Outcome::Tcp(reason)) => tracing::info!(
                ?reason,
                detail = %self.fallback_detail,
                by_peer = self.fallback_by_peer,
                "negotiation: falling back to TCP"
            ),
            State::Finished(Outcome::Plain(_)) => {
                tracing::debug!("negotiation: the client does not speak Lightpath; plain TCP")
            }
            State::Failed(err) => tracing::debug!(error = %err, "negotiation failed"),
            _ => {}
        }
    }

    /// The result, with the TCP connection the driver used (call at [`Need::Done`]).
    pub(crate) fn finish(mut self, tcp: TcpStream) -> io::Result<Negotiated> {
        self.report_outcome();
        match std::mem::replace(&mut self.state, State::Gone) {
            State::Finished(Outcome::Rdma { conn, provider }) => Ok(Negotiated::Rdma { conn, provider }),
            State::Finished(Outcome::Tcp(reason)) => {
                tcp.set_read_timeout(None)?;
                let framed = reason != FallbackReason::VersionMismatch;
                let transport = if framed { Transport::Tcp(reason) } else { Transport::PlainTcp };
                Ok(Negotiated::Tcp { tcp, framed, prefix: Vec::new(), transport })
            }
            State::Finished(Outcome::Plain(prefix)) => {
                tcp.set_read_timeout(None)?;
                Ok(Negotiated::Tcp { tcp, framed: false, prefix, transport: Transport::PlainTcp })
            }
            State::Failed(err) => Err(err),
            _ => Err(io::Error::other("lightpath: the negotiation was finished before its end")),
        }
    }
}

fn not_lightpath_closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionRefused,
        "lightpath: the server closed the connection without answering: it is not a Lightpath listener, \
         or one out of file descriptors (which turns new clients away so)",
    )
}

/// What a negotiation moved on by [`advance`] needs before it can go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Advanced {
    /// Its socket writable (`write`) or readable before `deadline` (past it, the next
    /// `advance` gives up on the peer).
    Wait { write: bool, deadline: Instant },
    /// The probe's acknowledgement before `deadline` ([`Handshake::probe_conn`], then
    /// [`Handshake::probe_finished`]; a client's only).
    Probe { deadline: Instant },
    /// Over: [`Handshake::finish`].
    Done,
}

/// Moves `handshake` on over the nonblocking `tcp` as far as it goes without waiting: the
/// step the acceptor's `poll` loop and the tokio driver share, each waiting its own way for
/// what it returns. A read or write that would block past the step's deadline ends the
/// negotiation as the blocking driver's timeout does.
pub(crate) fn advance(handshake: &mut Handshake, tcp: &TcpStream) -> Advanced {
    let mut chunk = [0u8; 512];
    loop {
        match handshake.need() {
            Need::Write { deadline } => match (&*tcp).write(handshake.outgoing()) {
                Ok(n) => handshake.sent(n),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() < deadline {
                        return Advanced::Wait { write: true, deadline };
                    }
                    handshake.write_failed(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "lightpath: the peer took nothing during negotiation",
                    ));
                }
                Err(err) => handshake.write_failed(err),
            },
            Need::Read { max, deadline } => match (&*tcp).read(&mut chunk[..max.min(512)]) {
                Ok(n) => handshake.received(&chunk[..n], tcp),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() < deadline {
                        handshake.before_waiting(tcp);
                        return Advanced::Wait { write: false, deadline };
                    }
                    handshake.timed_out();
                }
                Err(err) => handshake.read_failed(err),
            },
            Need::Probe { deadline } => return Advanced::Probe { deadline },
            Need::Done => return Advanced::Done,
        }
    }
}

/// A socket timeout for the blocking driver's calls (`SO_RCVTIMEO` or `SO_SNDTIMEO`), kept
/// while it ends a call that starts now within [`CallTimeout::SLACK`] of the step's deadline.
/// Set before every call, it cost a `setsockopt` each (about eight per connection); kept, it
/// is set once per direction, as a step's deadline moves by the microseconds between two
/// steps. (A call whose timeout expires before the deadline is tried again with the timeout
/// set anew.)
#[derive(Default)]
struct CallTimeout(Option<Duration>);

impl CallTimeout {
    const SLACK: Duration = Duration::from_millis(50);

    /// Makes sure a call starting now gives up at `deadline`, give or take the slack, with
    /// `set` (the socket's setter) if the timeout in place does not.
    fn cover(
        &mut self,
        deadline: Instant,
        set: impl FnOnce(Option<Duration>) -> io::Result<()>,
    ) -> io::Result<()> {
        let now = Instant::now();
        let fits = self.0.is_some_and(|t| {
            let ends = now + t;
            ends + Self::SLACK >= deadline && ends <= deadline + Self::SLACK
        });
        if !fits {
            let left = deadline.saturating_duration_since(now).max(Duration::from_millis(1));
            set(Some(left))?;
            self.0 = Some(left);
        }
        Ok(())
    }
}

/// Whether a blocking call's error is its socket timeout expiring.
fn timeout_expired(err: &io::Error) -> bool {
    matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Runs `handshake` to its end with blocking calls on `tcp`.
fn drive_blocking(mut handshake: Handshake, mut tcp: TcpStream) -> io::Result<Negotiated> {
    let mut chunk = [0u8; 512];
    let (mut read_timeout, mut write_timeout) = (CallTimeout::default(), CallTimeout::default());
    loop {
        match handshake.need() {
            Need::Write { deadline } => {
                write_timeout.cover(deadline, |t| tcp.set_write_timeout(t))?;
                match tcp.write(handshake.outgoing()) {
                    Ok(n) => handshake.sent(n),
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                    // A timeout set for an earlier deadline: set it again.
                    Err(err) if timeout_expired(&err) && Instant::now() < deadline => write_timeout.0 = None,
                    Err(err) => handshake.write_failed(err),
                }
            }
            Need::Read { max, deadline } => {
                handshake.before_waiting(&tcp);
                if deadline <= Instant::now() {
                    handshake.timed_out();
                    continue;
                }
                read_timeout.cover(deadline, |t| tcp.set_read_timeout(t))?;
                let max = max.min(chunk.len());
                match tcp.read(&mut chunk[..max]) {
                    Ok(n) => handshake.received(&chunk[..n], &tcp),
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                    Err(err) if timeout_expired(&err) && Instant::now() < deadline => read_timeout.0 = None,
                    Err(err) if timeout_expired(&err) => handshake.timed_out(),
                    Err(err) => handshake.read_failed(err),
                }
            }
            Need::Probe { deadline } => {
                let left = deadline.saturating_duration_since(Instant::now());
                let result = match handshake.probe_conn() {
                    Some(conn) => conn.wait_probe(left),
                    None => Err(io::Error::other("lightpath: no probe to wait for")),
                };
                handshake.probe_finished(result);
            }
            Need::Done => {
                if write_timeout.0.is_some() {
                    tcp.set_write_timeout(None)?;
                }
                return handshake.finish(tcp);
            }
        }
    }
}

/// The client side, on a connected TCP stream (blocking).
pub(crate) fn client(tcp: TcpStream, options: &Options) -> io::Result<Negotiated> {
    let handshake = Handshake::client(&tcp, options)?;
    drive_blocking(handshake, tcp)
}

/// What a listener does with a new TCP connection.
pub(crate) enum Accepted {
    /// A stream for the application.
    Stream(Negotiated),
    /// Nothing: the client went away or spoke garbage (it was told why, if it can parse it).
    Dropped,
}

/// The server side, on an accepted TCP stream (blocking).
pub(crate) fn server(tcp: TcpStream, options: &Options) -> Accepted {
    match Handshake::server(&tcp, options).and_then(|handshake| drive_blocking(handshake, tcp)) {
        Ok(negotiated) => Accepted::Stream(negotiated),
        Err(_) => Accepted::Dropped,
    }
}

/// The server's pick: the first of its own providers, in its order of preference, that fits
/// the client's offer (shm only between processes of one host and namespace) and whose device
/// opens here. Returns the provider this side uses, the one the client is told to use and the
/// set-up. They differ where soft meets RoCE hardware, which speak the same RoCE v2 wire
/// protocol: a server with an RDMA NIC serves a soft-only client from its ibverbs device, and
/// a soft server serves a client whose ibverbs device serves the route (the client offers
/// ibverbs only then: `devices::usable`) from its soft device, when the client ranks ibverbs
/// above soft or offers no soft. Hardware sends to the RoCE v2 port only, so the soft side then
/// takes no port of its own, and is skipped if its device could not bind that port.
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
    let candidates =
        provider_candidates(&options.providers, offered, same_host, || devices::ibverbs::serves_roce(tcp));
    if candidates.is_empty() {
        return Err(FallbackReason::NoCommonProvider);
    }
    if devices::short_of_descriptors(tcp) {
        return Err(FallbackReason::Resources);
    }
    candidates
        .into_iter()
        .find_map(|(local, announced)| {
            if local == ProviderId::Soft && announced == ProviderId::Ibverbs {
                let setup = devices::setup_towards_hardware(tcp, options).ok()?;
                let reachable = setup.endpoint().udp_port == lightpath_soft::ROCE_PORT;
                return reachable.then_some((local, announced, setup));
            }
            devices::setup(local, tcp, options).ok().map(|setup| (local, announced, setup))
        })
        .ok_or(FallbackReason::NoDevice)
}

/// The (this side's, the client's) provider pairs a server tries, best first: its own
/// providers in its order that the client offered (shm only on one host), and the pairs where
/// soft meets RoCE hardware (see [`choose_provider`]). `serves_roce`: whether this side's
/// ibverbs device serves the connection's route with a RoCE port.
fn provider_candidates(
    ours: &[ProviderId],
    offered: &[ProviderId],
    same_host: bool,
    serves_roce: impl Fn() -> bool,
) -> Vec<(ProviderId, ProviderId)> {
    let rank = |wanted: ProviderId| offered.iter().position(|&p| p == wanted);
    // A soft server and a client with RoCE hardware: the client's device where the client
    // ranks it first (or has no soft); the client's soft device otherwise, or if that fails.
    let hardware_first = rank(ProviderId::Ibverbs)
        .is_some_and(|hardware| rank(ProviderId::Soft).is_none_or(|soft| hardware < soft));
    let mut candidates = Vec::new();
    for &provider in ours {
        if provider == ProviderId::Soft && hardware_first {
            candidates.push((ProviderId::Soft, ProviderId::Ibverbs));
        }
        if offered.contains(&provider) && (provider != ProviderId::Shm || same_host) {
            candidates.push((provider, provider));
        } else if provider == ProviderId::Ibverbs && offered.contains(&ProviderId::Soft) && serves_roce() {
            candidates.push((ProviderId::Ibverbs, ProviderId::Soft));
        }
    }
    candidates
}

#[cfg(test)]
mod tests {
    //! The state machine on its own: bytes fed by hand, no driver. The sockets only serve the
    //! local look-ups (addresses, `set_nodelay`); nothing is sent over them.
    use super::*;
    use lightpath_stream::negotiate::RdmaEndpoint;
    use lightpath_verbs::Gid;

    /// Covers `deadline` with `timeout`; the timeout it had to set, if any.
    fn set_for(timeout: &mut CallTimeout, deadline: Instant) -> Option<Duration> {
        let mut set = None;
        timeout
            .cover(deadline, |t| {
                set = t;
                Ok(())
            })
            .unwrap();
        set
    }

    #[test]
    fn a_call_timeout_is_set_once_while_deadlines_move_by_little() {
        let mut timeout = CallTimeout::default();
        let first = Instant::now() + Duration::from_secs(5);
        assert!(set_for(&mut timeout, first).is_some(), "nothing was set");
        // The next step's deadline, microseconds later: the timeout in place still fits.
        assert_eq!(
            set_for(&mut timeout, first + Duration::from_millis(1)),
            None,
            "set again for a deadline within the slack"
        );
        // A much later deadline (the call would give up too early) or a much earlier one (too
        // late): set again, to what is left.
        assert!(set_for(&mut timeout, first + Duration::from_secs(2)).is_some());
        let left = set_for(&mut timeout, Instant::now() + Duration::from_secs(1)).expect("set again");
        assert!(left <= Duration::from_secs(1) && left > Duration::from_millis(900), "{left:?}");
        // A failed set leaves nothing recorded, so the next call tries again.
        let mut failing = CallTimeout::default();
        assert!(failing.cover(first, |_| Err(io::Error::other("no"))).is_err());
        assert!(failing.0.is_none());
    }

    /// Both ends of a loopback TCP connection.
    fn sockets() -> (TcpStream, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    /// Writes everything the machine has to send; returns it.
    fn drain_out(handshake: &mut Handshake) -> Vec<u8> {
        let mut out = Vec::new();
        while let Need::Write { .. } = handshake.need() {
            out.extend_from_slice(handshake.outgoing());
            let n = handshake.outgoing().len();
            handshake.sent(n);
        }
        out
    }

    #[test]
    fn the_server_reads_exactly_one_frame_at_a_time_and_falls_back_when_rdma_is_off() {
        let (_client, server) = sockets();
        let mut handshake = Handshake::server(&server, &Options::tcp_only()).unwrap();
        assert!(matches!(handshake.need(), Need::Read { max: 8, .. }));
        handshake.received(&CLIENT_MAGIC[..3], &server);
        assert!(matches!(handshake.need(), Need::Read { max: 5, .. }), "the rest of the magic only");
        handshake.received(&CLIENT_MAGIC[3..], &server);
        let mut hello = Vec::new();
        Message::ClientHello {
            min_version: VERSION,
            max_version: VERSION,
            providers: vec![],
            host_id: [0; 16],
        }
        .emit(&mut hello);
        assert!(matches!(handshake.need(), Need::Read { max: FRAME_HEADER, .. }), "a frame header first");
        handshake.received(&hello[..FRAME_HEADER], &server);
        let body = hello.len() - FRAME_HEADER;
        assert!(
            matches!(handshake.need(), Need::Read { max, .. } if max == body),
            "then exactly the body: {:?}",
            handshake.need()
        );
        handshake.received(&hello[FRAME_HEADER..], &server);
        let out = drain_out(&mut handshake);
        assert!(out.starts_with(&SERVER_MAGIC));
        let (answer, used) = Message::parse(&out[8..]).unwrap().unwrap();
        assert_eq!(used, out.len() - 8);
        assert!(matches!(answer, Message::ServerHello { choice: Choice::Tcp(FallbackReason::Disabled), .. }));
        assert_eq!(handshake.need(), Need::Done);
        match handshake.finish(server).unwrap() {
            Negotiated::Tcp { framed, prefix, transport, .. } => {
                assert!(framed);
                assert!(prefix.is_empty());
                assert_eq!(transport, Transport::Tcp(FallbackReason::Disabled));
            }
            Negotiated::Rdma { .. } => panic!("RDMA was off"),
        }
    }

    #[test]
    fn a_plain_client_is_known_by_its_first_byte_or_its_silence() {
        let (_client, server) = sockets();
        let mut speaks = Handshake::server(&server, &Options::default()).unwrap();
        speaks.received(b"GET ", &server);
        assert_eq!(speaks.need(), Need::Done);
        match speaks.finish(server.try_clone().unwrap()).unwrap() {
            Negotiated::Tcp { framed, prefix, transport, .. } => {
                assert!(!framed);
                assert_eq!(prefix, b"GET ");
                assert_eq!(transport, Transport::PlainTcp);
            }
            Negotiated::Rdma { .. } => panic!("a plain client"),
        }
        let mut silent = Handshake::server(&server, &Options::default()).unwrap();
        silent.received(&CLIENT_MAGIC[..2], &server);
        silent.timed_out();
        assert_eq!(silent.need(), Need::Done);
        match silent.finish(server).unwrap() {
            Negotiated::Tcp { prefix, transport, .. } => {
                assert_eq!(prefix, &CLIENT_MAGIC[..2]);
                assert_eq!(transport, Transport::PlainTcp);
            }
            Negotiated::Rdma { .. } => panic!("a plain client"),
        }
    }

    #[test]
    fn garbage_after_the_magic_is_answered_with_the_reason_and_fails() {
        let (_client, server) = sockets();
        let mut handshake = Handshake::server(&server, &Options::default()).unwrap();
        handshake.received(&CLIENT_MAGIC, &server);
        handshake.received(&[0xff, 0, 1], &server);
        let out = drain_out(&mut handshake);
        assert!(out.starts_with(&SERVER_MAGIC), "the reason follows the server magic");
        assert!(matches!(Message::parse(&out[8..]), Ok(Some((Message::Error(_), _)))), "{out:?}");
        assert_eq!(handshake.need(), Need::Done);
        let err = handshake.finish(server).err().expect("a failed negotiation");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    /// The UDP port a soft client tells a server whose hello carries `server_udp_port`.
    fn soft_client_port_towards(server_udp_port: u16) -> u16 {
        let (client, _server) = sockets();
        let options =
            Options { providers: vec![ProviderId::Soft], soft_qp_port: Some(true), ..Options::default() };
        let mut handshake = Handshake::client(&client, &options).unwrap();
        drain_out(&mut handshake);
        handshake.received(&SERVER_MAGIC, &client);
        let server = RdmaEndpoint {
            gid: Gid::from_ip("127.0.0.1".parse().unwrap()).0,
            udp_port: server_udp_port,
            qpn: 0x11,
            psn: 1,
            mtu: 1024,
            ring_addr: 0x1000,
            ring_len: 1 << 16,
            ring_rkey: 7,
            credit_addr: 0x800,
            credit_rkey: 7,
            recv_depth: 16,
        };
        let mut hello = Vec::new();
        Message::ServerHello { version: VERSION, choice: Choice::Rdma(ProviderId::Soft, server) }
            .emit(&mut hello);
        handshake.received(&hello, &client);
        let out = drain_out(&mut handshake);
        match Message::parse(&out) {
            Ok(Some((Message::Connect(endpoint), _))) => endpoint.udp_port,
            other => panic!("expected Connect, got {other:?}"),
        }
    }

    #[test]
    fn a_soft_client_takes_a_port_of_its_own_only_towards_a_soft_server() {
        // Towards hardware (ibverbs announced as soft: no UDP port in its hello) the client is
        // reached at its device's port, the same for every connection; libibverbs could not
        // address any other.
        let hardware = soft_client_port_towards(0);
        assert_ne!(hardware, 0);
        assert_eq!(soft_client_port_towards(0), hardware, "the device's port both times");
        // Towards a soft server it names a port of its own.
        let own = soft_client_port_towards(lightpath_soft::ROCE_PORT);
        assert_ne!(own, hardware, "a port of its own, not the device's");
    }

    #[test]
    fn soft_and_roce_hardware_meet_on_either_side() {
        use ProviderId::{Ibverbs, Shm, Soft};
        let all = [Shm, Ibverbs, Soft];
        let roce = || true;
        let no_roce = || false;
        // A soft-only server (its ibverbs device absent) and a client with hardware: the
        // client's device first, its soft device if the pair cannot be set up.
        assert_eq!(
            provider_candidates(&all, &[Ibverbs, Soft], false, no_roce),
            [(Ibverbs, Ibverbs), (Soft, Ibverbs), (Soft, Soft)]
        );
        assert_eq!(provider_candidates(&[Soft], &[Ibverbs], false, no_roce), [(Soft, Ibverbs)]);
        // The client ranks its soft device first: soft on both sides.
        assert_eq!(provider_candidates(&[Soft], &[Soft, Ibverbs], false, no_roce), [(Soft, Soft)]);
        // A client without hardware: soft meets soft, or the server's RoCE device.
        assert_eq!(provider_candidates(&[Soft], &[Shm, Soft], false, roce), [(Soft, Soft)]);
        assert_eq!(provider_candidates(&[Ibverbs], &[Soft], false, roce), [(Ibverbs, Soft)]);
        assert_eq!(provider_candidates(&[Ibverbs], &[Soft], false, no_roce), []);
        // shm only on one host.
        assert_eq!(provider_candidates(&[Shm], &[Shm], false, roce), []);
        assert_eq!(provider_candidates(&[Shm, Soft], &[Shm, Soft], true, roce), [(Shm, Shm), (Soft, Soft)]);
    }

    #[test]
    fn a_client_knows_an_echo_server_and_a_server_that_closes() {
        let (client, _server) = sockets();
        let mut echoed = Handshake::client(&client, &Options::tcp_only()).unwrap();
        let hello = drain_out(&mut echoed);
        assert!(hello.starts_with(&CLIENT_MAGIC));
        // The magics differ only in their last byte.
        echoed.received(&hello[..8], &client);
        assert_eq!(echoed.need(), Need::Done);
        let err = echoed.finish(client.try_clone().unwrap()).err().expect("an echo is no answer");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("echoed"), "{err}");

        let mut closed = Handshake::client(&client, &Options::tcp_only()).unwrap();
        drain_out(&mut closed);
        closed.received(&[], &client);
        let err = closed.finish(client).err().expect("no answer");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    }
}
