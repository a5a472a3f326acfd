//! Path MTUs a soft device's link cannot carry are refused at once, with both MTUs named, as
//! Linux rxe refuses a path MTU above its port's active MTU (which it derives from the netdev's
//! MTU): never a queue pair whose full-size datagrams the kernel refuses, ending in "transport
//! retry counter exceeded" after a wait.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;

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
