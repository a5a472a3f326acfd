//! Two network namespaces joined by a veth pair (MTU 1500): the tests' stand-in for two hosts.
//! Programs run inside one of them through `ip netns exec`, with or without the library; a
//! preloaded one gets `LIGHTPATH_PRELOAD_PEERS` naming the pair's /24, so its connections to
//! the other namespace pair over the soft provider (RoCE v2 over UDP). Each [`Namespaces`] has
//! names with the test process's id and a counter, and deletes both namespaces when dropped,
//! also when the test fails; a machine that cannot create namespaces (not root, no `ip netns`)
//! skips the test with `SKIPPED <test>: <reason>`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::{command, require, Background, Mode};

/// Two network namespaces joined by a veth pair: `a` (the server's side) has `<net>.1/24`, `b`
/// `<net>.2/24`. Dropping it deletes both namespaces (and with them the pair).
pub struct Namespaces {
    pub a: String,
    pub b: String,
    /// The first three octets of the /24.
    pub net: String,
}

impl Namespaces {
    /// Sets the pair up, or says why it cannot be (the caller skips the test).
    pub fn up() -> Result<Namespaces, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces cannot be created".into());
        }
        // Tests of one binary may run in parallel: each gets its own names and /24.
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let namespaces = Namespaces {
            a: format!("lp-pre-a-{pid}-{k}"),
            b: format!("lp-pre-b-{pid}-{k}"),
            net: format!("10.77.{}", (pid % 200 + k % 50)),
        };
        // From here on the guard deletes whatever was created, whatever fails next.
        ip(&["netns", "add", &namespaces.a]).map_err(|e| format!("ip netns add failed: {e}"))?;
        ip(&["netns", "add", &namespaces.b]).map_err(|e| format!("ip netns add failed: {e}"))?;
        // Interface names: at most 15 bytes ("lpva" + a pid of up to 7 digits + "x" + k).
        let (veth_a, veth_b) = (format!("lpva{pid}x{k}"), format!("lpvb{pid}x{k}"));
        // Created in place (each end directly in its namespace): nothing is left in this
        // namespace if a later step fails.
        ip(&[
            "link",
            "add",
            "name",
            &veth_a,
            "netns",
            &namespaces.a,
            "type",
            "veth",
            "peer",
            "name",
            &veth_b,
            "netns",
            &namespaces.b,
        ])
        .map_err(|e| format!("cannot create a veth pair: {e}"))?;
        for (ns, veth, host) in [(&namespaces.a, &veth_a, 1), (&namespaces.b, &veth_b, 2)] {
            let address = format!("{}.{host}/24", namespaces.net);
            for args in [
                &["-n", ns, "addr", "add", &address, "dev", veth][..],
                &["-n", ns, "link", "set", veth, "mtu", "1500", "up"],
                &["-n", ns, "link", "set", "lo", "up"],
            ] {
                ip(args).unwrap_or_else(|e| panic!("setting up {ns}: {e}"));
            }
        }
        Ok(namespaces)
    }

    /// The server's address (in `a`).
    pub fn server_address(&self) -> String {
        format!("{}.1", self.net)
    }

    /// Caps TCP receive buffers in namespace `ns` at `max` bytes (`net.ipv4.tcp_rmem`, which
    /// a namespace has of its own; 32 MiB here by default): a bulk transfer then cannot put
    /// most of a test's file in flight over TCP before its connection switches, as a fresh
    /// namespace's autotuned buffers sometimes let it (a 24 MiB nginx download went whole over
    /// TCP in one run of the full suite under load).
    pub fn cap_receive_buffers(&self, ns: &str, max: usize) {
        let value = format!("net.ipv4.tcp_rmem=4096 131072 {max}");
        ip(&["netns", "exec", ns, "sysctl", "-q", "-w", &value])
            .unwrap_or_else(|e| panic!("capping receive buffers in {ns}: {e}"));
    }

    /// The pair's /24, as `LIGHTPATH_PRELOAD_PEERS` takes it.
    pub fn subnet(&self) -> String {
        format!("{}.0/24", self.net)
    }

    /// `program ARGS` inside namespace `ns` (`self.a` or `self.b`), preloaded or plain as
    /// [`command`] makes it; a preloaded one names the pair's /24 as its peers (so its
    /// connections to the other namespace pair over soft), a plain one gets no rule.
    pub fn command(&self, ns: &str, program: &str, args: &[&str], mode: Mode, report: &Path) -> Command {
        let rule = (mode == Mode::Preloaded).then(|| self.subnet());
        command_in(ns, program, args, mode, report, rule.as_deref())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            // Fails harmlessly for a namespace that was never created.
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Runs `ip ARGS`; its standard error when it fails.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim()))
    }
}

/// The namespaces for a test of the python peers, or None after printing why the test is
/// skipped.
pub fn namespaces(test: &str) -> Option<Namespaces> {
    namespaces_for(test, &["python3", "sha256sum"])
}

/// The namespaces for a test that runs `programs`, or None after printing why the test is
/// skipped (a program missing, or no namespaces to be made).
pub fn namespaces_for(test: &str, programs: &[&str]) -> Option<Namespaces> {
    if !require(test, &["ip"]) || !require(test, programs) {
        return None;
    }
    match Namespaces::up() {
        Ok(namespaces) => Some(namespaces),
        Err(reason) => {
            eprintln!("SKIPPED {test}: {reason}");
            None
        }
    }
}

/// `ip netns exec NS program ARGS`, preloaded or plain as [`command`] makes it (`ip netns
/// exec` keeps the environment, so a preloaded program gets the library and the report), with
/// `LIGHTPATH_PRELOAD_PEERS` set to `rule` (unset when None).
pub fn command_in(
    ns: &str,
    program: &str,
    args: &[&str],
    mode: Mode,
    report: &Path,
    rule: Option<&str>,
) -> Command {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    let mut command = command("ip", &full, mode, report);
    command.env_remove("LIGHTPATH_PRELOAD_PEERS");
    if let Some(rule) = rule {
        command.env("LIGHTPATH_PRELOAD_PEERS", rule);
    }
    command
}

/// Starts a server inside `ns` and waits until it listens on `port` there (`common::serve`
/// reads this namespace's table; here the table is read from inside `ns`). Not by connecting,
/// as `common::serve` explains.
pub fn serve_in(ns: &str, mut command: Command, port: u16, name: &str) -> Background {
    command.stdout(Stdio::null()).stderr(Stdio::null());
    let child = command.spawn().unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let mut server = Background(child, name.to_string());
    let deadline = Instant::now() + Duration::from_secs(15);
    while !listening_in(ns, port) {
        if let Ok(Some(status)) = server.0.try_wait() {
            panic!("{name} exited before listening: {status}");
        }
        assert!(Instant::now() < deadline, "{name} did not listen on {port} in {ns} within 15 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// Whether some socket listens on TCP `port` in namespace `ns` (state 0A is LISTEN).
pub fn listening_in(ns: &str, port: u16) -> bool {
    let Ok(output) = Command::new("ip")
        .args(["netns", "exec", ns, "cat", "/proc/net/tcp", "/proc/net/tcp6"])
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return false;
    };
    // Whatever cat could read (no tcp6 table without IPv6).
    let local = format!(":{port:04X}");
    String::from_utf8_lossy(&output.stdout).lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() > 3 && fields[1].ends_with(&local) && fields[3] == "0A"
    })
}
