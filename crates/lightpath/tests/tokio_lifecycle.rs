//! The tokio listener and connect as tokio users expect them (issue 17, parts 2 and 3):
//!
//! * a runtime with a task waiting in `accept` and streams still open shuts down at once
//!   (before: the accept ran on the blocking pool, and a runtime waits for its blocking tasks
//!   when it shuts down, so the process could not exit);
//! * `accept` is cancel-safe: `timeout(10 ms, accept())` in a loop loses no connection and
//!   leaves no thread behind (before: each cancelled accept left a blocking-pool thread in
//!   the blocking accept, which took the next connection and dropped it);
//! * a dropped `connect` leaves nothing behind (before: its negotiation went on on the
//!   blocking pool until the handshake timed out);
//! * silent, garbage-speaking and slow clients do not hold up other accepts.
//!
//! Each test runs its own runtime, with named threads where it counts them, and bounds every
//! wait.
#![cfg(feature = "tokio")]

use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::OddClients;
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

/// A multi-thread runtime whose threads (workers and blocking pool) carry `name`.
fn runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

/// Threads of this process named `name` (thread names are cut to 15 bytes).
fn threads_named(name: &str) -> usize {
    let name = &name[..name.len().min(15)];
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// Runs `f` on a thread of its own and returns its result, or `None` if it has not finished
/// within `limit` (the thread is then left behind, stuck).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    result.recv_timeout(limit).ok()
}

#[test]
fn runtime_shutdown_is_not_held_by_a_waiting_accept_or_open_streams() {
    for options in [soft(), Options::default().with_providers(&[ProviderId::Shm]), Options::tcp_only()] {
        let shut_down = within(Duration::from_secs(20), move || {
            let rt = runtime("lp-shutdown");
            rt.block_on(async {
                let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
                let addr = listener.local_addr().unwrap();
                // The server accepts one connection, answers it, keeps it open and goes on
                // waiting in accept, as a server does when its work is done.
                tokio::spawn(async move {
                    let (mut stream, _) = listener.accept().await.unwrap();
                    let mut hello = [0u8; 5];
                    stream.read_exact(&mut hello).await.unwrap();
                    stream.write_all(&hello).await.unwrap();
                    let _kept_open = stream;
                    let _ = listener.accept().await;
                });
                let mut client = Stream::connect_with(addr, &options).await.unwrap();
                client.write_all(b"hello").await.unwrap();
                let mut back = [0u8; 5];
                client.read_exact(&mut back).await.unwrap();
                assert_eq!(&back, b"hello");
                // Unread bytes in flight as the runtime goes.
                client.write_all(&[7u8; 100_000]).await.unwrap();
                tokio::spawn(async move {
                    let _open = client;
                    std::future::pending::<()>().await;
                });
            });
            let started = Instant::now();
            drop(rt);
            started.elapsed()
        });
        let took = shut_down.expect("the runtime did not shut down within 20 s");
        assert!(took < Duration::from_secs(5), "runtime shutdown took {took:?}");
    }
}

#[test]
fn a_cancelled_accept_loses_no_connection_and_leaves_no_thread() {
    // On a thread of its own: a runtime that cannot shut down must fail the test, not hang it.
    let finished = within(Duration::from_secs(30), cancelled_accepts);
    assert!(finished.is_some(), "the accepts panicked (see above) or did not finish within 30 s");
}

fn cancelled_accepts() {
    const NAME: &str = "lp-cancel-acc";
    let rt = runtime(NAME);
    let outcome = rt.block_on(async {
        let listener = Listener::bind_with("127.0.0.1:0", soft()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Some accepts time out before the client even starts.
        let mut cancelled = 0;
        for _ in 0..20 {
            assert!(tokio::time::timeout(Duration::from_millis(10), listener.accept()).await.is_err());
            cancelled += 1;
        }
        let client = tokio::spawn(async move {
            let mut stream = Stream::connect_with(addr, &soft()).await.unwrap();
            stream.write_all(b"ping").await.unwrap();
            let mut back = [0u8; 4];
            stream.read_exact(&mut back).await.unwrap();
            back
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut server, _) = loop {
            assert!(Instant::now() < deadline, "no accept returned the connection within 10 s");
            match tokio::time::timeout(Duration::from_millis(10), listener.accept()).await {
                Ok(accepted) => break accepted.unwrap(),
                Err(_) => cancelled += 1,
            }
        };
        let mut ping = [0u8; 4];
        server.read_exact(&mut ping).await.unwrap();
        server.write_all(&ping).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(10), client).await.unwrap().unwrap();
        assert_eq!(&back, b"ping");
        (cancelled, threads_named(NAME))
    });
    let (cancelled, threads) = outcome;
    assert!(cancelled >= 20);
    // The two workers, and perhaps a blocking thread tokio itself started (name resolution);
    // not one per cancelled accept.
    assert!(threads <= 4, "{threads} runtime threads after {cancelled} cancelled accepts");
    rt.shutdown_timeout(Duration::from_secs(5));
}

#[test]
fn a_dropped_connect_leaves_nothing_behind() {
    const NAME: &str = "lp-drop-conn";
    let rt = runtime(NAME);
    let (closed_after, threads) = rt.block_on(async {
        // A server that accepts and never speaks: the client's negotiation waits for its
        // answer (up to the handshake timeout, 5 s).
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let options = soft();
        let connecting = Stream::connect_with(addr, &options);
        let (dropped, accepted) =
            tokio::join!(tokio::time::timeout(Duration::from_millis(100), connecting), silent.accept());
        assert!(dropped.is_err(), "the connect cannot have finished");
        let threads = threads_named(NAME);
        let (mut conn, _) = accepted.unwrap();
        // The client's hello arrived; then the connection must close with the dropped future.
        let started = Instant::now();
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => continue,
                Err(_) => panic!("the dropped connect's TCP connection is still open after 10 s"),
            }
        }
        (started.elapsed(), threads)
    });
    assert!(closed_after < Duration::from_secs(1), "the connection closed {closed_after:?} after the drop");
    assert!(threads <= 4, "{threads} runtime threads while a dropped connect was about");
    rt.shutdown_timeout(Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_garbage_and_slow_clients_do_not_hold_up_accepts() {
    let options = soft();
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let started = Instant::now();
    let mut odd = OddClients::connect(addr);
    // Meanwhile a Lightpath client gets through at once.
    let client = tokio::spawn(async move { Stream::connect_with(addr, &soft()).await.unwrap() });
    let (first, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept()).await.unwrap().unwrap();
    assert!(started.elapsed() < options.plain_client_wait, "the first accept waited for the silent clients");
    assert_eq!(first.transport(), Transport::Rdma(ProviderId::Soft));
    let client = client.await.unwrap();
    assert_eq!(client.transport(), Transport::Rdma(ProviderId::Soft));
    odd.garbage_was_told();
    // The silent client and the slow one, whose bytes did not complete the magic, are plain
    // TCP peers once the wait is over; the silent one gets a working stream.
    let mut plain = Vec::new();
    for _ in 0..2 {
        let (stream, _) =
            tokio::time::timeout(Duration::from_secs(10), listener.accept()).await.unwrap().unwrap();
        assert_eq!(stream.transport(), Transport::PlainTcp);
        plain.push(stream);
    }
    for stream in &mut plain {
        stream.write_all(b"hi").await.unwrap();
    }
    odd.plain_ones_read_hi();
}
