//! How often an event loop's soft stream arms its queue pair's port per message: every arming
//! is a look at the port (a system call), so a request/response exchange should cost each side
//! one arming to wait for the peer's message and at most one more to take it in.
//!
//! Before readiness left from the previous message was consumed ahead of the arming, each wait
//! returned at once and armed again: three armings per message and side. And a task polled
//! again while it waits (woken by something else: a timer, a channel, as hyper's dispatcher is)
//! must not arm again when nothing came.
#![cfg(feature = "tokio")]

use lightpath::tokio::{Listener, Stream};
use lightpath::{soft_device_stats, Options, ProviderId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ROUND_TRIPS: u64 = 2_000;

/// The counters are the process's soft device's: the tests here take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Soft-only options and a listener on them.
async fn soft_listener() -> (Options, Listener, std::net::SocketAddr) {
    let options = Options::default().with_providers(&[ProviderId::Soft]);
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    (options, listener, addr)
}

fn port_armings() -> u64 {
    soft_device_stats().iter().map(|device| device.stats.driver.port_armings).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_and_its_answer_cost_each_side_at_most_two_armings() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (options, listener, addr) = soft_listener().await;
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut request = [0u8; 64];
        while stream.read_exact(&mut request).await.is_ok() {
            stream.write_all(&request).await.unwrap();
        }
    });
    let mut stream = Stream::connect_with(addr, &options).await.unwrap();
    assert!(stream.transport().is_rdma(), "{}", stream.transport());
    let mut answer = [0u8; 64];
    // Warm-up: the connection's first messages arm while the ports are still fresh.
    for i in 0..100u8 {
        stream.write_all(&[i; 64]).await.unwrap();
        stream.read_exact(&mut answer).await.unwrap();
    }
    let before = port_armings();
    for i in 0..ROUND_TRIPS {
        let request = [(i % 251) as u8; 64];
        stream.write_all(&request).await.unwrap();
        stream.read_exact(&mut answer).await.unwrap();
        assert_eq!(answer, request);
    }
    let armings = port_armings() - before;
    // Both ends are in this process and share its soft device: two sides' armings.
    let per_message_and_side = armings as f64 / (2 * ROUND_TRIPS) as f64;
    eprintln!("{armings} armings, {per_message_and_side:.2} per message and side");
    assert!(armings > 0, "the streams should wait on their own ports");
    assert!(
        per_message_and_side <= 2.3,
        "{armings} armings for {ROUND_TRIPS} round trips: {per_message_and_side:.2} per message and side"
    );
    stream.close().await.unwrap();
    server.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_polled_again_while_nothing_came_does_not_arm_again() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (options, listener, addr) = soft_listener().await;
    let (go, wait_for_go) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        wait_for_go.await.unwrap();
        stream.write_all(b"late").await.unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
    });
    let mut stream = Stream::connect_with(addr, &options).await.unwrap();
    assert!(stream.transport().is_rdma(), "{}", stream.transport());
    let before = port_armings();
    // The read waits while a 1 ms ticker wakes this task fifty times: each wake-up polls the
    // read again.
    let mut ticker = tokio::time::interval(std::time::Duration::from_millis(1));
    let mut buf = [0u8; 4];
    let mut ticks = 0;
    {
        let read = stream.read_exact(&mut buf);
        tokio::pin!(read);
        let mut go = Some(go);
        loop {
            tokio::select! {
                result = &mut read => { result.unwrap(); break; }
                _ = ticker.tick() => {
                    ticks += 1;
                    if ticks == 50 {
                        go.take().unwrap().send(()).unwrap();
                    }
                }
            }
        }
    }
    assert_eq!(&buf, b"late");
    assert!(ticks >= 50);
    let armings = port_armings() - before;
    eprintln!("{armings} armings over {ticks} polls of one waiting read");
    // The waiting read arms once (and once more to take the message in); the server side's
    // read and write add a few. Arming on every poll made it fifty and more.
    assert!(armings <= 10, "{armings} armings while one read waited through {ticks} polls");
    stream.shutdown().await.unwrap();
    drop(stream);
    server.await.unwrap();
}
