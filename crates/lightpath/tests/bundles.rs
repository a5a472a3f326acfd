//! Acknowledgement bundles over soft streams (stream protocol version 3): two version-3
//! peers put each acknowledgement in front of their next message to each other; a peer that
//! offers only version 2 is never sent one, and its streams carry the same bytes as before.
//! One test in its own process, since the counters belong to the process's soft devices.

mod common;

use std::io::{Read, Write};

use common::{echo_server, listener};
use lightpath::{soft_device_stats, Options, ProviderId, Stream, Transport};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

/// Bundles sent and taken apart by this process's soft devices so far.
fn bundles() -> (u64, u64) {
    soft_device_stats().iter().fold((0, 0), |(sent, taken), device| {
        (sent + device.stats.driver.tx_bundles, taken + device.stats.engine.rx_bundles)
    })
}

/// `rounds` ping-pongs of 8 bytes between a client with `client` options and a version-3
/// soft server, both in this process; the bytes come back as sent.
fn ping_pong(client: &Options, rounds: u32) {
    let listener = listener(soft());
    let addr = listener.local_addr().expect("addr");
    let server = echo_server(listener, 1);
    let mut stream = Stream::connect_with(addr, client).expect("connect");
    assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
    for round in 0..rounds {
        let ping = u64::from(round).to_le_bytes();
        stream.write_all(&ping).expect("write");
        let mut pong = [0u8; 8];
        stream.read_exact(&mut pong).expect("read");
        assert_eq!(pong, ping, "round {round}");
    }
    drop(stream);
    assert_eq!(server.join().expect("server"), [Transport::Rdma(ProviderId::Soft)]);
}

#[test]
fn version_3_peers_bundle_and_a_version_2_peer_never_gets_a_bundle() {
    let start = bundles();
    ping_pong(&soft(), 200);
    let after_v3 = bundles();
    assert!(after_v3.0 > start.0, "version-3 peers sent no bundle: {start:?} -> {after_v3:?}");
    assert!(after_v3.1 > start.1, "version-3 peers took no bundle apart: {start:?} -> {after_v3:?}");
    let version_2 = Options { fault_versions: Some((2, 2)), ..soft() };
    ping_pong(&version_2, 200);
    assert_eq!(bundles(), after_v3, "a bundle went to (or came from) a version-2 peer");
}
