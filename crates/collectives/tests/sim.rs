//! Every schedule, run on the simulated network (no buffering, shuffled order), against a
//! reference computed element by element: every algorithm × sizes 0, 1, odd, large × world
//! sizes 1..=16, every dtype × operator, plus proptest over random shapes and seeds.

use lightpath_collectives::dtype::{self, DType, ReduceOp};
use lightpath_collectives::schedule::{
    build, build_on, AllreduceAlgo, BroadcastAlgo, Collective, Topology, HIERARCHICAL_SPLIT_MIN,
};
use lightpath_collectives::sim::{run, Buffers};
use proptest::prelude::*;

const SIZES: [usize; 6] = [0, 1, 2, 7, 33, 1031];

/// A small integer, exact in every dtype and under every operator for up to 16 ranks
/// (sums stay below 64, products of magnitudes <= 2 below 2^16).
fn value(rank: usize, i: usize, salt: u64) -> i64 {
    let mut x = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ salt;
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % 5) as i64 - 2
}

fn encode(dtype: DType, v: i64) -> Vec<u8> {
    match dtype {
        DType::F32 => (v as f32).to_ne_bytes().to_vec(),
        DType::F64 => (v as f64).to_ne_bytes().to_vec(),
        DType::F16 => half::f16::from_f32(v as f32).to_ne_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f32(v as f32).to_ne_bytes().to_vec(),
        DType::I32 => (v as i32).to_ne_bytes().to_vec(),
        DType::I64 => v.to_ne_bytes().to_vec(),
        DType::U8 => vec![v as u8],
        _ => unreachable!(),
    }
}

fn data(dtype: DType, rank: usize, n: usize, salt: u64) -> Vec<u8> {
    (0..n).flat_map(|i| encode(dtype, value(rank, i, salt))).collect()
}

/// The reduction of every rank's vector, in rank order, with the library's own kernels
/// applied one element at a time (the kernels are tested against scalar code in dtype.rs).
fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for v in &inputs[1..] {
        dtype::reduce(dtype, op, &mut acc, v);
    }
    if op == ReduceOp::Avg {
        dtype::divide(dtype, &mut acc, inputs.len());
    }
    acc
}

fn simulate(what: &Collective, dtype: DType, p: usize, mut bufs: Vec<Buffers>, seed: u64) -> Vec<Buffers> {
    let schedules: Vec<_> = (0..p).map(|r| build(what, dtype, r, p)).collect();
    run(&schedules, &mut bufs, seed).unwrap_or_else(|e| panic!("{what:?} {dtype} p={p}: {e:?}"));
    bufs
}

fn check_allreduce(
    algo: AllreduceAlgo,
    n: usize,
    p: usize,
    dtype: DType,
    op: ReduceOp,
    in_place: bool,
    seed: u64,
) {
    check_allreduce_on(algo, n, &Topology::one_host(p), dtype, op, in_place, seed)
}

fn check_allreduce_on(
    algo: AllreduceAlgo,
    n: usize,
    topology: &Topology,
    dtype: DType,
    op: ReduceOp,
    in_place: bool,
    seed: u64,
) {
    let p = topology.size();
    let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, r, n, seed)).collect();
    let expect = reference(dtype, op, &inputs);
    let bufs = inputs
        .iter()
        .map(|v| {
            if in_place {
                Buffers { input: Vec::new(), output: v.clone() }
            } else {
                Buffers { input: v.clone(), output: vec![0xAB; v.len()] }
            }
        })
        .collect();
    let what = Collective::Allreduce { count: n, op, algo, in_place };
    let mut out: Vec<Buffers> = bufs;
    let schedules: Vec<_> = (0..p).map(|r| build_on(&what, dtype, r, topology)).collect();
    run(&schedules, &mut out, seed).unwrap_or_else(|e| panic!("{what:?} {dtype} {topology:?}: {e:?}"));
    for (r, b) in out.iter().enumerate() {
        assert_eq!(b.output, expect, "{what:?} {dtype} {topology:?} rank {r}");
        if !in_place {
            assert_eq!(b.input, inputs[r], "input changed");
        }
    }
}

#[test]
fn allreduce_every_algorithm_size_and_world_size() {
    for algo in AllreduceAlgo::ALL {
        for p in 1..=16 {
            for n in SIZES {
                check_allreduce(algo, n, p, DType::I32, ReduceOp::Sum, true, 1);
                check_allreduce(algo, n, p, DType::F32, ReduceOp::Sum, false, 2);
            }
        }
    }
}

