//! `lightpath launch -n N -- CMD ARGS...`: starts N copies of a command on this host as the
//! ranks of one job, serves their rendezvous store, and waits.
//!
//! Each copy gets `LIGHTPATH_RANK`, `LIGHTPATH_SIZE`, `LIGHTPATH_LOCAL_RANK`,
//! `LIGHTPATH_LOCAL_SIZE`, `LIGHTPATH_STORE` (the store this launcher serves on a free
//! loopback port, so two jobs on one host never collide) and `LIGHTPATH_JOB_ID`. When a rank
//! fails (non-zero exit or a signal) the others get `grace` to notice and exit on their own
//! (they do, through the collectives' failure detection), then are killed; the launcher exits
//! with the first failure's status.

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
}

impl LaunchOptions {
    /// `ranks` ranks, 10 s grace.
    pub fn new(ranks: usize) -> Self {
        LaunchOptions { ranks, grace: Duration::from_secs(10), env: Vec::new() }
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
    for rank in 0..opts.ranks {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("LIGHTPATH_RANK", rank.to_string())
            .env("LIGHTPATH_SIZE", opts.ranks.to_string())
            .env("LIGHTPATH_LOCAL_RANK", rank.to_string())
            .env("LIGHTPATH_LOCAL_SIZE", opts.ranks.to_string())
            .env("LIGHTPATH_STORE", store.local_addr().to_string())
            .env("LIGHTPATH_JOB_ID", &job);
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        match cmd.spawn() {
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
