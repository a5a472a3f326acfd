//! Path MTUs a soft device's link cannot carry are refused at once, with both MTUs named, as
//! Linux rxe refuses a path MTU above its port's active MTU (which it derives from the netdev's
//! MTU): never a queue pair whose full-size datagrams the kernel refuses, ending in "transport
//! retry counter exceeded" after a wait.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;

mod common;

use lightpath_soft::{SoftConfig, SoftDevice};
use lightpath_verbs::{
    AccessFlags, AddressVector, Device, Error, Mtu, ProtectionDomain, QpAttr, QpCaps, QueuePair,
};

/// Moves `device`'s new queue pair to INIT, then asks for RTR at `mtu`.
fn rtr_at(device: &SoftDevice, mtu: Mtu) -> (lightpath_verbs::Result<()>, lightpath_verbs::Result<()>) {
    let pd = device.alloc_pd().expect("pd");
    let cq = device.create_cq(16).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    qp.modify(&QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("INIT");
    let av = AddressVector::new(device.gid(), 0);
    let first = qp.modify(&QpAttr::to_rtr(av, mtu, qp.qpn(), 0));
    // Nothing changed: the same queue pair still goes to RTR at the active MTU.
    let active = device.query_port(1).expect("port").active_mtu;
    let second = qp.modify(&QpAttr::to_rtr(av, active, qp.qpn(), 0));
    (first, second)
}

#[test]
fn a_path_mtu_above_the_configured_one_is_refused_naming_both() {
    let mut config = SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0));
    config.mtu = Mtu::Mtu1024;
    let device = SoftDevice::open(config).expect("open");
    let port = device.query_port(1).expect("port");
    assert_eq!(port.active_mtu, Mtu::Mtu1024);
    assert_eq!(port.max_mtu, Mtu::Mtu4096, "loopback carries 4096-byte payloads");
    let (refused, then) = rtr_at(&device, Mtu::Mtu4096);
    match refused {
        Err(Error::PathMtuTooLarge { requested: 4096, active: 1024, ref why }) => {
            let text = refused.as_ref().unwrap_err().to_string();
            assert!(text.contains("4096") && text.contains("1024"), "{text}");
            assert!(why.contains("opened with MTU 1024"), "{why}");
        }
        other => panic!("expected PathMtuTooLarge, got {other:?}"),
    }
    then.expect("RTR at the active MTU after the refusal");
}

#[test]
fn loopback_devices_go_up_to_4096() {
    let mut config = SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0));
    config.mtu = Mtu::Mtu4096;
    let device = SoftDevice::open(config).expect("open");
    assert_eq!(device.config().mtu, Mtu::Mtu4096);
    let (first, _) = rtr_at(&device, Mtu::Mtu4096);
    first.expect("RTR at 4096 over loopback");
}

/// Runs `f` on a thread of its own in a new network namespace that holds a veth pair with
/// `10.231.0.1/24` on an interface of MTU `mtu`; `None` (with a note) where namespaces or
/// veth cannot be made (not root, no `ip`).
fn in_namespace_with_link<T: Send + 'static>(mtu: u32, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    std::thread::spawn(move || {
        // SAFETY: unshare takes no pointers; CLONE_NEWNET moves only this thread (which owns
        // no sockets yet) into a new network namespace; the thread ends with the test.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            eprintln!("SKIPPED: cannot create a network namespace: {}", std::io::Error::last_os_error());
            return None;
        }
        let ip = |args: &[&str]| Command::new("ip").args(args).status().is_ok_and(|s| s.success());
        let ok = ip(&["link", "add", "lpmtu0", "type", "veth", "peer", "name", "lpmtu1"])
            && ip(&["link", "set", "lpmtu0", "mtu", &mtu.to_string(), "up"])
            && ip(&["link", "set", "lpmtu1", "up"])
            && ip(&["addr", "add", "10.231.0.1/24", "dev", "lpmtu0"]);
        if !ok {
            eprintln!("SKIPPED: cannot set up a veth pair in a network namespace (`ip` missing?)");
            return None;
        }
        Some(f())
    })
    .join()
    .expect("namespace thread")
}

#[test]
fn the_link_mtu_limits_the_active_mtu_and_is_named_when_exceeded() {
    let outcome = in_namespace_with_link(1500, || {
        let mut config = SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 231, 0, 1)), 0));
        config.mtu = Mtu::Mtu4096;
        let device = SoftDevice::open(config).expect("open on the veth address");
        let port = device.query_port(1).expect("port");
        let (refused, then) = rtr_at(&device, Mtu::Mtu2048);
        (port.active_mtu, port.max_mtu, refused.map_err(|err| err.to_string()), then.is_ok())
    });
    let Some((active, max, refused, then_ok)) = outcome else { return };
    assert_eq!((active, max), (Mtu::Mtu1024, Mtu::Mtu1024), "as rxe: 1500-byte Ethernet carries 1024");
    let text = refused.expect_err("2048 does not fit a 1500-byte link");
    for needle in ["2048", "1024", "lpmtu0", "1500"] {
        assert!(text.contains(needle), "{needle:?} missing from {text:?}");
    }
    assert!(then_ok, "RTR at the active MTU after the refusal");

    let jumbo = in_namespace_with_link(9000, || {
        let config = SoftConfig {
            mtu: Mtu::Mtu4096,
            ..SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 231, 0, 1)), 0))
        };
        SoftDevice::open(config).expect("open").query_port(1).expect("port").active_mtu
    });
    if let Some(active) = jumbo {
        assert_eq!(active, Mtu::Mtu4096, "a 9000-byte link carries 4096-byte payloads");
    }
}

