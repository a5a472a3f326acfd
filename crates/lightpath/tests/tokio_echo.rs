//! The tokio driver: echo through `tokio::io::split` + `copy`, and a proxy built on
//! `copy_bidirectional` between a Lightpath stream and a plain tokio TCP stream, over the soft
//! provider and over TCP; messages many times the receive ring between two tasks of one
//! runtime, and a dropped `send_msg` future whose message still arrives whole (soft, shm, TCP);
//! a vectored write is one record and `flush` does not wait for the acknowledgement.
#![cfg(feature = "tokio")]

mod common;

use common::{checksum, pattern};
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

async fn split_copy_echo(options: Options, expect_rdma: bool) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let (mut reader, mut writer) = tokio::io::split(stream);
        let copied = tokio::io::copy(&mut reader, &mut writer).await.unwrap();
        writer.shutdown().await.unwrap();
        copied
    });
    let mut stream = Stream::connect_with(addr, &options).await.unwrap();
    assert_eq!(stream.transport().is_rdma(), expect_rdma, "{}", stream.transport());
    let data = pattern(3 << 20, 4);
    let (mut reader, mut writer) = tokio::io::split(&mut stream);
    let send = async {
        writer.write_all(&data).await.unwrap();
        writer.shutdown().await.unwrap();
    };
    let receive = async {
        let mut back = Vec::new();
        reader.read_to_end(&mut back).await.unwrap();
        back
    };
    let ((), back) = tokio::join!(send, receive);
    assert_eq!(back.len(), data.len());
    assert_eq!(checksum(&back), checksum(&data));
    assert_eq!(server.await.unwrap(), data.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_and_copy_over_soft() {
    split_copy_echo(soft(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_and_copy_over_tcp() {
    split_copy_echo(Options::tcp_only(), false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn copy_bidirectional_proxy_and_messages() {
    // A plain tokio TCP echo server behind a Lightpath proxy.
    let backend = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = backend.accept().await.unwrap();
        let (mut r, mut w) = conn.split();
        tokio::io::copy(&mut r, &mut w).await.unwrap();
    });
    let listener = Listener::bind_with("127.0.0.1:0", soft()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = tokio::spawn(async move {
        let (mut front, _) = listener.accept().await.unwrap();
        assert_eq!(front.transport(), Transport::Rdma(ProviderId::Soft));
        let greeting = front.recv_msg().await.unwrap().unwrap();
        front.send_msg(&greeting).await.unwrap();
        let mut back = tokio::net::TcpStream::connect(backend_addr).await.unwrap();
        tokio::io::copy_bidirectional(&mut front, &mut back).await.unwrap()
    });
    let mut stream = Stream::connect_with(addr, &soft()).await.unwrap();
    stream.send_msg(b"hello proxy").await.unwrap();
    assert_eq!(stream.recv_msg().await.unwrap().as_deref(), Some(&b"hello proxy"[..]));
    let data = pattern(200_000, 9);
    stream.write_all(&data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(back, data);
    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    let (up, down) = proxy.await.unwrap();
    assert_eq!((up, down), (data.len() as u64, data.len() as u64));
}

fn small_ring(provider: ProviderId) -> Options {
    Options::default().with_providers(&[provider]).with_ring_size(64 << 10)
}

async fn connected(options: &Options) -> (Stream, Stream) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (accepted, connected) = tokio::join!(listener.accept(), Stream::connect_with(addr, options));
    (accepted.unwrap().0, connected.unwrap())
}

/// Messages of up to 16 rings between two tasks of one current-thread runtime: `send_msg` on
/// a full ring waits by sleeping (one that blocked the thread would stop the receiver: a
/// hang), completes once the whole message is handed over, and every message arrives whole and
/// in order.
async fn large_messages_through_a_full_ring(options: Options) {
    let (mut receiver, mut sender) = connected(&options).await;
    let sizes = [1 << 20, 0, 3, 300_000, (1 << 20) + 7, 64 << 10, 1];
    let messages: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| pattern(n, i as u32)).collect();
    let send = async {
        for message in &messages {
            sender.send_msg(message).await.unwrap();
        }
        sender.shutdown().await.unwrap();
    };
    let receive = async {
        let mut got = Vec::new();
        while let Some(message) = receiver.recv_msg().await.unwrap() {
            got.push(message);
        }
        got
    };
    // A guard against a hang, not a measurement.
    let guard = std::time::Duration::from_secs(60);
    let ((), got) = tokio::time::timeout(guard, async { tokio::join!(send, receive) }).await.expect("hung");
    assert_eq!(got.len(), messages.len());
    assert!(got == messages, "messages differ");
}

#[tokio::test(flavor = "current_thread")]
async fn large_messages_through_a_full_ring_over_soft() {
    large_messages_through_a_full_ring(small_ring(ProviderId::Soft)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn large_messages_through_a_full_ring_over_shm() {
    large_messages_through_a_full_ring(small_ring(ProviderId::Shm)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn large_messages_through_a_full_ring_over_tcp() {
    large_messages_through_a_full_ring(Options::tcp_only()).await;
}

/// A `send_msg` future polled once (part of the message goes, the rest does not fit) and then
/// dropped: the message was accepted, so its rest goes out before the next one, and the
/// receiver gets both whole.
async fn dropped_send_msg_still_delivers_its_message(options: Options, big: usize) {
    use std::future::Future;
    let (mut receiver, mut sender) = connected(&options).await;
    // One exchange first: a TCP stream, as tokio's own sockets, tries a write only once the
    // runtime has seen the socket writable, which a fresh one has not.
    sender.send_msg(b"hello").await.unwrap();
    assert_eq!(receiver.recv_msg().await.unwrap().as_deref(), Some(&b"hello"[..]));
    let first = pattern(big, 1);
    {
        let send = std::pin::pin!(sender.send_msg(&first));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(send.poll(&mut cx).is_pending(), "the message does not fit at once");
    }
    let send = async {
        sender.send_msg(b"second").await.unwrap();
        sender.shutdown().await.unwrap();
    };
    let receive = async {
        let mut got = Vec::new();
        while let Some(message) = receiver.recv_msg().await.unwrap() {
            got.push(message);
        }
        got
    };
    let guard = std::time::Duration::from_secs(60);
    let ((), got) = tokio::time::timeout(guard, async { tokio::join!(send, receive) }).await.expect("hung");
    assert_eq!(got.len(), 2);
    assert!(got[0] == first, "the first message differs ({} bytes)", got[0].len());
    assert_eq!(got[1], b"second");
}

#[tokio::test(flavor = "current_thread")]
async fn dropped_send_msg_still_delivers_its_message_over_soft() {
    dropped_send_msg_still_delivers_its_message(small_ring(ProviderId::Soft), 1 << 20).await;
}

#[tokio::test(flavor = "current_thread")]
async fn dropped_send_msg_still_delivers_its_message_over_shm() {
    dropped_send_msg_still_delivers_its_message(small_ring(ProviderId::Shm), 1 << 20).await;
}

#[tokio::test(flavor = "current_thread")]
async fn dropped_send_msg_still_delivers_its_message_over_tcp() {
    // More than loopback TCP's socket buffers on both ends.
    dropped_send_msg_still_delivers_its_message(Options::tcp_only(), 32 << 20).await;
}

/// A vectored write (hyper's header and body) goes as one record: over soft, small slices
/// that fit one datagram leave in exactly one, where a write per slice sent one each.
#[tokio::test(flavor = "current_thread")]
async fn a_vectored_write_is_one_record() {
    use std::io::IoSlice;
    use std::pin::Pin;
    use tokio::io::AsyncWrite;
    let (mut receiver, mut sender) = connected(&soft()).await;
    assert!(sender.is_write_vectored());
    let before = sender.get_ref().queue_pair_stats().expect("a soft stream has queue-pair counters");
    let (head, body, tail) = (pattern(40, 1), pattern(100, 2), pattern(7, 3));
    let slices = [IoSlice::new(&head), IoSlice::new(&[]), IoSlice::new(&body), IoSlice::new(&tail)];
    let n = std::future::poll_fn(|cx| Pin::new(&mut sender).poll_write_vectored(cx, &slices)).await.unwrap();
    assert_eq!(n, 147, "all of it fits at once");
    let mut got = vec![0u8; n];
    receiver.read_exact(&mut got).await.unwrap();
    assert_eq!(got, [head, body, tail].concat());
    let after = sender.get_ref().queue_pair_stats().unwrap();
    let sent = after.tx_datagrams - before.tx_datagrams - (after.retransmits - before.retransmits);
    assert_eq!(sent, 1, "one write with immediate for the three slices");
}

/// `poll_flush` hands the bytes to the transport and does not wait for the peer's
/// acknowledgement (as a socket's flush): ready on its first poll right after a write, on
/// every transport; `shutdown` still waits until the peer has everything.
#[tokio::test(flavor = "current_thread")]
async fn flush_does_not_wait_for_the_acknowledgement() {
    use std::future::Future;
    for options in [soft(), small_ring(ProviderId::Shm), Options::tcp_only()] {
        let (mut receiver, mut sender) = connected(&options).await;
        sender.write_all(b"ping").await.unwrap();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let flush = std::pin::pin!(sender.flush());
        assert!(
            matches!(flush.poll(&mut cx), std::task::Poll::Ready(Ok(()))),
            "flush waited over {}",
            sender.transport()
        );
        sender.shutdown().await.unwrap();
        let mut got = Vec::new();
        receiver.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ping");
    }
}

/// Over soft, an event loop is woken by the provider's progress thread through the completion
/// hook: no notifier thread of Lightpath's sits between them (one wake-up less per message).
#[tokio::test(flavor = "current_thread")]
async fn soft_event_loops_need_no_notifier_thread() {
    let (mut receiver, mut sender) = connected(&soft()).await;
    for round in 0..3u8 {
        sender.write_all(&[round; 10]).await.unwrap();
        let mut got = [0u8; 10];
        receiver.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [round; 10]);
    }
    let threads: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .collect();
    assert!(
        !threads.iter().any(|name| name.starts_with("lightpath-cq-no")),
        "a notifier thread runs: {threads:?}"
    );
}

/// A read zero-fills only the room it can use of the caller's uninitialised buffer (hyper
/// offers hundreds of KiB; zeroing all of it on every read cost a fifth of a server's CPU).
#[tokio::test(flavor = "current_thread")]
async fn a_read_initialises_only_what_it_can_fill() {
    use std::mem::MaybeUninit;
    use std::pin::Pin;
    use tokio::io::{AsyncRead, ReadBuf};
    for options in [soft(), small_ring(ProviderId::Shm), Options::tcp_only()] {
        let (mut receiver, mut sender) = connected(&options).await;
        // A read that finds nothing (an event loop's read before each wait) zeroes little.
        let mut storage = vec![MaybeUninit::<u8>::uninit(); 1 << 20];
        let mut buf = ReadBuf::uninit(&mut storage);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut receiver).poll_read(&mut cx, &mut buf).is_pending());
        assert!(
            buf.initialized().len() <= 4 << 10,
            "{} bytes zeroed for a read that found nothing over {}",
            buf.initialized().len(),
            receiver.transport()
        );
        sender.write_all(b"0123456789").await.unwrap();
        let mut storage = vec![MaybeUninit::<u8>::uninit(); 1 << 20];
        let mut buf = ReadBuf::uninit(&mut storage);
        std::future::poll_fn(|cx| Pin::new(&mut receiver).poll_read(cx, &mut buf)).await.unwrap();
        assert_eq!(buf.filled(), b"0123456789");
        assert!(
            buf.initialized().len() <= 4 << 10,
            "{} bytes zeroed for a 10-byte read over {}",
            buf.initialized().len(),
            receiver.transport()
        );
    }
}
