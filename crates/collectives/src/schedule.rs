//! Schedules: what one rank does for one collective, as data, with no I/O.
//!
//! A [`Schedule`] is a list of [`Round`]s. Within a round, the communication steps (`Send`,
//! `Recv`, `RecvReduce`) run concurrently, in any interleaving; once all of them have
//! completed, the local steps (`Copy`, `Reduce`, `Divide`) run in order; then the next round
//! starts. Messages between two ranks are matched by order (the transport is a FIFO byte
//! stream per pair), so a builder's duty is that the sends from rank `a` to rank `b` and the
//! receives of `b` from `a` have the same lengths in the same order, and that the rounds of
//! all ranks never wait on each other in a cycle even if every send completes only when the
//! receiver has taken it (the simulated network checks both, see [`crate::sim`]).
//!
//! Zero-length steps are never emitted (so a rank's message order is the same whether or not
//! an empty block exists). A `RecvReduce` combines bytes into its region as they arrive, so
//! the reduction overlaps the transfer of the rest; a round never sends from the region it
//! receives into.
//!
//! The builders are deterministic functions of (rank, size, counts, algorithm): every rank
//! derives its part of the same global plan with no communication, and floating-point results
//! are bit-identical on every rank (each output element is reduced on one rank, or by the same
//! commutative pair-wise operations on both partners, then copied).

use crate::dtype::{DType, ReduceOp};

/// From this many bytes on, a hierarchical allreduce over hosts with equal numbers of ranks
/// splits the vector among each host's ranks (reduce-scatter, allreduce of the blocks across
/// hosts, allgather); below it, it goes through one leader per host (fewer, larger messages,
/// as small calls want).
pub const HIERARCHICAL_SPLIT_MIN: usize = 64 << 10;

/// Which host each rank of a group runs on: what [`AllreduceAlgo::Hierarchical`] follows.
/// Hosts are numbered in the order of their first rank; each host lists its ranks in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    host_of: Vec<usize>,
    hosts: Vec<Vec<usize>>,
}

impl Topology {
    /// `size` ranks on one host.
    pub fn one_host(size: usize) -> Topology {
        Topology {
            host_of: vec![0; size],
            hosts: if size == 0 { Vec::new() } else { vec![(0..size).collect()] },
        }
    }

    /// The topology of ranks whose hosts are named by `keys` (one per rank; equal keys, same
    /// host).
    pub fn from_keys<K: PartialEq>(keys: &[K]) -> Topology {
        let mut firsts: Vec<&K> = Vec::new();
        let mut host_of = Vec::with_capacity(keys.len());
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (rank, key) in keys.iter().enumerate() {
            let host = match firsts.iter().position(|k| *k == key) {
                Some(host) => host,
                None => {
                    firsts.push(key);
                    hosts.push(Vec::new());
                    hosts.len() - 1
                }
            };
            host_of.push(host);
            hosts[host].push(rank);
        }
        Topology { host_of, hosts }
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.host_of.len()
    }

    /// The ranks of each host.
    pub fn hosts(&self) -> &[Vec<usize>] {
        &self.hosts
    }

    /// The host of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// Whether a hierarchical plan differs from a flat one: several hosts, and more than one
    /// rank on at least one of them.
    pub fn is_multi_level(&self) -> bool {
        self.hosts.len() > 1 && self.hosts.iter().any(|h| h.len() > 1)
    }

    /// Whether every host has as many ranks.
    pub fn is_uniform(&self) -> bool {
        self.hosts.windows(2).all(|w| w[0].len() == w[1].len())
    }
}

/// Which of a call's buffers a region lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The caller's input (out-of-place calls); never written.
    Input,
    /// The caller's output (in-place calls: input and output).
    Output,
    /// Working memory the driver allocates ([`Schedule::scratch`] bytes).
    Scratch,
}

/// `len` bytes at `offset` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The buffer.
    pub buf: Buf,
    /// Byte offset.
    pub offset: usize,
    /// Byte length.
    pub len: usize,
}

impl Region {
    fn new(buf: Buf, offset: usize, len: usize) -> Region {
        Region { buf, offset, len }
    }
}

