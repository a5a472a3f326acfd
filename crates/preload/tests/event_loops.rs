//! Event-loop programs through the preload library (epoll, poll, select with nonblocking
//! sockets): nginx with curl (sendfile), redis-server with redis-benchmark and redis-cli,
//! memcached with libmemcached's tools, iperf3 both directions, and a python epoll client
//! that deletes and re-adds its connection around each request. Both sides preloaded: same
//! results as TCP and bytes over shm (the library's report); one side plain: plain TCP.

mod common;

use std::time::Duration;

use common::{command, curl_download, require, run, scratch, serve, shm_bytes, wait_for_lines, Mode};

fn sha256_of(path: &std::path::Path) -> String {
    let output = std::process::Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&output.stdout).split(' ').next().unwrap().to_string()
}

fn text(output: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

#[test]
fn nginx_serves_a_file_by_sendfile_to_preloaded_and_plain_curl() {
    if !require("nginx_curl", &["nginx", "curl", "sha256sum"]) {
        return;
    }
    let dir = scratch("nginx");
    let report_path = dir.join("report");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    // Larger than loopback socket buffers hold, so nginx still sends after the switch.
    std::fs::write(www.join("file.bin"), common::random_bytes(24 << 20, 3)).unwrap();
    let port = common::free_port();
    let conf = dir.join("nginx.conf");
    let d = dir.display();
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nuser root;\nworker_processes 1;\nerror_log {d}/error.log;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 256; }}\nhttp {{\n access_log off;\n sendfile on;\n\
             client_body_temp_path {d}/b; proxy_temp_path {d}/p; fastcgi_temp_path {d}/f; uwsgi_temp_path {d}/u; scgi_temp_path {d}/s;\n\
             server {{ listen 127.0.0.1:{port}; root {}; }}\n}}\n",
            www.display()
        ),
    )
    .unwrap();
    let _server = serve(
        command(
            "nginx",
            &["-c", conf.to_str().unwrap(), "-p", dir.to_str().unwrap()],
            Mode::Preloaded,
            &report_path,
        ),
        port,
        "nginx",
    );
    let expected = sha256_of(&www.join("file.bin"));
    let url = format!("http://127.0.0.1:{port}/file.bin");
    for (i, mode) in [Mode::Preloaded, Mode::Plain, Mode::Preloaded].into_iter().enumerate() {
        let got = dir.join(format!("got{i}"));
        let output = curl_download(&url, &got, mode, &report_path, Duration::from_secs(60));
        assert!(output.status.success(), "curl {i}: {}", text(&output));
        assert_eq!(sha256_of(&got), expected, "download {i} ({mode:?})");
    }
    // Keep-alive: several small requests on one preloaded connection.
    let small = dir.join("small");
    let urls: Vec<String> = (0..20).map(|_| url.clone()).collect();
    let mut args: Vec<&str> = vec!["-sS", "--limit-rate", "200M"];
    let outs: Vec<String> = (0..20).map(|i| format!("{}.{i}", small.display())).collect();
    for (u, o) in urls.iter().zip(&outs) {
        args.extend(["-o", o.as_str(), u.as_str()]);
    }
    let output = run(
        command("curl", &args, Mode::Preloaded, &report_path),
        Duration::from_secs(120),
        "curl keep-alive",
    );
    assert!(output.status.success(), "{}", text(&output));
    for o in &outs {
        assert_eq!(sha256_of(std::path::Path::new(o)), expected, "{o}");
    }
    let lines = wait_for_lines(&report_path, 4, Duration::from_secs(5));
    assert!(shm_bytes(&lines) >= 24 << 20, "too little over shm: {lines:#?}");
}

