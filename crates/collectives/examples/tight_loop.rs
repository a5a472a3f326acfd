use lightpath_collectives::Communicator;
fn main() {
    let comm = Communicator::from_env().expect("init");
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let test = std::env::args().nth(2).unwrap_or("bcast".into());
    let mut buf = [1.0f32; 2];
    let mut out = [0.0f32; 2];
    for _ in 0..10000 {
        comm.broadcast(&mut buf, 0).unwrap();
    }
    comm.barrier().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..n {
        if test == "bcast" {
            comm.broadcast(&mut buf, 0).unwrap();
        } else {
            comm.allreduce(&buf, &mut out, lightpath_collectives::ReduceOp::Sum).unwrap();
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("rank {} {test} {ns:.1} ns/call", comm.rank());
}
