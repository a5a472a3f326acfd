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
