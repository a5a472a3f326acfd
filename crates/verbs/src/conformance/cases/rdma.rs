//! Cases: one-sided operations (WRITE, WRITE with immediate, READ, atomics).

use crate::conformance::harness::{assert_empty, assert_success, pattern, read_region, wait_n, Pair, MR_ALL};
use crate::conformance::ConformanceFixture;
use crate::{AccessFlags, MemoryRegion, QueuePair, SendOp, SendWr, WcOpcode};

/// A multi-packet WRITE lands exactly where addressed, completes only at the requester, and
/// does not consume the receive the responder had posted.
pub fn rdma_write<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let len = 2 * pair.mtu.bytes() as usize + 100;
    let src = pair.a.alloc(len, AccessFlags::LOCAL_WRITE);
    let target = pair.b.alloc(len + 300, MR_ALL);
    let inbox = pair.b.alloc(64, AccessFlags::LOCAL_WRITE);
    pair.b.post_recv(77, &inbox, 0, 64);
    let data = pattern(len, 5);
    src.write(0, &data).expect("fill");

    let remote = target.remote();
    let sge = [src.sge(0, len as u32)];
    let op = SendOp::Write { remote_addr: remote.addr + 100, rkey: remote.rkey };
    pair.a.qp.post_send(&SendWr::new(1, op, &sge)).expect("post write");
    let wc = pair.a.wait_one();
    assert_success(&wc, 1, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&target, 100, len), data);
    assert_eq!(read_region(&target, 0, 100), vec![0u8; 100], "bytes before the target changed");
    assert_eq!(read_region(&target, 100 + len, 200), vec![0u8; 200], "bytes after the target changed");
    assert_empty(&pair.b.cq);

    // The receive is still there for the next SEND.
    let sge = [src.sge(0, 10)];
    pair.a.qp.post_send(&SendWr::new(2, SendOp::Send, &sge)).expect("post send");
    let recv = pair.b.wait_one();
    assert_success(&recv, 77, WcOpcode::Recv);
    assert_eq!(recv.byte_len, 10);
    assert_success(&pair.a.wait_one(), 2, WcOpcode::Send);
}

/// WRITE with immediate writes the data and consumes a receive that reports the immediate value
/// and the written length.
pub fn rdma_write_with_imm<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let len = 2 * pair.mtu.bytes() as usize + 3;
    let src = pair.a.alloc(len, AccessFlags::LOCAL_WRITE);
    let target = pair.b.alloc(len, MR_ALL);
    let inbox = pair.b.alloc(16, AccessFlags::LOCAL_WRITE);
    pair.b.post_recv(9, &inbox, 0, 16);
    let data = pattern(len, 8);
    src.write(0, &data).expect("fill");
    let remote = target.remote();
    let sge = [src.sge(0, len as u32)];
    let op = SendOp::WriteWithImm { remote_addr: remote.addr, rkey: remote.rkey, imm: 0x1234_5678 };
    pair.a.qp.post_send(&SendWr::new(3, op, &sge)).expect("post write with imm");

    let recv = pair.b.wait_one();
    assert_success(&recv, 9, WcOpcode::RecvRdmaWithImm);
    assert_eq!(recv.imm_data, Some(0x1234_5678));
    assert_eq!(recv.byte_len as usize, len);
    assert_eq!(recv.src_qp, pair.a.qp.qpn());
    assert_eq!(read_region(&target, 0, len), data);
    assert_eq!(read_region(&inbox, 0, 16), vec![0u8; 16], "the receive buffer was written");
    assert_success(&pair.a.wait_one(), 3, WcOpcode::RdmaWrite);

    // Zero bytes with immediate: a pure notification, no scatter/gather entry at all.
    pair.b.post_recv(10, &inbox, 0, 16);
    let op = SendOp::WriteWithImm { remote_addr: remote.addr, rkey: remote.rkey, imm: 0xABCD };
    pair.a.qp.post_send(&SendWr::new(4, op, &[])).expect("post zero-length write with imm");
    let recv = pair.b.wait_one();
    assert_success(&recv, 10, WcOpcode::RecvRdmaWithImm);
    assert_eq!((recv.imm_data, recv.byte_len), (Some(0xABCD), 0), "{recv:?}");
    assert_eq!(read_region(&target, 0, len), data, "a zero-length write changed memory");
    assert_success(&pair.a.wait_one(), 4, WcOpcode::RdmaWrite);
}

