//! Real processes: `lightpath launch` (the library's launcher) starts this test binary as N
//! ranks, which join over the environment, run every collective on shm and check the
//! results; a rank that dies makes the others fail within the timeout, naming it; a
//! mismatched call is reported in debug mode; a foreign server on the store port and a rank
//! joining twice are refused.
//!
//! The ranks are this same binary, started with `--exact worker` and `LPCOLL_ROLE` set; in a
//! normal run the `worker` test returns at once.

use lightpath_collectives::launch::{launch, LaunchOptions};
use lightpath_collectives::{
    bf16, f16, AllreduceAlgo, BroadcastAlgo, CallBuffers, Collective, Communicator, DType, Error, ReduceOp,
};
use std::time::{Duration, Instant};

fn value(rank: usize, i: usize) -> i64 {
    ((rank * 7 + i * 13) % 5) as i64 - 2
}

fn fill<T: Copy>(rank: usize, n: usize, conv: impl Fn(i64) -> T) -> Vec<T> {
    (0..n).map(|i| conv(value(rank, i))).collect()
}

fn expect_sum(p: usize, n: usize) -> Vec<i64> {
    (0..n).map(|i| (0..p).map(|r| value(r, i)).sum()).collect()
}

macro_rules! check {
    ($cond:expr, $($msg:tt)*) => {
        if !$cond {
            eprintln!("rank check failed: {}", format!($($msg)*));
            std::process::exit(1);
        }
    };
}

