//! `lightpath perf allreduce|reduce|bcast|allgather|reduce_scatter|alltoall|barrier`: an
//! OSU-style benchmark of the collectives, run as every rank of a job under any launcher
//! (`lightpath launch -n 2 -- lightpath perf allreduce -a`, mpirun, srun, torchrun).
//!
//! Per size: warm-up calls, then `-n` timed calls, each timed alone; the table (printed by
//! rank 0) has the average, minimum and maximum call time over all ranks and calls (avg is the
//! mean of the ranks' means, as osu_allreduce reports it), and algbw / busbw as nccl-tests
//! define them (algbw = S / t; busbw = algbw × 2(n-1)/n for allreduce, (n-1)/n for
//! allgather, reduce_scatter and alltoall, 1 for broadcast and reduce; S is the whole vector).
//! After timing, one call on known data is checked on every rank; a wrong result fails the run.
//! Buffers are f32 unless `--dtype` says otherwise; out-of-place where the call has both.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use clap::Parser;
use lightpath_collectives::{Communicator, DType, ReduceOp};

/// Whether the arguments ask for a collectives test (`lightpath perf allreduce ...`).
pub fn wants(args: &[OsString]) -> bool {
    args.get(1).is_some_and(|a| a == "perf")
        && args
            .iter()
            .skip(2)
            .find(|a| !a.to_string_lossy().starts_with('-'))
            .is_some_and(|a| TESTS.contains(&a.to_string_lossy().as_ref()))
}

const TESTS: [&str; 7] =
    ["allreduce", "reduce", "bcast", "allgather", "reduce_scatter", "alltoall", "barrier"];

/// `lightpath perf <collective>`: run as every rank of a job.
#[derive(Debug, Parser)]
#[command(name = "perf")]
struct CollArgs {
    /// allreduce, reduce, bcast, allgather, reduce_scatter, alltoall or barrier.
    test: String,
    /// One size in bytes, suffixes allowed (64K, 1M). Default: -a.
    #[arg(short = 's', long, value_parser = crate::size::parse_usize)]
    size: Option<usize>,
    /// Every power of two from 8 B to --max-size.
    #[arg(short = 'a', long)]
    all: bool,
    /// Largest size for -a.
    #[arg(long, value_parser = crate::size::parse_usize, default_value = "64M")]
    max_size: usize,
    /// Timed calls per size (default: 1000 up to 64 KiB, fewer above, at least 20).
    #[arg(short = 'n', long)]
    iters: Option<u64>,
    /// Element type: f32, f64, f16, bf16, i32, i64, u8.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Print one JSON object per size instead of a table.
    #[arg(long)]
    json: bool,
    /// Rewrite the data each call sends before the call, outside the timing, as a training
    /// step rewrites its gradients: the bytes then sit modified in this core's cache, as an
    /// application's fresh data does, instead of clean in every cache after the first call.
    #[arg(long)]
    touch: bool,
}

/// Parses and runs from the full argument list.
pub fn run_from(args: Vec<OsString>) -> Result<ExitCode> {
    let args = CollArgs::try_parse_from(args.into_iter().skip(1)).unwrap_or_else(|err| err.exit());
    run(&args)
}

