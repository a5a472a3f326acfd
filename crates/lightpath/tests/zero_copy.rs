//! Zero-copy transfers on both sides: `write_buf` / `send_msg_buf` from registered buffers,
//! `read_buf` / `recv_msg_buf` into them, with large writes going by rendezvous (the reader
//! fetches them by RDMA READ). Over soft and shm: sizes around the rendezvous threshold up to
//! 64 MiB, read both ways; stream order with ordinary writes in between; partial reads;
//! buffer reuse; nonblocking readers; nonblocking zero-copy calls repeated until done;
//! write timeouts; peers killed mid-rendezvous (child processes); peers whose descriptors lie.
//! Every byte is checked.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{checksum, listener, pattern};
use lightpath::options::RendezvousLie;
use lightpath::{Options, ProviderId, RegisteredBuf, Stream, Transport};

const MIB: usize = 1 << 20;

fn options(provider: ProviderId) -> Options {
    Options::default().with_providers(&[provider])
}

/// The provider's default threshold (the tests probe sizes around it).
fn threshold(provider: ProviderId) -> usize {
    Options::default().rendezvous_min_for(provider)
}

/// A connected pair in this process: `(server side, client side)`.
fn pair(server: Options, client: Options) -> (Stream, Stream) {
    let listener = listener(server);
    let addr = listener.local_addr().unwrap();
    let accepted = std::thread::spawn(move || listener.accept().unwrap().0);
    let client = Stream::connect_with(addr, &client).unwrap();
    let server = accepted.join().unwrap();
    assert!(client.transport().is_rdma(), "{}", client.transport());
    (server, client)
}

/// A registered buffer holding `bytes` at `offset`.
fn filled(stream: &Stream, len: usize, offset: usize, bytes: &[u8]) -> RegisteredBuf {
    let buf = stream.register_buf(len).unwrap();
    buf.write(offset, bytes).unwrap();
    buf
}

/// `read_buf` until `len` bytes are in `buf` from `offset`, in calls of at most `step`.
fn read_buf_exact(stream: &mut Stream, buf: &RegisteredBuf, offset: usize, len: usize, step: usize) {
    let mut done = 0;
    while done < len {
        let want = step.min(len - done);
        let n = stream.read_buf(buf, offset + done, want).unwrap();
        assert!(n > 0 && n <= want, "read_buf returned {n} of {want} at {done} of {len}");
        done += n;
    }
}

fn bytes_of(buf: &RegisteredBuf, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    buf.read(offset, &mut out).unwrap();
    out
}

