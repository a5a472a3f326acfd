//! Tests of the network model alone (no engine): fault rates, determinism, MTU cap, timing,
//! scripted faults.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use lightpath_sim::{DropReason, LinkConfig, Network, ScriptedFault, SimTime, TraceKind};

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
}

fn two_nodes(seed: u64, link: &LinkConfig, scripted: Vec<ScriptedFault>) -> Network {
    Network::new(seed, vec![v4(1), v4(2)], link, scripted)
}

/// Sends `count` datagrams 0 → 1, one per microsecond, each carrying its index, and returns
/// every delivery's payload in arrival order.
fn send_and_collect(network: &mut Network, count: u64, len: usize) -> Vec<Vec<u8>> {
    let mut delivered = Vec::new();
    for i in 0..count {
        let now = SimTime::from_micros(i);
        let mut bytes = vec![0u8; len];
        bytes[..8].copy_from_slice(&i.to_be_bytes());
        network.send(now, 0, v4(2), 4791, &bytes);
        while let Some(d) = network.pop_due(now) {
            delivered.push(d.bytes);
        }
    }
    while let Some(d) = network.pop_due(SimTime::NEVER) {
        delivered.push(d.bytes);
    }
    delivered
}

/// `observed` is within 5 standard deviations of a binomial(n, p) mean.
fn assert_rate(what: &str, observed: u64, n: u64, p: f64) {
    let mean = n as f64 * p;
    let sigma = (n as f64 * p * (1.0 - p)).sqrt();
    assert!(
        (observed as f64 - mean).abs() <= 5.0 * sigma + 1.0,
        "{what}: observed {observed} of {n}, expected about {mean:.0} (sigma {sigma:.1})"
    );
}

#[test]
fn fault_rates_are_honoured() {
    let link =
        LinkConfig { loss: 0.1, duplicate: 0.05, reorder: 0.1, corrupt: 0.05, ..LinkConfig::default() };
    let mut network = two_nodes(11, &link, Vec::new());
    let n = 20_000;
    let delivered = send_and_collect(&mut network, n, 64);
    let stats = network.stats().clone();
    assert_eq!(stats.sent, n);
    assert_rate("loss", stats.dropped_loss, n, 0.1);
    let survivors = n - stats.dropped_loss;
    assert_rate("duplicate", stats.duplicated, survivors, 0.05);
    assert_rate("reorder", stats.reordered, survivors, 0.1);
    assert_rate("corrupt", stats.corrupted, survivors, 0.05);
    assert_eq!(stats.delivered, survivors + stats.duplicated);
    assert_eq!(delivered.len() as u64, stats.delivered);
    assert_eq!(stats.dropped(), stats.dropped_loss);
}

#[test]
fn corrupted_datagrams_differ_from_what_was_sent() {
    let link = LinkConfig { corrupt: 0.2, duplicate: 0.1, ..LinkConfig::default() };
    let mut network = two_nodes(5, &link, Vec::new());
    let mut differing = 0;
    let n = 5_000u64;
    for i in 0..n {
        network.send(SimTime::from_micros(i), 0, v4(2), 4791, &[0u8; 100]);
    }
    while let Some(d) = network.pop_due(SimTime::NEVER) {
        if d.bytes.iter().any(|b| *b != 0) {
            differing += 1;
        }
        assert_eq!(d.bytes.len(), 100, "corruption never changes the length");
    }
    let stats = network.stats();
    assert!(stats.corrupted > 0);
    // Every corrupted datagram arrives damaged; a duplicate of one arrives damaged too.
    assert!(differing >= stats.corrupted && differing <= stats.corrupted + stats.duplicated);
}

#[test]
fn without_reordering_delivery_is_fifo_despite_jitter() {
    let link = LinkConfig { jitter: Duration::from_micros(50), ..LinkConfig::default() };
    let mut network = two_nodes(3, &link, Vec::new());
    let delivered = send_and_collect(&mut network, 2_000, 64);
    let order: Vec<u64> = delivered.iter().map(|b| u64::from_be_bytes(b[..8].try_into().unwrap())).collect();
    assert_eq!(order, (0..2_000).collect::<Vec<_>>());
}

#[test]
fn reordering_lets_later_datagrams_overtake() {
    let link = LinkConfig { reorder: 0.2, ..LinkConfig::default() };
    let mut network = two_nodes(3, &link, Vec::new());
    let delivered = send_and_collect(&mut network, 2_000, 64);
    let order: Vec<u64> = delivered.iter().map(|b| u64::from_be_bytes(b[..8].try_into().unwrap())).collect();
    let inversions = order.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(inversions > 50, "only {inversions} inversions");
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..2_000).collect::<Vec<_>>(), "reordering loses nothing");
}

fn traced_run(seed: u64) -> Vec<String> {
    let link = LinkConfig { loss: 0.2, duplicate: 0.1, reorder: 0.2, corrupt: 0.1, ..LinkConfig::default() };
    let mut network = two_nodes(seed, &link, Vec::new());
    network.enable_trace();
    send_and_collect(&mut network, 300, 40);
    network.take_trace().iter().map(ToString::to_string).collect()
}

