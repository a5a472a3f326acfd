//! Helpers shared by the facade's integration tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use lightpath::{Listener, Options, ProviderId, Stream};

/// Deterministic test bytes.
pub fn pattern(len: usize, salt: u32) -> Vec<u8> {
    let mut x = salt.wrapping_mul(2654435761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// FNV-1a, enough to compare large transfers.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3))
}

/// Options that offer (and accept) shm alone.
pub fn shm() -> Options {
    Options::default().with_providers(&[ProviderId::Shm])
}

/// Options that offer (and accept) soft alone.
pub fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

/// A body's length and CRC-32, as the HTTP tests' servers answer it.
pub fn digest(body: &[u8]) -> String {
    format!("{} {:08x}", body.len(), crc32fast::hash(body))
}

/// A listener on an ephemeral loopback port.
pub fn listener(options: Options) -> Listener {
    Listener::bind_with("127.0.0.1:0", options).expect("bind")
}

/// A server thread that echoes every byte of each accepted stream until EOF, `count` times.
pub fn echo_server(listener: Listener, count: usize) -> JoinHandle<Vec<lightpath::Transport>> {
    std::thread::spawn(move || {
        let mut transports = Vec::new();
        for _ in 0..count {
            let (mut stream, _) = listener.accept().expect("accept");
            transports.push(stream.transport());
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = stream.read(&mut buf).expect("server read");
                if n == 0 {
                    break;
                }
                stream.write_all(&buf[..n]).expect("server write");
            }
        }
        transports
    })
}

/// Writes `data` from one thread and reads the echo on another; returns what came back.
pub fn echo(stream: Stream, data: Vec<u8>) -> Vec<u8> {
    let mut stream = stream;
    let mut reader_half = Vec::with_capacity(data.len());
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        // One thread both writes and reads in slices, so no second handle is needed.
        let _ = (tx, rx, scope);
        let mut sent = 0;
        let mut buf = vec![0u8; 1 << 16];
        while reader_half.len() < data.len() {
            if sent < data.len() {
                let end = (sent + (1 << 16)).min(data.len());
                stream.write_all(&data[sent..end]).expect("client write");
                sent = end;
            }
            while reader_half.len() < sent {
                let n = stream.read(&mut buf).expect("client read");
                assert!(n > 0, "echo ended early at {} of {}", reader_half.len(), data.len());
                reader_half.extend_from_slice(&buf[..n]);
            }
        }
    });
    reader_half
}

/// Clients that do not behave, as a listener meets them (its tests with either driver): one
/// that waits for the server to speak first (a plain-TCP stream after `plain_client_wait`),
/// one that sends the Lightpath magic and then garbage (dropped, told why), and one that sends
/// half the magic and stalls (a plain-TCP stream after the wait, its bytes kept).
pub struct OddClients {
    pub silent: TcpStream,
    pub garbage: TcpStream,
    pub slow: TcpStream,
}

impl OddClients {
    pub fn connect(addr: SocketAddr) -> Self {
        let silent = TcpStream::connect(addr).unwrap();
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(b"\x89LPATH/C\xff\xff\xff\xff").unwrap();
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"\x89LPA").unwrap();
        Self { silent, garbage, slow }
    }

    /// The garbage client was told why (after the server's magic) and its connection closed.
    pub fn garbage_was_told(&mut self) {
        self.garbage.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut told = Vec::new();
        let _ = self.garbage.read_to_end(&mut told);
        assert!(told.starts_with(b"\x89LPATH/S"), "{told:?}");
    }

    /// The silent and the slow client each read `hi`, which the server wrote on their plain
    /// streams.
    pub fn plain_ones_read_hi(&mut self) {
        for client in [&mut self.silent, &mut self.slow] {
            let mut hi = [0u8; 2];
            client.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            client.read_exact(&mut hi).unwrap();
            assert_eq!(&hi, b"hi");
        }
    }
}
