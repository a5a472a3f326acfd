//! Peers that fail or do not speak Lightpath: a peer killed mid-transfer, a blocked RDMA path,
//! a version mismatch, plain TCP clients and servers on either side, and fuzzed negotiation
//! messages. Each must end in a working stream or a clear error — never a hang.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{checksum, echo, echo_server, listener, pattern};
use lightpath::{FallbackReason, Options, ProviderId, Stream, Transport};
use lightpath_stream::negotiate::{Choice, Message, CLIENT_MAGIC, SERVER_MAGIC, VERSION};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

fn quick() -> Options {
    Options {
        handshake_timeout: Duration::from_millis(500),
        plain_client_wait: Duration::from_millis(200),
        probe_timeout: Duration::from_secs(2),
        ..soft()
    }
}

/// The options a child process was told to use (`LIGHTPATH_TEST_CHILD_PROVIDER`, default soft).
fn child_options() -> Options {
    match std::env::var("LIGHTPATH_TEST_CHILD_PROVIDER").as_deref() {
        Ok("shm") => Options::default().with_providers(&[ProviderId::Shm]),
        _ => soft(),
    }
}

fn provider_options(provider: ProviderId) -> Options {
    Options::default().with_providers(&[provider])
}

/// Child-process side of `peer_killed_mid_transfer`: connects, writes forever.
#[test]
fn child_writer() {
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_CHILD_ADDR") else { return };
    let mut stream = Stream::connect_with(addr.as_str(), &child_options()).expect("child connect");
    println!("transport {}", stream.transport());
    let chunk = pattern(1 << 16, 1);
    loop {
        if stream.write_all(&chunk).is_err() {
            return;
        }
    }
}

/// Child-process side of `flushed_bytes_survive_a_killed_writer`: writes 200 KB (less than
/// the receive ring, so no reader is needed), flushes, says so, then waits to be killed.
#[test]
fn child_flusher() {
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_FLUSH_ADDR") else { return };
    let mut stream = Stream::connect_with(addr.as_str(), &child_options()).expect("child connect");
    stream.write_all(&pattern(200_000, 42)).unwrap();
    stream.flush().unwrap();
    println!("flushed");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn flushed_bytes_survive_a_killed_writer_over_soft() {
    flushed_bytes_survive_a_killed_writer(ProviderId::Soft, false);
    flushed_bytes_survive_a_killed_writer(ProviderId::Soft, true);
}

#[test]
fn flushed_bytes_survive_a_killed_writer_over_shm() {
    flushed_bytes_survive_a_killed_writer(ProviderId::Shm, false);
    flushed_bytes_survive_a_killed_writer(ProviderId::Shm, true);
}

fn flushed_bytes_survive_a_killed_writer(provider: ProviderId, look_first: bool) {
    let listener = listener(provider_options(provider));
    let addr = listener.local_addr().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("LIGHTPATH_TEST_CHILD_PROVIDER", provider.name())
        .args(["--exact", "child_flusher", "--nocapture", "--test-threads=1"])
        .env("LIGHTPATH_TEST_FLUSH_ADDR", addr.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut stream, _) = listener.accept_timeout(Duration::from_secs(20)).expect("child connected");
    assert_eq!(stream.transport(), Transport::Rdma(provider));
    // Wait until the child's flush returned, without reading the stream yet.
    let mut out = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains("flushed") {
        assert_eq!(out.read(&mut byte).unwrap(), 1, "the child ended before flushing");
        seen.push(byte[0]);
    }
    child.kill().unwrap();
    let _ = child.wait();
    if look_first {
        // A busy-polling driver's look (`Stream::drive`) once the loss may be known: the
        // bytes that arrived before it are still there to read, so it reports them rather
        // than the failure.
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..3 {
            let driven = stream.drive().expect("bytes that arrived before the loss are readable");
            assert!(driven.readable);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // Everything the child's flush acknowledged is readable, then the loss is reported.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let err = loop {
        match stream.read(&mut buf) {
            Ok(0) => panic!("a killed peer must not look like a clean close"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(err) => break err,
        }
    };
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    assert_eq!(got.len(), 200_000);
    if look_first {
        // Once they are read, a look says a read would not block, and the read fails.
        assert!(stream.drive().is_ok_and(|driven| driven.readable));
        assert_eq!(stream.read(&mut buf).unwrap_err().kind(), ErrorKind::ConnectionReset);
    }
    assert_eq!(checksum(&got), checksum(&pattern(200_000, 42)));
}

#[test]
fn timeouts_and_nonblocking_mode() {
    for options in [soft(), Options::tcp_only()] {
        let listener = listener(options.clone());
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1];
            stream.read_exact(&mut buf).unwrap();
        });
        let mut stream = Stream::connect_with(addr, &options).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        assert_eq!(stream.read_timeout(), Some(Duration::from_millis(100)));
        let started = Instant::now();
        let err = stream.read(&mut [0u8; 4]).unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(90));
        assert!(stream.set_read_timeout(Some(Duration::ZERO)).is_err());
        stream.set_read_timeout(None).unwrap();
        stream.set_nonblocking(true).unwrap();
        assert_eq!(stream.read(&mut [0u8; 4]).unwrap_err().kind(), ErrorKind::WouldBlock);
        stream.set_nonblocking(false).unwrap();
        assert_eq!(stream.local_addr().unwrap().ip(), stream.peer_addr().unwrap().ip());
        stream.write_all(b"x").unwrap();
        server.join().unwrap();
    }
}