fn role_all(comm: &Communicator) {
    let (r, p) = (comm.rank(), comm.size());
    // The hosts the job was started on, when the test says (see `LPCOLL_HOSTS`).
    if let Ok(expect) = std::env::var("LPCOLL_EXPECT_HOSTS") {
        let hosts = format!("{:?}", comm.topology().hosts());
        check!(hosts == expect, "hosts {hosts}, expected {expect}");
        let algo = comm.allreduce_algorithm(1 << 20);
        check!(algo == AllreduceAlgo::Hierarchical, "1 MiB allreduce over {hosts} uses {algo:?}");
        check!(comm.allreduce_algorithm(8) == AllreduceAlgo::Hierarchical, "8 B over {hosts}");
        check!(comm.broadcast_algorithm(8) == BroadcastAlgo::Hierarchical, "broadcast over {hosts}");
    }
    for n in [0usize, 1, 7, 1000, 70_000, 600_000] {
        let want = expect_sum(p, n);
        // f32 in place, every algorithm via the default table and sizes.
        let mut v = fill(r, n, |x| x as f32);
        comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        check!(v.iter().zip(&want).all(|(a, b)| *a == *b as f32), "allreduce f32 n={n}");
        // i64 out of place, max.
        let input = fill(r, n, |x| x);
        let mut out = vec![0i64; n];
        comm.allreduce(&input, &mut out, ReduceOp::Max).unwrap();
        check!(
            out.iter().enumerate().all(|(i, m)| *m == (0..p).map(|q| value(q, i)).max().unwrap()),
            "allreduce max n={n}"
        );
        // f16 / bf16 avg and sum.
        let mut h = fill(r, n, |x| f16::from_f32(x as f32));
        comm.allreduce_in_place(&mut h, ReduceOp::Sum).unwrap();
        check!(h.iter().zip(&want).all(|(a, b)| a.to_f32() == *b as f32), "allreduce f16 n={n}");
        let mut b = fill(r, n, |x| bf16::from_f32(x as f32 * p as f32));
        comm.allreduce_in_place(&mut b, ReduceOp::Avg).unwrap();
        check!(b.iter().zip(&want).all(|(a, w)| a.to_f32() == *w as f32), "allreduce bf16 avg n={n}");
        // reduce to the last rank.
        let mut red = fill(r, n, |x| x as i32);
        comm.reduce(&mut red, ReduceOp::Sum, p - 1).unwrap();
        if r == p - 1 {
            check!(red.iter().zip(&want).all(|(a, b)| *a as i64 == *b), "reduce n={n}");
        } else {
            check!(red == fill(r, n, |x| x as i32), "reduce changed a non-root buffer");
        }
        // broadcast from rank 1 % p.
        let root = 1 % p;
        let mut bc = if r == root { fill(root, n, |x| x as f64) } else { vec![0.0; n] };
        comm.broadcast(&mut bc, root).unwrap();
        check!(bc == fill(root, n, |x| x as f64), "broadcast n={n}");
        // allgather.
        let mine = fill(r, n, |x| x as u8);
        let mut all = vec![0u8; n * p];
        comm.allgather(&mine, &mut all).unwrap();
        check!((0..p).all(|q| all[q * n..(q + 1) * n] == fill(q, n, |x| x as u8)[..]), "allgather n={n}");
        // reduce_scatter.
        let input = fill(r, n * p, |x| x as i32);
        let mut out = vec![0i32; n];
        comm.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
        let full = expect_sum(p, n * p);
        check!(out.iter().zip(&full[r * n..]).all(|(a, b)| *a as i64 == *b), "reduce_scatter n={n}");
        // alltoall: block j of rank i holds i * 1000 + j.
        let send: Vec<i32> = (0..p).flat_map(|j| std::iter::repeat_n((r * 1000 + j) as i32, n)).collect();
        let mut recv = vec![0i32; n * p];
        comm.alltoall(&send, &mut recv).unwrap();
        check!(
            (0..p).all(|i| recv[i * n..(i + 1) * n].iter().all(|x| *x == (i * 1000 + r) as i32)),
            "alltoall n={n}"
        );
    }
    // Same-host peers carry small messages in pipes, unless turned off.
    let pipes_off = std::env::var("LIGHTPATH_COLL_PIPE_MAX").is_ok_and(|v| v == "0");
    let transports: Vec<String> = comm.transports().into_iter().flatten().collect();
    check!(
        transports.iter().all(|t| !t.starts_with("rdma/shm") || t.contains("+pipe") != pipes_off),
        "pipes {} expected: {transports:?}",
        if pipes_off { "not" } else { "" }
    );
    // Large messages between same-host ranks are read from the sender's memory, unless
    // turned off (root may always read another process's memory here).
    let cma_off = std::env::var("LIGHTPATH_COLL_CMA_MIN").is_ok_and(|v| v == "0");
    check!(
        transports.iter().all(|t| !t.contains("+pipe") || t.ends_with("+cma") != cma_off),
        "descriptors {} expected: {transports:?}",
        if cma_off { "not" } else { "" }
    );
    // send/recv around a ring.
    let next = (r + 1) % p;
    let prev = (r + p - 1) % p;
    if p > 1 {
        let msg = vec![r as i64; 5000];
        let mut got = vec![0i64; 5000];
        if r % 2 == 0 {
            comm.send(&msg, next).unwrap();
            comm.recv(&mut got, prev).unwrap();
        } else {
            comm.recv(&mut got, prev).unwrap();
            comm.send(&msg, next).unwrap();
        }
        check!(got.iter().all(|x| *x == prev as i64), "send/recv");
    }
    // Nonblocking: two allreduces and a barrier in flight, then wait in order.
    let a = comm.iallreduce(vec![1i64; 1000], ReduceOp::Sum);
    let b = comm.iallreduce(vec![r as f64; 10], ReduceOp::Max);
    let c = comm.ibarrier();
    check!(a.wait().unwrap().iter().all(|x| *x == p as i64), "iallreduce");
    check!(b.wait().unwrap().iter().all(|x| *x == (p - 1) as f64), "iallreduce max");
    c.wait().unwrap();
    // The generic nonblocking form over buffers the caller provides (what bindings use):
    // out of place, two outstanding, waited in reverse order; an inconsistent call is
    // refused at once and issues nothing.
    #[derive(Debug)]
    struct Pair(Vec<u8>, Vec<u8>);
    impl CallBuffers for Pair {
        fn buffers(&mut self) -> (&[u8], &mut [u8]) {
            (&self.0, &mut self.1)
        }
    }
    let n = 1001;
    let bytes = |v: Vec<i32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let ints =
        |b: &[u8]| b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let scatter = Collective::ReduceScatter { count: n, op: ReduceOp::Sum };
    let rs =
        comm.iexecute(scatter.clone(), DType::I32, Pair(bytes(fill(r, n * p, |x| x as i32)), vec![0; 4 * n]));
    let gather = Collective::Allgather { counts: vec![4 * n; p], in_place: false };
    let ag = comm.iexecute(gather, DType::U8, Pair(bytes(fill(r, n, |x| x as i32)), vec![0; 4 * n * p]));
    let refused = comm.iexecute(scatter, DType::I32, Pair(vec![0; 4], vec![0; 4 * n]));
    check!(matches!(refused, Err(Error::InvalidArgument { .. })), "iexecute took a short input: {refused:?}");
    let gathered = ints(&ag.unwrap().wait().unwrap().1);
    check!(
        (0..p).all(|q| gathered[q * n..(q + 1) * n] == fill(q, n, |x| x as i32)[..]),
        "iexecute allgather"
    );
    let scattered = ints(&rs.unwrap().wait().unwrap().1);
    let want: Vec<i32> = (0..n).map(|i| (0..p).map(|q| value(q, r * n + i) as i32).sum()).collect();
    check!(scattered == want, "iexecute reduce_scatter");
    comm.wait_issued();
    // Split into even and odd ranks, reversed order; allreduce the world ranks.
    let sub = comm.split(Some((r % 2) as u32), -(r as i64)).unwrap().unwrap();
    let members: Vec<usize> = (0..p).filter(|q| q % 2 == r % 2).collect();
    check!(
        sub.size() == members.len() && sub.world_ranks()[0] == *members.last().unwrap(),
        "split membership {:?}",
        sub.world_ranks()
    );
    let mut s = [r as i32];
    sub.allreduce_in_place(&mut s, ReduceOp::Sum).unwrap();
    check!(s[0] as usize == members.iter().sum::<usize>(), "split allreduce");
    // Bad input: an error, nothing sent, the communicator still works.
    let mut short = vec![0f32; 3];
    let e = comm.allreduce(&[1f32; 4], &mut short, ReduceOp::Sum).unwrap_err();
    check!(matches!(e, Error::InvalidArgument { .. }), "mismatched lengths: {e}");
    check!(comm.broadcast(&mut short, p).is_err(), "root out of range");
    comm.barrier().unwrap();
    println!(
        "rank {r} of {p}: all collectives correct over {:?}",
        comm.transports().iter().flatten().collect::<Vec<_>>()
    );
}

