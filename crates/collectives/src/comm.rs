//! The [`Communicator`]: a group of ranks and the collective calls among them.

use crate::bootstrap::{self, JobEnv};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::Error;
use crate::mesh::{parse_address, Listeners, Mesh};
use crate::schedule::{self, AllreduceAlgo, BroadcastAlgo, Collective, Topology};
use crate::store::{StoreClient, StoreServer};
use std::net::{IpAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// How a communicator behaves. [`Config::from_env`] reads the environment variables.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// A call fails when a peer it waits for makes no progress this long
    /// (`LIGHTPATH_COLL_TIMEOUT_MS`, default 2000).
    pub timeout: Duration,
    /// Joining the job (store, connections) fails after this long
    /// (`LIGHTPATH_COLL_INIT_TIMEOUT_MS`, default 60000).
    pub init_timeout: Duration,
    /// Forces an allreduce algorithm (`LIGHTPATH_COLL_ALLREDUCE=ring|rd|rabenseifner`).
    pub allreduce: Option<AllreduceAlgo>,
    /// Forces a broadcast algorithm (`LIGHTPATH_COLL_BCAST=binomial|chain[:SEGMENT_BYTES]`).
    pub broadcast: Option<BroadcastAlgo>,
    /// Checks before every collective that all ranks call the same thing with the same
    /// counts, type and root (`LIGHTPATH_COLL_DEBUG=1`); costs one small allgather per call.
    pub check_fingerprints: bool,
    /// Stream options (providers, ring size: [`MESH_RING`] by default); `LIGHTPATH_PROVIDERS`
    /// applies as for streams.
    pub stream: lightpath::Options,
    /// The address this rank's listeners bind and advertise (`LIGHTPATH_COLL_ADDR`); by
    /// default the local address of the route towards the store.
    pub addr: Option<IpAddr>,
}

/// The receive ring of the mesh's streams: 1 MiB, four times a stream's default. A sender
/// then runs up to 1 MiB (2 MiB over shm, whose rings are doubled) ahead of its receiver
/// before it waits for credits, which on a loaded machine is often a descheduled peer away.
/// Measured, 2 ranks over shm, allreduce (fastest call of 2 runs, load 10): 1 MiB 147 ->
/// 96 us, 4 MiB 573 -> 343 us, 16 MiB 3.4 -> 2.7 ms against 256 KiB; 512 KiB was in between,
/// 2 and 4 MiB no better (4 MiB worse at 1 and 4 MiB: the rings leave the caches).
pub const MESH_RING: u32 = 1 << 20;

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(2),
            init_timeout: Duration::from_secs(60),
            allreduce: None,
            broadcast: None,
            check_fingerprints: false,
            stream: {
                // The mesh busy-polls its streams during a call, so over soft it receives the
                // peers' datagrams itself instead of waiting for the device's progress thread
                // to be scheduled (on a bound rank, on the CPU the rank spins on): 2 ranks,
                // 8 B allreduce, median 40-45 -> 11-16 us (see the crate README).
                let mut options = lightpath::Options::default().with_ring_size(MESH_RING);
                options.soft_progress = lightpath::ProgressMode::polling();
                options
            },
            addr: None,
        }
    }
}

impl Config {
    /// Defaults, overridden by the `LIGHTPATH_COLL_*` variables; a malformed value is an error.
    pub fn from_env() -> Result<Config, Error> {
        let mut c = Config::default();
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let ms = |n: &str| -> Result<Option<Duration>, Error> {
            var(n)
                .map(|v| {
                    v.parse::<u64>()
                        .map(Duration::from_millis)
                        .map_err(|_| Error::bootstrap(format!("{n}={v:?} is not milliseconds")))
                })
                .transpose()
        };
        if let Some(t) = ms("LIGHTPATH_COLL_TIMEOUT_MS")? {
            c.timeout = t;
        }
        if let Some(t) = ms("LIGHTPATH_COLL_INIT_TIMEOUT_MS")? {
            c.init_timeout = t;
        }
        if let Some(v) = var("LIGHTPATH_COLL_ALLREDUCE") {
            c.allreduce = Some(AllreduceAlgo::parse(&v).ok_or_else(|| {
                Error::bootstrap(format!(
                    "LIGHTPATH_COLL_ALLREDUCE={v:?}: use ring, rd, rabenseifner or hierarchical"
                ))
            })?);
        }
        if let Some(v) = var("LIGHTPATH_COLL_BCAST") {
            c.broadcast = Some(parse_bcast(&v).ok_or_else(|| {
                Error::bootstrap(format!(
                    "LIGHTPATH_COLL_BCAST={v:?}: use binomial, chain[:BYTES] or hierarchical"
                ))
            })?);
        }
        c.check_fingerprints = var("LIGHTPATH_COLL_DEBUG").is_some_and(|v| v != "0");
        if let Some(v) = var("LIGHTPATH_COLL_ADDR") {
            c.addr =
                Some(v.parse().map_err(|_| {
                    Error::bootstrap(format!("LIGHTPATH_COLL_ADDR={v:?} is not an IP address"))
                })?);
        }
        Ok(c)
    }
}

fn parse_bcast(v: &str) -> Option<BroadcastAlgo> {
    match v.split_once(':') {
        None if v == "binomial" => Some(BroadcastAlgo::Binomial),
        None if v == "hierarchical" => Some(BroadcastAlgo::Hierarchical),
        None if v == "chain" => Some(BroadcastAlgo::Chain { segment: DEFAULT_CHAIN_SEGMENT }),
        Some(("chain", n)) => {
            n.parse().ok().filter(|n| *n > 0).map(|segment| BroadcastAlgo::Chain { segment })
        }
        _ => None,
    }
}

