//! What an operator sees when a stream falls back to TCP: the reason (and its detail) reaches
//! the tracing subscriber on both sides, inside the connection's span; and the counters of a
//! soft stream (its queue pair, its device) move with its traffic.
//!
//! The subscriber is process-wide (the listener negotiates on its own thread), so the tests
//! here tell their events apart by the connection's client address, a field of the span.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::{listener, soft};
use lightpath::{FallbackReason, Options, ProviderId, Stream, Transport};

/// One captured event: its level, its fields and those of the spans around it, as text.
#[derive(Clone, Debug)]
struct Captured {
    level: tracing::Level,
    fields: BTreeMap<String, String>,
    spans: BTreeMap<String, String>,
}

/// A subscriber that keeps every event with the fields of the spans it was in.
#[derive(Clone, Default)]
struct Capture {
    events: Arc<Mutex<Vec<Captured>>>,
    /// Fields of each span by id (ids are never reused here).
    spans: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
}

thread_local! {
    static ENTERED: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

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
    fn new_span(&self, attrs: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut fields = BTreeMap::new();
        attrs.record(&mut FieldText(&mut fields));
        let mut spans = self.spans.lock().unwrap();
        spans.push(fields);
        tracing::span::Id::from_u64(spans.len() as u64)
    }
    /// Fields a span was given after it was made (the connection span records the addresses
    /// only when a subscriber takes it).
    fn record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut spans = self.spans.lock().unwrap();
        if let Some(fields) = spans.get_mut(id.into_u64() as usize - 1) {
            values.record(&mut FieldText(fields));
        }
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut FieldText(&mut fields));
        let mut span_fields = BTreeMap::new();
        let spans = self.spans.lock().unwrap();
        let mut ids: Vec<u64> = ENTERED.with(|entered| entered.borrow().clone());
        if let Some(parent) = event.parent() {
            ids.push(parent.into_u64());
        }
        for id in ids {
            if let Some(fields) = spans.get(id as usize - 1) {
                span_fields.extend(fields.clone());
            }
        }
        let level = *event.metadata().level();
        self.events.lock().unwrap().push(Captured { level, fields, spans: span_fields });
    }
    fn enter(&self, id: &tracing::span::Id) {
        ENTERED.with(|entered| entered.borrow_mut().push(id.into_u64()));
    }
    fn exit(&self, id: &tracing::span::Id) {
        ENTERED.with(|entered| {
            let mut entered = entered.borrow_mut();
            if let Some(at) = entered.iter().rposition(|&e| e == id.into_u64()) {
                entered.remove(at);
            }
        });
    }
}

fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(capture.clone()).expect("the only subscriber");
        capture
    })
}

/// The fallback events of the connection whose client end is `client`: (role, event).
fn fallbacks_of(client: std::net::SocketAddr) -> Vec<(String, Captured)> {
    // The server sees the client as an IPv4-mapped address.
    let names = [client.to_string(), format!("[::ffff:{}]:{}", client.ip(), client.port())];
    capture()
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.fields.get("message").is_some_and(|m| m == "negotiation: falling back to TCP"))
        .filter(|e| {
            [e.spans.get("local"), e.spans.get("peer")].into_iter().flatten().any(|end| names.contains(end))
        })
        .map(|e| (e.spans.get("role").cloned().unwrap_or_default(), e.clone()))
        .collect()
}

/// Accepts one stream, echoes it until EOF, returns its transport.
fn echo_once(listener: lightpath::Listener) -> std::thread::JoinHandle<Transport> {
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; 4096];
        loop {
            let n = stream.read(&mut buf).expect("server read");
            if n == 0 {
                break;
            }
            stream.write_all(&buf[..n]).expect("server write");
        }
        stream.transport()
    })
}

fn echo(mut stream: Stream, data: &[u8]) -> Vec<u8> {
    stream.write_all(data).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut back = Vec::new();
    stream.read_to_end(&mut back).unwrap();
    back
}

fn quick(base: Options) -> Options {
    Options {
        handshake_timeout: Duration::from_millis(2000),
        plain_client_wait: Duration::from_millis(200),
        probe_timeout: Duration::from_millis(500),
        ..base
    }
}

