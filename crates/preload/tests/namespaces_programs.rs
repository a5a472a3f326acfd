//! The real Debian programs between two network namespaces joined by a veth pair (the
//! stand-in for two hosts, `common::netns`): the server in namespace `a` listening on `<net>.1`,
//! its clients in `b`. What `tests/event_loops.rs` and `tests/blocking.rs` prove on one host
//! over shm, proven here across the pair over soft (RoCE v2 over UDP): redis with
//! redis-benchmark and redis-cli, nginx serving a file by sendfile to curl, iperf3 both ways,
//! memcached with libmemcached's tools, python3 -m http.server with curl, a socat fork server.
//!
//! Both sides preloaded (each with `LIGHTPATH_PRELOAD_PEERS` naming the pair's /24): the
//! results are exact and every connection that carried a sizeable part of the data ended
//! `rdma/soft` at both ends, with bytes over the stream (each side's report; the server's
//! line of a connection is found by its two addresses). Connections that end within a few
//! milliseconds (one redis-cli command, one memccp) finish before their pairing and may stay
//! TCP by design: for them only the results count. A plain client against the preloaded
//! server: the same results, and the server reports its connection as TCP with every byte
//! counted there. Every client has a deadline (`common::run`), so a stall fails the test.

mod common;

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::netns::{namespaces_for, serve_in, Namespaces};
use common::{report, run, scratch, soft_bytes, Line, Mode, Scratch};

/// How long the server's line of a connection may take to appear once its client is done.
const SERVER_LINE_LIMIT: Duration = Duration::from_secs(10);

fn sha256_of(path: &Path) -> String {
    let output = std::process::Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&output.stdout).split(' ').next().unwrap().to_string()
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A test's scratch directory and its reports: the server's, and one per preloaded client
/// run (so a run's lines are its own, and a server line whose peer is none of them belongs to
/// a plain client).
struct Reports {
    dir: Scratch,
    client_runs: Cell<usize>,
}

impl Reports {
    fn new(name: &str) -> Reports {
        Reports { dir: scratch(name), client_runs: Cell::new(0) }
    }

    fn server(&self) -> PathBuf {
        self.dir.join("server.report")
    }

    /// A fresh report file for the next client run.
    fn next_client(&self) -> PathBuf {
        let k = self.client_runs.get();
        self.client_runs.set(k + 1);
        self.dir.join(format!("client-{k}.report"))
    }

    /// The report of the next client run in `mode`: a fresh file for a preloaded one; a plain
    /// one writes no report (the path it gets is never written).
    fn for_client(&self, mode: Mode) -> PathBuf {
        match mode {
            Mode::Preloaded => self.next_client(),
            Mode::Plain => self.dir.join("plain-clients-write-no-report"),
        }
    }

    /// The lines of every preloaded client run so far.
    fn all_clients(&self) -> Vec<Line> {
        (0..self.client_runs.get())
            .flat_map(|k| report(&self.dir.join(format!("client-{k}.report"))))
            .collect()
    }
}

fn total_bytes(line: &Line) -> u64 {
    line.tcp_in + line.tcp_out + line.rdma_in + line.rdma_out
}

/// Whether `server` is the other end of `client`'s connection.
fn other_end(server: &Line, client: &Line) -> bool {
    server.local == client.peer && server.peer == client.local
}

/// Both ends of a preloaded client run: the client's lines (its own report) of connections
/// that carried at least `min_bytes`, and the server's lines of those connections.
struct SoftRun {
    client: Vec<Line>,
    server: Vec<Line>,
}

impl SoftRun {
    fn soft_bytes(&self) -> u64 {
        soft_bytes(&self.client) + soft_bytes(&self.server)
    }
}

