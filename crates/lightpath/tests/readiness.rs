//! The readiness API an event loop uses: one fd per stream (`readiness_fd`) waited on with
//! poll(2) or epoll, then `poll_ready`; over RDMA (soft and shm) and over TCP; and the two
//! `event_fds` edge-triggered with `poll_ready_after` reading only what signalled. A raw epoll
//! echo server drives several streams at once through their single fds, and writers blocked
//! on a full ring (or on receive credits) learn through the fd when room returns.

mod common;

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::BorrowedFd;
use std::sync::mpsc;

use common::{checksum, listener, pattern, shm, soft};
use lightpath::{Options, ProviderId, Stream};
use rustix::event::{epoll, poll, PollFd, PollFlags, Timespec};

/// How long a loop may go without any event before the test calls it a hang (a guard, not a
/// measurement: every wait here normally ends within milliseconds).
const HANG_GUARD: Timespec = Timespec { tv_sec: 20, tv_nsec: 0 };

/// Sleeps in poll(2) on `fds` for readability, at most the hang guard; panics if nothing came.
fn sleep_on(fds: &[BorrowedFd<'_>], what: &str) {
    let mut pollfds: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::new(fd, PollFlags::IN)).collect();
    let n = poll(&mut pollfds, Some(&HANG_GUARD)).unwrap();
    assert!(n > 0, "no event while waiting for {what}");
}

/// Waits until `poll_ready` reports the stream readable, sleeping on its readiness fd (or, with
/// `legacy`, on all of `event_fds`) in between; returns how many sleeps it took.
fn wait_readable(stream: &mut Stream, legacy: bool) -> usize {
    let mut sleeps = 0;
    loop {
        if stream.poll_ready().unwrap().readable {
            return sleeps;
        }
        if legacy {
            let fds = stream.event_fds();
            // SAFETY: the fds belong to `stream`, which outlives this wait.
            let borrowed: Vec<BorrowedFd<'_>> =
                fds.iter().map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) }).collect();
            sleep_on(&borrowed, "readability");
        } else {
            sleep_on(&[stream.readiness_fd().unwrap()], "readability");
        }
        sleeps += 1;
    }
}

fn ping_pong(options: Options, legacy: bool) {
    ping_pong_with(options.clone(), options, legacy);
}

/// [`ping_pong`] with the client's options apart.
fn ping_pong_with(options: Options, client_options: Options, legacy: bool) {
    let listener = listener(options);
    let addr = listener.local_addr().unwrap();
    let (answer_tx, answer_rx) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4];
        stream.read_exact(&mut buf).unwrap();
        // Answer only once the client has looked and found nothing to read.
        answer_rx.recv().unwrap();
        stream.write_all(b"pong").unwrap();
        stream.read_exact(&mut buf).unwrap();
    });
    let mut stream = Stream::connect_with(addr, &client_options).unwrap();
    stream.set_nonblocking(true).unwrap();
    let first = stream.poll_ready().unwrap();
    assert!(!first.readable, "nothing has been sent yet");
    assert!(first.writable);
    stream.write_all(b"ping").unwrap();
    assert!(!stream.poll_ready().unwrap().readable, "the server has not answered");
    answer_tx.send(()).unwrap();
    wait_readable(&mut stream, legacy);
    let mut buf = [0u8; 4];
    stream.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");
    assert!(!stream.poll_ready().unwrap().readable);
    stream.write_all(b"done").unwrap();
    server.join().unwrap();
    // The server closed: end of stream is readable too.
    wait_readable(&mut stream, legacy);
    assert_eq!(stream.read(&mut buf).unwrap(), 0);
}

#[test]
fn single_fd_ping_pong_over_soft() {
    ping_pong(soft(), false);
}

#[test]
fn single_fd_ping_pong_over_shm() {
    ping_pong(shm(), false);
}

