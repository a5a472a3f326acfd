//! Knobs of a connection or listener, with defaults that suit most programs.

use std::net::IpAddr;
use std::time::Duration;

use lightpath_soft::ProgressMode;
use lightpath_stream::negotiate::ProviderId;

/// How a connection is set up and sized. `Options::default()` offers shm (chosen only between
/// processes of one host and network namespace), then ibverbs (chosen when an RDMA device has
/// a RoCE v2 GID for the connection's local address), then soft; the environment variable
/// `LIGHTPATH_PROVIDERS` overrides that list (comma-separated, best first, such as `shm,soft`
/// or `soft`; `tcp` alone turns RDMA off).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// RDMA providers to offer or accept, best first; empty means TCP only.
    pub providers: Vec<ProviderId>,
    /// Bytes in this side's receive ring (the peer's staging mirrors it). Bounded memory per
    /// connection is about twice this (ring plus staging for the other direction). Over shm
    /// the writer copies straight into the peer's ring and nobody keeps a staging mirror, so
    /// the ring is twice this instead: the same memory. Over soft, `soft_ring_size` applies.
    pub ring_size: u32,
    /// `ring_size` for connections over the soft provider (default 1 MiB, against 256 KiB
    /// elsewhere). A soft writer's credit comes back a network round trip plus the peer's
    /// processing after its bytes left, and a 256 KiB ring ran dry waiting for it: one
    /// stream of 1 MiB writes moved 1.9 GB/s over loopback and 0.9 between two network
    /// namespaces with 256 KiB, 2.8-3.0 and 1.2 with 1 MiB (and less CPU per byte), while
    /// 4 MiB was no faster. Memory is touched as it is used, so an idle connection does not
    /// hold it. [`Options::with_ring_size`] sets both.
    pub soft_ring_size: u32,
    /// Whether a connection over the soft provider receives on a UDP port of its own
    /// (`lightpath_soft::SoftConfig::max_qp_ports` of them per device, 64 by default; the
    /// peer is told to send there), so the kernel wakes whoever waits for it directly.
    /// `None` (the default) and `Some(true)`: yes, except towards hardware (an ibverbs peer,
    /// which always sends to the RoCE v2 port) and past the device's limit; `Some(false)`:
    /// every connection shares the device's socket.
    ///
    /// An event loop then wakes once per message instead of twice (the device's progress
    /// thread, then the loop): 1-connection request/response with event loops on both sides
    /// went from 5.7-6.6k to 8.3-13.9k requests/s. A thread blocked on its own connection
    /// polls its port for [`Options::soft_wait_spin`] before it sleeps, as a thread watching
    /// the shared socket does; with that, a server with a thread per connection and ports
    /// against the shared socket, 3 alternated rounds over loopback (`lightpath perf
    /// stream_rr -s 64`): 16 connections 54-63k against 42-49k requests/s, 100 connections
    /// 46-60k against 42-54k, 1 connection 35-41k against 30-40k; between two network
    /// namespaces, 2 rounds: 56-60k against 40-43k, 40-43k against 35-43k, 31-37k against
    /// 28-39k. (Without the spin, ports had cost 16 such connections a third.) The
    /// environment variable `LIGHTPATH_SOFT_QP_PORT=1` or `=0` sets it for every stream of
    /// the process.
    pub soft_qp_port: Option<bool>,
    /// Receive requests kept posted.
    pub recv_depth: u32,
    /// Send queue depth.
    pub send_depth: u32,
    /// How long a client waits for the server's negotiation answers.
    pub handshake_timeout: Duration,
    /// How long a listener waits for a new client's first byte before treating it as a plain
    /// TCP client (one that waits for the server to speak first).
    pub plain_client_wait: Duration,
    /// How long a client waits for its RDMA probe to complete before falling back to TCP.
    pub probe_timeout: Duration,
    /// How long dropping a stream may wait for its last writes to be acknowledged.
    pub linger: Duration,
    /// How long a blocked read or write busy-polls before it sleeps. With the soft
    /// provider's progress thread (the default) spinning only helps when a core is free for
    /// that thread, so the default is not to spin; with `ProgressMode::Polling` the calling
    /// thread drives the device itself and a spin of tens of µs (or more) pays off. Streams
    /// that fell back to TCP spin on their socket before a blocking read sleeps, likewise.
    pub spin: Duration,
    /// Progress mode of the soft device the first connection opens.
    pub soft_progress: ProgressMode,
    /// With the soft device's progress thread (the default), how long a thread blocked on
    /// the device busy-polls its socket before it sleeps, while that pays (see
    /// `lightpath_soft::SoftConfig::wait_spin`: spinning stops by itself on idle connections
    /// or when the peer cannot get a core). Default 50 µs; the environment variable
    /// `LIGHTPATH_SOFT_SPIN_US` sets it (0 turns spinning off). Taken by the device the first
    /// connection opens.
    pub soft_wait_spin: Duration,
    /// Over shm, how long a thread blocked on its connection (with other connections on the
    /// device, which wait on their doorbells) looks for news, yielding the core between
    /// looks, before it arms its doorbell and sleeps, while that pays (spinning stops by
    /// itself on idle connections, as the soft wait's does). An answer that comes within it
    /// costs neither side a wake-up. Default 20 µs; the environment variable
    /// `LIGHTPATH_SHM_SPIN_US` sets it (0 turns spinning off). See docs/shm-scaling.md,
    /// "Spinning doorbell waiters".
    pub shm_wait_spin: Duration,
    /// For connections of an event loop ([`Options::event_loop`]): how long a task of each
    /// runtime keeps looking for their news, while the runtime has nothing else to do,
    /// before it lets the runtime park (spinning stops by itself when the runtime is busy,
    /// and after spins that found nothing). Over shm the task that dispatches the device's
    /// task doorbell looks after each wake-up, with the peers' rings held; over soft a
    /// spinner per device looks at the ports of its connections' queue pairs after one of
    /// them went to wait, while the device serves at most two such connections. An answer
    /// within it costs neither side a wake-up: hyper with one connection went from 16 k to
    /// 65 k requests per second over shm (2026-12-07) and from 13 k to 25 k over soft
    /// (2026-12-08). Taken by the first connection that starts the runtime's dispatcher or
    /// spinner. Default 50 µs; the environment variable `LIGHTPATH_EVENT_LOOP_SPIN_US` sets
    /// it (0 turns spinning off). See docs/shm-scaling.md, "An event loop's dispatcher spins
    /// before its runtime parks" and "A soft event loop spins too".
    pub event_loop_spin: Duration,
    /// The connections are driven by an event loop's tasks (set by `lightpath::tokio`'s
    /// `connect_with` and `Listener`): where the provider can (shm), a connection's queue pair
    /// wakes its task through the device's task doorbell, one descriptor per device, rather
    /// than through an eventfd of its own that the peer holds a copy of (two descriptors per
    /// connection; issue 15). A blocking call on such a connection still works (its thread
    /// watches the task doorbell itself), and so does `Stream::readiness_fd` (it holds the
    /// doorbell too), but a blocked thread or readiness fd is woken by every ring of that
    /// doorbell, for any connection of the device, and `Stream::event_fds` does not cover
    /// it: leave it off for blocking streams. Default off.
    pub event_loop: bool,
    /// UDP port the soft device takes if it is free (default 4791, where hardware and rxe
    /// peers send); otherwise it takes a port the kernel picks, which Lightpath peers learn
    /// in the negotiation.
    pub soft_udp_port: u16,
    /// Start with corking off (see [`crate::Stream::set_nodelay`]).
    pub nodelay: bool,
    /// Zero-copy writes (`Stream::write_buf`, `Stream::send_msg_buf`) of at least this many
    /// bytes go by rendezvous: the peer fetches them with RDMA READ straight from the
    /// registered buffer (into its own registered buffer when it reads with `read_buf`)
    /// instead of through its receive ring, which smaller ones are copied into. `None` (the
    /// default) picks the provider's crossover, where the two cost the same (measured on
    /// loopback, see `docs/stream-protocol.md`): [`Options::rendezvous_min_for`].
    /// `Some(usize::MAX)` turns rendezvous off.
    pub rendezvous_min: Option<usize>,
    /// Whether this connection's queue pair reports to a completion queue its device shares
    /// with other connections (`Some(true)`; see `docs/architecture.md`), to one of its own
    /// (`Some(false)`), or what pays with its provider (`None`, the default): shared over soft
    /// and ibverbs, where one thread watching the device's socket or channel for every blocked
    /// connection saves a wake-up per message; its own over shm, whose peer rings the waiting
    /// connection's doorbell directly, so a shared queue only adds a router between them
    /// (`stream_rr` 64 B, a thread per connection: 2x the requests/s at 16 connections). The
    /// environment variable `LIGHTPATH_SHARED_CQ=1` or `=0` sets the default for every provider.
    pub shared_completion_queues: Option<bool>,
    /// Test hook: rendezvous descriptors this side sends lie about the buffer.
    #[doc(hidden)]
    pub fault_rendezvous: Option<RendezvousLie>,
    /// Test hook: advertise an RDMA address nothing listens on, as a firewall that drops UDP
    /// would make it.
    #[doc(hidden)]
    pub fault_blackhole_rdma: bool,
    /// Test hook: offer this protocol version range instead of the real one.
    #[doc(hidden)]
    pub fault_versions: Option<(u8, u8)>,
    /// Test hook: a client that claims to run on another host (so shm is never chosen).
    #[doc(hidden)]
    pub fault_other_host: bool,
}