fn run(args: &CollArgs) -> Result<ExitCode> {
    if !TESTS.contains(&args.test.as_str()) {
        bail!("unknown collective test {:?}; one of {}", args.test, TESTS.join(", "));
    }
    let dtype = DType::parse(&args.dtype)
        .ok_or_else(|| anyhow!("--dtype {:?}: one of f32, f64, f16, bf16, i32, i64, u8", args.dtype))?;
    let comm = Communicator::from_env()?;
    let (rank, p) = (comm.rank(), comm.size());
    let es = dtype.size();
    let sizes: Vec<usize> = if args.test == "barrier" {
        vec![0]
    } else if let (Some(s), false) = (args.size, args.all) {
        vec![s.max(es)]
    } else {
        std::iter::successors(Some(8usize.max(es)), |s| Some(s * 2))
            .take_while(|s| *s <= args.max_size)
            .collect()
    };
    if rank == 0 && !args.json {
        let transports = comm.transports();
        let via: Vec<&str> = transports.iter().flatten().map(String::as_str).collect();
        outln!(
            "# lightpath perf {}: {p} ranks, {dtype}, via {}",
            args.test,
            if via.is_empty() { "-".to_string() } else { via.join(",") }
        );
        outln!(
            "# {:>10} {:>12} {:>12} {:>12} {:>10} {:>10}",
            "size(B)",
            "avg(us)",
            "min(us)",
            "max(us)",
            "algbw(GB/s)",
            "busbw(GB/s)"
        );
    }
    for &bytes in &sizes {
        let count = bytes / es;
        let iters = args.iters.unwrap_or(if bytes <= 64 << 10 {
            1000
        } else {
            ((256u64 << 20) / bytes as u64).clamp(20, 1000)
        });
        let warmup = (iters / 10).max(2);
        let mut bench = Bench::new(&args.test, dtype, count, p, rank);
        for _ in 0..warmup {
            bench.call(&comm)?;
        }
        let (mut sum, mut min, mut max) = (0f64, f64::MAX, 0f64);
        let mut times = Vec::with_capacity(iters as usize);
        comm.barrier()?;
        for _ in 0..iters {
            if args.touch {
                bench.touch();
            }
            let t = Instant::now();
            bench.call(&comm)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            sum += us;
            times.push(us);
            min = min.min(us);
            max = max.max(us);
        }
        times.sort_by(f64::total_cmp);
        // Median and tail (90th, 99th percentile) of each rank's calls, averaged over ranks in
        // one call.
        let percentile = |q: usize| {
            times.get((times.len() * q / 100).min(times.len().saturating_sub(1))).copied().unwrap_or(0.0)
        };
        let mut percentiles = [percentile(50), percentile(90), percentile(99)];
        comm.allreduce_in_place(&mut percentiles, ReduceOp::Avg)?;
        let [median, p90, p99] = percentiles;
        let mut avg = [sum / iters as f64];
        let mut mins = [min];
        let mut maxs = [max];
        comm.allreduce_in_place(&mut avg, ReduceOp::Avg)?;
        comm.allreduce_in_place(&mut mins, ReduceOp::Min)?;
        comm.allreduce_in_place(&mut maxs, ReduceOp::Max)?;
        let ok = bench.verify(&comm)?;
        let mut all_ok = [ok as i32];
        comm.allreduce_in_place(&mut all_ok, ReduceOp::Min)?;
        if all_ok[0] != 1 {
            bail!("{} of {bytes} B: a rank got a wrong result", args.test);
        }
        let total = count * es;
        let algbw = total as f64 / (avg[0] * 1e-6) / 1e9;
        let factor = match args.test.as_str() {
            "allreduce" => 2.0 * (p as f64 - 1.0) / p as f64,
            "allgather" | "reduce_scatter" | "alltoall" => (p as f64 - 1.0) / p as f64,
            _ => 1.0,
        };
        let algorithm = match args.test.as_str() {
            "allreduce" => comm.allreduce_algorithm(total).name(),
            "bcast" | "broadcast" => comm.broadcast_algorithm(total).name(),
            _ => "",
        };
        if rank == 0 {
            if args.json {
                outln!(
                    "{}",
                    serde_json::json!({"test": args.test, "impl": "lightpath", "ranks": p, "dtype": dtype.name(), "size": total,
                        "iters": iters, "algorithm": algorithm, "avg_us": avg[0], "p50_us": median, "p90_us": p90, "p99_us": p99, "min_us": mins[0], "max_us": maxs[0], "algbw_gbps": algbw, "busbw_gbps": algbw * factor, "touched": args.touch, "verified": true})
                );
            } else {
                outln!(
                    "  {:>10} {:>12.2} {:>12.2} {:>12.2} {:>10.3} {:>10.3}",
                    total,
                    avg[0],
                    mins[0],
                    maxs[0],
                    algbw,
                    algbw * factor
                );
            }
        }
    }
    drop(comm);
    Ok(ExitCode::SUCCESS)
}

/// Writes `f(i)` as element `i` of `buf` (elements of `dtype`), in place: what `Bench::verify`
/// fills its buffers and expected results with. (Collecting one small vector per element took
/// longer than the timed calls themselves from 16 MiB on.)
fn fill_elements(buf: &mut [u8], dtype: DType, f: &dyn Fn(usize) -> i64) {
    for (i, out) in buf.chunks_exact_mut(dtype.size()).enumerate() {
        let v = f(i);
        match dtype {
            DType::F32 => out.copy_from_slice(&(v as f32).to_ne_bytes()),
            DType::F64 => out.copy_from_slice(&(v as f64).to_ne_bytes()),
            DType::F16 => out.copy_from_slice(&lightpath_collectives::f16::from_f32(v as f32).to_ne_bytes()),
            DType::BF16 => {
                out.copy_from_slice(&lightpath_collectives::bf16::from_f32(v as f32).to_ne_bytes())
            }
            DType::I32 => out.copy_from_slice(&(v as i32).to_ne_bytes()),
            DType::I64 => out.copy_from_slice(&v.to_ne_bytes()),
            _ => out[0] = v as u8,
        }
    }
}

/// One test's buffers.
struct Bench {
    test: String,
    dtype: DType,
    count: usize,
    p: usize,
    rank: usize,
    input: Vec<u8>,
    output: Vec<u8>,
}

impl Bench {
    fn new(test: &str, dtype: DType, count: usize, p: usize, rank: usize) -> Bench {
        let es = dtype.size();
        let (inp, out) = match test {
            "allreduce" => (count, count),
            "reduce" | "bcast" => (0, count),
            "allgather" => (count / p, count / p * p),
            "reduce_scatter" => (count / p * p, count / p),
            "alltoall" => (count / p * p, count / p * p),
            _ => (0, 0),
        };
        Bench {
            test: test.into(),
            dtype,
            count,
            p,
            rank,
            // Written, as an application's buffers are: a zeroed allocation is untouched
            // memory, whose reads all hit one shared zero page (always in cache) and whose
            // first write per page faults, neither of which the MPI loop beside it pays.
            input: vec![1; inp * es],
            output: vec![1; out * es],
        }
    }

