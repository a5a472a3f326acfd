//! `lightpath cat` and `lightpath perf stream_*` as processes: bytes both ways through cat with
//! end of stream, and small perf runs over soft, shm and tcp whose JSON is checked.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::wait_listening;

const BIN: &str = env!("CARGO_BIN_EXE_lightpath");

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn cat_round_trip(provider: &str) {
    let port = free_port();
    let mut server = Command::new(BIN)
        .args(["cat", "-l", &port.to_string(), "-v", "--provider", provider])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_listening(port);
    let mut client = Command::new(BIN)
        .args(["cat", "127.0.0.1", &port.to_string(), "-v", "--provider", provider])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let to_server: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let to_client: Vec<u8> = (0..70_000u32).map(|i| (i % 13) as u8 + b'a').collect();
    let mut client_in = client.stdin.take().unwrap();
    let mut server_in = server.stdin.take().unwrap();
    let (a, b) = (to_server.clone(), to_client.clone());
    let writers = std::thread::spawn(move || {
        client_in.write_all(&a).unwrap();
        drop(client_in);
        server_in.write_all(&b).unwrap();
        drop(server_in);
    });
    let client_out = client.wait_with_output().unwrap();
    // The server ends once its client has; a server still waiting (its client went elsewhere,
    // or failed before it connected) is a failure with the client's words, not a hang. (Its
    // output is read meanwhile: a full pipe would stop it.)
    let server_pid = server.id();
    let (done, server_exit) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(server.wait_with_output());
    });
    let server_out = match server_exit.recv_timeout(Duration::from_secs(30)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg(server_pid.to_string()).status();
            panic!(
                "the {provider} server did not end within 30 s of its client\nclient: {}",
                String::from_utf8_lossy(&client_out.stderr)
            );
        }
    };
    writers.join().unwrap();
    assert!(client_out.status.success(), "{}", String::from_utf8_lossy(&client_out.stderr));
    assert!(server_out.status.success(), "{}", String::from_utf8_lossy(&server_out.stderr));
    assert_eq!(server_out.stdout, to_server);
    assert_eq!(client_out.stdout, to_client);
    let expected = match provider {
        "soft" | "shm" => format!("transport rdma/{provider}"),
        _ => "transport tcp".to_string(),
    };
    assert!(
        String::from_utf8_lossy(&client_out.stderr).contains(&expected),
        "{}",
        String::from_utf8_lossy(&client_out.stderr)
    );
}

#[test]
fn cat_over_soft() {
    cat_round_trip("soft");
}

#[test]
fn cat_over_shm() {
    cat_round_trip("shm");
}

#[test]
fn cat_over_tcp() {
    cat_round_trip("tcp");
}

fn perf(test: &str, provider: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    perf_with_server(test, provider, &[], extra, |_| {})
}

