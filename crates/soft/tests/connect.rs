//! The out-of-band connect/accept helper with soft queue pairs: a real TCP exchange, then
//! one-sided and two-sided traffic using what was exchanged.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;

use lightpath_soft::connect::{accept, connect, ConnectOptions};
use lightpath_soft::{ProgressMode, SoftDevice};
use lightpath_verbs::conformance::harness::{pattern, wait_n, PairOptions, Side, MR_ALL};
use lightpath_verbs::{
    AccessFlags, Error, MemoryRegion, Mtu, QpAttr, QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
    WcStatus,
};

#[test]
fn connect_and_accept_then_write_and_send() {
    let (dev_a, dev_b) = common::open_pair(ProgressMode::Thread);
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr().expect("addr");

    let server = std::thread::spawn(move || {
        let side: Side<SoftDevice> = Side::new(dev_b, &PairOptions::default());
        let target = side.alloc(4096, MR_ALL);
        let inbox = side.alloc(4096, AccessFlags::LOCAL_WRITE);
        // Receives are posted in INIT, before the peer can send.
        side.qp.modify(&QpAttr::to_init(AccessFlags::REMOTE_WRITE)).expect("INIT");
        side.qp.post_recv(&RecvWr::new(7, &[inbox.sge(0, 4096)])).expect("post_recv");
        let options =
            ConnectOptions { mtu: Mtu::Mtu2048, regions: vec![target.remote()], ..ConnectOptions::default() };
        let connection = accept(&listener, &side.qp, &options).expect("accept");
        let recv = wait_n(&side.cq, 1)[0];
        (connection, recv, target.remote(), read(&target, 100), read(&inbox, 5))
    });

    let side: Side<SoftDevice> = Side::new(dev_a, &PairOptions::default());
    let options = ConnectOptions { psn: Some(0xAB_CDEF), ..ConnectOptions::default() };
    let connection = connect(addr, &side.qp, &options).expect("connect");
    assert_eq!(connection.mtu, Mtu::Mtu1024, "the smaller MTU wins");
    assert_eq!(connection.local_psn, 0xAB_CDEF);
    assert_eq!(connection.peer.regions.len(), 1);
    assert_eq!(side.qp.state().expect("state"), QpState::Rts);

    let region = connection.peer.regions[0];
    let src = side.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(100, 9)).expect("fill");
    let op = SendOp::Write { remote_addr: region.addr, rkey: region.rkey };
    side.qp.post_send(&SendWr::new(1, op, &[src.sge(0, 100)])).expect("write");
    src.write(200, b"hello").expect("fill");
    side.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(200, 5)])).expect("send");
    let done = wait_n(&side.cq, 2);
    assert_eq!((done[0].status, done[0].opcode), (WcStatus::Success, WcOpcode::RdmaWrite));
    assert_eq!((done[1].status, done[1].opcode), (WcStatus::Success, WcOpcode::Send));

    let (server_connection, recv, target, written, received) = server.join().expect("server");
    assert_eq!(server_connection.peer.psn, 0xAB_CDEF);
    assert_eq!(server_connection.peer.qpn, side.qp.qpn());
    assert_eq!(server_connection.peer.gid, side.device.gid());
    assert_eq!(connection.peer.psn, server_connection.local_psn);
    assert_eq!(target, region);
    assert_eq!((recv.wr_id, recv.status, recv.byte_len), (7, WcStatus::Success, 5));
    assert_eq!(written, pattern(100, 9));
    assert_eq!(received, b"hello");
}

fn read(mr: &impl MemoryRegion, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    mr.read(0, &mut out).expect("read");
    out
}

#[test]
fn a_peer_that_speaks_nonsense_is_refused() {
    let device = common::open_device(|_| {});
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr().expect("addr");
    let impostor = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        // Read the whole hello first: closing with unread data would reset the connection.
        let mut seen = Vec::new();
        let mut byte = [0u8; 1];
        while !seen.ends_with(b"end\n") && stream.read(&mut byte).expect("read") == 1 {
            seen.push(byte[0]);
        }
        stream.write_all(b"0000:000011:5a3c1f:00000000000000000000ffff7f000001\0").expect("write");
        // Dropping the stream closes it.
    });
    let side: Side<SoftDevice> = Side::new(device, &PairOptions::default());
    let result = connect(addr, &side.qp, &ConnectOptions::default());
    impostor.join().expect("impostor");
    match result {
        Err(Error::Io(err)) => assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}"),
        other => panic!("expected an InvalidData error, got {other:?}"),
    }
    assert_eq!(side.qp.state().expect("state"), QpState::Init, "no further than INIT");
}
