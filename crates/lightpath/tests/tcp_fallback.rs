//! The TCP fallback's framing under back-pressure: in nonblocking mode a full socket must never
//! tear a record — messages accepted by `send_msg` arrive whole and once, bytes accepted by
//! `write` arrive exactly, whatever the socket took at each call.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::time::Duration;

use common::{listener, pattern};
use lightpath::{Options, Stream, Transport};

fn tcp_pair() -> (Stream, Stream) {
    let listener = listener(Options::tcp_only());
    let addr = listener.local_addr().unwrap();
    let accepted = std::thread::spawn(move || listener.accept().unwrap().0);
    let client = Stream::connect_with(addr, &Options::tcp_only()).unwrap();
    let server = accepted.join().unwrap();
    assert!(matches!(client.transport(), Transport::Tcp(_)), "{}", client.transport());
    (client, server)
}

#[test]
fn nonblocking_messages_survive_a_full_socket() {
    let (mut writer, mut reader) = tcp_pair();
    writer.set_nonblocking(true).unwrap();
    // Offer 8 MiB messages until the socket pushes back, with nobody reading.
    let mut accepted = Vec::new();
    let mut refusals = 0;
    for i in 0..6u32 {
        let msg = pattern((8 << 20) + i as usize, i);
        loop {
            match writer.send_msg(&msg) {
                Ok(()) => {
                    accepted.push(msg);
                    break;
                }
                Err(err) if err.kind() == ErrorKind::WouldBlock => {
                    refusals += 1;
                    if refusals > 3 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(err) => panic!("send_msg: {err}"),
            }
        }
        if refusals > 3 {
            break;
        }
    }
    assert!(refusals > 0, "the socket never filled: the test proves nothing");
    let expected = accepted.len();
    let reading = std::thread::spawn(move || {
        let mut got = Vec::new();
        while let Some(msg) = reader.recv_msg().unwrap() {
            got.push(msg);
        }
        got
    });
    // What was accepted but not yet sent goes out with the next calls and the close.
    writer.set_nonblocking(false).unwrap();
    writer.flush().unwrap();
    drop(writer);
    let got = reading.join().unwrap();
    assert_eq!(got.len(), expected);
    for (i, (got, sent)) in got.iter().zip(&accepted).enumerate() {
        assert!(got == sent, "message {i} differs ({} vs {} bytes)", got.len(), sent.len());
    }
}

#[test]
fn nonblocking_writes_deliver_exactly_what_they_accepted() {
    let (mut writer, mut reader) = tcp_pair();
    writer.set_nonblocking(true).unwrap();
    let source = pattern(24 << 20, 9);
    let mut offset = 0;
    let mut would_block = 0;
    let mut sizes = [1usize, 3, 100, 65_536, 1 << 20, 5 << 20].iter().cycle();
    while offset < source.len() && would_block < 50 {
        let end = (offset + sizes.next().unwrap()).min(source.len());
        match writer.write(&source[offset..end]) {
            Ok(n) => offset += n,
            Err(err) if err.kind() == ErrorKind::WouldBlock => would_block += 1,
            Err(err) => panic!("write: {err}"),
        }
    }
    assert!(would_block > 0, "the socket never filled: the test proves nothing");
    let written = offset;
    let reading = std::thread::spawn(move || {
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        got
    });
    writer.set_nonblocking(false).unwrap();
    writer.write_all(&source[written..]).unwrap();
    writer.shutdown(std::net::Shutdown::Write).unwrap();
    let got = reading.join().unwrap();
    assert_eq!(got.len(), source.len());
    assert!(got == source, "the stream differs from what was written");
}

#[test]
fn a_full_socket_at_a_record_boundary_starts_no_record() {
    // One-byte writes: every call starts a record, so the socket fills exactly at a boundary.
    let (mut writer, mut reader) = tcp_pair();
    writer.set_nonblocking(true).unwrap();
    let mut written = Vec::new();
    let mut would_block = 0;
    let mut next = 0u8;
    while would_block < 20 {
        match writer.write(&[next]) {
            Ok(1) => {
                written.push(next);
                next = next.wrapping_add(7);
            }
            Ok(n) => panic!("a one-byte write accepted {n} bytes"),
            Err(err) if err.kind() == ErrorKind::WouldBlock => would_block += 1,
            Err(err) => panic!("write: {err}"),
        }
    }
    let reading = std::thread::spawn(move || {
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        got
    });
    writer.set_nonblocking(false).unwrap();
    writer.write_all(b"end").unwrap();
    written.extend_from_slice(b"end");
    writer.shutdown(std::net::Shutdown::Write).unwrap();
    let got = reading.join().unwrap();
    assert_eq!(got.len(), written.len());
    assert!(got == written, "the stream differs from what was written");
}

#[test]
fn spinning_reads_still_sleep_and_time_out() {
    let options = Options { spin: Duration::from_millis(20), ..Options::tcp_only() };
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut word = [0u8; 4];
        // The first word comes after the client's spin has run out: the read sleeps for it.
        stream.read_exact(&mut word).unwrap();
        stream.write_all(&word).unwrap();
        stream.read_exact(&mut word).unwrap();
        stream.write_all(&word).unwrap();
    });
    let mut client = Stream::connect_with(addr, &options).unwrap();
    client.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let mut word = [0u8; 4];
    let err = client.read(&mut word).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{err}");
    client.set_read_timeout(None).unwrap();
    for value in [7u32, 9] {
        client.write_all(&value.to_be_bytes()).unwrap();
        client.read_exact(&mut word).unwrap();
        assert_eq!(u32::from_be_bytes(word), value);
    }
    server.join().unwrap();
}