/// `write_direct`: a provider that cannot answers `None`, to the no-bytes probe and to real
/// writes alike; one that can puts the bytes exactly where an RDMA WRITE would, before a WRITE
/// WITH IMMEDIATE posted afterwards is seen, and refuses what a WRITE would fail on (a bad
/// rkey, a range past the region, a region without remote write) without writing anything.
pub fn write_direct_or_none<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let target = pair.b.alloc(4096, MR_ALL);
    let read_only = pair.b.alloc(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    let inbox = pair.b.alloc(16, AccessFlags::LOCAL_WRITE);
    let remote = target.remote();
    let data = pattern(1000, 11);
    let probe = pair.a.qp.write_direct(remote.addr, remote.rkey, &[]);
    let Some(written) = pair.a.qp.write_direct(remote.addr + 100, remote.rkey, &data) else {
        assert!(probe.is_none(), "answered the no-bytes probe but not a write");
        assert!(pair.a.qp.write_direct(remote.addr, remote.rkey ^ 1, &data).is_none());
        assert_eq!(read_region(&target, 0, 4096), vec![0u8; 4096]);
        return;
    };
    assert!(probe.is_some(), "wrote directly but answered the probe with None");
    written.expect("a direct write the rkey allows");

    // The announcing WRITE WITH IMMEDIATE carries no bytes of its own.
    pair.b.post_recv(21, &inbox, 0, 16);
    let op = SendOp::WriteWithImm { remote_addr: remote.addr, rkey: remote.rkey, imm: 0x77 };
    pair.a.qp.post_send(&SendWr::new(22, op, &[])).expect("post the announcement");
    let recv = pair.b.wait_one();
    assert_success(&recv, 21, WcOpcode::RecvRdmaWithImm);
    assert_eq!(read_region(&target, 100, data.len()), data);
    assert_eq!(read_region(&target, 0, 100), vec![0u8; 100], "bytes before the range changed");
    assert_eq!(read_region(&target, 1100, 100), vec![0u8; 100], "bytes after the range changed");
    assert_success(&pair.a.wait_one(), 22, WcOpcode::RdmaWrite);

    let junk = [0xEE_u8; 64];
    let refused = [
        ("a bad rkey", remote.addr, remote.rkey ^ 0x5A5A),
        ("past the region", remote.addr + 4096 - 32, remote.rkey),
        ("no remote write", read_only.remote().addr, read_only.remote().rkey),
    ];
    for (what, addr, rkey) in refused {
        let result = pair.a.qp.write_direct(addr, rkey, &junk);
        assert!(matches!(result, Some(Err(_))), "{what}: {result:?}");
    }
    assert_eq!(read_region(&target, 100, data.len()), data, "a refused write changed memory");
    assert_eq!(read_region(&target, 4096 - 32, 32), vec![0u8; 32], "a refused write changed memory");
    assert_eq!(read_region(&read_only, 0, 64), vec![0u8; 64], "a refused write changed memory");
    assert_empty(&pair.a.cq);
}