const DEFAULT_CHAIN_SEGMENT: usize = 256 << 10;

/// The allreduce algorithm for `bytes` among `size` ranks when none is forced.
///
/// From `lightpath perf allreduce` with each algorithm forced (`LIGHTPATH_COLL_ALLREDUCE`) on
/// this project's 2-core machine, over shm, under load from other jobs (so coarse). At 2 ranks
/// recursive doubling (one exchange of the whole vector, in one round instead of two) wins
/// while latency counts (64 KiB p50 10-12 us against 12-14); from 128 KiB on Rabenseifner
/// does (128 KiB about even; 256 KiB p50 32-37 against 41-46 us, 512 KiB 56-60 against 82-89,
/// 1 MiB 87-115 against 130-160): it moves the same bytes but reduces only half of them,
/// and in place it needs no scratch copy. (Before the combining receives and the 1 MiB
/// rings, recursive doubling won up to 1 MiB there.) Above 2 ranks: recursive doubling below
/// 16 KiB (latency-bound, `lg p` rounds), Rabenseifner for powers of two above, ring
/// otherwise.
pub fn choose_allreduce(bytes: usize, size: usize) -> AllreduceAlgo {
    let small = if size == 2 { 128 << 10 } else { 16 << 10 };
    if bytes < small || size <= 1 {
        AllreduceAlgo::RecursiveDoubling
    } else if size.is_power_of_two() {
        AllreduceAlgo::Rabenseifner
    } else {
        AllreduceAlgo::Ring
    }
}

/// The allreduce algorithm for `bytes` among the ranks of `topology` when none is forced:
/// [`AllreduceAlgo::Hierarchical`] when the group spans hosts with more than one rank on some
/// host, else [`choose_allreduce`] for the group's size.
///
/// Measured with `scripts/hier_bench.sh` (4 ranks, 2 in each of two network namespaces, soft
/// between them, shm inside; medians of 3 rounds): hierarchical against the fastest flat
/// algorithm, ranks placed by block, 8 B 0.62-0.75x, 1 KiB 0.84, 8 KiB 0.55, 32 KiB 0.70,
/// 64 KiB 0.84, 256 KiB 0.99, 1 MiB 0.80, 4 MiB 0.68, 16 MiB 0.67; alternating hosts 0.56-0.84
/// up to 32 KiB. Only one rank per host crosses the network for small calls, and each rank a
/// `1/L` share for large ones, where a flat plan sends the whole vector from every rank.
pub fn choose_allreduce_on(bytes: usize, topology: &Topology) -> AllreduceAlgo {
    if topology.is_multi_level() {
        AllreduceAlgo::Hierarchical
    } else {
        choose_allreduce(bytes, topology.size())
    }
}

/// The broadcast algorithm for `bytes` among the ranks of `topology` when none is forced:
/// [`BroadcastAlgo::Hierarchical`] when the group spans hosts with more than one rank on some
/// host (one message per host crosses the network), else [`choose_broadcast`].
pub fn choose_broadcast_on(bytes: usize, topology: &Topology) -> BroadcastAlgo {
    if topology.is_multi_level() {
        BroadcastAlgo::Hierarchical
    } else {
        choose_broadcast(bytes, topology.size())
    }
}

