//! Blocking programs through the preload library: python peers (banner-first servers, clients
//! that wait to read, echo), socat, python3 -m http.server with curl. Each pair runs with
//! both sides preloaded (the bytes must move over shm after the switch: the library's report
//! says how many) and with one side plain (plain TCP, byte for byte, no stall).

mod common;

use std::time::Duration;

use common::{
    command, curl_download, peers, report, require, run, scratch, serve, shm_bytes, wait_for_lines, Mode,
};

/// The transcript of a banner-first exchange (server speaks first, client waits to read).
fn banner_exchange(name: &str, server_mode: Mode, client_mode: Mode) -> (String, Vec<common::Line>) {
    let dir = scratch(name);
    let report_path = dir.join("report");
    let port = common::free_port();
    let script = peers();
    let script = script.to_str().unwrap();
    // The server serves connections one by one until the test ends.
    let _server = serve(
        command("python3", &[script, "banner-server", &port.to_string(), "100"], server_mode, &report_path),
        port,
        "banner server",
    );
    let output = run(
        command(
            "python3",
            &[script, "banner-client", &port.to_string(), "40", "10"],
            client_mode,
            &report_path,
        ),
        Duration::from_secs(30),
        "banner client",
    );
    assert!(output.status.success(), "client failed: {}", String::from_utf8_lossy(&output.stderr));
    let preloaded = [server_mode, client_mode].iter().filter(|m| **m == Mode::Preloaded).count();
    let expected = preloaded;
    let lines = wait_for_lines(&report_path, expected, Duration::from_secs(10));
    (String::from_utf8_lossy(&output.stdout).trim().to_string(), lines)
}

/// The transcript a plain pair produces (the reference).
fn reference_transcript() -> String {
    banner_exchange("banner-reference", Mode::Plain, Mode::Plain).0
}

#[test]
fn banner_first_server_and_waiting_client_both_preloaded_switch_to_shm() {
    if !require("banner_first_both_preloaded", &["python3"]) {
        return;
    }
    let reference = reference_transcript();
    let (transcript, lines) = banner_exchange("banner-both", Mode::Preloaded, Mode::Preloaded);
    assert_eq!(transcript, reference, "the exchange differs from plain TCP");
    let shm = shm_bytes(&lines);
    assert!(shm > 10_000, "expected most of the 40 exchanges over shm, report: {lines:#?}");
}

/// TCP_CORK over shm: a response sent in two parts under the cork arrives whole, whether
/// the server uncorks after it or leaves the cork on while it waits for the next request
/// (the hold then ends by itself, as Linux ends a cork after 200 ms).
#[test]
fn corked_responses_over_shm_arrive_whether_or_not_uncorked() {
    if !require("corked_responses_over_shm", &["python3"]) {
        return;
    }
    let dir = scratch("cork-shm");
    let report_path = dir.join("report");
    let script = peers();
    let script = script.to_str().unwrap();
    let port = common::free_port();
    let _server = serve(
        command("python3", &[script, "cork-server", &port.to_string(), "1"], Mode::Preloaded, &report_path),
        port,
        "cork server",
    );
    let output = run(
        command("python3", &[script, "cork-client", &port.to_string(), "40"], Mode::Preloaded, &report_path),
        Duration::from_secs(60),
        "cork client",
    );
    let lines = common::assert_cork_client_done(&output, 40, &report_path, "rdma/shm");
    assert!(shm_bytes(&lines) > 0, "nothing went over shm: {lines:#?}");
}

#[test]
fn banner_first_preloaded_server_and_plain_client_stay_plain_tcp() {
    if !require("banner_preloaded_server_plain_client", &["python3"]) {
        return;
    }
    let reference = reference_transcript();
    let (transcript, lines) = banner_exchange("banner-server-only", Mode::Preloaded, Mode::Plain);
    assert_eq!(transcript, reference, "a plain client saw something else than over plain TCP");
    assert!(!lines.is_empty(), "the preloaded server reports its connections");
    for line in &lines {
        assert!(line.transport.starts_with("tcp"), "{line:?}");
        assert_eq!(line.rdma_in + line.rdma_out, 0, "{line:?}");
    }
}

