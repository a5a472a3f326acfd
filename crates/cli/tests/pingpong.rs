//! Runs the built `lightpath pingpong` as two processes on loopback, the way `ibv_rc_pingpong`
//! is run: a server (soft device on 127.0.0.1) and a client (127.0.0.2), over sizes, path MTUs
//! and both completion modes; and against peers that are not ping-pongs, or that stop.
//!
//! Every test uses its own TCP port and its own UDP port for the soft devices, so the tests run
//! in parallel with each other and with anything on the RoCE port 4791.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Output;
use std::time::{Duration, Instant};

mod common;

use common::{free_tcp_port, free_udp_port, strings, Running};

fn spawn(args: &[String]) -> Running {
    common::spawn("pingpong", args)
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The part of an address line after its label: "LID 0x0000, QPN 0x…, PSN 0x…, GID …".
fn address_of<'a>(stdout: &'a str, label: &str) -> &'a str {
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix(&format!("  {label}")))
        .unwrap_or_else(|| panic!("no {label:?} line in {stdout:?}"));
    line.trim_start()
}

/// Checks one side's output: four lines in rc_pingpong's formats, the right totals.
fn check_side(stdout: &str, gid: &str, size: u64, iters: u64) {
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    let local = address_of(stdout, "local address: ");
    assert!(local.starts_with("LID 0x0000, QPN 0x"), "{local}");
    assert!(local.ends_with(&format!(", GID ::ffff:{gid}")), "{local}");
    let fields: Vec<&str> = local.split(", ").collect();
    assert_eq!(fields.len(), 4, "{local}");
    for (field, prefix) in fields[..3].iter().zip(["LID 0x", "QPN 0x", "PSN 0x"]) {
        let digits = field.strip_prefix(prefix).unwrap();
        assert!(digits.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{field}");
    }
    let bytes_line = lines[2];
    let expected = format!("{} bytes in ", size * iters * 2);
    assert!(bytes_line.starts_with(&expected) && bytes_line.ends_with(" Mbit/sec"), "{bytes_line}");
    let iters_line = lines[3];
    assert!(
        iters_line.starts_with(&format!("{iters} iters in ")) && iters_line.ends_with(" usec/iter"),
        "{iters_line}"
    );
}

/// Runs a server and a client; returns both outputs.
fn run_pair(server_extra: &[&str], client_extra: &[&str]) -> (Output, Output) {
    let (tcp, udp) = (free_tcp_port().to_string(), free_udp_port().to_string());
    let common = ["-p", &tcp, "--udp-port", &udp, "--timeout", "30"];
    let mut server_args = strings(&common);
    server_args.extend(strings(server_extra));
    let server = spawn(&server_args);
    let mut client_args = strings(&common);
    client_args.extend(strings(client_extra));
    client_args.push("127.0.0.1".into());
    let client = spawn(&client_args);
    (server.output(), client.output())
}

/// Both sides succeed, print rc_pingpong's lines, and agree on each other's address.
fn check_pair(server: &Output, client: &Output, size: u64, iters: u64) {
    let ((s_out, s_err), (c_out, c_err)) = (text(server), text(client));
    assert!(server.status.success(), "server failed: {s_out}{s_err}\nclient: {c_out}{c_err}");
    assert!(client.status.success(), "client failed: {c_out}{c_err}\nserver: {s_out}{s_err}");
    check_side(&s_out, "127.0.0.1", size, iters);
    check_side(&c_out, "127.0.0.2", size, iters);
    assert_eq!(address_of(&s_out, "local address: "), address_of(&c_out, "remote address:"));
    assert_eq!(address_of(&c_out, "local address: "), address_of(&s_out, "remote address:"));
}

#[test]
fn sizes_and_mtus() {
    let iters = 25u64;
    for mtu in [256u32, 1024, 4096] {
        for size in [1u64, 64, 4096, 10000] {
            let (size_s, mtu_s, iters_s) = (size.to_string(), mtu.to_string(), iters.to_string());
            let shape = ["-s", size_s.as_str(), "-m", mtu_s.as_str(), "-n", iters_s.as_str()];
            let server: Vec<&str> = shape.iter().copied().chain(["--bind", "127.0.0.1"]).collect();
            let client: Vec<&str> = shape.iter().copied().chain(["--bind", "127.0.0.2"]).collect();
            let (server, client) = run_pair(&server, &client);
            check_pair(&server, &client, size, iters);
        }
    }
}

#[test]
fn completion_events_on_one_or_both_sides() {
    let (server, client) = run_pair(
        &["-e", "-s", "5000", "-n", "40", "--bind", "127.0.0.1"],
        &["-e", "-s", "5000", "-n", "40", "--bind", "127.0.0.2"],
    );
    check_pair(&server, &client, 5000, 40);
    let (server, client) = run_pair(
        &["-e", "-n", "40", "-r", "2", "--bind", "127.0.0.1"],
        &["-n", "40", "-r", "2", "--bind", "127.0.0.2"],
    );
    check_pair(&server, &client, 4096, 40);
}

#[test]
fn buffer_check() {
    // Both with -c: the client marks every page, the server finds every mark.
    let (server, client) = run_pair(
        &["-c", "-s", "10000", "-n", "10", "--bind", "127.0.0.1"],
        &["-c", "-s", "10000", "-n", "10", "--bind", "127.0.0.2"],
    );
    check_pair(&server, &client, 10000, 10);
    // Only the server checks: the unmarked pages (0x7b at their start) are reported, as the C
    // tool reports them, without failing the run.
    let (server, client) = run_pair(
        &["-c", "-s", "10000", "-n", "10", "--bind", "127.0.0.1"],
        &["-s", "10000", "-n", "10", "--bind", "127.0.0.2"],
    );
    assert!(server.status.success() && client.status.success());
    let (out, _) = text(&server);
    let reported: Vec<&str> = out.lines().skip(4).collect();
    assert_eq!(
        reported,
        ["invalid data in page 0", "invalid data in page 1", "invalid data in page 2"],
        "{out}"
    );
}

#[test]
fn addresses_default_to_the_tcp_connection() {
    // No --bind: the server uses the address the client reached (127.0.0.1); the client, whose
    // side of the connection is the same address, moves to 127.0.0.2.
    let (server, client) = run_pair(&["-n", "20"], &["-n", "20"]);
    check_pair(&server, &client, 4096, 20);
}

/// A fake server on `listener` that sends `reply` to whoever connects, after reading 52 bytes.
fn fake_server(listener: TcpListener, reply: Vec<u8>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut got = vec![0u8; 52];
        stream.read_exact(&mut got).unwrap();
        stream.write_all(&reply).unwrap();
        // Keep the connection open a little: the client must not need EOF to give up.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        got
    })
}

