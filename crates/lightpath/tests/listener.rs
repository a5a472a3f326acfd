//! The blocking [`Listener`]: one thread accepts and negotiates every connection in a `poll`
//! loop, so a silent, slow or garbage-speaking client must hold up nobody, many clients at once
//! must all get through, and dropping the listener in the middle of negotiations must return.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod common;

use common::{shm, OddClients};
use lightpath::{Listener, ProviderId, Stream, Transport};

#[test]
fn silent_garbage_and_slow_clients_do_not_hold_up_accepts() {
    let options = shm();
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let started = Instant::now();
    let mut odd = OddClients::connect(addr);
    // Meanwhile Lightpath clients get through at once, one after the other.
    for round in 0..3 {
        let client = std::thread::spawn(move || {
            let mut stream = Stream::connect_with(addr, &shm()).unwrap();
            stream.write_all(&[round; 5]).unwrap();
            stream
        });
        let (mut accepted, _) = listener.accept_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(accepted.transport(), Transport::Rdma(ProviderId::Shm));
        let mut got = [0u8; 5];
        accepted.read_exact(&mut got).unwrap();
        assert_eq!(got, [round; 5]);
        assert_eq!(client.join().unwrap().transport(), Transport::Rdma(ProviderId::Shm));
    }
    assert!(started.elapsed() < options.plain_client_wait, "the accepts waited for the silent clients");
    odd.garbage_was_told();
    // The silent client and the slow one, whose bytes did not complete the magic, are plain
    // TCP peers once the wait is over, each with a working stream.
    let mut plain = Vec::new();
    for _ in 0..2 {
        let (stream, _) = listener.accept_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(stream.transport(), Transport::PlainTcp);
        assert!(started.elapsed() >= options.plain_client_wait, "a plain stream before the wait was over");
        plain.push(stream);
    }
    for stream in &mut plain {
        stream.write_all(b"hi").unwrap();
    }
    odd.plain_ones_read_hi();
    // The slow client's half magic was kept for the application, which reads it first; the
    // silent one has sent nothing.
    let firsts: Vec<Vec<u8>> = plain
        .iter_mut()
        .map(|stream| {
            stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut first = [0u8; 4];
            stream.read_exact(&mut first).map(|()| first.to_vec()).unwrap_or_default()
        })
        .collect();
    assert!(firsts.iter().any(|f| f == b"\x89LPA"), "the slow client's first bytes were lost: {firsts:?}");
    assert!(firsts.iter().any(|f| f.is_empty()), "the silent client sent something? {firsts:?}");
}

#[test]
fn many_clients_at_once_all_get_through() {
    let listener = Listener::bind_with("127.0.0.1:0", shm()).unwrap();
    let addr = listener.local_addr().unwrap();
    const CLIENTS: usize = 48;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            std::thread::spawn(move || {
                let mut stream = Stream::connect_with(addr, &shm()).unwrap();
                stream.write_all(&(i as u32).to_le_bytes()).unwrap();
                let mut back = [0u8; 4];
                stream.read_exact(&mut back).unwrap();
                assert_eq!(u32::from_le_bytes(back), i as u32 * 3);
                stream.transport()
            })
        })
        .collect();
    let mut servers = Vec::new();
    for _ in 0..CLIENTS {
        let (mut stream, _) = listener.accept_timeout(Duration::from_secs(20)).unwrap();
        servers.push(std::thread::spawn(move || {
            let mut got = [0u8; 4];
            stream.read_exact(&mut got).unwrap();
            stream.write_all(&(u32::from_le_bytes(got) * 3).to_le_bytes()).unwrap();
            let mut end = [0u8; 1];
            assert_eq!(stream.read(&mut end).unwrap(), 0, "the client sent more than its number");
        }));
    }
    for client in clients {
        assert_eq!(client.join().unwrap(), Transport::Rdma(ProviderId::Shm));
    }
    for server in servers {
        server.join().unwrap();
    }
}

#[test]
fn dropping_the_listener_during_negotiations_returns() {
    let listener = Listener::bind_with("127.0.0.1:0", shm()).unwrap();
    let addr = listener.local_addr().unwrap();
    // Clients stuck in the middle of their hello keep negotiations open.
    let stalled: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut conn = TcpStream::connect(addr).unwrap();
            conn.write_all(b"\x89LPATH").unwrap();
            conn
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    drop(listener);
    assert!(started.elapsed() < Duration::from_secs(1), "drop took {:?}", started.elapsed());
    // Their connections were closed with it.
    for mut conn in stalled {
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        match conn.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty(), "a stalled client was sent {rest:?}"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "not closed: {e}"),
        }
    }
}