macro_rules! over_soft_and_shm {
    ($($name:ident),* $(,)?) => {
        mod soft {
            $(#[test] fn $name() { super::$name(lightpath::ProviderId::Soft) })*
        }
        mod shm {
            $(#[test] fn $name() { super::$name(lightpath::ProviderId::Shm) })*
        }
    };
}

over_soft_and_shm!(
    sizes_around_the_threshold_and_large,
    ring_bytes_and_rendezvous_keep_stream_order,
    partial_read_bufs_and_buffer_reuse,
    messages_from_and_into_registered_buffers,
    nonblocking_plain_reader_of_a_rendezvous,
    nonblocking_zero_copy_calls_are_repeated_until_done,
    closing_with_an_unfinished_nonblocking_write_gives_up,
    more_rendezvous_than_receive_credits,
    event_loop_reader_sleeps_while_reads_are_in_flight,
    write_timeout_while_the_peer_does_not_read,
    writer_killed_mid_rendezvous,
    reader_killed_mid_rendezvous,
    lying_descriptors_get_clear_errors,
);

fn sizes_around_the_threshold_and_large(provider: ProviderId) {
    let t = threshold(provider);
    let sizes = [t - 1, t, t + 1, MIB, 64 * MIB];
    let (mut server, mut client) = pair(options(provider), options(provider));
    let reader = std::thread::spawn(move || {
        let into = server.register_buf(64 * MIB + 8).unwrap();
        let mut sums = Vec::new();
        for &size in &sizes {
            // Once into a registered buffer (at an odd offset), once with plain reads.
            read_buf_exact(&mut server, &into, 3, size, usize::MAX);
            sums.push(checksum(&bytes_of(&into, 3, size)));
            let mut plain = vec![0u8; size];
            server.read_exact(&mut plain).unwrap();
            sums.push(checksum(&plain));
        }
        assert_eq!(server.read(&mut [0u8; 1]).unwrap(), 0);
        sums
    });
    let from = client.register_buf(64 * MIB + 16).unwrap();
    let mut expected = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        for round in 0..2 {
            let data = pattern(size, (i * 2 + round) as u32);
            from.write(16, &data).unwrap();
            client.write_buf(&from, 16, size).unwrap();
            expected.push(checksum(&data));
        }
    }
    client.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(reader.join().unwrap(), expected);
}

fn ring_bytes_and_rendezvous_keep_stream_order(provider: ProviderId) {
    let t = threshold(provider);
    let (mut server, mut client) = pair(options(provider), options(provider));
    let big = pattern(3 * MIB + 5, 1);
    let below = pattern(t - 1, 2);
    let exact = pattern(t, 3);
    let mut expected = Vec::new();
    let total = 4 + big.len() + 3 + below.len() + exact.len() + 5 + big.len() + 4;
    let reader = std::thread::spawn(move || {
        // A mix of read sizes and both read forms, so records are split every which way.
        let into = server.register_buf(MIB).unwrap();
        let mut got = Vec::with_capacity(total);
        let steps = [7usize, 100_000, 1, 65_536, MIB, 333_333];
        let mut k = 0;
        while got.len() < total {
            let step = steps[k % steps.len()];
            if k % 2 == 0 {
                let n = server.read_buf(&into, 0, step).unwrap();
                assert!(n > 0);
                got.extend_from_slice(&bytes_of(&into, 0, n));
            } else {
                let mut buf = vec![0u8; step];
                let n = server.read(&mut buf).unwrap();
                assert!(n > 0);
                got.extend_from_slice(&buf[..n]);
            }
            k += 1;
        }
        assert_eq!(server.read(&mut [0u8; 1]).unwrap(), 0, "nothing after the last byte");
        got
    });
    let buf = filled(&client, 4 * MIB, 0, &big);
    client.write_all(b"head").unwrap();
    client.write_buf(&buf, 0, big.len()).unwrap();
    client.write_all(b"mid").unwrap();
    buf.write(0, &below).unwrap();
    client.write_buf(&buf, 0, below.len()).unwrap();
    buf.write(MIB, &exact).unwrap();
    client.write_buf(&buf, MIB, exact.len()).unwrap();
    client.write_all(b"mid 2").unwrap();
    buf.write(0, &big).unwrap();
    client.write_buf(&buf, 0, big.len()).unwrap();
    client.write_all(b"tail").unwrap();
    for part in [&b"head"[..], &big, b"mid", &below, &exact, b"mid 2", &big, b"tail"] {
        expected.extend_from_slice(part);
    }
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let got = reader.join().unwrap();
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "stream order or bytes differ");
}

fn partial_read_bufs_and_buffer_reuse(provider: ProviderId) {
    let (mut server, mut client) = pair(options(provider), options(provider));
    let first = pattern(2 * MIB, 10);
    let second = pattern(2 * MIB, 11);
    let reader = std::thread::spawn(move || {
        // 100 KB at a time into a buffer much smaller than the rendezvous, at an offset.
        let small = server.register_buf(100_000 + 50).unwrap();
        let mut got = Vec::new();
        while got.len() < 4 * MIB {
            let n = server.read_buf(&small, 50, 100_000).unwrap();
            assert!(n > 0 && n <= 100_000);
            got.extend_from_slice(&bytes_of(&small, 50, n));
        }
        let err = server.read_buf(&small, 50, 100_001).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "past the buffer's end");
        assert_eq!(server.read_buf(&small, 0, 0).unwrap(), 0);
        got
    });
    let buf = filled(&client, 2 * MIB, 0, &first);
    client.write_buf(&buf, 0, first.len()).unwrap();
    // write_buf returned: the peer has every byte, the buffer is ours again.
    buf.write(0, &second).unwrap();
    client.write_buf(&buf, 0, second.len()).unwrap();
    buf.write(0, &pattern(2 * MIB, 99)).unwrap();
    let got = reader.join().unwrap();
    assert!(got[..2 * MIB] == first[..], "first write");
    assert!(got[2 * MIB..] == second[..], "second write (the buffer was reused after the first returned)");
}

