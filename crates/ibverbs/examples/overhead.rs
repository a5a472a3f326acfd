//! What the safe wrapper costs on the data path, measured against the same C calls made
//! directly, in one process, on the same queue pairs of a real device (rxe or a NIC).
//!
//! A 64-byte inline SEND ping from queue pair A to queue pair B (both on the device, connected
//! back to back), polled to completion on both sides, receive re-posted: first through
//! `IbvQp::post_send`/`IbvCq::poll`/`IbvQp::post_recv`, then through `ffi::ops` with prebuilt C
//! work requests, alternating in blocks so that drift of the machine hits both alike. Prints
//! the median block mean of each and the difference.
//!
//! `cargo run --release -p lightpath-ibverbs --example overhead [DEVICE] [BLOCKS] [ITERS]`
//! (BLOCKS × ITERS measured iterations of each, after ITERS of warm-up)

use std::time::Instant;

use lightpath_ibverbs::ffi::ops;
use lightpath_ibverbs::ffi::types::{
    wr_opcode, IbvRdmaWr, IbvRecvWr, IbvSendWr, IbvSendWrUnion, IbvSge, IbvWc, SEND_INLINE,
};
use lightpath_ibverbs::{IbvDevice, IbvProvider};
use lightpath_verbs::conformance::harness::Pair;
use lightpath_verbs::conformance::ConformanceFixture;
use lightpath_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, Provider, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

struct Named;

impl ConformanceFixture for Named {
    type Device = IbvDevice;
    fn open_pair() -> (IbvDevice, IbvDevice) {
        let name = std::env::args().nth(1).unwrap_or_else(|| "rxe0".into());
        let open = || IbvProvider::default().open(&name).expect("open the device");
        (open(), open())
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let blocks: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(20);
    let iters: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(500);
    let pair = Pair::<IbvDevice>::connected::<Named>();
    let inbox = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    let payload = [0x5au8; 64];

    // The wrapper.
    let recv_sge = [inbox.sge(0, 4096)];
    let mut wcs = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 16];
    let mut wrapped = || {
        pair.b.qp.post_recv(&RecvWr::new(1, &recv_sge)).expect("post_recv");
        let wr =
            SendWr::inline(2, SendOp::Send, &payload).with_flags(SendFlags::SIGNALED | SendFlags::INLINE);
        pair.a.qp.post_send(&wr).expect("post_send");
        while pair.b.cq.poll(&mut wcs).expect("poll") == 0 {}
        while pair.a.cq.poll(&mut wcs).expect("poll") == 0 {}
    };

    // The same calls in C form.
    let (qp_a, qp_b) = (pair.a.qp.as_raw(), pair.b.qp.as_raw());
    let (cq_a, cq_b) = (pair.a.cq.as_raw(), pair.b.cq.as_raw());
    let mut c_recv_sge = IbvSge { addr: inbox.addr(), length: 4096, lkey: inbox.lkey() };
    let mut c_send_sge = IbvSge { addr: payload.as_ptr() as u64, length: 64, lkey: 0 };
    let mut raw_wc = [IbvWc::default(); 16];
    let mut direct = || {
        let mut recv =
            IbvRecvWr { wr_id: 1, next: std::ptr::null_mut(), sg_list: &mut c_recv_sge, num_sge: 1 };
        let mut send = IbvSendWr {
            wr_id: 2,
            next: std::ptr::null_mut(),
            sg_list: &mut c_send_sge,
            num_sge: 1,
            opcode: wr_opcode::SEND,
            send_flags: SendFlags::SIGNALED.bits() | SEND_INLINE,
            imm_data_or_invalidate_rkey: 0,
            wr: IbvSendWrUnion { rdma: IbvRdmaWr { remote_addr: 0, rkey: 0 } },
            qp_type_xrc_remote_srqn: 0,
            bind_mw_or_tso: [0; 6],
        };
        let mut bad_recv = std::ptr::null_mut();
        let mut bad_send = std::ptr::null_mut();
        // SAFETY: live queue pairs and completion queues of `pair`; the requests and their
        // scatter/gather entries outlive the calls; `raw_wc` has room for 16 completions.
        unsafe {
            assert_eq!(ops::post_recv(qp_b, &mut recv, &mut bad_recv), 0);
            assert_eq!(ops::post_send(qp_a, &mut send, &mut bad_send), 0);
            while ops::poll_cq(cq_b, 16, raw_wc.as_mut_ptr()) == 0 {}
            while ops::poll_cq(cq_a, 16, raw_wc.as_mut_ptr()) == 0 {}
        }
    };

    // Warm both paths up, then alternate single iterations, each timed with the CPU's cycle
    // counter (cheap even where the OS clock is not): the median of each side is robust to
    // the load spikes a shared machine adds, and alternating cancels drift.
    for _ in 0..iters {
        wrapped();
        direct();
    }
    let total = blocks * iters;
    let (mut w, mut d) = (Vec::with_capacity(total), Vec::with_capacity(total));
    let wall = Instant::now();
    let first = cycles();
    for _ in 0..total {
        let t0 = cycles();
        wrapped();
        let t1 = cycles();
        direct();
        let t2 = cycles();
        w.push(t1.wrapping_sub(t0) as f64);
        d.push(t2.wrapping_sub(t1) as f64);
    }
    let ns_per_cycle = wall.elapsed().as_nanos() as f64 / cycles().wrapping_sub(first).max(1) as f64;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let quartiles = |v: &Vec<f64>| (v[v.len() / 4], v[v.len() * 3 / 4]);
    let (w_med, d_med) = (median(&mut w), median(&mut d));
    let us = |c: f64| c * ns_per_cycle / 1000.0;
    println!(
        "{total} SEND round trips each (64 B inline, both CQs polled), alternating, median per iteration:"
    );
    let (wq1, wq3) = quartiles(&w);
    let (dq1, dq3) = quartiles(&d);
    println!("  wrapper (IbvQp/IbvCq): {:.2} us (middle half {:.2} .. {:.2})", us(w_med), us(wq1), us(wq3));
    println!("  direct C calls:        {:.2} us (middle half {:.2} .. {:.2})", us(d_med), us(dq1), us(dq3));
    println!(
        "  difference:            {:+.2} us ({:+.1}%)",
        us(w_med - d_med),
        (w_med - d_med) / d_med * 100.0
    );

    // What one clock read costs here: latency tools that read the clock several times per
    // iteration pay it several times (perftest reads the cycle counter instead).
    let reads = 10_000u32;
    let start = Instant::now();
    let mut last = start;
    for _ in 0..reads {
        last = std::hint::black_box(Instant::now());
    }
    let per_read = last.duration_since(start).as_nanos() as f64 / f64::from(reads);
    println!("  one Instant::now():    {:.2} us", per_read / 1000.0);
}

/// A cheap, monotonic-enough tick count (the time-stamp counter on x86_64).
#[cfg(target_arch = "x86_64")]
fn cycles() -> u64 {
    // SAFETY: RDTSC has no preconditions on x86_64.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// A tick count where there is no time-stamp counter: nanoseconds of the OS clock.
#[cfg(not(target_arch = "x86_64"))]
fn cycles() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}
