//! Sending without blocking: a nonblocking `send_msg` (or small zero-copy send) of a message
//! larger than the peer's ring, with nobody reading, returns at once — accepted, its rest kept
//! and sent by later calls — and every message still arrives whole and in order, over soft,
//! shm and the TCP fallback. While the rest is kept, writes wait for it and the stream does not
//! report itself writable; every kind of close sends it first.
//!
//! A nonblocking call that blocked would hang these tests; each runs its sending side under a
//! hang guard that fails the test instead (a guard, not a measurement).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::{listener, pattern};
use lightpath::{Options, ProviderId, Stream};
use rustix::event::{poll, PollFd, PollFlags, Timespec};

/// The receive ring of the RDMA tests: messages of several rings flow through it in parts.
const RING: usize = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Soft,
    Shm,
    Tcp,
}

fn options(kind: Kind) -> Options {
    match kind {
        Kind::Soft => Options::default().with_providers(&[ProviderId::Soft]).with_ring_size(RING as u32),
        Kind::Shm => Options::default().with_providers(&[ProviderId::Shm]).with_ring_size(RING as u32),
        Kind::Tcp => Options::tcp_only(),
    }
}

/// A message the transport cannot take whole while nobody reads: several rings, or more than
/// loopback TCP's socket buffers on both ends.
fn big(kind: Kind) -> usize {
    match kind {
        Kind::Tcp => 32 << 20,
        _ => 3 * RING + 17,
    }
}

/// A connected pair: `(writer, reader)`.
fn pair(kind: Kind) -> (Stream, Stream) {
    let listener = listener(options(kind));
    let addr = listener.local_addr().unwrap();
    let accepted = std::thread::spawn(move || listener.accept().unwrap().0);
    let writer = Stream::connect_with(addr, &options(kind)).unwrap();
    let reader = accepted.join().unwrap();
    assert_eq!(writer.transport().is_rdma(), kind != Kind::Tcp, "{}", writer.transport());
    (writer, reader)
}

/// Runs `f` on its own thread and returns its result; fails the test if it has not finished
/// within a minute (it should take milliseconds: only a call that blocks takes longer).
fn within_guard<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(value) => {
            worker.join().unwrap();
            value
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker sent nothing and did not panic"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: a call blocked"),
    }
}

/// A reader thread that starts reading messages only when told, and returns them all (to the
/// end of the stream).
fn late_message_reader(mut reader: Stream) -> (mpsc::Sender<()>, JoinHandle<Vec<Vec<u8>>>) {
    let (go, start) = mpsc::channel::<()>();
    let reading = std::thread::spawn(move || {
        start.recv().unwrap();
        let mut got = Vec::new();
        while let Some(message) = reader.recv_msg().unwrap() {
            got.push(message);
        }
        got
    });
    (go, reading)
}

/// Sleeps on the stream's readiness fd until something may have changed (a guard of 20 s:
/// reaching it fails the test). The caller called `poll_ready` before its last attempt, which
/// armed the fd. RDMA fds are waited on for readability only; a TCP socket for
/// writability too, as an event loop does while it has bytes to send.
fn wait_for_event(stream: &Stream, kind: Kind) {
    let fd = stream.readiness_fd().unwrap();
    let flags = if kind == Kind::Tcp { PollFlags::IN | PollFlags::OUT } else { PollFlags::IN };
    let mut fds = [PollFd::new(&fd, flags)];
    let n = poll(&mut fds, Some(&Timespec { tv_sec: 20, tv_nsec: 0 })).unwrap();
    assert!(n > 0, "no event on the readiness fd");
}

fn assert_same(got: &[Vec<u8>], sent: &[Vec<u8>]) {
    assert_eq!(got.len(), sent.len(), "message count");
    for (i, (got, sent)) in got.iter().zip(sent).enumerate() {
        assert!(got == sent, "message {i} differs ({} bytes received, {} sent)", got.len(), sent.len());
    }
}

