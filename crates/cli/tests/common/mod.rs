//! Process harness shared by the CLI tests that run two `lightpath` processes on loopback:
//! ports no other test in this process uses, children killed when a test ends early.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Ports handed out in this process, so that two tests never get the same one.
static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

fn take(port: u16) -> bool {
    TAKEN.lock().unwrap().get_or_insert_with(HashSet::new).insert(port)
}

/// A TCP port nothing listens on right now.
pub fn free_tcp_port() -> u16 {
    loop {
        let port = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap().local_addr().unwrap().port();
        if take(port) {
            return port;
        }
    }
}

/// A UDP port free on 127.0.0.1, 127.0.0.2 and 127.0.0.3.
pub fn free_udp_port() -> u16 {
    loop {
        let first = UdpSocket::bind((Ipv4Addr::new(127, 0, 0, 1), 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        let others_free = (2..=3).all(|last| UdpSocket::bind((Ipv4Addr::new(127, 0, 0, last), port)).is_ok());
        if others_free && take(port) {
            return port;
        }
    }
}

/// A child process that is killed if the test ends before it does.
pub struct Running(Option<Child>);

impl Running {
    pub fn output(mut self) -> Output {
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `lightpath SUBCOMMAND ARGS…` with piped output.
pub fn spawn(subcommand: &str, args: &[String]) -> Running {
    let child = Command::new(env!("CARGO_BIN_EXE_lightpath"))
        .arg(subcommand)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Running(Some(child))
}

/// Waits for `child` to exit, at most `deadline`; kills it and fails the test after that.
pub fn wait_with_deadline(mut child: Child, deadline: Duration) -> Output {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().ok();
    panic!("process did not finish within {deadline:?}");
}

/// Owned copies of string arguments.
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Whether a socket listens on `port`, whatever its address (the kernel's tables of TCP
/// sockets: local address and port in hex, state 0A is LISTEN).
pub fn listening(port: u16) -> bool {
    let port = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|path| {
        std::fs::read_to_string(path).is_ok_and(|table| {
            table.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.get(1).is_some_and(|local| local.ends_with(&port)) && fields.get(3) == Some(&"0A")
            })
        })
    })
}

pub fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    // A probe connection would be taken as a client by the server (`cat -l`, a perf server),
    // and a port that is bound may not be listening yet: wait for the kernel to list the
    // socket as listening. (Connecting in a loop instead can even connect a socket to itself:
    // the kernel may pick the port as the attempt's own source port while nothing listens.)
    while Instant::now() < deadline {
        if listening(port) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("nothing listened on port {port}");
}
