//! `Stream::drive`, the look a busy-polling loop takes between waits (the collectives' mesh):
//! it reports what a read or a write would do, and `handed_over` means the written bytes reach
//! the peer without the writer calling anything again. Over shm (RDMA) and TCP.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{listener, pattern, shm};
use lightpath::{Options, Stream};

/// How long a loop may look before the test calls it a hang (a guard, not a measurement).
const HANG_GUARD: Duration = Duration::from_secs(20);

/// Drives `stream` until `done` says so; panics after the hang guard.
fn drive_until(stream: &mut Stream, what: &str, done: impl Fn(&lightpath::Driven) -> bool) {
    let start = Instant::now();
    loop {
        let driven = stream.drive().unwrap();
        if done(&driven) {
            return;
        }
        assert!(start.elapsed() < HANG_GUARD, "drive never reported {what}: {driven:?}");
        std::thread::yield_now();
    }
}

fn handed_over_bytes_arrive_without_further_calls(options: Options, rdma: bool) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    // Larger than the peer's ring: the writes wait for room and receive credits on the way.
    let message = pattern(4 << 20, 7);
    let expected = message.clone();
    let (got_tx, got_rx) = mpsc::channel::<Vec<u8>>();
    let (answer_tx, answer_rx) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(HANG_GUARD)).unwrap();
        let mut buf = vec![0u8; expected.len()];
        stream.read_exact(&mut buf).unwrap();
        got_tx.send(buf).unwrap();
        answer_rx.recv().unwrap();
        stream.write_all(b"pong").unwrap();
        stream.flush().unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).unwrap();
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    stream.set_nonblocking(true).unwrap();
    let first = stream.drive().unwrap();
    assert!(first.writable && first.handed_over, "{first:?}");
    if rdma {
        assert!(!first.readable, "nothing was sent to this side: {first:?}");
    }
    // Write everything, looking with drive only, until the stream holds nothing back.
    let mut sent = 0;
    let start = Instant::now();
    while sent < message.len() {
        let driven = stream.drive().unwrap();
        if driven.writable {
            match stream.write(&message[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("write: {e}"),
            }
            // What the stream knows without a look never contradicts the look.
            if stream.handed_over_now() {
                assert!(stream.drive().unwrap().handed_over, "handed_over_now without handed_over");
            }
            assert!(rdma || !stream.handed_over_now(), "a TCP stream never knows without a look");
        }
        assert!(start.elapsed() < HANG_GUARD, "the peer never made room ({sent} bytes sent)");
    }
    drive_until(&mut stream, "handed_over", |d| d.handed_over);
    // From here on this side calls nothing: the peer still gets every byte.
    let got = got_rx.recv_timeout(HANG_GUARD).expect("the peer read everything");
    assert!(got == message, "the peer read other bytes");
    answer_tx.send(()).unwrap();
    drive_until(&mut stream, "readable", |d| d.readable);
    let mut buf = [0u8; 4];
    let start = Instant::now();
    let mut have = 0;
    while have < 4 {
        match stream.read(&mut buf[have..]) {
            Ok(0) => panic!("end of stream before the answer"),
            Ok(n) => have += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => panic!("read: {e}"),
        }
        assert!(start.elapsed() < HANG_GUARD, "the answer never came");
    }
    assert_eq!(&buf, b"pong");
    stream.set_nonblocking(false).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    server.join().unwrap();
}

#[test]
fn drive_over_shm() {
    handed_over_bytes_arrive_without_further_calls(shm(), true);
}

#[test]
fn drive_over_tcp() {
    handed_over_bytes_arrive_without_further_calls(Options::tcp_only(), false);
}

/// `handed_over_now` right after a small write: the write posted its record at once, so the
/// stream knows it without a look (what the collectives' mesh relies on to skip a drive per
/// send); a TCP stream always says `false` (a look tells).
fn handed_over_now_after_a_small_write(options: Options, rdma: bool) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(HANG_GUARD)).unwrap();
        let mut buf = [0u8; 8];
        stream.read_exact(&mut buf).unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).unwrap();
        buf
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    stream.set_nonblocking(true).unwrap();
    assert_eq!(stream.write(b"8 bytes!").unwrap(), 8);
    assert_eq!(stream.handed_over_now(), rdma);
    drive_until(&mut stream, "handed_over", |d| d.handed_over);
    stream.set_nonblocking(false).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(&server.join().unwrap(), b"8 bytes!");
}

#[test]
fn handed_over_now_over_shm() {
    handed_over_now_after_a_small_write(shm(), true);
}

#[test]
fn handed_over_now_over_tcp() {
    handed_over_now_after_a_small_write(Options::tcp_only(), false);
}