/// Two loopback soft devices, each with a queue pair, connected as Lightpath peers at
/// `lightpath_pmtu` (the other side at `peer_pmtu`).
fn lightpath_pair(
    lightpath_pmtu: u32,
) -> (
    lightpath_verbs::conformance::harness::Side<SoftDevice>,
    lightpath_verbs::conformance::harness::Side<SoftDevice>,
) {
    use lightpath_verbs::conformance::harness::{PairOptions, Side};
    let options = PairOptions::default();
    let (a, b) = common::open_pair(lightpath_soft::ProgressMode::Thread);
    let (a, b) = (Side::new(a, &options), Side::new(b, &options));
    for (side, peer, send_psn, recv_psn) in
        [(&a, &b, options.a_psn, options.b_psn), (&b, &a, options.b_psn, options.a_psn)]
    {
        side.qp.modify(&QpAttr::to_init(options.qp_access)).expect("INIT");
        let peer_end = peer.qp.endpoint();
        let av = AddressVector { lightpath_peer: true, ..AddressVector::new(peer_end.gid, 0) };
        let rtr = QpAttr {
            lightpath_pmtu: Some(lightpath_pmtu),
            ..QpAttr::to_rtr(av, Mtu::Mtu1024, peer_end.qpn, recv_psn)
        };
        side.qp.modify(&rtr).expect("RTR at the Lightpath MTU");
        side.qp.modify(&QpAttr::to_rts(send_psn)).expect("RTS");
    }
    (a, b)
}

#[test]
fn lightpath_peers_on_loopback_move_a_megabyte_in_32_kib_datagrams() {
    use lightpath_verbs::conformance::harness::{pattern, read_region, MR_ALL};
    use lightpath_verbs::{MemoryRegion, SendOp, SendWr, WcOpcode, WcStatus, MAX_LIGHTPATH_PMTU};
    let (a, b) = lightpath_pair(MAX_LIGHTPATH_PMTU);
    assert_eq!(a.device.max_lightpath_pmtu(), MAX_LIGHTPATH_PMTU, "loopback carries 32 KiB payloads");
    let len = 1 << 20;
    let src = a.alloc(len, MR_ALL);
    src.write(0, &pattern(len, 5)).expect("fill");
    let dst = b.alloc(len, MR_ALL);
    let before = a.device.stats().engine.tx_datagrams;
    let sge = [src.sge(0, len as u32)];
    let op = SendOp::Write { remote_addr: dst.addr(), rkey: dst.rkey() };
    a.qp.post_send(&SendWr::new(7, op, &sge)).expect("post");
    let wc = a.wait_one();
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (7, WcStatus::Success, WcOpcode::RdmaWrite));
    assert_eq!(read_region(&dst, 0, len), pattern(len, 5));
    let sent = a.device.stats().engine.tx_datagrams - before;
    // 32 datagrams of 32 KiB, a few more only if some had to be sent again.
    let retransmits = a.device.stats().engine.retransmits;
    assert!(sent >= 32 && sent <= 32 + retransmits, "{sent} datagrams, {retransmits} retransmitted");
}

#[test]
fn a_lightpath_mtu_the_link_cannot_carry_is_refused_naming_both() {
    let outcome = in_namespace_with_link(1500, || {
        let config = SoftConfig {
            mtu: Mtu::Mtu4096,
            ..SoftConfig::with_addr(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 231, 0, 1)), 0))
        };
        let device = SoftDevice::open(config).expect("open on the veth address");
        let pd = device.alloc_pd().expect("pd");
        let cq = device.create_cq(16).expect("cq");
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
        qp.modify(&QpAttr::to_init(AccessFlags::LOCAL_WRITE)).expect("INIT");
        let av = AddressVector { lightpath_peer: true, ..AddressVector::new(device.gid(), 0) };
        let rtr =
            |bytes| QpAttr { lightpath_pmtu: Some(bytes), ..QpAttr::to_rtr(av, Mtu::Mtu1024, qp.qpn(), 0) };
        let refused = qp.modify(&rtr(2048)).map_err(|err| {
            (err.to_string(), matches!(err, Error::PathMtuTooLarge { requested: 2048, active: 1408, .. }))
        });
        let fits = qp.modify(&rtr(1408));
        (device.max_lightpath_pmtu(), refused, fits.is_ok())
    });
    let Some((max, refused, fits)) = outcome else { return };
    assert_eq!(max, 1408, "1500 - 72 bytes of headers, down to 64");
    let (text, right_kind) = refused.expect_err("2048 does not fit a 1500-byte link");
    assert!(right_kind, "{text}");
    for needle in ["2048", "1408", "lpmtu0", "1500"] {
        assert!(text.contains(needle), "{needle:?} missing from {text:?}");
    }
    assert!(fits, "RTR at 1408 after the refusal");
}