/// A blocking stream connected with `Options::event_loop` (its queue pair's news rings the
/// device's task doorbell; no event loop dispatches it here, and the server's thread, whose
/// connection has a doorbell of its own, does not watch it): the readiness fd watches the task
/// doorbell and `poll_ready` dispatches it.
#[test]
fn single_fd_ping_pong_over_shm_with_event_loop_options() {
    ping_pong_with(shm(), Options { event_loop: true, ..shm() }, false);
}

#[test]
fn single_fd_ping_pong_over_tcp() {
    ping_pong(Options::tcp_only(), false);
}

#[test]
fn legacy_event_fds_still_work() {
    ping_pong(soft(), true);
}

/// Waits until `poll_ready_after` reports the stream readable, sleeping in `poller`, which holds
/// the stream's `event_fds` edge-triggered (token 1: the liveness connection, the last of them;
/// 0: the others, the notification fd and a soft queue pair's own port): the notification fd
/// is never read, the liveness connection only after it signalled (what the preload library
/// does).
fn wait_readable_on_edges(stream: &mut Stream, poller: &std::os::fd::OwnedFd, liveness: &mut bool) {
    let mut events = Vec::with_capacity(4);
    loop {
        if stream.poll_ready_after(false, std::mem::take(liveness)).unwrap().readable {
            return;
        }
        events.clear();
        epoll::wait(poller, rustix::buffer::spare_capacity(&mut events), Some(&HANG_GUARD)).unwrap();
        assert!(!events.is_empty(), "no event while waiting for readability");
        *liveness |= events.iter().any(|event| event.data.u64() == 1);
    }
}

/// Ping-pong through `poll_ready_after` with the two event fds edge-triggered and read only as
/// `wait_readable_on_edges` does: each answer and the peer's close must be seen (a missed
/// wake-up hangs the wait until the guard fails the test).
fn ping_pong_on_edges(options: Options) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let (answer_tx, answer_rx) = mpsc::channel::<()>();
    let (close_tx, close_rx) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4];
        for _ in 0..3 {
            stream.read_exact(&mut buf).unwrap();
            answer_rx.recv().unwrap();
            stream.write_all(b"pong").unwrap();
        }
        close_rx.recv().unwrap();
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    stream.set_nonblocking(true).unwrap();
    let fds = stream.event_fds();
    assert_eq!(
        fds.len(),
        expected_event_fds(&options),
        "an RDMA stream has a notification fd, a soft one its own port too, and a liveness connection"
    );
    let poller = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    for (i, &fd) in fds.iter().enumerate() {
        // SAFETY: the fds belong to `stream`, which outlives `poller`'s use here.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let flags = epoll::EventFlags::IN | epoll::EventFlags::ET;
        let token = u64::from(i == fds.len() - 1);
        epoll::add(&poller, fd, epoll::EventData::new_u64(token), flags).unwrap();
    }
    let mut liveness = false;
    for round in 0..3 {
        stream.write_all(b"ping").unwrap();
        assert!(!stream.poll_ready_after(false, false).unwrap().readable, "round {round}: no answer yet");
        answer_tx.send(()).unwrap();
        // The answer may be there before the first look (no sleep), or come after one.
        wait_readable_on_edges(&mut stream, &poller, &mut liveness);
        let mut buf = [0u8; 4];
        stream.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"pong");
    }
    assert!(!stream.poll_ready_after(false, false).unwrap().readable);
    close_tx.send(()).unwrap();
    server.join().unwrap();
    // The server's stream is gone: its end arrives (the goodbye on the liveness connection, or
    // a close record), readable through an edge.
    wait_readable_on_edges(&mut stream, &poller, &mut liveness);
    let mut buf = [0u8; 4];
    assert_eq!(stream.read(&mut buf).unwrap(), 0);
}

/// How many `event_fds` an RDMA stream made with `options` has: the notification fd and the
/// liveness connection, and between them a soft queue pair's own UDP port (by default).
fn expected_event_fds(options: &Options) -> usize {
    let soft_port = options.providers == [ProviderId::Soft] && options.soft_qp_port != Some(false);
    2 + usize::from(soft_port)
}