/// One step of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send the region's bytes to `peer`.
    Send { peer: usize, from: Region },
    /// Receive exactly `into.len` bytes from `peer` into the region.
    Recv { peer: usize, into: Region },
    /// Receive exactly `into.len` bytes from `peer` and reduce them into the region.
    RecvReduce { peer: usize, into: Region },
    /// Receive exactly `into.len` bytes from `peer` and store `with op received` into `into`
    /// (`with` has the same length, in another buffer): a `RecvReduce` whose left operand is
    /// read from elsewhere, so that nothing has to copy it into `into` first.
    RecvCombine { peer: usize, with: Region, into: Region },
    /// Local copy (after the round's communication).
    Copy { from: Region, into: Region },
    /// Local reduction `into = into op from` (after the round's communication).
    Reduce { from: Region, into: Region },
    /// Divide every element of the region by `by` (the end of `Avg`).
    Divide { region: Region, by: usize },
}

impl Step {
    /// Whether the step is communication (runs concurrently in its round).
    pub fn is_comm(&self) -> bool {
        matches!(
            self,
            Step::Send { .. } | Step::Recv { .. } | Step::RecvReduce { .. } | Step::RecvCombine { .. }
        )
    }
}

/// Steps that run together; see the module docs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// The steps, communication and local mixed; local ones run after all communication, in order.
    pub steps: Vec<Step>,
}

/// One rank's plan for one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The rounds, in order.
    pub rounds: Vec<Round>,
    /// Bytes of scratch memory the plan uses.
    pub scratch: usize,
    /// Element type (for reductions).
    pub dtype: DType,
    /// Reduction operator (unused by data-movement collectives).
    pub op: ReduceOp,
}

/// Allreduce algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AllreduceAlgo {
    /// Ring: reduce-scatter then allgather around the ring, `2(p-1)` steps of `S/p` bytes.
    Ring,
    /// Recursive doubling: `lg p` exchanges of the whole vector (non-powers of two fold first).
    RecursiveDoubling,
    /// Rabenseifner: recursive-halving reduce-scatter, recursive-doubling allgather
    /// (non-powers of two fold first).
    Rabenseifner,
    /// Hierarchical, over the group's [`Topology`]: the ranks of each host first combine
    /// among themselves (shared memory), then only what crosses hosts goes over the network,
    /// then each host spreads the result. With the same number of ranks on every host and at
    /// least [`HIERARCHICAL_SPLIT_MIN`] bytes: a ring reduce-scatter inside each host, an
    /// allreduce of each block among the ranks holding it on every host (each rank carries
    /// `1/L` of the vector across hosts, all `L` of a host at once), a ring allgather inside
    /// each host. Otherwise: a binomial reduce to each host's first rank, an allreduce among
    /// those leaders, a binomial broadcast inside each host. On one host it is a ring (or a
    /// reduce and a broadcast); with one rank per host, the network allreduce alone.
    Hierarchical,
}

impl AllreduceAlgo {
    /// Every algorithm.
    pub const ALL: [AllreduceAlgo; 4] = [
        AllreduceAlgo::Ring,
        AllreduceAlgo::RecursiveDoubling,
        AllreduceAlgo::Rabenseifner,
        AllreduceAlgo::Hierarchical,
    ];

    /// Name used by `LIGHTPATH_COLL_ALLREDUCE` and in tables.
    pub fn name(self) -> &'static str {
        match self {
            AllreduceAlgo::Ring => "ring",
            AllreduceAlgo::RecursiveDoubling => "rd",
            AllreduceAlgo::Rabenseifner => "rabenseifner",
            AllreduceAlgo::Hierarchical => "hierarchical",
        }
    }

    /// Parses [`AllreduceAlgo::name`].
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == text)
    }
}

/// Broadcast algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BroadcastAlgo {
    /// Binomial tree: `ceil(lg p)` rounds of the whole message.
    Binomial,
    /// Pipelined chain: segments flow root → next → ..., `segments + p - 2` rounds.
    Chain {
        /// Segment size in bytes (rounded down to whole elements, at least one).
        segment: usize,
    },
    /// Hierarchical, over the group's [`Topology`]: a broadcast among one rank per host (the
    /// root on its own host, the first rank on the others), then one inside each host from
    /// that rank; each level picks binomial or chain for its own size. One message per host
    /// crosses the network.
    Hierarchical,
}

impl BroadcastAlgo {
    /// Name used by `LIGHTPATH_COLL_BCAST` and in tables.
    pub fn name(self) -> &'static str {
        match self {
            BroadcastAlgo::Binomial => "binomial",
            BroadcastAlgo::Chain { .. } => "chain",
            BroadcastAlgo::Hierarchical => "hierarchical",
        }
    }
}

