//! Running real programs with and without the preload library, with deadlines, and reading
//! the library's per-connection report.

#![allow(dead_code)]

pub mod netns;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The library under test: `target/<profile>/liblightpath_preload.so`. Integration tests do
/// not make cargo build a cdylib, so the first call builds it (`cargo build -p
/// lightpath-preload`, same profile), which also picks up source changes.
pub fn library() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    BUILT.call_once(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "-q", "-p", "lightpath-preload"]);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().expect("running cargo build for the preload library");
        assert!(status.success(), "cargo build -p lightpath-preload failed");
    });
    let lib = profile_dir.join("liblightpath_preload.so");
    assert!(lib.is_file(), "{} missing: cargo builds it with the crate's tests", lib.display());
    lib
}

/// The path of `program` if installed; prints SKIPPED with the reason otherwise.
/// The Python peers the tests drive (`tests/helpers/peers.py`).
pub fn peers() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/peers.py")
}

pub fn require(test: &str, programs: &[&str]) -> bool {
    for program in programs {
        let found = std::env::var_os("PATH")
            .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
            .unwrap_or(false);
        if !found {
            eprintln!("SKIPPED {test}: {program} is not installed (scripts/ci-deps/preload.sh installs it)");
            return false;
        }
    }
    true
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A scratch directory for one test, removed when the test is done with it unless the test
/// failed (what a failed test left there is kept for a look). Before, every run left its
/// directories behind: the nginx test's alone held 577 MB, and repeated runs filled `/tmp`.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("lightpath-preload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// See [`scratch`]: the directory's path, which it removes when dropped.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// How a program runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    /// With the library, reporting to the given file.
    Preloaded,
    /// Without it.
    Plain,
}

/// A command with or without the library; `report` receives its connection lines.
pub fn command(program: &str, args: &[&str], mode: Mode, report: &Path) -> Command {
    let mut command = Command::new(program);
    command.args(args).env_remove("LD_PRELOAD").env_remove("LIGHTPATH_PROVIDERS");
    if mode == Mode::Preloaded {
        command.env("LD_PRELOAD", library()).env("LIGHTPATH_PRELOAD_REPORT", report);
    }
    command
}

/// A background program killed when dropped.
pub struct Background(pub Child, pub String);

impl Drop for Background {
    fn drop(&mut self) {
        // SIGTERM first, so the library's exit report is written.
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a server and waits until `port` accepts connections.
pub fn serve(mut command: Command, port: u16, name: &str) -> Background {
    command.stdout(Stdio::null()).stderr(Stdio::null());
    let child = command.spawn().unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let mut server = Background(child, name.to_string());
    let deadline = Instant::now() + Duration::from_secs(15);
    // Ready once the kernel lists a listening socket on the port. Not by connecting: a probe
    // connection is a client that sends nothing, which some servers answer by resetting
    // themselves (iperf3 closes and reopens its listener after such a client, and a real
    // client queued on the old listener meanwhile is reset: "unable to send cookie").
    while !listening(port) {
        if let Ok(Some(status)) = server.0.try_wait() {
            panic!("{name} exited before listening: {status}");
        }
        assert!(Instant::now() < deadline, "{name} did not listen on {port} within 15 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

/// Whether some socket listens on TCP `port` (IPv4 or IPv6), from `/proc/net/tcp{,6}`
/// (state 0A is LISTEN).
fn listening(port: u16) -> bool {
    let local = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.len() > 3 && fields[1].ends_with(&local) && fields[3] == "0A"
            })
        })
    })
}

/// Downloads `url` into `to` with curl (in `mode`), at most 50 MB/s so that the transfer
/// lasts long enough for a preloaded connection to switch; fails the test after `limit`.
pub fn curl_download(url: &str, to: &Path, mode: Mode, report: &Path, limit: Duration) -> Output {
    let args = ["-sS", "--limit-rate", "50M", "-o", to.to_str().unwrap(), url];
    run(command("curl", &args, mode, report), limit, "curl")
}

/// Runs a command to its end (its output drained as it comes), killing it after `limit`
/// (the test then fails).
pub fn run(mut command: Command, limit: Duration, name: &str) -> Output {
    command.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
    let child = command.spawn().unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let pid = child.id();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(limit) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let output = receiver.recv().unwrap().unwrap();
            panic!(
                "{name} did not finish within {limit:?} (a stall)\nstdout: {}\nstderr: {}",
                String::from_utf8_lossy(&output.stdout[..output.stdout.len().min(2000)]),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}

/// One connection line of a report.
#[derive(Debug, Clone)]
pub struct Line {
    pub pid: u32,
    pub local: String,
    pub peer: String,
    pub transport: String,
    pub tcp_out: u64,
    pub tcp_in: u64,
    pub rdma_out: u64,
    pub rdma_in: u64,
}

fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let start = text.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &text[start..];
    Some(rest.split(' ').next().unwrap_or(""))
}

/// The connection lines of the report at `path`.
pub fn report(path: &Path) -> Vec<Line> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains(" transport="))
        .map(|l| {
            let transport_start = l.find(" transport=").unwrap() + 11;
            let transport_end = l.find(" tcp_out=").unwrap();
            Line {
                pid: field(l, "pid").and_then(|v| v.parse().ok()).unwrap_or(0),
                local: field(l, "local").unwrap_or("").to_string(),
                peer: field(l, "peer").unwrap_or("").to_string(),
                transport: l[transport_start..transport_end].to_string(),
                tcp_out: field(l, "tcp_out").and_then(|v| v.parse().ok()).unwrap_or(0),
                tcp_in: field(l, "tcp_in").and_then(|v| v.parse().ok()).unwrap_or(0),
                rdma_out: field(l, "rdma_out").and_then(|v| v.parse().ok()).unwrap_or(0),
                rdma_in: field(l, "rdma_in").and_then(|v| v.parse().ok()).unwrap_or(0),
            }
        })
        .collect()
}

/// Bytes that moved over shm in the report's lines.
pub fn shm_bytes(lines: &[Line]) -> u64 {
    lines.iter().filter(|l| l.transport == "rdma/shm").map(|l| l.rdma_in + l.rdma_out).sum()
}

/// Bytes that moved over the soft provider (RoCE v2 over UDP) in the report's lines.
pub fn soft_bytes(lines: &[Line]) -> u64 {
    lines.iter().filter(|l| l.transport == "rdma/soft").map(|l| l.rdma_in + l.rdma_out).sum()
}

/// Pseudo-random bytes (xorshift), reproducible.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What a `peers.py cork-client` run of `requests` must show: it got every answer whole
/// ("ok N"), and both preloaded ends report `transport`. Returns the report's lines.
pub fn assert_cork_client_done(
    output: &Output,
    requests: usize,
    report: &Path,
    transport: &str,
) -> Vec<Line> {
    assert!(output.status.success(), "client failed: {}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), format!("ok {requests}"));
    let lines = wait_for_lines(report, 2, Duration::from_secs(10));
    for line in &lines {
        assert_eq!(line.transport, transport, "both ends should have switched: {lines:#?}");
    }
    lines
}

/// Waits until the report at `path` has `n` connection lines from `pid`-less writers (or the
/// deadline passes); servers write theirs when the connection closes.
pub fn wait_for_lines(path: &Path, n: usize, limit: Duration) -> Vec<Line> {
    let deadline = Instant::now() + limit;
    loop {
        let lines = report(path);
        if lines.len() >= n || Instant::now() >= deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