#[test]
fn plain_banner_server_and_preloaded_waiting_client_stay_plain_tcp() {
    if !require("banner_plain_server_preloaded_client", &["python3"]) {
        return;
    }
    let reference = reference_transcript();
    let (transcript, lines) = banner_exchange("banner-client-only", Mode::Plain, Mode::Preloaded);
    assert_eq!(transcript, reference);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].transport.starts_with("tcp"), "{:?}", lines[0]);
    assert!(lines[0].tcp_in > 16_000 && lines[0].tcp_out > 16_000, "{:?}", lines[0]);
}

/// An echo of `len` bytes: (bytes back, their sha256 as the client printed it, report).
fn echo(name: &str, len: usize, server_mode: Mode, client_mode: Mode) -> (String, String, Vec<common::Line>) {
    echo_with("echo-client", name, len, server_mode, client_mode)
}

/// [`echo`] with the python peers' client `client` (`echo-client` or `scatter-client`).
fn echo_with(
    client: &str,
    name: &str,
    len: usize,
    server_mode: Mode,
    client_mode: Mode,
) -> (String, String, Vec<common::Line>) {
    let dir = scratch(name);
    let report_path = dir.join("report");
    let input = dir.join("input");
    std::fs::write(&input, common::random_bytes(len, 7)).unwrap();
    let port = common::free_port();
    let script = peers();
    let script = script.to_str().unwrap();
    let _server = serve(
        command("python3", &[script, "echo-server", &port.to_string(), "100"], server_mode, &report_path),
        port,
        "echo server",
    );
    let output = run(
        command(
            "python3",
            &[script, client, &port.to_string(), input.to_str().unwrap()],
            client_mode,
            &report_path,
        ),
        Duration::from_secs(60),
        "echo client",
    );
    assert!(output.status.success(), "client failed: {}", String::from_utf8_lossy(&output.stderr));
    let expected = sha256_of(&input);
    let lines = wait_for_lines(&report_path, 2, Duration::from_secs(5));
    (String::from_utf8_lossy(&output.stdout).trim().to_string(), expected, lines)
}

fn sha256_of(path: &std::path::Path) -> String {
    let output = std::process::Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&output.stdout).split(' ').next().unwrap().to_string()
}

#[test]
fn echo_of_8_mib_both_preloaded_is_exact_and_mostly_over_shm() {
    if !require("echo_both_preloaded", &["python3", "sha256sum"]) {
        return;
    }
    let len = 8 << 20;
    let (printed, expected, lines) = echo("echo-both", len, Mode::Preloaded, Mode::Preloaded);
    assert_eq!(printed, format!("sha256 {expected} {len}"));
    assert!(shm_bytes(&lines) > (len as u64), "less than half the echo went over shm: {lines:#?}");
}

#[test]
fn readv_and_recvmsg_fill_every_buffer_they_are_given() {
    if !require("readv_and_recvmsg_scatter", &["python3", "sha256sum"]) {
        return;
    }
    let len = 4 << 20;
    let (printed, expected, lines) =
        echo_with("scatter-client", "scatter", len, Mode::Preloaded, Mode::Preloaded);
    let mut words = printed.split_whitespace();
    assert_eq!(words.next(), Some("sha256"), "{printed}");
    assert_eq!(words.next(), Some(expected.as_str()), "the bytes read back differ: {printed}");
    assert_eq!(words.next(), Some(len.to_string().as_str()), "{printed}");
    let most: usize = words.nth(1).and_then(|w| w.parse().ok()).expect("the most bytes one call read");
    // 7 + 13 bytes in the first two buffers: a call that filled only the first buffer (a legal
    // short read, but every time) would never return more than 7.
    assert!(most > 20, "no readv/recvmsg call filled more than its first buffer: {printed}");
    assert!(shm_bytes(&lines) > 0, "the exchange should have switched to shm: {lines:#?}");
}