/// What to compute: a collective and its shape (counts in elements).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Collective {
    /// Every rank's output = op over all ranks' inputs. In place: the input is `Output`.
    Allreduce { count: usize, op: ReduceOp, algo: AllreduceAlgo, in_place: bool },
    /// The root's `Output` = op over every rank's `Output` (in place; other ranks' buffers unchanged).
    Reduce { count: usize, op: ReduceOp, root: usize },
    /// Every rank's `Output` = the root's.
    Broadcast { count: usize, root: usize, algo: BroadcastAlgo },
    /// `Output` = every rank's block, concatenated in rank order; block `r` has `counts[r]`
    /// elements. Out of place the block comes from `Input`; in place it is already in `Output`.
    Allgather { counts: Vec<usize>, in_place: bool },
    /// `Input` holds `size` blocks of `count`; `Output` (`count`) = op over all ranks' block `rank`.
    ReduceScatter { count: usize, op: ReduceOp },
    /// `Input` holds a block per destination (`send_counts`), `Output` a block per source
    /// (`recv_counts`), both in rank order.
    Alltoall { send_counts: Vec<usize>, recv_counts: Vec<usize> },
    /// No data; returns once every rank has entered.
    Barrier,
    /// Send `count` elements of `Input` to `peer`.
    Send { count: usize, peer: usize },
    /// Receive `count` elements from `peer` into `Output`.
    Recv { count: usize, peer: usize },
}

impl Collective {
    /// The operation's name, for errors and fingerprints.
    pub fn name(&self) -> &'static str {
        match self {
            Collective::Allreduce { .. } => "allreduce",
            Collective::Reduce { .. } => "reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Allgather { .. } => "allgather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::Alltoall { .. } => "alltoall",
            Collective::Barrier => "barrier",
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
        }
    }
}

/// Collects steps, dropping empty ones.
///
/// The algorithms below are written for ranks `0..p` of a whole vector. A hierarchical
/// schedule runs them on a subgroup (the ranks of one host, one rank per host) and on a block
/// of the vector: while `members` is set, a step's peer `i` is `members[i]`, and while `base`
/// is set, element `e` of the input and output is element `base + e` (scratch is unaffected:
/// each phase uses it from offset 0, and no phase leaves anything in it for the next).
struct Builder {
    rounds: Vec<Round>,
    current: Vec<Step>,
    es: usize,
    members: Option<Vec<usize>>,
    base: usize,
}

impl Builder {
    fn new(dtype: DType) -> Self {
        Builder { rounds: Vec::new(), current: Vec::new(), es: dtype.size(), members: None, base: 0 }
    }
    /// Region of elements `[start, end)` of `buf`.
    fn r(&self, buf: Buf, start: usize, end: usize) -> Region {
        let base = if buf == Buf::Scratch { 0 } else { self.base };
        Region::new(buf, (base + start) * self.es, (end - start) * self.es)
    }
    /// Runs `phase` with peers numbered within `members` and elements counted from `base`.
    fn within<R>(&mut self, members: Vec<usize>, base: usize, phase: impl FnOnce(&mut Builder) -> R) -> R {
        let saved = (self.members.replace(members), std::mem::replace(&mut self.base, base));
        let r = phase(self);
        self.end_round();
        (self.members, self.base) = saved;
        r
    }
    fn push(&mut self, mut step: Step) {
        if let Some(members) = &self.members {
            match &mut step {
                Step::Send { peer, .. }
                | Step::Recv { peer, .. }
                | Step::RecvReduce { peer, .. }
                | Step::RecvCombine { peer, .. } => *peer = members[*peer],
                Step::Copy { .. } | Step::Reduce { .. } | Step::Divide { .. } => {}
            }
        }
        let len = match step {
            Step::Send { from, .. } => from.len,
            Step::Recv { into, .. } | Step::RecvReduce { into, .. } | Step::RecvCombine { into, .. } => {
                into.len
            }
            Step::Copy { from, into } => {
                if from == into {
                    0
                } else {
                    into.len
                }
            }
            Step::Reduce { into, .. } => into.len,
            Step::Divide { region, by } => {
                if by == 1 {
                    0
                } else {
                    region.len
                }
            }
        };
        if len > 0 {
            self.current.push(step);
        }
    }
    fn send(&mut self, peer: usize, from: Region) {
        self.push(Step::Send { peer, from });
    }
    fn recv(&mut self, peer: usize, into: Region) {
        self.push(Step::Recv { peer, into });
    }
    fn recv_reduce(&mut self, peer: usize, into: Region) {
        self.push(Step::RecvReduce { peer, into });
    }
    /// Receive from `peer` and store `with op received` into `into`: a `RecvReduce` when `with`
    /// is `into`, else a `RecvCombine` (the two never share a buffer otherwise).
    fn recv_combine(&mut self, peer: usize, with: Region, into: Region) {
        if with == into {
            self.recv_reduce(peer, into);
        } else {
            debug_assert_ne!(with.buf, into.buf);
            self.push(Step::RecvCombine { peer, with, into });
        }
    }
    fn end_round(&mut self) {
        if !self.current.is_empty() {
            self.rounds.push(Round { steps: std::mem::take(&mut self.current) });
        }
    }
    fn finish(mut self, scratch: usize, dtype: DType, op: ReduceOp) -> Schedule {
        self.end_round();
        Schedule { rounds: self.rounds, scratch, dtype, op }
    }
}