fn messages_from_and_into_registered_buffers(provider: ProviderId) {
    let t = threshold(provider);
    let sizes = [0, 1, 1000, t - 1, t, t + 1, 5 * MIB];
    let (mut server, mut client) = pair(options(provider), options(provider));
    let reader = std::thread::spawn(move || {
        let into = server.register_buf(5 * MIB + 100).unwrap();
        let mut sums = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            if i % 2 == 0 {
                assert_eq!(server.recv_msg_buf(&into, 100).unwrap(), Some(size), "message {i}");
                sums.push(checksum(&bytes_of(&into, 100, size)));
            } else {
                let message = server.recv_msg().unwrap().unwrap();
                sums.push(checksum(&message));
            }
        }
        // A message larger than the buffer is refused and kept, whichever way it came.
        let small = server.register_buf(1000).unwrap();
        for _ in 0..2 {
            let err = server.recv_msg_buf(&small, 10).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
            let whole = server.recv_msg().unwrap().unwrap();
            sums.push(checksum(&whole));
        }
        // Stream bytes are not a message.
        let err = server.recv_msg_buf(&into, 0).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidData);
        let mut rest = [0u8; 5];
        server.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"bytes");
        assert_eq!(server.recv_msg_buf(&into, 0).unwrap(), None, "end of stream");
        sums
    });
    let from = client.register_buf(5 * MIB + 1).unwrap();
    let mut expected = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let data = pattern(size, 20 + i as u32);
        from.write(1, &data).unwrap();
        client.send_msg_buf(&from, 1, size).unwrap();
        expected.push(checksum(&data));
    }
    for size in [5000, 2 * t] {
        let data = pattern(size, 40);
        from.write(0, &data).unwrap();
        client.send_msg_buf(&from, 0, size).unwrap();
        expected.push(checksum(&data));
    }
    client.write_all(b"bytes").unwrap();
    assert_eq!(client.send_msg_buf(&from, 5 * MIB, 2).unwrap_err().kind(), ErrorKind::InvalidInput);
    client.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(reader.join().unwrap(), expected);
}

fn nonblocking_plain_reader_of_a_rendezvous(provider: ProviderId) {
    let (mut server, mut client) = pair(options(provider), options(provider));
    let data = pattern(3 * MIB, 7);
    let reader = std::thread::spawn(move || {
        server.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 40_000];
        let mut would_block = 0u64;
        loop {
            match server.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(err) if err.kind() == ErrorKind::WouldBlock => {
                    would_block += 1;
                    std::thread::yield_now();
                }
                Err(err) => panic!("{err}"),
            }
        }
        (got, would_block)
    });
    let buf = filled(&client, data.len(), 0, &data);
    client.write_buf(&buf, 0, data.len()).unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let (got, would_block) = reader.join().unwrap();
    assert!(got == data, "bytes differ");
    assert!(would_block > 0, "a nonblocking reader waits for READs by WouldBlock");
}

/// Sleeps on the stream's readiness fd (after `poll_ready` armed it) for at most 20 s.
fn sleep_on_fd(stream: &Stream) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let fd = stream.readiness_fd().unwrap();
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    assert!(poll(&mut fds, Some(&Timespec { tv_sec: 20, tv_nsec: 0 })).unwrap() > 0, "no event");
}