#[test]
fn redis_benchmark_and_redis_cli_against_a_preloaded_redis() {
    if !require("redis", &["redis-server", "redis-benchmark", "redis-cli"]) {
        return;
    }
    let dir = scratch("redis");
    let report_path = dir.join("report");
    let port = common::free_port();
    let p = port.to_string();
    let _server = serve(
        command(
            "redis-server",
            &[
                "--port",
                &p,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                dir.to_str().unwrap(),
            ],
            Mode::Preloaded,
            &report_path,
        ),
        port,
        "redis-server",
    );
    let output = run(
        command(
            "redis-benchmark",
            &["-p", &p, "-t", "set,get", "-n", "20000", "-c", "10", "-r", "1000", "-d", "100", "--csv"],
            Mode::Preloaded,
            &report_path,
        ),
        Duration::from_secs(120),
        "redis-benchmark",
    );
    let csv = text(&output);
    assert!(output.status.success(), "{csv}");
    assert!(csv.contains("\"SET\"") && csv.contains("\"GET\""), "{csv}");
    let cli = |args: &[&str], mode| {
        let mut full = vec!["-p", p.as_str()];
        full.extend_from_slice(args);
        let output =
            run(command("redis-cli", &full, mode, &report_path), Duration::from_secs(30), "redis-cli");
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
    let lines = wait_for_lines(&report_path, 20, Duration::from_secs(5));
    assert!(shm_bytes(&lines) > 1_000_000, "redis-benchmark's requests did not go over shm: {lines:#?}");
}

#[test]
fn memcached_with_memccp_memccat_and_memcslap() {
    if !require("memcached", &["memcached", "memccp", "memccat", "memcslap"]) {
        return;
    }
    let dir = scratch("memcached");
    let report_path = dir.join("report");
    let port = common::free_port();
    let p = port.to_string();
    let _server = serve(
        command(
            "memcached",
            &["-p", &p, "-U", "0", "-l", "127.0.0.1", "-u", "root", "-t", "2"],
            Mode::Preloaded,
            &report_path,
        ),
        port,
        "memcached",
    );
    let servers = format!("--servers=127.0.0.1:{port}");
    let file = dir.join("item");
    let data = common::random_bytes(600_000, 9);
    std::fs::write(&file, &data).unwrap();
    let output = run(
        command("memccp", &[&servers, file.to_str().unwrap()], Mode::Preloaded, &report_path),
        Duration::from_secs(30),
        "memccp",
    );
    assert!(output.status.success(), "{}", text(&output));
    for mode in [Mode::Preloaded, Mode::Plain] {
        let mut cat = command("memccat", &[&servers, "item"], mode, &report_path);
        cat.current_dir(&dir);
        let output = run(cat, Duration::from_secs(30), &format!("memccat ({mode:?})"));
        assert!(output.status.success(), "{}", text(&output));
        // memccat ends the value with a newline.
        assert_eq!(&output.stdout[..output.stdout.len().min(data.len())], &data[..], "memccat ({mode:?})");
        assert_eq!(output.stdout.len(), data.len() + 1);
    }
    let output = run(
        command(
            "memcslap",
            &[&servers, "--concurrency=4", "--execute-number=2000"],
            Mode::Preloaded,
            &report_path,
        ),
        Duration::from_secs(120),
        "memcslap",
    );
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("8000 keys"), "memcslap did not set all its keys: {out}");
    let lines = wait_for_lines(&report_path, 10, Duration::from_secs(5));
    assert!(shm_bytes(&lines) > 1_000_000, "memcslap's sets did not go over shm: {lines:#?}");
}