#[test]
fn poll_ready_after_on_edge_triggered_event_fds_over_shm() {
    ping_pong_on_edges(shm());
}

#[test]
fn poll_ready_after_on_edge_triggered_event_fds_over_soft() {
    ping_pong_on_edges(soft());
}

#[test]
fn the_fd_is_stable_and_a_tcp_stream_s_fd_is_its_socket() {
    for (options, rdma) in [(soft(), true), (Options::tcp_only(), false)] {
        let listener = listener(options.clone());
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || listener.accept().map(|_| ()).unwrap());
        let stream = Stream::connect_with(addr, &options).unwrap();
        server.join().unwrap();
        assert_eq!(stream.transport().is_rdma(), rdma);
        let first = std::os::fd::AsRawFd::as_raw_fd(&stream.readiness_fd().unwrap());
        let again = std::os::fd::AsRawFd::as_raw_fd(&stream.readiness_fd().unwrap());
        assert_eq!(first, again, "one fd per stream, made once");
        let fds = stream.event_fds();
        if rdma {
            assert_eq!(fds.len(), expected_event_fds(&options));
            assert!(!fds.contains(&first), "an RDMA stream's fd is its own epoll instance");
        } else {
            assert_eq!(fds, vec![first], "a TCP stream's fd is the socket");
        }
    }
}

/// One connection of the epoll echo server.
struct Served {
    stream: Stream,
    /// Bytes read but not yet echoed.
    out: Vec<u8>,
    read_eof: bool,
    interest: epoll::EventFlags,
}

/// What the epoll echo server saw.
#[derive(Debug, Default)]
struct ServerStats {
    /// Returns from epoll_wait.
    wakeups: usize,
    /// Times the loop went to sleep with bytes to echo that `poll_ready` said would not fit.
    waits_for_room: usize,
    /// Bytes echoed on a stream after such a wait, i.e. once its fd had said room returned.
    echoed_after_wait: usize,
}

/// An echo server for `count` connections, on one thread, driven only by each stream's
/// readiness fd in one epoll instance. Echoes every byte, half-closes after the client's end of
/// stream, and returns when every connection is done.
fn epoll_echo_server(listener: lightpath::Listener, count: usize) -> ServerStats {
    let poller = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    let mut served: HashMap<u64, Served> = HashMap::new();
    for key in 0..count as u64 {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_nonblocking(true).unwrap();
        let interest = epoll::EventFlags::IN;
        epoll::add(&poller, stream.readiness_fd().unwrap(), epoll::EventData::new_u64(key), interest)
            .unwrap();
        served.insert(key, Served { stream, out: Vec::new(), read_eof: false, interest });
    }
    let mut stats = ServerStats::default();
    let mut waited = vec![false; count];
    // Step 1 of the contract: poll_ready before the first wait (every stream counts as woken).
    let mut woken: Vec<u64> = served.keys().copied().collect();
    let mut events = Vec::with_capacity(count);
    while !served.is_empty() {
        for key in woken.drain(..) {
            let Some(conn) = served.get_mut(&key) else { continue };
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let ready = conn.stream.poll_ready().unwrap();
                let mut acted = false;
                if ready.readable && !conn.read_eof {
                    acted = match conn.stream.read(&mut buf) {
                        Ok(0) => {
                            conn.read_eof = true;
                            true
                        }
                        Ok(n) => {
                            conn.out.extend_from_slice(&buf[..n]);
                            true
                        }
                        Err(err) if err.kind() == ErrorKind::WouldBlock => false,
                        Err(err) => panic!("server read: {err}"),
                    };
                }
                if ready.writable && !conn.out.is_empty() {
                    match conn.stream.write(&conn.out) {
                        Ok(n) => {
                            if waited[key as usize] {
                                stats.echoed_after_wait += n;
                            }
                            conn.out.drain(..n);
                            acted = true;
                        }
                        Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                        Err(err) => panic!("server write: {err}"),
                    }
                }
                if !acted {
                    // poll_ready reported nothing this loop wants: sleep on the fd.
                    if !ready.writable && !conn.out.is_empty() {
                        stats.waits_for_room += 1;
                        waited[key as usize] = true;
                    }
                    break;
                }
            }
            if conn.read_eof && conn.out.is_empty() {
                epoll::delete(&poller, conn.stream.readiness_fd().unwrap()).unwrap();
                conn.stream.shutdown(std::net::Shutdown::Write).unwrap();
                // The close must not stall the loop: finish it in the background.
                served.remove(&key).unwrap().stream.close_in_background();
                continue;
            }
            // Ask for EPOLLOUT only while there is something to write: a TCP socket reports
            // it (level-triggered, so always asking would spin); an RDMA fd never does.
            let interest = if conn.out.is_empty() {
                epoll::EventFlags::IN
            } else {
                epoll::EventFlags::IN | epoll::EventFlags::OUT
            };
            if interest != conn.interest {
                let fd = conn.stream.readiness_fd().unwrap();
                epoll::modify(&poller, fd, epoll::EventData::new_u64(key), interest).unwrap();
                conn.interest = interest;
            }
        }
        if served.is_empty() {
            break;
        }
        events.clear();
        epoll::wait(&poller, rustix::buffer::spare_capacity(&mut events), Some(&HANG_GUARD)).unwrap();
        assert!(!events.is_empty(), "the epoll loop got no event for {HANG_GUARD:?}: {stats:?}");
        stats.wakeups += 1;
        woken.extend(events.iter().map(|event| event.data.u64()));
    }
    stats
}