#[test]
fn a_server_that_is_not_a_pingpong() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let udp = free_udp_port().to_string();
    let fake = fake_server(listener, b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n".to_vec());
    let client =
        spawn(&strings(&["-p", &port, "--udp-port", &udp, "--bind", "127.0.0.2", "127.0.0.1"])).output();
    let (out, err) = text(&client);
    assert!(!client.status.success());
    assert!(err.contains("not an ibv_rc_pingpong") && err.contains("HTTP/1.1 400"), "{err}");
    // Only the local address was printed, and what the client sent was a real address message.
    assert_eq!(out.lines().count(), 1, "{out}");
    let sent = fake.join().unwrap();
    assert_eq!(sent[51], 0);
    assert!(sent.starts_with(b"0000:"), "{}", sent.escape_ascii());
    assert!(sent[..51].ends_with(b"00000000000000000000ffff7f000002"), "{}", sent.escape_ascii());
}

/// Connects to a server that may still be starting.
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
fn a_client_that_is_not_a_pingpong() {
    let (tcp, udp) = (free_tcp_port(), free_udp_port());
    let server =
        spawn(&strings(&["-p", &tcp.to_string(), "--udp-port", &udp.to_string(), "--bind", "127.0.0.1"]));
    let mut garbage = connect_when_listening(tcp);
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let output = server.output();
    let (_, err) = text(&output);
    assert!(!output.status.success());
    assert!(err.contains("not an ibv_rc_pingpong") && err.contains("GET / HTTP"), "{err}");
}

#[test]
fn a_client_that_vanishes_after_the_exchange() {
    let (tcp, udp) = (free_tcp_port(), free_udp_port());
    let server = spawn(&strings(&[
        "-p",
        &tcp.to_string(),
        "--udp-port",
        &udp.to_string(),
        "--bind",
        "127.0.0.1",
        "--timeout",
        "2",
    ]));
    // A correct exchange for a peer at 127.0.0.3 that then never sends anything.
    let mut stream = connect_when_listening(tcp);
    stream.write_all(b"0000:000042:000001:00000000000000000000ffff7f000003\0").unwrap();
    let mut reply = [0u8; 52];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(reply[51], 0);
    stream.write_all(b"done\0").unwrap();
    let output = server.output();
    let (out, err) = text(&output);
    assert!(!output.status.success(), "{out}");
    assert!(err.contains("stopped responding") && err.contains("0 sends and 0 receives"), "{err}");
    assert!(
        out.contains("remote address: LID 0x0000, QPN 0x000042, PSN 0x000001, GID ::ffff:127.0.0.3"),
        "{out}"
    );
}

#[test]
fn a_server_that_vanishes_after_the_exchange() {
    // The client sends first: its SEND to a peer that is not there exhausts the retries.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let udp = free_udp_port().to_string();
    let fake = fake_server(listener, b"0000:000042:000001:00000000000000000000ffff7f000003\0".to_vec());
    let client = spawn(&strings(&[
        "-p",
        &port,
        "--udp-port",
        &udp,
        "--bind",
        "127.0.0.2",
        "--timeout",
        "20",
        "127.0.0.1",
    ]))
    .output();
    let (_, err) = text(&client);
    assert!(!client.status.success());
    assert!(err.contains("transport retry counter exceeded") && err.contains("wr_id 2 (send)"), "{err}");
    fake.join().unwrap();
}

#[test]
fn unsupported_options_are_refused() {
    for (args, message) in [
        (&["-t"][..], "-t/--ts is not supported"),
        (&["-O"][..], "-O/--iodp is not supported"),
        (&["-g", "1"][..], "one GID, index 0"),
        (&["-i", "2"][..], "one port"),
        (&["-m", "1500"][..], "256, 512, 1024, 2048 or 4096"),
        (&["-d", "mlx5_0"][..], "not a soft device"),
        (&["--bind", "0.0.0.0"][..], "not a usable RoCE address"),
    ] {
        let output = spawn(&strings(args)).output();
        let (_, err) = text(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}