#[test]
fn peer_killed_mid_transfer_over_soft() {
    peer_killed_mid_transfer(ProviderId::Soft);
}

#[test]
fn peer_killed_mid_transfer_over_shm() {
    peer_killed_mid_transfer(ProviderId::Shm);
}

fn peer_killed_mid_transfer(provider: ProviderId) {
    let listener = listener(provider_options(provider));
    let addr = listener.local_addr().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("LIGHTPATH_TEST_CHILD_PROVIDER", provider.name())
        .args(["--exact", "child_writer", "--nocapture", "--test-threads=1"])
        .env("LIGHTPATH_TEST_CHILD_ADDR", addr.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (mut stream, _) = listener.accept_timeout(Duration::from_secs(20)).expect("child connected");
    assert_eq!(stream.transport(), Transport::Rdma(provider));
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0usize;
    while total < 4 << 20 {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0);
        total += n;
    }
    child.kill().unwrap();
    let killed = Instant::now();
    let err = loop {
        match stream.read(&mut buf) {
            Ok(0) => panic!("a killed peer must not look like a clean close"),
            Ok(_) => continue,
            Err(err) => break err,
        }
    };
    let noticed = killed.elapsed();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    assert!(noticed < Duration::from_secs(2), "noticed after {noticed:?}");
    let _ = child.wait();
}

#[test]
fn blocked_rdma_path_falls_back_to_tcp() {
    let listener = listener(soft());
    let addr = listener.local_addr().unwrap();
    let server = echo_server(listener, 1);
    let options = Options { fault_blackhole_rdma: true, ..quick() };
    let stream = Stream::connect_with(addr, &options).unwrap();
    assert_eq!(stream.transport(), Transport::Tcp(FallbackReason::PathFailed));
    let data = pattern(500_000, 8);
    assert_eq!(checksum(&echo(stream, data.clone())), checksum(&data));
    assert_eq!(server.join().unwrap(), vec![Transport::Tcp(FallbackReason::PathFailed)]);
}

#[test]
fn tcp_only_client_and_version_mismatch() {
    let listener = listener(soft());
    let addr = listener.local_addr().unwrap();
    let server = echo_server(listener, 2);
    let stream = Stream::connect_with(addr, &Options::tcp_only()).unwrap();
    assert_eq!(stream.transport(), Transport::Tcp(FallbackReason::Disabled));
    assert_eq!(echo(stream, b"abc".to_vec()), b"abc");
    let future = Options { fault_versions: Some((7, 9)), ..soft() };
    let stream = Stream::connect_with(addr, &future).unwrap();
    assert_eq!(stream.transport(), Transport::PlainTcp);
    assert_eq!(echo(stream, b"version".to_vec()), b"version");
    let transports = server.join().unwrap();
    assert_eq!(transports, vec![Transport::Tcp(FallbackReason::Disabled), Transport::PlainTcp]);
}

