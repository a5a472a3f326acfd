//! Negotiation frames: `type (u8) | body length (u16, BE) | body`, parse and emit.

use super::endpoint::{EndpointError, ProviderId, RdmaEndpoint, ENDPOINT_LEN};

/// Largest body any message may have; a longer frame is not from a Lightpath peer.
pub const MAX_BODY: usize = 512;
/// Most providers a hello may list.
pub const MAX_PROVIDERS: usize = 8;
/// Longest explanation text carried by a fallback or error message.
pub const MAX_TEXT: usize = 256;

/// Frame type codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageType {
    /// Client's offer.
    ClientHello = 1,
    /// Server's choice.
    ServerHello = 2,
    /// Client's endpoint.
    Connect = 3,
    /// Server's queue pair is ready.
    Ready = 4,
    /// Client's probe went through: RDMA it is.
    Confirm = 5,
    /// Give up on RDMA; carry the data over this TCP connection.
    Fallback = 6,
    /// Clean close of an RDMA connection, with final counts.
    Bye = 7,
    /// Fatal error; the connection is closed.
    Error = 8,
}

impl MessageType {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => MessageType::ClientHello,
            2 => MessageType::ServerHello,
            3 => MessageType::Connect,
            4 => MessageType::Ready,
            5 => MessageType::Confirm,
            6 => MessageType::Fallback,
            7 => MessageType::Bye,
            8 => MessageType::Error,
            _ => return None,
        })
    }
}

/// Why a connection carries its data over TCP. Codes are part of the protocol; unknown
/// codes from newer peers are kept as [`FallbackReason::Other`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// The two sides have no RDMA provider in common.
    NoCommonProvider,
    /// A side's provider has no usable device.
    NoDevice,
    /// Creating or connecting the queue pair failed.
    SetupFailed,
    /// The queue pairs connected but the probe did not get through (e.g. UDP blocked).
    PathFailed,
    /// The two sides speak no common protocol version.
    VersionMismatch,
    /// A side was configured to use TCP.
    Disabled,
    /// A side is short of file descriptors: the queue pair, its memory and its wake-up fds
    /// would leave it too few for the connections it already serves.
    Resources,
    /// A reason this version does not know.
    Other(u8),
}

impl FallbackReason {
    /// The protocol code.
    pub fn code(self) -> u8 {
        match self {
            FallbackReason::NoCommonProvider => 1,
            FallbackReason::NoDevice => 2,
            FallbackReason::SetupFailed => 3,
            FallbackReason::PathFailed => 4,
            FallbackReason::VersionMismatch => 5,
            FallbackReason::Disabled => 6,
            FallbackReason::Resources => 7,
            FallbackReason::Other(code) => code,
        }
    }

    /// From the protocol code.
    pub fn from_code(code: u8) -> Self {
        match code {
            1 => FallbackReason::NoCommonProvider,
            2 => FallbackReason::NoDevice,
            3 => FallbackReason::SetupFailed,
            4 => FallbackReason::PathFailed,
            5 => FallbackReason::VersionMismatch,
            6 => FallbackReason::Disabled,
            7 => FallbackReason::Resources,
            other => FallbackReason::Other(other),
        }
    }

    /// A short description.
    pub fn describe(self) -> &'static str {
        match self {
            FallbackReason::NoCommonProvider => "no RDMA provider in common",
            FallbackReason::NoDevice => "no usable RDMA device",
            FallbackReason::SetupFailed => "queue pair set-up failed",
            FallbackReason::PathFailed => "the RDMA path did not carry a probe (blocked?)",
            FallbackReason::VersionMismatch => "no common protocol version",
            FallbackReason::Disabled => "RDMA disabled by configuration",
            FallbackReason::Resources => "short of file descriptors",
            FallbackReason::Other(_) => "a reason this version does not know",
        }
    }
}

