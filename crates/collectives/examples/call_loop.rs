//! Time per call of a loop of small blocking calls, with no clock read per call: the loop's
//! whole time divided by its calls, on each rank. `lightpath perf` times every call (as OSU's
//! benchmarks do), which adds two clock reads to calls that take tens of nanoseconds; this
//! shows what the calls themselves cost. `bench/mpi_call_loop.c` is the same loop over Open
//! MPI, for a side-by-side run:
//!
//! ```text
//! cargo build --release -p lightpath-collectives --example call_loop
//! lightpath launch -n 2 -- target/release/examples/call_loop broadcast 2000000
//! mpicc -O2 -o mpi_call_loop crates/collectives/bench/mpi_call_loop.c
//! mpirun --allow-run-as-root -np 2 ./mpi_call_loop broadcast 2000000
//! ```
//!
//! Arguments: `broadcast` (from rank 0) or `allreduce` (sum), then the number of calls
//! (default 1,000,000). Each call moves two `f32`s (8 bytes); 10,000 calls warm up first.

use lightpath_collectives::{Communicator, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: call_loop broadcast|allreduce [CALLS]";
    let test = args.next().ok_or(usage)?;
    let calls: u64 = match args.next() {
        Some(n) => n.parse()?,
        None => 1_000_000,
    };
    if test != "broadcast" && test != "allreduce" {
        return Err(usage.into());
    }
    let comm = Communicator::from_env()?;
    let mut buf = [1.0f32; 2];
    let mut out = [0.0f32; 2];
    let mut call = |comm: &Communicator| match test.as_str() {
        "broadcast" => comm.broadcast(&mut buf, 0),
        _ => comm.allreduce(&buf, &mut out, ReduceOp::Sum),
    };
    for _ in 0..10_000 {
        call(&comm)?;
    }
    comm.barrier()?;
    let start = std::time::Instant::now();
    for _ in 0..calls {
        call(&comm)?;
    }
    let ns = start.elapsed().as_nanos() as f64 / calls as f64;
    println!("rank {}: {test} of 8 B, {ns:.1} ns per call ({calls} calls)", comm.rank());
    Ok(())
}
