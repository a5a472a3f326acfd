//! Socket calls beyond read and write on preloaded connections, with python peers
//! (`tests/helpers/calls.py`): `splice` between a connection and a pipe (the bytes a pipe
//! cannot take stay in the connection), `recv` with `MSG_TRUNC` (the bytes are discarded, as
//! TCP does) and `send` with `MSG_MORE` (held for the next send; never held for good). Both
//! sides preloaded (the connection switches to shm), and with the client plain (it stays TCP,
//! and the emulated calls must count its bytes right).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{command, peers, require, run, scratch, serve, shm_bytes, wait_for_lines, Line, Mode};

fn calls() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/calls.py")
}

fn sha256_hex(data: &[u8]) -> String {
    let output = std::process::Command::new("python3")
        .args(["-c", "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(data)?;
            child.wait_with_output()
        })
        .expect("python3 for sha256");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// The report's lines once both ends (or only the server, with a plain client) wrote theirs.
fn lines_of(report: &std::path::Path, client: Mode) -> Vec<Line> {
    let ends = if client == Mode::Preloaded { 2 } else { 1 };
    let lines = wait_for_lines(report, ends, Duration::from_secs(10));
    assert_eq!(lines.len(), ends, "one line per preloaded end: {lines:#?}");
    lines
}

/// Both preloaded: the connection ended on shm with bytes over it; client plain: TCP only.
fn assert_transport(lines: &[Line], client: Mode) {
    if client == Mode::Preloaded {
        assert!(lines.iter().all(|l| l.transport == "rdma/shm"), "{lines:#?}");
        assert!(shm_bytes(lines) > 0, "nothing went over shm: {lines:#?}");
    } else {
        assert!(lines.iter().all(|l| l.transport.starts_with("tcp")), "{lines:#?}");
        assert_eq!(shm_bytes(lines), 0, "{lines:#?}");
    }
}

#[test]
fn splice_echo_through_a_pipe_is_exact() {
    if !require("splice_echo", &["python3"]) {
        return;
    }
    let len = 6 << 20;
    for client in [Mode::Preloaded, Mode::Plain] {
        let dir = scratch(&format!("splice-{client:?}"));
        let report = dir.join("report");
        let input = dir.join("input");
        let data = common::random_bytes(len, 21);
        std::fs::write(&input, &data).unwrap();
        let port = common::free_port().to_string();
        let server = command(
            "python3",
            &[calls().to_str().unwrap(), "splice-server", &port],
            Mode::Preloaded,
            &report,
        );
        let _server = serve(server, port.parse().unwrap(), "splice server");
        let script = peers();
        let output = run(
            command(
                "python3",
                &[script.to_str().unwrap(), "echo-client", &port, input.to_str().unwrap()],
                client,
                &report,
            ),
            Duration::from_secs(60),
            "echo client",
        );
        assert!(output.status.success(), "client failed: {}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).trim(),
            format!("sha256 {} {len}", sha256_hex(&data)),
            "the echo spliced through a pipe differs (client {client:?})"
        );
        assert_transport(&lines_of(&report, client), client);
    }
}

#[test]
fn msg_trunc_discards_and_msg_more_is_sent() {
    if !require("msg_trunc_and_more", &["python3"]) {
        return;
    }
    // More than the library discards in one piece (1 MiB), so MSG_WAITALL must loop.
    let skip = (3 << 20) / 2;
    for client in [Mode::Preloaded, Mode::Plain] {
        let dir = scratch(&format!("trunc-more-{client:?}"));
        let report = dir.join("report");
        let input = dir.join("input");
        std::fs::write(&input, common::random_bytes(3 << 20, 5)).unwrap();
        let port = common::free_port().to_string();
        let script = calls();
        let script = script.to_str().unwrap();
        let server = command(
            "python3",
            &[script, "trunc-more-server", &port, &skip.to_string()],
            Mode::Preloaded,
            &report,
        );
        let _server = serve(server, port.parse().unwrap(), "trunc-more server");
        let output = run(
            command(
                "python3",
                &[script, "trunc-more-client", &port, input.to_str().unwrap(), &skip.to_string()],
                client,
                &report,
            ),
            Duration::from_secs(60),
            "trunc-more client",
        );
        assert!(
            output.status.success(),
            "client {client:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "ok");
        assert_transport(&lines_of(&report, client), client);
    }
}

/// Writes after the peer closed fail, as a TCP writer's second write after the peer's close
/// does (the kernel answers the first with a reset): over shm too. Before the stream's write
/// path looked at its liveness channel now and then, a nonblocking stream (the preload's
/// streams are) accepted them all and dropped them while the peer's queue pair lived: the
/// client printed "never failed".
#[test]
fn writes_after_the_peers_close_fail() {
    if !require("writes_after_close", &["python3"]) {
        return;
    }
    for client in [Mode::Preloaded, Mode::Plain] {
        let dir = scratch(&format!("late-writer-{client:?}"));
        let report = dir.join("report");
        let port = common::free_port().to_string();
        let script = calls();
        let script = script.to_str().unwrap();
        let server = command("python3", &[script, "close-server", &port], Mode::Preloaded, &report);
        let _server = serve(server, port.parse().unwrap(), "close server");
        let output = run(
            command("python3", &[script, "late-writer", &port], client, &report),
            Duration::from_secs(30),
            "late writer",
        );
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let printed = String::from_utf8_lossy(&output.stdout).trim().to_string();
        assert!(printed.starts_with("ok "), "client {client:?}: {printed}");
        assert_transport(&lines_of(&report, client), client);
    }
}
