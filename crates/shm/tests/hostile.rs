//! Hostile or broken processes on the rendezvous socket: junk, introductions with the wrong
//! descriptors (none, a pipe for a doorbell, an unsealed memfd, a sealed memfd without a
//! segment header, an activity area that is no such thing or lacks the slot named), questions
//! before any introduction. Each such connection is dropped, the device keeps answering probes,
//! and a genuine peer still connects and talks.

mod common;

use common::Fixture;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use lightpath_shm::{address::rendezvous_name, probe, ShmConfig, ShmDevice};
use lightpath_verbs::conformance::harness::{
    assert_success, connect, pattern, read_region, Pair, PairOptions,
};
use lightpath_verbs::{
    AccessFlags, AddressVector, Error, Gid, MemoryRegion, QpAttr, QpState, QueuePair, SendOp, SendWr,
    WcOpcode,
};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
use rustix::io::pwrite;
use rustix::net::{
    connect as socket_connect, recv, sendmsg, socket_with, AddressFamily, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

fn raw_connect(gid: Gid) -> OwnedFd {
    let fd =
        socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).expect("socket");
    socket_connect(&fd, &SocketAddrUnix::new_abstract_name(&rendezvous_name(gid)).expect("name"))
        .expect("connect");
    fd
}

fn raw_send(fd: &OwnedFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    sendmsg(fd, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL).expect("send");
}

/// Waits until the device closes our connection (reads EOF).
fn assert_dropped(fd: &OwnedFd, what: &str) {
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let timeout = Timespec { tv_sec: 10, tv_nsec: 0 };
    assert_eq!(poll(&mut fds, Some(&timeout)).expect("poll"), 1, "{what}: connection kept open");
    let mut buf = [0u8; 64];
    assert_eq!(
        recv(fd, &mut buf, RecvFlags::DONTWAIT).expect("recv").0,
        0,
        "{what}: got a reply instead of EOF"
    );
}

/// An introduction as a Lightpath device would send it, for `to_qpn`, from activity slot
/// `slot`, as the first on its link (flag 8: the device's doorbell, activity area and task
/// doorbell follow the segment), with `flags` besides (1: the queue pair's own doorbell
/// follows, 2: a region follows, 4: the queue pair's waiter is a task) and no region described.
fn hello_with(to_qpn: u32, slot: u32, flags: u32) -> Vec<u8> {
    raw_hello(to_qpn, slot, flags | 8)
}

/// An introduction with exactly `flags`.
fn raw_hello(to_qpn: u32, slot: u32, flags: u32) -> Vec<u8> {
    let mut bytes = b"LPSM\x05\x01".to_vec();
    bytes.extend_from_slice(&[0xfd, 0x53, 0x48, 0x4d, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]);
    bytes.extend_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&to_qpn.to_le_bytes());
    bytes.extend_from_slice(&slot.to_le_bytes());
    bytes.extend_from_slice(&flags.to_le_bytes());
    bytes.extend_from_slice(&[0; 24]);
    bytes
}

fn hello_from_slot(to_qpn: u32, slot: u32) -> Vec<u8> {
    hello_with(to_qpn, slot, 0)
}

/// An introduction that says the queue pair's own doorbell follows.
fn hello_with_waiter(to_qpn: u32) -> Vec<u8> {
    hello_with(to_qpn, 0, 1)
}

fn hello(to_qpn: u32) -> Vec<u8> {
    hello_from_slot(to_qpn, 0)
}

/// An introduction as version 1 sent it (no slot: its devices had no activity area).
fn first_hello(to_qpn: u32) -> Vec<u8> {
    let mut bytes = hello(to_qpn);
    bytes.truncate(bytes.len() - 32);
    bytes[4] = 1;
    bytes
}

/// An introduction as version 4 sent it (the same bytes; three fixed descriptors, no task
/// doorbell).
fn version_4_hello(to_qpn: u32) -> Vec<u8> {
    let mut bytes = hello(to_qpn);
    bytes[4] = 4;
    bytes
}