/// Builds rank `rank`'s schedule of `what` among `size` ranks of one host. Counts are
/// elements of `dtype`.
///
/// Panics if `rank >= size`, a root or peer is out of range, or a counts vector's length is
/// not `size` (the [`crate::Communicator`] checks these and returns errors first).
pub fn build(what: &Collective, dtype: DType, rank: usize, size: usize) -> Schedule {
    build_on(what, dtype, rank, &Topology::one_host(size))
}

/// Builds rank `rank`'s schedule of `what` among the ranks of `topology` (only
/// [`AllreduceAlgo::Hierarchical`] looks at the hosts; every other plan depends on the
/// group size alone). Panics as [`build`] does.
pub fn build_on(what: &Collective, dtype: DType, rank: usize, topology: &Topology) -> Schedule {
    let size = topology.size();
    assert!(rank < size, "rank {rank} out of range for size {size}");
    let mut b = Builder::new(dtype);
    let mut op = ReduceOp::Sum;
    let mut scratch = 0;
    match what {
        Collective::Allreduce { count, op: o, algo, in_place } => {
            op = *o;
            let n = *count;
            // Out of place, the first step that reads a block reads it from the input and
            // the first reduction into it combines the input with what arrives: no copy of
            // the input into the output first (one pass over the vector less).
            let src = if *in_place { Buf::Output } else { Buf::Input };
            if size == 1 {
                b.push(Step::Copy { from: b.r(src, 0, n), into: b.r(Buf::Output, 0, n) });
            }
            scratch = match algo {
                AllreduceAlgo::Hierarchical => hierarchical_allreduce(&mut b, topology, rank, n, src),
                flat => flat_allreduce(&mut b, *flat, rank, size, n, src),
            };
            if op == ReduceOp::Avg {
                b.push(Step::Divide { region: b.r(Buf::Output, 0, n), by: size });
            }
        }
        Collective::Reduce { count, op: o, root } => {
            op = *o;
            scratch = binomial_reduce(&mut b, rank, size, *count, *root);
            if op == ReduceOp::Avg && rank == *root {
                b.push(Step::Divide { region: b.r(Buf::Output, 0, *count), by: size });
            }
        }
        Collective::Broadcast { count, root, algo } => match algo {
            BroadcastAlgo::Hierarchical => hierarchical_broadcast(&mut b, topology, rank, *count, *root),
            flat => flat_broadcast(&mut b, *flat, rank, size, *count, *root),
        },
        Collective::Allgather { counts, in_place } => {
            assert_eq!(counts.len(), size);
            let displ: Vec<usize> = prefix(counts);
            if !in_place {
                b.push(Step::Copy {
                    from: b.r(Buf::Input, 0, counts[rank]),
                    into: b.r(Buf::Output, displ[rank], displ[rank + 1]),
                });
                b.end_round();
            }
            ring_allgather(&mut b, rank, size, &displ, Buf::Output, 0);
        }
        Collective::ReduceScatter { count, op: o } => {
            op = *o;
            let n = count * size;
            let displ: Vec<usize> = (0..=size).map(|i| i * count).collect();
            let (s, e) = (displ[rank], displ[rank + 1]);
            // Blocks in transit are reduced into scratch from the input as they arrive; the
            // last one, this rank's, straight into the output (no copy of the input first,
            // none of the result after).
            let own = b.r(Buf::Output, 0, *count);
            if size == 1 {
                b.push(Step::Copy { from: b.r(Buf::Input, s, e), into: own });
            } else {
                scratch = n * dtype.size();
            }
            ring_reduce_scatter(&mut b, rank, size, &displ, Buf::Scratch, 1, Buf::Input, Some(own));
            if op == ReduceOp::Avg {
                b.push(Step::Divide { region: b.r(Buf::Output, 0, *count), by: size });
            }
        }
        Collective::Alltoall { send_counts, recv_counts } => {
            assert_eq!(send_counts.len(), size);
            assert_eq!(recv_counts.len(), size);
            let sd = prefix(send_counts);
            let rd = prefix(recv_counts);
            // Every exchange posted at once; the driver progresses them together. Ordered by
            // distance so that with bounded buffers the nearest pairs go first.
            for k in 1..size {
                let to = (rank + k) % size;
                let from = (rank + size - k) % size;
                b.send(to, b.r(Buf::Input, sd[to], sd[to + 1]));
                b.recv(from, b.r(Buf::Output, rd[from], rd[from + 1]));
            }
            b.push(Step::Copy {
                from: b.r(Buf::Input, sd[rank], sd[rank + 1]),
                into: b.r(Buf::Output, rd[rank], rd[rank + 1]),
            });
        }
        Collective::Barrier => {
            // Dissemination: round k, a one-byte token to rank + 2^k, from rank - 2^k.
            scratch = 2;
            let mut dist = 1;
            while dist < size {
                b.push(Step::Send { peer: (rank + dist) % size, from: Region::new(Buf::Scratch, 0, 1) });
                b.push(Step::Recv {
                    peer: (rank + size - dist) % size,
                    into: Region::new(Buf::Scratch, 1, 1),
                });
                b.end_round();
                dist *= 2;
            }
        }
        Collective::Send { count, peer } => {
            assert!(*peer < size);
            b.send(*peer, b.r(Buf::Input, 0, *count));
        }
        Collective::Recv { count, peer } => {
            assert!(*peer < size);
            b.recv(*peer, b.r(Buf::Output, 0, *count));
        }
    }
    b.finish(scratch, dtype, op)
}