fn role_die(comm: &Communicator) {
    let (r, p) = (comm.rank(), comm.size());
    comm.barrier().unwrap();
    let victim = p - 1;
    if r == victim {
        // Dies without closing, as a crash or kill -9 would, while the others are in their
        // allreduce loop.
        std::thread::sleep(Duration::from_millis(200));
        std::process::abort();
    }
    let start = Instant::now();
    let mut v = vec![1f32; 4096];
    let err = loop {
        match comm.allreduce_in_place(&mut v, ReduceOp::Sum) {
            Ok(()) => check!(start.elapsed() < Duration::from_secs(5), "allreduce kept succeeding"),
            Err(e) => break e,
        }
    };
    let took = start.elapsed();
    println!("rank {r}: {err} (after {took:?})");
    check!(
        err.rank() == Some(victim),
        "error names rank {:?}, not the dead rank {victim}: {err}",
        err.rank()
    );
    check!(err.op() == Some("allreduce") && err.seq().is_some(), "error lacks op/seq: {err}");
    check!(took < Duration::from_millis(2500), "took {took:?}");
    // Every later call fails at once too.
    check!(comm.barrier().is_err(), "barrier after a failure succeeded");
    std::process::exit(0);
}

/// The victim crashes the moment its fourth allreduce returns, with no pause: the others may
/// still be inside that call. Its part of the call was handed over before it returned (over
/// shm: published in its segment, which a peer drains when the victim's socket hangs up), so
/// their fourth call finishes, and their fifth fails naming the victim, the operation and that
/// call's sequence number (#0 is the barrier joining runs). A death seen while a call needs
/// nothing more from the dead rank does not fail it.
fn role_die_after_a_call(comm: &Communicator) {
    let (r, p) = (comm.rank(), comm.size());
    let victim = p - 1;
    // Small calls (1,000 floats) and ring-sized ones (64 Ki floats).
    let n = if std::env::var("LPCOLL_BIG").is_ok() { 65536 } else { 1000 };
    let mut v = vec![1f32; n];
    for call in 1..=4 {
        if let Err(e) = comm.allreduce_in_place(&mut v, ReduceOp::Sum) {
            eprintln!("rank {r}: allreduce #{call} failed although every rank made it: {e}");
            std::process::exit(1);
        }
    }
    if r == victim {
        std::process::abort();
    }
    let err = match comm.allreduce_in_place(&mut v, ReduceOp::Sum) {
        Ok(()) => {
            eprintln!("rank {r}: allreduce #5 with a dead peer succeeded");
            std::process::exit(1);
        }
        Err(e) => e,
    };
    check!(
        err.rank() == Some(victim) && err.op() == Some("allreduce") && err.seq() == Some(5),
        "rank {r}: expected rank {victim}, allreduce, #5: {err}"
    );
    println!("rank {r}: allreduce #5 failed: {err}");
    std::process::exit(0);
}

fn role_stop(comm: &Communicator) {
    // A rank that stays alive but stops calling: the others time out naming it.
    let (r, p) = (comm.rank(), comm.size());
    comm.barrier().unwrap();
    let victim = p - 1;
    if r == victim {
        std::thread::sleep(Duration::from_secs(6));
        std::process::exit(0);
    }
    let start = Instant::now();
    let mut v = vec![1f32; 64];
    let err = comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
    let took = start.elapsed();
    println!("rank {r}: {err} (after {took:?})");
    check!(err.op() == Some("allreduce") && err.seq().is_some(), "error lacks op/seq: {err}");
    // Ranks waiting on the victim directly time out naming it; the others are woken by their
    // abort, which blames it as well.
    check!(
        err.rank() == Some(victim),
        "error names rank {:?}, not the stopped rank {victim}: {err}",
        err.rank()
    );
    check!(took < Duration::from_millis(3000), "took {took:?}");
    std::process::exit(0);
}

