//! Cases: two-sided messaging (SEND/RECV, immediate data, gather/scatter, inline, unsignaled).

use crate::conformance::harness::{
    assert_empty, assert_refused, assert_success, pattern, read_region, wait_n, Pair, MR_ALL,
};
use crate::conformance::ConformanceFixture;
use crate::{
    AccessFlags, Device, Error, MemoryRegion, QueuePair, RecvWr, SendFlags, SendOp, SendWr, WcOpcode,
};

/// Sends `len` bytes from the start of `src` into a fresh receive at the start of `dst` and
/// checks both completions and the bytes.
fn send_and_check<D: Device>(
    pair: &Pair<D>,
    src: &crate::MrOf<D>,
    dst: &crate::MrOf<D>,
    len: usize,
    seed: u8,
) {
    let data = pattern(len, seed);
    src.write(0, &data).expect("fill source");
    pair.b.post_recv(u64::from(seed), dst, 0, dst.len() as u32);
    let sge = [src.sge(0, len as u32)];
    // A zero-length SEND is posted without any scatter/gather entry, as verbs allows.
    let sges: &[crate::Sge] = if len == 0 { &[] } else { &sge };
    pair.a.qp.post_send(&SendWr::new(1000 + u64::from(seed), SendOp::Send, sges)).expect("post_send");

    let recv = pair.b.wait_one();
    assert_success(&recv, u64::from(seed), WcOpcode::Recv);
    assert_eq!(recv.byte_len as usize, len, "receive length for a {len}-byte SEND");
    assert_eq!(recv.qp_num, pair.b.qp.qpn());
    assert_eq!(recv.src_qp, pair.a.qp.qpn());
    assert_eq!(recv.imm_data, None);
    assert!(read_region(dst, 0, len) == data, "payload of a {len}-byte SEND differs");
    let send = pair.a.wait_one();
    assert_success(&send, 1000 + u64::from(seed), WcOpcode::Send);
    assert_eq!(send.qp_num, pair.a.qp.qpn());
}

/// SEND/RECV of 0, 1, MTU−1, MTU, MTU+1 and 3·MTU+5 bytes.
pub fn send_recv_small_sizes<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let mtu = pair.mtu.bytes() as usize;
    let largest = 3 * mtu + 5;
    let src = pair.a.alloc(largest, AccessFlags::LOCAL_WRITE);
    let dst = pair.b.alloc(largest, AccessFlags::LOCAL_WRITE);
    for (seed, len) in [0, 1, mtu - 1, mtu, mtu + 1, largest].into_iter().enumerate() {
        send_and_check(&pair, &src, &dst, len, seed as u8 + 1);
    }
    assert_empty(&pair.a.cq);
    assert_empty(&pair.b.cq);
}

/// One 1 MiB SEND (hundreds of packets, more than any sensible window).
pub fn send_recv_one_mib<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let len = 1 << 20;
    let src = pair.a.alloc(len, AccessFlags::LOCAL_WRITE);
    let dst = pair.b.alloc(len, AccessFlags::LOCAL_WRITE);
    send_and_check(&pair, &src, &dst, len, 42);
}

/// SEND with immediate delivers the immediate value with the receive completion.
pub fn send_with_imm<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let mtu = pair.mtu.bytes();
    let src = pair.a.alloc(4 * mtu as usize, AccessFlags::LOCAL_WRITE);
    let dst = pair.b.alloc(4 * mtu as usize, AccessFlags::LOCAL_WRITE);
    for (wr_id, len) in [(1u64, 0u32), (2, 9), (3, 2 * mtu + 1)] {
        let data = pattern(len as usize, wr_id as u8);
        src.write(0, &data).expect("fill");
        pair.b.post_recv(wr_id, &dst, 0, dst.len() as u32);
        let imm = 0xdead_0000 | wr_id as u32;
        let sge = [src.sge(0, len)];
        pair.a.qp.post_send(&SendWr::new(wr_id, SendOp::SendWithImm { imm }, &sge)).expect("post_send");
        let recv = pair.b.wait_one();
        assert_success(&recv, wr_id, WcOpcode::Recv);
        assert_eq!(recv.imm_data, Some(imm), "{recv:?}");
        assert_eq!(recv.byte_len, len, "{recv:?}");
        assert_eq!(read_region(&dst, 0, len as usize), data);
        assert_success(&pair.a.wait_one(), wr_id, WcOpcode::Send);
    }
}

/// A SEND gathered from two regions lands scattered over two receive entries.
pub fn send_gather_scatter<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let first = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let second = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let dst = pair.b.alloc(8192, AccessFlags::LOCAL_WRITE);
    let (part1, part2) = (pattern(100, 1), pattern(1500, 2));
    first.write(0, &part1).expect("fill");
    second.write(50, &part2).expect("fill");
    let recv_sges = [dst.sge(0, 150), dst.sge(4000, 2000)];
    pair.b.qp.post_recv(&RecvWr::new(5, &recv_sges)).expect("post_recv");
    let send_sges = [first.sge(0, 100), second.sge(50, 1500)];
    pair.a.qp.post_send(&SendWr::new(6, SendOp::Send, &send_sges)).expect("post_send");

    let recv = pair.b.wait_one();
    assert_success(&recv, 5, WcOpcode::Recv);
    assert_eq!(recv.byte_len, 1600);
    let sent: Vec<u8> = part1.iter().chain(&part2).copied().collect();
    assert_eq!(read_region(&dst, 0, 150), sent[..150]);
    assert_eq!(read_region(&dst, 150, 3850), vec![0u8; 3850], "bytes between the entries were written");
    assert_eq!(read_region(&dst, 4000, 1450), sent[150..]);
    assert_success(&pair.a.wait_one(), 6, WcOpcode::Send);
}

