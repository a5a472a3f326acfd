//! Zero copy under tokio: `register_buf`, `write_buf` / `send_msg_buf` from and `read_buf` /
//! `recv_msg_buf` into registered buffers, over soft and shm, with both ends tasks of one
//! current-thread runtime — a call that blocked the thread (a rendezvous writer waiting for the
//! reader, a reader waiting for its READs) would stop the other end and hang. Sizes around the
//! rendezvous threshold and far above it, checked by checksum; messages that do not fit the
//! buffer; buffers of another stream refused; futures dropped mid-transfer fence the
//! connection; TCP streams refuse the calls as the blocking ones do.
#![cfg(feature = "tokio")]

mod common;

use std::future::Future;
use std::io::ErrorKind;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use common::{checksum, pattern};
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, RegisteredBuf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: usize = 1 << 20;

fn options(provider: ProviderId) -> Options {
    Options::default().with_providers(&[provider])
}

fn threshold(provider: ProviderId) -> usize {
    Options::default().rendezvous_min_for(provider)
}

/// A connected pair in this runtime: `(server side, client side)`.
async fn pair(options: Options) -> (Stream, Stream) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (accepted, client) = tokio::join!(listener.accept(), Stream::connect_with(addr, &options));
    let (server, client) = (accepted.unwrap().0, client.unwrap());
    assert_eq!(server.transport(), client.transport());
    (server, client)
}

/// Fails the test if `work` has not finished within a minute (it takes well under a second;
/// only a hang takes longer). A guard, not a measurement.
async fn guarded<T>(work: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), work).await.expect("hung: a call blocked the runtime")
}

/// `read_buf` until `len` bytes are in `buf` from `offset`, in calls of at most `step`.
async fn read_buf_exact(stream: &mut Stream, buf: &RegisteredBuf, offset: usize, len: usize, step: usize) {
    let mut done = 0;
    while done < len {
        let want = step.min(len - done);
        let n = stream.read_buf(buf, offset + done, want).await.unwrap();
        assert!(n > 0 && n <= want, "read_buf returned {n} of {want} at {done} of {len}");
        done += n;
    }
}

fn bytes_of(buf: &RegisteredBuf, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    buf.read(offset, &mut out).unwrap();
    out
}

/// Polls `future` once, without anything to wake it.
fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

macro_rules! over_soft_and_shm {
    ($($name:ident),* $(,)?) => {
        mod soft {
            $(#[tokio::test(flavor = "current_thread")]
            async fn $name() { super::guarded(super::$name(lightpath::ProviderId::Soft)).await })*
        }
        mod shm {
            $(#[tokio::test(flavor = "current_thread")]
            async fn $name() { super::guarded(super::$name(lightpath::ProviderId::Shm)).await })*
        }
    };
}

over_soft_and_shm!(
    write_buf_and_read_buf_across_the_threshold,
    messages_from_and_into_registered_buffers,
    buffers_of_another_stream_are_refused,
    dropping_a_started_write_buf_closes_the_connection,
);

/// Over soft only: shm completes READs as fast as they are posted, so the future's first poll
/// runs the whole transfer (the driver retries at once while completions keep coming) and
/// there is no moment with READs in flight to drop it at.
#[tokio::test(flavor = "current_thread")]
async fn dropping_a_read_buf_with_reads_in_flight_closes_the_connection_over_soft() {
    guarded(dropping_a_read_buf_with_reads_in_flight_closes_the_connection(ProviderId::Soft)).await;
}