fn role_mismatch(comm: Communicator) {
    let r = comm.rank();
    let n = if r == 1 { 11 } else { 10 };
    let mut v = vec![1f32; n];
    let err = comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
    println!("rank {r}: {err}");
    check!(matches!(err, Error::Mismatch { .. }), "expected a mismatch: {err}");
    check!(err.to_string().contains("allreduce #") && err.to_string().contains("11"), "message: {err}");
    // A clean close: the others may still be finishing the fingerprint exchange.
    drop(comm);
    std::process::exit(0);
}

fn role_abort(comm: &Communicator) {
    // Rank 0 blocks in a receive nobody answers; another of its threads aborts 300 ms later.
    // Rank 0's call and every other rank's call fail at once, naming rank 0.
    let r = comm.rank();
    comm.barrier().unwrap();
    let start = Instant::now();
    let err = if r == 0 {
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                comm.abort("test abort");
            });
            let mut buf = [0f32; 4];
            comm.recv(&mut buf, 1).unwrap_err()
        })
    } else {
        let mut v = [1f32; 4];
        comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap_err()
    };
    let took = start.elapsed();
    println!("rank {r}: {err} (after {took:?})");
    check!(matches!(err, Error::Aborted { rank: 0, .. }), "expected an abort naming rank 0: {err}");
    check!(took < Duration::from_millis(1500), "took {took:?}");
    std::process::exit(0);
}

fn role_buffers_change(comm: &Communicator) {
    // Rank 0 starts an allreduce over buffers that shrink before the call's turn (a
    // `CallBuffers` breaking its contract): its request fails, and so do the peers' calls
    // (they are told, naming rank 0) and rank 0's next call; nothing panics or hangs.
    #[derive(Debug)]
    struct Shrinking(Vec<u8>, usize);
    impl CallBuffers for Shrinking {
        fn buffers(&mut self) -> (&[u8], &mut [u8]) {
            self.1 += 1;
            let len = if self.1 == 1 { self.0.len() } else { self.0.len() / 2 };
            (&[], &mut self.0[..len])
        }
    }
    let r = comm.rank();
    comm.barrier().unwrap();
    let what = |count| Collective::Allreduce {
        count,
        op: ReduceOp::Sum,
        algo: lightpath_collectives::AllreduceAlgo::Ring,
        in_place: true,
    };
    if r == 0 {
        let req = comm.iexecute(what(64), DType::U8, Shrinking(vec![1; 64], 0)).unwrap();
        let err = req.wait().unwrap_err();
        println!("rank {r}: {err}");
        check!(matches!(err, Error::InvalidArgument { .. }), "expected an argument error: {err}");
        check!(comm.barrier().is_err(), "the communicator still works after the failed call");
    } else {
        let mut v = vec![1u8; 64];
        let err = comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
        println!("rank {r}: {err}");
        check!(err.rank() == Some(0), "expected an error naming rank 0: {err}");
    }
    std::process::exit(0);
}

fn role_issue_while_running(comm: &Communicator) {
    // Rank 0 starts a nonblocking allreduce that cannot finish until rank 1 joins it, then
    // issues a second one: that must return at once (it only queues), and only then does
    // rank 0 tell rank 1 (a marker file) to join both. An issue that waited for the running
    // call would wait for rank 1, which waits for the marker: rank 1 gives up after 10 s.
    let r = comm.rank();
    let marker = std::path::PathBuf::from(std::env::var("LPCOLL_MARKER").expect("a marker path"));
    comm.barrier().unwrap();
    if r == 0 {
        let first = comm.iallreduce(vec![1f32; 4096], ReduceOp::Sum);
        // Let the call thread take the first call and block in it.
        std::thread::sleep(Duration::from_millis(50));
        let second = comm.iallreduce(vec![2i64; 16], ReduceOp::Sum);
        std::fs::write(&marker, b"issued").unwrap();
        let first = first.wait().unwrap();
        let second = second.wait().unwrap();
        check!(first.iter().all(|v| *v == 2.0), "first allreduce");
        check!(second.iter().all(|v| *v == 4), "second allreduce");
    } else {
        let start = Instant::now();
        while !marker.exists() {
            check!(
                start.elapsed() < Duration::from_secs(10),
                "rank 0's second issue waited for its first call"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut a = vec![1f32; 4096];
        comm.allreduce_in_place(&mut a, ReduceOp::Sum).unwrap();
        let mut b = vec![2i64; 16];
        comm.allreduce_in_place(&mut b, ReduceOp::Sum).unwrap();
        check!(a.iter().all(|v| *v == 2.0) && b.iter().all(|v| *v == 4), "rank 1's results");
    }
    std::process::exit(0);
}

/// The rank side: runs only when started by one of the tests below.
#[test]
fn worker() {
    let Ok(role) = std::env::var("LPCOLL_ROLE") else { return };
    // `LPCOLL_HOSTS=a,a,b,b`: rank r says it runs on host `a`, `a`, `b`, ... (one machine
    // standing in for several, through `LIGHTPATH_COLL_HOST`).
    if let Ok(hosts) = std::env::var("LPCOLL_HOSTS") {
        let env = lightpath_collectives::bootstrap::detect().expect("a launcher's environment");
        let host = hosts.split(',').nth(env.rank).expect("a host per rank").to_string();
        std::env::set_var("LIGHTPATH_COLL_HOST", host);
    }
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("joining failed: {e}");
            std::process::exit(2);
        }
    };
    match role.as_str() {
        "all" => role_all(&comm),
        "die" => role_die(&comm),
        "die_after_a_call" => role_die_after_a_call(&comm),
        "stop" => role_stop(&comm),
        "mismatch" => return role_mismatch(comm),
        "abort" => role_abort(&comm),
        "buffers_change" => role_buffers_change(&comm),
        "issue_while_running" => role_issue_while_running(&comm),
        other => panic!("unknown role {other}"),
    }
    drop(comm);
}