/// A negotiation message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// The client's offer: versions and RDMA providers it can use, best first.
    ClientHello {
        /// Lowest version spoken.
        min_version: u8,
        /// Highest version spoken.
        max_version: u8,
        /// Providers, best first (unknown codes are dropped when parsed).
        providers: Vec<ProviderId>,
        /// Identifies the client's host (for same-host providers); zero if unknown.
        host_id: [u8; 16],
    },
    /// The server's choice: an RDMA provider and its endpoint, or TCP and why.
    ServerHello {
        /// Version the server speaks.
        version: u8,
        /// The choice.
        choice: Choice,
    },
    /// The client's endpoint for the chosen provider.
    Connect(RdmaEndpoint),
    /// The server's queue pair is connected and its receives are posted.
    Ready,
    /// The client's probe completed: data moves over RDMA from now on.
    Confirm,
    /// Use TCP for the data, because of `reason`.
    Fallback {
        /// Why.
        reason: FallbackReason,
        /// Details for logs.
        detail: String,
    },
    /// The sender closes cleanly: totals of what it sent over RDMA.
    Bye {
        /// Ring bytes sent.
        bytes: u64,
        /// Records sent.
        records: u64,
    },
    /// Something went wrong; the connection ends.
    Error(String),
}

/// What a server hello chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Data over RDMA with this provider; the server's endpoint.
    Rdma(ProviderId, RdmaEndpoint),
    /// Data over this TCP connection, framed (both sides speak the protocol).
    Tcp(FallbackReason),
}

/// Why bytes are not a valid message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParseError {
    /// Unknown frame type.
    Type(u8),
    /// Body longer than [`MAX_BODY`].
    TooLong(usize),
    /// The body does not fit its type.
    Body(MessageType),
    /// The endpoint is malformed.
    Endpoint(EndpointError),
    /// Text is not UTF-8.
    Text,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParseError::Type(code) => write!(f, "unknown negotiation message type {code}"),
            ParseError::TooLong(len) => write!(f, "negotiation message of {len} bytes is too long"),
            ParseError::Body(kind) => write!(f, "malformed {kind:?} message"),
            ParseError::Endpoint(err) => write!(f, "malformed RDMA endpoint ({err:?})"),
            ParseError::Text => f.write_str("negotiation text is not UTF-8"),
        }
    }
}

impl std::error::Error for ParseError {}

const CHOICE_TCP: u8 = 0;

