//! Who am I, how many are we, and where is the rendezvous store: read from the launcher's
//! environment, without linking MPI or PMIx.
//!
//! Checked in this order (the first that matches wins):
//!
//! 1. **`lightpath launch`**: `LIGHTPATH_RANK`, `LIGHTPATH_SIZE`, `LIGHTPATH_STORE`
//!    (`host:port` of the store the launcher serves), `LIGHTPATH_LOCAL_RANK`/`_SIZE`.
//! 2. **torchrun** (and any `init_method="env://"` setup): `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//!    `MASTER_PORT`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`. When torchrun's agent serves its
//!    TCPStore on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`) the ranks join it as
//!    clients; otherwise rank 0 serves one there. Keys are prefixed with the run id and the
//!    restart count so that restarts never read stale addresses.
//! 3. **Open MPI's mpirun** (4.x, ORTE): `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`,
//!    `_LOCAL_SIZE`. Rank 0's host is the first `tcp://` address of `OMPI_MCA_orte_hnp_uri`
//!    (`JOBID.VPID;tcp://ADDR[,ADDR]:PORT;...`) and the port `61440 + (JOBID / 4096) % 4096`,
//!    derived by every rank alike (the scheme JAX uses); rank 0 serves the store there.
//! 4. **Slurm's srun**: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//!    `SLURM_NTASKS_PER_NODE`/`SLURM_STEP_TASKS_PER_NODE`; rank 0's host is the first of
//!    `SLURM_STEP_NODELIST` (`node[001-004],other` → `node001`) and the port
//!    `61440 + SLURM_JOB_ID % 4096`; rank 0 serves the store there.
//!
//! `LIGHTPATH_STORE=host:port` overrides the derived store address for mpirun and srun (for
//! Open MPI 5, whose PRRTE sets no `orte_hnp_uri`, it is required), and
//! `LIGHTPATH_COLL_ADDR=IP` chooses the address the rank's own listeners bind and advertise
//! (by default: the local address of the route towards the store).

use std::net::{SocketAddr, ToSocketAddrs};

/// The launcher a job was detected under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// `lightpath launch`.
    Lightpath,
    /// torchrun or a plain `env://` environment.
    Torchrun,
    /// Open MPI's mpirun.
    OpenMpi,
    /// Slurm's srun.
    Slurm,
}

/// What the environment says about this process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEnv {
    /// Where it was found.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the processes of this host.
    pub local_rank: usize,
    /// Processes on this host.
    pub local_size: usize,
    /// The rendezvous store (`host:port`, resolved at connect time).
    pub store: String,
    /// Whether this process must serve the store (rank 0 unless a launcher serves it).
    pub serve_store: bool,
    /// Prefix for this job's keys in the store.
    pub key_prefix: String,
}

fn parse<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
) -> Result<Option<T>, String> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| format!("{name}={v:?} is not a number")),
    }
}

fn need<T: std::str::FromStr>(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<T, String> {
    parse(get, name)?.ok_or_else(|| format!("{name} is not set"))
}

/// The first host of a Slurm node list: `node[001-004,7],other` → `node001`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find(',').unwrap_or(list.len());
    let bracket = list.find('[');
    match bracket {
        Some(b) if b < end => {
            let close = list[b..].find(']')? + b;
            let inner = &list[b + 1..close];
            let first = inner.split(',').next()?.split('-').next()?;
            Some(format!("{}{}", &list[..b], first))
        }
        _ => {
            let host = &list[..end];
            (!host.is_empty()).then(|| host.to_string())
        }
    }
}

/// Rank 0's address from Open MPI's `OMPI_MCA_orte_hnp_uri`: (first tcp host, derived port).
pub fn ompi_store_from_hnp_uri(uri: &str) -> Option<(String, u16)> {
    let jobid: u64 = uri.split('.').next()?.trim().parse().ok()?;
    let tcp = uri.split(';').find_map(|part| part.strip_prefix("tcp://"))?;
    let hosts = tcp.rsplit_once(':')?.0;
    let host = hosts.split(',').next()?.to_string();
    if host.is_empty() {
        return None;
    }
    Some((host, 61440 + ((jobid / 4096) % 4096) as u16))
}