/// Runs a perf stream test: a server with `server_extra`, then `before_client(port)`, then the
/// client with `extra`; both must succeed. Returns the client's JSON lines.
fn perf_with_server(
    test: &str,
    provider: &str,
    server_extra: &[&str],
    extra: &[&str],
    before_client: impl FnOnce(u16),
) -> Vec<serde_json::Value> {
    let port = free_port();
    let port_arg = port.to_string();
    let mut server = Command::new(BIN)
        .args(["perf", test, "-p", &port_arg, "--provider", provider])
        .args(server_extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    before_client(port);
    let client = Command::new(BIN)
        .args(["perf", test, "127.0.0.1", "-p", &port_arg, "--provider", provider, "--json"])
        .args(extra)
        .output()
        .unwrap();
    let mut server_err = String::new();
    if !client.status.success() {
        let _ = server.kill();
    }
    let status = server.wait().unwrap();
    server.stderr.take().unwrap().read_to_string(&mut server_err).unwrap();
    assert!(
        client.status.success(),
        "client: {}\nserver: {server_err}",
        String::from_utf8_lossy(&client.stderr)
    );
    assert!(status.success(), "server: {server_err}");
    String::from_utf8(client.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect()
}

/// Both processes' CPU time is reported, with the per-request or per-GB figure.
fn check_cpu(result: &serde_json::Value, per: &str) {
    assert!(result["cpu_s"].as_f64().unwrap() > 0.0, "{result}");
    assert!(result["server_cpu_s"].as_f64().unwrap() > 0.0, "{result}");
    assert!(result[per].as_f64().unwrap() > 0.0, "{result}");
}

/// What a run's JSON must say carried it: RDMA over the provider asked for, plain kernel TCP
/// for `tcp` (the baseline: no Lightpath in the data path), Lightpath's TCP fallback for
/// `fallback`.
fn check_transport(provider: &str, transport: &str) {
    match provider {
        "tcp" => assert_eq!(transport, "kernel tcp"),
        "fallback" => assert!(transport.starts_with("tcp (fallback"), "{transport}"),
        _ => assert!(transport.starts_with(&format!("rdma/{provider}")), "{transport}"),
    }
}

#[test]
fn perf_stream_tests_over_soft_shm_tcp_and_the_fallback() {
    for provider in ["soft", "shm", "tcp", "fallback"] {
        let lat = perf("stream_lat", provider, &["-s", "4096", "-n", "50"]);
        assert_eq!(lat.len(), 1);
        assert_eq!(lat[0]["test"], "stream_lat");
        assert_eq!(lat[0]["size"], 4096);
        assert_eq!(lat[0]["server"], "threads");
        assert_eq!(lat[0]["polling"], false);
        assert!(lat[0]["lat_us"]["median"].as_f64().unwrap() > 0.0);
        check_cpu(&lat[0], "cpu_us_per_op");
        check_transport(provider, lat[0]["transport"].as_str().unwrap());

        let bw = perf("stream_bw", provider, &["-s", "65536", "-n", "64", "--polling"]);
        assert!(bw[0]["bw_mb_s"].as_f64().unwrap() > 0.0);
        assert_eq!(bw[0]["verified"], true);
        assert_eq!(bw[0]["polling"], true);
        check_cpu(&bw[0], "cpu_s_per_gb");

        let rr = perf("stream_rr", provider, &["--conns", "8", "-n", "20", "-s", "64"]);
        assert_eq!(rr[0]["conns"], 8);
        check_transport(provider, rr[0]["transport"].as_str().unwrap());
        assert!(rr[0]["msg_rate_mpps"].as_f64().unwrap() > 0.0);
        check_cpu(&rr[0], "cpu_us_per_op");
    }
}

/// `--server loop` (one tokio event loop) serves every provider; the client's JSON says which
/// shape served it, and a client expecting the other shape is told.
#[test]
fn perf_stream_rr_event_loop_server() {
    for provider in ["soft", "shm", "tcp", "fallback"] {
        let rr = perf_with_server(
            "stream_rr",
            provider,
            &["--server", "loop"],
            &["--conns", "8", "-n", "20", "-s", "64", "--server", "loop"],
            |_| {},
        );
        assert_eq!(rr.len(), 1);
        assert_eq!(rr[0]["server"], "loop", "{provider}");
        assert_eq!(rr[0]["conns"], 8);
        check_cpu(&rr[0], "cpu_us_per_op");
        check_transport(provider, rr[0]["transport"].as_str().unwrap());
    }
    let lat = perf_with_server("stream_lat", "soft", &["--server", "loop"], &["-n", "50"], |_| {});
    assert_eq!(lat[0]["server"], "loop");
}

/// Connects to the server on `port` once it listens.
fn plain_client(port: u16) -> TcpStream {
    wait_listening(port);
    TcpStream::connect(("127.0.0.1", port)).unwrap()
}

/// Before the real client, a plain TCP client sends garbage, a port scanner connects and
/// closes, and another plain client connects and says nothing (kept open for the whole run):
/// every stream test's server, in both shapes, drops them and serves the real client.
#[test]
fn perf_stream_servers_survive_foreign_clients() {
    let cases: [(&str, &str, &str, &[&str]); 6] = [
        ("stream_lat", "soft", "threads", &["-n", "50"]),
        ("stream_bw", "soft", "threads", &["-n", "50"]),
        ("stream_rr", "soft", "threads", &["--conns", "4", "-n", "20"]),
        ("stream_rr", "soft", "loop", &["--conns", "4", "-n", "20"]),
        // The kernel-TCP baseline's servers too (a length prefix of "GET " is refused).
        ("stream_lat", "tcp", "threads", &["-n", "50"]),
        ("stream_rr", "tcp", "loop", &["--conns", "4", "-n", "20"]),
    ];
    for (test, provider, shape, extra) in cases {
        let mut silent = None;
        let results = perf_with_server(test, provider, &["--server", shape], extra, |port| {
            let mut garbage = plain_client(port);
            garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
            drop(plain_client(port));
            silent = Some(plain_client(port));
            // Let the server see them before the real client comes.
            std::thread::sleep(Duration::from_millis(300));
            drop(garbage);
        });
        assert_eq!(results.len(), 1, "{test}/{shape}");
        assert_eq!(results[0]["verified"], true);
        assert_eq!(results[0]["server"], shape);
        drop(silent);
    }
}

#[test]
fn cat_to_a_plain_tcp_server_fails_clearly() {
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tcp.local_addr().unwrap().port();
    std::thread::spawn(move || {
        if let Ok((mut conn, _)) = tcp.accept() {
            let _ = conn.write_all(b"SSH-2.0-test\r\n");
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    let out = Command::new(BIN)
        .args(["cat", "127.0.0.1", &port.to_string()])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a Lightpath listener"), "{err}");
}