impl Message {
    /// The frame type.
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::ClientHello { .. } => MessageType::ClientHello,
            Message::ServerHello { .. } => MessageType::ServerHello,
            Message::Connect(_) => MessageType::Connect,
            Message::Ready => MessageType::Ready,
            Message::Confirm => MessageType::Confirm,
            Message::Fallback { .. } => MessageType::Fallback,
            Message::Bye { .. } => MessageType::Bye,
            Message::Error(_) => MessageType::Error,
        }
    }

    /// Appends the frame to `out`. Texts longer than `MAX_TEXT` bytes are cut (at a
    /// character boundary) and provider lists to `MAX_PROVIDERS`.
    pub fn emit(&self, out: &mut Vec<u8>) {
        let mut body = Vec::new();
        match self {
            Message::ClientHello { min_version, max_version, providers, host_id } => {
                let providers = &providers[..providers.len().min(MAX_PROVIDERS)];
                body.extend_from_slice(&[*min_version, *max_version, providers.len() as u8]);
                body.extend(providers.iter().map(|p| p.code()));
                body.extend_from_slice(host_id);
            }
            Message::ServerHello { version, choice } => {
                body.push(*version);
                match choice {
                    Choice::Rdma(provider, endpoint) => {
                        body.push(provider.code());
                        endpoint.emit(&mut body);
                    }
                    Choice::Tcp(reason) => body.extend_from_slice(&[CHOICE_TCP, reason.code()]),
                }
            }
            Message::Connect(endpoint) => endpoint.emit(&mut body),
            Message::Ready | Message::Confirm => {}
            Message::Fallback { reason, detail } => {
                body.push(reason.code());
                body.extend_from_slice(cut_text(detail).as_bytes());
            }
            Message::Bye { bytes, records } => {
                body.extend_from_slice(&bytes.to_be_bytes());
                body.extend_from_slice(&records.to_be_bytes());
            }
            Message::Error(text) => body.extend_from_slice(cut_text(text).as_bytes()),
        }
        out.push(self.message_type() as u8);
        out.extend_from_slice(&(body.len() as u16).to_be_bytes());
        out.extend_from_slice(&body);
    }

    /// The frame as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.emit(&mut out);
        out
    }

    /// Parses one frame from the start of `bytes`: `Ok(None)` if more bytes are needed,
    /// else the message and the bytes it used. The type and length are checked as soon as the
    /// 3-byte header is there, so garbage is refused without waiting for more.
    pub fn parse(bytes: &[u8]) -> Result<Option<(Message, usize)>, ParseError> {
        let Some(&code) = bytes.first() else { return Ok(None) };
        let kind = MessageType::from_code(code).ok_or(ParseError::Type(code))?;
        let Some(len_bytes) = bytes.get(1..3) else { return Ok(None) };
        let len = usize::from(u16::from_be_bytes([len_bytes[0], len_bytes[1]]));
        if len > MAX_BODY {
            return Err(ParseError::TooLong(len));
        }
        let Some(body) = bytes.get(3..3 + len) else { return Ok(None) };
        Ok(Some((parse_body(kind, body)?, 3 + len)))
    }
}