/// One job at a time: on two cores, several 8-rank jobs at once starve each other.
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(ranks: usize, role: &str, extra: &[(&str, &str)]) -> lightpath_collectives::launch::LaunchOutcome {
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    let mut opts = LaunchOptions::new(ranks);
    opts.grace = Duration::from_secs(20);
    opts.env.push(("LPCOLL_ROLE".into(), role.into()));
    for (k, v) in extra {
        opts.env.push((k.to_string(), v.to_string()));
    }
    let args: Vec<String> =
        ["--exact", "worker", "--nocapture", "--test-threads=1"].map(String::from).to_vec();
    launch(exe.to_str().unwrap(), &args, &opts).unwrap()
}

#[test]
fn every_collective_on_1_to_4_ranks_over_shm() {
    for ranks in [1, 2, 3, 4] {
        let out = run(ranks, "all", &[("LIGHTPATH_COLL_TIMEOUT_MS", "20000")]);
        assert_eq!(out.first_failure, None, "{ranks} ranks: {:?}", out.statuses);
    }
}

#[test]
fn every_collective_on_8_ranks_with_forced_algorithms() {
    for (var, value) in [
        ("LIGHTPATH_COLL_ALLREDUCE", "ring"),
        ("LIGHTPATH_COLL_ALLREDUCE", "rabenseifner"),
        ("LIGHTPATH_COLL_BCAST", "chain:4096"),
        ("LIGHTPATH_COLL_PIPE_MAX", "0"),
        ("LIGHTPATH_COLL_PIPE_MAX", "1000000"),
        ("LIGHTPATH_COLL_CMA_MIN", "0"),
        ("LIGHTPATH_COLL_CMA_MIN", "5000"),
    ] {
        let out = run(
            if value == "ring" { 5 } else { 8 },
            "all",
            &[(var, value), ("LIGHTPATH_COLL_TIMEOUT_MS", "20000")],
        );
        assert_eq!(out.first_failure, None, "{var}={value}: {:?}", out.statuses);
    }
}

/// Messages read from the sender's memory, half of each copied by the sender into the
/// receiver (`LIGHTPATH_COLL_CMA_HELP_MIN`): every collective gives the reference result with
/// every descriptor message helped, on an odd and an even number of ranks; and a rank that
/// dies mid-job still fails the others' calls, naming it.
#[test]
fn every_collective_with_descriptor_messages_copied_half_by_their_sender() {
    let env = [
        ("LIGHTPATH_COLL_CMA_MIN", "5000"),
        ("LIGHTPATH_COLL_CMA_HELP_MIN", "5000"),
        ("LIGHTPATH_COLL_TIMEOUT_MS", "20000"),
    ];
    for ranks in [2, 3, 4] {
        let out = run(ranks, "all", &env);
        assert_eq!(out.first_failure, None, "{ranks} ranks: {:?}", out.statuses);
    }
    let out = run(3, "die", &env[..2]);
    assert!(!out.statuses[2].success());
    for (r, s) in out.statuses[..2].iter().enumerate() {
        assert!(s.success(), "rank {r} {s:?}");
    }
}

