//! Bandwidth of large messages between two shm devices, next to plain `memcpy` of the same
//! size in the same run: WRITE (the requester copies into the peer's region), READ (it copies
//! out of it) and SEND (from 32 KiB on, the receiver copies straight out of the sender's
//! region). `lightpath perf` stops at 8 MiB; this goes to any size.
//!
//! `cargo run --release -p lightpath-shm --example large_messages -- [SIZE_MIB] [ITERATIONS]`
//! (default 64 MiB, 20 iterations). Both devices live in this process, one thread each, as two
//! processes would use them.

use std::time::{Duration, Instant};

use lightpath_shm::{ShmConfig, ShmDevice};
use lightpath_verbs::conformance::harness::{wait_n, Pair};
use lightpath_verbs::conformance::ConformanceFixture;
use lightpath_verbs::{AccessFlags, MemoryRegion, QueuePair, RecvWr, SendOp, SendWr, WcStatus};

struct Fixture;

impl ConformanceFixture for Fixture {
    type Device = ShmDevice;

    fn open_pair() -> (ShmDevice, ShmDevice) {
        let open = || ShmDevice::open(ShmConfig::default()).expect("shm device");
        (open(), open())
    }
}

fn gbps(bytes: usize, iterations: usize, elapsed: Duration) -> f64 {
    (bytes * iterations) as f64 / elapsed.as_secs_f64() / 1e9
}

fn main() {
    let mut args = std::env::args().skip(1);
    let size = args.next().and_then(|a| a.parse::<usize>().ok()).unwrap_or(64) << 20;
    let iterations = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);

    let source = vec![0x5Au8; size];
    let mut target = vec![0u8; size];
    // One unmeasured copy faults the target's pages in, as the warm-up rounds below do.
    target.copy_from_slice(&source);
    let start = Instant::now();
    for i in 0..iterations {
        target.copy_from_slice(&source);
        std::hint::black_box(&mut target[i % size]);
    }
    println!("memcpy {:>5} MiB: {:6.2} GB/s", size >> 20, gbps(size, iterations, start.elapsed()));

    let pair = Pair::<ShmDevice>::connected::<Fixture>();
    let a = pair.a.alloc(size, AccessFlags::ALL);
    let b = pair.b.alloc(size, AccessFlags::ALL);
    a.write(0, &source).expect("fill");
    let remote = b.remote();
    let sge = [a.sge(0, size as u32)];
    for (name, op) in [
        ("WRITE", SendOp::Write { remote_addr: remote.addr, rkey: remote.rkey }),
        ("READ", SendOp::Read { remote_addr: remote.addr, rkey: remote.rkey }),
    ] {
        // One unmeasured round maps the peer's region and faults its pages in.
        pair.a.qp.post_send(&SendWr::new(0, op, &sge)).expect("post");
        wait_n(&pair.a.cq, 1);
        let start = Instant::now();
        for i in 0..iterations {
            pair.a.qp.post_send(&SendWr::new(i as u64, op, &sge)).expect("post");
            assert_eq!(wait_n(&pair.a.cq, 1)[0].status, WcStatus::Success);
        }
        println!("{name:<6} {:>5} MiB: {:6.2} GB/s", size >> 20, gbps(size, iterations, start.elapsed()));
    }

    std::thread::scope(|scope| {
        let receiver = scope.spawn(|| {
            let sge = [b.sge(0, size as u32)];
            for i in 0..=iterations {
                pair.b.qp.post_recv(&RecvWr::new(i as u64, &sge)).expect("recv");
                assert_eq!(wait_n(&pair.b.cq, 1)[0].status, WcStatus::Success);
            }
        });
        pair.a.qp.post_send(&SendWr::new(0, SendOp::Send, &sge)).expect("warm-up send");
        wait_n(&pair.a.cq, 1);
        let start = Instant::now();
        for i in 0..iterations {
            pair.a.qp.post_send(&SendWr::new(i as u64, SendOp::Send, &sge)).expect("send");
            assert_eq!(wait_n(&pair.a.cq, 1)[0].status, WcStatus::Success);
        }
        println!("SEND   {:>5} MiB: {:6.2} GB/s", size >> 20, gbps(size, iterations, start.elapsed()));
        receiver.join().expect("receiver");
    });
}
