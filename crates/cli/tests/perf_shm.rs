//! `lightpath perf --provider shm` end to end: a server and a client process on this host for
//! every verbs test, checking the JSON each size prints and that payloads were verified; every
//! size of `--all`; the server's refusal of a client that claims to run on another host; and
//! the shm entry of `lightpath devices`.

mod common;

use common::{free_tcp_port, wait_listening, wait_with_deadline};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_lightpath");

fn spawn(args: &[&str]) -> Child {
    Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lightpath")
}

/// Runs one test over shm, returning the client's JSON objects.
fn run_pair(test: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let port = free_tcp_port().to_string();
    let mut server_args = vec!["perf", test, "--provider", "shm", "-p", &port, "--bind", "127.0.0.1"];
    server_args.extend_from_slice(extra);
    let server = spawn(&server_args);
    let mut client_args = vec!["perf", test, "127.0.0.1", "--provider", "shm", "-p", &port, "--json"];
    client_args.extend_from_slice(extra);
    let client = wait_with_deadline(spawn(&client_args), Duration::from_secs(120));
    let server = wait_with_deadline(server, Duration::from_secs(30));
    assert!(client.status.success(), "{test} client failed: {}", String::from_utf8_lossy(&client.stderr));
    assert!(server.status.success(), "{test} server failed: {}", String::from_utf8_lossy(&server.stderr));
    String::from_utf8(client.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect()
}

fn check_results(results: &[serde_json::Value], test: &str, sizes: &[u64]) {
    assert_eq!(results.len(), sizes.len(), "{results:?}");
    for (result, size) in results.iter().zip(sizes) {
        assert_eq!(result["test"], test);
        assert_eq!(result["provider"], "shm");
        assert_eq!(result["size"], *size);
        assert_eq!(result["verified"], true);
        if test.ends_with("_lat") {
            let lat = &result["lat_us"];
            let (min, median, p99, max) = (
                lat["min"].as_f64().unwrap(),
                lat["median"].as_f64().unwrap(),
                lat["p99"].as_f64().unwrap(),
                lat["max"].as_f64().unwrap(),
            );
            assert!(min > 0.0 && min <= median && median <= p99 && p99 <= max, "{lat}");
        } else {
            assert!(result["bw_mb_s"].as_f64().unwrap() > 0.0, "{result}");
            assert!(result["msg_rate_mpps"].as_f64().unwrap() > 0.0, "{result}");
        }
    }
}

macro_rules! shm_case {
    ($name:ident, $test:literal, $size:literal) => {
        #[test]
        fn $name() {
            let results = run_pair($test, &["-s", $size, "-n", "300"]);
            check_results(&results, $test, &[$size.parse().unwrap()]);
        }
    };
}

shm_case!(shm_send_lat, "send_lat", "4096");
shm_case!(shm_write_lat, "write_lat", "3000");
shm_case!(shm_read_lat, "read_lat", "10000");
shm_case!(shm_send_bw, "send_bw", "65536");
shm_case!(shm_write_bw, "write_bw", "100000");
shm_case!(shm_read_bw, "read_bw", "65536");
shm_case!(shm_send_bw_larger_than_the_ring, "send_bw", "3000000");

#[test]
fn shm_atomic_lat() {
    let results = run_pair("atomic_lat", &["-n", "300"]);
    check_results(&results, "atomic_lat", &[8]);
}

/// `--all` runs every power of two from 2 B to 8 MiB, for a one-sided and a two-sided test.
#[test]
fn shm_all_sizes() {
    let sizes: Vec<u64> = (1..=23).map(|shift| 1u64 << shift).collect();
    for test in ["write_bw", "send_lat"] {
        let results = run_pair(test, &["--all", "-n", "3"]);
        check_results(&results, test, &sizes);
    }
}

fn send_frame(stream: &mut TcpStream, value: &serde_json::Value) {
    let body = serde_json::to_vec(value).unwrap();
    stream.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
    stream.write_all(&body).unwrap();
}

fn recv_frame(stream: &mut TcpStream) -> serde_json::Value {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    stream.read_exact(&mut body).unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// A client whose endpoint says it runs on another host (another boot) is refused with the
/// reason; the server does not try to connect, goes on waiting and serves a client from here.
#[test]
fn a_client_on_another_host_is_refused() {
    let port = free_tcp_port();
    let server =
        spawn(&["perf", "send_lat", "--provider", "shm", "-p", &port.to_string(), "--bind", "127.0.0.1"]);
    wait_listening(port);
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let hello = serde_json::json!({
        "magic": "lightpath-perf",
        "version": 2,
        "test": "send_lat",
        "provider": "shm",
        "plan": [[2, 10]],
        "tx_depth": 1,
        "endpoint": {
            "host": "boot=00000000-0000-0000-0000-000000000001,net=1,ipc=2",
            "rdma": {
                "gid": "fd53484d000000000000000000000001", "qpn": 2, "psn": 0, "mtu": 4096,
                "addr": 0, "len": 0, "rkey": 0
            }
        }
    });
    send_frame(&mut stream, &hello);
    let answer = recv_frame(&mut stream);
    let reason = answer["Reject"]["reason"].as_str().unwrap_or_else(|| panic!("not refused: {answer}"));
    assert!(reason.contains("one host"), "{reason}");
    let client = Command::new(BIN)
        .args(["perf", "send_lat", "127.0.0.1", "--provider", "shm", "-p", &port.to_string()])
        .args(["-n", "50", "--json"])
        .output()
        .unwrap();
    assert!(client.status.success(), "{}", String::from_utf8_lossy(&client.stderr));
    let server = wait_with_deadline(server, Duration::from_secs(10));
    assert!(server.status.success(), "{}", String::from_utf8_lossy(&server.stderr));
}

/// `lightpath devices` lists shm as available, with its one device and this host's identity.
#[test]
fn devices_lists_shm() {
    let out = Command::new(BIN).args(["devices", "--json"]).output().expect("run lightpath");
    assert!(out.status.success());
    let reports: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let shm = reports
        .as_array()
        .and_then(|all| all.iter().find(|r| r["provider"] == "shm"))
        .unwrap_or_else(|| panic!("no shm report: {reports}"));
    assert_eq!(shm["available"], true, "{shm}");
    let device = &shm["devices"][0];
    assert_eq!((device["name"].as_str(), device["usable"].as_bool()), (Some("shm"), Some(true)), "{shm}");
    assert!(device["gid"].as_str().is_some_and(|gid| gid.starts_with("fd53:484d:")), "{shm}");
    assert!(device["note"].as_str().is_some_and(|note| note.contains("boot=")), "{shm}");
}
