//! What a tokio stream costs in file descriptors beyond the blocking stream it wraps (issue
//! 15: an idle stream should cost about one descriptor beyond its TCP socket).
//!
//! Wrapping an RDMA stream for tokio registers the connection's own descriptors with the
//! runtime by number (its notification eventfd, its queue pair's port, its TCP socket) and
//! opens none. It used to make the readiness epoll and register three duplicates (that epoll
//! twice, one per side, and the TCP socket): four descriptors per stream on top of the
//! provider's own.
//!
//! A tokio stream whose queue pair has no doorbell of its own (a soft queue pair without a
//! UDP port of its own) gets its wake-ups from the completion router straight to its task:
//! it holds its TCP socket and nothing else (the connection's notification eventfd is made
//! only for a blocked thread or a caller that asks for it).
//!
//! Over shm, a tokio stream's queue pair wakes its task through the device's task doorbell
//! (one descriptor per device, see `lightpath_shm::activity`), so it holds its TCP socket alone
//! too (before, its own eventfd and the peer's copy of it: three).
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

/// Open descriptors by kind (what `/proc/self/fd` links to, numbers dropped).
fn descriptor_kinds() -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let target = std::fs::read_link(entry.path()).map(|t| t.display().to_string()).unwrap_or_default();
        *kinds.entry(target.split(':').next().unwrap_or_default().to_string()).or_insert(0) += 1;
    }
    kinds
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

/// Connects `count` tokio streams to a tokio listener in this process over `options`, sends
/// a message each way on each, and returns the descriptors opened per connection (both ends
/// counted: a pair of kernel TCP sockets is 2), and the eventfds, epolls and timers opened in
/// all (what `/proc/self/fd` shows as `anon_inode`).
fn descriptors_per_tokio_pair(options: Options, count: usize) -> (f64, usize) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let listener = lightpath::tokio::Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serve = |listener: lightpath::tokio::Listener, count: usize| async move {
            let mut streams = Vec::new();
            for _ in 0..count {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 4];
                stream.read_exact(&mut buf).await.unwrap();
                stream.write_all(&buf).await.unwrap();
                stream.flush().await.unwrap();
                streams.push(stream);
            }
            (listener, streams)
        };
        let round_trip = |mut stream: lightpath::tokio::Stream, tag: u32| async move {
            stream.write_all(&tag.to_le_bytes()).await.unwrap();
            stream.flush().await.unwrap();
            let mut back = [0u8; 4];
            stream.read_exact(&mut back).await.unwrap();
            assert_eq!(u32::from_le_bytes(back), tag);
            assert!(stream.transport().is_rdma(), "{}", stream.transport());
            stream
        };
        // A first connection sets up what a device opens once (threads, device descriptors).
        let server = tokio::spawn(serve(listener, 1));
        let first = lightpath::tokio::Stream::connect_with(addr, &options).await.unwrap();
        let first = round_trip(first, 0).await;
        let (listener, first_served) = server.await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;

        let before = open_descriptors();
        let before_kinds = descriptor_kinds();
        let server = tokio::spawn(serve(listener, count));
        let mut clients = Vec::new();
        for tag in 1..=count {
            let stream = lightpath::tokio::Stream::connect_with(addr, &options).await.unwrap();
            clients.push(round_trip(stream, tag as u32).await);
        }
        let (_listener, served) =
            tokio::time::timeout(Duration::from_secs(30), server).await.unwrap().unwrap();
        let per_pair = (open_descriptors() - before) as f64 / count as f64;
        let anonymous = |kinds: &std::collections::BTreeMap<String, usize>| kinds.get("anon_inode").copied();
        let anon_added =
            anonymous(&descriptor_kinds()).unwrap_or(0).saturating_sub(anonymous(&before_kinds).unwrap_or(0));
        drop((first, first_served, clients, served));
        (per_pair, anon_added)
    })
}

#[test]
fn a_tokio_stream_costs_no_descriptor_beyond_the_blocking_stream() {
    wrapping_opens_no_descriptor(common::shm());
    wrapping_opens_no_descriptor(common::soft());

    // Soft queue pairs without ports of their own: both ends hold their TCP socket alone.
    // (With the connection's notification eventfd made at once, as before, it was 4.)
    let mut without_ports = common::soft();
    without_ports.soft_qp_port = Some(false);
    // Each completion router the connections fill (one per so many queue pairs) has its
    // notifier thread's two; a descriptor per connection would be 32 here.
    let (per_pair, anon_added) = descriptors_per_tokio_pair(without_ports, 16);
    assert!(anon_added <= 4, "{anon_added} eventfds and the like for 16 tokio pairs over soft without ports");
    // Besides, what devices and routers open once (8 in all at most: half a descriptor per pair).
    assert!(per_pair <= 2.5, "{per_pair} descriptors per tokio pair over soft without ports (TCP: 2)");

    // Soft queue pairs with ports of their own (the default): the port is what the event loop
    // watches; news other threads make wakes the task directly. Both ends: TCP socket and
    // port (with an eventfd each as well before: 6 per pair).
    let (per_pair, anon_added) = descriptors_per_tokio_pair(common::soft(), 16);
    assert!(anon_added <= 4, "{anon_added} eventfds and the like for 16 tokio pairs over soft");
    assert!(per_pair <= 4.5, "{per_pair} descriptors per tokio pair over soft (TCP sockets and ports: 4)");

    // shm: each queue pair wakes its task through its device's task doorbell, not through an
    // eventfd of its own that the peer holds a copy of (6 per pair, with the TCP sockets).
    let (per_pair, anon_added) = descriptors_per_tokio_pair(common::shm(), 16);
    assert!(anon_added <= 4, "{anon_added} eventfds and the like for 16 tokio pairs over shm");
    assert!(per_pair <= 2.5, "{per_pair} descriptors per tokio pair over shm (TCP: 2)");
}