fn prefix(counts: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut sum = 0;
    out.push(0);
    for c in counts {
        sum += c;
        out.push(sum);
    }
    out
}

/// Ring reduce-scatter over blocks `displ` of `buf`: at step `s` rank `r` sends block
/// `r - s - e` and reduces block `r - s - e - 1` from its predecessor, so that it ends holding
/// the fully reduced block `r + 1 - e` (mod p): `e = 0` for allreduce's first phase, `e = 1`
/// to end on one's own block.
///
/// `src` holds the rank's own contribution (`buf` itself in place): every block is first
/// read from it (sent at step 0, or combined with what arrives), so `buf` need not hold it.
/// `last`, if given, is where the last block reduced goes instead of `buf` (it is not sent on).
#[allow(clippy::too_many_arguments)]
fn ring_reduce_scatter(
    b: &mut Builder,
    rank: usize,
    p: usize,
    displ: &[usize],
    buf: Buf,
    end_offset: usize,
    src: Buf,
    last: Option<Region>,
) {
    let next = (rank + 1) % p;
    let prev = (rank + p - 1) % p;
    for s in 0..p.saturating_sub(1) {
        let send_block = (rank + 2 * p - s - end_offset) % p;
        let recv_block = (rank + 2 * p - s - end_offset - 1) % p;
        // The block sent at step s > 0 is the one reduced at step s - 1; every received
        // block is touched for the first time.
        let from = if s == 0 { src } else { buf };
        b.send(next, b.r(from, displ[send_block], displ[send_block + 1]));
        let into = match last {
            Some(last) if s + 2 == p => last,
            _ => b.r(buf, displ[recv_block], displ[recv_block + 1]),
        };
        b.recv_combine(prev, b.r(src, displ[recv_block], displ[recv_block + 1]), into);
        b.end_round();
    }
}

/// Ring allgather over blocks `displ` of `buf`, starting from rank `r` holding block
/// `(r + shift) % p`.
fn ring_allgather(b: &mut Builder, rank: usize, p: usize, displ: &[usize], buf: Buf, shift: usize) {
    let next = (rank + 1) % p;
    let prev = (rank + p - 1) % p;
    for s in 0..p.saturating_sub(1) {
        let send_block = (rank + shift + p - s) % p;
        let recv_block = (rank + shift + 2 * p - s - 1) % p;
        b.send(next, b.r(buf, displ[send_block], displ[send_block + 1]));
        b.recv(prev, b.r(buf, displ[recv_block], displ[recv_block + 1]));
        b.end_round();
    }
}

