//! One-sided remote buffers: the server exposes a buffer, the client writes into it with a
//! notification and reads it back, all verified byte for byte; bad ranges are refused locally;
//! TCP streams refuse remote buffers clearly.

mod common;

use std::io::{ErrorKind, Read, Write};

use common::{listener, pattern};
use lightpath::{Options, ProviderId, RemoteBuf, Stream, Transport};

#[test]
fn write_with_notify_then_read_back_over_soft() {
    write_with_notify_then_read_back(ProviderId::Soft);
}

#[test]
fn write_with_notify_then_read_back_over_shm() {
    write_with_notify_then_read_back(ProviderId::Shm);
}

fn write_with_notify_then_read_back(provider: ProviderId) {
    let options = Options::default().with_providers(&[provider]);
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let exposed = stream.register_buf(1 << 20).unwrap();
        exposed.write(0, b"server was here").unwrap();
        stream.send_msg(&exposed.remote().to_bytes()).unwrap();
        // The client writes 700 KiB at offset 4096 and notifies with 77.
        assert_eq!(stream.recv_notify().unwrap(), 77);
        let expected = pattern(700 << 10, 1);
        let matches = exposed.with_bytes(|bytes| bytes[4096..4096 + expected.len()] == expected[..]);
        assert!(matches, "the written bytes are in place when the notification arrives");
        // Let the client read it back, then close.
        assert_eq!(stream.recv_msg().unwrap().as_deref(), Some(&b"done"[..]));
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    assert_eq!(stream.transport(), Transport::Rdma(provider));
    let remote = RemoteBuf::from_bytes(&stream.recv_msg().unwrap().unwrap()).unwrap();
    assert_eq!(remote.len, 1 << 20);
    let local = stream.register_buf(1 << 20).unwrap();
    let data = pattern(700 << 10, 1);
    local.write(0, &data).unwrap();
    stream.write_remote(&local, 0, &remote, 4096, data.len() as u32, Some(77)).unwrap();
    let back = stream.register_buf(1 << 20).unwrap();
    stream.read_remote(&back, 0, &remote, 0, 15).unwrap();
    stream.read_remote(&back, 100, &remote, 4096, data.len() as u32).unwrap();
    let mut head = [0u8; 15];
    back.read(0, &mut head).unwrap();
    assert_eq!(&head, b"server was here");
    assert!(back.with_bytes(|bytes| bytes[100..100 + data.len()] == data[..]));
    let err = stream.write_remote(&local, 0, &remote, (1 << 20) - 10, 11, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let err = stream.read_remote(&back, (1 << 20) - 1, &remote, 0, 2).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    stream.send_msg(b"done").unwrap();
    server.join().unwrap();
}

#[test]
fn zero_copy_writes_keep_stream_order_over_soft() {
    zero_copy_writes_keep_stream_order(ProviderId::Soft);
}

#[test]
fn zero_copy_writes_keep_stream_order_over_shm() {
    zero_copy_writes_keep_stream_order(ProviderId::Shm);
}

fn zero_copy_writes_keep_stream_order(provider: ProviderId) {
    let options = Options::default().with_providers(&[provider]);
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let total = 4 + 1_500_000 + 4 + 300_000 + 4;
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut got = vec![0u8; total];
        stream.read_exact(&mut got).unwrap();
        assert_eq!(stream.read(&mut [0u8; 1]).unwrap(), 0);
        got
    });
    let mut stream = Stream::connect_with(addr, &options).unwrap();
    assert_eq!(stream.transport(), Transport::Rdma(provider));
    let big = pattern(1_500_000, 5);
    let small = pattern(300_000, 6);
    let buf = stream.register_buf(2_000_000).unwrap();
    buf.write(100, &big).unwrap();
    stream.write_all(b"head").unwrap();
    stream.write_buf(&buf, 100, big.len()).unwrap();
    stream.write_all(b"mid!").unwrap();
    // The buffer may be reused as soon as write_buf returns.
    buf.write(7, &small).unwrap();
    stream.write_buf(&buf, 7, small.len()).unwrap();
    stream.write_all(b"tail").unwrap();
    assert_eq!(stream.write_buf(&buf, 1_999_999, 2).unwrap_err().kind(), ErrorKind::InvalidInput);
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let got = server.join().unwrap();
    let mut expected = b"head".to_vec();
    expected.extend_from_slice(&big);
    expected.extend_from_slice(b"mid!");
    expected.extend_from_slice(&small);
    expected.extend_from_slice(b"tail");
    assert!(got == expected, "the stream differs");
}

#[test]
fn tcp_streams_refuse_remote_buffers() {
    let listener = listener(Options::tcp_only());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || listener.accept().map(drop));
    let mut stream = Stream::connect_with(addr, &Options::tcp_only()).unwrap();
    assert_eq!(stream.register_buf(64).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(stream.recv_notify().unwrap_err().kind(), ErrorKind::Unsupported);
    server.join().unwrap().unwrap();
}

#[test]
fn buffers_of_another_stream_are_refused() {
    let options = Options::default().with_providers(&[ProviderId::Soft]);
    let listener = listener(options.clone());
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut streams = Vec::new();
        for _ in 0..2 {
            let (mut stream, _) = listener.accept().unwrap();
            let exposed = stream.register_buf(4096).unwrap();
            stream.send_msg(&exposed.remote().to_bytes()).unwrap();
            streams.push((stream, exposed));
        }
        for (stream, _) in &mut streams {
            assert_eq!(stream.recv_msg().unwrap(), None);
        }
    });
    let mut first = Stream::connect_with(addr, &options).unwrap();
    let mut second = Stream::connect_with(addr, &options).unwrap();
    let remote = RemoteBuf::from_bytes(&first.recv_msg().unwrap().unwrap()).unwrap();
    let _ = second.recv_msg().unwrap().unwrap();
    let foreign = second.register_buf(4096).unwrap();
    let err = first.write_remote(&foreign, 0, &remote, 0, 8, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(first.write_buf(&foreign, 0, 8).unwrap_err().kind(), ErrorKind::InvalidInput);
    // The refused calls broke nothing: the stream still works.
    let own = first.register_buf(4096).unwrap();
    own.write(0, b"12345678").unwrap();
    first.write_remote(&own, 0, &remote, 0, 8, None).unwrap();
    drop((first, second));
    server.join().unwrap();
}
