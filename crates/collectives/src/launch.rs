//! `lightpath launch -n N -- CMD ARGS...`: starts N copies of a command on this host as the
//! ranks of one job, serves their rendezvous store, and waits.
//!
//! With hosts (`lightpath launch -n N --hosts A:2,B:2 -- CMD`, [`LaunchOptions::hosts`]) the
//! ranks are spread over them by block (the first host's slots get ranks 0, 1, ..., then the
//! next host's), each started through an agent, `ssh` by default, as mpirun's rsh launcher
//! does: the agent's words with `{host}` replaced (or the host appended), then the rank's
//! command as one shell-quoted string (`cd DIR && exec env VAR=... CMD ARGS`), which the
//! remote shell runs. `ip netns exec {host} sh -c` makes network namespaces the hosts (the
//! tests). Rank 0 then serves the store, on `store_addr` (default: the first host's name) and
//! a port of the 29500-29999 range; ranks are not bound to CPUs (each host's own scheduler
//! places them), and `LIGHTPATH_LOCAL_RANK` / `LIGHTPATH_LOCAL_SIZE` count the ranks of each
//! host. A rank that fails makes the launcher stop the others' agents after `grace`; over ssh
//! that ends the remote ranks only if their sessions hang up, as with mpirun's rsh launcher.
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
    /// module docs). Only without `hosts`.
    pub bind: bool,
    /// Hosts and how many ranks each takes (empty: every rank on this host, started
    /// directly). See the module docs.
    pub hosts: Vec<(String, usize)>,
    /// How a rank starts on a host: words, `{host}` replaced by the host (appended if no word
    /// has it), followed by the rank's command as one shell string. Default `ssh -o
    /// BatchMode=yes`.
    pub agent: Vec<String>,
    /// Where the ranks reach rank 0's store when there are hosts (default: the first host).
    pub store_addr: Option<String>,
}

impl LaunchOptions {
    /// `ranks` ranks, 10 s grace.
    pub fn new(ranks: usize) -> Self {
        LaunchOptions {
            ranks,
            grace: Duration::from_secs(10),
            env: Vec::new(),
            bind: true,
            hosts: Vec::new(),
            agent: ["ssh", "-o", "BatchMode=yes"].map(String::from).to_vec(),
            store_addr: None,
        }
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

/// Parses `HOST[:SLOTS],...` (one slot when none is given; an IPv6 address with slots goes
/// in brackets, `[::1]:2`).
pub fn parse_hosts(text: &str) -> Result<Vec<(String, usize)>, String> {
    text.split(',')
        .filter(|entry| !entry.is_empty())
        .map(|entry| match entry.rsplit_once(':') {
            // A bare IPv6 address: its colons are not a slot count.
            Some((host, _)) if host.contains(':') && !host.ends_with(']') => Ok((entry.to_string(), 1)),
            Some((host, slots)) => match slots.parse::<usize>() {
                Ok(n) if n > 0 && !host.is_empty() => Ok((host.to_string(), n)),
                _ => Err(format!("{entry:?}: expected HOST or HOST:SLOTS with SLOTS at least 1")),
            },
            None => Ok((entry.to_string(), 1)),
        })
        .collect()
}

/// `text` quoted for a POSIX shell (single quotes; `'` as `'\''`).
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// The agent command that starts `script` on `host`.
fn agent_command(agent: &[String], host: &str, script: &str) -> io::Result<Command> {
    let mut words: Vec<String> = agent.iter().map(|w| w.replace("{host}", host)).collect();
    if !agent.iter().any(|w| w.contains("{host}")) {
        words.push(host.to_string());
    }
    let Some((first, rest)) = words.split_first() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "launch: empty agent"));
    };
    let mut cmd = Command::new(first);
    cmd.args(rest).arg(script);
    Ok(cmd)
}