/// Hosts as rank -> host lists: blocks, round-robin, uneven, one rank alone, many hosts.
const LAYOUTS: [&[u8]; 12] = [
    &[0, 0, 1, 1],
    &[0, 1, 0, 1],
    &[0, 0, 0, 1],
    &[1, 0, 0, 0],
    &[0, 1, 2],
    &[0, 0, 1, 1, 2, 2],
    &[0, 1, 2, 0, 1, 2],
    &[0, 0, 0, 1, 1, 2],
    &[0, 0, 0, 0, 1, 1, 1, 1],
    &[0, 1, 1, 1, 1, 1, 1, 0, 2],
    &[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3],
    &[3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0],
];

#[test]
fn hierarchical_allreduce_on_every_layout() {
    // Both plans: through leaders (small, or uneven hosts) and split among each host's
    // ranks (from HIERARCHICAL_SPLIT_MIN bytes with equal hosts), at sizes that leave some
    // ranks' blocks empty.
    let split = HIERARCHICAL_SPLIT_MIN / 4;
    for layout in LAYOUTS {
        let topology = Topology::from_keys(layout);
        for n in SIZES.into_iter().chain([split - 1, split, split + 5]) {
            check_allreduce_on(
                AllreduceAlgo::Hierarchical,
                n,
                &topology,
                DType::F32,
                ReduceOp::Sum,
                n % 2 == 0,
                3,
            );
            check_allreduce_on(
                AllreduceAlgo::Hierarchical,
                n,
                &topology,
                DType::I32,
                ReduceOp::Avg,
                n % 2 == 1,
                4,
            );
        }
    }
}

#[test]
fn hierarchical_allreduce_every_dtype_and_operator() {
    for layout in [&[0u8, 0, 1, 1][..], &[0, 1, 0, 1, 1]] {
        let topology = Topology::from_keys(layout);
        for n in [37, HIERARCHICAL_SPLIT_MIN / 2 + 3] {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    check_allreduce_on(
                        AllreduceAlgo::Hierarchical,
                        n,
                        &topology,
                        dtype,
                        op,
                        (op as u8).is_multiple_of(2),
                        7,
                    );
                }
            }
        }
    }
}

#[test]
fn hierarchical_broadcast_on_every_layout_from_every_root() {
    // Small and large (each level may pick a chain: 256 KiB segments from 256 KiB on).
    for layout in LAYOUTS {
        let topology = Topology::from_keys(layout);
        let p = topology.size();
        for n in [0, 1, 33, 1031, 70_000] {
            for root in 0..p {
                let src = data(DType::F32, root, n, 6);
                let mut bufs: Vec<Buffers> = (0..p)
                    .map(|r| Buffers {
                        input: Vec::new(),
                        output: if r == root { src.clone() } else { vec![0; src.len()] },
                    })
                    .collect();
                let what = Collective::Broadcast { count: n, root, algo: BroadcastAlgo::Hierarchical };
                let schedules: Vec<_> = (0..p).map(|r| build_on(&what, DType::F32, r, &topology)).collect();
                run(&schedules, &mut bufs, root as u64)
                    .unwrap_or_else(|e| panic!("{what:?} {topology:?}: {e:?}"));
                for (r, b) in bufs.iter().enumerate() {
                    assert_eq!(b.output, src, "{what:?} {topology:?} rank {r}");
                }
            }
        }
    }
}

#[test]
fn topologies_group_ranks_by_host() {
    let t = Topology::from_keys(&["b", "a", "b", "c", "a"]);
    assert_eq!(t.hosts(), &[vec![0, 2], vec![1, 4], vec![3]]);
    assert_eq!((t.host_of(3), t.size()), (2, 5));
    assert!(t.is_multi_level() && !t.is_uniform());
    assert!(Topology::from_keys(&[1, 1, 2, 2]).is_uniform());
    assert!(!Topology::one_host(4).is_multi_level());
    assert!(!Topology::from_keys(&[1, 2, 3]).is_multi_level(), "one rank per host is flat");
}

#[test]
fn allreduce_every_dtype_and_operator() {
    for algo in AllreduceAlgo::ALL {
        for p in [1, 2, 3, 5, 8, 13] {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    check_allreduce(algo, 37, p, dtype, op, p % 2 == 0, p as u64);
                }
            }
        }
    }
}

