//! The readiness API an event loop uses: wait on `event_fds` with poll(2), then ask
//! `poll_ready`; over RDMA and over TCP.

mod common;

use std::io::{Read, Write};
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use common::listener;
use lightpath::{Options, ProviderId, Stream};
use rustix::event::{poll, PollFd, PollFlags, Timespec};

/// Waits (at most `limit`) until `poll_ready` reports the stream readable, sleeping in
/// poll(2) on its event fds in between; returns how many sleeps it took.
fn wait_readable(stream: &mut Stream, limit: Duration) -> usize {
    let started = Instant::now();
    let mut sleeps = 0;
    loop {
        if stream.poll_ready().unwrap().readable {
            return sleeps;
        }
        assert!(started.elapsed() < limit, "never became readable");
        let fds = stream.event_fds();
        // SAFETY: the fds belong to `stream`, which outlives this poll call.
        let borrowed: Vec<BorrowedFd<'_>> =
            fds.iter().map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) }).collect();
        let mut pollfds: Vec<PollFd<'_>> = borrowed.iter().map(|fd| PollFd::new(fd, PollFlags::IN)).collect();
        let timeout = Timespec { tv_sec: 1, tv_nsec: 0 };
        poll(&mut pollfds, Some(&timeout)).unwrap();
        sleeps += 1;
    }
}

fn readiness(options: Options) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4];
        stream.read_exact(&mut buf).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        stream.write_all(b"pong").unwrap();
        stream.read_exact(&mut buf).unwrap();
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    stream.set_nonblocking(true).unwrap();
    let first = stream.poll_ready().unwrap();
    assert!(!first.readable, "nothing has been sent yet");
    assert!(first.writable);
    stream.write_all(b"ping").unwrap();
    let sleeps = wait_readable(&mut stream, Duration::from_secs(5));
    assert!(sleeps >= 1, "the answer comes 100 ms later, so the loop slept");
    let mut buf = [0u8; 4];
    stream.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");
    assert!(!stream.poll_ready().unwrap().readable);
    stream.write_all(b"done").unwrap();
    server.join().unwrap();
    // The server closed: end of stream is readable too.
    wait_readable(&mut stream, Duration::from_secs(5));
    assert_eq!(stream.read(&mut buf).unwrap(), 0);
}

#[test]
fn readiness_over_soft() {
    readiness(Options::default().with_providers(&[ProviderId::Soft]));
}

#[test]
fn readiness_over_tcp() {
    readiness(Options::tcp_only());
}