async fn write_buf_and_read_buf_across_the_threshold(provider: ProviderId) {
    let t = threshold(provider);
    let sizes = [t - 1, t, t + 1, MIB, 16 * MIB];
    let (mut server, mut client) = pair(options(provider)).await;
    let write = async {
        let from = client.register_buf(16 * MIB + 16).unwrap();
        let mut sums = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            for round in 0..2 {
                let data = pattern(size, (i * 2 + round) as u32);
                from.write(16, &data).unwrap();
                client.write_buf(&from, 16, size).await.unwrap();
                // It completed: the buffer may be reused at once.
                from.write(16, &pattern(size, 999)).unwrap();
                sums.push(checksum(&data));
            }
        }
        client.shutdown().await.unwrap();
        sums
    };
    let read = async {
        let into = server.register_buf(16 * MIB + 8).unwrap();
        let mut sums = Vec::new();
        for &size in &sizes {
            // Once into a registered buffer (at an odd offset, in uneven steps), once plainly.
            read_buf_exact(&mut server, &into, 3, size, 3 * MIB + 1).await;
            sums.push(checksum(&bytes_of(&into, 3, size)));
            let mut plain = vec![0u8; size];
            server.read_exact(&mut plain).await.unwrap();
            sums.push(checksum(&plain));
        }
        assert_eq!(server.read_buf(&into, 0, 1).await.unwrap(), 0, "end of stream");
        sums
    };
    let (sent, received) = tokio::join!(write, read);
    assert_eq!(received, sent);
}

async fn messages_from_and_into_registered_buffers(provider: ProviderId) {
    let t = threshold(provider);
    let sizes = [0, 1, 1000, t - 1, t, t + 1, 5 * MIB];
    let (mut server, mut client) = pair(options(provider)).await;
    let send = async {
        let from = client.register_buf(5 * MIB + 1).unwrap();
        let mut sums = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let data = pattern(size, 20 + i as u32);
            from.write(1, &data).unwrap();
            client.send_msg_buf(&from, 1, size).await.unwrap();
            sums.push(checksum(&data));
        }
        // Too large for the receiver's small buffer, by ring and by rendezvous.
        for size in [5000, 2 * t] {
            let data = pattern(size, 40);
            from.write(0, &data).unwrap();
            client.send_msg_buf(&from, 0, size).await.unwrap();
            sums.push(checksum(&data));
        }
        let err = client.send_msg_buf(&from, 5 * MIB, 2).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "past the buffer's end");
        client.shutdown().await.unwrap();
        sums
    };
    let receive = async {
        let into = server.register_buf(5 * MIB + 100).unwrap();
        let mut sums = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            if i % 2 == 0 {
                assert_eq!(server.recv_msg_buf(&into, 100).await.unwrap(), Some(size), "message {i}");
                sums.push(checksum(&bytes_of(&into, 100, size)));
            } else {
                sums.push(checksum(&server.recv_msg().await.unwrap().expect("a message")));
            }
        }
        let small = server.register_buf(1000).unwrap();
        for _ in 0..2 {
            let err = server.recv_msg_buf(&small, 10).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
            sums.push(checksum(&server.recv_msg().await.unwrap().expect("the refused message, kept")));
        }
        assert_eq!(server.recv_msg_buf(&into, 0).await.unwrap(), None, "end of stream");
        sums
    };
    let (sent, received) = tokio::join!(send, receive);
    assert_eq!(received, sent);
}

async fn buffers_of_another_stream_are_refused(provider: ProviderId) {
    let (_other_server, other) = pair(options(provider)).await;
    let foreign = other.register_buf(4 * MIB).unwrap();
    let (mut server, mut client) = pair(options(provider)).await;
    let big = threshold(provider) + 1;
    for len in [10, big] {
        let err = client.write_buf(&foreign, 0, len).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "write_buf of {len}: {err}");
        let err = client.send_msg_buf(&foreign, 0, len).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "send_msg_buf of {len}: {err}");
    }
    let err = server.read_buf(&foreign, 0, 10).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "read_buf: {err}");
    let err = server.recv_msg_buf(&foreign, 0).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "recv_msg_buf: {err}");
    // Refused before anything happened: the pair still works with its own buffers.
    let own = client.register_buf(big).unwrap();
    own.write(0, &pattern(big, 5)).unwrap();
    let into = server.register_buf(big).unwrap();
    let (sent, received) = tokio::join!(client.send_msg_buf(&own, 0, big), server.recv_msg_buf(&into, 0));
    sent.unwrap();
    assert_eq!(received.unwrap(), Some(big));
    assert!(bytes_of(&into, 0, big) == pattern(big, 5));
}

