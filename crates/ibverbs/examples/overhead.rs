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

    // Warm both paths up, then alternate blocks.
    for _ in 0..iters {
        wrapped();
        direct();
    }
    let (mut w, mut d) = (Vec::new(), Vec::new());
    for _ in 0..blocks {
        let start = Instant::now();
        for _ in 0..iters {
            wrapped();
        }
        w.push(start.elapsed().as_nanos() as f64 / iters as f64);
        let start = Instant::now();
        for _ in 0..iters {
            direct();
        }
        d.push(start.elapsed().as_nanos() as f64 / iters as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (w, d) = (median(&mut w), median(&mut d));
    println!(
        "{blocks} blocks x {iters} SEND round trips (64 B inline, both CQs polled), median of block means:"
    );
    println!("  wrapper (IbvQp/IbvCq): {:.2} us per iteration", w / 1000.0);
    println!("  direct C calls:        {:.2} us per iteration", d / 1000.0);
    println!("  difference:            {:+.2} us ({:+.1}%)", (w - d) / 1000.0, (w - d) / d * 100.0);
}