/// What names this process's host for hierarchical collectives: `LIGHTPATH_COLL_HOST` if
/// set, else the host name, the boot id and the network namespace (ranks in different
/// namespaces cannot share memory through Lightpath's shm provider, whose sockets are
/// per namespace, so each namespace counts as a host). Hashed to 64 bits (FNV-1a).
fn host_key() -> u64 {
    let text = match std::env::var("LIGHTPATH_COLL_HOST") {
        Ok(v) if !v.is_empty() => format!("user:{v}"),
        _ => {
            let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
            let netns =
                std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
            format!(
                "{}|{}|{netns}",
                read("/proc/sys/kernel/hostname").trim(),
                read("/proc/sys/kernel/random/boot_id").trim()
            )
        }
    };
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The broadcast algorithm for `bytes` among `size` ranks when none is forced: binomial
/// below 256 KiB or up to 3 ranks, else a pipelined chain of 256 KiB segments.
pub fn choose_broadcast(bytes: usize, size: usize) -> BroadcastAlgo {
    if bytes < (256 << 10) || size <= 3 {
        BroadcastAlgo::Binomial
    } else {
        BroadcastAlgo::Chain { segment: DEFAULT_CHAIN_SEGMENT }
    }
}

struct State {
    mesh: Mesh,
    /// The schedule of the last blocking call, with what it was built for (collective, type,
    /// rank, the group's hosts): a loop of identical calls builds it once (see
    /// `Communicator::execute`).
    last: Option<(Collective, DType, usize, Arc<Topology>, schedule::Schedule)>,
    serving: u64,
    /// Calls waiting for their turn: the finishing call wakes them only if there are any
    /// (a condition variable's notify is a system call even when nobody waits).
    waiting: usize,
}

/// What communicators of one job (the world and its splits) share: the mesh, and the order
/// in which their calls run (the order they were issued in, nonblocking ones included).
struct Shared {
    state: Mutex<State>,
    turn: Condvar,
    /// The next call's ticket: the order calls run in. Outside `state`, whose lock a running
    /// call holds, so that issuing a nonblocking call never waits for the call that runs.
    next_ticket: AtomicU64,
    config: Config,
    _store: Option<StoreServer>,
    /// The queue of the thread that runs nonblocking calls, started by the first one. Calls
    /// go in in the order of their tickets (taken under this lock), so the thread, running
    /// them one after the other, never waits for a call queued behind the one it runs. It
    /// ends when this is dropped.
    worker: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    /// Clones of the control connections, for [`Communicator::abort`].
    abort_lines: Mutex<Vec<std::net::TcpStream>>,
    /// Set by [`Communicator::abort`]; the mesh's calls fail once they see it.
    aborted: Arc<std::sync::atomic::AtomicBool>,
    /// Each world rank's host key (see `host_key`), learned when the job starts.
    host_keys: OnceLock<Vec<u64>>,
}

impl Shared {
    /// Issues a ticket and takes the call's sequence number from `seq` (the calling
    /// communicator's counter), without waiting for the call that runs now. Calls issued by
    /// one thread get tickets and numbers in the order it issues them; calls issued at once
    /// by several threads run in some order, as they would with any library.
    fn issue(&self, seq: &AtomicU64) -> (u64, u64) {
        (self.next_ticket.fetch_add(1, Ordering::Relaxed), seq.fetch_add(1, Ordering::Relaxed))
    }

    fn run<R>(&self, ticket: u64, f: impl FnOnce(&mut State) -> R) -> R {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.run_locked(st, ticket, f)
    }

    /// Issues a ticket and runs `f` (given the call's sequence number, taken from `seq`, or 0
    /// for something that is not a call) in its turn (a blocking call).
    fn issue_and_run<R>(&self, seq: Option<&AtomicU64>, f: impl FnOnce(&mut State, u64) -> R) -> R {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let seq = seq.map_or(0, |seq| seq.fetch_add(1, Ordering::Relaxed));
        self.run_locked(st, ticket, |st| f(st, seq))
    }

    fn run_locked<R>(
        &self,
        mut st: std::sync::MutexGuard<'_, State>,
        ticket: u64,
        f: impl FnOnce(&mut State) -> R,
    ) -> R {
        while st.serving != ticket {
            st.waiting += 1;
            st = self.turn.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
        }
        // A call that panics (a bug) still ends its turn, or every later call would wait for
        // it forever; the mesh is in an unknown state then, so it fails every later call.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut st)));
        if r.is_err() && st.mesh.poisoned.is_none() {
            st.mesh.poisoned = Some(Error::Internal {
                op: "call",
                detail: "an earlier call panicked (a bug in Lightpath)".into(),
            });
        }
        st.serving += 1;
        let wake = st.waiting > 0;
        drop(st);
        if wake {
            self.turn.notify_all();
        }
        r.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.mesh.close();
    }
}

/// A group of ranks. The world communicator comes from [`Communicator::from_env`] (or
/// [`Communicator::init`]); [`Communicator::split`] makes sub-groups that share its
/// connections.
///
/// Every rank of the group must make the same calls in the same order (as in MPI); calls on
/// one process run one at a time in the order they were issued. Buffers are slices of an
/// [`Element`] type (or bytes with a [`DType`], [`Communicator::execute`]). Errors name the
/// rank at fault, the operation and its sequence number; after one, every call fails.
///
/// Drop the communicator before the process exits: dropping flushes what this rank sent
/// and tells the peers it left cleanly (a process that exits without it looks dead).
pub struct Communicator {
    shared: Arc<Shared>,
    /// World rank of each member, in group order.
    group: Arc<[usize]>,
    rank: usize,
    seq: Arc<AtomicU64>,
    /// The hosts of the group's ranks.
    topology: Arc<Topology>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.group.len())
            .finish_non_exhaustive()
    }
}

/// A nonblocking call's handle; [`Request::wait`] returns the buffer it was given.
///
/// The call runs on the communicator's call thread (one per process, shared by the
/// communicators split from one world, started by the first nonblocking call), in its turn:
/// calls of a process run one at a time in the order they were issued, blocking and
/// nonblocking alike (so every rank runs them in the same order). Dropping a request without
/// waiting detaches the call: it still runs, and its buffers are dropped when it ends.
#[derive(Debug)]
pub struct Request<T> {
    state: Option<Pending<T>>,
}

#[derive(Debug)]
enum Pending<T> {
    Running(Arc<Completion<T>>, Started),
    /// Refused before it was issued.
    Failed(Error),
}

/// A nonblocking call's outcome, filled in by the call thread.
#[derive(Debug)]
struct Completion<T> {
    outcome: Mutex<Option<Result<T, Error>>>,
    ready: Condvar,
}

impl<T> Completion<T> {
    fn complete(&self, outcome: Result<T, Error>) {
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        self.ready.notify_all();
    }
}

/// A nonblocking call, queued for the call thread.
type Job = Box<dyn FnOnce() + Send>;

/// A started nonblocking call that a thread about to wait for it may run itself
/// ([`Started::run_here`]) if the call thread has not begun it yet: a blocking wait right after
/// the start (torch's synchronous calls are such) then costs no thread hand-over, the call
/// thread's wake-up arriving to find the call gone.
#[derive(Clone)]
pub struct Started(Arc<Mutex<Option<Job>>>);

impl std::fmt::Debug for Started {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Started").finish_non_exhaustive()
    }
}

impl Started {
    /// Takes the call if nobody has begun it.
    fn take(&self) -> Option<Job> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Runs the call on this thread (in its turn: it first waits for the calls issued before
    /// it, which the call thread runs) if the call thread has not begun it; returns whether
    /// it did. Either way the call then ends as it would have on the call thread (its outcome
    /// handed over the same way).
    pub fn run_here(&self) -> bool {
        match self.take() {
            Some(job) => {
                job();
                true
            }
            None => false,
        }
    }
}

impl<T> Request<T> {
    /// Waits for the call and returns its buffer (or the call's error).
    pub fn wait(mut self) -> Result<T, Error> {
        match self.state.take() {
            Some(Pending::Running(done, started)) => {
                started.run_here();
                let mut outcome = done.outcome.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(r) = outcome.take() {
                        return r;
                    }
                    outcome = done.ready.wait(outcome).unwrap_or_else(|e| e.into_inner());
                }
            }
            Some(Pending::Failed(e)) => Err(e),
            None => Err(Error::Internal { op: "wait", detail: "the request was already waited".into() }),
        }
    }