/// Several clients each write `len` bytes (more than a ring) before reading anything, so the
/// server's echo fills their rings and must wait for them to read: the epoll loop serves them
/// all through their readiness fds alone.
fn epoll_loop_serves_several_streams(options: Options, rdma: bool) {
    const CLIENTS: usize = 4;
    // Twice the ring on every provider: shm rings are twice `ring_size` (no staging mirror).
    let len = (options.ring_size as usize) * 4 + 12_345;
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || epoll_echo_server(listener, CLIENTS));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let options = options.clone();
            std::thread::spawn(move || {
                let mut stream = Stream::connect_with(addr, &options).unwrap();
                assert_eq!(stream.transport().is_rdma(), rdma, "{}", stream.transport());
                let data = pattern(len, i as u32);
                // Everything first, reading only after: the echo fills this side's ring and
                // the server must wait for room (it buffers what it cannot echo yet).
                stream.write_all(&data).unwrap();
                stream.shutdown(std::net::Shutdown::Write).unwrap();
                let mut back = Vec::with_capacity(len);
                stream.read_to_end(&mut back).unwrap();
                assert_eq!(back.len(), len, "client {i}");
                assert_eq!(checksum(&back), checksum(&data), "client {i}");
            })
        })
        .collect();
    for client in clients {
        client.join().unwrap();
    }
    let stats = server.join().unwrap();
    assert!(stats.wakeups > 0, "the loop slept on the fds: {stats:?}");
    if rdma {
        // (Loopback TCP buffers megabytes, so only the rings are sure to fill.)
        assert!(stats.waits_for_room > 0, "the echo outran the clients' reads: {stats:?}");
        assert!(stats.echoed_after_wait > 0, "writes resumed after the fd woke the loop: {stats:?}");
    }
}

#[test]
fn epoll_loop_serves_several_streams_over_soft() {
    epoll_loop_serves_several_streams(soft().with_ring_size(64 << 10), true);
}

#[test]
fn epoll_loop_serves_several_streams_over_shm() {
    epoll_loop_serves_several_streams(shm().with_ring_size(64 << 10), true);
}

#[test]
fn epoll_loop_serves_several_streams_over_tcp() {
    epoll_loop_serves_several_streams(Options::tcp_only(), false);
}

/// How a writer fills the peer's ring.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Large writes until the ring's bytes are used up.
    RingBytes,
    /// Small messages until the receive credits are used up (`send_msg`, which does not itself
    /// tell the peer it is blocked: `poll_ready` must).
    RecvCredits,
}

