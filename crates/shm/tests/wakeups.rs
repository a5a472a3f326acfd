//! Polling that fits the machine: the notification fd fires for a program that only waits on
//! it (epoll-style, never polling the queue), blocked waiters sleep instead of spinning, and an
//! idle device's helper threads (socket and driver) block without a timeout.

mod common;

use common::Fixture;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use lightpath_shm::{helper_thread_names, ShmDevice};
use lightpath_verbs::conformance::harness::{assert_success, wait_n, Pair};
use lightpath_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, QueuePair, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use rustix::event::{poll, PollFd, PollFlags, Timespec};

fn empty() -> [WorkCompletion; 4] {
    [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 4]
}

/// A field of `/proc/self/task/<tid>/status` for the thread named `name`.
fn thread_status(name: &str, field: &str) -> u64 {
    for entry in std::fs::read_dir("/proc/self/task").expect("tasks") {
        let path = entry.expect("task").path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let status = std::fs::read_to_string(path.join("status")).expect("status");
            let line = status.lines().find(|l| l.starts_with(field)).expect("field");
            return line[field.len()..].trim_start_matches(':').trim().parse().expect("number");
        }
    }
    panic!("no thread named {name}");
}

/// This thread's voluntary context switches (times it blocked).
fn own_blocks() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").expect("status");
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches")).expect("field");
    line.split(':').nth(1).expect("value").trim().parse().expect("number")
}

/// The receiver arms its queue and then only waits on the notification fd with `poll(2)`,
/// never calling `poll`/`wait` on the queue: the completion still arrives and the fd fires
/// (the helper thread processes arrivals once the application is idle).
#[test]
fn notify_fd_fires_for_a_program_that_only_waits_on_it() {
    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, b"event-driven").expect("fill");
    pair.b.post_recv(1, &inbox, 0, 4096);
    let cq = &pair.b.cq;
    cq.request_notify().expect("arm");
    let mut buf = empty();
    assert_eq!(cq.poll(&mut buf).expect("poll"), 0);
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 12)])).expect("send");

    let fd = cq.notify_fd().expect("an fd");
    // SAFETY: the fd belongs to the queue, which outlives this borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let timeout = Timespec { tv_sec: 30, tv_nsec: 0 };
    assert_eq!(poll(&mut fds, Some(&timeout)).expect("poll(2)"), 1, "the notification fd never fired");
    assert!(cq.take_notify().expect("take"), "readable fd without a notification");
    let got = cq.poll(&mut buf).expect("poll");
    assert_eq!(got, 1, "{:?}", &buf[..got]);
    assert_success(&buf[0], 1, WcOpcode::Recv);
    let mut payload = [0u8; 12];
    inbox.read(0, &mut payload).expect("read");
    assert_eq!(&payload, b"event-driven");
    assert_success(&pair.a.wait_one(), 2, WcOpcode::Send);
}

/// `wait` on a queue that stays empty returns 0 at its timeout, having slept (blocked) rather
/// than spun the whole time.
#[test]
fn waiters_sleep_after_spinning() {
    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    let blocks_before = own_blocks();
    let start = Instant::now();
    let mut buf = empty();
    assert_eq!(pair.b.cq.wait(&mut buf, Duration::from_millis(100)).expect("wait"), 0);
    assert!(start.elapsed() >= Duration::from_millis(100));
    assert!(own_blocks() > blocks_before, "the waiter never blocked");
}

/// After traffic stops and the application stops calling in, both helper threads of each device
/// block in `poll(2)` with no timeout: they do not wake up at all while nothing happens.
#[test]
fn idle_helper_threads_do_not_wake() {
    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    pair.b.post_recv(1, &inbox, 0, 4096);
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 100)])).expect("send");
    assert_success(&wait_n(&pair.b.cq, 1)[0], 1, WcOpcode::Recv);
    assert_success(&wait_n(&pair.a.cq, 1)[0], 2, WcOpcode::Send);

    // Let both helpers notice the application went idle and go to sleep for good.
    let idle_after = pair.a.device.config().idle_after;
    std::thread::sleep(idle_after * 20 + Duration::from_millis(50));
    let names: Vec<String> = [&pair.a.device, &pair.b.device]
        .into_iter()
        .flat_map(|device| helper_thread_names(device.gid()))
        .collect();
    let before: Vec<u64> = names.iter().map(|n| thread_status(n, "voluntary_ctxt_switches")).collect();
    std::thread::sleep(Duration::from_millis(200));
    let after: Vec<u64> = names.iter().map(|n| thread_status(n, "voluntary_ctxt_switches")).collect();
    assert_eq!(before, after, "an idle helper thread woke up");
    assert_eq!(pair.b.qp.state().expect("state"), lightpath_verbs::QpState::Rts);
}