    /// Whether the call has finished (then [`Request::wait`] returns at once). Never blocks
    /// for longer than a lock the call thread holds only to store the outcome.
    pub fn is_finished(&self) -> bool {
        match &self.state {
            Some(Pending::Running(done, _)) => {
                done.outcome.lock().unwrap_or_else(|e| e.into_inner()).is_some()
            }
            _ => true,
        }
    }
}

/// The buffers of a nonblocking call started with [`Communicator::iexecute`], owned by the call
/// while it runs and handed back by [`Request::wait`].
///
/// The call asks for the bytes once, when it is started (to check their lengths), and once
/// more when its turn comes, on the call thread; both times must give the same lengths (and,
/// for the same call, the same memory): buffers whose lengths changed fail the call and the
/// communicator. An implementation over memory the value does not own
/// (a C caller's buffers, say) is how a binding lends buffers to a call without copying them:
/// the value then stands for the promise that the memory stays valid, and is used by nobody
/// else, until the request is waited.
pub trait CallBuffers: Send + 'static {
    /// The call's input (empty for in-place forms and calls that read nothing) and output
    /// (empty for calls that write nothing), as [`Communicator::execute`] takes them.
    fn buffers(&mut self) -> (&[u8], &mut [u8]);
}

fn invalid(op: &'static str, detail: String) -> Error {
    Error::InvalidArgument { op, detail }
}

impl Communicator {
    /// Joins the job the environment describes (see [`crate::bootstrap`]), with
    /// [`Config::from_env`].
    pub fn from_env() -> Result<Communicator, Error> {
        let env = bootstrap::detect().map_err(Error::bootstrap)?;
        Communicator::init(&env, Config::from_env()?)
    }

    /// Joins the job `env` describes: serves or reaches the store, publishes this rank's
    /// listeners, connects to every other rank.
    pub fn init(env: &JobEnv, config: Config) -> Result<Communicator, Error> {
        let store_addr = bootstrap::resolve(&env.store)
            .map_err(|e| Error::bootstrap(format!("store address {}: {e}", env.store)))?;
        let server = if env.serve_store {
            let bind = std::net::SocketAddr::new(
                if store_addr.is_ipv6() { IpAddr::from([0u16; 8]) } else { IpAddr::from([0u8; 4]) },
                store_addr.port(),
            );
            Some(StoreServer::bind(bind).map_err(|e| {
                Error::bootstrap(format!("rank {}: serving the store on {bind}: {e}", env.rank))
            })?)
        } else {
            None
        };
        let mut store = StoreClient::connect(store_addr, config.init_timeout).map_err(Error::bootstrap)?;
        let prefix = &env.key_prefix;
        let joined = store.add(&format!("{prefix}join/{}", env.rank), 1).map_err(Error::bootstrap)?;
        if joined != 1 {
            return Err(Error::bootstrap(format!(
                "rank {} joined twice (the store has seen it {joined} times)",
                env.rank
            )));
        }
        let ip = match config.addr {
            Some(ip) => ip,
            None => route_to(store_addr)
                .map_err(|e| Error::bootstrap(format!("choosing an address towards {store_addr}: {e}")))?,
        };
        let listeners = Listeners::bind(ip, config.stream.clone())
            .map_err(|e| Error::bootstrap(format!("binding {ip}: {e}")))?;
        let address = listeners.address().map_err(Error::bootstrap)?;
        store.set(&format!("{prefix}addr/{}", env.rank), address.as_bytes()).map_err(Error::bootstrap)?;
        let init_timeout = config.init_timeout;
        let mut mesh = Mesh::connect(
            env.rank,
            env.size,
            listeners,
            |j| {
                let text = store
                    .get(&format!("{prefix}addr/{j}"), init_timeout)
                    .map_err(|e| Error::bootstrap(format!("address of rank {j}: {e}")))?;
                parse_address(&String::from_utf8_lossy(&text))
                    .ok_or_else(|| Error::bootstrap(format!("rank {j} published a malformed address")))
            },
            &config.stream,
            config.timeout,
            init_timeout,
        )?;
        let soft_polled = config.stream.soft_progress.is_polling();
        mesh.choose_spin(env.local_size, soft_polled);
        let aborted = mesh.abort_flag();
        let abort_lines = Mutex::new(mesh.control_clones());
        let shared = Arc::new(Shared {
            abort_lines,
            aborted,
            state: Mutex::new(State { mesh, last: None, serving: 0, waiting: 0 }),
            next_ticket: AtomicU64::new(0),
            turn: Condvar::new(),
            config,
            _store: server,
            host_keys: OnceLock::new(),
            worker: Mutex::new(None),
        });
        let mut comm = Communicator {
            shared,
            group: (0..env.size).collect(),
            rank: env.rank,
            seq: Arc::new(AtomicU64::new(0)),
            topology: Arc::new(Topology::one_host(env.size)),
        };
        // Every rank learns every rank's host. Nobody leaves init (and rank 0 never stops
        // serving the store) before all are connected: a rank has every block of an
        // allgather only once every rank has sent its own.
        let mut keys = vec![0i64; env.size];
        comm.allgather(&[host_key() as i64], &mut keys)?;
        let keys: Vec<u64> = keys.into_iter().map(|k| k as u64).collect();
        comm.topology = Arc::new(Topology::from_keys(&keys));
        let _ = comm.shared.host_keys.set(keys);
        Ok(comm)
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.group.len()
    }