fn ring_allreduce(b: &mut Builder, rank: usize, p: usize, n: usize, src: Buf) {
    let displ: Vec<usize> = (0..=p).map(|i| n * i / p).collect();
    // After reduce-scatter with end_offset 0, rank r holds block (r + 1) % p.
    ring_reduce_scatter(b, rank, p, &displ, Buf::Output, 0, src, None);
    ring_allgather(b, rank, p, &displ, Buf::Output, 1);
}

/// Folding for non-powers of two: of the first `2 * rem` ranks, each even one hands its vector
/// to the odd one above and sits out; the rest renumber into a power of two `pof2`.
struct Fold {
    pof2: usize,
    rem: usize,
}

impl Fold {
    fn new(p: usize) -> Fold {
        let mut pof2 = 1;
        while pof2 * 2 <= p {
            pof2 *= 2;
        }
        Fold { pof2, rem: p - pof2 }
    }
    /// The rank's number among the `pof2` active ranks, or None if it sits out.
    fn new_rank(&self, rank: usize) -> Option<usize> {
        if rank < 2 * self.rem {
            (rank % 2 == 1).then_some(rank / 2)
        } else {
            Some(rank - self.rem)
        }
    }
    fn real_rank(&self, new_rank: usize) -> usize {
        if new_rank < self.rem {
            new_rank * 2 + 1
        } else {
            new_rank + self.rem
        }
    }
    /// Before: the sitting-out ranks send their whole vector (in `src`) up. Returns where the
    /// rank's vector is afterwards (`Output` for the ranks that folded).
    fn fold_in(&self, b: &mut Builder, rank: usize, n: usize, src: Buf) -> Buf {
        if rank < 2 * self.rem {
            if rank.is_multiple_of(2) {
                b.send(rank + 1, b.r(src, 0, n));
            } else {
                b.recv_combine(rank - 1, b.r(src, 0, n), b.r(Buf::Output, 0, n));
            }
            b.end_round();
            Buf::Output
        } else {
            src
        }
    }
    /// After: they get the result back.
    fn fold_out(&self, b: &mut Builder, rank: usize, n: usize) {
        if rank < 2 * self.rem {
            if rank.is_multiple_of(2) {
                b.recv(rank + 1, b.r(Buf::Output, 0, n));
            } else {
                b.send(rank - 1, b.r(Buf::Output, 0, n));
            }
            b.end_round();
        }
    }
}

/// Each exchange sends the whole vector from where it is and combines it with what arrives
/// into another buffer (a round never receives into what it sends): input into output,
/// output into scratch, scratch into output; a result left in scratch is copied out.
fn recursive_doubling(b: &mut Builder, rank: usize, p: usize, n: usize, src: Buf) -> usize {
    let fold = Fold::new(p);
    let mut cur = fold.fold_in(b, rank, n, src);
    let mut scratch = 0;
    if let Some(me) = fold.new_rank(rank) {
        let mut mask = 1;
        while mask < fold.pof2 {
            let partner = fold.real_rank(me ^ mask);
            let next = if cur == Buf::Output { Buf::Scratch } else { Buf::Output };
            if next == Buf::Scratch {
                scratch = n * b.es;
            }
            b.send(partner, b.r(cur, 0, n));
            b.recv_combine(partner, b.r(cur, 0, n), b.r(next, 0, n));
            b.end_round();
            cur = next;
            mask *= 2;
        }
        if cur == Buf::Scratch {
            b.push(Step::Copy { from: b.r(Buf::Scratch, 0, n), into: b.r(Buf::Output, 0, n) });
            b.end_round();
        }
    }
    fold.fold_out(b, rank, n);
    scratch
}

