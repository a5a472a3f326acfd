//! Runs the built `lightpath interop-peer` against itself on loopback: a server (responder,
//! soft device on 127.0.0.1) and a client (requester, 127.0.0.2) for every operation of
//! interop/PROTOCOL.md, with and without the client's deliberate fault (`-x`), and against
//! peers that disagree, speak another protocol or vanish. (The interop suite runs the same
//! command against verbs_peer on rxe.)
//!
//! Every test uses its own TCP port and UDP port, so the tests run in parallel.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Output;
use std::time::{Duration, Instant};

const OPS: [&str; 7] = ["send", "send_imm", "write", "write_imm", "read", "cmp_swap", "fetch_add"];

mod common;

use common::{free_tcp_port, free_udp_port, strings, Running};

fn spawn(args: &[String]) -> Running {
    common::spawn("interop-peer", args)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn last_line(output: &Output) -> String {
    stdout(output).lines().last().unwrap_or_default().to_string()
}

/// Runs a server and a client with the same `common` options plus their own.
fn run_pair(common: &[&str], server_extra: &[&str], client_extra: &[&str]) -> (Output, Output) {
    let (tcp, udp) = (free_tcp_port().to_string(), free_udp_port().to_string());
    let mut base = strings(&["-p", &tcp, "--udp-port", &udp, "-t", "30"]);
    base.extend(strings(common));
    let mut server_args = base.clone();
    server_args.extend(strings(&["--bind", "127.0.0.1"]));
    server_args.extend(strings(server_extra));
    let server = spawn(&server_args);
    let mut client_args = base;
    client_args.extend(strings(&["--bind", "127.0.0.2"]));
    client_args.extend(strings(client_extra));
    client_args.push("127.0.0.1".into());
    let client = spawn(&client_args);
    (server.output(), client.output())
}

fn describe(server: &Output, client: &Output) -> String {
    format!(
        "server {:?}:\n{}{}\nclient {:?}:\n{}{}",
        server.status.code(),
        stdout(server),
        String::from_utf8_lossy(&server.stderr),
        client.status.code(),
        stdout(client),
        String::from_utf8_lossy(&client.stderr)
    )
}

#[test]
fn every_operation_passes_both_ways() {
    for op in OPS {
        let (server, client) = run_pair(&["-o", op], &[], &[]);
        let what = describe(&server, &client);
        assert_eq!(server.status.code(), Some(0), "{op}: {what}");
        assert_eq!(client.status.code(), Some(0), "{op}: {what}");
        let size = match op {
            "read" => 1_048_576,
            "cmp_swap" | "fetch_add" => 8,
            _ => 10000,
        };
        let tail = format!("op={op} size={size} iters=5 mtu=1024");
        assert!(
            last_line(&server).starts_with(&format!("PASS lightpath interop-peer server {tail}")),
            "{what}"
        );
        assert!(
            last_line(&client).starts_with(&format!("PASS lightpath interop-peer client {tail}")),
            "{what}"
        );
        assert!(stdout(&server).contains("own checks: 0 failures"), "{what}");
    }
}

#[test]
fn the_smaller_mtu_wins_and_receives_are_reposted() {
    // 300 receives: more than the 256 the responder posts at first.
    for op in ["send", "write_imm"] {
        let (server, client) =
            run_pair(&["-o", op, "-n", "300", "-s", "300"], &["-m", "4096"], &["-m", "256"]);
        let what = describe(&server, &client);
        assert!(server.status.success() && client.status.success(), "{what}");
        assert!(stdout(&server).contains("connected: path MTU 256,"), "{what}");
        assert!(stdout(&client).contains("connected: path MTU 256,"), "{what}");
        assert!(last_line(&server).contains("iters=300 mtu=4096"), "{what}");
        assert!(last_line(&client).contains("iters=300 mtu=256"), "{what}");
    }
}

#[test]
fn a_deliberate_fault_fails_both_sides() {
    // What each fault must be caught as, on the side that catches it.
    let caught = [
        ("send", "server: FAIL: iteration 0: data wrong at byte 5 of 10"),
        ("send_imm", "server: FAIL: receive 0: immediate 0x1f020001, expected 0x1f020000"),
        ("write", "server: FAIL: slot 0 written wrongly: byte 0 of 10"),
        ("write_imm", "server: FAIL: receive 0: immediate 0x1f040001, expected 0x1f040000"),
        ("read", "client: FAIL: READ 0: data wrong at byte 0 of 10"),
        (
            "cmp_swap",
            "client: FAIL: cmp_swap 1: original value 0x1122334455667788, expected 0x8f154afd2a2c0b9d",
        ),
        (
            "fetch_add",
            "client: FAIL: fetch_add 1: original value 0x00000000ffffff82, expected 0x00000000ffffff81",
        ),
    ];
    for (op, message) in caught {
        let size = if op == "cmp_swap" || op == "fetch_add" { "8" } else { "10" };
        let (server, client) = run_pair(&["-o", op, "-n", "2", "-s", size], &[], &["-x"]);
        let what = describe(&server, &client);
        assert_eq!(server.status.code(), Some(1), "{op}: {what}");
        assert_eq!(client.status.code(), Some(1), "{op}: {what}");
        assert!(last_line(&server).starts_with("FAIL lightpath interop-peer server"), "{what}");
        assert!(last_line(&client).starts_with("FAIL lightpath interop-peer client"), "{what}");
        let all = format!("{}{}", stdout(&server), stdout(&client));
        assert!(all.contains(&format!("lightpath interop-peer {message}")), "{op}: {what}");
    }
}

#[test]
fn disagreeing_peers_are_a_setup_error() {
    let (server, client) = run_pair(&["-n", "3"], &["-o", "write"], &["-o", "read", "-s", "10000"]);
    let what = describe(&server, &client);
    assert_eq!(server.status.code(), Some(2), "{what}");
    assert_eq!(client.status.code(), Some(2), "{what}");
    assert!(
        stdout(&server).contains("ERROR: peer wants op=read size=10000 iters=3, we have op=write"),
        "{what}"
    );
    assert_eq!(last_line(&server), "FAIL lightpath interop-peer server op=write (setup error)");
    assert!(stdout(&client).contains("bad or missing server line"), "{what}");
    assert_eq!(last_line(&client), "FAIL lightpath interop-peer client op=read (setup error)");
}

fn connect_when_listening(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match TcpStream::connect((Ipv4Addr::LOCALHOST, port)) {
            Ok(stream) => return stream,
            Err(err) if Instant::now() > deadline => panic!("the server never listened: {err}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn a_client_speaking_another_protocol() {
    let (tcp, udp) = (free_tcp_port(), free_udp_port());
    let server =
        spawn(&strings(&["-p", &tcp.to_string(), "--udp-port", &udp.to_string(), "--bind", "127.0.0.1"]));
    let mut garbage = connect_when_listening(tcp);
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let output = server.output();
    assert_eq!(output.status.code(), Some(2), "{}", stdout(&output));
    assert!(
        stdout(&output).contains("ERROR: bad or missing client line: \"GET / HTTP/1.0\r\""),
        "{}",
        stdout(&output)
    );
    assert_eq!(last_line(&output), "FAIL lightpath interop-peer server op=send (setup error)");
}

#[test]
fn a_server_that_vanishes_after_the_exchange() {
    // A fake server answers with a valid line for a responder at 127.0.0.3 that does not
    // exist: the client's first WRITE exhausts its retries and the run fails (exit 1).
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let udp = free_udp_port().to_string();
    let fake = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let reply =
            "LP1 write 000042 000001 00000000000000000000ffff7f000003 1024 0000000000010000 00000007 100 2\n";
        (&stream).write_all(reply.as_bytes()).unwrap();
        let mut done = String::new();
        reader.read_line(&mut done).unwrap();
        (line, done)
    });
    let client = spawn(&strings(&[
        "-o",
        "write",
        "-s",
        "100",
        "-n",
        "2",
        "-R",
        "2",
        "-p",
        &port,
        "--udp-port",
        &udp,
        "--bind",
        "127.0.0.2",
        "-t",
        "20",
        "127.0.0.1",
    ]))
    .output();
    let out = stdout(&client);
    assert_eq!(client.status.code(), Some(1), "{out}");
    assert!(
        out.contains("FAIL: iteration 0 completed with status transport retry counter exceeded"),
        "{out}"
    );
    assert!(out.contains("FAIL: no RESULT line from the server"), "{out}");
    assert!(
        last_line(&client).starts_with("FAIL lightpath interop-peer client op=write size=100 iters=2"),
        "{out}"
    );
    let (line, done) = fake.join().unwrap();
    assert!(line.starts_with("LP1 write "), "{line}");
    assert!(line.contains(" 00000000000000000000ffff7f000002 1024 ") && line.ends_with(" 100 2\n"), "{line}");
    assert_eq!(done, "DONE FAIL\n");
}

#[test]
fn bad_options_are_setup_errors() {
    for (args, message) in [
        (&["-m", "1500"][..], "-m must be 256, 512, 1024, 2048 or 4096"),
        (&["-o", "cmp_swap", "-s", "16"][..], "atomics operate on 8 bytes"),
        (&["-n", "70000"][..], "-n must be 1..65535"),
        (&["-R", "8"][..], "-R must be 0..7"),
        (&["-g", "3"][..], "one GID, index 0"),
    ] {
        let output = spawn(&strings(args)).output();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(stdout(&output).contains(message), "{args:?}: {}", stdout(&output));
        assert!(last_line(&output).starts_with("FAIL lightpath interop-peer server"), "{args:?}");
    }
    let output = spawn(&strings(&["-o", "swap"])).output();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown operation swap"));
}
