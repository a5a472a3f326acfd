//! A server short of file descriptors (issue 15): connections that would leave it with too
//! few for the ones it already serves fall back to TCP (reason `Resources`) instead of failing,
//! every connection carries its bytes, the established ones keep working, and nothing panics.
//!
//! The server is this test binary run again (`--exact server_role`) under `ulimit -n`, so the
//! limit binds it alone; the clients run here.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};

use lightpath::{Listener, Options, ProviderId, Stream, Transport};

mod common;

/// Descriptors the server may hold.
const SERVER_LIMIT: u32 = 200;

/// Connections opened (all kept open): more than the limit holds over RDMA (shm takes about
/// ten descriptors per connection, soft three: its TCP socket, a notification fd and a UDP
/// port of its own), fewer than it holds over TCP.
fn connections(provider: &str) -> usize {
    if provider == "shm" {
        48
    } else {
        80
    }
}

/// The server: echoes every connection until EOF, each on a thread; reports accept errors and
/// keeps serving. Prints its port first. Returns after `connections()` connections ended, or
/// (provider `tcp`, the overflow test) once its standard input closes.
#[test]
fn server_role() {
    let Ok(provider) = std::env::var("LP_DESCRIPTORS_SERVER") else { return };
    #[cfg(feature = "tokio")]
    if provider == "tcp-tokio" {
        return tokio_server();
    }
    let options = match provider.as_str() {
        "shm" => common::shm(),
        "soft" => common::soft(),
        _ => Options::default().with_providers(&[]),
    };
    let listener = Listener::bind_with("127.0.0.1:0", options).expect("bind");
    // The harness may have started the line ("test server_role ... "): a marker, not a prefix.
    println!("listening-port={}", listener.local_addr().expect("address").port());
    let stdin_closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if provider == "tcp" {
        let closed = std::sync::Arc::clone(&stdin_closed);
        std::thread::spawn(move || {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            closed.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let mut served = Vec::new();
    loop {
        if provider == "tcp" {
            if stdin_closed.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
        } else if served.len() >= connections(&provider) {
            break;
        }
        match listener.accept_timeout(std::time::Duration::from_millis(100)) {
            Ok((mut stream, _)) => served.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) => return Ok(()),
                        Ok(n) => stream.write_all(&buf[..n])?,
                        Err(e) => return Err(e),
                    }
                }
            })),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) => {
                eprintln!("server: accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
    for (i, thread) in served.into_iter().enumerate() {
        if let Err(e) = thread.join().expect("a server thread panicked") {
            panic!("server: connection {i} failed: {e}");
        }
    }
}

/// One echo round trip of `len` bytes on `stream`.
fn round_trip(stream: &mut Stream, len: usize, salt: u32) {
    let data = common::pattern(len, salt);
    stream.write_all(&data).expect("client write");
    let mut back = vec![0u8; len];
    stream.read_exact(&mut back).expect("client read");
    assert!(back == data, "connection {salt}: the echo differs");
}

/// Starts the server role under the descriptor limit; returns it and its port.
fn start_server(provider: &str) -> (std::process::Child, u16) {
    let exe = std::env::current_exe().expect("test binary");
    let mut server = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -n {SERVER_LIMIT} && exec \"$0\" --exact server_role --nocapture --test-threads=1"
        ))
        .arg(&exe)
        .env("LP_DESCRIPTORS_SERVER", provider)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the server");
    let mut lines = BufReader::new(server.stdout.take().expect("stdout")).lines();
    let port: u16 = loop {
        let line = lines.next().expect("the server printed no port").expect("server output");
        if let Some((_, port)) = line.split_once("listening-port=") {
            break port.trim().parse().expect("a port number");
        }
    };
    // Keep reading what it prints (the harness's last lines), or it dies of a broken pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (server, port)
}

fn run(provider: &str) {
    let (mut server, port) = start_server(provider);
    let options = match provider {
        "shm" => Options::default().with_providers(&[ProviderId::Shm]),
        _ => Options::default().with_providers(&[ProviderId::Soft]),
    };
    let mut streams = Vec::new();
    let count = connections(provider);
    for i in 0..count {
        let mut stream = Stream::connect_with(("127.0.0.1", port), &options)
            .unwrap_or_else(|e| panic!("{provider}: connection {i} failed: {e}"));
        round_trip(&mut stream, 70_000, i as u32);
        streams.push(stream);
    }
    // The first connections still carry bytes once the server is short of descriptors.
    for (i, stream) in streams.iter_mut().enumerate() {
        round_trip(stream, 5_000, 1000 + i as u32);
    }
    let transports: Vec<Transport> = streams.iter().map(Stream::transport).collect();
    drop(streams);
    let status = server.wait().expect("waiting for the server");
    let mut errors = String::new();
    server.stderr.take().expect("stderr").read_to_string(&mut errors).expect("server stderr");
    assert!(status.success(), "{provider}: the server failed ({status}):\n{errors}");
    assert!(!errors.contains("panicked"), "{provider}: the server panicked:\n{errors}");
    let rdma = transports.iter().filter(|t| t.is_rdma()).count();
    let short =
        transports.iter().filter(|t| **t == Transport::Tcp(lightpath::FallbackReason::Resources)).count();
    eprintln!("{provider}: {rdma} over RDMA, {short} over TCP for want of descriptors, of {count}");
    assert!(rdma > 0, "{provider}: no connection used RDMA: {transports:?}");
    assert!(short > 0, "{provider}: the server never ran short: {transports:?}");
    assert_eq!(rdma + short, count, "{provider}: other transports: {transports:?}");
}