macro_rules! over_soft_shm_and_tcp {
    ($($name:ident),* $(,)?) => {
        mod soft {
            $(#[test] fn $name() { super::$name(super::Kind::Soft) })*
        }
        mod shm {
            $(#[test] fn $name() { super::$name(super::Kind::Shm) })*
        }
        mod tcp {
            $(#[test] fn $name() { super::$name(super::Kind::Tcp) })*
        }
    };
}

over_soft_shm_and_tcp!(
    nonblocking_messages_larger_than_the_ring_never_block,
    blocking_send_msg_past_its_write_timeout_keeps_the_rest,
    kept_rest_goes_out_before_a_blocking_close,
    kept_rest_goes_out_before_a_background_close,
    half_close_waits_behind_the_kept_rest,
);

fn nonblocking_messages_larger_than_the_ring_never_block(kind: Kind) {
    let (writer, reader) = pair(kind);
    let big = big(kind);
    let sizes = [big, 10, 0, big + 1000, RING, 1, 2 * big / 3];
    let messages: Vec<Vec<u8>> = (0..14).map(|i| pattern(sizes[i % sizes.len()], i as u32)).collect();
    let (go, reading) = late_message_reader(reader);
    let (first, second) = (messages[0].clone(), messages[1].clone());
    let mut writer = within_guard("nonblocking sends while nobody reads", move || {
        let mut writer = writer;
        writer.set_nonblocking(true).unwrap();
        // The first message is larger than the peer can take: accepted, with its rest kept.
        writer.send_msg(&first).unwrap();
        for _ in 0..3 {
            let err = writer.send_msg(&second).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::WouldBlock, "{err}");
            assert_eq!(writer.write(b"x").unwrap_err().kind(), ErrorKind::WouldBlock);
            assert_eq!(writer.flush().unwrap_err().kind(), ErrorKind::WouldBlock);
            assert!(!writer.poll_ready().unwrap().writable, "writable while the rest is kept");
        }
        writer
    });
    go.send(()).unwrap();
    let sent = messages.clone();
    // An event loop: send the rest whenever the stream is writable, sleep on its fd otherwise.
    writer = within_guard("a nonblocking event loop", move || {
        let mut next = 1;
        loop {
            if writer.poll_ready().unwrap().writable {
                if next < sent.len() {
                    match writer.send_msg(&sent[next]) {
                        Ok(()) => next += 1,
                        Err(err) if err.kind() == ErrorKind::WouldBlock => wait_for_event(&writer, kind),
                        Err(err) => panic!("send_msg {next}: {err}"),
                    }
                    continue;
                }
                match writer.flush() {
                    Ok(()) => break,
                    Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                    Err(err) => panic!("flush: {err}"),
                }
            }
            wait_for_event(&writer, kind);
        }
        writer
    });
    drop(writer);
    assert_same(&reading.join().unwrap(), &messages);
}

fn blocking_send_msg_past_its_write_timeout_keeps_the_rest(kind: Kind) {
    let (writer, reader) = pair(kind);
    let message = pattern(big(kind), 3);
    let (go, reading) = late_message_reader(reader);
    let sent = message.clone();
    let mut writer = within_guard("a blocking send_msg with a write timeout", move || {
        let mut writer = writer;
        writer.set_write_timeout(Some(Duration::from_millis(100))).unwrap();
        // It cannot all fit while nobody reads: accepted at the timeout, the rest kept.
        writer.send_msg(&sent).unwrap();
        let err = writer.write(b"x").unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock), "{err}");
        writer
    });
    go.send(()).unwrap();
    writer.set_write_timeout(None).unwrap();
    writer.send_msg(b"after").unwrap();
    drop(writer);
    assert_same(&reading.join().unwrap(), &[message, b"after".to_vec()]);
}

/// A nonblocking writer whose message is partly kept, closed by `close`: the reader, reading
/// only afterwards, gets the whole message and then the end of the stream.
fn kept_rest_then(kind: Kind, close: impl FnOnce(Stream) + Send + 'static) {
    let (writer, reader) = pair(kind);
    let message = pattern(big(kind), 8);
    let (go, reading) = late_message_reader(reader);
    let sent = message.clone();
    within_guard("closing with a kept rest", move || {
        let mut writer = writer;
        writer.set_nonblocking(true).unwrap();
        writer.send_msg(&sent).unwrap();
        assert!(!writer.poll_ready().unwrap().writable, "the rest is kept");
        // The close waits for the reader, which starts now.
        go.send(()).unwrap();
        close(writer);
    });
    assert_same(&reading.join().unwrap(), &[message]);
}