/// An introduction as version 3 sent it (every queue pair had a connection of its own, and
/// the introduction had no flags and no region).
fn previous_hello(to_qpn: u32) -> Vec<u8> {
    let mut bytes = hello(to_qpn);
    bytes.truncate(bytes.len() - 28);
    bytes[4] = 3;
    bytes
}

/// A sealed memfd with a well-formed queue-pair segment header (a 4 KiB ring), so the checks
/// behind the segment's are reached.
fn segment() -> OwnedFd {
    let fd = memfd(8192, false);
    let words: [u64; 4] = [u64::from_le_bytes(*b"LPSHMQP\0"), 2, 4096, 992];
    let header: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    assert_eq!(pwrite(&fd, &header, 0).expect("write the header"), header.len());
    fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).expect("seal");
    fd
}

fn memfd(len: u64, sealed: bool) -> OwnedFd {
    let fd = memfd_create("hostile", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
    ftruncate(&fd, len).expect("size");
    if sealed {
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).expect("seal");
    }
    fd
}

#[test]
fn hostile_connections_are_dropped_and_the_device_keeps_working() {
    let pair = Pair::<ShmDevice>::unconnected_with::<Fixture>(&PairOptions::default());
    let victim = pair.b.device.gid();
    let target = pair.b.qp.qpn();
    let doorbell = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).expect("eventfd");
    let (pipe_read, _pipe_write) = std::io::pipe().expect("pipe");
    let pipe = OwnedFd::from(pipe_read);
    let unsealed = memfd(1 << 20, false);
    let headerless = memfd(1 << 20, true);
    let tiny = memfd(100, true);
    let segment = segment();
    let area = memfd(4096, true);
    let (seg, bell) = (segment.as_fd(), doorbell.as_fd());

    let cases: Vec<(&str, Vec<u8>, Vec<BorrowedFd<'_>>)> = vec![
        ("junk bytes", b"GET / HTTP/1.1\r\n".to_vec(), vec![]),
        ("a question before any introduction", b"LPSM\x05\x02\0\0\0\0\0\0\0\0\0\0\0\0".to_vec(), vec![]),
        ("an introduction without descriptors", hello(target), vec![]),
        ("an introduction of version 1", first_hello(target), vec![seg, bell, area.as_fd()]),
        ("an introduction of version 3", previous_hello(target), vec![seg, bell, area.as_fd()]),
        ("an introduction of the previous version", version_4_hello(target), vec![seg, bell, area.as_fd()]),
        ("a pipe for a doorbell", hello(target), vec![seg, pipe.as_fd(), area.as_fd(), bell]),
        ("an unsealed segment", hello(target), vec![unsealed.as_fd(), bell, area.as_fd(), bell]),
        ("a segment without a header", hello(target), vec![headerless.as_fd(), bell, area.as_fd(), bell]),
        ("a segment smaller than any ring", hello(target), vec![tiny.as_fd(), bell, area.as_fd(), bell]),
        ("no activity area", hello(target), vec![seg, bell]),
        ("an unsealed activity area", hello(target), vec![seg, bell, unsealed.as_fd(), bell]),
        ("an activity area too small for one slot", hello(target), vec![seg, bell, tiny.as_fd(), bell]),
        ("a pipe for an activity area", hello(target), vec![seg, bell, pipe.as_fd(), bell]),
        ("no task doorbell", hello(target), vec![seg, bell, area.as_fd()]),
        ("a first introduction without the device's descriptors", raw_hello(target, 0, 0), vec![seg]),
        (
            "a first introduction that sends the device's descriptors unannounced",
            raw_hello(target, 0, 0),
            vec![seg, bell, area.as_fd(), bell],
        ),
        ("a pipe for a task doorbell", hello(target), vec![seg, bell, area.as_fd(), pipe.as_fd()]),
        ("a memfd for a task doorbell", hello_with(target, 0, 4), vec![seg, bell, area.as_fd(), seg]),
        (
            "a slot outside the activity area",
            hello_from_slot(target, 1 << 20),
            vec![seg, bell, area.as_fd(), bell],
        ),
        (
            "a memfd for the queue pair's own doorbell",
            hello_with_waiter(target),
            vec![seg, bell, area.as_fd(), bell, seg],
        ),
        (
            "a pipe for the queue pair's own doorbell",
            hello_with_waiter(target),
            vec![seg, bell, area.as_fd(), bell, pipe.as_fd()],
        ),
        (
            "a fifth descriptor the flags do not announce",
            hello(target),
            vec![seg, bell, area.as_fd(), bell, bell],
        ),
        (
            "a task waiter with a doorbell of its own",
            hello_with(target, 0, 4),
            vec![seg, bell, area.as_fd(), bell, bell],
        ),
        ("a missing own doorbell", hello_with_waiter(target), vec![seg, bell, area.as_fd(), bell]),
        ("both waiter flags", hello_with(target, 0, 5), vec![seg, bell, area.as_fd(), bell, bell]),
        ("a region announced but not sent", hello_with(target, 0, 2), vec![seg, bell, area.as_fd(), bell]),
        ("a pipe for a region", hello_with(target, 0, 2), vec![seg, bell, area.as_fd(), bell, pipe.as_fd()]),
        (
            "a headerless memfd for a region",
            hello_with(target, 0, 2),
            vec![seg, bell, area.as_fd(), bell, headerless.as_fd()],
        ),
        ("an unknown flag", hello_with(target, 0, 16), vec![seg, bell, area.as_fd(), bell]),
        ("six descriptors", hello_with_waiter(target), vec![seg, bell, area.as_fd(), bell, bell, bell]),
    ];
    for (what, bytes, fds) in cases {
        let fd = raw_connect(victim);
        raw_send(&fd, &bytes, &fds);
        assert_dropped(&fd, what);
        probe(victim, Duration::from_secs(10))
            .unwrap_or_else(|err| panic!("after {what}: probe failed: {err}"));
    }

    // The queue pair those introductions named connects to a genuine peer and carries data.
    connect(&pair.a.qp, &pair.b.qp, pair.mtu, &PairOptions::default());
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(300, 3)).expect("fill");
    pair.b.post_recv(1, &inbox, 0, 4096);
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 300)])).expect("send");
    assert_success(&pair.b.wait_one(), 1, WcOpcode::Recv);
    assert_success(&pair.a.wait_one(), 2, WcOpcode::Send);
    assert_eq!(read_region(&inbox, 0, 300), pattern(300, 3));
}