#[test]
fn reduce_to_every_root() {
    for p in 1..=16 {
        for n in SIZES {
            for root in 0..p {
                for (dtype, op) in
                    [(DType::F64, ReduceOp::Sum), (DType::I64, ReduceOp::Min), (DType::BF16, ReduceOp::Avg)]
                {
                    let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, r, n, 3)).collect();
                    let expect = reference(dtype, op, &inputs);
                    let bufs =
                        inputs.iter().map(|v| Buffers { input: Vec::new(), output: v.clone() }).collect();
                    let what = Collective::Reduce { count: n, op, root };
                    let out = simulate(&what, dtype, p, bufs, root as u64);
                    for (r, b) in out.iter().enumerate() {
                        let want = if r == root { &expect } else { &inputs[r] };
                        assert_eq!(&b.output, want, "{what:?} p={p} rank {r}");
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_every_algorithm_root_size_and_world_size() {
    for algo in [
        BroadcastAlgo::Binomial,
        BroadcastAlgo::Chain { segment: 64 },
        BroadcastAlgo::Chain { segment: 1 << 20 },
        BroadcastAlgo::Hierarchical,
    ] {
        for p in 1..=16 {
            for n in SIZES {
                for root in [0, p / 2, p - 1] {
                    let src = data(DType::F32, root, n, 4);
                    let bufs = (0..p)
                        .map(|r| Buffers {
                            input: Vec::new(),
                            output: if r == root { src.clone() } else { vec![0; src.len()] },
                        })
                        .collect();
                    let what = Collective::Broadcast { count: n, root, algo };
                    for (r, b) in simulate(&what, DType::F32, p, bufs, 5).iter().enumerate() {
                        assert_eq!(b.output, src, "{what:?} p={p} rank {r}");
                    }
                }
            }
        }
    }
}

fn check_allgather(counts: &[usize], in_place: bool, seed: u64) {
    let p = counts.len();
    let blocks: Vec<Vec<u8>> = (0..p).map(|r| data(DType::F16, r, counts[r], seed)).collect();
    let expect: Vec<u8> = blocks.concat();
    let displ: Vec<usize> = counts
        .iter()
        .scan(0, |s, c| {
            let d = *s;
            *s += c * 2;
            Some(d)
        })
        .collect();
    let bufs = (0..p)
        .map(|r| {
            let mut output = vec![0xEE; expect.len()];
            if in_place {
                output[displ[r]..displ[r] + blocks[r].len()].copy_from_slice(&blocks[r]);
                Buffers { input: Vec::new(), output }
            } else {
                Buffers { input: blocks[r].clone(), output }
            }
        })
        .collect();
    let what = Collective::Allgather { counts: counts.to_vec(), in_place };
    for (r, b) in simulate(&what, DType::F16, p, bufs, seed).iter().enumerate() {
        assert_eq!(b.output, expect, "{what:?} rank {r}");
    }
}

#[test]
fn allgather_and_allgatherv() {
    for p in 1..=16 {
        for n in SIZES {
            check_allgather(&vec![n; p], false, 6);
            check_allgather(&vec![n; p], true, 7);
            let varied: Vec<usize> = (0..p).map(|r| (n + r * 3) % (n + 2)).collect();
            check_allgather(&varied, p % 2 == 0, 8);
        }
    }
}

#[test]
fn reduce_scatter_every_size_and_world_size() {
    for p in 1..=16 {
        for n in SIZES {
            for (dtype, op) in
                [(DType::I32, ReduceOp::Sum), (DType::F32, ReduceOp::Max), (DType::U8, ReduceOp::Avg)]
            {
                let inputs: Vec<Vec<u8>> = (0..p).map(|r| data(dtype, r, n * p, 9)).collect();
                let full = reference(dtype, op, &inputs);
                let es = dtype.size();
                let bufs =
                    inputs.iter().map(|v| Buffers { input: v.clone(), output: vec![0; n * es] }).collect();
                let what = Collective::ReduceScatter { count: n, op };
                for (r, b) in simulate(&what, dtype, p, bufs, 10).iter().enumerate() {
                    assert_eq!(
                        b.output,
                        full[r * n * es..(r + 1) * n * es],
                        "{what:?} {dtype} p={p} rank {r}"
                    );
                }
            }
        }
    }
}

/// Rank i sends counts[i][j] elements to rank j.
fn check_alltoall(counts: &[Vec<usize>], seed: u64) {
    let p = counts.len();
    let es = DType::I64.size();
    // Block i->j holds value(i * p + j, k).
    let block = |i: usize, j: usize| data(DType::I64, i * p + j, counts[i][j], seed);
    let bufs = (0..p)
        .map(|i| Buffers {
            input: (0..p).flat_map(|j| block(i, j)).collect(),
            output: vec![0; (0..p).map(|j| counts[j][i]).sum::<usize>() * es],
        })
        .collect();
    let schedules: Vec<_> = (0..p)
        .map(|r| {
            let what = Collective::Alltoall {
                send_counts: counts[r].clone(),
                recv_counts: (0..p).map(|j| counts[j][r]).collect(),
            };
            build(&what, DType::I64, r, p)
        })
        .collect();
    let mut bufs: Vec<Buffers> = bufs;
    run(&schedules, &mut bufs, seed).unwrap_or_else(|e| panic!("alltoall p={p}: {e:?}"));
    for (j, b) in bufs.iter().enumerate() {
        let expect: Vec<u8> = (0..p).flat_map(|i| block(i, j)).collect();
        assert_eq!(b.output, expect, "alltoall p={p} rank {j}");
    }
}

#[test]
fn alltoall_and_alltoallv() {
    for p in 1..=16 {
        for n in SIZES {
            check_alltoall(&vec![vec![n; p]; p], 11);
            let varied: Vec<Vec<usize>> =
                (0..p).map(|i| (0..p).map(|j| (i * 7 + j * 3 + n) % (n + 3)).collect()).collect();
            check_alltoall(&varied, 12);
        }
    }
}

#[test]
fn barrier_and_send_recv() {
    for p in 1..=16 {
        let bufs = vec![Buffers::default(); p];
        simulate(&Collective::Barrier, DType::U8, p, bufs, 13);
    }
    let payload = data(DType::F64, 0, 9, 14);
    let schedules = vec![
        build(&Collective::Send { count: 9, peer: 1 }, DType::F64, 0, 2),
        build(&Collective::Recv { count: 9, peer: 0 }, DType::F64, 1, 2),
    ];
    let mut bufs = vec![
        Buffers { input: payload.clone(), output: Vec::new() },
        Buffers { input: Vec::new(), output: vec![0; payload.len()] },
    ];
    run(&schedules, &mut bufs, 15).unwrap();
    assert_eq!(bufs[1].output, payload);
}

#[test]
fn the_simulator_catches_mismatched_and_deadlocked_plans() {
    // Rank 1 expects 2 elements where rank 0 sends 3: a length mismatch, not silent corruption.
    let schedules = vec![
        build(&Collective::Send { count: 3, peer: 1 }, DType::I32, 0, 2),
        build(&Collective::Recv { count: 2, peer: 0 }, DType::I32, 1, 2),
    ];
    let mut bufs = vec![
        Buffers { input: vec![0; 12], output: Vec::new() },
        Buffers { input: Vec::new(), output: vec![0; 8] },
    ];
    assert!(matches!(
        run(&schedules, &mut bufs, 1),
        Err(lightpath_collectives::sim::SimError::LengthMismatch { .. })
    ));
    // Both ranks receive first: with no buffering nobody can move.
    let schedules = vec![
        build(&Collective::Recv { count: 1, peer: 1 }, DType::I32, 0, 2),
        build(&Collective::Recv { count: 1, peer: 0 }, DType::I32, 1, 2),
    ];
    let mut bufs = vec![Buffers { input: Vec::new(), output: vec![0; 4] }; 2];
    assert!(matches!(
        run(&schedules, &mut bufs, 1),
        Err(lightpath_collectives::sim::SimError::Deadlock { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn allreduce_random_shapes(p in 1usize..=16, n in 0usize..300, algo in 0usize..4, op in 0usize..5, dt in 0usize..7, seed in any::<u64>(), in_place in any::<bool>()) {
        check_allreduce(AllreduceAlgo::ALL[algo], n, p, DType::ALL[dt], ReduceOp::ALL[op], in_place, seed);
    }

    #[test]
    fn hierarchical_allreduce_random_layouts(hosts in proptest::collection::vec(0u8..4, 1..=12), n in 0usize..300, op in 0usize..5, seed in any::<u64>(), in_place in any::<bool>()) {
        check_allreduce_on(AllreduceAlgo::Hierarchical, n, &Topology::from_keys(&hosts), DType::I64, ReduceOp::ALL[op], in_place, seed);
    }

    #[test]
    fn allgatherv_random_counts(counts in proptest::collection::vec(0usize..40, 1..=16), seed in any::<u64>(), in_place in any::<bool>()) {
        check_allgather(&counts, in_place, seed);
    }
}