/// How a test peer's rendezvous descriptors lie (the receiver must refuse them cleanly).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RendezvousLie {
    /// A remote key that names no region of the sender.
    Key,
    /// One page more than the registered buffer holds.
    PastTheEnd,
    /// A length no buffer has (2^60 bytes).
    Huge,
}

/// Which peers on other hosts to accept, as the preload library's `LIGHTPATH_PRELOAD_PEERS`
/// and `lightpath run --peers` spell it: comma-separated addresses and CIDR prefixes
/// (`10.77.0.0/24`, `fd00::/8`, `192.168.1.7`), or `all`. IPv4-mapped IPv6 addresses count
/// as IPv4.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerRule {
    all: bool,
    prefixes: Vec<(IpAddr, u8)>,
}

impl PeerRule {
    /// Parses the rule's text; returns the rule and the entries it could not read.
    pub fn parse(text: &str) -> (PeerRule, Vec<String>) {
        let mut rule = PeerRule::default();
        let mut bad = Vec::new();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if entry == "all" || entry == "*" {
                rule.all = true;
                continue;
            }
            let (address, bits) = match entry.split_once('/') {
                Some((address, bits)) => (address, Some(bits)),
                None => (entry, None),
            };
            let Ok(ip) = address.parse::<IpAddr>() else {
                bad.push(entry.to_string());
                continue;
            };
            let ip = ip.to_canonical();
            let max = if ip.is_ipv4() { 32 } else { 128 };
            match bits.map(str::parse::<u8>) {
                None => rule.prefixes.push((ip, max)),
                Some(Ok(bits)) if bits <= max => rule.prefixes.push((ip, bits)),
                Some(_) => bad.push(entry.to_string()),
            }
        }
        (rule, bad)
    }

    /// Whether `ip` is named.
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.all || self.prefixes.iter().any(|&(prefix, bits)| same_prefix(prefix, ip, bits))
    }

    /// Whether the rule names no peer at all.
    pub fn is_empty(&self) -> bool {
        !self.all && self.prefixes.is_empty()
    }
}