/// A queue pair told to connect to a GID where no device listens (a closed device, or one in
/// another network namespace) is refused at RTR with the reason, and stays in INIT.
#[test]
fn rtr_towards_a_missing_device_is_refused() {
    let pair = Pair::<ShmDevice>::unconnected_with::<Fixture>(&PairOptions::default());
    let gone = pair.b.device.gid();
    let qpn = pair.b.qp.qpn();
    drop(pair.b);
    let qp = &pair.a.qp;
    qp.modify(&QpAttr::to_init(AccessFlags::ALL)).expect("INIT");
    let rtr = QpAttr::to_rtr(AddressVector::new(gone, 0), pair.mtu, qpn, 0);
    match qp.modify(&rtr) {
        Err(Error::Unavailable(reason)) => assert!(reason.contains("no shm device"), "{reason}"),
        other => panic!("RTR towards a closed device: {other:?}"),
    }
    assert_eq!(qp.state().expect("state"), QpState::Init);
    let not_shm = QpAttr::to_rtr(AddressVector::new("10.0.0.1".parse().expect("gid"), 0), pair.mtu, qpn, 0);
    assert!(matches!(qp.modify(&not_shm), Err(Error::InvalidAttribute(_))), "a RoCE GID was accepted");
}

#[test]
fn probing_finds_devices_and_only_devices() {
    let device = ShmDevice::open(ShmConfig::default()).expect("device");
    probe(device.gid(), Duration::from_secs(10)).expect("a live device answers");
    let gid = device.gid();
    drop(device);
    assert!(probe(gid, Duration::from_secs(1)).is_err(), "a closed device still answers");
}
