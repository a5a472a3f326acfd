//! Echo over RDMA (soft provider) and over the TCP fallback: sizes from 1 byte to 64 MiB,
//! compared by checksum; half close; messages.

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;

use common::{checksum, echo, echo_server, listener, pattern};
use lightpath::{FallbackReason, Options, ProviderId, Stream, Transport};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

#[test]
fn echo_sizes_over_soft() {
    let sizes = [1usize, 7, 4096, 65_537, 262_144, 1 << 20, 3 << 20];
    let listener = listener(soft());
    let addr = listener.local_addr().unwrap();
    let server = echo_server(listener, sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        let stream = Stream::connect_with(addr, &soft()).expect("connect");
        assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
        let data = pattern(size, i as u32);
        let back = echo(stream, data.clone());
        assert_eq!(back.len(), size);
        assert_eq!(checksum(&back), checksum(&data), "size {size}");
    }
    let transports = server.join().unwrap();
    assert!(transports.iter().all(|t| *t == Transport::Rdma(ProviderId::Soft)), "{transports:?}");
}

#[test]
fn echo_64_mib_over_soft() {
    let listener = listener(soft());
    let addr = listener.local_addr().unwrap();
    let server = echo_server(listener, 1);
    let stream = Stream::connect_with(addr, &soft()).expect("connect");
    assert!(stream.transport().is_rdma());
    let data = pattern(64 << 20, 99);
    let back = echo(stream, data.clone());
    assert_eq!(checksum(&back), checksum(&data));
    server.join().unwrap();
}

#[test]
fn echo_over_tcp_fallback() {
    let listener = listener(Options::tcp_only());
    let addr = listener.local_addr().unwrap();
    let server = echo_server(listener, 2);
    for size in [1usize, 1 << 20] {
        let stream = Stream::connect_with(addr, &soft()).expect("connect");
        assert_eq!(stream.transport(), Transport::Tcp(FallbackReason::Disabled));
        let data = pattern(size, 5);
        assert_eq!(checksum(&echo(stream, data.clone())), checksum(&data));
    }
    server.join().unwrap();
}

fn half_close(options: Options) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).unwrap();
        // The client shut down writing; this side can still answer.
        stream.write_all(&(got.len() as u64).to_be_bytes()).unwrap();
        stream.write_all(&got[..10]).unwrap();
        stream.shutdown(Shutdown::Write).unwrap();
        stream.transport()
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    let data = pattern(300_000, 3);
    stream.write_all(&data).unwrap();
    stream.shutdown(Shutdown::Write).unwrap();
    assert!(stream.write(b"x").is_err(), "writing after shutdown fails");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    assert_eq!(&answer[..8], &(data.len() as u64).to_be_bytes());
    assert_eq!(&answer[8..], &data[..10]);
    assert_eq!(stream.read(&mut [0u8; 4]).unwrap(), 0, "EOF stays EOF");
    assert_eq!(server.join().unwrap(), stream.transport());
}

#[test]
fn half_close_over_soft() {
    half_close(soft());
}

#[test]
fn half_close_over_tcp() {
    half_close(Options::tcp_only());
}

fn messages(options: Options) {
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let sizes = [0usize, 1, 100, 70_000, 1 << 20, 5];
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        while let Some(message) = stream.recv_msg().unwrap() {
            stream.send_msg(&message).unwrap();
        }
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    for (i, &size) in sizes.iter().enumerate() {
        let message = pattern(size, i as u32);
        stream.send_msg(&message).unwrap();
        assert_eq!(stream.recv_msg().unwrap(), Some(message), "message {i} of {size} bytes");
    }
    stream.shutdown(Shutdown::Write).unwrap();
    assert_eq!(stream.recv_msg().unwrap(), None);
    server.join().unwrap();
}

#[test]
fn messages_over_soft() {
    messages(soft());
}

#[test]
fn messages_over_tcp() {
    messages(Options::tcp_only());
}
