//! Hostile and broken network input: garbage, truncated, oversized and wrong-ICRC datagrams,
//! datagrams for queue pairs that do not exist or from the wrong peer, and a peer that
//! disappears in the middle of a transfer. Each must end in a counted drop or an error
//! completion, never a panic or a hang.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use lightpath_soft::{ProgressMode, SoftDevice, SoftStats};
use lightpath_verbs::conformance::harness::{connect, pattern, wait_n, PairOptions, Side, MR_ALL};
use lightpath_verbs::{
    AccessFlags, MemoryRegion, Mtu, QpState, QueuePair, SendOp, SendWr, WcOpcode, WcStatus,
};
use lightpath_wire::icrc;
use lightpath_wire::transport::TransportHeader;
use lightpath_wire::{BthRepr, Endpoints, Opcode, Psn};

const DEADLINE: Duration = Duration::from_secs(30);

/// Two connected sides on fresh loopback addresses.
fn connected(options: &PairOptions) -> (Side<SoftDevice>, Side<SoftDevice>) {
    let (a, b) = common::open_pair(ProgressMode::Thread);
    let mtu = lightpath_verbs::conformance::harness::common_mtu(&a, &b);
    let (a, b) = (Side::new(a, options), Side::new(b, options));
    connect(&a.qp, &b.qp, mtu, options);
    (a, b)
}

/// A SEND_ONLY datagram to `dest_qpn` with a correct ICRC for the given endpoints.
fn sealed_send(endpoints: &Endpoints, dest_qpn: u32, psn: u32, payload: &[u8]) -> Vec<u8> {
    let mut bth = BthRepr::new(Opcode::RC_SEND_ONLY, dest_qpn, Psn::new(psn));
    bth.ack_req = true;
    let header = TransportHeader::new(bth);
    let mut buf = vec![0u8; 64 + payload.len()];
    let header_len = header.emit(payload.len(), &mut buf).expect("emit header");
    buf[header_len..header_len + payload.len()].copy_from_slice(payload);
    let len = header.datagram_len(payload.len());
    buf.truncate(len);
    icrc::seal(endpoints, &mut buf).expect("seal");
    buf
}

/// Waits until `done` holds for the device's counters.
fn wait_for_stats(device: &SoftDevice, what: &str, done: impl Fn(&SoftStats) -> bool) -> SoftStats {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let stats = device.stats();
        if done(&stats) {
            return stats;
        }
        assert!(Instant::now() < deadline, "{what}: counters never got there: {stats:#?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A tiny deterministic generator for garbage (xorshift64*).
struct Garbage(u64);

impl Garbage {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

#[test]
fn hostile_datagrams_are_counted_and_dropped() {
    let options = PairOptions::default();
    let (a, b) = connected(&options);
    let a_addr = a.device.local_addr();
    let b_ip = b.device.local_addr().ip();
    // Datagrams that appear to come from B's address (B's IP, another port), and from a
    // stranger's address.
    let spoofer = UdpSocket::bind(SocketAddr::new(b_ip, 0)).expect("bind spoofer");
    let stranger = UdpSocket::bind(SocketAddr::new(common::fresh_addr().ip(), 0)).expect("bind stranger");
    let from_b = Endpoints {
        src: b_ip,
        dst: a_addr.ip(),
        src_port: spoofer.local_addr().expect("addr").port(),
        dst_port: a_addr.port(),
    };
    let a_qpn = a.qp.qpn();
    let before = a.device.stats();

    // Structurally broken.
    for datagram in [Vec::new(), vec![0x04], vec![0u8; 11], vec![0xFF; 15]] {
        spoofer.send_to(&datagram, a_addr).expect("send");
    }
    let mut truncated = sealed_send(&from_b, a_qpn, options.b_psn, b"hello");
    truncated.truncate(9);
    spoofer.send_to(&truncated, a_addr).expect("send");
    // Longer than any RoCE packet can be (even at the Lightpath MTU extension's 32 KiB).
    spoofer.send_to(&vec![0x04; lightpath_roce::MAX_DATAGRAM + 1000], a_addr).expect("send");
    // Well formed, correctly sealed, for a queue pair that does not exist.
    let unknown = sealed_send(&from_b, a_qpn ^ 0x5A5A, options.b_psn, b"hello");
    spoofer.send_to(&unknown, a_addr).expect("send");
    // For A's queue pair with the expected PSN, but one payload bit flipped after sealing.
    let mut corrupted = sealed_send(&from_b, a_qpn, options.b_psn, b"a perfectly good payload");
    corrupted[14] ^= 0x01;
    spoofer.send_to(&corrupted, a_addr).expect("send");
    // Correctly sealed for A's queue pair, but from an address that is not A's peer.
    let from_stranger = Endpoints {
        src: stranger.local_addr().expect("addr").ip(),
        src_port: stranger.local_addr().expect("addr").port(),
        ..from_b
    };
    stranger.send_to(&sealed_send(&from_stranger, a_qpn, options.b_psn, b"intruder"), a_addr).expect("send");
    // And a spray of random garbage of random lengths.
    let mut garbage = Garbage(0x9E37_79B9_7F4A_7C15);
    for _ in 0..200 {
        let len = (garbage.next() % 200) as usize;
        spoofer.send_to(&garbage.bytes(len), a_addr).expect("send");
    }
    let sent = 4 + 1 + 1 + 1 + 1 + 1 + 200;

    let after = wait_for_stats(&a.device, "drops", |s| s.total_drops() - before.total_drops() >= sent);
    assert_eq!(after.total_drops() - before.total_drops(), sent, "{after:#?}");
    let e = &after.engine;
    let unparsable = (e.drops_malformed + e.drops_unsupported)
        - (before.engine.drops_malformed + before.engine.drops_unsupported);
    assert_eq!(unparsable, 4 + 1 + 200, "{after:#?}");
    assert_eq!(e.drops_unknown_qp - before.engine.drops_unknown_qp, 1, "{after:#?}");
    assert_eq!(e.drops_icrc - before.engine.drops_icrc, 1, "{after:#?}");
    assert_eq!(e.drops_wrong_peer - before.engine.drops_wrong_peer, 1, "{after:#?}");
    assert_eq!(after.driver.drops_oversized - before.driver.drops_oversized, 1, "{after:#?}");

    // Nothing reached the application, and the connection still works.
    let mut buf = [lightpath_verbs::WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4];
    assert_eq!(lightpath_verbs::CompletionQueue::poll(&a.cq, &mut buf).expect("poll"), 0);
    assert_eq!(a.qp.state().expect("state"), QpState::Rts);
    let src = b.alloc(64, AccessFlags::LOCAL_WRITE);
    let dst = a.alloc(64, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(64, 3)).expect("fill");
    a.post_recv(1, &dst, 0, 64);
    b.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 64)])).expect("post_send");
    let got = wait_n(&a.cq, 1)[0];
    assert_eq!((got.wr_id, got.status, got.byte_len), (1, WcStatus::Success, 64), "{got:?}");
    let mut data = vec![0u8; 64];
    dst.read(0, &mut data).expect("read");
    assert_eq!(data, pattern(64, 3));
}