#[test]
fn same_seed_gives_an_identical_trace() {
    let a = traced_run(77);
    assert_eq!(a, traced_run(77));
    assert_ne!(a, traced_run(78));
    assert!(a.iter().any(|line| line.contains("DROP(Loss)")));
    assert!(a.iter().any(|line| line.contains("CORRUPT")));
    assert!(a.iter().any(|line| line.contains("DUP")));
}

#[test]
fn mtu_cap_drops_oversized_datagrams() {
    let link = LinkConfig { mtu: 1500, ..LinkConfig::default() };
    // IPv4: 20 bytes of IP and 8 of UDP header count against the MTU.
    let mut network = two_nodes(1, &link, Vec::new());
    network.enable_trace();
    network.send(SimTime::ZERO, 0, v4(2), 4791, &[0; 1472]);
    network.send(SimTime::ZERO, 0, v4(2), 4791, &[0; 1473]);
    assert_eq!(network.stats().dropped_mtu, 1);
    assert!(network.pop_due(SimTime::NEVER).is_some_and(|d| d.bytes.len() == 1472));
    assert!(network.pop_due(SimTime::NEVER).is_none());
    assert!(network.take_trace().iter().any(|e| e.kind == TraceKind::Dropped(DropReason::Mtu)));

    // IPv6: 40 bytes of IP header.
    let six = |last: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, last));
    let mut network = Network::new(1, vec![six(1), six(2)], &link, Vec::new());
    network.send(SimTime::ZERO, 0, six(2), 4791, &[0; 1452]);
    network.send(SimTime::ZERO, 0, six(2), 4791, &[0; 1453]);
    assert_eq!(network.stats().dropped_mtu, 1);
    assert_eq!(network.stats().dropped(), 1);
}

#[test]
fn arrival_is_serialization_plus_latency() {
    let link = LinkConfig {
        latency: Duration::from_micros(3),
        jitter: Duration::ZERO,
        bits_per_second: 1_000_000_000, // 8 ns per byte
        ..LinkConfig::default()
    };
    let mut network = two_nodes(1, &link, Vec::new());
    // 72 bytes of payload + 28 of headers = 100 bytes = 800 ns on the wire.
    network.send(SimTime::from_micros(10), 0, v4(2), 4791, &[0; 72]);
    network.send(SimTime::from_micros(10), 0, v4(2), 4791, &[0; 72]);
    assert_eq!(network.next_arrival(), Some(SimTime::from_nanos(10_000 + 800 + 3_000)));
    let first = network.pop_due(SimTime::NEVER).unwrap();
    let second = network.pop_due(SimTime::NEVER).unwrap();
    assert_eq!(first.at, SimTime::from_nanos(13_800));
    assert_eq!(second.at, SimTime::from_nanos(14_600), "the second waits for the first to be serialized");
    assert_eq!((first.src_ip, first.dst_ip, first.src_port), (v4(1), v4(2), 4791));
}

#[test]
fn scripted_faults_drop_what_they_say() {
    let scripted = vec![
        ScriptedFault::DropNth { from: 0, to: 1, nth: 2 },
        ScriptedFault::Partition {
            a: 0,
            b: 1,
            from: SimTime::from_micros(100),
            until: Some(SimTime::from_micros(200)),
        },
        ScriptedFault::Kill { node: 1, at: SimTime::from_micros(1_000) },
    ];
    let mut network = two_nodes(1, &LinkConfig::default(), scripted);
    for i in 0..5u8 {
        network.send(SimTime::from_micros(u64::from(i)), 0, v4(2), 1, &[i; 16]);
    }
    let firsts: Vec<u8> =
        std::iter::from_fn(|| network.pop_due(SimTime::from_micros(50))).map(|d| d.bytes[0]).collect();
    assert_eq!(firsts, vec![0, 1, 3, 4]);
    assert_eq!(network.stats().dropped_scripted, 1);

    network.send(SimTime::from_micros(150), 1, v4(1), 1, &[9; 16]);
    network.send(SimTime::from_micros(150), 0, v4(2), 1, &[9; 16]);
    network.send(SimTime::from_micros(250), 1, v4(1), 1, &[7; 16]);
    assert_eq!(network.stats().dropped_partition, 2);
    assert_eq!(network.pop_due(SimTime::from_micros(300)).map(|d| d.bytes[0]), Some(7));

    // In flight when the destination dies: dropped on arrival.
    network.send(SimTime::from_nanos(999_999), 0, v4(2), 1, &[1; 16]);
    assert!(network.pop_due(SimTime::NEVER).is_none());
    assert_eq!(network.stats().dropped_dead, 1);
    assert!(network.is_alive(0, SimTime::from_micros(5_000)));
    assert!(!network.is_alive(1, SimTime::from_micros(1_000)));
    // Nothing to or from a dead node gets through.
    network.send(SimTime::from_micros(2_000), 1, v4(1), 1, &[1; 16]);
    network.send(SimTime::from_micros(2_000), 0, v4(9), 1, &[1; 16]);
    assert_eq!(network.stats().dropped_dead, 2);
    assert_eq!(network.stats().dropped_no_route, 1);
    assert_eq!(network.in_flight(), 0);
}
