//! `lightpath perf` end to end: a server and a client process on loopback for every test, over
//! the soft provider and over kernel TCP, checking the JSON each size prints and that payloads
//! were verified; plus refusals (mismatched tests, a foreign peer on the control port).

mod common;

use common::{free_tcp_port, wait_with_deadline};
use std::io::Write;
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_lightpath");

/// A loopback address and UDP port unique to this test process and call, so tests can run in
/// parallel with each other and with other test binaries.
fn unique_endpoint() -> (String, String, u16) {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id() as u16;
    let third = (pid % 200) as u8 + 20;
    let fourth = (n % 100) as u8 * 2 + 10;
    let udp_port = 20000 + (pid % 20000) + n;
    (format!("127.{third}.{fourth}.1"), format!("127.{third}.{fourth}.2"), udp_port)
}

fn spawn_server(args: &[&str]) -> Child {
    Command::new(BIN).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start server")
}

/// Runs one test with `provider`, returning the client's JSON objects.
fn run_pair(test: &str, provider: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let (server_ip, client_ip, udp_port) = unique_endpoint();
    let port = free_tcp_port().to_string();
    let udp = udp_port.to_string();
    let mut server_args =
        vec!["perf", test, "--provider", provider, "-p", &port, "--bind", &server_ip, "--udp-port", &udp];
    server_args.extend_from_slice(extra);
    let server = spawn_server(&server_args);
    let mut client_args = vec![
        "perf",
        test,
        &server_ip,
        "--provider",
        provider,
        "-p",
        &port,
        "--bind",
        &client_ip,
        "--udp-port",
        &udp,
        "--json",
    ];
    client_args.extend_from_slice(extra);
    let client =
        Command::new(BIN).args(&client_args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let client = wait_with_deadline(client, Duration::from_secs(120));
    let server = wait_with_deadline(server, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&client.stderr);
    assert!(client.status.success(), "{test}/{provider} client failed: {stderr}");
    assert!(
        server.status.success(),
        "{test}/{provider} server failed: {}",
        String::from_utf8_lossy(&server.stderr)
    );
    String::from_utf8(client.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect()
}

fn check_results(results: &[serde_json::Value], test: &str, provider: &str, sizes: &[u64]) {
    assert_eq!(results.len(), sizes.len(), "{results:?}");
    for (result, size) in results.iter().zip(sizes) {
        assert_eq!(result["test"], test);
        assert_eq!(result["provider"], provider);
        assert_eq!(result["size"], *size);
        assert_eq!(result["verified"], true);
        // Both processes' CPU time over the size, and the derived figure.
        assert!(result["cpu_s"].as_f64().unwrap() > 0.0, "{result}");
        assert!(result["server_cpu_s"].as_f64().unwrap() > 0.0, "{result}");
        let per = if test.ends_with("_lat") { "cpu_us_per_op" } else { "cpu_s_per_gb" };
        assert!(result[per].as_f64().unwrap() > 0.0, "{result}");
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

macro_rules! perf_case {
    ($name:ident, $test:literal, $provider:literal, $size:literal) => {
        #[test]
        fn $name() {
            let results = run_pair($test, $provider, &["-s", $size, "-n", "200"]);
            check_results(&results, $test, $provider, &[$size.parse().unwrap()]);
        }
    };
}

perf_case!(soft_send_lat, "send_lat", "soft", "4096");
perf_case!(soft_write_lat, "write_lat", "soft", "3000");
perf_case!(soft_read_lat, "read_lat", "soft", "10000");
perf_case!(soft_send_bw, "send_bw", "soft", "65536");
perf_case!(soft_write_bw, "write_bw", "soft", "100000");
perf_case!(soft_read_bw, "read_bw", "soft", "65536");
perf_case!(tcp_send_lat, "send_lat", "tcp", "64");
perf_case!(tcp_read_lat, "read_lat", "tcp", "4096");
perf_case!(tcp_write_bw, "write_bw", "tcp", "65536");
perf_case!(tcp_read_bw, "read_bw", "tcp", "65536");

#[test]
fn atomic_latency_both_providers() {
    for provider in ["soft", "tcp"] {
        let results = run_pair("atomic_lat", provider, &["-n", "300"]);
        check_results(&results, "atomic_lat", provider, &[8]);
    }
}

/// `--all` runs every power of two from 2 B to 8 MiB; a few iterations each keep it short.
#[test]
fn soft_write_bw_all_sizes() {
    let results = run_pair("write_bw", "soft", &["--all", "-n", "3"]);
    let sizes: Vec<u64> = (1..=23).map(|shift| 1u64 << shift).collect();
    check_results(&results, "write_bw", "soft", &sizes);
}

/// Two soft sides use the largest path MTU both links carry (the Lightpath extension: 32,448
/// bytes on loopback, two packets per segmented UDP message) unless `-m` names an IB size, and
/// any size between 256 and 32 KiB on request; every result says which it used, and the
/// payload is verified either way.
#[test]
fn soft_sides_use_the_lightpath_mtu_unless_told_otherwise() {
    let cases = [
        (&[][..], 32448),
        (&["-m", "4096"][..], 4096),
        (&["-m", "9000"][..], 9000),
        (&["-m", "32768"][..], 32768),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["-s", "200000", "-n", "20"];
        args.extend_from_slice(extra);
        let results = run_pair("write_bw", "soft", &args);
        check_results(&results, "write_bw", "soft", &[200000]);
        assert_eq!(results[0]["path_mtu"], expected, "{extra:?}");
    }
    let tcp = Command::new(BIN)
        .args(["perf", "write_bw", "127.0.0.1", "--provider", "tcp", "-m", "9000"])
        .output()
        .unwrap();
    assert!(!tcp.status.success());
    assert!(String::from_utf8_lossy(&tcp.stderr).contains("not one of 256"), "{tcp:?}");
}

/// Connects a plain TCP client to `port`, retrying until the server listens.
fn plain_client(ip: &str, port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect((ip, port)) {
            Ok(stream) => return stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(err) => panic!("server never listened: {err}"),
        }
    }
}

/// A mismatched client is refused with the reason; the server keeps waiting and then serves a
/// matching client.
#[test]
fn mismatched_tests_are_refused_and_the_server_goes_on() {
    let (server_ip, client_ip, udp_port) = unique_endpoint();
    let port = free_tcp_port().to_string();
    let udp = udp_port.to_string();
    let server = spawn_server(&["perf", "send_lat", "-p", &port, "--bind", &server_ip, "--udp-port", &udp]);
    let client = Command::new(BIN)
        .args(["perf", "write_bw", &server_ip, "-p", &port, "--bind", &client_ip, "--udp-port", &udp])
        .output()
        .unwrap();
    assert!(!client.status.success());
    let stderr = String::from_utf8_lossy(&client.stderr);
    assert!(stderr.contains("client runs write_bw but this server runs send_lat"), "{stderr}");
    let client = Command::new(BIN)
        .args(["perf", "send_lat", &server_ip, "-p", &port, "--bind", &client_ip, "--udp-port", &udp])
        .args(["-n", "50", "--json"])
        .output()
        .unwrap();
    assert!(client.status.success(), "{}", String::from_utf8_lossy(&client.stderr));
    let server = wait_with_deadline(server, Duration::from_secs(10));
    assert!(server.status.success(), "{}", String::from_utf8_lossy(&server.stderr));
    let stderr = String::from_utf8_lossy(&server.stderr);
    assert!(stderr.contains("refused: client runs write_bw"), "{stderr}");
}

/// Before the real client: a perftest client (its version string), a port scanner (connects
/// and closes) and a plain client that connects and says nothing. None of them stops the
/// server or holds it up; each is logged; the real client's run succeeds.
#[test]
fn foreign_peers_are_dropped_and_the_server_goes_on() {
    for provider in ["soft", "tcp"] {
        let (server_ip, client_ip, udp_port) = unique_endpoint();
        let port = free_tcp_port();
        let udp = udp_port.to_string();
        let port_arg = port.to_string();
        let server = spawn_server(&[
            "perf",
            "send_lat",
            "--provider",
            provider,
            "-p",
            &port_arg,
            "--bind",
            &server_ip,
            "--udp-port",
            &udp,
        ]);
        let mut perftest = plain_client(&server_ip, port);
        perftest.write_all(b"6.22\0\0\0\0\0\0\0\0\0\0\0\0").unwrap();
        drop(plain_client(&server_ip, port));
        let _silent = plain_client(&server_ip, port);
        let client = Command::new(BIN)
            .args(["perf", "send_lat", &server_ip, "--provider", provider, "-p", &port_arg])
            .args(["--bind", &client_ip, "--udp-port", &udp, "-n", "50", "--json"])
            .output()
            .unwrap();
        assert!(client.status.success(), "{provider}: {}", String::from_utf8_lossy(&client.stderr));
        let results: Vec<serde_json::Value> = String::from_utf8_lossy(&client.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        check_results(&results, "send_lat", provider, &[2]);
        let server = wait_with_deadline(server, Duration::from_secs(10));
        let stderr = String::from_utf8_lossy(&server.stderr);
        assert!(server.status.success(), "{provider}: {stderr}");
        assert!(stderr.contains("not a `lightpath perf` process"), "{stderr}");
        // Not held up by the silent client: the real one was served at once, not after the
        // silent one's 10 s of patience ran out (if they ran out at all before the end).
        let served = stderr.find("connected").expect("a served client");
        assert!(stderr.find("no hello within").is_none_or(|dropped| served < dropped), "{stderr}");
        drop(perftest);
    }
}

/// A client that speaks the control protocol but sends no usable endpoint is refused with the
/// reason, and the server goes on to serve a real client.
#[test]
fn a_hello_without_an_endpoint_is_refused_and_the_server_goes_on() {
    use std::io::Read;
    let (server_ip, client_ip, udp_port) = unique_endpoint();
    let port = free_tcp_port();
    let (port_arg, udp) = (port.to_string(), udp_port.to_string());
    let server =
        spawn_server(&["perf", "send_lat", "-p", &port_arg, "--bind", &server_ip, "--udp-port", &udp]);
    let mut fake = plain_client(&server_ip, port);
    let hello = r#"{"magic":"lightpath-perf","version":2,"test":"send_lat","provider":"soft","plan":[[2,10]],"tx_depth":1,"endpoint":null}"#;
    fake.write_all(&(hello.len() as u32).to_be_bytes()).unwrap();
    fake.write_all(hello.as_bytes()).unwrap();
    fake.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut len = [0u8; 4];
    fake.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u32::from_be_bytes(len) as usize];
    fake.read_exact(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.contains("Reject") && answer.contains("no usable RDMA endpoint"), "{answer}");
    let client = Command::new(BIN)
        .args(["perf", "send_lat", &server_ip, "-p", &port_arg, "--bind", &client_ip, "--udp-port", &udp])
        .args(["-n", "50", "--json"])
        .output()
        .unwrap();
    assert!(client.status.success(), "{}", String::from_utf8_lossy(&client.stderr));
    let server = wait_with_deadline(server, Duration::from_secs(10));
    assert!(server.status.success(), "{}", String::from_utf8_lossy(&server.stderr));
}