/// The writer fills the peer's ring until it says `WouldBlock`, sees `poll_ready` say "not
/// writable", then sleeps on its single fd until the peer has read and the fd says writable.
fn writability_through_the_fd(options: Options, fill: Fill) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        go_rx.recv().unwrap();
        let mut got = Vec::new();
        match fill {
            Fill::RingBytes => {
                stream.read_to_end(&mut got).unwrap();
            }
            Fill::RecvCredits => {
                while let Some(msg) = stream.recv_msg().unwrap() {
                    got.extend_from_slice(&msg);
                }
            }
        }
        got
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    assert!(stream.transport().is_rdma());
    stream.set_nonblocking(true).unwrap();
    let mut sent = Vec::new();
    let mut salt = 0;
    let mut attempt = |stream: &mut Stream, sent: &mut Vec<u8>| -> bool {
        salt += 1;
        let result = match fill {
            Fill::RingBytes => {
                let chunk = pattern(48 << 10, salt);
                stream.write(&chunk).map(|n| sent.extend_from_slice(&chunk[..n]))
            }
            Fill::RecvCredits => {
                let msg = pattern(100, salt);
                stream.send_msg(&msg).map(|()| sent.extend_from_slice(&msg))
            }
        };
        match result {
            Ok(()) => true,
            Err(err) if err.kind() == ErrorKind::WouldBlock => false,
            Err(err) => panic!("write: {err}"),
        }
    };
    while attempt(&mut stream, &mut sent) {}
    let filled = sent.len();
    assert!(!stream.poll_ready().unwrap().writable, "the peer has read nothing: no room");
    go_tx.send(()).unwrap();
    // The contract: once poll_ready has said "not writable", the fd becomes readable when room
    // returns (here: once the reader has read), so sleeping on it at once is safe.
    let mut sleeps = 0;
    loop {
        sleep_on(&[stream.readiness_fd().unwrap()], "writability");
        sleeps += 1;
        if stream.poll_ready().unwrap().writable {
            break;
        }
        assert!(sleeps < 100_000, "the fd keeps waking without room: a busy loop");
    }
    assert!(attempt(&mut stream, &mut sent), "writable means a write goes through");
    assert!(sent.len() > filled);
    // Blocking from here on: the rest of the contract is plain delivery.
    stream.set_nonblocking(false).unwrap();
    drop(stream);
    let got = reader.join().unwrap();
    assert_eq!(got.len(), sent.len(), "{fill:?}");
    assert_eq!(checksum(&got), checksum(&sent));
}

#[test]
fn writable_again_through_the_fd_after_a_full_ring_over_soft() {
    writability_through_the_fd(soft(), Fill::RingBytes);
}

#[test]
fn writable_again_through_the_fd_after_a_full_ring_over_shm() {
    writability_through_the_fd(shm(), Fill::RingBytes);
}

#[test]
fn writable_again_through_the_fd_after_spent_credits_over_soft() {
    writability_through_the_fd(soft(), Fill::RecvCredits);
}

#[test]
fn writable_again_through_the_fd_after_spent_credits_over_shm() {
    writability_through_the_fd(shm(), Fill::RecvCredits);
}

#[test]
fn close_in_background_delivers_everything() {
    for options in [soft(), shm(), Options::tcp_only()] {
        let listener = listener(options.clone());
        let addr = listener.local_addr().unwrap();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let reader = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            go_rx.recv().unwrap();
            let mut got = Vec::new();
            stream.read_to_end(&mut got).unwrap();
            got
        });
        let mut stream = Stream::connect_with(addr, &options).unwrap();
        let data = pattern(100_000, 77);
        stream.write_all(&data).unwrap();
        // The reader has not read a byte when the stream is let go.
        stream.close_in_background();
        go_tx.send(()).unwrap();
        let got = reader.join().unwrap();
        assert_eq!(got.len(), data.len(), "{:?}", options.providers);
        assert_eq!(checksum(&got), checksum(&data));
    }
}
