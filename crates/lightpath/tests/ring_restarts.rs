//! Ring restarts (stream protocol version 4): a sender whose peer has read everything starts
//! its next record at the beginning of the peer's ring, so request/response traffic keeps to
//! the ring's first pages however long it runs; facing a version-3 peer it never does, and the
//! position runs through the whole ring as before. Measured over shm, whose rings are memfds:
//! the resident size of their mappings in this process (both sides run here) is what the
//! traffic touched. One test in its own process, so no other connection's regions count.

mod common;

use std::io::{Read, Write};

use common::{echo_server, listener};
use lightpath::{Options, ProviderId, Stream, Transport};

fn shm() -> Options {
    Options::default().with_providers(&[ProviderId::Shm])
}

/// Resident KiB of each mapping of a shm memory region (stream rings) in this process.
fn ring_mappings_rss() -> Vec<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut in_region = false;
    let mut rss = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            in_region = line.contains("lightpath-shm-mr");
        } else if first == "Rss:" && in_region {
            rss.push(words.next().and_then(|kib| kib.parse().ok()).expect("an Rss value"));
        }
    }
    rss
}

/// `rounds` round trips of 64 bytes with an echo server (default options) from a client with
/// `client` options; returns the resident KiB of the ring mappings before the stream closes.
fn round_trips(client: &Options, rounds: u32) -> Vec<u64> {
    let listener = listener(shm());
    let addr = listener.local_addr().expect("addr");
    let server = echo_server(listener, 1);
    let mut stream = Stream::connect_with(addr, client).expect("connect");
    assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Shm));
    let mut request = [0u8; 64];
    for round in 0..rounds {
        request[..4].copy_from_slice(&round.to_le_bytes());
        stream.write_all(&request).expect("write");
        let mut answer = [0u8; 64];
        stream.read_exact(&mut answer).expect("read");
        assert_eq!(answer, request, "round {round}");
    }
    let rss = ring_mappings_rss();
    drop(stream);
    assert_eq!(server.join().expect("server"), [Transport::Rdma(ProviderId::Shm)]);
    rss
}

#[test]
fn version_4_peers_keep_to_the_start_of_their_rings_and_a_version_3_peer_runs_through_them() {
    // 20,000 round trips move 1.25 MiB each way through rings of 512 KiB.
    let rounds = 20_000;
    let restarted = round_trips(&shm(), rounds);
    assert_eq!(restarted.len(), 4, "two rings, each mapped by its owner and its writer: {restarted:?}");
    assert!(restarted.iter().all(|&kib| kib <= 64), "version 4: rings touched {restarted:?} KiB");
    let version_3 = Options { fault_versions: Some((2, 3)), ..shm() };
    let cycled = round_trips(&version_3, rounds);
    assert!(cycled.iter().all(|&kib| kib >= 256), "version 3: rings touched only {cycled:?} KiB");
}
