//! `lightpath perf --perftest` without perftest: both ends are Lightpath speaking perftest's
//! exchange on loopback (the rxe interop suite runs it against the real perftest), and peers
//! that are not perftest get a clear error instead of a hang.

mod common;

use common::{free_tcp_port, wait_with_deadline};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lightpath");

/// Loopback addresses and a UDP port unique to this process and call.
fn unique_endpoint() -> (String, String, u16) {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id() as u16;
    let third = (pid % 200) as u8 + 20;
    let fourth = (n % 100) as u8 * 2 + 110;
    (format!("127.{third}.{fourth}.1"), format!("127.{third}.{fourth}.2"), 30000 + (pid % 20000) + n)
}

/// The "#bytes #iterations" pairs of a result table.
fn result_pairs(stdout: &[u8]) -> Vec<(u64, u64)> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
        })
        .collect()
}

/// The rows `-a` reports: every power of two from 2 B to 8 MiB, `iters` iterations each.
fn all_sizes(iters: u64) -> Vec<(u64, u64)> {
    (1..24).map(|shift| (1u64 << shift, iters)).collect()
}

fn run_pair(test: &str, extra: &[&str]) -> (Output, Output) {
    run_mismatched(test, extra, extra, Duration::from_secs(60))
}

fn check(test: &str, extra: &[&str], expected: &[(u64, u64)], server_prints: bool) {
    let (server, client) = run_pair(test, extra);
    let text =
        |o: &Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(client.status.success(), "{test} client: {}", text(&client));
    assert!(server.status.success(), "{test} server: {}", text(&server));
    assert_eq!(result_pairs(&client.stdout), expected, "{test} client: {}", text(&client));
    let server_pairs = result_pairs(&server.stdout);
    if server_prints {
        assert_eq!(server_pairs, expected, "{test} server: {}", text(&server));
    } else {
        assert!(server_pairs.is_empty(), "{test} server: {}", text(&server));
    }
}

#[test]
fn write_bw_both_ends_report_the_clients_bytes_and_iterations() {
    check("write_bw", &["-s", "4096", "-n", "300"], &[(4096, 300)], true);
}

#[test]
fn read_bw_with_default_size() {
    check("read_bw", &["-n", "100"], &[(65536, 100)], true);
}

#[test]
fn write_lat_ping_pong_every_size_of_a_short_all() {
    check("write_lat", &["-a", "-n", "5"], &all_sizes(5), true);
}

#[test]
fn read_lat_server_is_passive() {
    check("read_lat", &["-s", "64", "-n", "200"], &[(64, 200)], false);
}

#[test]
fn send_lat_ping_pong_both_ends_report_every_size() {
    check("send_lat", &["-s", "64", "-n", "300"], &[(64, 300)], true);
}

#[test]
fn send_lat_with_all_sizes() {
    check("send_lat", &["-a", "-n", "5"], &all_sizes(5), true);
}

#[test]
fn send_bw_both_ends_report_their_own_table() {
    // Unlike write_bw, perftest's send_bw server measures its receives and prints its own
    // report for every size (no report crosses the connection).
    check("send_bw", &["-n", "200"], &[(65536, 200)], true);
    check("send_bw", &["-a", "-n", "5"], &all_sizes(5), true);
}

/// How long a mismatched run may take before it counts as a hang (the stall limit is 10 s, the
/// control connection's 30 s).
const LIMIT: Duration = Duration::from_secs(90);

/// Runs a server and a client (each with its own extra options; the client retries until the
/// server listens), each within `limit`; returns both outputs.
fn run_mismatched(
    test: &str,
    server_extra: &[&str],
    client_extra: &[&str],
    limit: Duration,
) -> (Output, Output) {
    let (server_ip, client_ip, udp) = unique_endpoint();
    let (port, udp) = (free_tcp_port().to_string(), udp.to_string());
    let common = ["--perftest", "-p", &port, "--udp-port", &udp];
    let server = Command::new(BIN)
        .args(["perf", test, "--bind", &server_ip])
        .args(common)
        .args(server_extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let client = loop {
        let out = Command::new(BIN)
            .args(["perf", test, &server_ip, "--bind", &client_ip])
            .args(common)
            .args(client_extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_with_deadline(out, limit);
        let refused = String::from_utf8_lossy(&out.stderr).contains("cannot reach perftest");
        if !refused || start.elapsed() > Duration::from_secs(10) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let server = wait_with_deadline(server, limit);
    (server, client)
}

#[test]
fn send_tests_with_mismatched_sizes_fail_clearly() {
    // The client sends larger messages than the server's receives hold.
    let (server, client) =
        run_mismatched("send_bw", &["-s", "4096", "-n", "50"], &["-s", "8192", "-n", "50"], LIMIT);
    let stderr = String::from_utf8_lossy(&server.stderr);
    assert_eq!(server.status.code(), Some(2), "server: {stderr}");
    assert!(stderr.contains("-s / -a"), "server: {stderr}");
    assert_ne!(client.status.code(), Some(0), "client: {}", String::from_utf8_lossy(&client.stderr));
    // The client sends smaller messages than the server expects: the receive says so.
    let (server, client) =
        run_mismatched("send_lat", &["-s", "64", "-n", "20"], &["-s", "32", "-n", "20"], LIMIT);
    let stderr = String::from_utf8_lossy(&server.stderr);
    assert_eq!(server.status.code(), Some(2), "server: {stderr}");
    assert!(stderr.contains("the peer sent a 32 B message where this side expects 64 B"), "server: {stderr}");
    assert_ne!(client.status.code(), Some(0), "client: {}", String::from_utf8_lossy(&client.stderr));
}

#[test]
fn a_peer_that_is_not_perftest_is_a_clear_error() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let peer = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut version = [0u8; 16];
        conn.read_exact(&mut version).unwrap();
        conn.write_all(b"HTTP/1.1 400 Bad").unwrap();
        version
    });
    let client = Command::new(BIN)
        .args(["perf", "write_bw", "127.0.0.1", "--perftest", "-p", &port, "--bind", "127.0.0.1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_with_deadline(client, Duration::from_secs(20));
    let version = peer.join().unwrap();
    assert_eq!(&version[..5], b"6.06\0", "we announce perftest's version, NUL-padded");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not perftest's"), "{stderr}");
}

#[test]
fn unsupported_tests_are_refused_before_connecting() {
    let out = Command::new(BIN)
        .args(["perf", "atomic_lat", "127.0.0.1", "--perftest", "-p", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not available with --perftest"));
}