/// Checks that the connections of the client run reported at `client_report` that carried at
/// least `min_bytes` (there must be some) ended `rdma/soft` with bytes over the stream, at the
/// client and at the server (waiting for the server's lines, written when it closes them),
/// all between the pair's addresses.
fn assert_over_soft(
    ns: &Namespaces,
    what: &str,
    client_report: &Path,
    server_report: &Path,
    min_bytes: u64,
) -> SoftRun {
    let all_client_lines = report(client_report);
    let client: Vec<Line> =
        all_client_lines.iter().filter(|l| total_bytes(l) >= min_bytes).cloned().collect();
    assert!(!client.is_empty(), "{what}: no connection carried {min_bytes} bytes: {all_client_lines:#?}");
    let prefix = format!("{}.", ns.net);
    for line in &client {
        assert!(
            line.local.starts_with(&prefix) && line.peer.starts_with(&prefix),
            "{what}: a connection not over the veth pair: {line:?}"
        );
        assert!(
            line.transport == "rdma/soft" && line.rdma_in + line.rdma_out > 0,
            "{what}: a connection that carried data did not end on soft: {line:?}\nall the client's lines: {all_client_lines:#?}"
        );
    }
    let deadline = Instant::now() + SERVER_LINE_LIMIT;
    let server = loop {
        let lines = report(server_report);
        let ends: Vec<Line> = lines
            .iter()
            .filter(|s| total_bytes(s) > 0 && client.iter().any(|c| other_end(s, c)))
            .cloned()
            .collect();
        let complete = client.iter().all(|c| ends.iter().any(|s| other_end(s, c)));
        if complete {
            break ends;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the server did not report every connection within {SERVER_LINE_LIMIT:?}\nclient: {client:#?}\nserver: {lines:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    for line in &server {
        assert!(
            line.transport == "rdma/soft" && line.rdma_in + line.rdma_out > 0,
            "{what}: the server's end of a connection did not end on soft: {line:?}\nclient: {client:#?}"
        );
    }
    SoftRun { client, server }
}

/// The server's lines of the connections of clients that ran plain (their peer address is
/// none of the preloaded client runs' connections), once there are at least `n` and they count
/// at least `min_tcp_bytes` over TCP (both ways). Each must say TCP with nothing over a
/// stream; returns them for the callers' byte counts.
fn assert_plain_clients_stayed_tcp(what: &str, reports: &Reports, n: usize, min_tcp_bytes: u64) -> Vec<Line> {
    let deadline = Instant::now() + SERVER_LINE_LIMIT;
    let plain = loop {
        let preloaded = reports.all_clients();
        let plain: Vec<Line> = report(&reports.server())
            .into_iter()
            .filter(|s| !preloaded.iter().any(|c| other_end(s, c)))
            .collect();
        let over_tcp: u64 = plain.iter().map(|l| l.tcp_in + l.tcp_out).sum();
        if plain.len() >= n && over_tcp >= min_tcp_bytes {
            break plain;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: within {SERVER_LINE_LIMIT:?} the server reported {} of the plain clients' {n} connection(s), {over_tcp} of {min_tcp_bytes} bytes over TCP: {plain:#?}",
            plain.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    for line in &plain {
        assert!(
            line.transport.starts_with("tcp") && line.rdma_in + line.rdma_out == 0,
            "{what}: a plain client's connection did not stay TCP at the server: {line:?}"
        );
    }
    plain
}

/// [`assert_plain_clients_stayed_tcp`] for one plain connection that was sent more than
/// `sent` bytes (a download, a value read back): it is the only one, and counts them over TCP.
fn assert_one_plain_sender(what: &str, reports: &Reports, sent: u64) {
    let plain = assert_plain_clients_stayed_tcp(what, reports, 1, sent);
    assert_eq!(plain.len(), 1, "{what}: one plain connection: {plain:#?}");
    assert!(plain[0].tcp_out > sent, "{what}: what it was sent is counted over TCP: {:?}", plain[0]);
}

/// curl in namespace `b` downloading `url` into `to`, at most 50 MB/s so that the transfer
/// lasts long enough for a preloaded connection to switch (as `common::curl_download`).
fn curl_in(ns: &Namespaces, url: &str, to: &Path, mode: Mode, report: &Path) -> Output {
    // 25 MB/s: a 24 MiB download lasts about a second, so a pairing slowed by a loaded
    // machine still switches it well before its end.
    let args = ["-sS", "--limit-rate", "25M", "-o", to.to_str().unwrap(), url];
    run(ns.command(&ns.b, "curl", &args, mode, report), Duration::from_secs(30), "curl")
}

/// The size of the files nginx and python's http.server serve: larger than a fresh
/// namespace's socket buffers take before the switch (at 8 MiB, 3 of 10 runs moved the whole
/// file over TCP before the connection switched).
const FILE_LEN: u64 = 24 << 20;

/// The reports and an empty web root of a file-serving test; at most about 5 MiB of a file
/// in flight before the switch (1 MiB of receive buffer in the client's namespace, at most
/// 4 MiB of send buffer): the rest goes over soft whatever the pairing's pace.
fn file_server(ns: &Namespaces, name: &str) -> (Reports, PathBuf) {
    ns.cap_receive_buffers(&ns.b, 1 << 20);
    let reports = Reports::new(name);
    let www = reports.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    (reports, www)
}

/// Downloads `url` (a file of `FILE_LEN` bytes whose sha256 is `expected`) with curl
/// preloaded, plain, preloaded: each exact, each preloaded one over one connection on soft,
/// the plain one TCP at the server with the file counted there. Returns the bytes the
/// preloaded downloads moved over soft (both ends).
fn three_downloads(ns: &Namespaces, reports: &Reports, dir: &Path, url: &str, expected: &str) -> u64 {
    let mut over_soft = 0;
    for (i, mode) in [Mode::Preloaded, Mode::Plain, Mode::Preloaded].into_iter().enumerate() {
        let got = dir.join(format!("got{i}"));
        let client_report = reports.for_client(mode);
        let output = curl_in(ns, url, &got, mode, &client_report);
        assert!(output.status.success(), "curl {i} ({mode:?}): {}", text(&output));
        assert_eq!(sha256_of(&got), expected, "download {i} ({mode:?})");
        if mode == Mode::Preloaded {
            let download =
                assert_over_soft(ns, &format!("curl {i}"), &client_report, &reports.server(), 1 << 20);
            assert_eq!(
                download.client.len(),
                1,
                "curl {i} downloads over one connection: {:#?}",
                download.client
            );
            over_soft += download.soft_bytes();
        }
    }
    assert_one_plain_sender("plain curl", reports, FILE_LEN);
    over_soft
}

#[test]
fn redis_benchmark_and_redis_cli_between_namespaces() {
    let test = "redis_benchmark_and_redis_cli_between_namespaces";
    let Some(ns) = namespaces_for(test, &["redis-server", "redis-benchmark", "redis-cli"]) else {
        return;
    };
    let reports = Reports::new("netns-redis");
    let host = ns.server_address();
    let port = common::free_port();
    let p = port.to_string();
    let dir = reports.dir.to_str().unwrap();
    let server_args = [
        "--port",
        &p,
        "--bind",
        &host,
        "--protected-mode",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        dir,
    ];
    let _server = serve_in(
        &ns.a,
        ns.command(&ns.a, "redis-server", &server_args, Mode::Preloaded, &reports.server()),
        port,
        "redis-server",
    );
    let benchmark_report = reports.next_client();
    let output = run(
        ns.command(
            &ns.b,
            "redis-benchmark",
            &[
                "-h", &host, "-p", &p, "-t", "set,get", "-n", "20000", "-c", "10", "-r", "1000", "-d", "100",
                "--csv",
            ],
            Mode::Preloaded,
            &benchmark_report,
        ),
        Duration::from_secs(60),
        "redis-benchmark",
    );
    let csv = text(&output);
    assert!(output.status.success(), "{csv}");
    assert!(csv.contains("\"SET\"") && csv.contains("\"GET\""), "{csv}");
    // Each of the 10 clients of each test sends 2,000 requests (GET's ~60 KB out, 200 KB in).
    let benchmark = assert_over_soft(&ns, "redis-benchmark", &benchmark_report, &reports.server(), 50_000);
    assert!(
        benchmark.soft_bytes() > 1_000_000,
        "redis-benchmark's requests did not go over soft: {:#?}",
        benchmark.client
    );

    let cli = |args: &[&str], mode| {
        let mut full = vec!["-h", host.as_str(), "-p", p.as_str()];
        full.extend_from_slice(args);
        let report = reports.for_client(mode);
        let output =
            run(ns.command(&ns.b, "redis-cli", &full, mode, &report), Duration::from_secs(30), "redis-cli");
        assert!(output.status.success(), "{}", text(&output));
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    let keys: u64 = cli(&["DBSIZE"], Mode::Preloaded).parse().expect("DBSIZE is a number");
    assert!(keys > 0 && keys <= 1001, "{keys} keys after SET with -r 1000");
    let value = "v".repeat(100_000);
    assert_eq!(cli(&["SET", "lightpath-key", &value], Mode::Preloaded), "OK");
    assert_eq!(
        cli(&["GET", "lightpath-key"], Mode::Plain),
        value,
        "a plain client reads what a preloaded one wrote"
    );
    assert_eq!(cli(&["GET", "lightpath-key"], Mode::Preloaded), value);
    assert_one_plain_sender("plain redis-cli", &reports, 100_000);
}

#[test]
fn nginx_serves_a_file_by_sendfile_to_preloaded_and_plain_curl_between_namespaces() {
    let test = "nginx_serves_a_file_by_sendfile_to_preloaded_and_plain_curl_between_namespaces";
    let Some(ns) = namespaces_for(test, &["nginx", "curl", "sha256sum"]) else {
        return;
    };
    let (reports, www) = file_server(&ns, "netns-nginx");
    let dir = &reports.dir;
    std::fs::write(www.join("file.bin"), common::random_bytes(FILE_LEN as usize, 3)).unwrap();
    let host = ns.server_address();
    let port = common::free_port();
    let conf = dir.join("nginx.conf");
    let d = dir.display();
    // As in event_loops.rs, plus `tcp_nopush on` as Debian's configuration has: nginx corks
    // each response's header and the start of its sendfile.
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nuser root;\nworker_processes 1;\nerror_log {d}/error.log;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 256; }}\nhttp {{\n access_log off;\n sendfile on;\n tcp_nopush on;\n\
             client_body_temp_path {d}/b; proxy_temp_path {d}/p; fastcgi_temp_path {d}/f; uwsgi_temp_path {d}/u; scgi_temp_path {d}/s;\n\
             server {{ listen {host}:{port}; root {}; }}\n}}\n",
            www.display()
        ),
    )
    .unwrap();
    let _server = serve_in(
        &ns.a,
        ns.command(
            &ns.a,
            "nginx",
            &["-c", conf.to_str().unwrap(), "-p", dir.to_str().unwrap()],
            Mode::Preloaded,
            &reports.server(),
        ),
        port,
        "nginx",
    );
    let expected = sha256_of(&www.join("file.bin"));
    let url = format!("http://{host}:{port}/file.bin");
    let over_soft = three_downloads(&ns, &reports, dir, &url, &expected);
    assert!(over_soft >= FILE_LEN, "{over_soft} bytes over soft in two downloads of {FILE_LEN}");
}

/// The byte count iperf3 -J reports under `key` (`sum_sent`, `sum_received`) at the end.
fn iperf_bytes(json: &str, key: &str) -> Option<u64> {
    let end = json.find(&format!("\"{key}\""))?;
    let bytes = json[end..].find("\"bytes\":")? + end + 8;
    json[bytes..].trim_start().split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[test]
fn iperf3_forward_and_reverse_with_byte_counts_between_namespaces() {
    let test = "iperf3_forward_and_reverse_with_byte_counts_between_namespaces";
    let Some(ns) = namespaces_for(test, &["iperf3"]) else {
        return;
    };
    const TOTAL: u64 = 400 << 20;
    let host = ns.server_address();
    let runs = [(false, Mode::Preloaded), (true, Mode::Preloaded), (false, Mode::Plain)];
    for (i, (reverse, client_mode)) in runs.into_iter().enumerate() {
        let what = format!("iperf3 (reverse {reverse}, client {client_mode:?})");
        let reports = Reports::new(&format!("netns-iperf3-{i}"));
        let port = common::free_port();
        let p = port.to_string();
        let _server = serve_in(
            &ns.a,
            ns.command(&ns.a, "iperf3", &["-s", "-B", &host, "-p", &p], Mode::Preloaded, &reports.server()),
            port,
            "iperf3 -s",
        );
        // `-w 2M`: socket buffers of 2 MiB at both ends (a fresh namespace lets a receive
        // buffer grow to 32 MiB), so what is in flight when the sender stops, which the
        // receiver's sum leaves out, stays well within the 3% (12 MiB) checked below: over
        // plain TCP without it, 4-11 MiB of 200 MiB were seen missing from the sum.
        let mut args = vec!["-c", &host, "-p", &p, "-n", "400M", "-w", "2M", "-J"];
        if reverse {
            args.push("-R");
        }
        let client_report = reports.for_client(client_mode);
        let output = run(
            ns.command(&ns.b, "iperf3", &args, client_mode, &client_report),
            Duration::from_secs(60),
            "iperf3 -c",
        );
        let json = text(&output);
        assert!(output.status.success(), "{what}: {json}");
        let error = json.lines().find(|l| l.contains("\"error\"")).unwrap_or("");
        let sent = iperf_bytes(&json, "sum_sent").unwrap_or_else(|| panic!("{what}: no sum_sent: {error}"));
        let received =
            iperf_bytes(&json, "sum_received").unwrap_or_else(|| panic!("{what}: no sum_received: {json}"));
        // As event_loops.rs explains: iperf3 3.12 may send up to 9 whole blocks past `-n`, and
        // the receiver's sum leaves out what is in flight when the sender stops.
        let block = 128 << 10;
        assert!(
            (TOTAL..=TOTAL + 9 * block).contains(&sent) && sent.is_multiple_of(block),
            "{what}: sent {sent}"
        );
        assert!(received >= TOTAL / 100 * 97, "{what}: received {received} of {sent}");
        if client_mode == Mode::Preloaded {
            // The data connection (the control connection carries a few KB).
            let data = assert_over_soft(&ns, &what, &client_report, &reports.server(), 1 << 20);
            assert_eq!(data.client.len(), 1, "{what}: one data connection: {:#?}", data.client);
            assert!(
                data.soft_bytes() > TOTAL,
                "{what}: less than half the test went over soft: {:#?}",
                data.client
            );
        } else {
            // The control connection and the data connection; the server reads at least what
            // iperf3 counted as received (it may leave the last blocks unread when it ends).
            let plain = assert_plain_clients_stayed_tcp(&what, &reports, 2, received);
            let over_tcp: u64 = plain.iter().map(|l| l.tcp_in).sum();
            assert!(
                over_tcp >= received,
                "{what}: the server counted {over_tcp} bytes in over TCP: {plain:#?}"
            );
        }
    }
}

#[test]
fn memcached_with_memccp_memccat_and_memcslap_between_namespaces() {
    let test = "memcached_with_memccp_memccat_and_memcslap_between_namespaces";
    let Some(ns) = namespaces_for(test, &["memcached", "memccp", "memccat", "memcslap"]) else {
        return;
    };
    let reports = Reports::new("netns-memcached");
    let host = ns.server_address();
    let port = common::free_port();
    let p = port.to_string();
    let _server = serve_in(
        &ns.a,
        ns.command(
            &ns.a,
            "memcached",
            &["-p", &p, "-U", "0", "-l", &host, "-u", "root", "-t", "2"],
            Mode::Preloaded,
            &reports.server(),
        ),
        port,
        "memcached",
    );
    let servers = format!("--servers={host}:{port}");
    let file = reports.dir.join("item");
    let data = common::random_bytes(600_000, 9);
    std::fs::write(&file, &data).unwrap();
    let output = run(
        ns.command(
            &ns.b,
            "memccp",
            &[&servers, file.to_str().unwrap()],
            Mode::Preloaded,
            &reports.next_client(),
        ),
        Duration::from_secs(30),
        "memccp",
    );
    assert!(output.status.success(), "{}", text(&output));
    for mode in [Mode::Preloaded, Mode::Plain] {
        let client_report = reports.for_client(mode);
        let output = run(
            ns.command(&ns.b, "memccat", &[&servers, "item"], mode, &client_report),
            Duration::from_secs(30),
            "memccat",
        );
        assert!(output.status.success(), "{}", text(&output));
        // memccat ends the value with a newline.
        assert_eq!(&output.stdout[..output.stdout.len().min(data.len())], &data[..], "memccat ({mode:?})");
        assert_eq!(output.stdout.len(), data.len() + 1, "memccat ({mode:?})");
    }
    let slap_report = reports.next_client();
    let output = run(
        ns.command(
            &ns.b,
            "memcslap",
            &[&servers, "--concurrency=4", "--execute-number=1000"],
            Mode::Preloaded,
            &slap_report,
        ),
        Duration::from_secs(60),
        "memcslap",
    );
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("4000 keys"), "memcslap did not set all its keys: {out}");
    let slap = assert_over_soft(&ns, "memcslap", &slap_report, &reports.server(), 50_000);
    assert!(slap.soft_bytes() > 0, "memcslap's sets did not go over soft: {:#?}", slap.client);
    assert_one_plain_sender("plain memccat", &reports, data.len() as u64);
}

#[test]
fn python_http_server_and_curl_between_namespaces() {
    let test = "python_http_server_and_curl_between_namespaces";
    let Some(ns) = namespaces_for(test, &["python3", "curl", "sha256sum"]) else {
        return;
    };
    let (reports, www) = file_server(&ns, "netns-http");
    let dir = &reports.dir;
    // Larger than what TCP can hold before the switch: a fresh namespace lets curl's receive
    // buffer grow to 32 MiB, and with an 8 MiB file the whole response was sometimes in
    // flight over TCP before the connection had switched (3 runs of 10: `rdma/soft` with no
    // byte over the stream).
    let file = www.join("file.bin");
    std::fs::write(&file, common::random_bytes(FILE_LEN as usize, 5)).unwrap();
    let host = ns.server_address();
    let port = common::free_port();
    let _server = serve_in(
        &ns.a,
        ns.command(
            &ns.a,
            "python3",
            &["-m", "http.server", &port.to_string(), "--bind", &host, "--directory", www.to_str().unwrap()],
            Mode::Preloaded,
            &reports.server(),
        ),
        port,
        "python3 -m http.server",
    );
    let expected = sha256_of(&file);
    let url = format!("http://{host}:{port}/file.bin");
    three_downloads(&ns, &reports, dir, &url, &expected);
}

/// Waits until `path` holds what `input` does (the socat child may still be writing when its
/// client has finished); panics after 10 s.
fn wait_for_same_file(path: &Path, input: &Path, what: &str) {
    let expected = sha256_of(input);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = sha256_of(path);
        if got == expected {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: the server's file differs from what was sent");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn socat_relay_between_namespaces_preloaded_and_plain_client() {
    let test = "socat_relay_between_namespaces_preloaded_and_plain_client";
    let Some(ns) = namespaces_for(test, &["socat", "python3", "sha256sum"]) else {
        return;
    };
    let reports = Reports::new("netns-socat");
    let output_path = reports.dir.join("output");
    let host = ns.server_address();
    let port = common::free_port();
    // A fork server (-u: network to file): each connection's child writes what it receives.
    let _server = serve_in(
        &ns.a,
        ns.command(
            &ns.a,
            "socat",
            &[
                "-u",
                &format!("TCP-LISTEN:{port},reuseaddr,fork,bind={host}"),
                &format!("CREATE:{}", output_path.display()),
            ],
            Mode::Preloaded,
            &reports.server(),
        ),
        port,
        "socat server",
    );
    const LEN: usize = 6 << 20;
    for (i, mode) in [Mode::Preloaded, Mode::Plain].into_iter().enumerate() {
        // A different file each time: the server's file from the run before cannot pass.
        let input = reports.dir.join(format!("input{i}"));
        std::fs::write(&input, common::random_bytes(LEN, 11 + i as u64)).unwrap();
        // Fed at a modest pace (64 KiB every 5 ms), as in blocking.rs, so the connection lives
        // long enough to switch.
        let pipeline = format!(
            "python3 -c 'import sys,time\nd=open(sys.argv[1],\"rb\").read()\nfor i in range(0,len(d),65536):\n sys.stdout.buffer.write(d[i:i+65536]); sys.stdout.flush(); time.sleep(0.005)' {} | socat -u STDIN TCP:{host}:{port}",
            input.display()
        );
        let client_report = reports.for_client(mode);
        let result = run(
            ns.command(&ns.b, "sh", &["-c", &pipeline], mode, &client_report),
            Duration::from_secs(30),
            "socat client",
        );
        assert!(
            result.status.success(),
            "socat client ({mode:?}): {}",
            String::from_utf8_lossy(&result.stderr)
        );
        wait_for_same_file(&output_path, &input, &format!("socat ({mode:?})"));
        if mode == Mode::Preloaded {
            let relay = assert_over_soft(&ns, "socat client", &client_report, &reports.server(), 1 << 20);
            assert_eq!(relay.client.len(), 1, "one connection: {:#?}", relay.client);
            assert!(relay.soft_bytes() > 0, "nothing went over soft: {:#?}", relay.client);
        }
    }
    // The fork child's line, and the parent's if it reports the connection it handed over.
    let plain = assert_plain_clients_stayed_tcp("plain socat client", &reports, 1, LEN as u64);
    let over_tcp: u64 = plain.iter().map(|l| l.tcp_in).sum();
    assert_eq!(over_tcp, LEN as u64, "the plain client's file is counted over TCP: {plain:#?}");
}