/// Starts rank `rank` of a job spread over hosts (see the module docs).
fn start_on_host(
    program: &str,
    args: &[String],
    opts: &LaunchOptions,
    rank: usize,
    (host, local_rank, local_size): (&str, usize, usize),
    store: &str,
    job: &str,
) -> io::Result<Child> {
    let dir = std::env::current_dir()?;
    let mut vars = vec![
        ("LIGHTPATH_RANK".to_string(), rank.to_string()),
        ("LIGHTPATH_SIZE".to_string(), opts.ranks.to_string()),
        ("LIGHTPATH_LOCAL_RANK".to_string(), local_rank.to_string()),
        ("LIGHTPATH_LOCAL_SIZE".to_string(), local_size.to_string()),
        ("LIGHTPATH_STORE".to_string(), store.to_string()),
        ("LIGHTPATH_STORE_SERVE".to_string(), u8::from(rank == 0).to_string()),
        ("LIGHTPATH_JOB_ID".to_string(), job.to_string()),
    ];
    vars.extend(opts.env.iter().cloned());
    let mut script = format!("cd {} && exec env", shell_quote(&dir.to_string_lossy()));
    for (k, v) in &vars {
        script.push(' ');
        script.push_str(&shell_quote(&format!("{k}={v}")));
    }
    for word in std::iter::once(program).chain(args.iter().map(String::as_str)) {
        script.push(' ');
        script.push_str(&shell_quote(word));
    }
    agent_command(&opts.agent, host, &script)?.spawn()
}

/// Runs `program args` as `opts.ranks` ranks and waits for all of them.
pub fn launch(program: &str, args: &[String], opts: &LaunchOptions) -> io::Result<LaunchOutcome> {
    if opts.ranks == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "launch: -n must be at least 1"));
    }
    if !opts.hosts.is_empty() {
        return launch_on_hosts(program, args, opts);
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
    wait_all(children, opts)
}

/// [`launch`] over `opts.hosts`.
fn launch_on_hosts(program: &str, args: &[String], opts: &LaunchOptions) -> io::Result<LaunchOutcome> {
    let slots: usize = opts.hosts.iter().map(|(_, n)| n).sum();
    if slots < opts.ranks {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("launch: {} ranks but the hosts have {slots} slots", opts.ranks),
        ));
    }
    // Ranks by block: (host, rank on that host, ranks on that host) of each rank.
    let mut placement = Vec::with_capacity(opts.ranks);
    let mut left = opts.ranks;
    for (host, n) in &opts.hosts {
        let here = (*n).min(left);
        placement.extend((0..here).map(|local| (host.as_str(), local, here)));
        left -= here;
    }
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let job = format!("{}-{now}", std::process::id());
    let port = 29500 + (now % 500) as u16;
    let store_host = opts.store_addr.clone().unwrap_or_else(|| opts.hosts[0].0.clone());
    let store = if store_host.contains(':') && !store_host.starts_with('[') {
        format!("[{store_host}]:{port}")
    } else {
        format!("{store_host}:{port}")
    };
    let mut children: Vec<Child> = Vec::with_capacity(opts.ranks);
    for (rank, &place) in placement.iter().enumerate() {
        match start_on_host(program, args, opts, rank, place, &store, &job) {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(io::Error::new(
                    e.kind(),
                    format!("launch: starting rank {rank} on {}: {e}", place.0),
                ));
            }
        }
    }
    wait_all(children, opts)
}

/// Waits for every rank; after the first failure, kills the rest once `opts.grace` passed.
fn wait_all(mut children: Vec<Child>, opts: &LaunchOptions) -> io::Result<LaunchOutcome> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_with_and_without_slots() {
        let hosts = parse_hosts("a:2,b,10.0.0.3:4,[::1]:3,::2").expect("valid");
        let want = [("a", 2), ("b", 1), ("10.0.0.3", 4), ("[::1]", 3), ("::2", 1)];
        assert_eq!(hosts, want.map(|(h, n)| (h.to_string(), n)).to_vec());
        assert!(parse_hosts("a:0").is_err());
        assert!(parse_hosts("a:x").is_err());
        assert!(parse_hosts(":3").is_err());
    }

    #[test]
    fn a_rank_command_survives_any_argument() {
        assert_eq!(shell_quote("it's a $test"), "'it'\\''s a $test'");
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("printf %s {}", shell_quote("it's a $test \"x\""))])
            .output()
            .expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's a $test \"x\"");
        let cmd =
            agent_command(&["ip".into(), "netns".into(), "exec".into(), "{host}".into()], "ns1", "true")
                .expect("command");
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(
            (cmd.get_program().to_string_lossy().into_owned(), args),
            ("ip".into(), vec!["netns".into(), "exec".into(), "ns1".into(), "true".into()])
        );
        let ssh = agent_command(&["ssh".into()], "h", "x").expect("command");
        assert_eq!(ssh.get_args().count(), 2, "the host is appended when no word names it");
    }
}
