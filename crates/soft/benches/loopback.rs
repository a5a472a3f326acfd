//! Soft provider over loopback: SEND ping-pong round-trip time with the progress thread and in
//! polling mode, the same ping-pong driven by one thread (the stack's CPU cost per message,
//! free of cross-core wake-up and scheduling noise), and RDMA WRITE throughput. Two devices on
//! 127.0.0.x addresses, one port.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lightpath_soft::{ProgressMode, SoftConfig, SoftDevice};
use lightpath_verbs::conformance::harness::{common_mtu, connect, wait_n, PairOptions, Side, MR_ALL};
use lightpath_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, QueuePair, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

fn open_pair(mode: ProgressMode, first_host: u8) -> (Side<SoftDevice>, Side<SoftDevice>) {
    let open = |host: u8| {
        let ip = IpAddr::V4(Ipv4Addr::new(127, 77, std::process::id() as u8, host));
        let mut config = SoftConfig::with_addr(SocketAddr::new(ip, 24792));
        config.mode = mode;
        SoftDevice::open(config).expect("open soft device")
    };
    let options = PairOptions::default();
    let (a, b) = (open(first_host), open(first_host + 1));
    let mtu = common_mtu(&a, &b);
    let (a, b) = (Side::new(a, &options), Side::new(b, &options));
    connect(&a.qp, &b.qp, mtu, &options);
    (a, b)
}

fn ping_pong(c: &mut Criterion, name: &str, mode: ProgressMode, first_host: u8) {
    let (a, b) = open_pair(mode, first_host);
    let (a_buf, b_buf) = (a.alloc(64, AccessFlags::LOCAL_WRITE), b.alloc(64, AccessFlags::LOCAL_WRITE));
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        // B echoes every message; a ping of u64::MAX tells it to stop.
        scope.spawn(|| {
            b.post_recv(0, &b_buf, 0, 8);
            while !stop.load(Ordering::Relaxed) {
                for wc in wait_n(&b.cq, 1) {
                    if wc.opcode == lightpath_verbs::WcOpcode::Recv {
                        let value = b_buf.read_u64(0).expect("read");
                        b.post_recv(0, &b_buf, 0, 8);
                        if value == u64::MAX {
                            return;
                        }
                        b.qp.post_send(&SendWr::inline(1, SendOp::Send, &value.to_ne_bytes())).expect("pong");
                    }
                }
            }
        });
        a.post_recv(0, &a_buf, 0, 8);
        c.bench_function(name, |bench| {
            bench.iter(|| {
                a.qp.post_send(&SendWr::inline(1, SendOp::Send, &7u64.to_ne_bytes())).expect("ping");
                let mut got_reply = false;
                let mut sent = false;
                while !(got_reply && sent) {
                    for wc in wait_n(&a.cq, 1) {
                        match wc.opcode {
                            lightpath_verbs::WcOpcode::Recv => {
                                got_reply = true;
                                a.post_recv(0, &a_buf, 0, 8);
                            }
                            _ => sent = true,
                        }
                    }
                }
            })
        });
        stop.store(true, Ordering::Relaxed);
        a.qp.post_send(&SendWr::inline(2, SendOp::Send, &u64::MAX.to_ne_bytes())).expect("stop");
    });
}

/// One thread plays both sides: post an 8-byte SEND on one device, poll the other until it
/// arrives, re-post the receive, and answer. Each iteration is one message one way: the
/// system calls, the engine and the driver's bookkeeping, nothing else.
fn single_thread_ping_pong(c: &mut Criterion) {
    let (a, b) = open_pair(ProgressMode::polling(), 7);
    let sides = [&a, &b];
    let inboxes = [a.alloc(64, AccessFlags::LOCAL_WRITE), b.alloc(64, AccessFlags::LOCAL_WRITE)];
    for (side, inbox) in sides.iter().zip(&inboxes) {
        for _ in 0..4 {
            side.post_recv(0, inbox, 0, 64);
        }
    }
    let mut wcs = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 16];
    let mut from = 0;
    c.bench_function("send_8B_one_way/single_thread_polling", |bench| {
        bench.iter(|| {
            let to = 1 - from;
            sides[from].qp.post_send(&SendWr::inline(1, SendOp::Send, b"8 bytes!")).expect("send");
            'arrived: loop {
                let n = sides[to].cq.poll(&mut wcs).expect("poll");
                for wc in &wcs[..n] {
                    assert_eq!(wc.status, WcStatus::Success);
                    if wc.opcode == WcOpcode::Recv {
                        break 'arrived;
                    }
                }
            }
            sides[to].post_recv(0, &inboxes[to], 0, 64);
            from = to;
        })
    });
}

fn latency(c: &mut Criterion) {
    single_thread_ping_pong(c);
    ping_pong(c, "send_rtt_64B/progress_thread", ProgressMode::Thread, 1);
    ping_pong(c, "send_rtt_64B/polling", ProgressMode::polling(), 3);
}

fn write_throughput(c: &mut Criterion) {
    let (a, b) = open_pair(ProgressMode::Thread, 5);
    const LEN: usize = 1 << 20;
    let src = a.alloc(LEN, AccessFlags::LOCAL_WRITE);
    let target = b.alloc(LEN, MR_ALL);
    let remote = target.remote();
    let mut group = c.benchmark_group("write_1MiB");
    group.throughput(Throughput::Bytes(LEN as u64));
    group.measurement_time(Duration::from_secs(5));
    group.bench_function("progress_thread", |bench| {
        bench.iter(|| {
            let op = SendOp::Write { remote_addr: remote.addr, rkey: remote.rkey };
            a.qp.post_send(&SendWr::new(1, op, &[src.sge(0, LEN as u32)])).expect("write");
            wait_n(&a.cq, 1)
        })
    });
    group.finish();
}

criterion_group!(benches, latency, write_throughput);
criterion_main!(benches);