fn cut_text(text: &str) -> &str {
    if text.len() <= MAX_TEXT {
        return text;
    }
    let mut end = MAX_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn parse_body(kind: MessageType, body: &[u8]) -> Result<Message, ParseError> {
    let bad = ParseError::Body(kind);
    let text = |bytes: &[u8]| -> Result<String, ParseError> {
        if bytes.len() > MAX_TEXT {
            return Err(bad);
        }
        String::from_utf8(bytes.to_vec()).map_err(|_| ParseError::Text)
    };
    Ok(match kind {
        MessageType::ClientHello => {
            let [min_version, max_version, count, rest @ ..] = body else { return Err(bad) };
            let count = usize::from(*count);
            if count > MAX_PROVIDERS || rest.len() != count + 16 || min_version > max_version {
                return Err(bad);
            }
            let providers = rest[..count].iter().filter_map(|&c| ProviderId::from_code(c)).collect();
            let mut host_id = [0u8; 16];
            host_id.copy_from_slice(&rest[count..]);
            Message::ClientHello { min_version: *min_version, max_version: *max_version, providers, host_id }
        }
        MessageType::ServerHello => {
            let [version, choice, rest @ ..] = body else { return Err(bad) };
            let choice = if *choice == CHOICE_TCP {
                let [reason] = rest else { return Err(bad) };
                Choice::Tcp(FallbackReason::from_code(*reason))
            } else {
                let provider = ProviderId::from_code(*choice).ok_or(bad)?;
                Choice::Rdma(provider, RdmaEndpoint::parse(rest).map_err(ParseError::Endpoint)?)
            };
            Message::ServerHello { version: *version, choice }
        }
        MessageType::Connect => {
            if body.len() != ENDPOINT_LEN {
                return Err(bad);
            }
            Message::Connect(RdmaEndpoint::parse(body).map_err(ParseError::Endpoint)?)
        }
        MessageType::Ready | MessageType::Confirm => {
            if !body.is_empty() {
                return Err(bad);
            }
            if kind == MessageType::Ready {
                Message::Ready
            } else {
                Message::Confirm
            }
        }
        MessageType::Fallback => {
            let [reason, detail @ ..] = body else { return Err(bad) };
            Message::Fallback { reason: FallbackReason::from_code(*reason), detail: text(detail)? }
        }
        MessageType::Bye => {
            let (bytes, records) = match body {
                [a @ .., _, _, _, _, _, _, _, _] if a.len() == 8 => {
                    let (first, second) = body.split_at(8);
                    (first, second)
                }
                _ => return Err(bad),
            };
            let u64_of = |b: &[u8]| u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            Message::Bye { bytes: u64_of(bytes), records: u64_of(records) }
        }
        MessageType::Error => Message::Error(text(body)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> RdmaEndpoint {
        RdmaEndpoint {
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            udp_port: 4791,
            qpn: 0x42,
            psn: 7,
            mtu: 1024,
            ring_addr: 0x1000,
            ring_len: 4096,
            ring_rkey: 9,
            credit_addr: 0x2000,
            credit_rkey: 10,
            recv_depth: 32,
        }
    }

    pub(crate) fn samples() -> Vec<Message> {
        vec![
            Message::ClientHello {
                min_version: 1,
                max_version: 1,
                providers: vec![ProviderId::Shm, ProviderId::Soft],
                host_id: [7; 16],
            },
            Message::ServerHello { version: 1, choice: Choice::Rdma(ProviderId::Soft, endpoint()) },
            Message::ServerHello { version: 1, choice: Choice::Tcp(FallbackReason::NoDevice) },
            Message::Connect(endpoint()),
            Message::Ready,
            Message::Confirm,
            Message::Fallback { reason: FallbackReason::PathFailed, detail: "probe timed out".into() },
            Message::Bye { bytes: 1 << 40, records: 12 },
            Message::Error("bad hello".into()),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for message in samples() {
            let bytes = message.to_bytes();
            assert_eq!(Message::parse(&bytes), Ok(Some((message.clone(), bytes.len()))), "{message:?}");
            for cut in 0..bytes.len() {
                assert_eq!(Message::parse(&bytes[..cut]), Ok(None), "{message:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn hello_bytes() {
        let bytes = samples()[0].to_bytes();
        assert_eq!(&bytes[..8], &[1, 0, 21, 1, 1, 2, 3, 1]);
    }

    #[test]
    fn garbage_is_refused_early() {
        assert_eq!(Message::parse(b"GET / HTTP/1.1"), Err(ParseError::Type(b'G')));
        assert_eq!(Message::parse(&[1, 0xff, 0xff]), Err(ParseError::TooLong(0xffff)));
        assert_eq!(Message::parse(&[4, 0, 1, 0]), Err(ParseError::Body(MessageType::Ready)));
        assert_eq!(Message::parse(&[8, 0, 2, 0xff, 0xfe]), Err(ParseError::Text));
        assert_eq!(Message::parse(&[1, 0, 3, 2, 1, 0]), Err(ParseError::Body(MessageType::ClientHello)));
    }

    #[test]
    fn unknown_codes_from_newer_peers() {
        let mut bytes = Message::ClientHello {
            min_version: 1,
            max_version: 2,
            providers: vec![ProviderId::Soft],
            host_id: [0; 16],
        }
        .to_bytes();
        bytes[6] = 77; // an unknown provider is skipped, not an error
        let (message, _) = Message::parse(&bytes).unwrap().unwrap();
        assert!(matches!(message, Message::ClientHello { ref providers, .. } if providers.is_empty()));
        let fallback = [6, 0, 1, 200];
        let (message, _) = Message::parse(&fallback).unwrap().unwrap();
        assert_eq!(message, Message::Fallback { reason: FallbackReason::Other(200), detail: String::new() });
    }

    #[test]
    fn long_texts_are_cut_on_emit() {
        let message = Message::Error("é".repeat(300));
        let (parsed, _) = Message::parse(&message.to_bytes()).unwrap().unwrap();
        let Message::Error(text) = parsed else { panic!("not an error message") };
        assert_eq!(text.len(), 256);
    }
}
