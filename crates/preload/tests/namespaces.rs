//! Cross-host pairing: two programs in two network namespaces joined by a veth pair (MTU 1500,
//! the stand-in for two hosts), the python echo server in one and its client in the other.
//! With `LIGHTPATH_PRELOAD_PEERS` naming the pair's /24 and both ends preloaded, the connection
//! must switch to the soft provider (RoCE v2 over UDP: the report says `rdma/soft` and how
//! many bytes went over the stream); without the rule, or with one side plain, it stays TCP,
//! byte for byte, without a stall. Each test sets up namespaces of its own (names with the
//! test process's id) and removes them when it ends, also when it fails; a machine that cannot
//! create namespaces (not root, no `ip netns`) skips the tests with `SKIPPED <test>: <reason>`.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::netns::{command_in, namespaces, serve_in, Namespaces};
use common::{peers, run, scratch, shm_bytes, soft_bytes, wait_for_lines, Line, Mode};

/// `peers.py ARGS` inside namespace `ns`, listening on or connecting to `host`, with
/// `LIGHTPATH_PRELOAD_PEERS` set to `rule` (unset when None).
fn peer_in(ns: &str, host: &str, args: &[&str], mode: Mode, report: &Path, rule: Option<&str>) -> Command {
    let script = peers();
    let mut full = vec![script.to_str().unwrap()];
    full.extend_from_slice(args);
    let mut command = command_in(ns, "python3", &full, mode, report, rule);
    command.env("LP_PEER_HOST", host);
    command
}

fn sha256_of(path: &Path) -> String {
    let output = Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&output.stdout).split(' ').next().unwrap().to_string()
}

/// What an echo across the namespaces produced.
struct Echo {
    /// What the client printed ('sha256 <hex> <bytes>').
    printed: String,
    /// What it should have printed.
    expected: String,
    /// The report's connection lines.
    lines: Vec<Line>,
}

const ECHO_LEN: usize = 8 << 20;

/// An echo of `ECHO_LEN` bytes from a client in `b` to a server in `a`; `rule` is
/// `LIGHTPATH_PRELOAD_PEERS` for both; waits for `lines` report lines.
fn echo(
    name: &str,
    ns: &Namespaces,
    server_mode: Mode,
    client_mode: Mode,
    rule: Option<&str>,
    lines: usize,
) -> Echo {
    echo_with(name, ns, (server_mode, &[]), client_mode, rule, lines)
}

/// [`echo`] with variables set for the server only.
fn echo_with(
    name: &str,
    ns: &Namespaces,
    (server_mode, server_env): (Mode, &[(&str, &str)]),
    client_mode: Mode,
    rule: Option<&str>,
    lines: usize,
) -> Echo {
    let dir = scratch(name);
    let report_path = dir.join("report");
    let input = dir.join("input");
    std::fs::write(&input, common::random_bytes(ECHO_LEN, 7)).unwrap();
    // Any port is free in a fresh namespace; one free here too does no harm.
    let port = common::free_port().to_string();
    let host = ns.server_address();
    let mut server = peer_in(&ns.a, &host, &["echo-server", &port, "100"], server_mode, &report_path, rule);
    server.envs(server_env.iter().copied());
    let _server = serve_in(&ns.a, server, port.parse().unwrap(), "echo server");
    let output = run(
        peer_in(
            &ns.b,
            &host,
            &["echo-client", &port, input.to_str().unwrap()],
            client_mode,
            &report_path,
            rule,
        ),
        Duration::from_secs(30),
        "echo client",
    );
    assert!(output.status.success(), "client failed: {}", String::from_utf8_lossy(&output.stderr));
    let expected = format!("sha256 {} {ECHO_LEN}", sha256_of(&input));
    let lines = wait_for_lines(&report_path, lines, Duration::from_secs(10));
    Echo { printed: String::from_utf8_lossy(&output.stdout).trim().to_string(), expected, lines }
}

