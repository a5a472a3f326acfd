//! What a tokio stream costs in file descriptors beyond the blocking stream it wraps (issue
//! 15: an idle stream should cost about one descriptor beyond its TCP socket).
//!
//! Wrapping an RDMA stream for tokio registers the connection's own descriptors with the
//! runtime by number (its notification eventfd, its queue pair's port, its TCP socket) and
//! opens none. It used to make the readiness epoll and register three duplicates (that epoll
//! twice, one per side, and the TCP socket): four descriptors per stream on top of the
//! provider's own.
//!
//! One test in this file, so no other test opens descriptors while it counts them.
#![cfg(feature = "tokio")]

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lightpath::{Listener, Options, Stream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Descriptors open in this process.
fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A connected pair of blocking streams over `options` (both ends in this process).
fn pair(options: &Options) -> (Stream, Stream) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || listener.accept().unwrap().0);
    let client = Stream::connect_with(addr, options).unwrap();
    let server = server.join().unwrap();
    assert!(client.transport().is_rdma(), "{}", client.transport());
    (client, server)
}

/// Wraps one end of an RDMA pair for tokio and counts what that adds; the wrapped stream
/// must still carry bytes both ways, and dropping it must give the descriptors back.
fn wrapping_opens_no_descriptor(options: Options) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (client, mut server) = pair(&options);
    // Settle what the first connection of a device opens lazily (threads, device fds).
    std::thread::sleep(Duration::from_millis(50));
    let before = open_descriptors();
    let mut client = runtime.block_on(async { lightpath::tokio::Stream::from_std(client) }).unwrap();
    let added = open_descriptors() - before;
    assert_eq!(added, 0, "wrapping an RDMA stream for tokio opened {added} descriptors");

    // Still a working stream, both ways, through the registrations.
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 5];
        server.read_exact(&mut buf).unwrap();
        server.write_all(&buf).unwrap();
        server
    });
    runtime.block_on(async {
        client.write_all(b"hello").await.unwrap();
        let mut back = [0u8; 5];
        tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut back)).await.unwrap().unwrap();
        assert_eq!(&back, b"hello");
    });
    let server = echo.join().unwrap();

    // Dropping deregisters first, then the background close gives back every descriptor the
    // stream held (its TCP socket and its provider's share).
    let with_both = open_descriptors();
    drop(client);
    drop(server);
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_descriptors() >= with_both && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(open_descriptors() < with_both, "dropping the streams closed nothing within 5 s");
    drop(runtime);
}

#[test]
fn a_tokio_stream_costs_no_descriptor_beyond_the_blocking_stream() {
    wrapping_opens_no_descriptor(common::shm());
    wrapping_opens_no_descriptor(common::soft());
}