/// The byte count iperf3 -J reports under `key` (`sum_sent`, `sum_received`) at the end.
fn iperf_bytes(json: &str, key: &str) -> Option<u64> {
    let end = json.find(&format!("\"{key}\""))?;
    let bytes = json[end..].find("\"bytes\":")? + end + 8;
    json[bytes..].trim_start().split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[test]
fn iperf3_forward_and_reverse_with_byte_counts() {
    if !require("iperf3", &["iperf3"]) {
        return;
    }
    for (reverse, client_mode) in [(false, Mode::Preloaded), (true, Mode::Preloaded), (false, Mode::Plain)] {
        let dir = scratch("iperf3");
        let report_path = dir.join("report");
        let port = common::free_port();
        let p = port.to_string();
        let _server =
            serve(command("iperf3", &["-s", "-p", &p], Mode::Preloaded, &report_path), port, "iperf3 -s");
        let mut args = vec!["-c", "127.0.0.1", "-p", &p, "-n", "400M", "-J"];
        if reverse {
            args.push("-R");
        }
        let output =
            run(command("iperf3", &args, client_mode, &report_path), Duration::from_secs(120), "iperf3 -c");
        let json = text(&output);
        assert!(output.status.success(), "{json}");
        let error = json.lines().find(|l| l.contains("\"error\"")).unwrap_or("");
        let sent = iperf_bytes(&json, "sum_sent")
            .unwrap_or_else(|| panic!("no sum_sent (reverse {reverse}, client {client_mode:?}): {error}"));
        let received =
            iperf_bytes(&json, "sum_received").unwrap_or_else(|| panic!("no sum_received: {json}"));
        // iperf3 3.12 checks `-n` only between bursts of up to 10 blocks (its `multisend`), so
        // a sender whose writes never block may go up to 9 blocks of 128 KiB past the target;
        // every block is whole.
        let block = 128 << 10;
        assert!(
            (400 << 20..=(400 << 20) + 9 * block).contains(&sent) && sent.is_multiple_of(block),
            "sent {sent} (reverse {reverse}, {client_mode:?})"
        );
        // The receiver's sum leaves out what is in flight when the sender stops (over plain
        // TCP too, where socket buffers hold several MiB).
        assert!(
            received >= (400 << 20) / 100 * 97,
            "received {received} (reverse {reverse}, {client_mode:?})"
        );
        let lines = wait_for_lines(
            &report_path,
            if client_mode == Mode::Plain { 2 } else { 4 },
            Duration::from_secs(5),
        );
        if client_mode == Mode::Preloaded {
            assert!(shm_bytes(&lines) > 200 << 20, "reverse {reverse}: {lines:#?}");
        } else {
            assert_eq!(shm_bytes(&lines), 0, "{lines:#?}");
        }
    }
}

#[test]
fn epoll_client_that_deletes_and_re_adds_its_connection_sees_every_echo_and_the_end() {
    if !require("epoll_delete_re_add", &["python3"]) {
        return;
    }
    let dir = scratch("epoll-re-add");
    let report_path = dir.join("report");
    let port = common::free_port();
    let script = common::peers();
    let script = script.to_str().unwrap();
    let _server = serve(
        command("python3", &[script, "echo-server", &port.to_string(), "1"], Mode::Preloaded, &report_path),
        port,
        "echo server",
    );
    let output = run(
        command(
            "python3",
            &[script, "epoll-client", &port.to_string(), "300"],
            Mode::Preloaded,
            &report_path,
        ),
        Duration::from_secs(60),
        "epoll client",
    );
    assert!(output.status.success(), "epoll client failed: {}", text(&output));
    let printed = String::from_utf8_lossy(&output.stdout);
    let cpu: f64 = printed
        .trim()
        .strip_prefix("ok 300 cpu ")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output: {}", text(&output)));
    // A deleted connection's hang-up is reported by the kernel whatever the interest; a wait
    // that kept receiving it would spin for the whole second.
    assert!(cpu < 0.2, "a 1 s wait with the deleted, hung-up connection took {cpu} s of CPU");
    let lines = wait_for_lines(&report_path, 2, Duration::from_secs(10));
    assert!(lines.iter().all(|l| l.transport == "rdma/shm"), "{lines:#?}");
    assert!(shm_bytes(&lines) > 0, "nothing went over shm: {lines:#?}");
}

#[test]
fn a_deleted_dup_s_old_number_reused_by_another_connection_keeps_that_one_reported() {
    if !require("epoll_deleted_dup_reused_number", &["python3"]) {
        return;
    }
    let dir = scratch("epoll-dup");
    let report_path = dir.join("report");
    let script = common::peers();
    let script = script.to_str().unwrap();
    let ports = [common::free_port(), common::free_port()];
    let _servers: Vec<_> = ports
        .iter()
        .map(|port| {
            serve(
                command(
                    "python3",
                    &[script, "echo-server", &port.to_string(), "1"],
                    Mode::Preloaded,
                    &report_path,
                ),
                *port,
                "echo server",
            )
        })
        .collect();
    let output = run(
        command(
            "python3",
            &[script, "epoll-dup-client", &ports[0].to_string(), &ports[1].to_string()],
            Mode::Preloaded,
            &report_path,
        ),
        Duration::from_secs(60),
        "epoll dup client",
    );
    assert!(output.status.success(), "epoll dup client failed: {}", text(&output));
    // The case needs the number reused (the lowest free number: it is, unless something else
    // took it in between).
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "ok reused True", "{}", text(&output));
}
