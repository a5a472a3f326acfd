//! A blocked call sleeps until something concerns it: no periodic wake-ups while idle, and the
//! peer's goodbye ends the sleep at once (the sleep watches the TCP connection, the liveness
//! channel, beside the connection's doorbell). Before, a blocked call woke every 20 ms to look
//! at the TCP connection: 50 wake-ups a second per blocked thread, 50,000 on an idle server
//! with a thread per connection and 1,000 connections.

mod common;

use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{listener, shm, soft};
use lightpath::{Options, Stream, Transport};

/// Voluntary context switches (times it blocked) of thread `tid` of this process.
fn blocks_of(tid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches")).expect("field");
    line.split(':').nth(1).expect("value").trim().parse().expect("number")
}

/// This thread's id (`/proc/thread-self` links to `PID/task/TID`).
fn own_tid() -> i32 {
    let link = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
    link.file_name().and_then(|tid| tid.to_str()).and_then(|tid| tid.parse().ok()).expect("a thread id")
}

/// Two connections (so waits go straight to each connection's doorbell, as on a server with
/// many), a reader blocked on the first: it blocks a handful of times at most in 600 ms,
/// wakes for a byte, and returns end of stream promptly when the peer closes.
fn idle_reader_sleeps_until_needed(options: Options) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let (first, _) = listener.accept().expect("accept");
        let (second, _) = listener.accept().expect("accept");
        (first, second)
    });
    let mut client = Stream::connect_with(addr, &options).expect("connect");
    let other = Stream::connect_with(addr, &options).expect("connect");
    let (mut served, _served_other) = server.join().expect("server");
    assert!(matches!(served.transport(), Transport::Rdma(_)), "{:?}", served.transport());

    let (tid_tx, tid_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        tid_tx.send(own_tid()).expect("tid");
        let mut byte = [0u8; 1];
        let first = served.read(&mut byte).map(|n| (n, byte[0]));
        let started = Instant::now();
        let second = served.read(&mut byte);
        (first, second, started.elapsed())
    });
    let tid = tid_rx.recv().expect("tid");
    // Past the spin before the sleep.
    std::thread::sleep(Duration::from_millis(150));
    let before = blocks_of(tid);
    std::thread::sleep(Duration::from_millis(600));
    let during = blocks_of(tid) - before;
    assert!(during <= 3, "an idle blocked reader blocked {during} times in 600 ms (woke that often)");

    client.write_all(b"x").expect("write");
    std::thread::sleep(Duration::from_millis(150));
    drop(client);
    let (first, second, waited) = reader.join().expect("reader");
    assert_eq!(first.expect("first read"), (1, b'x'));
    assert_eq!(second.expect("read after the peer's close"), 0, "end of stream");
    // The goodbye travels over the TCP connection the sleep watches; the sleep's safety net is
    // a second.
    assert!(waited < Duration::from_millis(700), "the peer's close was noticed after {waited:?}");
    drop(other);
}

#[test]
fn an_idle_reader_over_shm_sleeps_until_needed() {
    idle_reader_sleeps_until_needed(shm());
}

#[test]
fn an_idle_reader_over_soft_sleeps_until_needed() {
    idle_reader_sleeps_until_needed(soft());
}