/// [`Options::shm_wait_spin`]'s default: 20 µs, or `LIGHTPATH_SHM_SPIN_US` µs when that
/// environment variable holds a number (0 turns spinning off).
pub fn default_shm_wait_spin() -> Duration {
    std::env::var("LIGHTPATH_SHM_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or(Duration::from_micros(20), Duration::from_micros)
}

/// [`Options::event_loop_spin`]'s default: 50 µs, or `LIGHTPATH_EVENT_LOOP_SPIN_US` µs when
/// that environment variable holds a number (0 turns spinning off).
pub fn default_event_loop_spin() -> Duration {
    std::env::var("LIGHTPATH_EVENT_LOOP_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or(Duration::from_micros(50), Duration::from_micros)
}

fn same_prefix(a: IpAddr, b: IpAddr, bits: u8) -> bool {
    let (a, b, width) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(b)), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let shift = width - u32::from(bits);
    shift >= width || (a >> shift) == (b >> shift)
}

/// Parses a provider list as `LIGHTPATH_PROVIDERS` spells it.
pub fn parse_providers(text: &str) -> Result<Vec<ProviderId>, String> {
    let mut providers = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "soft" => providers.push(ProviderId::Soft),
            "ibverbs" => providers.push(ProviderId::Ibverbs),
            "shm" => providers.push(ProviderId::Shm),
            "tcp" | "none" => {}
            other => return Err(format!("unknown provider {other:?} (soft, ibverbs, shm, tcp)")),
        }
    }
    Ok(providers)
}