fn rabenseifner(b: &mut Builder, rank: usize, p: usize, n: usize, src: Buf) {
    let fold = Fold::new(p);
    // Where the blocks of this rank's vector are until it first reduces them: the halving's
    // first exchange sends from there and combines from there into the output.
    let mut src = fold.fold_in(b, rank, n, src);
    if let Some(me) = fold.new_rank(rank) {
        let q = fold.pof2;
        let edge = |blk: usize| n * blk / q;
        // Window of blocks [lo, hi) this rank is responsible for; halves each step.
        let (mut lo, mut hi) = (0, q);
        let mut mask = q / 2;
        while mask >= 1 {
            let partner = fold.real_rank(me ^ mask);
            let mid = (lo + hi) / 2;
            let (keep, give) = if me & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
            b.send(partner, b.r(src, edge(give.0), edge(give.1)));
            let into = b.r(Buf::Output, edge(keep.0), edge(keep.1));
            b.recv_combine(partner, b.r(src, edge(keep.0), edge(keep.1)), into);
            b.end_round();
            src = Buf::Output;
            (lo, hi) = keep;
            mask /= 2;
        }
        // Now [lo, hi) == [me, me + 1); grow back by recursive doubling.
        let mut mask = 1;
        while mask < q {
            let partner = fold.real_rank(me ^ mask);
            let size = hi - lo;
            let (other_lo, other_hi) = if me & mask == 0 { (hi, hi + size) } else { (lo - size, lo) };
            b.send(partner, b.r(Buf::Output, edge(lo), edge(hi)));
            b.recv(partner, b.r(Buf::Output, edge(other_lo), edge(other_hi)));
            b.end_round();
            (lo, hi) = (lo.min(other_lo), hi.max(other_hi));
            mask *= 2;
        }
    }
    fold.fold_out(b, rank, n);
}

/// A flat allreduce of `n` elements among `p` ranks (`Hierarchical` is not one); returns
/// the scratch bytes used.
fn flat_allreduce(b: &mut Builder, algo: AllreduceAlgo, rank: usize, p: usize, n: usize, src: Buf) -> usize {
    match algo {
        AllreduceAlgo::Ring | AllreduceAlgo::Hierarchical => {
            ring_allreduce(b, rank, p, n, src);
            0
        }
        AllreduceAlgo::RecursiveDoubling => recursive_doubling(b, rank, p, n, src),
        AllreduceAlgo::Rabenseifner => {
            rabenseifner(b, rank, p, n, src);
            0
        }
    }
}

/// See [`AllreduceAlgo::Hierarchical`]; returns the scratch bytes used. Every phase ends its
/// last round, and a pair of ranks talks in one phase only or (same host) in the first and
/// the last, so messages between two ranks stay in the same order on both sides.
fn hierarchical_allreduce(b: &mut Builder, topology: &Topology, rank: usize, n: usize, src: Buf) -> usize {
    let host = topology.host_of(rank);
    let members = topology.hosts()[host].clone();
    let local = members.iter().position(|&r| r == rank).expect("a rank is on its host");
    let l = members.len();
    let h = topology.hosts().len();
    let es = b.es;
    if topology.is_uniform() && n * es >= HIERARCHICAL_SPLIT_MIN {
        // Inside the host: rank `local` ends holding block `(local + 1) % l`, reduced over
        // the host (nothing to do alone: the whole vector, still where it was).
        let displ: Vec<usize> = (0..=l).map(|i| n * i / l).collect();
        b.within(members.clone(), 0, |b| ring_reduce_scatter(b, local, l, &displ, Buf::Output, 0, src, None));
        let block = (local + 1) % l;
        let (start, len) = (displ[block], displ[block + 1] - displ[block]);
        let block_src = if l > 1 { Buf::Output } else { src };
        // Across hosts: the ranks holding the same block (the same local index everywhere).
        let column: Vec<usize> = topology.hosts().iter().map(|ranks| ranks[local]).collect();
        let algo = crate::comm::choose_allreduce(len * es, h);
        let scratch = b.within(column, start, |b| flat_allreduce(b, algo, host, h, len, block_src));
        b.within(members, 0, |b| ring_allgather(b, local, l, &displ, Buf::Output, 1));
        scratch
    } else {
        // Through each host's first rank. The binomial reduce combines the output buffers.
        let mut block_src = src;
        if l > 1 && src == Buf::Input {
            b.push(Step::Copy { from: b.r(Buf::Input, 0, n), into: b.r(Buf::Output, 0, n) });
            b.end_round();
            block_src = Buf::Output;
        }
        let mut scratch = b.within(members.clone(), 0, |b| binomial_reduce(b, local, l, n, 0));
        if local == 0 {
            let leaders: Vec<usize> = topology.hosts().iter().map(|ranks| ranks[0]).collect();
            let algo = crate::comm::choose_allreduce(n * es, h);
            let s = b.within(leaders, 0, |b| flat_allreduce(b, algo, host, h, n, block_src));
            scratch = scratch.max(s);
        }
        b.within(members, 0, |b| binomial_broadcast(b, local, l, n, 0));
        scratch
    }
}