/// Ranks that say they run on different hosts (`LIGHTPATH_COLL_HOST`) allreduce
/// hierarchically: every collective, with hosts round-robin and uneven.
#[test]
fn every_collective_over_hosts_with_hierarchical_allreduce() {
    for (hosts, expect) in [("x,y,x,y", "[[0, 2], [1, 3]]"), ("a,a,a,b,b", "[[0, 1, 2], [3, 4]]")] {
        let ranks = hosts.split(',').count();
        let out = run(
            ranks,
            "all",
            &[
                ("LPCOLL_HOSTS", hosts),
                ("LPCOLL_EXPECT_HOSTS", expect),
                ("LIGHTPATH_COLL_TIMEOUT_MS", "20000"),
            ],
        );
        assert_eq!(out.first_failure, None, "hosts {hosts}: {:?}", out.statuses);
    }
}

#[test]
fn a_dead_rank_fails_every_other_ranks_call_within_the_timeout_naming_it() {
    for ranks in [2, 4] {
        let out = run(ranks, "die", &[]);
        // The victim aborted (signal); every other rank checked its error and exited 0.
        assert!(!out.statuses[ranks - 1].success());
        for (r, s) in out.statuses[..ranks - 1].iter().enumerate() {
            assert!(s.success(), "{ranks} ranks: rank {r} {s:?}");
        }
    }
}

#[test]
fn a_rank_that_crashes_right_after_a_call_fails_the_others_naming_it() {
    // Timing decides whether the others are still inside call #4 when the victim dies; repeat.
    for (ranks, big) in [(3, false), (4, false), (3, true), (2, false), (3, false), (4, true)] {
        let extra: &[(&str, &str)] = if big { &[("LPCOLL_BIG", "1")] } else { &[] };
        let out = run(ranks, "die_after_a_call", extra);
        assert!(!out.statuses[ranks - 1].success(), "the victim aborts");
        for (r, s) in out.statuses[..ranks - 1].iter().enumerate() {
            assert!(s.success(), "{ranks} ranks (big {big}): rank {r} {s:?}");
        }
    }
}

#[test]
fn a_stopped_rank_times_out_every_other_rank_naming_it() {
    let out = run(4, "stop", &[]);
    for (r, s) in out.statuses.iter().enumerate() {
        assert!(s.success(), "rank {r} {s:?}");
    }
}

#[test]
fn buffers_that_change_under_a_nonblocking_call_fail_it_and_the_peers() {
    let out = run(2, "buffers_change", &[]);
    for (r, s) in out.statuses.iter().enumerate() {
        assert!(s.success(), "rank {r} {s:?}");
    }
}