#[test]
fn no_common_provider_is_reported_with_its_reason_on_both_sides() {
    capture();
    let listener = listener(quick(Options::default().with_providers(&[ProviderId::Shm])));
    let addr = listener.local_addr().unwrap();
    let server = echo_once(listener);
    let stream = Stream::connect_with(addr, &quick(soft())).unwrap();
    let client = stream.local_addr().unwrap();
    assert_eq!(stream.transport(), Transport::Tcp(FallbackReason::NoCommonProvider));
    assert_eq!(echo(stream, b"hello"), b"hello");
    assert_eq!(server.join().unwrap(), Transport::Tcp(FallbackReason::NoCommonProvider));

    let events = fallbacks_of(client);
    let client_side: Vec<_> = events.iter().filter(|(role, _)| role == "client").collect();
    let server_side: Vec<_> = events.iter().filter(|(role, _)| role == "server").collect();
    assert_eq!(client_side.len(), 1, "{events:#?}");
    assert_eq!(server_side.len(), 1, "{events:#?}");
    let (_, c) = client_side[0];
    assert_eq!(c.level, tracing::Level::INFO);
    assert_eq!(c.fields["reason"], "NoCommonProvider");
    assert_eq!(c.fields["by_peer"], "true", "the server decided");
    let (_, s) = server_side[0];
    assert_eq!(s.fields["reason"], "NoCommonProvider");
    assert_eq!(s.fields["by_peer"], "false");
}

#[test]
fn a_failed_probe_is_reported_with_its_detail() {
    capture();
    let listener = listener(quick(soft()));
    let addr = listener.local_addr().unwrap();
    let server = echo_once(listener);
    let options = Options { fault_blackhole_rdma: true, ..quick(soft()) };
    let stream = Stream::connect_with(addr, &options).unwrap();
    let client = stream.local_addr().unwrap();
    assert_eq!(stream.transport(), Transport::Tcp(FallbackReason::PathFailed));
    assert_eq!(echo(stream, b"probe"), b"probe");
    assert_eq!(server.join().unwrap(), Transport::Tcp(FallbackReason::PathFailed));

    let events = fallbacks_of(client);
    let (_, c) = events.iter().find(|(role, _)| role == "client").expect("the client's event");
    assert_eq!(c.fields["reason"], "PathFailed");
    assert_eq!(c.fields["by_peer"], "false");
    assert!(!c.fields["detail"].is_empty(), "the probe's error is the detail: {c:?}");
    let (_, s) = events.iter().find(|(role, _)| role == "server").expect("the server's event");
    assert_eq!(s.fields["by_peer"], "true");
    assert_eq!(s.fields["detail"], c.fields["detail"], "the client's detail reached the server");
}

#[test]
fn a_soft_stream_reports_its_queue_pair_and_device_counters() {
    let listener = listener(soft());
    let addr = listener.local_addr().unwrap();
    let server = echo_once(listener);
    let mut stream = Stream::connect_with(addr, &soft()).unwrap();
    assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
    let before = stream.queue_pair_stats().expect("a soft stream has queue-pair counters");
    let data = common::pattern(300_000, 3);
    stream.write_all(&data).unwrap();
    let mut back = vec![0u8; data.len()];
    stream.read_exact(&mut back).unwrap();
    assert_eq!(back, data);
    let after = stream.queue_pair_stats().unwrap();
    assert!(after.tx_bytes >= before.tx_bytes + data.len() as u64, "{before:?} -> {after:?}");
    assert!(after.rx_bytes >= before.rx_bytes + data.len() as u64, "{before:?} -> {after:?}");
    assert!(after.tx_datagrams > before.tx_datagrams && after.rx_datagrams > before.rx_datagrams);
    let devices = lightpath::soft_device_stats();
    assert!(!devices.is_empty());
    let total_tx: u64 = devices.iter().map(|d| d.stats.engine.tx_bytes).sum();
    assert!(total_tx >= 2 * data.len() as u64, "both ends' devices are in this process");
    drop(stream);
    assert_eq!(server.join().unwrap(), Transport::Rdma(ProviderId::Soft));

    let tcp = Stream::connect_with(addr_of_tcp_only(), &Options::tcp_only()).unwrap();
    assert!(tcp.queue_pair_stats().is_none(), "TCP streams have no queue pair");
}

/// A listener that only speaks TCP (for the `None` case above), accepting one stream.
fn addr_of_tcp_only() -> std::net::SocketAddr {
    let listener = listener(Options::tcp_only());
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let _ = listener.accept();
    });
    addr
}
