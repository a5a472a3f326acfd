//! What an operator sees: counters (per device and per queue pair) move with traffic, and a
//! datagram with a bad ICRC is dropped, counted against its queue pair and reported to the
//! tracing subscriber with the fields that say where it came from.
//!
//! The subscriber is installed process-wide (the device's progress thread, not the test
//! thread, receives the datagram), so this file holds one test.

mod common;

use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lightpath_soft::{ProgressMode, SoftDevice};
use lightpath_verbs::conformance::harness::{common_mtu, connect, wait_n, PairOptions, Side};
use lightpath_verbs::{AccessFlags, MemoryRegion, QueuePair, SendOp, SendWr, WcStatus};

/// One captured event: level, message and fields as text.
#[derive(Clone, Debug)]
struct Captured {
    level: tracing::Level,
    fields: BTreeMap<String, String>,
}

/// A subscriber that keeps every event (spans are accepted and ignored).
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Captured>>>);

struct FieldText<'a>(&'a mut BTreeMap<String, String>);

impl tracing::field::Visit for FieldText<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut FieldText(&mut fields));
        let level = *event.metadata().level();
        self.0.lock().unwrap().push(Captured { level, fields });
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn connected() -> (Side<SoftDevice>, Side<SoftDevice>) {
    let options = PairOptions::default();
    let (a, b) = common::open_pair(ProgressMode::Thread);
    let mtu = common_mtu(&a, &b);
    let (a, b) = (Side::new(a, &options), Side::new(b, &options));
    connect(&a.qp, &b.qp, mtu, &options);
    (a, b)
}

/// A RoCE v2 RC SEND ONLY packet (BTH, 16 payload bytes, ICRC) for `dest_qpn`, with an ICRC
/// that cannot match.
fn send_only_with_bad_icrc(dest_qpn: u32, psn: u32) -> Vec<u8> {
    let mut packet = vec![
        0x04, // RC SEND ONLY
        0x00, // SE, MigReq, pad count, transport version
        0xFF, 0xFF, // default P_Key
        0x00, // reserved
    ];
    packet.extend_from_slice(&dest_qpn.to_be_bytes()[1..]);
    packet.push(0x80); // AckReq
    packet.extend_from_slice(&psn.to_be_bytes()[1..]);
    packet.extend_from_slice(&[0xAB; 16]);
    packet.extend_from_slice(&[0xDE, 0xAD, 0xBE, 0xEF]);
    packet
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn traffic_moves_the_counters_and_an_icrc_failure_reaches_the_subscriber() {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(capture.clone()).expect("the only subscriber");

    let (a, b) = connected();
    let before = (a.device.stats(), b.device.stats());

    // Traffic: 8 SENDs of 1,000 bytes from a to b.
    let src = a.alloc(1000, AccessFlags::LOCAL_WRITE);
    let inbox = b.alloc(8 * 1000, AccessFlags::LOCAL_WRITE);
    for i in 0..8u64 {
        b.post_recv(i, &inbox, i as usize * 1000, 1000);
    }
    for i in 0..8u64 {
        a.qp.post_send(&SendWr::new(100 + i, SendOp::Send, &[src.sge(0, 1000)])).expect("post_send");
    }
    assert!(wait_n(&a.cq, 8).iter().all(|wc| wc.status == WcStatus::Success));
    assert!(wait_n(&b.cq, 8).iter().all(|wc| wc.status == WcStatus::Success));

    let a_qp = a.qp.stats().expect("a's queue pair");
    let b_qp = b.qp.stats().expect("b's queue pair");
    assert!(a_qp.tx_datagrams >= 8, "{a_qp:?}");
    assert!(a_qp.tx_bytes >= 8 * 1000, "{a_qp:?}");
    assert!(b_qp.rx_datagrams >= 8 && b_qp.rx_bytes >= 8 * 1000, "{b_qp:?}");
    assert!(a_qp.rx_datagrams >= 1, "the ACKs reached a: {a_qp:?}");
    let b_dev = b.device.stats();
    assert!(b_dev.engine.rx_datagrams >= before.1.engine.rx_datagrams + 8);
    assert!(b_dev.engine.rx_bytes >= before.1.engine.rx_bytes + 8 * 1000);
    assert!(a.device.stats().engine.tx_bytes >= before.0.engine.tx_bytes + 8 * 1000);
    assert_eq!(b_qp.drops_icrc, 0);

    // A datagram from a's address (so it passes the peer check) with a bad ICRC.
    let a_ip = a.device.local_addr().ip();
    let injector = UdpSocket::bind((a_ip, 0)).expect("bind the injector");
    let injector_port = injector.local_addr().unwrap().port();
    let bad = send_only_with_bad_icrc(b.qp.qpn(), 12345);
    injector.send_to(&bad, b.device.local_addr()).expect("send the bad datagram");
    wait_until("the ICRC drop", || b.device.stats().engine.drops_icrc == before.1.engine.drops_icrc + 1);
    assert_eq!(b.qp.stats().unwrap().drops_icrc, 1, "counted against the queue pair it named");
    assert_eq!(b.qp.stats().unwrap().rx_datagrams, b_qp.rx_datagrams, "the bad datagram reached no work");

    let events = capture.0.lock().unwrap().clone();
    let icrc: Vec<&Captured> = events
        .iter()
        .filter(|e| e.fields.get("message").is_some_and(|m| m.contains("ICRC mismatch")))
        .collect();
    assert_eq!(icrc.len(), 1, "one ICRC event: {events:#?}");
    let event = icrc[0];
    assert_eq!(event.level, tracing::Level::WARN, "the first failure from a peer is a warning");
    assert_eq!(event.fields["qpn"], b.qp.qpn().to_string());
    assert_eq!(event.fields["from"], a_ip.to_string());
    assert_eq!(event.fields["src_port"], injector_port.to_string());
    assert_eq!(event.fields["psn"], "12345");
    assert_eq!(event.fields["len"], bad.len().to_string());

    // A second one is counted too, and reported below the warning level.
    injector.send_to(&bad, b.device.local_addr()).expect("send the bad datagram again");
    wait_until("the second ICRC drop", || b.qp.stats().unwrap().drops_icrc == 2);
    let events = capture.0.lock().unwrap().clone();
    let levels: Vec<tracing::Level> = events
        .iter()
        .filter(|e| e.fields.get("message").is_some_and(|m| m.contains("ICRC mismatch")))
        .map(|e| e.level)
        .collect();
    assert_eq!(levels, [tracing::Level::WARN, tracing::Level::DEBUG]);
}