#[test]
fn an_shm_server_short_of_descriptors_falls_back_to_tcp() {
    run("shm");
}

#[test]
fn a_soft_server_short_of_descriptors_falls_back_to_tcp() {
    run("soft");
}

/// Past the limit itself: clients the server has no descriptor for are turned away at once
/// (not left waiting for the 5 s negotiation timeout), the established connections keep
/// working, and once some close, new clients get in again.
#[test]
fn clients_past_the_limit_are_turned_away_at_once() {
    turned_away("tcp");
}

#[cfg(feature = "tokio")]
#[test]
fn clients_past_the_limit_of_a_tokio_listener_are_turned_away_at_once() {
    turned_away("tcp-tokio");
}

/// The body of the two tests above, against the server role `server_kind`.
fn turned_away(server_kind: &str) {
    let (mut server, port) = start_server(server_kind);
    let options = Options::default().with_providers(&[]);
    let mut streams = Vec::new();
    let mut refused = Vec::new();
    // Connections the server negotiated and then dropped (it could not set them up).
    let mut dropped = 0;
    for i in 0..(SERVER_LIMIT as usize + 40) {
        let started = std::time::Instant::now();
        match Stream::connect_with(("127.0.0.1", port), &options) {
            Ok(mut stream) => {
                let data = common::pattern(100, i as u32);
                let mut back = vec![0u8; data.len()];
                match stream.write_all(&data).and_then(|()| stream.read_exact(&mut back)) {
                    Ok(()) => {
                        assert!(back == data, "connection {i}: the echo differs");
                        streams.push(stream);
                    }
                    Err(e) => {
                        assert!(
                            started.elapsed() < std::time::Duration::from_secs(3),
                            "a drop took long: {e}"
                        );
                        dropped += 1;
                    }
                }
            }
            Err(e) => refused.push((started.elapsed(), e.to_string())),
        }
    }
    eprintln!(
        "{server_kind}: {} connected, {} turned away, {dropped} dropped after the negotiation; first refusal: {:?}",
        streams.len(),
        refused.len(),
        refused.first()
    );
    if server_kind == "tcp" {
        assert_eq!(dropped, 0, "the blocking listener dropped negotiated connections");
    }
    // A tokio stream registers a duplicate of its socket: two descriptors per connection.
    assert!(streams.len() > SERVER_LIMIT as usize / 3, "only {} connections got in", streams.len());
    assert!(!refused.is_empty() || dropped > 0, "the server never ran out");
    for (took, error) in &refused {
        assert!(*took < std::time::Duration::from_secs(3), "a refusal took {took:?}: {error}");
        assert!(error.contains("out of file descriptors"), "the refusal does not say why it may be: {error}");
    }
    for (i, stream) in streams.iter_mut().enumerate() {
        round_trip(stream, 1000, 5000 + i as u32);
    }
    // Closing some makes room again.
    streams.truncate(streams.len() - 20);
    let closed = std::time::Instant::now();
    let mut again = loop {
        match Stream::connect_with(("127.0.0.1", port), &options) {
            Ok(stream) => break stream,
            Err(e) if closed.elapsed() < std::time::Duration::from_secs(10) => {
                eprintln!("after {:?}: {e}", closed.elapsed());
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            Err(e) => panic!("no client got in within 10 s of 20 closing: {e}"),
        }
    };
    eprintln!("a new client got in {:?} after 20 closed", closed.elapsed());
    round_trip(&mut again, 100, 9999);
    drop(again);
    drop(streams);
    drop(server.stdin.take());
    let status = server.wait().expect("waiting for the server");
    let mut errors = String::new();
    server.stderr.take().expect("stderr").read_to_string(&mut errors).expect("server stderr");
    assert!(status.success(), "the server failed ({status}):\n{errors}");
    assert!(!errors.contains("panicked"), "the server panicked:\n{errors}");
}

/// The server role with the tokio listener: echoes each connection in a task until standard
/// input closes.
#[cfg(feature = "tokio")]
fn tokio_server() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let options = Options::default().with_providers(&[]);
        let listener = lightpath::tokio::Listener::bind_with("127.0.0.1:0", options).await.expect("bind");
        println!("listening-port={}", listener.local_addr().expect("address").port());
        let (closed_tx, mut closed) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            let _ = closed_tx.send(());
        });
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut closed => break,
                accepted = listener.accept() => match accepted {
                    Ok((mut stream, _)) => {
                        tasks.spawn(async move {
                            let mut buf = vec![0u8; 1 << 16];
                            loop {
                                let n = stream.read(&mut buf).await?;
                                if n == 0 {
                                    return Ok::<(), std::io::Error>(());
                                }
                                stream.write_all(&buf[..n]).await?;
                            }
                        });
                    }
                    Err(e) => eprintln!("server: accept failed: {e}"),
                },
            }
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("a server task panicked").expect("a server connection failed");
        }
    });
}