impl Default for Options {
    fn default() -> Self {
        let providers = std::env::var("LIGHTPATH_PROVIDERS")
            .ok()
            .and_then(|text| parse_providers(&text).ok())
            .unwrap_or_else(|| vec![ProviderId::Shm, ProviderId::Ibverbs, ProviderId::Soft]);
        Self {
            providers,
            ring_size: 256 << 10,
            soft_ring_size: 1 << 20,
            soft_qp_port: std::env::var("LIGHTPATH_SOFT_QP_PORT").ok().map(|v| v != "0"),
            recv_depth: 64,
            send_depth: 64,
            handshake_timeout: Duration::from_secs(5),
            plain_client_wait: Duration::from_secs(2),
            probe_timeout: Duration::from_secs(3),
            linger: Duration::from_secs(10),
            spin: Duration::ZERO,
            soft_progress: ProgressMode::Thread,
            soft_wait_spin: lightpath_soft::config::default_wait_spin(),
            shm_wait_spin: default_shm_wait_spin(),
            event_loop_spin: default_event_loop_spin(),
            event_loop: false,
            soft_udp_port: lightpath_soft::ROCE_PORT,
            nodelay: true,
            rendezvous_min: None,
            shared_completion_queues: std::env::var("LIGHTPATH_SHARED_CQ").ok().map(|v| v != "0"),
            fault_rendezvous: None,
            fault_blackhole_rdma: false,
            fault_versions: None,
            fault_other_host: false,
        }
    }
}

impl Options {
    /// TCP only: no RDMA provider is offered or accepted.
    pub fn tcp_only() -> Self {
        Self { providers: Vec::new(), ..Self::default() }
    }

    /// The given providers, best first.
    pub fn with_providers(mut self, providers: &[ProviderId]) -> Self {
        self.providers = providers.to_vec();
        self
    }

    /// Zero-copy writes of at least `bytes` go by rendezvous (see
    /// [`Options::rendezvous_min`]; at least 1).
    pub fn with_rendezvous_min(mut self, bytes: usize) -> Self {
        self.rendezvous_min = Some(bytes.max(1));
        self
    }

    /// The rendezvous threshold a connection over `provider` uses: the configured one, else
    /// the provider's crossover. Soft: 256 KiB (a round trip costs tens of µs, as much as
    /// copying a quarter MiB twice). Shm: 16 KiB (a round trip is a few µs). Ibverbs: 64 KiB,
    /// not measured here (no RDMA hardware); RNICs' round trips are a few µs.
    pub fn rendezvous_min_for(&self, provider: ProviderId) -> usize {
        self.rendezvous_min.unwrap_or(match provider {
            ProviderId::Soft => 256 << 10,
            ProviderId::Shm => 16 << 10,
            ProviderId::Ibverbs => 64 << 10,
        })
    }

    /// A receive ring of `bytes` (at least 4 KiB; rounded to 64 bytes), over every provider
    /// (`ring_size` and `soft_ring_size`).
    pub fn with_ring_size(mut self, bytes: u32) -> Self {
        self.ring_size = bytes.max(4096) & !63;
        self.soft_ring_size = self.ring_size;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_names_addresses_and_prefixes() {
        let (rule, bad) = PeerRule::parse(" 10.77.0.0/24, 192.168.1.7 ,fd00::/8, bogus, 10.0.0.0/33");
        assert_eq!(bad, ["bogus", "10.0.0.0/33"]);
        assert!(rule.allows("10.77.0.200".parse().unwrap()));
        assert!(!rule.allows("10.77.1.1".parse().unwrap()));
        assert!(rule.allows("192.168.1.7".parse().unwrap()));
        assert!(!rule.allows("192.168.1.8".parse().unwrap()));
        assert!(rule.allows("fd12::1".parse().unwrap()));
        assert!(rule.allows("::ffff:10.77.0.3".parse().unwrap()), "IPv4-mapped counts as IPv4");
        assert!(!rule.allows("fe80::1".parse().unwrap()));
        let (none, _) = PeerRule::parse("");
        assert!(none.is_empty() && !none.allows("10.77.0.1".parse().unwrap()));
        let (all, _) = PeerRule::parse("all");
        assert!(all.allows("8.8.8.8".parse().unwrap()) && all.allows("::1".parse().unwrap()));
        let (zero, _) = PeerRule::parse("0.0.0.0/0");
        assert!(zero.allows("1.2.3.4".parse().unwrap()) && !zero.allows("::2".parse().unwrap()));
    }

    #[test]
    fn provider_lists() {
        assert_eq!(parse_providers("soft"), Ok(vec![ProviderId::Soft]));
        assert_eq!(parse_providers("shm, soft"), Ok(vec![ProviderId::Shm, ProviderId::Soft]));
        assert_eq!(parse_providers("tcp"), Ok(vec![]));
        assert!(parse_providers("rxe").is_err());
        assert_eq!(Options::default().with_ring_size(100).ring_size, 4096);
        let options = Options::default().with_ring_size(100_000);
        assert_eq!((options.ring_size, options.soft_ring_size), (99_968, 99_968));
        assert!(Options::default().soft_ring_size > Options::default().ring_size);
    }
}