#[test]
fn plain_tcp_clients_get_plain_streams() {
    let listener = listener(quick());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut stream, _) = listener.accept().unwrap();
            assert_eq!(stream.transport(), Transport::PlainTcp);
            stream.write_all(b"220 hello\r\n").unwrap();
            let mut line = [0u8; 6];
            stream.read_exact(&mut line).unwrap();
            stream.write_all(&line).unwrap();
        }
    });
    // A client that speaks first (its first byte is not the Lightpath magic)…
    let mut talker = TcpStream::connect(addr).unwrap();
    talker.write_all(b"HELO x").unwrap();
    let mut got = vec![0u8; 17];
    talker.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"220 hello\r\nHELO x");
    // …and one that waits for the server's banner first.
    let mut waiter = TcpStream::connect(addr).unwrap();
    let mut banner = [0u8; 11];
    waiter.read_exact(&mut banner).unwrap();
    assert_eq!(&banner, b"220 hello\r\n");
    waiter.write_all(b"QUIT\r\n").unwrap();
    let mut echo = [0u8; 6];
    waiter.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"QUIT\r\n");
    server.join().unwrap();
}

/// A plain TCP server that does `behave` with each connection.
fn plain_server(behave: fn(TcpStream)) -> std::net::SocketAddr {
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in tcp.incoming().flatten() {
            std::thread::spawn(move || behave(conn));
        }
    });
    addr
}