async fn dropping_a_started_write_buf_closes_the_connection(provider: ProviderId) {
    let (mut server, mut client) = pair(options(provider)).await;
    let len = 2 * MIB;
    let buf = client.register_buf(len).unwrap();
    buf.write(0, &pattern(len, 6)).unwrap();
    {
        // The rendezvous is announced on the first poll; the reader does not read.
        let write = pin!(client.write_buf(&buf, 0, len));
        assert!(poll_once(write).is_pending(), "nobody fetched the bytes");
    }
    // Dropped: the connection was given up so that the buffer is free again at once.
    buf.write(0, &pattern(len, 7)).unwrap();
    let err = client.write_all(b"more").await.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::ConnectionReset), "{err}");
    drop(client);
    // The reader never gets the buffer's bytes, old or new: only an error.
    let into = server.register_buf(len).unwrap();
    let err = match server.read_buf(&into, 0, len).await {
        Ok(n) => panic!("read {n} bytes of an abandoned rendezvous"),
        Err(err) => err,
    };
    assert!(matches!(err.kind(), ErrorKind::ConnectionReset | ErrorKind::InvalidData), "{err}");
}

async fn dropping_a_read_buf_with_reads_in_flight_closes_the_connection(provider: ProviderId) {
    // On a fast moment a poll can take all 32 MiB at once (seen over soft, 1 run in 5): that
    // run checks the bytes and tries again; one of a few must catch READs in flight.
    for _ in 0..5 {
        if drop_a_read_buf_with_reads_in_flight(provider).await {
            return;
        }
    }
    panic!("32 MiB of READs completed within one poll in each of 5 tries: nothing was in flight to drop");
}

/// One try of the above: `false` if the first poll already completed the read (whose bytes
/// are then checked), `true` once the drop with READs in flight was checked.
async fn drop_a_read_buf_with_reads_in_flight(provider: ProviderId) -> bool {
    let (mut server, mut client) = pair(options(provider)).await;
    let len = 32 * MIB;
    let buf = client.register_buf(len).unwrap();
    buf.write(0, &pattern(len, 8)).unwrap();
    let into = server.register_buf(len).unwrap();
    let write = async { client.write_buf(&buf, 0, len).await };
    let read = async {
        // One byte first: the rendezvous is then at the head, accepted, so the next call
        // posts its READs on its first poll.
        read_buf_exact(&mut server, &into, 0, 1, 1).await;
        assert_eq!(bytes_of(&into, 0, 1), pattern(len, 8)[..1]);
        {
            let rest = pin!(server.read_buf(&into, 1, len - 1));
            if let Poll::Ready(outcome) = poll_once(rest) {
                assert_eq!(outcome.expect("a read that completed at once"), len - 1);
                assert!(bytes_of(&into, 0, len) == pattern(len, 8), "the bytes of a read done at once");
                return false;
            }
        }
        // Dropped with READs in flight: fenced, so nothing lands in the buffer any more.
        into.with_bytes_mut(|bytes| bytes.fill(0xEE));
        let err = server.read_buf(&into, 1, len - 1).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TimedOut, "the abandoned connection's error: {err}");
        tokio::task::yield_now().await;
        assert!(into.with_bytes(|bytes| bytes.iter().all(|&b| b == 0xEE)), "a READ landed after the drop");
        drop(server);
        true
    };
    let (written, in_flight) = tokio::join!(write, read);
    if in_flight {
        let err = written.expect_err("the reader gave up: the rendezvous cannot complete");
        assert!(matches!(err.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe), "{err}");
    } else {
        written.expect("a rendezvous read at once completes its write");
    }
    in_flight
}

#[tokio::test(flavor = "current_thread")]
async fn tcp_streams_refuse_zero_copy_calls() {
    let (_rdma_server, rdma) = pair(options(ProviderId::Soft)).await;
    let buf = rdma.register_buf(64).unwrap();
    let (mut server, mut client) = pair(Options::tcp_only()).await;
    assert!(!client.transport().is_rdma());
    assert_eq!(client.register_buf(64).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(client.write_buf(&buf, 0, 8).await.unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(client.send_msg_buf(&buf, 0, 8).await.unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(server.read_buf(&buf, 0, 8).await.unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(server.recv_msg_buf(&buf, 0).await.unwrap_err().kind(), ErrorKind::Unsupported);
    // Refused without touching the stream: it still carries messages.
    client.send_msg(b"still here").await.unwrap();
    assert_eq!(server.recv_msg().await.unwrap().as_deref(), Some(&b"still here"[..]));
}