/// Detects the job from the process environment.
pub fn detect() -> Result<JobEnv, String> {
    detect_from(&|name| std::env::var(name).ok())
}

/// Detects the job from any variable lookup (for tests).
pub fn detect_from(get: &dyn Fn(&str) -> Option<String>) -> Result<JobEnv, String> {
    let store_override = get("LIGHTPATH_STORE");
    if get("LIGHTPATH_RANK").is_some() {
        let rank: usize = need(get, "LIGHTPATH_RANK")?;
        let size: usize = need(get, "LIGHTPATH_SIZE")?;
        let store = store_override.ok_or("LIGHTPATH_RANK is set but LIGHTPATH_STORE is not")?;
        return finish(JobEnv {
            launcher: Launcher::Lightpath,
            rank,
            size,
            local_rank: parse(get, "LIGHTPATH_LOCAL_RANK")?.unwrap_or(rank),
            local_size: parse(get, "LIGHTPATH_LOCAL_SIZE")?.unwrap_or(size),
            store,
            // `lightpath launch --hosts`: rank 0 serves the store (the launcher may be on
            // no host of the job).
            serve_store: rank == 0 && get("LIGHTPATH_STORE_SERVE").is_some_and(|v| v == "1"),
            key_prefix: format!("lightpath/{}/", get("LIGHTPATH_JOB_ID").unwrap_or_default()),
        });
    }
    if get("RANK").is_some() && get("WORLD_SIZE").is_some() && get("MASTER_ADDR").is_some() {
        let rank: usize = need(get, "RANK")?;
        let size: usize = need(get, "WORLD_SIZE")?;
        let port: u16 = need(get, "MASTER_PORT")?;
        let host = get("MASTER_ADDR").unwrap_or_default();
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        return finish(JobEnv {
            launcher: Launcher::Torchrun,
            rank,
            size,
            local_rank: parse(get, "LOCAL_RANK")?.unwrap_or(0),
            local_size: parse(get, "LOCAL_WORLD_SIZE")?.unwrap_or(1),
            store: join_host_port(&host, port),
            serve_store: !agent_store && rank == 0,
            key_prefix: format!(
                "lightpath/{}/{}/",
                get("TORCHELASTIC_RUN_ID").unwrap_or_default(),
                get("TORCHELASTIC_RESTART_COUNT").unwrap_or_default()
            ),
        });
    }
    if get("OMPI_COMM_WORLD_RANK").is_some() {
        let rank: usize = need(get, "OMPI_COMM_WORLD_RANK")?;
        let size: usize = need(get, "OMPI_COMM_WORLD_SIZE")?;
        let uri = get("OMPI_MCA_orte_hnp_uri");
        let store = match (&store_override, &uri) {
            (Some(s), _) => s.clone(),
            (None, Some(uri)) => {
                let (host, port) = ompi_store_from_hnp_uri(uri)
                    .ok_or_else(|| format!("OMPI_MCA_orte_hnp_uri={uri:?} has no tcp:// address; set LIGHTPATH_STORE=host:port"))?;
                join_host_port(&host, port)
            }
            (None, None) => {
                return Err("mpirun without OMPI_MCA_orte_hnp_uri (Open MPI 5?): set LIGHTPATH_STORE=host:port (rank 0 serves it)".into())
            }
        };
        let job = uri.as_deref().and_then(|u| u.split('.').next()).unwrap_or("").to_string();
        return finish(JobEnv {
            launcher: Launcher::OpenMpi,
            rank,
            size,
            local_rank: parse(get, "OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
            local_size: parse(get, "OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(1),
            store,
            serve_store: rank == 0,
            key_prefix: format!("lightpath/ompi{job}/"),
        });
    }
    if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
        let rank: usize = need(get, "SLURM_PROCID")?;
        let size: usize = need(get, "SLURM_NTASKS")?;
        let job: u64 = parse(get, "SLURM_JOB_ID")?.or(parse(get, "SLURM_JOBID")?).unwrap_or(0);
        let store = match store_override {
            Some(s) => s,
            None => {
                let list = get("SLURM_STEP_NODELIST")
                    .or_else(|| get("SLURM_JOB_NODELIST"))
                    .or_else(|| get("SLURM_NODELIST"));
                let host = list
                    .as_deref()
                    .and_then(first_slurm_host)
                    .ok_or("srun without SLURM_STEP_NODELIST: set LIGHTPATH_STORE=host:port")?;
                join_host_port(&host, 61440 + (job % 4096) as u16)
            }
        };
        let local_size = get("SLURM_STEP_TASKS_PER_NODE")
            .or_else(|| get("SLURM_NTASKS_PER_NODE"))
            .and_then(|v| v.split(['(', ',']).next().and_then(|n| n.trim().parse().ok()))
            .unwrap_or(size);
        return finish(JobEnv {
            launcher: Launcher::Slurm,
            rank,
            size,
            local_rank: parse(get, "SLURM_LOCALID")?.unwrap_or(0),
            local_size,
            store,
            serve_store: rank == 0,
            key_prefix: format!("lightpath/slurm{job}.{}/", get("SLURM_STEP_ID").unwrap_or_default()),
        });
    }
    Err("no launcher environment found (lightpath launch, torchrun/env://, mpirun or srun)".into())
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn finish(env: JobEnv) -> Result<JobEnv, String> {
    if env.size == 0 {
        return Err("world size 0".into());
    }
    if env.rank >= env.size {
        return Err(format!("rank {} is not below the world size {}", env.rank, env.size));
    }
    Ok(env)
}

/// Resolves a `host:port` store address.
pub fn resolve(store: &str) -> std::io::Result<SocketAddr> {
    store.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, format!("{store} resolves to no address"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn lightpath_launch_over_hosts_has_rank_0_serve_the_store() {
        let vars = |rank: &'static str, serve: &'static str| {
            env(&[
                ("LIGHTPATH_RANK", rank),
                ("LIGHTPATH_SIZE", "4"),
                ("LIGHTPATH_STORE", "10.0.0.1:29501"),
                ("LIGHTPATH_STORE_SERVE", serve),
            ])
        };
        let serves = |rank, serve| detect_from(&vars(rank, serve)).unwrap().serve_store;
        assert!(serves("0", "1"));
        assert!(!serves("1", "1"), "only rank 0");
        assert!(!serves("0", "0"), "the local launcher serves it itself");
    }

    #[test]
    fn launchers_are_told_apart() {
        let e = detect_from(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.size, e.local_rank, e.local_size, e.store.as_str(), e.serve_store),
            (Launcher::Torchrun, 1, 4, 1, 2, "10.0.0.1:29500", false)
        );
        let e = detect_from(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap();
        assert!(e.serve_store, "plain env:// rank 0 serves");
        let e = detect_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_MCA_orte_hnp_uri", "1106771968.0;tcp://192.0.2.2,10.1.1.1:56115;tcp6://[fd00::2]:46549"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!(e.store, format!("192.0.2.2:{}", 61440 + (1106771968u64 / 4096) % 4096));
        assert!(e.serve_store);
        let e = detect_from(&env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_ID", "4099"),
            ("SLURM_STEP_NODELIST", "node[007-009],x"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ]))
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.local_rank, e.local_size, e.store.as_str(), e.serve_store),
            (Launcher::Slurm, 3, 1, 2, "node007:61443", false)
        );
        let e = detect_from(&env(&[
            ("LIGHTPATH_RANK", "2"),
            ("LIGHTPATH_SIZE", "3"),
            ("LIGHTPATH_STORE", "127.0.0.1:9"),
        ]))
        .unwrap();
        assert_eq!((e.launcher, e.rank, e.serve_store), (Launcher::Lightpath, 2, false));
    }

    #[test]
    fn bad_environments_say_what_is_wrong() {
        assert!(detect_from(&env(&[])).unwrap_err().contains("no launcher"));
        assert!(detect_from(&env(&[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1")
        ]))
        .unwrap_err()
        .contains("RANK"));
        assert!(detect_from(&env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1")
        ]))
        .unwrap_err()
        .contains("below"));
        assert!(detect_from(&env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]))
            .unwrap_err()
            .contains("LIGHTPATH_STORE"));
        assert_eq!(first_slurm_host("a1"), Some("a1".into()));
        assert_eq!(first_slurm_host("n[3,5-6]"), Some("n3".into()));
    }
}