fn kept_rest_goes_out_before_a_blocking_close(kind: Kind) {
    kept_rest_then(kind, drop);
}

fn kept_rest_goes_out_before_a_background_close(kind: Kind) {
    kept_rest_then(kind, Stream::close_in_background);
}

fn half_close_waits_behind_the_kept_rest(kind: Kind) {
    kept_rest_then(kind, |mut writer| {
        // Queued behind the kept bytes, not sent before them (nor blocking for them).
        writer.shutdown(Shutdown::Write).unwrap();
        assert_eq!(writer.send_msg(b"late").unwrap_err().kind(), ErrorKind::BrokenPipe);
        assert_eq!(writer.write(b"late").unwrap_err().kind(), ErrorKind::BrokenPipe);
        let kind = if writer.transport().is_rdma() { Kind::Soft } else { Kind::Tcp };
        loop {
            // Armed before the attempt, so an event after it wakes the wait below.
            writer.poll_ready().unwrap();
            match writer.flush() {
                Ok(()) => break,
                Err(err) if err.kind() == ErrorKind::WouldBlock => wait_for_event(&writer, kind),
                Err(err) => panic!("flush: {err}"),
            }
        }
    });
}

/// Zero-copy sends below the rendezvous threshold are copied through the ring like `write`
/// and `send_msg`; in nonblocking mode what does not fit is kept the same way (its buffer may
/// be reused at once), and the bytes and the message arrive intact.
fn small_zero_copy_sends_keep_their_rest(provider: ProviderId) {
    let kind = if provider == ProviderId::Shm { Kind::Shm } else { Kind::Soft };
    let options = options(kind).with_rendezvous_min(1 << 20);
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let accepted = std::thread::spawn(move || listener.accept().unwrap().0);
    let writer = Stream::connect_with(addr, &options).unwrap();
    let mut reader = accepted.join().unwrap();
    let bytes = pattern(4 * RING + 5, 1);
    let message = pattern(3 * RING, 2);
    let (bytes_sent, message_sent) = (bytes.clone(), message.clone());
    let (go, start) = mpsc::channel::<()>();
    let reading = std::thread::spawn(move || {
        start.recv().unwrap();
        let mut got = vec![0u8; 4 * RING + 5];
        reader.read_exact(&mut got).unwrap();
        let message = reader.recv_msg().unwrap().unwrap();
        assert_eq!(reader.recv_msg().unwrap(), None);
        (got, message)
    });
    within_guard("nonblocking small zero-copy sends", move || {
        let mut writer = writer;
        writer.set_nonblocking(true).unwrap();
        let buf = writer.register_buf(4 * RING + 5).unwrap();
        buf.write(0, &bytes_sent).unwrap();
        writer.write_buf(&buf, 0, bytes_sent.len()).unwrap();
        // The buffer is ours again: what was not sent was copied.
        buf.write(0, &message_sent).unwrap();
        assert_eq!(
            writer.send_msg_buf(&buf, 0, message_sent.len()).unwrap_err().kind(),
            ErrorKind::WouldBlock
        );
        go.send(()).unwrap();
        loop {
            writer.poll_ready().unwrap();
            match writer.send_msg_buf(&buf, 0, message_sent.len()) {
                Ok(()) => break,
                Err(err) if err.kind() == ErrorKind::WouldBlock => wait_for_event(&writer, kind),
                Err(err) => panic!("send_msg_buf: {err}"),
            }
        }
        buf.with_bytes_mut(|bytes| bytes.fill(0xEE));
        drop(writer);
    });
    let (got, got_message) = reading.join().unwrap();
    assert!(got == bytes, "stream bytes differ");
    assert!(got_message == message, "message differs");
}

#[test]
fn small_zero_copy_sends_keep_their_rest_over_soft() {
    small_zero_copy_sends_keep_their_rest(ProviderId::Soft);
}

#[test]
fn small_zero_copy_sends_keep_their_rest_over_shm() {
    small_zero_copy_sends_keep_their_rest(ProviderId::Shm);
}
