//! Two soft devices on one IP address (as two processes on one host would have), each on its
//! own UDP port, with queue pairs that name each other's port in the address vector
//! (`udp_dport`): SEND/RECV, RDMA WRITE with immediate and RDMA READ both ways.

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};

use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::conformance::harness::{pattern, read_region, wait_n, PairOptions, Side, MR_ALL};
use lightpath_verbs::{
    AccessFlags, AddressVector, Device, MemoryRegion, Mtu, QpAttr, QueuePair, RecvWr, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const REGION: usize = 16 << 10;

/// A device on 127.0.0.1 at a port the kernel picks.
fn open_on_free_port(mode: ProgressMode) -> SoftDevice {
    let mut config = SoftConfig::with_addr(SocketAddr::new(LOCALHOST, 0));
    config.mode = mode;
    SoftDevice::open(config).expect("open a soft device on 127.0.0.1:0")
}

/// Brings `side`'s queue pair to RTS towards `peer`, whose device listens on `peer_port`.
fn bring_up(side: &Side<SoftDevice>, peer: &Side<SoftDevice>, peer_port: u16, psns: (u32, u32)) {
    side.qp
        .modify(&QpAttr::to_init(
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        ))
        .expect("INIT");
    let endpoint = peer.qp.endpoint();
    let av = AddressVector { udp_dport: peer_port, ..AddressVector::new(endpoint.gid, 0) };
    side.qp.modify(&QpAttr::to_rtr(av, Mtu::Mtu1024, endpoint.qpn, psns.1)).expect("RTR");
    side.qp.modify(&QpAttr::to_rts(psns.0)).expect("RTS");
}

fn by_wr_id(mut wcs: Vec<WorkCompletion>) -> Vec<WorkCompletion> {
    wcs.sort_by_key(|wc| wc.wr_id);
    wcs
}

/// `from` SENDs, WRITEs with immediate and READs to and from `to`, and every byte is checked.
fn exercise(from: &Side<SoftDevice>, to: &Side<SoftDevice>, seed: u8) {
    let (src, dst) = (from.alloc(REGION, MR_ALL), to.alloc(REGION, MR_ALL));
    src.write(0, &pattern(6000, seed)).expect("fill the source");
    dst.write(8192, &pattern(5000, seed.wrapping_add(1))).expect("fill what is read");
    let remote = dst.remote();
    // Two receives: one for the SEND (into dst at 0), one consumed by the WRITE's immediate.
    to.qp.post_recv(&RecvWr::new(100, &[dst.sge(0, 4096)])).expect("post_recv");
    to.qp.post_recv(&RecvWr::new(101, &[dst.sge(0, 4096)])).expect("post_recv");

    from.qp.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 3000)])).expect("SEND");
    let write = SendOp::WriteWithImm { remote_addr: remote.addr + 4096, rkey: remote.rkey, imm: 0x1234_5678 };
    from.qp.post_send(&SendWr::new(2, write, &[src.sge(0, 4000)])).expect("WRITE with immediate");
    let read = SendOp::Read { remote_addr: remote.addr + 8192, rkey: remote.rkey };
    from.qp.post_send(&SendWr::new(3, read, &[src.sge(8192, 5000)])).expect("READ");

    let sent = by_wr_id(wait_n(&from.cq, 3));
    let ops: Vec<_> = sent.iter().map(|wc| (wc.wr_id, wc.status, wc.opcode)).collect();
    let ok = WcStatus::Success;
    assert_eq!(ops, [(1, ok, WcOpcode::Send), (2, ok, WcOpcode::RdmaWrite), (3, ok, WcOpcode::RdmaRead)]);
    let received = by_wr_id(wait_n(&to.cq, 2));
    let ops: Vec<_> =
        received.iter().map(|wc| (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data)).collect();
    assert_eq!(
        ops,
        [
            (100, ok, WcOpcode::Recv, 3000, None),
            (101, ok, WcOpcode::RecvRdmaWithImm, 4000, Some(0x1234_5678))
        ]
    );
    assert_eq!(read_region(&dst, 0, 3000), pattern(3000, seed), "the SEND");
    assert_eq!(read_region(&dst, 4096, 4000), pattern(4000, seed), "the WRITE");
    assert_eq!(read_region(&src, 8192, 5000), pattern(5000, seed.wrapping_add(1)), "the READ");
}

fn shared_address_traffic(mode: ProgressMode) {
    let (dev_a, dev_b) = (open_on_free_port(mode), open_on_free_port(mode));
    let (port_a, port_b) = (dev_a.local_addr().port(), dev_b.local_addr().port());
    assert_ne!(port_a, port_b);
    assert_eq!(dev_a.gid(), dev_b.gid(), "one address, two devices");
    let a = Side::new(dev_a, &PairOptions::default());
    let b = Side::new(dev_b, &PairOptions::default());
    bring_up(&a, &b, port_b, (10, 20));
    bring_up(&b, &a, port_a, (20, 10));
    exercise(&a, &b, 1);
    exercise(&b, &a, 7);
    for side in [&a, &b] {
        let stats = side.device.stats();
        assert_eq!(stats.engine.drops_icrc, 0, "{stats:?}");
        assert_eq!(stats.engine.drops_unknown_qp, 0, "{stats:?}");
    }
}

#[test]
fn devices_on_one_address_and_different_ports_talk_thread_mode() {
    shared_address_traffic(ProgressMode::Thread);
}

#[test]
fn devices_on_one_address_and_different_ports_talk_polling_mode() {
    shared_address_traffic(ProgressMode::polling());
}

#[test]
fn a_device_on_port_zero_reports_the_port_it_holds() {
    let device = open_on_free_port(ProgressMode::Thread);
    let local = device.local_addr();
    assert_eq!(local.ip(), LOCALHOST);
    assert_ne!(local.port(), 0, "the kernel's choice, not the request");
    assert_eq!(device.config().local, local);
    assert!(device.name().ends_with(&format!("-{}", local.port())), "{}", device.name());
    let taken = UdpSocket::bind(local).expect_err("the device holds that port");
    assert_eq!(taken.kind(), ErrorKind::AddrInUse);
}