    /// Rewrites what the next call sends with the bytes it held (`--touch`): the input, or
    /// for a broadcast the root's buffer.
    fn touch(&mut self) {
        if self.test == "bcast" {
            if self.rank == 0 {
                self.output.fill(1);
            }
        } else {
            self.input.fill(1);
        }
    }

    fn what(&self, comm: &Communicator) -> lightpath_collectives::Collective {
        use lightpath_collectives::Collective;
        let es = self.dtype.size();
        let p = self.p;
        let n = self.count;
        match self.test.as_str() {
            "allreduce" => Collective::Allreduce {
                count: n,
                op: ReduceOp::Sum,
                algo: comm.allreduce_algorithm(n * es),
                in_place: false,
            },
            "reduce" => Collective::Reduce { count: n, op: ReduceOp::Sum, root: 0 },
            "bcast" => Collective::Broadcast { count: n, root: 0, algo: comm.broadcast_algorithm(n * es) },
            "allgather" => Collective::Allgather { counts: vec![n / p; p], in_place: false },
            "reduce_scatter" => Collective::ReduceScatter { count: n / p, op: ReduceOp::Sum },
            "alltoall" => Collective::Alltoall { send_counts: vec![n / p; p], recv_counts: vec![n / p; p] },
            _ => Collective::Barrier,
        }
    }

    fn call(&mut self, comm: &Communicator) -> Result<()> {
        let what = self.what(comm);
        comm.execute(&what, self.dtype, &self.input, &mut self.output)?;
        Ok(())
    }

    /// One call on known data (small integers, exact in every type), checked.
    fn verify(&mut self, comm: &Communicator) -> Result<bool> {
        let es = self.dtype.size();
        let dtype = self.dtype;
        let elem = |r: usize, i: usize| ((r + i) % 3) as i64;
        let (p, r) = (self.p, self.rank);
        let fill = |buf: &mut Vec<u8>, f: &dyn Fn(usize) -> i64| fill_elements(buf, dtype, f);
        match self.test.as_str() {
            "allreduce" | "reduce" => {
                if self.test == "allreduce" {
                    fill(&mut self.input, &|i| elem(r, i));
                } else {
                    fill(&mut self.output, &|i| elem(r, i));
                }
                self.call(comm)?;
                if self.test == "reduce" && r != 0 {
                    return Ok(true);
                }
                let mut want = self.output.clone();
                fill(&mut want, &|i| (0..p).map(|q| elem(q, i)).sum());
                Ok(self.output == want)
            }
            "bcast" => {
                fill(&mut self.output, &|i| if r == 0 { elem(0, i) } else { 0 });
                self.call(comm)?;
                let mut want = self.output.clone();
                fill(&mut want, &|i| elem(0, i));
                Ok(self.output == want)
            }
            "allgather" => {
                fill(&mut self.input, &|i| elem(r, i));
                self.call(comm)?;
                let block = self.input.len() / es;
                let mut want = self.output.clone();
                fill(&mut want, &|i| elem(i / block.max(1), i % block.max(1)));
                Ok(self.output == want)
            }
            "reduce_scatter" => {
                fill(&mut self.input, &|i| elem(r, i));
                self.call(comm)?;
                let block = self.output.len() / es;
                let mut want = self.output.clone();
                fill(&mut want, &|i| (0..p).map(|q| elem(q, r * block + i)).sum());
                Ok(self.output == want)
            }
            "alltoall" => {
                let block = self.input.len() / es / p.max(1);
                // Block j of rank r: elem(r, j), everywhere in the block.
                fill(&mut self.input, &|i| elem(r, i / block.max(1)));
                self.call(comm)?;
                let mut want = self.output.clone();
                fill(&mut want, &|i| elem(i / block.max(1), r));
                Ok(self.output == want)
            }
            _ => {
                self.call(comm)?;
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_written_in_place_in_every_type() {
        let value = |i: usize| i as i64 % 3;
        for dtype in DType::ALL {
            let es = dtype.size();
            let mut buf = vec![0xAAu8; 5 * es];
            fill_elements(&mut buf, dtype, &value);
            let expect: Vec<u8> = (0..5)
                .flat_map(|i| match dtype {
                    DType::F32 => (value(i) as f32).to_ne_bytes().to_vec(),
                    DType::F64 => (value(i) as f64).to_ne_bytes().to_vec(),
                    DType::F16 => {
                        lightpath_collectives::f16::from_f32(value(i) as f32).to_ne_bytes().to_vec()
                    }
                    DType::BF16 => {
                        lightpath_collectives::bf16::from_f32(value(i) as f32).to_ne_bytes().to_vec()
                    }
                    DType::I32 => (value(i) as i32).to_ne_bytes().to_vec(),
                    DType::I64 => value(i).to_ne_bytes().to_vec(),
                    _ => vec![value(i) as u8],
                })
                .collect();
            assert_eq!(buf, expect, "{dtype:?}");
            assert!(buf.iter().any(|&b| b != 0xAA), "{dtype:?}: nothing written");
        }
    }
}