#[test]
fn lightpath_client_to_plain_servers_fails_fast_and_clearly() {
    let echoing = plain_server(|mut conn| {
        let mut buf = [0u8; 1024];
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 || conn.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
    let banner = plain_server(|mut conn| {
        let _ = conn.write_all(b"SSH-2.0-OpenSSH_9.6\r\n");
        std::thread::sleep(Duration::from_secs(2));
    });
    let silent = plain_server(|conn| {
        std::thread::sleep(Duration::from_secs(3));
        drop(conn);
    });
    let closing = plain_server(drop);
    let cases = [
        (echoing, ErrorKind::InvalidData, "echoed"),
        (banner, ErrorKind::InvalidData, "SSH-2.0"),
        (silent, ErrorKind::TimedOut, "no Lightpath answer"),
        (closing, ErrorKind::ConnectionRefused, "not a Lightpath listener"),
    ];
    for (addr, kind, text) in cases {
        let started = Instant::now();
        let err = Stream::connect_with(addr, &quick()).expect_err("a plain server is no Lightpath peer");
        assert_eq!(err.kind(), kind, "{err}");
        assert!(err.to_string().contains(text), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    }
}

/// xorshift for the fuzz cases (deterministic).
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn fuzzed_client_hellos_never_break_the_listener() {
    let listener = listener(quick());
    let addr = listener.local_addr().unwrap();
    let valid = {
        let mut bytes = CLIENT_MAGIC.to_vec();
        Message::ClientHello {
            min_version: VERSION,
            max_version: VERSION,
            providers: vec![ProviderId::Soft],
            host_id: [0; 16],
        }
        .emit(&mut bytes);
        bytes
    };
    // Mangled hellos that still parse (another host id, no providers…) are valid clients: the
    // application gets their streams, and this one drops them at once.
    let listener = std::sync::Arc::new(listener);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drainer = {
        let (listener, stop) = (listener.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = listener.accept_timeout(Duration::from_millis(20));
            }
        })
    };
    let mut state = 0x1234_5678_9abc_def0u64;
    for case in 0..60 {
        let mut bytes = valid.clone();
        match case % 3 {
            0 => {
                let at = 8 + (next(&mut state) as usize % (bytes.len() - 8));
                bytes[at] ^= (next(&mut state) as u8) | 1;
            }
            1 => bytes.truncate(8 + next(&mut state) as usize % (bytes.len() - 8)),
            _ => {
                bytes.truncate(8);
                bytes.extend((0..next(&mut state) % 64).map(|_| next(&mut state) as u8));
            }
        }
        let mut conn = TcpStream::connect(addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conn.write_all(&bytes).unwrap();
        let _ = conn.shutdown(std::net::Shutdown::Write);
        let started = Instant::now();
        let mut answer = Vec::new();
        let _ = conn.read_to_end(&mut answer);
        assert!(started.elapsed() < Duration::from_secs(4), "case {case}: the listener hung");
        if !answer.is_empty() {
            assert_eq!(&answer[..8.min(answer.len())], &SERVER_MAGIC[..8.min(answer.len())], "case {case}");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    drainer.join().unwrap();
    let listener = std::sync::Arc::try_unwrap(listener).expect("only owner");
    let server = echo_server(listener, 1);
    let stream = Stream::connect_with(addr, &soft()).unwrap();
    assert!(stream.transport().is_rdma());
    assert_eq!(echo(stream, b"still fine".to_vec()), b"still fine");
    server.join().unwrap();
}

#[test]
fn fuzzed_server_answers_end_in_errors() {
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let answers: Vec<Vec<u8>> = {
        let endpoint = lightpath_stream::negotiate::RdmaEndpoint {
            gid: [0; 16],
            udp_port: 4791,
            qpn: 5,
            psn: 1,
            mtu: 1024,
            ring_addr: 0,
            ring_len: 4096,
            ring_rkey: 1,
            credit_addr: 0,
            credit_rkey: 1,
            recv_depth: 16,
        };
        let mut valid = SERVER_MAGIC.to_vec();
        Message::ServerHello { version: VERSION, choice: Choice::Rdma(ProviderId::Soft, endpoint) }
            .emit(&mut valid);
        let mut state = 0xfeed_beef_u64;
        (0..40)
            .map(|case| {
                let mut bytes = valid.clone();
                if case % 2 == 0 {
                    let at = 8 + next(&mut state) as usize % (bytes.len() - 8);
                    bytes[at] ^= (next(&mut state) as u8) | 1;
                } else {
                    bytes.truncate(8 + next(&mut state) as usize % (bytes.len() - 8));
                }
                bytes
            })
            .collect()
    };
    let count = answers.len();
    std::thread::spawn(move || {
        for (answer, conn) in answers.into_iter().zip(tcp.incoming()) {
            let mut conn = conn.unwrap();
            let _ = conn.write_all(&answer);
            // Then silence: the client must not wait longer than its handshake timeout.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(3));
                drop(conn);
            });
        }
    });
    for case in 0..count {
        let started = Instant::now();
        let outcome = Stream::connect_with(addr, &quick());
        assert!(started.elapsed() < Duration::from_secs(4), "case {case} took {:?}", started.elapsed());
        if let Ok(stream) = outcome {
            // A mutation that still parses (say, a different queue pair number) can only get
            // as far as falling back to TCP.
            assert!(!stream.transport().is_rdma(), "case {case}");
        }
    }
}

/// Child-process side of `processes_share_an_address_over_soft`: echoes one connection.
#[test]
fn child_echo_server() {
    let Ok(port_file) = std::env::var("LIGHTPATH_TEST_ECHO_PORT_FILE") else { return };
    let listener = listener(soft());
    std::fs::write(&port_file, listener.local_addr().unwrap().port().to_string()).unwrap();
    let (mut stream, _) = listener.accept_timeout(Duration::from_secs(30)).expect("accept");
    assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n]).unwrap();
    }
}

#[test]
fn processes_share_an_address_over_soft() {
    // Two echo servers in two processes and this one: three soft devices on 127.0.0.1, so at
    // most one holds the RoCE v2 port and the others use ports of their own.
    let dir = std::env::temp_dir();
    let mut children = Vec::new();
    let mut ports = Vec::new();
    for i in 0..2 {
        let port_file = dir.join(format!("lightpath-share-{}-{i}", std::process::id()));
        let _ = std::fs::remove_file(&port_file);
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_echo_server", "--nocapture", "--test-threads=1"])
            .env("LIGHTPATH_TEST_ECHO_PORT_FILE", &port_file)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        children.push(child);
        let started = Instant::now();
        let port = loop {
            if let Some(port) = std::fs::read_to_string(&port_file).ok().and_then(|t| t.parse::<u16>().ok()) {
                break port;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "child {i} did not start");
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = std::fs::remove_file(&port_file);
        ports.push(port);
    }
    for (i, port) in ports.into_iter().enumerate() {
        let stream = Stream::connect_with(("127.0.0.1", port), &soft()).unwrap();
        assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft), "server {i}");
        let data = pattern(300_000, i as u32);
        assert_eq!(checksum(&echo(stream, data.clone())), checksum(&data));
    }
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
}
