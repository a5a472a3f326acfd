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
/// ten descriptors per connection, soft two), fewer than it holds over TCP.
fn connections(provider: &str) -> usize {
    if provider == "shm" {
        48
    } else {
        110
    }
}

/// The server: echoes every connection until EOF, each on a thread; reports accept errors and
/// keeps serving. Prints its port first. Returns after `connections()` connections ended.
#[test]
fn server_role() {
    let Ok(provider) = std::env::var("LP_DESCRIPTORS_SERVER") else { return };
    let options = match provider.as_str() {
        "shm" => common::shm(),
        _ => common::soft(),
    };
    let listener = Listener::bind_with("127.0.0.1:0", options).expect("bind");
    // The harness may have started the line ("test server_role ... "): a marker, not a prefix.
    println!("listening-port={}", listener.local_addr().expect("address").port());
    let mut served = Vec::new();
    while served.len() < connections(&provider) {
        match listener.accept() {
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

fn run(provider: &str) {
    let exe = std::env::current_exe().expect("test binary");
    let mut server = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -n {SERVER_LIMIT} && exec \"$0\" --exact server_role --nocapture --test-threads=1"
        ))
        .arg(&exe)
        .env("LP_DESCRIPTORS_SERVER", provider)
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