#[test]
fn a_nonblocking_call_issued_while_another_runs_returns_at_once() {
    let marker = std::env::temp_dir().join(format!("lpcoll-issued-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let out = run(
        2,
        "issue_while_running",
        &[("LPCOLL_MARKER", marker.to_str().unwrap()), ("LIGHTPATH_COLL_TIMEOUT_MS", "30000")],
    );
    let _ = std::fs::remove_file(&marker);
    for (r, s) in out.statuses.iter().enumerate() {
        assert!(s.success(), "rank {r} {s:?}");
    }
}

#[test]
fn abort_wakes_this_ranks_blocked_call_and_every_peer() {
    let out = run(3, "abort", &[]);
    for (r, s) in out.statuses.iter().enumerate() {
        assert!(s.success(), "rank {r} {s:?}");
    }
}

#[test]
fn mismatched_counts_are_reported_in_debug_mode() {
    let out = run(3, "mismatch", &[("LIGHTPATH_COLL_DEBUG", "1")]);
    for (r, s) in out.statuses.iter().enumerate() {
        assert!(s.success(), "rank {r} {s:?}");
    }
}

#[test]
fn a_foreign_server_on_the_store_port_is_refused() {
    // Something that accepts and answers garbage.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            use std::io::Write;
            let mut c = c;
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        }
    });
    let env = lightpath_collectives::bootstrap::JobEnv {
        launcher: lightpath_collectives::bootstrap::Launcher::Lightpath,
        rank: 1,
        size: 2,
        local_rank: 1,
        local_size: 2,
        store: addr.to_string(),
        serve_store: false,
        key_prefix: "t/".into(),
    };
    let start = Instant::now();
    let err = Communicator::init(&env, Default::default()).unwrap_err();
    assert!(matches!(err, Error::Bootstrap { .. }) && err.to_string().contains("TCPStore"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_rank_joining_twice_is_refused() {
    let server = lightpath_collectives::store::StoreServer::bind("127.0.0.1:0").unwrap();
    let env = lightpath_collectives::bootstrap::JobEnv {
        launcher: lightpath_collectives::bootstrap::Launcher::Lightpath,
        rank: 0,
        size: 2,
        local_rank: 0,
        local_size: 2,
        store: server.local_addr().to_string(),
        serve_store: false,
        key_prefix: "twice/".into(),
    };
    // Pretend rank 0 already joined.
    let mut client =
        lightpath_collectives::store::StoreClient::connect(server.local_addr(), Duration::from_secs(5))
            .unwrap();
    client.add("twice/join/0", 1).unwrap();
    let err = Communicator::init(&env, Default::default()).unwrap_err();
    assert!(err.to_string().contains("joined twice"), "{err}");
    let _ = DType::F32;
}

/// Starts `n` ranks of this binary's worker with per-rank environment, as a launcher would,
/// and returns whether every one succeeded (killing stragglers after two minutes).
fn spawn_ranks(
    n: usize,
    role: &str,
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<std::process::ExitStatus> {
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<std::process::Child> = (0..n)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
                .env("LPCOLL_ROLE", role)
                .env("LIGHTPATH_COLL_TIMEOUT_MS", "20000")
                .envs(env(r))
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut statuses = vec![None; n];
    while statuses.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if statuses[r].is_none() {
                statuses[r] = c.try_wait().unwrap();
                if statuses[r].is_none() && Instant::now() > deadline {
                    let _ = c.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    statuses.into_iter().map(Option::unwrap).collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn torchrun_environment_with_rank_0_serving_the_store() {
    let port = free_port().to_string();
    let statuses = spawn_ranks(3, "all", |r| {
        [
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".into()),
            ("LOCAL_RANK", r.to_string()),
            ("LOCAL_WORLD_SIZE", "3".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .to_vec()
    });
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
}

#[test]
fn torchrun_environment_with_the_agents_store() {
    // torchrun's agent serves a TCPStore on MASTER_PORT and tells workers so; this store
    // speaks the same protocol and plays the agent's part.
    let store = lightpath_collectives::store::StoreServer::bind("127.0.0.1:0").unwrap();
    let port = store.local_addr().port().to_string();
    let statuses = spawn_ranks(2, "all", |r| {
        [
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", r.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCHELASTIC_RUN_ID", "test".into()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .to_vec()
    });
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
}

#[test]
fn slurm_environment() {
    // The variables srun sets per task; rank 0 serves the store at 61440 + job id % 4096 on
    // the first host of the step's node list.
    let job = (free_port() as u64 % 4096).to_string();
    let statuses = spawn_ranks(2, "all", |r| {
        [
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", r.to_string()),
            ("SLURM_JOB_ID", job.clone()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_STEP_NODELIST", "localhost".into()),
            ("SLURM_STEP_TASKS_PER_NODE", "2".into()),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .to_vec()
    });
    assert!(statuses.iter().all(|s| s.success()), "{statuses:?}");
}

#[test]
fn under_open_mpi_mpirun() {
    let Ok(mpirun) = which("mpirun") else {
        eprintln!("SKIPPED: mpirun not found (scripts/ci-deps/collectives.sh installs Debian's openmpi-bin)");
        return;
    };
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(mpirun)
        .args([
            "--oversubscribe",
            "-n",
            "3",
            "-x",
            "LPCOLL_ROLE=all",
            "-x",
            "LIGHTPATH_COLL_TIMEOUT_MS=20000",
        ])
        .arg(&exe)
        .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mpirun: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches("all collectives correct").count(), 3, "{text}");
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(name)).find(|p| p.is_file()))
        .ok_or(())
}

/// Runs `ip ARGS`, panicking with its stderr on failure.
fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip").args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Two network namespaces joined by a veth pair (`NET.1` in `a`, `NET.2` in `b`), removed
/// when dropped. `None` (and SKIPPED printed) without root or iproute2.
struct Namespaces {
    a: String,
    b: String,
}

impl Namespaces {
    fn create(prefix: &str, net: &str) -> Option<Namespaces> {
        let is_root = std::fs::read_to_string("/proc/self/status")
            .map(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")))
            .unwrap_or(false);
        if !is_root || which("ip").is_err() {
            eprintln!("SKIPPED: needs root and iproute2's ip to create network namespaces");
            return None;
        }
        let tag = std::process::id() % 100_000;
        let (a, b) = (format!("{prefix}{tag}a"), format!("{prefix}{tag}b"));
        let (va, vb) = (format!("{prefix}v{tag}a"), format!("{prefix}v{tag}b"));
        ip(&["netns", "add", &a]);
        let mut made = Namespaces { a: a.clone(), b: String::new() };
        ip(&["netns", "add", &b]);
        made.b = b.clone();
        ip(&["link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b]);
        for (ns, dev, host) in [(&a, &va, 1), (&b, &vb, 2)] {
            ip(&["-n", ns, "addr", "add", &format!("{net}.{host}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        Some(made)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b].into_iter().filter(|ns| !ns.is_empty()) {
            let _ = std::process::Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Two "hosts" as network namespaces joined by a veth pair, two ranks in each: shm inside a
/// namespace, soft (RoCE v2 over UDP) between them, in one job (torchrun's environment, rank 0
/// serving the store).
#[test]
fn hosts_as_network_namespaces_soft_between_shm_inside() {
    let Some(net) = Namespaces::create("lpc", "10.231.0") else { return };
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = (&net.a, &net.b);
    let exe = std::env::current_exe().unwrap();
    let port = "29517";
    let mut children: Vec<std::process::Child> = (0..4)
        .map(|r| {
            let ns = if r < 2 { &a } else { &b };
            std::process::Command::new("ip")
                .args(["netns", "exec", ns])
                .arg(&exe)
                .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
                .env("LPCOLL_ROLE", "all")
                .env("LPCOLL_EXPECT_HOSTS", "[[0, 1], [2, 3]]")
                .env("LIGHTPATH_COLL_TIMEOUT_MS", "30000")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "4")
                .env("LOCAL_RANK", (r % 2).to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "10.231.0.1")
                .env("MASTER_PORT", port)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut outputs = Vec::new();
    for c in &mut children {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                let mut text = String::new();
                use std::io::Read;
                c.stdout.take().unwrap().read_to_string(&mut text).unwrap();
                outputs.push((status, text));
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for (r, (status, text)) in outputs.iter().enumerate() {
        assert!(status.success(), "rank {r}: {status:?}\n{text}");
        assert!(
            text.contains("rdma/shm") && text.contains("rdma/soft"),
            "rank {r} should reach its namespace peer over shm and the others over soft: {text}"
        );
    }
}

/// `lightpath launch --hosts` with network namespaces as the hosts (`ip netns exec {host} sh
/// -c` as the agent), 2 ranks in each: rank 0 serves the store in the first namespace, the
/// ranks see two hosts and run every collective.
#[test]
fn launch_over_hosts_as_network_namespaces() {
    let Some(net) = Namespaces::create("lph", "10.232.0") else { return };
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    let mut opts = LaunchOptions::new(4);
    opts.grace = Duration::from_secs(20);
    opts.hosts = vec![(net.a.clone(), 2), (net.b.clone(), 2)];
    opts.agent = ["ip", "netns", "exec", "{host}", "sh", "-c"].map(String::from).to_vec();
    opts.store_addr = Some("10.232.0.1".into());
    for (k, v) in [
        ("LPCOLL_ROLE", "all"),
        ("LPCOLL_EXPECT_HOSTS", "[[0, 1], [2, 3]]"),
        ("LIGHTPATH_COLL_TIMEOUT_MS", "30000"),
    ] {
        opts.env.push((k.into(), v.into()));
    }
    let args: Vec<String> =
        ["--exact", "worker", "--nocapture", "--test-threads=1"].map(String::from).to_vec();
    let out = launch(exe.to_str().unwrap(), &args, &opts).unwrap();
    assert_eq!(out.first_failure, None, "{:?}", out.statuses);
}

#[test]
fn under_slurm_srun() {
    let ready = which("srun").is_ok()
        && std::process::Command::new("sinfo")
            .args(["-h", "-o", "%T"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("idle"));
    if !ready {
        eprintln!(
            "SKIPPED: no Slurm node answers (scripts/ci-deps/slurm.sh sets up a single-node slurm-wlm)"
        );
        return;
    }
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("srun")
        .args(["-n", "3", "--overcommit", "--time=5"])
        .arg(&exe)
        .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
        .env("LPCOLL_ROLE", "all")
        .env("LIGHTPATH_COLL_TIMEOUT_MS", "20000")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "srun: {:?}\n{text}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.matches("all collectives correct").count(), 3, "{text}");
}

/// Real torchrun (Debian's python3-torch, `python3 -m torch.distributed.run`, with
/// `--redirects 1 --tee 1`, which torch 1.13 needs on Python 3.11): `--standalone` (rank 0
/// serves the store on MASTER_PORT) and a static rendezvous (the agent serves its TCPStore
/// there and the ranks join it as clients, in torch 1.13's query numbering).
#[test]
fn under_real_torchrun() {
    let python = "/usr/bin/python3";
    let has_torch = std::process::Command::new(python)
        .args(["-c", "import torch.distributed.run"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        eprintln!("SKIPPED: no torch.distributed.run for /usr/bin/python3 (scripts/ci-deps/torch.sh installs Debian's python3-torch)");
        return;
    }
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    for mode in [vec!["--standalone".to_string()], vec!["--master_port".to_string(), free_port().to_string()]]
    {
        let out = std::process::Command::new(python)
            .args([
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--redirects",
                "1",
                "--tee",
                "1",
                "--no_python",
            ])
            .args(&mode)
            .arg(&exe)
            .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
            .env("LPCOLL_ROLE", "all")
            .env("LIGHTPATH_COLL_TIMEOUT_MS", "20000")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "torchrun {mode:?}: {:?}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(text.matches("all collectives correct").count(), 2, "torchrun {mode:?}: {text}");
    }
}