fn nonblocking_zero_copy_calls_are_repeated_until_done(provider: ProviderId) {
    // Large enough that a direct read is never over within the call that starts it (each
    // call posts at most two rounds of READs).
    let len = 64 * MIB;
    let (mut server, mut client) = pair(options(provider), options(provider));
    let data = pattern(len, 12);
    let buf = filled(&client, len, 0, &data);
    client.set_nonblocking(true).unwrap();
    // Announced but not fetched (nobody reads): WouldBlock, and so is the repeated call.
    for _ in 0..2 {
        assert_eq!(client.write_buf(&buf, 0, len).unwrap_err().kind(), ErrorKind::WouldBlock);
    }
    let writer = std::thread::spawn(move || {
        loop {
            client.poll_ready().unwrap();
            match client.write_buf(&buf, 0, len) {
                Ok(()) => break,
                Err(err) if err.kind() == ErrorKind::WouldBlock => sleep_on_fd(&client),
                Err(err) => panic!("write_buf: {err}"),
            }
        }
        // Fetched: the buffer is the writer's again.
        buf.write(0, &pattern(len, 13)).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        client
    });
    server.set_nonblocking(true).unwrap();
    let into = server.register_buf(len).unwrap();
    let mut got = 0;
    let mut refused = 0;
    while got < len {
        let readable = server.poll_ready().unwrap().readable;
        match server.read_buf(&into, got, len - got) {
            Ok(n) => {
                assert!(n > 0);
                got += n;
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => {
                // If the call started READs into `into` (certainly when data was there before
                // it; possibly when the announcement arrived between the look and the call),
                // other reads are refused until the same call has returned: their bytes are
                // owed to it. Otherwise a read finds nothing either.
                let err = server.read(&mut [0u8; 1]).unwrap_err();
                if readable || err.kind() != ErrorKind::WouldBlock {
                    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
                    let err = server.read_buf(&into, 0, 1).unwrap_err();
                    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
                    refused += 1;
                }
                if !server.poll_ready().unwrap().readable {
                    sleep_on_fd(&server);
                }
            }
            Err(err) => panic!("read_buf: {err}"),
        }
    }
    assert!(refused > 0, "no read_buf call ever left READs in flight: the test proves nothing");
    assert!(bytes_of(&into, 0, len) == data, "bytes differ");
    let client = writer.join().unwrap();
    loop {
        match server.read_buf(&into, 0, 1) {
            Ok(n) => {
                assert_eq!(n, 0, "end of stream");
                break;
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => {
                if !server.poll_ready().unwrap().readable {
                    sleep_on_fd(&server);
                }
            }
            Err(err) => panic!("read_buf at the end: {err}"),
        }
    }
    drop(client);
}

fn closing_with_an_unfinished_nonblocking_write_gives_up(provider: ProviderId) {
    let (mut server, mut client) = pair(options(provider), options(provider));
    let buf = filled(&client, 2 * MIB, 0, &pattern(2 * MIB, 14));
    client.set_nonblocking(true).unwrap();
    client.write_buf(&buf, 0, 2 * MIB).unwrap_err();
    // Dropped before the call was repeated to its end: the peer may not read the buffer
    // later (the application may reuse or free it), and the close does not wait for a reader
    // (the linger time is 10 s; the hang guard of this test would be the harness's).
    drop(client);
    buf.write(0, &pattern(2 * MIB, 15)).unwrap();
    let into = server.register_buf(2 * MIB).unwrap();
    let err = match server.read_buf(&into, 0, 2 * MIB) {
        Ok(n) => panic!("read {n} bytes of a given-up rendezvous"),
        Err(err) => err,
    };
    assert!(matches!(err.kind(), ErrorKind::ConnectionReset | ErrorKind::InvalidData), "{err}");
}

fn event_loop_reader_sleeps_while_reads_are_in_flight(provider: ProviderId) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let (mut server, mut client) = pair(options(provider), options(provider));
    let rounds = 3;
    let writer = std::thread::spawn(move || {
        let buf = filled(&client, 2 * MIB, 0, &pattern(2 * MIB, 4));
        for _ in 0..rounds {
            client.write_buf(&buf, 0, 2 * MIB).unwrap();
        }
    });
    server.set_nonblocking(true).unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 100_000];
    // Readable but WouldBlock: only when a read had to start a rendezvous' READs.
    let mut started_reads = 0;
    while got.len() < rounds * 2 * MIB {
        if !server.poll_ready().unwrap().readable {
            let fd = server.readiness_fd().unwrap();
            let mut fds = [PollFd::new(&fd, PollFlags::IN)];
            let guard = Timespec { tv_sec: 20, tv_nsec: 0 };
            assert!(poll(&mut fds, Some(&guard)).unwrap() > 0, "no event while READs were in flight");
            continue;
        }
        match server.read(&mut buf) {
            Ok(n) => {
                assert!(n > 0);
                got.extend_from_slice(&buf[..n]);
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => started_reads += 1,
            Err(err) => panic!("{err}"),
        }
    }
    writer.join().unwrap();
    assert!(got.chunks(2 * MIB).all(|chunk| chunk == &pattern(2 * MIB, 4)[..]), "bytes differ");
    assert!(started_reads <= 2 * rounds, "readable while READs were in flight {started_reads} times");
}

fn more_rendezvous_than_receive_credits(provider: ProviderId) {
    // Every rendezvous costs the reader one receive credit of the writer (its done record);
    // a reader that never writes must still see the credits the writer returns. Three times
    // the receive queue's depth of rendezvous in a row.
    let small = options(provider).with_rendezvous_min(4096);
    let rounds = 3 * small.recv_depth as usize;
    let (mut server, mut client) = pair(small.clone(), small);
    let reader = std::thread::spawn(move || {
        let into = server.register_buf(5000).unwrap();
        let mut sums = Vec::new();
        for _ in 0..rounds {
            read_buf_exact(&mut server, &into, 0, 5000, usize::MAX);
            sums.push(checksum(&bytes_of(&into, 0, 5000)));
        }
        sums
    });
    let buf = client.register_buf(5000).unwrap();
    let mut expected = Vec::new();
    for round in 0..rounds {
        let data = pattern(5000, round as u32);
        buf.write(0, &data).unwrap();
        client.write_buf(&buf, 0, data.len()).unwrap();
        expected.push(checksum(&data));
    }
    assert_eq!(reader.join().unwrap(), expected);
}

fn write_timeout_while_the_peer_does_not_read(provider: ProviderId) {
    let (mut server, mut client) = pair(options(provider), options(provider));
    client.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
    let buf = filled(&client, MIB, 0, &pattern(MIB, 1));
    let started = Instant::now();
    let err = client.write_buf(&buf, 0, MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(190));
    // The connection was given up (so the peer cannot read the buffer any more).
    assert!(client.write_all(b"x").is_err());
    drop(client);
    let mut sink = vec![0u8; MIB];
    let err = loop {
        match server.read(&mut sink) {
            Ok(n) => assert!(n > 0, "a given-up connection is no clean close"),
            Err(err) => break err,
        }
    };
    assert!(matches!(err.kind(), ErrorKind::ConnectionReset | ErrorKind::InvalidData), "{err}");
}

/// Which child a test runs, and with which provider.
fn child_options() -> Options {
    match std::env::var("LIGHTPATH_TEST_CHILD_PROVIDER").as_deref() {
        Ok("shm") => options(ProviderId::Shm),
        _ => options(ProviderId::Soft),
    }
}

fn spawn_child(name: &str, provider: ProviderId, addr: std::net::SocketAddr) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("LIGHTPATH_TEST_CHILD_PROVIDER", provider.name())
        .env("LIGHTPATH_TEST_ZERO_COPY_ADDR", addr.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the child prints `word`.
fn wait_for_word(child: &mut std::process::Child, word: &str) {
    let out = child.stdout.as_mut().unwrap();
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains(word) {
        assert_eq!(out.read(&mut byte).unwrap(), 1, "the child ended before saying {word:?}");
        seen.push(byte[0]);
    }
}

/// Child side of `writer_killed_mid_rendezvous`: 64 MiB zero-copy writes until killed.
#[test]
fn child_rendezvous_writer() {
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_ZERO_COPY_ADDR") else { return };
    let mut stream = Stream::connect_with(addr.as_str(), &child_options()).unwrap();
    let buf = stream.register_buf(64 * MIB).unwrap();
    buf.write(0, &pattern(64 * MIB, 5)).unwrap();
    while stream.write_buf(&buf, 0, 64 * MIB).is_ok() {}
}

fn writer_killed_mid_rendezvous(provider: ProviderId) {
    let listener = listener(options(provider));
    let mut child = spawn_child("child_rendezvous_writer", provider, listener.local_addr().unwrap());
    let (mut stream, _) = listener.accept_timeout(Duration::from_secs(20)).expect("child connected");
    assert_eq!(stream.transport(), Transport::Rdma(provider));
    // Part of the first rendezvous, then the writer dies.
    let into = stream.register_buf(MIB).unwrap();
    read_buf_exact(&mut stream, &into, 0, MIB, MIB);
    assert!(bytes_of(&into, 0, MIB) == pattern(64 * MIB, 5)[..MIB]);
    child.kill().unwrap();
    let killed = Instant::now();
    let err = loop {
        match stream.read_buf(&into, 0, MIB) {
            Ok(n) => assert!(n > 0, "a killed peer must not look like a clean close"),
            Err(err) => break err,
        }
    };
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    assert!(killed.elapsed() < Duration::from_secs(5), "noticed after {:?}", killed.elapsed());
    let _ = child.wait();
}

/// Child side of `reader_killed_mid_rendezvous`: reads 1 MiB of a rendezvous, says so, then
/// waits to be killed.
#[test]
fn child_rendezvous_reader() {
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_ZERO_COPY_ADDR") else { return };
    let mut stream = Stream::connect_with(addr.as_str(), &child_options()).unwrap();
    let into = stream.register_buf(MIB).unwrap();
    read_buf_exact(&mut stream, &into, 0, MIB, MIB);
    println!("started");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

fn reader_killed_mid_rendezvous(provider: ProviderId) {
    let listener = listener(options(provider));
    let mut child = spawn_child("child_rendezvous_reader", provider, listener.local_addr().unwrap());
    let (mut stream, _) = listener.accept_timeout(Duration::from_secs(20)).expect("child connected");
    assert_eq!(stream.transport(), Transport::Rdma(provider));
    let killer = std::thread::spawn(move || {
        wait_for_word(&mut child, "started");
        child.kill().unwrap();
        let killed = Instant::now();
        let _ = child.wait();
        killed
    });
    let buf = filled(&stream, 64 * MIB, 0, &pattern(64 * MIB, 6));
    let err = stream.write_buf(&buf, 0, 64 * MIB).unwrap_err();
    let killed = killer.join().unwrap();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    assert!(killed.elapsed() < Duration::from_secs(5), "noticed after {:?}", killed.elapsed());
}

fn lying_descriptors_get_clear_errors(provider: ProviderId) {
    for lie in [RendezvousLie::Key, RendezvousLie::PastTheEnd, RendezvousLie::Huge] {
        let liar = Options { fault_rendezvous: Some(lie), ..options(provider) };
        let (mut server, mut client) = pair(options(provider), liar);
        let writer = std::thread::spawn(move || {
            let buf = filled(&client, MIB, 0, &pattern(MIB, 8));
            client.write_all(b"before").unwrap();
            client.write_buf(&buf, 0, MIB)
        });
        let mut head = [0u8; 6];
        server.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"before");
        let into = server.register_buf(4 * MIB).unwrap();
        into.with_bytes_mut(|bytes| bytes.fill(0xEE));
        let err = loop {
            match server.read_buf(&into, 0, 2 * MIB) {
                Ok(n) => assert!(n > 0),
                Err(err) => break err,
            }
        };
        assert_eq!(err.kind(), ErrorKind::InvalidData, "{lie:?}: {err}");
        let text = err.to_string();
        let expected = match lie {
            RendezvousLie::Huge => "malformed rendezvous descriptor",
            RendezvousLie::Key | RendezvousLie::PastTheEnd => {
                "rendezvous names memory it does not let us read"
            }
        };
        assert!(text.contains(expected), "{lie:?}: {text}");
        // Nothing beyond what the descriptor could name was written, and for a refused key or
        // length nothing at all.
        let untouched_from = if lie == RendezvousLie::PastTheEnd { MIB + 4096 } else { 0 };
        assert!(into.with_bytes(|bytes| bytes[untouched_from..].iter().all(|&b| b == 0xEE)), "{lie:?}");
        // The connection is broken for good; the liar's write fails instead of hanging.
        assert_eq!(server.read_buf(&into, 0, 1).unwrap_err().kind(), ErrorKind::InvalidData);
        drop(server);
        let outcome = writer.join().unwrap();
        let err = outcome.expect_err("the liar's rendezvous cannot succeed");
        assert!(matches!(err.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe), "{lie:?}: {err}");
    }
}

#[test]
fn tcp_streams_refuse_zero_copy_calls() {
    let (_rdma_server, rdma) = pair(options(ProviderId::Soft), options(ProviderId::Soft));
    let buf = rdma.register_buf(64).unwrap();
    let listener = listener(Options::tcp_only());
    let addr = listener.local_addr().unwrap();
    let accepted = std::thread::spawn(move || listener.accept().map(drop));
    let mut tcp = Stream::connect_with(addr, &Options::tcp_only()).unwrap();
    assert_eq!(tcp.read_buf(&buf, 0, 8).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(tcp.recv_msg_buf(&buf, 0).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(tcp.send_msg_buf(&buf, 0, 8).unwrap_err().kind(), ErrorKind::Unsupported);
    assert_eq!(tcp.write_buf(&buf, 0, 8).unwrap_err().kind(), ErrorKind::Unsupported);
    accepted.join().unwrap().unwrap();
}

#[test]
fn version_one_peers_get_plain_tcp() {
    // Version 2 added rendezvous; a version-1 peer is not offered RDMA with this side.
    let listener = listener(options(ProviderId::Soft));
    let addr = listener.local_addr().unwrap();
    let accepted = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buf = [0u8; 3];
        stream.read_exact(&mut buf).unwrap();
        stream.write_all(&buf).unwrap();
        stream.transport()
    });
    let old = Options { fault_versions: Some((1, 1)), ..options(ProviderId::Soft) };
    let mut stream = Stream::connect_with(addr, &old).unwrap();
    assert_eq!(stream.transport(), Transport::PlainTcp);
    stream.write_all(b"old").unwrap();
    let mut echo = [0u8; 3];
    stream.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"old");
    assert_eq!(accepted.join().unwrap(), Transport::PlainTcp);
}
