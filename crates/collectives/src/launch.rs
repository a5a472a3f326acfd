//! `lightpath launch -n N -- CMD ARGS...`: starts N copies of a command on this host as the
//! ranks of one job, serves their rendezvous store, and waits.
//!
//! Each copy gets `LIGHTPATH_RANK`, `LIGHTPATH_SIZE`, `LIGHTPATH_LOCAL_RANK`,
//! `LIGHTPATH_LOCAL_SIZE`, `LIGHTPATH_STORE` (the store this launcher serves on a free
//! loopback port, so two jobs on one host never collide) and `LIGHTPATH_JOB_ID`. When a rank
//! fails (non-zero exit or a signal) the others get `grace` to notice and exit on their own
//! (they do, through the collectives' failure detection), then are killed; the launcher exits
//! with the first failure's status.
//!
//! It binds each rank to a CPU (of those the launcher may use), round robin: rank `i` runs on
//! the `(i mod n)`-th of `n`. Why: the ranks poll while they wait (see the mesh), and unbound,
//! the scheduler sometimes puts ranks that wait for each other on one CPU while the other runs
//! something else, and moves them around; every exchange then costs context switches and cold
//! caches. Measured on this project's loaded 2-CPU machine, allreduce median (p50): 2 ranks,
//! 8 B, 1.0-2.0 us bound against 2.3-9.4 us unbound; 4 ranks (two per CPU, which mpirun
//! would leave unbound), 8 B 13 against 35 us, 64 KiB 55 against 125 us, 1 MiB 545-958
//! against 1231-2023 us, 16 MiB 22-29 against 37-41 ms. [`LaunchOptions::bind`] (`lightpath
//! launch --no-bind`) turns it off. With fewer usable CPUs than ranks (`taskset -c 1
//! lightpath launch -n 2`) it also sets `LIGHTPATH_COLL_SPIN_US=0` for the ranks unless set:
//! a rank judges whether to busy-poll by the host's CPUs, and two ranks busy-polling on one
//! CPU made 8 B allreduce take 107 us (median) instead of 6.8.

use crate::store::StoreServer;
use std::io;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// How to launch.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LaunchOptions {
    /// Number of ranks.
    pub ranks: usize,
    /// How long the other ranks may run after one failed before they are killed.
    pub grace: Duration,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Bind rank `i` to the `(i mod n)`-th of the `n` usable CPUs (default true; see the
    /// module docs).
    pub bind: bool,
}

impl LaunchOptions {
    /// `ranks` ranks, 10 s grace.
    pub fn new(ranks: usize) -> Self {
        LaunchOptions { ranks, grace: Duration::from_secs(10), env: Vec::new(), bind: true }
    }
}

/// What became of the job.
#[derive(Debug)]
pub struct LaunchOutcome {
    /// Each rank's exit status.
    pub statuses: Vec<ExitStatus>,
    /// The first rank that failed, if any.
    pub first_failure: Option<usize>,
}

impl LaunchOutcome {
    /// The exit code a launcher process should return: 0, the failing rank's code, or
    /// 128 + signal number.
    pub fn exit_code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        match self.first_failure {
            None => 0,
            Some(r) => {
                let s = self.statuses[r];
                s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
            }
        }
    }
}

/// Runs `program args` as `opts.ranks` ranks and waits for all of them.
pub fn launch(program: &str, args: &[String], opts: &LaunchOptions) -> io::Result<LaunchOutcome> {
    if opts.ranks == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "launch: -n must be at least 1"));
    }
    let store = StoreServer::bind(("127.0.0.1", 0))?;
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let job = format!("{}-{now}", std::process::id());
    let mut children: Vec<Child> = Vec::with_capacity(opts.ranks);
    // Children inherit the affinity of the thread that starts them: this thread takes each
    // rank's CPU in turn, and its own set back afterwards.
    let own_cpus = rustix::thread::sched_getaffinity(None).ok();
    let cpus: Vec<usize> = own_cpus
        .as_ref()
        .map(|set| (0..rustix::thread::CpuSet::MAX_CPU).filter(|c| set.is_set(*c)).collect())
        .unwrap_or_default();
    let bind = opts.bind && !cpus.is_empty();
    for rank in 0..opts.ranks {
        if let (true, Some(&cpu)) = (bind, cpus.get(rank % cpus.len().max(1))) {
            let mut one = rustix::thread::CpuSet::new();
            one.set(cpu);
            // Best effort: a rank started unbound still runs correctly.
            let _ = rustix::thread::sched_setaffinity(None, &one);
        }
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("LIGHTPATH_RANK", rank.to_string())
            .env("LIGHTPATH_SIZE", opts.ranks.to_string())
            .env("LIGHTPATH_LOCAL_RANK", rank.to_string())
            .env("LIGHTPATH_LOCAL_SIZE", opts.ranks.to_string())
            .env("LIGHTPATH_STORE", store.local_addr().to_string())
            .env("LIGHTPATH_JOB_ID", &job);
        // Ranks sharing CPUs must not busy-poll (see the mesh). A rank judges by the host's
        // CPUs; when this launcher may use fewer than there are ranks, it says so.
        if bind && opts.ranks > cpus.len() && std::env::var_os("LIGHTPATH_COLL_SPIN_US").is_none() {
            cmd.env("LIGHTPATH_COLL_SPIN_US", "0");
        }
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let spawned = cmd.spawn();
        if let (true, Some(set)) = (bind, &own_cpus) {
            let _ = rustix::thread::sched_setaffinity(None, set);
        }
        match spawned {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(io::Error::new(e.kind(), format!("launch: starting {program}: {e}")));
            }
        }
    }
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; opts.ranks];
    let mut first_failure = None;
    let mut kill_at: Option<Instant> = None;
    while statuses.iter().any(Option::is_none) {
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                statuses[rank] = Some(status);
                if !status.success() && first_failure.is_none() {
                    first_failure = Some(rank);
                    kill_at = Some(Instant::now() + opts.grace);
                }
            }
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (rank, child) in children.iter_mut().enumerate() {
                if statuses[rank].is_none() {
                    let _ = child.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(LaunchOutcome {
        statuses: statuses.into_iter().map(|s| s.expect("all collected")).collect(),
        first_failure,
    })
}