/// Every line is of a connection between the two namespaces' addresses (over the veth pair).
fn assert_over_the_pair(ns: &Namespaces, lines: &[Line]) {
    let prefix = format!("{}.", ns.net);
    for line in lines {
        assert!(
            line.local.starts_with(&prefix) && line.peer.starts_with(&prefix),
            "a connection not over the veth pair: {line:?}"
        );
    }
}

/// A line of a connection that stayed TCP: every echoed byte counted over TCP, none over a stream.
fn assert_plain_tcp(line: &Line) {
    assert!(line.transport.starts_with("tcp"), "{line:?}");
    assert_eq!(line.rdma_in + line.rdma_out, 0, "{line:?}");
    assert_eq!((line.tcp_in, line.tcp_out), (ECHO_LEN as u64, ECHO_LEN as u64), "{line:?}");
}

#[test]
fn echo_between_namespaces_both_preloaded_switches_to_soft() {
    let test = "echo_between_namespaces_both_preloaded_switches_to_soft";
    let Some(ns) = namespaces(test) else {
        return;
    };
    let rule = ns.subnet();
    let echo = echo("netns-soft", &ns, Mode::Preloaded, Mode::Preloaded, Some(&rule), 2);
    assert_eq!(echo.printed, echo.expected, "the echo differs from what was sent");
    let lines = &echo.lines;
    assert_eq!(lines.len(), 2, "one line per end expected: {lines:#?}");
    assert_over_the_pair(&ns, lines);
    for line in lines {
        assert_eq!(line.transport, "rdma/soft", "both ends should have switched to soft: {lines:#?}");
    }
    assert!(soft_bytes(lines) > 1 << 20, "less than 1 MiB of the echo went over soft: {lines:#?}");
}

/// A server that empties its environment once started (nginx does, for its workers) keeps
/// the library's settings: they are read when the library loads. Before they were, its
/// connections read `LIGHTPATH_PRELOAD_PEERS` when they came, found nothing, and stayed TCP
/// ("the peer is on another host").
#[test]
fn a_server_that_clears_its_environment_still_switches_to_soft() {
    let test = "a_server_that_clears_its_environment_still_switches_to_soft";
    let Some(ns) = namespaces(test) else {
        return;
    };
    let rule = ns.subnet();
    let server = (Mode::Preloaded, &[("LP_CLEAR_ENV", "1")][..]);
    let echo = echo_with("netns-clear-env", &ns, server, Mode::Preloaded, Some(&rule), 2);
    assert_eq!(echo.printed, echo.expected, "the echo differs from what was sent");
    let lines = &echo.lines;
    assert_eq!(lines.len(), 2, "one line per end expected: {lines:#?}");
    for line in lines {
        assert_eq!(line.transport, "rdma/soft", "both ends should have switched to soft: {lines:#?}");
    }
}

/// TCP_CORK on a connection switched to soft: a response sent in two parts under the cork
/// arrives whole, whether the server uncorks after it or leaves the cork on while it waits for
/// the next request (then the hold ends by itself, as Linux ends a cork after 200 ms; a cork
/// held for good would leave the client waiting for ever).
#[test]
fn corked_responses_over_soft_arrive_whether_or_not_uncorked() {
    let test = "corked_responses_over_soft_arrive_whether_or_not_uncorked";
    let Some(ns) = namespaces(test) else {
        return;
    };
    let rule = ns.subnet();
    let dir = scratch("netns-cork");
    let report_path = dir.join("report");
    let port = common::free_port().to_string();
    let host = ns.server_address();
    let _server = serve_in(
        &ns.a,
        peer_in(&ns.a, &host, &["cork-server", &port, "1"], Mode::Preloaded, &report_path, Some(&rule)),
        port.parse().unwrap(),
        "cork server",
    );
    let output = run(
        peer_in(&ns.b, &host, &["cork-client", &port, "40"], Mode::Preloaded, &report_path, Some(&rule)),
        Duration::from_secs(60),
        "cork client",
    );
    let lines = common::assert_cork_client_done(&output, 40, &report_path, "rdma/soft");
    assert!(soft_bytes(&lines) > 0, "nothing went over soft: {lines:#?}");
}