#[test]
fn echo_with_one_side_plain_is_exact_both_ways() {
    if !require("echo_one_side_plain", &["python3", "sha256sum"]) {
        return;
    }
    let len = 2 << 20;
    for (server, client) in [(Mode::Preloaded, Mode::Plain), (Mode::Plain, Mode::Preloaded)] {
        let (printed, expected, lines) = echo("echo-one", len, server, client);
        assert_eq!(printed, format!("sha256 {expected} {len}"), "server {server:?}, client {client:?}");
        assert_eq!(shm_bytes(&lines), 0, "{lines:#?}");
        assert!(lines.iter().all(|l| l.transport.starts_with("tcp")), "{lines:#?}");
    }
}

#[test]
fn socat_relay_both_preloaded_moves_the_file_over_shm() {
    if !require("socat_relay", &["socat", "sha256sum"]) {
        return;
    }
    let dir = scratch("socat");
    let report_path = dir.join("report");
    let input = dir.join("input");
    let output_path = dir.join("output");
    std::fs::write(&input, common::random_bytes(6 << 20, 11)).unwrap();
    let port = common::free_port();
    // A fork server (-u: network to file): each connection's child writes what it receives.
    let _server = serve(
        command(
            "socat",
            &[
                "-u",
                &format!("TCP-LISTEN:{port},reuseaddr,fork,bind=127.0.0.1"),
                &format!("CREATE:{}", output_path.display()),
            ],
            Mode::Preloaded,
            &report_path,
        ),
        port,
        "socat server",
    );
    // The file is fed at a modest pace (64 KiB every 5 ms) so the connection lives long enough to switch.
    std::thread::sleep(Duration::from_millis(200));
    let pipeline = format!(
        "python3 -c 'import sys,time\nd=open(sys.argv[1],\"rb\").read()\nfor i in range(0,len(d),65536):\n sys.stdout.buffer.write(d[i:i+65536]); sys.stdout.flush(); time.sleep(0.005)' {} | socat -u STDIN TCP:127.0.0.1:{port}",
        input.display()
    );
    let client = command("sh", &["-c", &pipeline], Mode::Preloaded, &report_path);
    let result = run(client, Duration::from_secs(60), "socat client");
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(&output_path).map(|m| m.len()).unwrap_or(0) < 6 << 20
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(sha256_of(&output_path), sha256_of(&input));
    let lines = wait_for_lines(&report_path, 3, Duration::from_secs(5));
    assert!(shm_bytes(&lines) > 0, "nothing went over shm: {lines:#?}");
}

#[test]
fn python_http_server_and_curl_both_preloaded_and_curl_alone() {
    if !require("http_server_curl", &["python3", "curl", "sha256sum"]) {
        return;
    }
    let dir = scratch("http");
    let report_path = dir.join("report");
    let file = dir.join("file.bin");
    // Larger than what loopback socket buffers hold (several MiB), so the server still has
    // bytes to send once the connection has switched.
    std::fs::write(&file, common::random_bytes(24 << 20, 5)).unwrap();
    let port = common::free_port();
    let mut server_command = command(
        "python3",
        &[
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--directory",
            dir.to_str().unwrap(),
        ],
        Mode::Preloaded,
        &report_path,
    );
    server_command.current_dir(&dir);
    let _server = serve(server_command, port, "python3 -m http.server");
    let expected = sha256_of(&file);
    for (i, mode) in [Mode::Preloaded, Mode::Preloaded, Mode::Plain, Mode::Preloaded].into_iter().enumerate()
    {
        let got = dir.join(format!("got{i}"));
        let url = format!("http://127.0.0.1:{port}/file.bin");
        let output = curl_download(&url, &got, mode, &report_path, Duration::from_secs(30));
        assert!(output.status.success(), "curl {i} ({mode:?}): {}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(sha256_of(&got), expected, "download {i} ({mode:?})");
    }
    let lines = wait_for_lines(&report_path, 8, Duration::from_secs(5));
    assert!(shm_bytes(&lines) >= 4 << 20, "no download went over shm: {lines:#?}");
    let plain = report(&report_path).into_iter().filter(|l| l.transport.starts_with("tcp")).count();
    assert!(plain >= 1, "the plain curl's connection is reported as TCP");
}
