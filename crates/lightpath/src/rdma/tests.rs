//! The driver's contract with nonblocking callers, on real soft connections over loopback.

use std::io::Write;
use std::time::{Duration, Instant};

use lightpath_stream::negotiate::ProviderId;

use crate::stream::Backend;
use crate::{Listener, Options, Stream, Transport};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

/// A nonblocking call that found nothing looks at the TCP connection; a peer's goodbye found
/// there makes it collect the completions the peer's last records left. Those raise no event
/// any more, so the look must say "look again" (`Ok`), not `WouldBlock`: an event loop would
/// otherwise sleep with what it waits for already handled. (A tokio `close` slept for good so
/// when its flush's last acknowledgement was collected this way.)
#[test]
fn a_nonblocking_look_that_collected_completions_says_look_again() {
    let listener = Listener::bind_with("127.0.0.1:0", soft()).expect("bind");
    let addr = listener.local_addr().expect("address");
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
        stream.write_all(b"last words").expect("server write");
        // A blocking drop: the close record, its acknowledgement, then the goodbye.
    });
    let mut client = Stream::connect_with(addr, &soft()).expect("connect");
    assert_eq!(client.transport(), Transport::Rdma(ProviderId::Soft));
    client.set_nonblocking(true).expect("nonblocking");
    server.join().expect("server");
    let Backend::Rdma(conn) = client.backend_mut() else { panic!("not an RDMA stream") };
    // The server's drop returned: its records were acknowledged by this side's queue pair, so
    // their completions are in this side's queue, and its goodbye is on the way. Until it is
    // read, a look has nothing to say; once it is, the look collects the completions.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // Past the driver's recheck interval, so that the look reads the TCP connection.
        std::thread::sleep(super::TCP_RECHECK + Duration::from_millis(5));
        let handled = conn.events();
        match conn.look_without_waiting() {
            Ok(()) => break,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                assert_eq!(
                    conn.events(),
                    handled,
                    "the look collected completions (the peer's goodbye was there: {}), yet said \
                     WouldBlock",
                    conn.peer_closed_its_side()
                );
                assert!(Instant::now() < deadline, "the peer's goodbye never came");
            }
            Err(err) => panic!("the look failed: {err}"),
        }
    }
    assert!(conn.peer_closed_its_side(), "the look said look again before the goodbye came");
}

/// A peer that closed its sending side and then died (its TCP connection ends without a
/// goodbye) sent its close record first; on a queue pair with a UDP port of its own that
/// record may still wait unread in the port when an event loop sees the TCP connection end.
/// The reader must take the port in before it judges the peer vanished: the stream ended
/// cleanly (`Ok(0)`, as over TCP), it was not reset. (A tokio server that read to the end and
/// then shut down got "the peer vanished" from `tokio_close`'s exited-peer test, rarely.)
#[test]
fn a_peer_that_half_closed_then_died_ends_the_stream_cleanly() {
    use std::io::Read;
    // The server's queue pair gets a port of its own (as by default).
    let options = Options { soft_qp_port: Some(true), ..soft() };
    let listener = Listener::bind_with("127.0.0.1:0", options).expect("bind");
    let addr = listener.local_addr().expect("address");
    let client = std::thread::spawn(move || Stream::connect_with(addr, &soft()).expect("connect"));
    let (mut server, _) = listener.accept().expect("accept");
    assert_eq!(server.transport(), Transport::Rdma(ProviderId::Soft));
    server.set_nonblocking(true).expect("nonblocking");
    let mut client = client.join().expect("client");
    assert_eq!(client.transport(), Transport::Rdma(ProviderId::Soft));
    // Armed as an event loop arms it: from now on only the server's own armings take in what
    // reaches its port at once (the device's progress thread drains armed ports only when
    // they stay unread for a tick).
    let Backend::Rdma(conn) = server.backend_mut() else { panic!("not an RDMA stream") };
    conn.arm(lightpath_verbs::WakeFor::Arrivals, crate::completions::PortLook::TakeIn).expect("arm");
    // The close record goes out; then the client's process "dies": its TCP connection ends
    // without a goodbye.
    client.shutdown(std::net::Shutdown::Write).expect("half close");
    let Backend::Rdma(client_conn) = client.backend_mut() else { panic!("not an RDMA stream") };
    client_conn.tcp().shutdown(std::net::Shutdown::Both).expect("end the client's TCP connection");
    // The event loop is woken by the TCP connection's end (the liveness readiness), looks at
    // it, and reads.
    let Backend::Rdma(conn) = server.backend_mut() else { panic!("not an RDMA stream") };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !conn.tcp_ended() {
        assert!(Instant::now() < deadline, "the client's TCP connection never ended");
        std::thread::yield_now();
        conn.poll_tcp();
    }
    let mut buf = [0u8; 16];
    loop {
        match server.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => panic!("the client sent nothing, yet {n} bytes were read"),
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "the end of the stream never came");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(err) => panic!("a clean half close read as {err}"),
        }
    }
    drop(client);
}