#[test]
fn echo_between_namespaces_without_peers_rule_stays_tcp() {
    let test = "echo_between_namespaces_without_peers_rule_stays_tcp";
    let Some(ns) = namespaces(test) else {
        return;
    };
    let echo = echo("netns-no-rule", &ns, Mode::Preloaded, Mode::Preloaded, None, 2);
    assert_eq!(echo.printed, echo.expected, "the echo differs from what was sent");
    let lines = &echo.lines;
    assert_eq!(lines.len(), 2, "one line per end expected: {lines:#?}");
    assert_over_the_pair(&ns, lines);
    assert_eq!(soft_bytes(lines) + shm_bytes(lines), 0, "{lines:#?}");
    lines.iter().for_each(assert_plain_tcp);
}

#[test]
fn echo_between_namespaces_with_one_side_plain_stays_tcp() {
    let test = "echo_between_namespaces_with_one_side_plain_stays_tcp";
    let Some(ns) = namespaces(test) else {
        return;
    };
    let rule = ns.subnet();
    // The client's deadline (common::run in echo) fails the test on a stall.
    let echo = echo("netns-one-plain", &ns, Mode::Preloaded, Mode::Plain, Some(&rule), 1);
    assert_eq!(echo.printed, echo.expected, "a plain client saw something else than over plain TCP");
    let lines = &echo.lines;
    assert_eq!(lines.len(), 1, "only the preloaded server reports: {lines:#?}");
    assert_over_the_pair(&ns, lines);
    assert_plain_tcp(&lines[0]);
}

/// An epoll program over soft between the namespaces: each preloaded end's soft queue pair
/// has a UDP port of its own (the default), a third event fd beside the notification fd and
/// the liveness connection; the preload's epoll must watch it too. `epoll-client` echoes its
/// lines one by one waiting in an epoll, then checks that a deleted, hung-up connection
/// leaves a wait idle (its CPU time).
#[test]
fn an_epoll_client_between_namespaces_over_soft() {
    let test = "an_epoll_client_between_namespaces_over_soft";
    let Some(ns) = namespaces(test) else {
        return;
    };
    let rule = ns.subnet();
    let dir = scratch("netns-epoll");
    let report_path = dir.join("report");
    let port = common::free_port().to_string();
    let host = ns.server_address();
    let _server = serve_in(
        &ns.a,
        peer_in(&ns.a, &host, &["echo-server", &port, "1"], Mode::Preloaded, &report_path, Some(&rule)),
        port.parse().unwrap(),
        "echo server",
    );
    let output = run(
        peer_in(&ns.b, &host, &["epoll-client", &port, "300"], Mode::Preloaded, &report_path, Some(&rule)),
        Duration::from_secs(60),
        "epoll client",
    );
    assert!(output.status.success(), "epoll client failed: {}", String::from_utf8_lossy(&output.stderr));
    let printed = String::from_utf8_lossy(&output.stdout);
    let cpu: f64 = printed
        .trim()
        .strip_prefix("ok 300 cpu ")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output: {printed}"));
    // A wait that kept being woken (by the port, say) would spin for the whole second.
    assert!(cpu < 0.2, "a 1 s wait with the deleted, hung-up connection took {cpu} s of CPU");
    let lines = wait_for_lines(&report_path, 2, Duration::from_secs(10));
    assert_over_the_pair(&ns, &lines);
    assert!(lines.iter().all(|l| l.transport == "rdma/soft"), "{lines:#?}");
    assert!(soft_bytes(&lines) > 0, "nothing went over soft: {lines:#?}");
}