/// A flat broadcast (`Hierarchical` is not one: binomial stands in).
fn flat_broadcast(b: &mut Builder, algo: BroadcastAlgo, rank: usize, p: usize, n: usize, root: usize) {
    match algo {
        BroadcastAlgo::Binomial | BroadcastAlgo::Hierarchical => binomial_broadcast(b, rank, p, n, root),
        BroadcastAlgo::Chain { segment } => chain_broadcast(b, rank, p, n, root, segment),
    }
}

/// See [`BroadcastAlgo::Hierarchical`]. Leaders of different hosts talk in the first phase
/// only, ranks of one host in the second only.
fn hierarchical_broadcast(b: &mut Builder, topology: &Topology, rank: usize, n: usize, root: usize) {
    let hosts = topology.hosts();
    let (host, root_host) = (topology.host_of(rank), topology.host_of(root));
    let leaders: Vec<usize> =
        hosts.iter().enumerate().map(|(h, ranks)| if h == root_host { root } else { ranks[0] }).collect();
    let bytes = n * b.es;
    if rank == leaders[host] {
        let algo = crate::comm::choose_broadcast(bytes, hosts.len());
        b.within(leaders.clone(), 0, |b| flat_broadcast(b, algo, host, hosts.len(), n, root_host));
    }
    let members = hosts[host].clone();
    let local = members.iter().position(|&r| r == rank).expect("a rank is on its host");
    let local_root = members.iter().position(|&r| r == leaders[host]).expect("a leader is on its host");
    let algo = crate::comm::choose_broadcast(bytes, members.len());
    let l = members.len();
    b.within(members, 0, |b| flat_broadcast(b, algo, local, l, n, local_root));
}

fn binomial_broadcast(b: &mut Builder, rank: usize, p: usize, n: usize, root: usize) {
    let vr = (rank + p - root) % p;
    let mut mask = 1;
    while mask < p {
        if vr < mask && vr + mask < p {
            b.send((vr + mask + root) % p, b.r(Buf::Output, 0, n));
        } else if vr >= mask && vr < 2 * mask {
            b.recv((vr - mask + root) % p, b.r(Buf::Output, 0, n));
        }
        b.end_round();
        mask *= 2;
    }
}

fn chain_broadcast(b: &mut Builder, rank: usize, p: usize, n: usize, root: usize, segment: usize) {
    let seg = (segment / b.es).max(1);
    let nseg = n.div_ceil(seg);
    let pos = (rank + p - root) % p;
    let seg_range = |s: usize| (s * seg, ((s + 1) * seg).min(n));
    if p == 1 || nseg == 0 {
        return;
    }
    for t in 0..nseg + p - 2 {
        if pos >= 1 && t + 1 >= pos && t + 1 - pos < nseg {
            let (s, e) = seg_range(t + 1 - pos);
            b.recv((rank + p - 1) % p, b.r(Buf::Output, s, e));
        }
        if pos + 1 < p && t >= pos && t - pos < nseg {
            let (s, e) = seg_range(t - pos);
            b.send((rank + 1) % p, b.r(Buf::Output, s, e));
        }
        b.end_round();
    }
}

/// Binomial-tree reduce; returns the scratch bytes used.
fn binomial_reduce(b: &mut Builder, rank: usize, p: usize, n: usize, root: usize) -> usize {
    let vr = (rank + p - root) % p;
    let has_children = vr.is_multiple_of(2) && vr + 1 < p;
    // The root accumulates in its output; others accumulate in scratch (their buffer is input only).
    let acc = if vr == 0 { Buf::Output } else { Buf::Scratch };
    if vr != 0 && has_children {
        b.push(Step::Copy { from: b.r(Buf::Output, 0, n), into: b.r(Buf::Scratch, 0, n) });
        b.end_round();
    }
    let src = if vr != 0 && !has_children { Buf::Output } else { acc };
    let mut mask = 1;
    while mask < p {
        if vr & mask != 0 {
            b.send((vr - mask + root) % p, b.r(src, 0, n));
            b.end_round();
            break;
        }
        if vr + mask < p {
            b.recv_reduce((vr + mask + root) % p, b.r(acc, 0, n));
            b.end_round();
        }
        mask *= 2;
    }
    if acc == Buf::Scratch {
        n * b.es
    } else {
        0
    }
}
