//! Connections that outlive the image that switched them: a program that `execve`s with a
//! switched connection open (its new image writes on the inherited socket, then reads the
//! client's answer from it), and a CGI
//! program that python3's `http.server --cgi` forks and execs with the connection as its
//! standard output after the server answered the headers. What the new program writes goes
//! over TCP after the stream's bytes (the library sends back on TCP before an exec, and a
//! reader takes TCP bytes that come after the peer's switch point once the stream ended:
//! `src/conn.rs`); before, the reader saw the stream end early (0 bytes of the CGI body) or
//! a reset. On one host (shm) and between two namespaces (soft). Python peers in
//! `tests/helpers/calls.py`, the CGI program in `tests/helpers/cgi-bin/pattern.py`.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::netns::{namespaces_for, serve_in, Namespaces};
use common::{command, require, run, scratch, serve, wait_for_lines, Line, Mode};

fn helpers() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/helpers")
}

fn calls() -> String {
    helpers().join("calls.py").to_str().unwrap().to_string()
}

/// The sha256 of `n` bytes of the peers' pattern.
fn pattern_sha256(n: usize) -> String {
    let output = std::process::Command::new("python3")
        .args([calls().as_str(), "pattern-sha256", &n.to_string()])
        .output()
        .expect("python3");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Where a run happens: this host (shm), or two namespaces (soft).
enum Place {
    Host,
    Pair(Namespaces),
}

impl Place {
    fn server_address(&self) -> String {
        match self {
            Place::Host => "127.0.0.1".into(),
            Place::Pair(ns) => ns.server_address(),
        }
    }

    fn transport(&self) -> &'static str {
        match self {
            Place::Host => "rdma/shm",
            Place::Pair(_) => "rdma/soft",
        }
    }

    /// `program ARGS`, preloaded, on the server's side (`server`) or the client's.
    fn command(
        &self,
        server: bool,
        program: &str,
        args: &[&str],
        report: &std::path::Path,
    ) -> std::process::Command {
        let mut command = match self {
            Place::Host => command(program, args, Mode::Preloaded, report),
            Place::Pair(ns) => {
                let side = if server { &ns.a } else { &ns.b };
                ns.command(side, program, args, Mode::Preloaded, report)
            }
        };
        command.env("LP_PEER_HOST", self.server_address());
        command
    }

    fn serve(&self, command: std::process::Command, port: u16, name: &str) -> common::Background {
        match self {
            Place::Host => serve(command, port, name),
            Place::Pair(ns) => serve_in(&ns.a, command, port, name),
        }
    }
}

/// The client's line in `lines` (the one whose peer is the server's port).
fn client_line(lines: &[Line], port: u16) -> Line {
    let suffix = format!(":{port}");
    lines
        .iter()
        .find(|l| l.peer.ends_with(&suffix))
        .cloned()
        .unwrap_or_else(|| panic!("no client line for port {port}: {lines:#?}"))
}

/// The exec'd image's bytes, after an exchange over the stream.
fn exec_keeps_writing(place: Place, name: &str) {
    let dir = scratch(name);
    let report = dir.join("report");
    let port = common::free_port();
    let p = port.to_string();
    let calls = calls();
    let _server = place.serve(
        place.command(true, "python3", &[&calls, "exec-server", &p], &report),
        port,
        "exec server",
    );
    let n = 3_000_000;
    let output = run(
        place.command(false, "python3", &[&calls, "exec-client", &p, "30", &n.to_string()], &report),
        Duration::from_secs(60),
        "exec client",
    );
    assert!(output.status.success(), "client failed: {}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("sha256 {} {n} OK EXTRA 12345", pattern_sha256(n)),
        "what the exec'd image wrote did not arrive whole, or what the client sent after the exec did not reach it"
    );
    let line = client_line(&wait_for_lines(&report, 1, Duration::from_secs(10)), port);
    assert_eq!(
        line.transport,
        place.transport(),
        "the connection should have switched before the exec: {line:?}"
    );
    assert!(line.rdma_in > 0, "the echoes before the exec should have come over the stream: {line:?}");
    assert!(line.tcp_in >= n as u64, "the exec'd image's bytes come over TCP: {line:?}");
}

/// A CGI body written by a forked and exec'd child, after headers the server wrote itself.
fn cgi_body_arrives(place: Place, name: &str) {
    let dir = scratch(name);
    let report = dir.join("report");
    let port = common::free_port();
    let p = port.to_string();
    let bind = place.server_address();
    let mut server =
        place.command(true, "python3", &["-m", "http.server", "--cgi", &p, "--bind", &bind], &report);
    server.current_dir(helpers());
    let _server = place.serve(server, port, "http.server --cgi");
    let n = 3_000_000;
    let got = dir.join("body");
    for round in 0..3 {
        let url = format!("http://{bind}:{p}/cgi-bin/pattern.py?{n}");
        let output = run(
            place.command(false, "curl", &["-sS", "-o", got.to_str().unwrap(), &url], &report),
            Duration::from_secs(60),
            "curl",
        );
        assert!(output.status.success(), "curl {round}: {}", String::from_utf8_lossy(&output.stderr));
        let sum = std::process::Command::new("sha256sum").arg(&got).output().expect("sha256sum");
        let sum = String::from_utf8_lossy(&sum.stdout).split(' ').next().unwrap_or("").to_string();
        let size = std::fs::metadata(&got).map(|m| m.len()).unwrap_or(0);
        assert_eq!((sum, size), (pattern_sha256(n), n as u64), "CGI body of round {round}");
    }
    let lines = wait_for_lines(&report, 6, Duration::from_secs(10));
    let switched = lines.iter().filter(|l| l.transport == place.transport()).count();
    assert!(switched >= 2, "no request switched before its CGI child ran: {lines:#?}");
}

#[test]
fn an_execd_program_writes_after_the_stream_on_one_host() {
    if require("exec_one_host", &["python3"]) {
        exec_keeps_writing(Place::Host, "exec-host");
    }
}

#[test]
fn an_execd_program_writes_after_the_stream_between_namespaces() {
    if let Some(ns) = namespaces_for("exec_namespaces", &["python3"]) {
        exec_keeps_writing(Place::Pair(ns), "exec-pair");
    }
}

#[test]
fn a_cgi_childs_output_reaches_a_preloaded_curl_on_one_host() {
    if require("cgi_one_host", &["python3", "curl", "sha256sum"]) {
        cgi_body_arrives(Place::Host, "cgi-host");
    }
}

#[test]
fn a_cgi_childs_output_reaches_a_preloaded_curl_between_namespaces() {
    if let Some(ns) = namespaces_for("cgi_namespaces", &["python3", "curl", "sha256sum"]) {
        cgi_body_arrives(Place::Pair(ns), "cgi-pair");
    }
}