/// A READ spanning several response packets returns the remote bytes.
pub fn rdma_read_multi_packet<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let len = 3 * pair.mtu.bytes() as usize + 17;
    let source = pair.b.alloc(len + 5, MR_ALL);
    let dst = pair.a.alloc(len + 10, AccessFlags::LOCAL_WRITE);
    let data = pattern(len, 11);
    source.write(5, &data).expect("fill");
    let remote = source.remote();
    let sge = [dst.sge(10, len as u32)];
    let op = SendOp::Read { remote_addr: remote.addr + 5, rkey: remote.rkey };
    pair.a.qp.post_send(&SendWr::new(4, op, &sge)).expect("post read");
    let wc = pair.a.wait_one();
    assert_success(&wc, 4, WcOpcode::RdmaRead);
    assert_eq!(wc.byte_len as usize, len);
    assert_eq!(read_region(&dst, 10, len), data);
    assert_eq!(read_region(&dst, 0, 10), vec![0u8; 10]);
    assert_empty(&pair.b.cq);
}

/// Compare-and-swap swaps on a match and not on a mismatch; both return the original value.
pub fn atomic_compare_swap<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let target = pair.b.alloc(64, MR_ALL);
    let result = pair.a.alloc(64, AccessFlags::LOCAL_WRITE);
    target.write_u64(8, 5).expect("init");
    let remote = target.remote();
    let cases = [(1u64, 5u64, 9u64, 5u64, 9u64), (2, 5, 11, 9, 9)];
    for (wr_id, compare, swap, original, after) in cases {
        let sge = [result.sge(16, 8)];
        let op = SendOp::CompareSwap { remote_addr: remote.addr + 8, rkey: remote.rkey, compare, swap };
        pair.a.qp.post_send(&SendWr::new(wr_id, op, &sge)).expect("post cmp_swap");
        let wc = pair.a.wait_one();
        assert_success(&wc, wr_id, WcOpcode::CompSwap);
        assert_eq!(wc.byte_len, 8);
        assert_eq!(result.read_u64(16).expect("read"), original, "original value returned");
        assert_eq!(
            target.read_u64(8).expect("read"),
            after,
            "remote value after compare {compare} swap {swap}"
        );
    }
    assert_eq!(target.read_u64(0).expect("read"), 0, "neighbouring word changed");
    assert_eq!(target.read_u64(16).expect("read"), 0, "neighbouring word changed");
}

/// Fetch-and-add returns the original value, wraps modulo 2^64, and several in flight apply
/// once each.
pub fn atomic_fetch_add<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let target = pair.b.alloc(64, MR_ALL);
    let results = pair.a.alloc(8 * 16, AccessFlags::LOCAL_WRITE);
    target.write_u64(24, u64::MAX - 1).expect("init");
    let remote = target.remote();
    let sge = [results.sge(0, 8)];
    let op = SendOp::FetchAdd { remote_addr: remote.addr + 24, rkey: remote.rkey, add: 3 };
    pair.a.qp.post_send(&SendWr::new(1, op, &sge)).expect("post fetch_add");
    let wc = pair.a.wait_one();
    assert_success(&wc, 1, WcOpcode::FetchAdd);
    assert_eq!(wc.byte_len, 8);
    assert_eq!(results.read_u64(0).expect("read"), u64::MAX - 1);
    assert_eq!(target.read_u64(24).expect("read"), 1, "the add wraps modulo 2^64");

    // Sixteen adds in flight at once: the responder applies them in order, once each.
    for i in 0..16u64 {
        let sge = [results.sge(8 * i as usize, 8)];
        let op = SendOp::FetchAdd { remote_addr: remote.addr + 24, rkey: remote.rkey, add: 10 };
        pair.a.qp.post_send(&SendWr::new(100 + i, op, &sge)).expect("post fetch_add");
    }
    let completions = wait_n(&pair.a.cq, 16);
    for (i, wc) in completions.iter().enumerate() {
        assert_success(wc, 100 + i as u64, WcOpcode::FetchAdd);
    }
    let originals: Vec<u64> = (0..16).map(|i| results.read_u64(8 * i).expect("read")).collect();
    assert_eq!(originals, (0..16).map(|i| 1 + 10 * i).collect::<Vec<u64>>());
    assert_eq!(target.read_u64(24).expect("read"), 161);
}
