//! A blocking close (dropping a `Stream`) while the peer keeps writing into it: the close
//! returns once this side's own bytes are acknowledged, with a clean goodbye, and the writer's
//! next write fails (`BrokenPipe` over RDMA: it saw the goodbye; a reset or broken pipe over
//! TCP, whose kernel resets a socket closed with unread bytes) instead of hanging. Over RDMA the
//! writer still reads what the closing side sent before it closed, then end of stream.
//!
//! Writers: blocking byte writes, one-byte and empty messages (which never fill the ring: only
//! receive credits stop them), and a nonblocking event loop; over soft, shm and TCP. The linger
//! time is two minutes, so a close that waited for it (or for the writer to stop on its own)
//! trips the hang guard instead of passing.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use common::listener;
use lightpath::{Options, ProviderId, Stream};
use rustix::event::{poll, PollFd, PollFlags, Timespec};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    Bytes,
    TinyMessages,
    EmptyMessages,
    EventLoop,
}

const WRITERS: [Writer; 4] = [Writer::Bytes, Writer::TinyMessages, Writer::EmptyMessages, Writer::EventLoop];

fn uses_messages(writer: Writer) -> bool {
    matches!(writer, Writer::TinyMessages | Writer::EmptyMessages)
}

/// One write of the writer's kind (nonblocking for the event loop).
fn write_once(stream: &mut Stream, writer: Writer) -> std::io::Result<()> {
    match writer {
        Writer::Bytes | Writer::EventLoop => stream.write(&[5u8; 1000]).map(drop),
        Writer::TinyMessages => stream.send_msg(&[1]),
        Writer::EmptyMessages => stream.send_msg(&[]),
    }
}

/// Writes until a write fails; returns that error.
fn write_until_error(stream: &mut Stream, writer: Writer, rdma: bool) -> std::io::Error {
    if writer == Writer::EventLoop {
        stream.set_nonblocking(true).unwrap();
    }
    loop {
        if writer == Writer::EventLoop && !stream.poll_ready().unwrap().writable {
            let fd = stream.readiness_fd().unwrap();
            let flags = if rdma { PollFlags::IN } else { PollFlags::IN | PollFlags::OUT };
            let mut fds = [PollFd::new(&fd, flags)];
            let n = poll(&mut fds, Some(&Timespec { tv_sec: 60, tv_nsec: 0 })).unwrap();
            assert!(n > 0, "the event loop was never woken");
            continue;
        }
        match write_once(stream, writer) {
            Ok(()) => {}
            Err(err) if err.kind() == ErrorKind::WouldBlock => {}
            Err(err) => return err,
        }
    }
}

fn close_while_the_peer_writes(options: Options, writer: Writer) {
    let options = Options { linger: Duration::from_secs(120), ..options };
    let rdma = !options.providers.is_empty();
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let writing = std::thread::spawn(move || {
        let mut stream = Stream::connect_with(addr, &options).unwrap();
        let err = write_until_error(&mut stream, writer, rdma);
        // Once the goodbye has been seen, what the closing side sent is still there to read.
        stream.set_nonblocking(false).unwrap();
        let last_words = if !rdma {
            None
        } else if uses_messages(writer) {
            let words = stream.recv_msg().unwrap();
            assert_eq!(stream.recv_msg().unwrap(), None, "end of stream after the last message");
            words
        } else {
            let mut words = Vec::new();
            stream.read_to_end(&mut words).unwrap();
            Some(words)
        };
        (err, last_words)
    });
    let (mut stream, _) = listener.accept().unwrap();
    // Read while the writer is in full flow, then close in the middle of it.
    for _ in 0..2000 {
        if uses_messages(writer) {
            stream.recv_msg().unwrap().expect("a message");
        } else {
            let mut buf = [0u8; 1000];
            stream.read_exact(&mut buf).unwrap();
        }
    }
    if uses_messages(writer) {
        stream.send_msg(b"last words").unwrap();
    } else {
        stream.write_all(b"last words").unwrap();
    }
    let (closed_tx, closed) = mpsc::channel();
    std::thread::spawn(move || {
        drop(stream);
        let _ = closed_tx.send(());
    });
    closed
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{writer:?}: the close did not return (it waits for linger, 120 s)"));
    let (err, last_words) = writing.join().unwrap();
    if rdma {
        assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{writer:?}: {err}");
        assert_eq!(last_words.as_deref(), Some(&b"last words"[..]), "{writer:?}");
    } else {
        assert!(
            matches!(err.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset),
            "{writer:?}: {err}"
        );
    }
}

#[test]
fn over_soft() {
    for writer in WRITERS {
        close_while_the_peer_writes(Options::default().with_providers(&[ProviderId::Soft]), writer);
    }
}

#[test]
fn over_shm() {
    for writer in WRITERS {
        close_while_the_peer_writes(Options::default().with_providers(&[ProviderId::Shm]), writer);
    }
}

#[test]
fn over_tcp() {
    for writer in [Writer::Bytes, Writer::TinyMessages, Writer::EventLoop] {
        close_while_the_peer_writes(Options::tcp_only(), writer);
    }
}

/// A nonblocking writer whose writes always find room (a few bytes now and then) after the
/// peer closed: its writes must fail as a TCP writer's do after the peer's close, not be
/// accepted and dropped. (Here the look that learns of the goodbye happened before the write
/// path's own look at the liveness channel existed too; the preload's test of the same,
/// `tests/socket_calls.rs`, is the one that failed without it.)
fn an_occasional_writer_learns_of_the_close(options: Options) {
    let rdma = !options.providers.is_empty();
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let writing = std::thread::spawn(move || {
        let mut stream = Stream::connect_with(addr, &options).unwrap();
        stream.write_all(b"hello").unwrap();
        let mut buf = [0u8; 5];
        stream.read_exact(&mut buf).unwrap();
        // Nonblocking from here, as the preload's streams are: a read that finds the end, and
        // writes that find room, never wait (and so never looked at the liveness channel).
        stream.set_nonblocking(true).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(stream.read(&mut buf).unwrap(), 0, "the peer's end");
        // Writes with room to spare, 5 ms apart, for at most 2 s.
        for _ in 0..400 {
            match stream.write(&[7u8; 100]) {
                Ok(_) => {}
                Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                Err(err) => return Some(err),
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    });
    let (mut stream, _) = listener.accept().unwrap();
    let mut buf = [0u8; 5];
    stream.read_exact(&mut buf).unwrap();
    stream.write_all(&buf).unwrap();
    drop(stream);
    let err = writing.join().unwrap().expect("every write after the peer's close was accepted for 2 s");
    let kinds: &[ErrorKind] =
        if rdma { &[ErrorKind::BrokenPipe] } else { &[ErrorKind::BrokenPipe, ErrorKind::ConnectionReset] };
    assert!(kinds.contains(&err.kind()), "{err}");
}

#[test]
fn an_occasional_writer_learns_of_the_close_over_shm() {
    an_occasional_writer_learns_of_the_close(Options::default().with_providers(&[ProviderId::Shm]));
}

#[test]
fn an_occasional_writer_learns_of_the_close_over_soft() {
    an_occasional_writer_learns_of_the_close(Options::default().with_providers(&[ProviderId::Soft]));
}

#[test]
fn an_occasional_writer_learns_of_the_close_over_tcp() {
    an_occasional_writer_learns_of_the_close(Options::tcp_only());
}