/// Inline data is copied at post time (the buffer may change right after), and inline data
/// larger than `max_inline_data` is refused.
pub fn inline_send<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let max_inline = pair.a.qp.caps().max_inline_data;
    assert!(max_inline >= 64, "providers must offer at least 64 inline bytes, got {max_inline}");
    let dst = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    pair.b.post_recv(1, &dst, 0, 4096);

    let mut buffer = pattern(max_inline as usize, 9);
    let expected = buffer.clone();
    pair.a.qp.post_send(&SendWr::inline(2, SendOp::Send, &buffer)).expect("inline post_send");
    buffer.fill(0xEE);
    let recv = pair.b.wait_one();
    assert_success(&recv, 1, WcOpcode::Recv);
    assert_eq!(recv.byte_len, max_inline);
    assert_eq!(read_region(&dst, 0, max_inline as usize), expected, "inline payload not copied at post time");
    assert_success(&pair.a.wait_one(), 2, WcOpcode::Send);

    // Inline WRITE works as well.
    let target = pair.b.alloc(4096, MR_ALL);
    let remote = target.remote();
    let op = SendOp::Write { remote_addr: remote.addr + 8, rkey: remote.rkey };
    pair.a.qp.post_send(&SendWr::inline(3, op, b"inline write")).expect("inline write");
    assert_success(&pair.a.wait_one(), 3, WcOpcode::RdmaWrite);
    assert_eq!(read_region(&target, 8, 12), b"inline write");

    let too_big = vec![1u8; max_inline as usize + 1];
    assert_refused(
        pair.a.qp.post_send(&SendWr::inline(4, SendOp::Send, &too_big)),
        "oversized inline",
        |e| matches!(e, Error::TooLarge(_)),
    );
    assert_empty(&pair.a.cq);
}

/// Unsignaled successful requests produce no completion; the signaled one after them does,
/// and the unsignaled ones did take effect.
pub fn unsignaled_requests<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let target = pair.b.alloc(4096, MR_ALL);
    let dst = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    src.write(0, &pattern(64, 3)).expect("fill");
    pair.b.post_recv(9, &dst, 0, 4096);
    let remote = target.remote();
    for (i, offset) in [0u64, 1024].into_iter().enumerate() {
        let sge = [src.sge(0, 64)];
        let op = SendOp::Write { remote_addr: remote.addr + offset, rkey: remote.rkey };
        let wr = SendWr::new(i as u64 + 1, op, &sge).with_flags(SendFlags::NONE);
        pair.a.qp.post_send(&wr).expect("unsignaled write");
    }
    let sge = [src.sge(0, 16)];
    pair.a.qp.post_send(&SendWr::new(3, SendOp::Send, &sge)).expect("signaled send");

    let completions = wait_n(&pair.a.cq, 1);
    assert_success(&completions[0], 3, WcOpcode::Send);
    // Completions are in order: had the unsignaled writes produced any, they would have come first.
    assert_empty(&pair.a.cq);
    assert_success(&pair.b.wait_one(), 9, WcOpcode::Recv);
    assert_eq!(read_region(&target, 0, 64), pattern(64, 3));
    assert_eq!(read_region(&target, 1024, 64), pattern(64, 3));
    assert_empty(&pair.b.cq);
}

/// Batched posts: a batch of receives and a batch of sends complete in order; a batch with a
/// refused request in the middle reports how many went in before it, and those complete.
pub fn batched_posts<F: ConformanceFixture>() {
    let pair = Pair::connected::<F>();
    let src = pair.a.alloc(4096, AccessFlags::LOCAL_WRITE);
    let dst = pair.b.alloc(4096, AccessFlags::LOCAL_WRITE);
    for i in 0..4 {
        src.write(i * 64, &pattern(64, i as u8)).expect("fill");
    }
    let recv_sges: Vec<[crate::Sge; 1]> = (0..6).map(|i| [dst.sge(i * 64, 64)]).collect();
    let recvs: Vec<RecvWr<'_>> =
        recv_sges.iter().enumerate().map(|(i, s)| RecvWr::new(i as u64, s)).collect();
    pair.b.qp.post_recv_batch(&recvs).expect("receive batch");
    let send_sges: Vec<[crate::Sge; 1]> = (0..4).map(|i| [src.sge(i * 64, 64)]).collect();
    let sends: Vec<SendWr<'_>> =
        send_sges.iter().enumerate().map(|(i, s)| SendWr::new(10 + i as u64, SendOp::Send, s)).collect();
    pair.a.qp.post_send_batch(&sends).expect("send batch");
    for (i, wc) in wait_n(&pair.b.cq, 4).iter().enumerate() {
        assert_success(wc, i as u64, WcOpcode::Recv);
        assert_eq!(read_region(&dst, i * 64, 64), pattern(64, i as u8));
    }
    for (i, wc) in wait_n(&pair.a.cq, 4).iter().enumerate() {
        assert_success(wc, 10 + i as u64, WcOpcode::Send);
    }

    let too_big = vec![0u8; pair.a.qp.caps().max_inline_data as usize + 1];
    let mixed = [
        SendWr::new(20, SendOp::Send, &send_sges[0]),
        SendWr::inline(21, SendOp::Send, &too_big),
        SendWr::new(22, SendOp::Send, &send_sges[1]),
    ];
    match pair.a.qp.post_send_batch(&mixed) {
        Err(crate::BatchError { posted: 1, error: Error::TooLarge(_) }) => {}
        other => panic!("batch with an oversized inline request: {other:?}"),
    }
    assert_success(&pair.a.wait_one(), 20, WcOpcode::Send);
    assert_success(&pair.b.wait_one(), 4, WcOpcode::Recv);
    assert_empty(&pair.a.cq);
}