#[test]
fn vanished_peer_ends_in_retry_exceeded() {
    // ACK timeout 4.096 µs × 2^10 ≈ 4 ms, two retries: the budget is a few tens of ms.
    let options = PairOptions { timeout: 10, retry_cnt: 2, ..PairOptions::default() };
    let (a, b) = connected(&options);
    const WRITES: u64 = 32;
    const LEN: usize = 1 << 20;
    let src = a.alloc(LEN, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(LEN, 1)).expect("fill");
    let target = b.alloc(LEN, MR_ALL);
    let remote = target.remote();
    for wr_id in 0..WRITES {
        let op = SendOp::Write { remote_addr: remote.addr, rkey: remote.rkey };
        a.qp.post_send(&SendWr::new(wr_id, op, &[src.sge(0, LEN as u32)])).expect("post write");
    }
    // Let the transfer get going, then make B vanish: its socket closes and nothing answers.
    let deadline = Instant::now() + DEADLINE;
    while target.read_u64(0).expect("read") == 0 {
        assert!(Instant::now() < deadline, "the transfer never started");
        std::thread::yield_now();
    }
    // The queue pair goes first, so B never answers again (a deregistered region would make
    // it NAK instead of staying silent).
    drop(b);
    drop(target);

    let completions = wait_n(&a.cq, WRITES as usize);
    let successes = completions.iter().take_while(|wc| wc.status == WcStatus::Success).count();
    assert!(successes < WRITES as usize, "every write completed although the peer vanished");
    assert_eq!(completions[successes].status, WcStatus::RetryExcErr, "{:?}", completions[successes]);
    for wc in &completions[successes + 1..] {
        assert_eq!(wc.status, WcStatus::WrFlushErr, "{wc:?}");
    }
    for (i, wc) in completions.iter().enumerate() {
        assert_eq!(wc.wr_id, i as u64, "completions out of order: {completions:?}");
    }
    assert_eq!(a.qp.state().expect("state"), QpState::Err);
    let stats = a.device.stats();
    assert!(stats.engine.timeouts >= u64::from(options.retry_cnt), "{stats:#?}");
}

#[test]
fn unroutable_peer_fails_cleanly() {
    // From a loopback address the kernel cannot send to a documentation-range address at all:
    // the datagrams are counted as transmit errors and the request ends in RetryExcErr.
    let options = PairOptions { timeout: 8, retry_cnt: 1, ..PairOptions::default() };
    let device = common::open_device(|_| {});
    let side = Side::new(device, &options);
    let peer = lightpath_verbs::QpEndpoint {
        gid: lightpath_verbs::Gid::from_ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))),
        gid_index: 0,
        qpn: 0x123,
    };
    lightpath_verbs::conformance::harness::bring_up(&side.qp, peer, Mtu::Mtu1024, 1, 1, &options);
    let mr = side.alloc(64, AccessFlags::LOCAL_WRITE);
    side.qp.post_send(&SendWr::new(5, SendOp::Send, &[mr.sge(0, 8)])).expect("post_send");
    let wc = wait_n(&side.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::RetryExcErr), "{wc:?}");
    let stats = side.device.stats();
    assert!(stats.driver.tx_errors >= 1, "{stats:#?}");
}