    /// World rank of each member of the group.
    pub fn world_ranks(&self) -> &[usize] {
        &self.group
    }

    /// The hosts the group's ranks run on (what hierarchical algorithms follow).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// How this rank reaches each world rank (`None` for itself), e.g. `rdma/soft`, or
    /// `rdma/shm+pipe` for a same-host rank whose small messages go through a pipe
    /// (`+pipe+cma` when large ones are read straight from the sender's memory).
    pub fn transports(&self) -> Vec<Option<String>> {
        let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.mesh.transports()
    }

    /// Splits the group: ranks passing the same `color` form a new communicator, ordered by
    /// `key` then by rank; `None` opts out (returns `Ok(None)`). Collective over this group.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>, Error> {
        let mut mine = [0u8; 16];
        mine[0] = color.is_some() as u8;
        mine[4..8].copy_from_slice(&color.unwrap_or(0).to_le_bytes());
        mine[8..].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 16 * self.size()];
        self.allgather(&mine[..], &mut all)?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = all
            .chunks_exact(16)
            .enumerate()
            .filter(|(_, c)| c[0] == 1 && u32::from_le_bytes(c[4..8].try_into().expect("4 bytes")) == color)
            .map(|(r, c)| (i64::from_le_bytes(c[8..].try_into().expect("8 bytes")), r))
            .collect();
        members.sort();
        let rank = members.iter().position(|&(_, r)| r == self.rank).expect("this rank is a member");
        let group: Arc<[usize]> = members.iter().map(|&(_, r)| self.group[r]).collect();
        let topology = match self.shared.host_keys.get() {
            Some(keys) => Topology::from_keys(&group.iter().map(|&w| keys[w]).collect::<Vec<_>>()),
            None => Topology::one_host(group.len()),
        };
        Ok(Some(Communicator {
            shared: self.shared.clone(),
            group,
            rank,
            seq: Arc::new(AtomicU64::new(0)),
            topology: Arc::new(topology),
        }))
    }

    /// Aborts the job: every rank's current or next call fails with [`Error::Aborted`]
    /// naming this rank; this communicator fails every later call.
    pub fn abort(&self, reason: &str) {
        // Not through the mesh's lock, which a blocked call holds: the control connections'
        // clones, and a flag the blocked call notices in its idle loop.
        let me = self.group[self.rank];
        self.shared.aborted.store(true, Ordering::Relaxed);
        let line = format!("abort {me} {}\n", reason.replace('\n', " "));
        for ctl in self.shared.abort_lines.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
            let _ = std::io::Write::write(ctl, line.as_bytes());
        }
    }

    /// Checks `what` against the buffers and this group.
    fn check(&self, what: &Collective, dtype: DType, input: usize, output: usize) -> Result<(), Error> {
        let op = what.name();
        let (p, r, es) = (self.size(), self.rank, dtype.size());
        let bytes = |n: usize| n.checked_mul(es).ok_or_else(|| invalid(op, format!("{n} elements overflow")));
        let expect = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(invalid(
                    op,
                    format!(
                        "{what} has {got} bytes, the call needs {want} ({} elements of {dtype})",
                        want / es
                    ),
                ))
            }
        };
        match what {
            Collective::Allreduce { count, in_place, .. } => {
                expect("the output", output, bytes(*count)?)?;
                if !in_place {
                    expect("the input", input, bytes(*count)?)?;
                }
            }
            Collective::Reduce { count, root, .. } | Collective::Broadcast { count, root, .. } => {
                if *root >= p {
                    return Err(invalid(op, format!("root {root} is not below the group size {p}")));
                }
                expect("the buffer", output, bytes(*count)?)?;
            }
            Collective::Allgather { counts, in_place } => {
                if counts.len() != p {
                    return Err(invalid(op, format!("{} counts for {p} ranks", counts.len())));
                }
                expect("the output", output, bytes(counts.iter().sum())?)?;
                if !in_place {
                    expect("the input", input, bytes(counts[r])?)?;
                }
            }
            Collective::ReduceScatter { count, .. } => {
                expect("the input", input, bytes(count * p)?)?;
                expect("the output", output, bytes(*count)?)?;
            }
            Collective::Alltoall { send_counts, recv_counts } => {
                if send_counts.len() != p || recv_counts.len() != p {
                    return Err(invalid(
                        op,
                        format!(
                            "counts for {} and {} ranks, the group has {p}",
                            send_counts.len(),
                            recv_counts.len()
                        ),
                    ));
                }
                expect("the input", input, bytes(send_counts.iter().sum())?)?;
                expect("the output", output, bytes(recv_counts.iter().sum())?)?;
            }
            Collective::Barrier => {}
            Collective::Send { count, peer } | Collective::Recv { count, peer } => {
                if *peer >= p || *peer == r {
                    return Err(invalid(op, format!("peer {peer} (this is rank {r} of {p})")));
                }
                let (name, len) = if matches!(what, Collective::Send { .. }) {
                    ("the input", input)
                } else {
                    ("the output", output)
                };
                expect(name, len, bytes(*count)?)?;
            }
        }
        Ok(())
    }

    /// A 32-byte description of a call, compared across ranks in debug mode.
    fn fingerprint(what: &Collective, dtype: DType, seq: u64) -> [u8; 32] {
        let mut f = [0u8; 32];
        let (code, count, root, op) = match what {
            Collective::Allreduce { count, op, .. } => (1u8, *count as u64, 0u64, *op as u8),
            Collective::Reduce { count, op, root } => (2, *count as u64, *root as u64, *op as u8),
            Collective::Broadcast { count, root, .. } => (3, *count as u64, *root as u64, 0),
            Collective::Allgather { counts, .. } => (4, counts.iter().sum::<usize>() as u64, 0, 0),
            Collective::ReduceScatter { count, op } => (5, *count as u64, 0, *op as u8),
            Collective::Alltoall { send_counts, .. } => (6, send_counts.len() as u64, 0, 0),
            Collective::Barrier => (7, 0, 0, 0),
            Collective::Send { .. } | Collective::Recv { .. } => (8, 0, 0, 0),
        };
        f[0] = code;
        f[1] = DType::ALL.iter().position(|d| *d == dtype).unwrap_or(255) as u8;
        f[2] = op;
        f[8..16].copy_from_slice(&count.to_le_bytes());
        f[16..24].copy_from_slice(&root.to_le_bytes());
        f[24..32].copy_from_slice(&seq.to_le_bytes());
        f
    }

    fn describe(f: &[u8]) -> String {
        const NAMES: [&str; 9] = [
            "?",
            "allreduce",
            "reduce",
            "broadcast",
            "allgather",
            "reduce_scatter",
            "alltoall",
            "barrier",
            "send/recv",
        ];
        let dtype = DType::ALL.get(f[1] as usize).map(|d| d.name()).unwrap_or("?");
        let count = u64::from_le_bytes(f[8..16].try_into().expect("8 bytes"));
        let root = u64::from_le_bytes(f[16..24].try_into().expect("8 bytes"));
        let seq = u64::from_le_bytes(f[24..32].try_into().expect("8 bytes"));
        format!(
            "{} #{seq} of {count} x {dtype} (op {}, root {root})",
            NAMES.get(f[0] as usize).unwrap_or(&"?"),
            f[2]
        )
    }

    /// Runs a call with byte buffers: `input` is read (out-of-place calls), `output` written.
    /// Counts in `what` are elements of `dtype`. The typed methods below are wrappers.
    pub fn execute(
        &self,
        what: &Collective,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), Error> {
        self.check(what, dtype, input.len(), output.len())?;
        self.shared
            .issue_and_run(Some(&self.seq), |st, seq| self.run_call(st, what, dtype, seq, input, output))
    }

    /// Runs a call in its turn (`st` locked): the schedule (the last one if it fits), the
    /// fingerprint check in debug mode, then the schedule itself.
    fn run_call(
        &self,
        st: &mut State,
        what: &Collective,
        dtype: DType,
        seq: u64,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), Error> {
        let check = self.shared.config.check_fingerprints
            && !matches!(what, Collective::Send { .. } | Collective::Recv { .. });
        let group = &self.group;
        let (rank, topology) = (self.rank, &self.topology);
        {
            // A loop of identical calls (a training step's allreduce, a benchmark) reuses the
            // last schedule: building one allocates, which a small call notices.
            let cached = st.last.as_ref().is_some_and(|(w, d, r, t, _)| {
                w == what && *d == dtype && *r == rank && (Arc::ptr_eq(t, topology) || t == topology)
            });
            if !cached {
                let sched = schedule::build_on(what, dtype, rank, topology);
                st.last = Some((what.clone(), dtype, rank, topology.clone(), sched));
            }
            let State { mesh, last, .. } = st;
            let sched = &last.as_ref().expect("just stored").4;
            if check {
                let mine = Self::fingerprint(what, dtype, seq);
                let p = group.len();
                let mut all = vec![0u8; 32 * p];
                let fp = schedule::build(
                    &Collective::Allgather { counts: vec![32; p], in_place: false },
                    DType::U8,
                    rank,
                    p,
                );
                mesh.execute(&fp, group, &mine, &mut all, what.name(), seq)?;
                if let Some((other, theirs)) = all.chunks_exact(32).enumerate().find(|(_, f)| *f != mine) {
                    let e = Error::Mismatch {
                        rank: group[other],
                        op: what.name(),
                        seq,
                        detail: format!(
                            "this rank called {}, rank {} called {}",
                            Self::describe(&mine),
                            group[other],
                            Self::describe(theirs)
                        ),
                    };
                    // Every rank sees the same fingerprints and reports the mismatch itself;
                    // no abort is sent (it would reach the others as `Aborted` first).
                    mesh.poisoned = Some(e.clone());
                    return Err(e);
                }
            }
            mesh.execute(sched, group, input, output, what.name(), seq)
        }
    }

    /// Starts a nonblocking call over buffers the call owns until [`Request::wait`] hands
    /// them back: checks the call against the buffers' lengths and this group now (an
    /// inconsistent call is refused here, before anything is issued), then runs it on the
    /// call thread (see [`Request`]) in the turn it takes now. Calls of a process run one at a
    /// time in the order they were issued, blocking and nonblocking alike, so every rank must
    /// issue the same calls in the same order; waiting for requests in any order is fine.
    ///
    /// [`Communicator::iallreduce`] and friends are this over a `Vec`; bindings use it to
    /// lend their callers' buffers to a call without copying them (see [`CallBuffers`]).
    pub fn iexecute<B: CallBuffers>(
        &self,
        what: Collective,
        dtype: DType,
        bufs: B,
    ) -> Result<Request<B>, Error> {
        self.launch(what, dtype, bufs, |b| b.buffers())
    }

    /// Returns once every call issued before it on this process's connections has finished:
    /// this communicator's, and those of the communicators split from the same world,
    /// nonblocking ones included (whose requests then complete at once). Sends nothing; each
    /// of those calls finishes or fails within the timeout, so this does not hang either.
    pub fn wait_issued(&self) {
        self.shared.issue_and_run(None, |_, _| ());
    }

    /// Another handle on this communicator (the same group and call counter), for a call
    /// queued for the call thread.
    fn handle(&self) -> Communicator {
        Communicator {
            shared: self.shared.clone(),
            group: self.group.clone(),
            rank: self.rank,
            seq: self.seq.clone(),
            topology: self.topology.clone(),
        }
    }

    /// [`Communicator::iexecute`] that reports the outcome instead of returning a [`Request`]:
    /// the call thread calls `then` with the buffers (or the call's error) the moment the call
    /// ends, in the order calls end (the order they were issued). `then` runs on the call
    /// thread, before any later call starts, so it must be short and must not wait for
    /// anything: hand the outcome over (a channel, a condition variable) and return. Bindings
    /// use it to complete their own futures without a thread of theirs waiting on each
    /// request. An inconsistent call is refused with the error, before anything is issued,
    /// and `then` is then dropped without being called.
    pub fn iexecute_then<B: CallBuffers>(
        &self,
        what: Collective,
        dtype: DType,
        bufs: B,
        then: impl FnOnce(Result<B, Error>) + Send + 'static,
    ) -> Result<Started, Error> {
        self.launch_then(what, dtype, bufs, |b| b.buffers(), then)
    }

    fn launch<T: Send + 'static>(
        &self,
        what: Collective,
        dtype: DType,
        buf: T,
        bytes: impl for<'a> Fn(&'a mut T) -> (&'a [u8], &'a mut [u8]) + Send + 'static,
    ) -> Result<Request<T>, Error> {
        let done = Arc::new(Completion { outcome: Mutex::new(None), ready: Condvar::new() });
        let completion = done.clone();
        let started =
            self.launch_then(what, dtype, buf, bytes, move |outcome| completion.complete(outcome))?;
        Ok(Request { state: Some(Pending::Running(done, started)) })
    }

    /// Checks the call now, then queues it for the call thread, which hands its outcome to
    /// `then` (see [`Communicator::iexecute_then`]).
    fn launch_then<T: Send + 'static>(
        &self,
        what: Collective,
        dtype: DType,
        mut buf: T,
        bytes: impl for<'a> Fn(&'a mut T) -> (&'a [u8], &'a mut [u8]) + Send + 'static,
        then: impl FnOnce(Result<T, Error>) + Send + 'static,
    ) -> Result<Started, Error> {
        {
            let (input, output) = bytes(&mut buf);
            self.check(&what, dtype, input.len(), output.len())?;
        }
        let op = what.name();
        let mut worker = self.shared.worker.lock().unwrap_or_else(|e| e.into_inner());
        if worker.is_none() {
            // Started before any call takes its turn: a thread the system refuses leaves
            // nothing issued (a turn nobody takes would stall every later call).
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("lightpath-coll".into())
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .map_err(|e| Error::Internal { op, detail: format!("starting the call thread: {e}") })?;
            *worker = Some(tx);
        }
        let (ticket, seq) = self.shared.issue(&self.seq);
        let comm = self.handle();
        let job: Job = Box::new(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let r = comm.shared.run(ticket, |st| {
                    let (input, output) = bytes(&mut buf);
                    // Buffers whose lengths changed since the call was issued (a `CallBuffers`
                    // breaking its contract) cannot take part: the peers then learn of it.
                    if let Err(e) = comm.check(&what, dtype, input.len(), output.len()) {
                        st.mesh.fail(e.clone());
                        return Err(e);
                    }
                    comm.run_call(st, &what, dtype, seq, input, output)
                });
                // The last handle on the connections closes them (flushing, saying goodbye):
                // that happens before the request completes, so that a process that exits
                // once its requests are complete leaves cleanly.
                drop(comm);
                r.map(|()| buf)
            }))
            .unwrap_or_else(|_| {
                Err(Error::Internal { op, detail: "the call panicked (a bug in Lightpath)".into() })
            });
            then(outcome);
        });
        let started = Started(Arc::new(Mutex::new(Some(job))));
        let queued = started.clone();
        let job: Job = Box::new(move || {
            queued.run_here();
        });
        if let Err(std::sync::mpsc::SendError(job)) = worker.as_ref().expect("started above").send(job) {
            // The call thread has gone (it does not while the connections live): run the
            // call here, blocking, rather than leave its turn untaken.
            *worker = None;
            drop(worker);
            job();
        }
        Ok(started)
    }

    /// [`Communicator::launch`] for the in-place calls of the typed API, whose argument errors
    /// come back from [`Request::wait`].
    fn spawn<T: Send + 'static>(
        &self,
        what: Collective,
        dtype: DType,
        buf: T,
        bytes: impl Fn(&mut T) -> &mut [u8] + Send + 'static,
    ) -> Request<T> {
        self.launch(what, dtype, buf, move |b| (&[][..], bytes(b)))
            .unwrap_or_else(|e| Request { state: Some(Pending::Failed(e)) })
    }

    /// The allreduce algorithm this communicator uses for `bytes` (forced or from the table).
    pub fn allreduce_algorithm(&self, bytes: usize) -> AllreduceAlgo {
        self.shared.config.allreduce.unwrap_or_else(|| choose_allreduce_on(bytes, &self.topology))
    }

    /// The broadcast algorithm this communicator uses for `bytes` (forced or from the table).
    pub fn broadcast_algorithm(&self, bytes: usize) -> BroadcastAlgo {
        self.shared.config.broadcast.unwrap_or_else(|| choose_broadcast_on(bytes, &self.topology))
    }

    /// `buf` = op over every rank's `buf`.
    pub fn allreduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), Error> {
        let algo = self.allreduce_algorithm(std::mem::size_of_val(buf));
        let what = Collective::Allreduce { count: buf.len(), op, algo, in_place: true };
        self.execute(&what, T::DTYPE, &[], bytemuck::cast_slice_mut(buf))
    }

    /// `output` = op over every rank's `input`.
    pub fn allreduce<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<(), Error> {
        let algo = self.allreduce_algorithm(std::mem::size_of_val(input));
        let what = Collective::Allreduce { count: output.len(), op, algo, in_place: false };
        self.execute(&what, T::DTYPE, bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output))
    }

    /// Nonblocking in-place allreduce; the buffer comes back from [`Request::wait`].
    pub fn iallreduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Request<Vec<T>> {
        let algo = self.allreduce_algorithm(std::mem::size_of_val(&buf[..]));
        let what = Collective::Allreduce { count: buf.len(), op, algo, in_place: true };
        self.spawn(what, T::DTYPE, buf, |b| bytemuck::cast_slice_mut(&mut b[..]))
    }

    /// The root's `buf` = op over every rank's `buf`; other ranks' buffers are unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<(), Error> {
        let what = Collective::Reduce { count: buf.len(), op, root };
        self.execute(&what, T::DTYPE, &[], bytemuck::cast_slice_mut(buf))
    }

    /// Every rank's `buf` = the root's.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), Error> {
        let algo = self.broadcast_algorithm(std::mem::size_of_val(buf));
        let what = Collective::Broadcast { count: buf.len(), root, algo };
        self.execute(&what, T::DTYPE, &[], bytemuck::cast_slice_mut(buf))
    }

    /// Nonblocking broadcast.
    pub fn ibroadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Request<Vec<T>> {
        let algo = self.broadcast_algorithm(std::mem::size_of_val(&buf[..]));
        let what = Collective::Broadcast { count: buf.len(), root, algo };
        self.spawn(what, T::DTYPE, buf, |b| bytemuck::cast_slice_mut(&mut b[..]))
    }

    /// `output` = every rank's `input`, in rank order (all inputs the same length).
    pub fn allgather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<(), Error> {
        let what = Collective::Allgather { counts: vec![input.len(); self.size()], in_place: false };
        self.execute(&what, T::DTYPE, bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output))
    }

    /// Allgather where rank `r`'s block is already at `output[r * n..(r + 1) * n]`.
    pub fn allgather_in_place<T: Element>(&self, output: &mut [T]) -> Result<(), Error> {
        let p = self.size();
        if !output.len().is_multiple_of(p) {
            return Err(invalid(
                "allgather",
                format!("{} elements do not split into {p} equal blocks", output.len()),
            ));
        }
        let what = Collective::Allgather { counts: vec![output.len() / p; p], in_place: true };
        self.execute(&what, T::DTYPE, &[], bytemuck::cast_slice_mut(output))
    }

    /// Allgather with a count per rank (`counts[r]` elements from rank `r`).
    pub fn allgatherv<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<(), Error> {
        let what = Collective::Allgather { counts: counts.to_vec(), in_place: false };
        self.execute(&what, T::DTYPE, bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output))
    }

    /// `output` (n elements) = op over every rank's block `rank` of `input` (`size` blocks of n).
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        let what = Collective::ReduceScatter { count: output.len(), op };
        self.execute(&what, T::DTYPE, bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output))
    }

    /// Block `j` of `input` goes to rank `j`; block `i` of `output` comes from rank `i`
    /// (equal blocks).
    pub fn alltoall<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<(), Error> {
        let p = self.size();
        if !input.len().is_multiple_of(p) {
            return Err(invalid(
                "alltoall",
                format!("{} elements do not split into {p} equal blocks", input.len()),
            ));
        }
        let counts = vec![input.len() / p; p];
        self.alltoallv(input, &counts, output, &counts)
    }

    /// Alltoall with counts per peer (blocks contiguous in rank order).
    pub fn alltoallv<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), Error> {
        let what =
            Collective::Alltoall { send_counts: send_counts.to_vec(), recv_counts: recv_counts.to_vec() };
        self.execute(&what, T::DTYPE, bytemuck::cast_slice(input), bytemuck::cast_slice_mut(output))
    }

    /// Returns once every rank of the group has entered.
    pub fn barrier(&self) -> Result<(), Error> {
        self.execute(&Collective::Barrier, DType::U8, &[], &mut [])
    }

    /// Nonblocking barrier.
    pub fn ibarrier(&self) -> Request<()> {
        self.spawn(Collective::Barrier, DType::U8, (), |_| &mut [])
    }

    /// Sends `buf` to `peer`, which must call [`Communicator::recv`] with the same count.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<(), Error> {
        self.execute(
            &Collective::Send { count: buf.len(), peer },
            T::DTYPE,
            bytemuck::cast_slice(buf),
            &mut [],
        )
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<(), Error> {
        self.execute(
            &Collective::Recv { count: buf.len(), peer },
            T::DTYPE,
            &[],
            bytemuck::cast_slice_mut(buf),
        )
    }
}

/// The local address of the route towards `to` (no packet is sent: a UDP "connect" only
/// picks the route).
fn route_to(to: std::net::SocketAddr) -> std::io::Result<IpAddr> {
    let any = if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
    let s = UdpSocket::bind(any)?;
    s.connect(to)?;
    Ok(s.local_addr()?.ip())
}
