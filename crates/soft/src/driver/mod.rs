//! The UDP driver around one engine: the state shared by a device's objects and its helper
//! thread, and the one routine that moves the engine forward (receive, timers, transmit,
//! notify).
//!
//! Locking: one mutex guards the engine together with the socket buffers, the completion-queue
//! wake-up table and the driver counters ([`Core`]). Every verbs call takes it briefly; socket
//! system calls happen under it so that datagrams enter and leave the engine in order.

mod ports;
mod progress;
mod signal;
mod socket;
mod stats;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use lightpath_roce::{CqHandle, Engine, EngineConfig, EngineEvent, Time};
use lightpath_verbs::{lightpath_pmtu_for_link, WakeFor, WorkCompletion};
use lightpath_verbs::{CompletionHook, Error, Gid, Mtu, Result};

use ports::{HeldAnswers, PortSet, PORTS_ACTIVE_FOR, PORT_TICK};
pub(crate) use ports::{PortDoorbell, QpPort};
pub(crate) use signal::CqSignal;
use socket::{RoceSocket, RxBuffers, TxBuffers};
pub use stats::{DriverStats, SoftStats};

use crate::config::SoftConfig;
use crate::sys::{self, EventFd, OneShotTimer, RECV_BATCH, SEND_DATAGRAMS};

/// How long the progress thread holds the answers to what an event loop received, waiting
/// for the event loop's reply to carry them (see [`Shared::drive_for_progress`]).
pub(crate) const ANSWER_HOLD: Duration = Duration::from_micros(200);

/// The monotonic clock (`CLOCK_MONOTONIC`, the one `Instant` reads) in nanoseconds: read
/// several times per message, so without `Instant`'s normalised `Duration` arithmetic.
fn monotonic_nanos() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// At most this many receive batches per drive, so one call cannot be held up indefinitely by
/// a peer that keeps sending.
const MAX_RX_BATCHES_PER_DRIVE: usize = 8;

/// How long the socket may go unwatched after the last application thread stopped watching it,
/// before the progress thread takes it over (see [`SocketWatch`]).
///
/// A thread that leaves a wait usually comes back within microseconds (it takes the message,
/// answers, and reads again), so handing the socket to the progress thread at once cost a
/// wake-up of that thread per message (measured: 21,823 wake-ups of the server's progress
/// thread over a 20,000-message ping-pong). Arrivals meanwhile wait in the socket; nothing the
/// application waits for is delayed, since a thread that blocks watches the socket itself.
const SOCKET_HANDOVER_DELAY: Duration = Duration::from_millis(1);

/// What one [`Shared::wait_round`] found.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WaitRound {
    /// Completions taken from the queue.
    pub(crate) completions: usize,
    /// Messages received from the socket (work for the engine, if not for this queue yet).
    pub(crate) received: usize,
    /// Time to the engine's next timer.
    pub(crate) next_timer: Option<Duration>,
}

/// What [`Shared::drain_port`] did.
#[derive(Clone, Copy, Debug)]
struct PortDrain {
    /// Messages received.
    received: usize,
    /// The last receive found the port empty: everything that arrived before it is in the
    /// engine. (False when another thread was receiving from the port, or the batches ran
    /// out first.)
    drained: bool,
}

/// Spins in a row that saw no traffic after which socket watchers stop spinning.
const SPIN_GIVE_UP_AFTER: u32 = 4;

/// Once spinning was given up, one wait in this many spins anyway, to see whether it pays
/// again.
const SPIN_RETRY_EVERY: u32 = 32;

/// Sentinel for "the progress thread is awake" in [`Shared::thread_deadline`].
const AWAKE: u64 = 0;

/// Hashes completion-queue handles (small integers the engine picks) with one multiply: the
/// map is consulted for every notification, where SipHash would cost more than the rest.
#[derive(Default)]
pub(crate) struct HandleHasher(u64);

impl Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Everything guarded by the device lock.
pub(crate) struct Core {
    pub(crate) engine: Engine,
    pub(crate) signals: HashMap<CqHandle, Arc<CqSignal>, BuildHasherDefault<HandleHasher>>,
    pub(crate) stats: DriverStats,
    rx: RxBuffers,
    rx_pace: RxPace,
    /// Completion hooks of queues that gained entries, run by [`CoreGuard`] once the lock is
    /// released (a hook polls its queue, which takes the lock).
    due_hooks: Vec<CompletionHook>,
    /// Queue pairs with a port of their own (see `ports`), by number.
    ports: HashMap<u32, Arc<QpPort>, BuildHasherDefault<HandleHasher>>,
    /// The queue pair whose owner is arming its port (`Shared::arm_port`): its own news rings
    /// no doorbell (it looks right after), and is recorded in `arming_found`.
    arming: Option<u32>,
    arming_found: bool,
    /// Doorbells news rang (see `Shared::take_in_for_tasks`, which counts its own).
    rung: u64,
    /// Scratch list of readable ports (the progress thread's look).
    readable_ports: Vec<u32>,
}

/// The engine locked ([`Shared::lock`]): derefs to [`Core`]; when dropped it unlocks, then
/// runs the completion hooks that came due meanwhile, with no lock of the device held.
pub(crate) struct CoreGuard<'a> {
    guard: Option<MutexGuard<'a, Core>>,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        self.guard.as_ref().expect("the guard holds the lock until it is dropped")
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        self.guard.as_mut().expect("the guard holds the lock until it is dropped")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else { return };
        if guard.due_hooks.is_empty() {
            return;
        }
        let hooks = std::mem::take(&mut guard.due_hooks);
        drop(guard);
        for hook in hooks {
            hook();
        }
    }
}

/// How many messages a polling round asks the kernel for first.
///
/// With sparse traffic (ping-pong: rounds that find nothing between messages) the first
/// `recvmmsg` takes one message. A reply and the ACK its sender sent right behind it then do
/// not both go through the kernel and the engine before the application sees the reply; the
/// ACK waits in the socket for the next round (measured: −0.7 µs one-way for 4 KiB SENDs).
/// Once several rounds in a row find a message waiting, the traffic is a stream and rounds
/// ask for full batches again, until a batch comes back (nearly) empty.
#[derive(Debug, Default)]
struct RxPace {
    stream: bool,
    /// Consecutive one-message rounds that found their message waiting.
    busy_rounds: u8,
}

impl RxPace {
    /// Rounds in a row that must find a message waiting before full batches are asked for.
    const STREAM_AFTER: u8 = 4;

    fn first_batch(&self) -> usize {
        if self.stream {
            RECV_BATCH
        } else {
            1
        }
    }

    /// A round asked for `first` messages first and received `received` in all.
    fn record(&mut self, first: usize, received: usize) {
        if self.stream {
            if received <= 1 {
                *self = Self::default();
            }
        } else if first == 1 && received >= 1 {
            self.busy_rounds += 1;
            self.stream = self.busy_rounds >= Self::STREAM_AFTER;
        } else {
            self.busy_rounds = 0;
        }
    }
}

/// State shared by a device's objects and its helper thread.
pub(crate) struct Shared {
    core: Mutex<Core>,
    /// The sending lock and its buffers: whoever holds it is the one thread sending the
    /// engine's datagrams, in the engine's order. It is taken before the engine lock (or
    /// tried with the engine held, never waited for), so a posting thread fills a batch under
    /// the engine lock and sends it after releasing that (see [`Shared::after_post`]): the
    /// engine is not held through `sendmmsg`, which over loopback carries the datagrams
    /// through the receiver's network stack too.
    tx: Mutex<TxBuffers>,
    /// A thread that had datagrams to send found the sending lock taken: its holder looks at
    /// the engine once more before it lets go.
    tx_pending: AtomicBool,
    /// The progress thread holds answers (ACKs) back for an event loop's reply (see
    /// [`Shared::drive_for_progress`]). Changed with the engine locked; read without the lock
    /// too (`CompletionQueue::consumer_idle` takes it only when this is set).
    pub(crate) answers_held: AtomicBool,
    /// Times a queue pair's owner armed its port ([`DriverStats::port_armings`]).
    port_armings: AtomicU64,
    socket: RoceSocket,
    /// Wakes the progress/helper thread (new earlier timer, or shutdown).
    waker: EventFd,
    /// Expires [`SOCKET_HANDOVER_DELAY`] after the last socket watcher left: then the
    /// progress thread watches the socket again, if nobody else does.
    handover: OneShotTimer,
    /// When the last socket watcher left (nanoseconds since `epoch`; 0: never watched).
    unwatched_since: AtomicU64,
    /// `handover` is armed (or about to be): a leaving watcher arms it only when it is not.
    handover_armed: AtomicBool,
    /// The monotonic clock's reading, in nanoseconds, when the device opened: the engine's
    /// time zero (see [`Shared::now`]).
    epoch: u64,
    pub(crate) config: SoftConfig,
    /// The interface holding the device's address and its MTU, if it could be read.
    pub(crate) link: Option<(String, u32)>,
    /// The largest path MTU that link carries (4096 if unknown).
    pub(crate) max_mtu: Mtu,
    /// The largest Lightpath-extension path MTU that link carries
    /// (`QpAttr::lightpath_pmtu`; 4096 if the link is unknown).
    pub(crate) max_lightpath_pmtu: u32,
    pub(crate) gid: Gid,
    pub(crate) name: String,
    stop: AtomicBool,
    /// Nanoseconds since `epoch` the progress thread sleeps until (`u64::MAX`: no timer;
    /// [`AWAKE`]: it is running and will look at the engine before sleeping again).
    thread_deadline: AtomicU64,
    /// When the device was last driven (polling mode), in nanoseconds since `epoch`.
    last_driven: AtomicU64,
    /// Polling mode: an event loop went to sleep on its notification, which only a reader of
    /// the socket can make; the helper thread takes the socket at once (see
    /// [`Shared::socket_relied_on`]) instead of after `assist_after`.
    assist_now: AtomicBool,
    /// Application threads blocked in a progress-thread-mode `wait` that watch the socket
    /// themselves; while there are any, the progress thread leaves the socket to them.
    socket_watchers: AtomicU32,
    /// How long socket watchers spin, and how that paid lately (see [`Shared::spin_budget`]).
    watcher_spin: crate::AdaptiveSpin,
    /// The epoll instances of the queue pairs' ports, all and fresh ones (see `ports`; made
    /// with the first port).
    port_set: OnceLock<(PortSet, PortSet)>,
    /// Ports open.
    port_count: AtomicUsize,
    /// The epoll instance of the ports whose waiters are event loops' tasks (made with the
    /// first), for [`TaskPortSpin`].
    task_ports: OnceLock<PortSet>,
    /// Ports in `task_ports` (shared with [`TaskPortSpin`], which reads it on every wait of an
    /// event loop's stream without reaching the device).
    task_port_count: Arc<AtomicUsize>,
    /// The device's [`TaskPortSpin`], made with the first task port.
    task_spin: OnceLock<Arc<TaskPortSpin>>,
    /// When a port last received datagrams (nanoseconds since `epoch`).
    last_port_traffic: AtomicU64,
}

impl Shared {
    pub(crate) fn new(mut config: SoftConfig) -> Result<Self> {
        let socket =
            RoceSocket::bind(config.local, config.recv_buffer, config.send_buffer, config.udp_offload)?;
        config.local = socket.local();
        // As rxe derives a port's active MTU from its netdev's: never more than the link
        // carries (a larger MTU would have every full-size datagram refused by the kernel).
        let link = sys::link_mtu_of(config.local.ip()).ok().flatten();
        let ipv6 = config.local.is_ipv6();
        let max_mtu = match &link {
            None => Mtu::Mtu4096,
            Some((interface, mtu)) => Mtu::largest_for_link(*mtu, ipv6).ok_or_else(|| {
                Error::Unavailable(format!(
                    "the link MTU of {interface} ({mtu} bytes) cannot carry RoCE v2 packets of even 256 bytes"
                ))
            })?,
        };
        config.mtu = config.mtu.min(max_mtu);
        let max_lightpath_pmtu = match &link {
            None => Mtu::Mtu4096.bytes(),
            Some((_, mtu)) => lightpath_pmtu_for_link(*mtu, ipv6).unwrap_or(max_mtu.bytes()),
        };
        let gid = Gid::from_ip(config.local.ip());
        let engine = Engine::new(EngineConfig {
            gid,
            roce_port: config.local.port(),
            verify_icrc: config.verify_icrc,
            // One socket sends from its bound port only; sealing for it saves a second CRC pass.
            fixed_src_port: Some(config.local.port()),
            max_qps: config.max_qps,
            max_mrs: config.max_mrs,
            max_cqs: config.max_cqs,
            max_cqe: config.max_cqe,
            // Payloads towards Lightpath peers go from region memory to the kernel directly.
            gather_payloads: true,
        });
        let core = Core {
            engine,
            signals: HashMap::default(),
            stats: DriverStats::default(),
            rx: RxBuffers::new(&socket),
            rx_pace: RxPace::default(),
            due_hooks: Vec::new(),
            ports: HashMap::default(),
            arming: None,
            arming_found: false,
            rung: 0,
            readable_ports: Vec::new(),
        };
        let watcher_spin = crate::AdaptiveSpin::new(config.wait_spin, SPIN_GIVE_UP_AFTER, SPIN_RETRY_EVERY);
        Ok(Self {
            core: Mutex::new(core),
            tx: Mutex::new(TxBuffers::new(config.udp_offload, config.mode.is_polling())),
            tx_pending: AtomicBool::new(false),
            socket,
            waker: EventFd::new(false)?,
            handover: OneShotTimer::new()?,
            unwatched_since: AtomicU64::new(0),
            handover_armed: AtomicBool::new(false),
            epoch: monotonic_nanos(),
            name: config.device_name(),
            link,
            max_mtu,
            max_lightpath_pmtu,
            gid,
            config,
            stop: AtomicBool::new(false),
            thread_deadline: AtomicU64::new(AWAKE),
            last_driven: AtomicU64::new(0),
            assist_now: AtomicBool::new(false),
            answers_held: AtomicBool::new(false),
            port_armings: AtomicU64::new(0),
            socket_watchers: AtomicU32::new(0),
            watcher_spin,
            port_set: OnceLock::new(),
            task_ports: OnceLock::new(),
            task_port_count: Arc::new(AtomicUsize::new(0)),
            task_spin: OnceLock::new(),
            port_count: AtomicUsize::new(0),
            last_port_traffic: AtomicU64::new(0),
        })
    }

    /// Refuses a path MTU above the port's active MTU, naming the link that limits it.
    pub(crate) fn check_path_mtu(&self, requested: Mtu) -> Result<()> {
        let active = self.config.mtu;
        if requested <= active {
            return Ok(());
        }
        let why = match &self.link {
            Some((interface, mtu)) if self.max_mtu == active => format!(
                "{} is on {interface}, whose link MTU is {mtu} bytes; a {}-byte payload needs {} with \
                 its RoCE v2 headers",
                self.name,
                requested.bytes(),
                requested.bytes() + Mtu::roce_overhead(self.config.local.is_ipv6())
            ),
            _ => format!("{} was opened with MTU {}", self.name, active.bytes()),
        };
        Err(Error::PathMtuTooLarge { requested: requested.bytes(), active: active.bytes(), why })
    }

    /// Refuses a Lightpath-extension path MTU (`QpAttr::lightpath_pmtu`) above what the link
    /// carries, naming the link.
    pub(crate) fn check_lightpath_pmtu(&self, requested: u32) -> Result<()> {
        let active = self.max_lightpath_pmtu;
        if requested <= active {
            return Ok(());
        }
        let why = match &self.link {
            Some((interface, mtu)) => format!(
                "{} is on {interface}, whose link MTU is {mtu} bytes; a {requested}-byte payload needs {} \
                 with its RoCE v2 headers",
                self.name,
                requested + Mtu::roce_overhead(self.config.local.is_ipv6())
            ),
            None => format!("{}: the link MTU is unknown, so at most {active} bytes", self.name),
        };
        Err(Error::PathMtuTooLarge { requested, active, why })
    }

    /// The bound socket address.
    pub(crate) fn local(&self) -> SocketAddr {
        self.socket.local()
    }

    /// The engine's notion of now.
    pub(crate) fn now(&self) -> Time {
        Time::from_nanos(monotonic_nanos().saturating_sub(self.epoch))
    }

    /// The sending lock, if no other thread holds it.
    fn try_lock_tx(&self) -> Option<MutexGuard<'_, TxBuffers>> {
        match self.tx.try_lock() {
            Ok(tx) => Some(tx),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The sending lock, waiting for it (with the engine not locked by this thread): held
    /// while a region is deregistered, so no batch in flight reads its memory after that.
    /// Give it back with [`Shared::unlock_tx`].
    pub(crate) fn lock_tx(&self) -> MutexGuard<'_, TxBuffers> {
        self.tx.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Gives back the sending lock taken with [`Shared::lock_tx`] (with the engine not locked
    /// by this thread): output that other threads left to its holder meanwhile (they found it
    /// taken) is sent now, not left waiting for the next post.
    pub(crate) fn unlock_tx(&self, tx: MutexGuard<'_, TxBuffers>) {
        drop(tx);
        if self.tx_pending.load(Ordering::SeqCst) {
            self.send_unlocked(None, self.now());
        }
    }

    pub(crate) fn lock(&self) -> CoreGuard<'_> {
        // A panic in another thread while it held the lock leaves the engine in whatever state
        // that call reached; the engine's own invariants are maintained per call, so carry on
        // rather than poison every later call.
        CoreGuard { guard: Some(self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())) }
    }

    pub(crate) fn is_polling(&self) -> bool {
        self.config.mode.is_polling()
    }

    /// After a verbs call changed the engine: send what it produced, wake waiters, and make
    /// sure the progress thread's sleep ends no later than the engine's next timer.
    pub(crate) fn after_call(&self, core: &mut Core, now: Time) {
        self.transmit(core, now);
        self.check_thread_deadline(core);
    }

    /// As [`Shared::after_call`] after a post, but the datagrams go out once `core` is
    /// unlocked: a batch is taken from the engine under its lock, then sent with only the
    /// sending lock held, so other threads post and receive meanwhile. While another thread
    /// holds the sending lock, that thread sends them.
    pub(crate) fn after_post(&self, mut core: CoreGuard<'_>, now: Time) {
        self.answers_held.store(false, Ordering::Relaxed);
        self.deliver_events(&mut core);
        self.check_thread_deadline(&core);
        self.send_unlocked(Some(core), now);
    }

    /// Sends what the engine has to send, batch by batch, each taken under the engine lock
    /// (`core`, if the caller holds it, is used for the first and released) and sent after
    /// releasing it, as long as this thread gets the sending lock; output of threads that
    /// found the sending lock taken meanwhile goes too.
    fn send_unlocked(&self, mut core: Option<CoreGuard<'_>>, now: Time) {
        loop {
            self.tx_pending.store(true, Ordering::SeqCst);
            let Some(mut tx) = self.try_lock_tx() else { return };
            self.tx_pending.store(false, Ordering::SeqCst);
            loop {
                let mut engine = core.take().unwrap_or_else(|| self.lock());
                let filled = tx.fill(&self.socket, &mut engine.engine, now.max(self.now()));
                // Building packets can complete work too (see `transmit`).
                self.deliver_events(&mut engine);
                drop(engine);
                tx.send_filled(&self.socket);
                if filled < SEND_DATAGRAMS && !self.tx_pending.swap(false, Ordering::SeqCst) {
                    break;
                }
            }
            drop(tx);
            // A thread that found the lock taken after the last look: take it again (or
            // leave it to whoever took it meanwhile).
            if !self.tx_pending.load(Ordering::SeqCst) {
                return;
            }
        }
    }

    /// After `post_recv`: a receive request never makes the engine send anything, so only the
    /// notifications (a receive flushed in ERR) are delivered. Output the device still owes
    /// (ACKs held back by [`Shared::poll_round`]) stays for the next send or poll, which
    /// usually carries the application's reply in the same system call.
    pub(crate) fn after_recv_post(&self, core: &mut Core) {
        self.deliver_events(core);
        self.check_thread_deadline(core);
    }

    fn check_thread_deadline(&self, core: &Core) {
        if let Some(next) = core.engine.poll_timeout() {
            if next.as_nanos() < self.thread_deadline.load(Ordering::SeqCst) {
                self.waker.signal(1);
            }
        }
    }

    /// Sends what the engine has to send (held-back answers, due retransmissions' output).
    pub(crate) fn flush(&self, core: &mut Core) {
        let now = self.now();
        self.transmit(core, now);
    }

    /// Receives what is waiting, runs due timers, transmits and notifies. Returns how many
    /// messages were received.
    pub(crate) fn drive(&self, core: &mut Core) -> usize {
        let now = self.now();
        core.engine.release_all_answers();
        let received = self.receive_and_run(core, now, RECV_BATCH, None);
        self.transmit(core, now);
        received
    }

    /// The progress thread's drive. When what it received completed work of a queue with a
    /// completion hook (an event loop's, which the hook wakes now), the engine's answers are
    /// held back, as a watcher's are: the event loop's reply, posted within moments, takes them
    /// along in one `sendmmsg`, and the peer receives the ACK with the reply instead of waking
    /// once for each. The progress thread sends them itself after [`ANSWER_HOLD`] if no post
    /// did (it sleeps no longer: see `run_progress`), and so does an event loop that goes back
    /// to waiting without a reply (`CompletionQueue::consumer_idle`). Returns the messages
    /// received and whether answers are held.
    pub(crate) fn drive_for_progress(&self, core: &mut Core) -> (usize, bool) {
        let now = self.now();
        let held = self.answers_held.swap(false, Ordering::Relaxed);
        if held && core.engine.has_output() {
            core.stats.late_answers += 1;
        }
        // What armings held for their owners' replies (see `finish_arming`) goes now too:
        // no reply took it within a tick.
        if core.engine.has_held_answers() {
            core.stats.late_answers += core.engine.release_all_answers() as u64;
        }
        let hooks_before = core.due_hooks.len();
        let received = self.receive_and_run(core, now, RECV_BATCH, None);
        if received > 0 && core.due_hooks.len() > hooks_before && !held && core.engine.has_output() {
            self.answers_held.store(true, Ordering::Relaxed);
            return (received, true);
        }
        self.transmit(core, now);
        (received, false)
    }

    /// One round of a polling-mode `poll` on completion queue `cq`: send what the last round
    /// held back, take completions waiting in `cq`, and if there are none, receive and run
    /// timers. When that produces completions for `cq`, they are returned *before* the
    /// engine's answers (ACKs) go out, so the application sees its message one system call
    /// sooner; the answers leave with the application's next post (one `sendmmsg` for its
    /// reply and the ACK) or at the start of its next poll, whichever comes first. Returns the
    /// completions taken and the time to the engine's next timer.
    pub(crate) fn poll_round(&self, cq: CqHandle, out: &mut [WorkCompletion]) -> (usize, Option<Duration>) {
        let mut core = self.lock();
        let now = self.now();
        self.transmit(&mut core, now);
        let mut count = core.engine.poll_cq(cq, out);
        if count == 0 {
            let first = core.rx_pace.first_batch();
            let received = self.receive_and_run(&mut core, now, first, Some(cq));
            core.rx_pace.record(first, received);
            // Only a hint for the helper thread: no ordering with anything else is needed.
            self.last_driven.store(now.as_nanos(), Ordering::Relaxed);
            count = core.engine.poll_cq(cq, out);
            if count == 0 {
                self.transmit(&mut core, now);
            }
        }
        let next_timer = core.engine.poll_timeout().map(|due| due.saturating_duration_since(now));
        (count, next_timer)
    }

    /// One round of a progress-thread-mode `wait` on `cq` by a registered waiter of `cq`: take
    /// its completions, or drive the device (receive, timers) and take them. Returns the
    /// completions taken and the time to the engine's next timer.
    ///
    /// `watching`: the caller watches the socket (see [`Shared::try_watch_socket`]). Its
    /// rounds behave as polling-mode rounds do: when the arrivals complete work on `cq`, the
    /// engine's answers (ACKs) are held back and leave with the application's next post,
    /// usually its reply, in one `sendmmsg`, or with the next drive; a watcher that leaves
    /// arms the hand-over timer, so the progress thread sends them within
    /// `SOCKET_HANDOVER_DELAY` if nobody else does. Completions for the caller's own queue
    /// do not signal its wake-up fd when it is the queue's only waiter (it takes them right
    /// after).
    pub(crate) fn wait_round(&self, cq: CqHandle, out: &mut [WorkCompletion], watching: bool) -> WaitRound {
        let mut core = self.lock();
        let mut count = core.engine.poll_cq(cq, out);
        let mut received = 0;
        if count == 0 {
            let now = self.now();
            let stop_for = watching.then_some(cq);
            received = self.receive_and_run_for(&mut core, now, RECV_BATCH, stop_for, Some(cq));
            count = core.engine.poll_cq(cq, out);
            if count == 0 || !watching {
                self.transmit(&mut core, now);
            }
            if received > 0 || count > 0 {
                self.check_thread_deadline(&core);
            }
        }
        WaitRound { completions: count, received, next_timer: self.until_next_timer(&core) }
    }

    /// Marks the calling thread as watching the socket (it blocks on it and drives the device
    /// when it becomes readable) until the guard is dropped, if no application thread watches
    /// yet.
    ///
    /// A thread waiting for a completion that arrives by the network then wakes once, when the
    /// datagram does, instead of waiting for the progress thread to wake, process it and wake
    /// it in turn (two wake-ups, each several microseconds).
    ///
    /// One watcher is enough to drive arrivals (it wakes the others' queues as their
    /// completions land, and the progress thread takes over when it leaves); with a watcher
    /// per waiting thread, every datagram woke every waiter: a thousand blocked connections, a
    /// thousand wake-ups.
    pub(crate) fn try_watch_socket(&self) -> Option<SocketWatch<'_>> {
        self.socket_watchers
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| SocketWatch(self))
    }

    /// Called by the progress thread after the hand-over timer expired: whether the socket
    /// has been unwatched for [`SOCKET_HANDOVER_DELAY`] (if a watcher left since the timer was
    /// armed, the timer is armed again for the rest of the delay; if one watches now, the
    /// next to leave arms it).
    pub(crate) fn handover_due(&self) -> bool {
        self.handover.take();
        self.handover_armed.store(false, Ordering::SeqCst);
        if self.socket_watched() {
            // The watcher that leaves next arms the timer again.
            return false;
        }
        if let Some(unwatched_for) = self.unwatched_for().filter(|&d| d < SOCKET_HANDOVER_DELAY) {
            // A watcher came and left since the timer was armed: the rest of the delay.
            if !self.handover_armed.swap(true, Ordering::SeqCst) {
                self.handover.arm((SOCKET_HANDOVER_DELAY - unwatched_for).max(Duration::from_micros(1)));
            }
            return false;
        }
        true
    }

    /// How long a socket watcher busy-polls before it sleeps: [`SoftConfig::wait_spin`] while
    /// spinning pays, nothing once [`SPIN_GIVE_UP_AFTER`] spins in a row saw no datagram (an idle connection, or a peer that cannot get a core), except one
    /// wait in [`SPIN_RETRY_EVERY`], which tries again.
    pub(crate) fn spin_budget(&self) -> Duration {
        self.watcher_spin.budget()
    }

    /// Records whether a watcher's spin received anything.
    pub(crate) fn record_spin(&self, hit: bool) {
        self.watcher_spin.record(hit);
    }

    /// Whether some application thread watches the socket (see [`Shared::try_watch_socket`]).
    pub(crate) fn socket_watched(&self) -> bool {
        self.socket_watchers.load(Ordering::SeqCst) > 0
    }

    /// Whether the socket is the progress thread's to watch: nobody watches it, and nobody
    /// has for [`SOCKET_HANDOVER_DELAY`]. (A thread between two waits of a ping-pong leaves
    /// it unwatched for microseconds; a progress thread that took it over then would be woken
    /// by, and race for, the datagrams the next wait is there to take.)
    pub(crate) fn socket_is_progress_threads(&self) -> bool {
        if self.socket_watched() {
            return false;
        }
        self.unwatched_for().is_none_or(|d| d >= SOCKET_HANDOVER_DELAY)
    }

    /// A completion queue was armed by a waiter that does not watch the socket itself (an
    /// event loop's stream on a queue pair without a port of its own, whose news only the
    /// socket's reader can make): if the socket is in its hand-over delay (a blocked thread
    /// watched it less than [`SOCKET_HANDOVER_DELAY`] ago and may come back), it is the
    /// progress thread's from now, and that thread is woken to take it. Otherwise what
    /// reached the socket meanwhile waited for the delay's end: a program that connects with
    /// blocking calls and then serves its streams in tokio (`lightpath perf stream_rr`'s
    /// client) waited ~1 ms for the answer to its first message on each connection past the
    /// device's 64 queue-pair ports, 40% of its connection set-up time.
    ///
    /// In polling mode nothing reads the socket but the application's own looks and the
    /// helper thread, which stepped in only after `assist_after` (1 ms) without a look: an
    /// event loop (a tokio runtime, epoll on the readiness descriptor) that waited for its
    /// notification waited that long for every answer (`lightpath perf stream_rr --polling`,
    /// one connection over soft: ~1.1 ms per request). The helper now takes the socket at
    /// once, until the application looks again.
    pub(crate) fn socket_relied_on(&self) {
        if self.is_polling() {
            if !self.assist_now.swap(true, Ordering::SeqCst) {
                self.waker.signal(1);
            }
            return;
        }
        // The hand-over timer is armed from a watcher's leave until the delay has passed: not
        // armed and not watched, the socket is the progress thread's (no clock read needed).
        if self.socket_watched() || !self.handover_armed.load(Ordering::SeqCst) {
            return;
        }
        if self.unwatched_for().is_none_or(|d| d >= SOCKET_HANDOVER_DELAY) {
            // Nobody ever watched it, or the progress thread has it already.
            return;
        }
        // As if nobody had watched it: `socket_is_progress_threads` holds from here, until a
        // watcher comes (and leaves) again.
        self.unwatched_since.store(0, Ordering::SeqCst);
        self.waker.signal(1);
    }

    /// How long ago the last socket watcher left; `None` if nobody ever watched.
    fn unwatched_for(&self) -> Option<Duration> {
        let left = self.unwatched_since.load(Ordering::SeqCst);
        (left != 0).then(|| Duration::from_nanos(self.now().as_nanos().saturating_sub(left)))
    }

    /// Receives up to [`MAX_RX_BATCHES_PER_DRIVE`] batches (the first of at most `first`
    /// messages, the others full size) and runs due timers; delivers notifications, but
    /// transmits only between full batches (a long burst is answered as it arrives). With
    /// `stop_for`, stops receiving as soon as that completion queue has entries. Returns how
    /// many messages were received.
    fn receive_and_run(&self, core: &mut Core, now: Time, first: usize, stop_for: Option<CqHandle>) -> usize {
        self.receive_and_run_for(core, now, first, stop_for, None)
    }

    /// [`Shared::receive_and_run`] by a registered waiter of `waiter_of`, whose own wake-up
    /// is skipped when it is that queue's only waiter.
    fn receive_and_run_for(
        &self,
        core: &mut Core,
        now: Time,
        first: usize,
        stop_for: Option<CqHandle>,
        waiter_of: Option<CqHandle>,
    ) -> usize {
        let mut received = 0;
        let mut limit = first;
        for _ in 0..MAX_RX_BATCHES_PER_DRIVE {
            let Core { engine, rx, stats, .. } = &mut *core;
            let count = rx.receive(&self.socket, engine, now, stats, limit);
            received += count;
            if count < limit || stop_for.is_some_and(|cq| core.engine.cq_len(cq) > 0) {
                break;
            }
            if limit == RECV_BATCH {
                self.transmit(core, now);
            }
            limit = RECV_BATCH;
        }
        run_due_timers(core, now);
        self.deliver_events_for(core, waiter_of);
        received
    }

    /// Wakes whoever waits for the completion queues that gained entries.
    fn deliver_events(&self, core: &mut Core) {
        self.deliver_events_for(core, None);
    }

    /// [`Shared::deliver_events`] on behalf of a registered waiter of `waiter_of`.
    fn deliver_events_for(&self, core: &mut Core, waiter_of: Option<CqHandle>) {
        let Core { engine, signals, due_hooks, ports, arming, arming_found, rung, .. } = core;
        while let Some(event) = engine.poll_event() {
            let (qpn, arrival) = match event {
                EngineEvent::Completion(cq) => {
                    if let Some(signal) = signals.get(&cq) {
                        signal.completion_added(waiter_of == Some(cq));
                        if let Some(hook) = signal.hook() {
                            if !due_hooks.iter().any(|due| Arc::ptr_eq(due, hook)) {
                                due_hooks.push(Arc::clone(hook));
                            }
                        }
                    }
                    continue;
                }
                EngineEvent::QpNews { qpn, arrival } => (qpn, arrival),
                EngineEvent::QpError { qpn } => (qpn, true),
                _ => continue,
            };
            if *arming == Some(qpn) {
                *arming_found = true;
            } else if let Some(port) = ports.get(&qpn) {
                if port.news(arrival) {
                    *rung += 1;
                }
            }
        }
    }

    /// Gives queue pair `qpn` a port of its own whose waiter's doorbell is `doorbell` (see
    /// `ports`). `None` when ports are not used: polling mode (the caller drives the device
    /// itself), [`SoftConfig::max_qp_ports`] reached, or the kernel refused a socket.
    pub(crate) fn open_port(&self, qpn: u32, doorbell: PortDoorbell) -> Option<Arc<QpPort>> {
        if self.is_polling() || self.port_count.load(Ordering::SeqCst) >= self.config.max_qp_ports {
            return None;
        }
        let port = match QpPort::open(qpn, &self.socket, self.config.recv_buffer, doorbell) {
            Ok(port) => Arc::new(port),
            Err(err) => {
                tracing::debug!(qpn, %err, "no port of its own for the queue pair; it shares the device socket");
                return None;
            }
        };
        let (all, fresh) = match self.port_set.get() {
            Some(sets) => sets,
            None => {
                let sets = (PortSet::new().ok()?, PortSet::new().ok()?);
                let _ = self.port_set.set(sets);
                self.port_set.get()?
            }
        };
        all.add(&port).ok()?;
        if fresh.add(&port).is_err() {
            all.remove(&port);
            return None;
        }
        if port.wakes_task() {
            let task_ports = match self.task_ports.get() {
                Some(set) => Some(set),
                None => PortSet::new().ok().map(|set| self.task_ports.get_or_init(|| set)),
            };
            // Without the set the port only misses the event loop's spin (see `TaskPortSpin`).
            if task_ports.is_some_and(|set| set.add(&port).is_ok()) {
                self.task_port_count.fetch_add(1, Ordering::SeqCst);
            }
        }
        let mut core = self.lock();
        core.ports.insert(qpn, Arc::clone(&port));
        core.engine.set_qp_news(true);
        if self.port_count.fetch_add(1, Ordering::SeqCst) == 0 {
            // The progress thread sleeps on the port set from its next round (later ports
            // join the set it already watches).
            self.waker.signal(1);
        }
        Some(port)
    }

    /// Takes in what waits in the ports of the device's event-loop tasks and wakes those armed
    /// for what it completed (see [`TaskPortSpin`]); whether it woke any. One `epoll_wait` for
    /// all the ports; the engine is locked only when some are readable.
    ///
    /// The owner is woken for a completion, not for each datagram: woken per datagram, a task
    /// took in a 64 KiB message a datagram at a time (an arming per datagram), as the spin
    /// finds each one microseconds after it lands. Datagrams that complete nothing (the
    /// middle of a message, acknowledgements) are taken in and do not count: a spin is kept
    /// going by answers, not by the parts of one. The answers of a queue pair whose port gave
    /// datagrams are held for its owner's reply, as its own arming holds them (see
    /// `finish_arming`).
    pub(crate) fn take_in_for_tasks(&self) -> bool {
        let Some(set) = self.task_ports.get() else { return false };
        let mut readable = Vec::new();
        set.readable(&mut readable);
        if readable.is_empty() {
            return false;
        }
        let mut core = self.lock();
        let now = self.now();
        let rung_before = core.rung;
        let mut received = 0;
        for qpn in &readable {
            let Some(port) = core.ports.get(qpn).map(Arc::clone) else { continue };
            let drain = self.drain_port(&mut core, &port, now);
            received += drain.received;
            if drain.received > 0 {
                self.hold_for_reply(&mut core, &port);
            }
            if !drain.drained && port.news(true) {
                // Its owner (or a burst longer than one look) was receiving: it looks again.
                core.rung += 1;
            }
        }
        if received > 0 {
            run_due_timers(&mut core, now);
            self.deliver_events(&mut core);
            self.transmit(&mut core, now);
            self.check_thread_deadline(&core);
        }
        core.rung != rung_before
    }

    /// Forgets `port` (its queue pair is being destroyed).
    pub(crate) fn close_port(&self, core: &mut Core, port: &QpPort) {
        if let Some((all, fresh)) = self.port_set.get() {
            all.remove(port);
            fresh.remove(port);
        }
        if core.ports.remove(&port.qpn).is_some() {
            self.port_count.fetch_sub(1, Ordering::SeqCst);
            if port.wakes_task() {
                if let Some(set) = self.task_ports.get() {
                    if set.remove(port) {
                        self.task_port_count.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
        }
    }

    /// The owner of `port` is about to wait for `wake` (`QueuePair::arm_waiter`): takes in what
    /// waits in the port (its completions land in the queue, where the caller looks next; the
    /// engine's answers are held for its reply, as a socket watcher's are), sends what is owed
    /// otherwise, and arms the doorbell for news other threads make from here.
    ///
    /// The owner receives from its port with no lock held, into buffers of its thread, and
    /// takes the engine lock only when datagrams came (or answers are owed). That receive is
    /// also the look at whether anything waits (the same one system call as a zero-timeout
    /// poll was), and the lock is not held across it: with a thread per connection on few
    /// cores, threads that queued on the engine lock while its holder sat in a system call
    /// cost a futex wait and wake each.
    pub(crate) fn arm_port(&self, port: &QpPort, wake: WakeFor) {
        self.count_arming(port);
        let handled = OWNER_RX.with(|cell| {
            let Ok(mut slot) = cell.try_borrow_mut() else { return false };
            if !port.start_receiving() {
                // Another thread drains the port (with the engine locked): the locked path
                // below waits for it.
                return false;
            }
            let rx = match slot.as_mut() {
                Some(rx) if rx.fits(&port.socket) => rx,
                _ => slot.insert(RxBuffers::new(&port.socket)),
            };
            let received = rx.recv_only(&port.socket, RECV_BATCH);
            if matches!(received, Ok(0)) && !self.owes_answers(port, wake) {
                // Nothing waits in the port and nothing is owed (or what is owed waits for
                // this owner's reply): arming takes no lock (news another thread makes before
                // the store is in the queue, where the caller looks next).
                port.finish_receiving();
                port.arm(wake);
                return true;
            }
            let (mut core, now) = self.start_arming(port);
            let failed = received.is_err();
            let Core { engine, stats, .. } = &mut *core;
            let count = rx.deliver_received(&port.socket, engine, now, stats, received);
            if count > 0 {
                self.port_received(port, now);
                self.transmit_if_burst(&mut core, now, count);
            }
            let more = count == RECV_BATCH;
            port.finish_receiving();
            // A full batch or a failed receive: look again (what waits behind it is unknown).
            let drained = !(more || failed) || self.drain_port(&mut core, port, now).drained;
            self.finish_arming(&mut core, port, wake, now, drained);
            true
        });
        if !handled {
            let (mut core, now) = self.start_arming(port);
            let drained = self.drain_port(&mut core, port, now).drained;
            self.finish_arming(&mut core, port, wake, now, drained);
        }
    }

    /// [`Shared::arm_port`] for an owner that watches the port itself (see
    /// `QueuePair::arm_waiter_without_look`): no receive; with nothing owed, no lock either.
    pub(crate) fn arm_port_without_look(&self, port: &QpPort, wake: WakeFor) {
        if self.owes_answers(port, wake) {
            // The answers go now (the owner sleeps without a reply to carry them), with the
            // look: a full arming.
            self.arm_port(port, wake);
            return;
        }
        self.count_arming(port);
        port.arm(wake);
    }

    /// Whether an arming of `port` for `wake` that finds nothing new must send the answers
    /// its queue pair's engine state holds (ACKs held for a reply, see `finish_arming`) before
    /// its owner sleeps.
    ///
    /// Not when this owner's arming held them, it waits for what the peer sends, and the
    /// progress thread looks within a tick (it sends them then if no reply took them): once
    /// only, so a second empty arming sends them. An event loop reads until a read would
    /// block before it answers (hyper's dispatcher does, then calls the service and writes
    /// the response): the arming of that last read sent the ACK of the request alone, and
    /// the response went in a second `sendmmsg`, each side sending two datagrams in two
    /// system calls per request where one call could carry both. Other queue pairs' holds are
    /// theirs: an event loop serving many connections arms each in turn, and when the holds
    /// were one per device every arming sent the others' ACKs alone.
    fn owes_answers(&self, port: &QpPort, wake: WakeFor) -> bool {
        match port.take_empty_arming() {
            HeldAnswers::None => false,
            HeldAnswers::MayKeep => !(wake == WakeFor::Arrivals && self.progress_looks_within(PORT_TICK)),
            HeldAnswers::Owed => true,
        }
    }

    /// Whether the progress thread will look at the device within `within` (it is awake, or
    /// its sleep ends by then).
    fn progress_looks_within(&self, within: Duration) -> bool {
        let deadline = self.thread_deadline.load(Ordering::SeqCst);
        deadline <= self.now().as_nanos().saturating_add(within.as_nanos() as u64)
    }

    /// Counts an arming of `port`; its first takes it out of the fresh ports (see `ports`).
    fn count_arming(&self, port: &QpPort) {
        self.port_armings.fetch_add(1, Ordering::Relaxed);
        if port.leave_fresh() {
            if let Some((_, fresh)) = self.port_set.get() {
                fresh.remove(port);
            }
        }
    }

    /// Locks the engine for the arming of `port` (its own news then rings no doorbell, see
    /// `Core::arming`).
    fn start_arming(&self, port: &QpPort) -> (CoreGuard<'_>, Time) {
        let mut core = self.lock();
        core.arming = Some(port.qpn);
        core.arming_found = false;
        (core, self.now())
    }

    /// Datagrams came from `port`: counted for the progress thread's looks.
    fn port_received(&self, port: &QpPort, now: Time) {
        port.drained();
        self.last_port_traffic.store(now.as_nanos().max(1), Ordering::Relaxed);
    }

    /// A long burst is answered as it arrives: after a full receive batch, what the engine
    /// has to send goes out before the next one is taken in.
    fn transmit_if_burst(&self, core: &mut Core, now: Time, received: usize) {
        if received == RECV_BATCH {
            self.transmit(core, now);
        }
    }

    /// The end of [`Shared::arm_port`] once the port's datagrams are in the engine: runs
    /// timers, delivers news, holds the answers for the owner's reply or sends them, and arms.
    /// Not `drained` (another thread was taking datagrams out of the port, or a burst
    /// outlasted the batches one look takes): the doorbell is rung at once, so the owner looks
    /// again rather than trusting that whatever still waits will announce itself (an event
    /// loop that saw the port's readiness since its last look arms without looking: see
    /// `QueuePair::arm_waiter_without_look`).
    fn finish_arming(&self, core: &mut Core, port: &QpPort, wake: WakeFor, now: Time, drained: bool) {
        run_due_timers(core, now);
        self.deliver_events(core);
        // What this arming found is answered with the owner's reply, or now.
        if !(core.arming_found && self.hold_for_reply(core, port)) {
            core.engine.release_answers(port.qpn);
            port.clear_reply_hold();
        }
        self.transmit(core, now);
        core.arming = None;
        port.arm(wake);
        if !drained {
            port.news(true);
        }
        self.check_thread_deadline(core);
    }

    /// Holds the answers (ACKs) `port`'s queue pair owes for its owner's reply, which carries
    /// them; whether any are held. Only while the progress thread looks within a tick: its
    /// drive sends what no reply took (an owner asleep since has nothing else to send them).
    fn hold_for_reply(&self, core: &mut Core, port: &QpPort) -> bool {
        let held = self.progress_looks_within(PORT_TICK) && core.engine.hold_answers(port.qpn);
        if held {
            port.hold_for_reply();
        }
        held
    }

    /// Receives what waits in `port` (up to [`MAX_RX_BATCHES_PER_DRIVE`] batches) into the
    /// engine, unless its owner is receiving from it right now (it hands what it took to the
    /// engine itself, in order).
    fn drain_port(&self, core: &mut Core, port: &QpPort, now: Time) -> PortDrain {
        if !port.start_receiving() {
            return PortDrain { received: 0, drained: false };
        }
        let mut drain = PortDrain { received: 0, drained: false };
        for _ in 0..MAX_RX_BATCHES_PER_DRIVE {
            let Core { engine, rx, stats, .. } = &mut *core;
            let received = rx.recv_only(&port.socket, RECV_BATCH);
            // A failed receive says nothing about what waits behind it.
            let failed = received.is_err();
            let count = rx.deliver_received(&port.socket, engine, now, stats, received);
            drain.received += count;
            if count < RECV_BATCH {
                drain.drained = !failed;
                if count > 0 {
                    self.port_received(port, now);
                }
                break;
            }
            self.port_received(port, now);
            self.transmit_if_burst(core, now, count);
        }
        port.finish_receiving();
        drain
    }

    /// The progress thread's look at the ports: drains those readable now (`all`), or those
    /// found readable at its previous look too with nobody reading them since. Returns how
    /// many messages it received.
    pub(crate) fn drain_unread_ports(&self, core: &mut Core, all: bool) -> usize {
        let Some((set, _)) = self.port_set.get() else { return 0 };
        self.drain_ports_of(core, set, all)
    }

    /// The progress thread drains the fresh ports that are readable (see `ports`).
    pub(crate) fn drain_fresh_ports(&self, core: &mut Core) -> usize {
        let Some((_, fresh)) = self.port_set.get() else { return 0 };
        self.drain_ports_of(core, fresh, true)
    }

    /// Drains the ports of `set` readable now (`all`), or only those unread since the last
    /// look.
    fn drain_ports_of(&self, core: &mut Core, set: &PortSet, all: bool) -> usize {
        let mut readable = std::mem::take(&mut core.readable_ports);
        set.readable(&mut readable);
        let now = self.now();
        let mut received = 0;
        for &qpn in &readable {
            let Some(port) = core.ports.get(&qpn).map(Arc::clone) else { continue };
            if all || port.unread_since_last_tick() {
                let drained = self.drain_port(core, &port, now).received;
                if !all && drained > 0 {
                    core.stats.port_rescues += 1;
                }
                received += drained;
            }
        }
        core.readable_ports = readable;
        if received > 0 {
            run_due_timers(core, now);
            self.transmit(core, now);
        }
        received
    }

    /// The ports' epoll instances (all, fresh), while ports exist.
    pub(crate) fn port_set(&self) -> Option<&(PortSet, PortSet)> {
        self.port_set.get().filter(|_| self.port_count.load(Ordering::Relaxed) > 0)
    }

    /// Whether a port received datagrams within [`PORTS_ACTIVE_FOR`].
    /// (False while the device has no port.)
    pub(crate) fn ports_active(&self) -> bool {
        if self.port_set().is_none() {
            return false;
        }
        let last = self.last_port_traffic.load(Ordering::Relaxed);
        last != 0 && self.now().as_nanos().saturating_sub(last) < PORTS_ACTIVE_FOR.as_nanos() as u64
    }

    /// Delivers notifications, then transmits everything pending (a woken waiter starts
    /// waking while the datagrams go out), with the engine locked; if another thread holds
    /// the sending lock (sending a batch it took, or deregistering a region), that thread
    /// sends this output when it lets go.
    fn transmit(&self, core: &mut Core, now: Time) {
        // Whatever was held back goes now.
        self.answers_held.store(false, Ordering::Relaxed);
        self.deliver_events(core);
        self.tx_pending.store(true, Ordering::SeqCst);
        if let Some(mut tx) = self.try_lock_tx() {
            self.tx_pending.store(false, Ordering::SeqCst);
            tx.transmit_all(&self.socket, &mut core.engine, now);
        }
        // Building packets can complete work too (a request whose region was deregistered
        // meanwhile fails, and the queue pair's other requests are flushed).
        self.deliver_events(core);
    }

    /// Time until the engine's next timer, if any.
    pub(crate) fn until_next_timer(&self, core: &Core) -> Option<Duration> {
        core.engine.poll_timeout().map(|due| due.saturating_duration_since(self.now()))
    }

    /// Blocks until the socket or `extra` is readable, or `timeout` passes. Returns whether
    /// `extra` is readable.
    pub(crate) fn block_on_socket(&self, extra: &EventFd, timeout: Option<Duration>) -> io::Result<bool> {
        sys::wait_readable(&[self.socket.as_fd(), extra.as_fd()], timeout).map(|ready| ready & 0b10 != 0)
    }

    /// Blocks until `wake` is signalled (a completion for this waiter) or `timeout` passes.
    /// Returns whether it was.
    pub(crate) fn block_on_signal(&self, wake: &EventFd, timeout: Option<Duration>) -> io::Result<bool> {
        sys::wait_readable(&[wake.as_fd()], timeout).map(|ready| ready != 0)
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> SoftStats {
        let tx = self.lock_tx();
        let sent = tx.stats.clone();
        self.unlock_tx(tx);
        let core = self.lock();
        let driver = DriverStats {
            port_armings: self.port_armings.load(Ordering::Relaxed),
            tx_batches: sent.tx_batches,
            tx_errors: sent.tx_errors,
            tx_segmented: sent.tx_segmented,
            tx_bundles: sent.tx_bundles,
            segmentation_failures: sent.segmentation_failures,
            ..core.stats.clone()
        };
        SoftStats { engine: core.engine.stats().clone(), driver }
    }
}

thread_local! {
    /// Receive buffers of a thread that arms its queue pair's port ([`Shared::arm_port`]),
    /// made at its first arming: the owner receives without the engine lock, so not into the
    /// device's buffers. (Memory is touched as datagrams fill it.)
    static OWNER_RX: std::cell::RefCell<Option<RxBuffers>> = const { std::cell::RefCell::new(None) };
}

/// Runs the engine's timers that are due at `now`.
fn run_due_timers(core: &mut Core, now: Time) {
    if core.engine.poll_timeout().is_some_and(|due| due <= now) {
        core.engine.handle_timeout(now);
    }
}

/// An application thread watching the socket; see [`Shared::try_watch_socket`].
pub(crate) struct SocketWatch<'a>(&'a Shared);

impl Drop for SocketWatch<'_> {
    fn drop(&mut self) {
        // The last watcher leaves: the progress thread watches the socket again unless a
        // thread comes back to wait within the hand-over delay.
        let shared = self.0;
        if shared.socket_watchers.fetch_sub(1, Ordering::SeqCst) == 1 {
            shared.unwatched_since.store(shared.now().as_nanos(), Ordering::SeqCst);
            // Arming a timer is a system call that may reprogram the CPU's timer (a VM exit
            // under a hypervisor: re-arming at every wait of a ping-pong cost more than the
            // rest of the round trip). Armed once; the progress thread re-arms it for the rest
            // of the delay when it fires early relative to the last leave.
            if !shared.handover_armed.swap(true, Ordering::SeqCst) {
                shared.handover.arm(SOCKET_HANDOVER_DELAY);
            }
        }
    }
}

/// The soft device's [`TaskSpin`](lightpath_verbs::TaskSpin): one look (`epoll_wait` with no
/// timeout) at the ports of every queue pair whose waiter is an event loop's task, taking in
/// what waits there and waking the tasks armed for what it completed (see
/// [`Shared::take_in_for_tasks`]). An event loop that keeps looking for a while after one of
/// its tasks went to wait catches the answer here instead of parking its runtime in
/// `epoll_wait` and being woken by the kernel; the ports stay registered with the runtime
/// all along, so nothing depends on the spin. Holds the device weakly: a runtime's spinner
/// does not keep a dropped device's socket open.
pub(crate) struct TaskPortSpin {
    shared: std::sync::Weak<Shared>,
    /// The device's `task_port_count`.
    tasks: Arc<AtomicUsize>,
}

impl TaskPortSpin {
    /// The device's spin, made with its first call.
    pub(crate) fn of(shared: &Arc<Shared>) -> Arc<Self> {
        let spin = || Self { shared: Arc::downgrade(shared), tasks: Arc::clone(&shared.task_port_count) };
        Arc::clone(shared.task_spin.get_or_init(|| Arc::new(spin())))
    }
}

impl std::fmt::Debug for TaskPortSpin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.shared.upgrade().map(|shared| shared.name.clone());
        f.debug_struct("TaskPortSpin").field("device", &name).field("tasks", &self.tasks).finish()
    }
}

impl lightpath_verbs::TaskSpin for TaskPortSpin {
    fn look(&self) -> bool {
        self.shared.upgrade().is_some_and(|shared| shared.take_in_for_tasks())
    }

    fn tasks(&self) -> usize {
        self.tasks.load(Ordering::Relaxed)
    }
}

/// The part of a device every object holds: dropping the last one stops the helper thread.
pub(crate) struct DeviceInner {
    pub(crate) shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl DeviceInner {
    /// Binds the socket, builds the engine and starts the helper thread the mode needs.
    pub(crate) fn start(config: SoftConfig) -> Result<Arc<Self>> {
        let shared = Arc::new(Shared::new(config)?);
        let thread = progress::spawn(Arc::clone(&shared)).map_err(Error::Io)?;
        Ok(Arc::new(Self { shared, thread: Mutex::new(Some(thread)) }))
    }
}

impl std::ops::Deref for DeviceInner {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.waker.signal(1);
        let handle = self.thread.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(handle) = handle {
            // The thread only ever panics on a bug; there is nothing to do with that here.
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device (no progress thread: nothing else reads the port) with a port for queue pair
    /// 7, its doorbell, and a plain UDP socket to send to the port from.
    fn device_with_port() -> (Shared, Arc<QpPort>, Arc<std::os::fd::OwnedFd>, std::net::UdpSocket) {
        let mut config = SoftConfig::with_addr("127.0.0.1:0".parse().unwrap());
        config.udp_offload = false;
        let shared = Shared::new(config).expect("device");
        let doorbell = Arc::new(
            rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .expect("eventfd"),
        );
        let port = shared.open_port(7, PortDoorbell::Fd(Arc::clone(&doorbell))).expect("a port of its own");
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("sender");
        sender.connect(port.socket.local()).expect("connect");
        (shared, port, doorbell, sender)
    }

    fn readable(fd: &impl AsFd) -> bool {
        sys::wait_readable(&[fd.as_fd()], Some(Duration::ZERO)).expect("poll") != 0
    }

    /// Datagrams that are not RoCE (the engine drops them) stand in for a peer's: what is
    /// tested is who takes them out of the port.
    fn send_junk(sender: &std::net::UdpSocket, count: usize) {
        for _ in 0..count {
            sender.send(&[0x5a; 40]).expect("send");
        }
    }

    #[test]
    fn an_arming_that_takes_everything_in_rings_nothing() {
        let (shared, port, doorbell, sender) = device_with_port();
        send_junk(&sender, 3);
        assert!(readable(&port.socket));
        shared.arm_port(&port, WakeFor::Anything);
        assert!(!readable(&port.socket), "the arming left datagrams in the port");
        assert!(!readable(&*doorbell), "an arming that took everything in rang the doorbell");
    }

    /// A burst longer than one arming's look leaves datagrams in the port that announce
    /// themselves to nobody (their readiness was seen before the look): the arming rings the
    /// doorbell, so an event loop that arms without looking until it sees readiness again
    /// looks once more.
    #[test]
    fn an_arming_that_leaves_datagrams_in_the_port_rings_the_doorbell() {
        let (shared, port, doorbell, sender) = device_with_port();
        // The owner's receive, then a drain of up to the batches of one drive.
        send_junk(&sender, (1 + MAX_RX_BATCHES_PER_DRIVE) * RECV_BATCH + 5);
        shared.arm_port(&port, WakeFor::Anything);
        assert!(readable(&port.socket), "one look took the whole burst: the test proves nothing");
        assert!(readable(&*doorbell), "datagrams were left in the port and the doorbell was not rung");
        // The next arming takes the rest, and rings nothing more.
        let mut count = [0u8; 8];
        rustix::io::read(&*doorbell, &mut count).expect("the doorbell");
        shared.arm_port(&port, WakeFor::Anything);
        assert!(!readable(&port.socket));
        assert!(!readable(&*doorbell));
    }

    #[test]
    fn an_arming_without_look_leaves_the_port_alone_and_arms() {
        let (shared, port, doorbell, sender) = device_with_port();
        send_junk(&sender, 1);
        let armings = shared.port_armings.load(Ordering::Relaxed);
        shared.arm_port_without_look(&port, WakeFor::Arrivals);
        assert_eq!(shared.port_armings.load(Ordering::Relaxed), armings + 1, "the arming was not counted");
        assert!(readable(&port.socket), "the arming without look received from the port");
        assert!(!readable(&*doorbell));
        // Armed: news another thread makes rings the doorbell.
        port.news(true);
        assert!(readable(&*doorbell), "the doorbell was not armed");
    }

    /// The answers an owner's arming held for its reply are kept through its next arming that
    /// finds nothing (once, for a reader, while the progress thread looks within a tick);
    /// every other empty arming of that owner sends them. Holds are per queue pair: another
    /// owner's arming neither sends them nor is made to.
    #[test]
    fn an_owner_keeps_the_answers_it_held_through_one_empty_arming() {
        let (shared, port, _doorbell, _sender) = device_with_port();
        let doorbell = Arc::new(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap());
        let other = shared.open_port(8, PortDoorbell::Fd(Arc::clone(&doorbell))).expect("a second port");
        // No progress thread here: it counts as awake (as it is when it runs its loop).
        shared.thread_deadline.store(AWAKE, Ordering::SeqCst);
        assert!(!shared.owes_answers(&port, WakeFor::Arrivals), "nothing is held");

        port.hold_for_reply();
        assert!(!shared.owes_answers(&port, WakeFor::Arrivals), "the reader's own hold was not kept");
        assert!(shared.owes_answers(&port, WakeFor::Arrivals), "kept through a second empty arming");

        port.hold_for_reply();
        assert!(
            shared.owes_answers(&port, WakeFor::Anything),
            "kept for a writer (it waits for the peer's answer)"
        );

        port.hold_for_reply();
        assert!(
            !shared.owes_answers(&other, WakeFor::Arrivals),
            "another owner's arming sends this one's hold"
        );
        other.hold_for_reply();
        assert!(
            !shared.owes_answers(&port, WakeFor::Arrivals),
            "a hold of another queue pair overtook this one"
        );

        port.hold_for_reply();
        port.clear_reply_hold();
        assert!(!shared.owes_answers(&port, WakeFor::Arrivals), "owed after the reply took the answers");

        port.hold_for_reply();
        let far = shared.now().as_nanos() + Duration::from_millis(50).as_nanos() as u64;
        shared.thread_deadline.store(far, Ordering::SeqCst);
        assert!(
            shared.owes_answers(&port, WakeFor::Arrivals),
            "kept while the progress thread sleeps past the tick that would send them"
        );
    }

    /// A port whose waiter is a task, with a counter of its wake-ups, on `shared` (see
    /// `device_with_port`), and a socket to send to it from.
    fn task_port(shared: &Shared, qpn: u32) -> (Arc<QpPort>, Arc<AtomicUsize>, std::net::UdpSocket) {
        let wakes = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&wakes);
        let wake: lightpath_verbs::TaskWake = Arc::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        let port = shared.open_port(qpn, PortDoorbell::Task(wake)).expect("a port of its own");
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("sender");
        sender.connect(port.socket.local()).expect("connect");
        (port, wakes, sender)
    }

    /// The spin's look (`TaskPortSpin`) serves the ports of task waiters only: it takes in
    /// what waits there (datagrams that complete nothing wake nobody), leaves other ports to
    /// their waiters, and has the owner look again when it could not take everything in.
    #[test]
    fn a_task_spin_takes_in_the_task_ports_and_wakes_owners_for_news_only() {
        use lightpath_verbs::TaskSpin;
        let (shared, fd_port, _doorbell, fd_sender) = device_with_port();
        let shared = Arc::new(shared);
        let spin = TaskPortSpin::of(&shared);
        assert!(Arc::ptr_eq(&spin, &TaskPortSpin::of(&shared)), "one spin per device");
        assert_eq!(spin.tasks(), 0, "a port with an eventfd doorbell counted as a task's");
        assert!(!spin.look(), "news with no task port");

        let (port, wakes, sender) = task_port(&shared, 9);
        assert_eq!(spin.tasks(), 1);
        port.arm(WakeFor::Anything);
        assert!(!spin.look(), "news before anything was sent");
        send_junk(&fd_sender, 2);
        assert!(!spin.look(), "the look took news of a port whose waiter is not a task");
        assert!(readable(&fd_port.socket), "the look drained a port whose waiter is not a task");

        send_junk(&sender, 3);
        assert!(!spin.look(), "news of datagrams that completed nothing");
        assert!(!readable(&port.socket), "the look left datagrams in the port");
        assert_eq!(wakes.load(Ordering::SeqCst), 0, "woken for datagrams that completed nothing");

        // More than one look takes: the owner is woken to look itself.
        send_junk(&sender, (MAX_RX_BATCHES_PER_DRIVE + 1) * RECV_BATCH);
        assert!(spin.look(), "no news of the owner woken");
        assert!(readable(&port.socket), "one look took the whole burst: the test proves nothing");
        assert_eq!(wakes.load(Ordering::SeqCst), 1, "datagrams were left in the port and nobody was woken");

        let mut core = shared.lock();
        shared.close_port(&mut core, &port);
        drop(core);
        assert_eq!(spin.tasks(), 0, "a closed port still counted");
        drop(spin);
        let weak = Arc::downgrade(&shared);
        let spin = TaskPortSpin::of(&shared);
        drop(shared);
        assert!(weak.upgrade().is_none(), "the spin kept the device alive");
        assert!(!spin.look());
        assert_eq!(spin.tasks(), 0);
    }

    /// A blocked thread watched the socket and left: the socket stays its own for the
    /// hand-over delay, so that it takes the next message itself. An event loop that then goes
    /// to sleep on its notification (it never reads the socket) hands the socket to the
    /// progress thread at once, or its news would wait out the delay.
    #[test]
    fn an_event_loop_going_idle_hands_a_left_socket_to_the_progress_thread() {
        let (shared, _port, _doorbell, _sender) = device_with_port();
        assert!(shared.socket_is_progress_threads(), "nobody watched the socket yet");
        shared.socket_relied_on();
        assert!(shared.socket_is_progress_threads());

        drop(shared.try_watch_socket().expect("the first watcher"));
        assert!(!shared.socket_is_progress_threads(), "handed over before the delay");
        shared.socket_relied_on();
        assert!(shared.socket_is_progress_threads(), "an idle event loop left the socket unread");
        assert!(readable(&shared.waker), "the progress thread was not woken to take the socket");

        // While a thread watches the socket, it stays that thread's.
        let watch = shared.try_watch_socket().expect("a watcher");
        shared.socket_relied_on();
        assert!(!shared.socket_is_progress_threads());
        drop(watch);
    }

    #[test]
    fn rx_pace_follows_the_traffic() {
        let mut pace = RxPace::default();
        // Ping-pong: a message, then rounds that find nothing.
        for _ in 0..10 {
            assert_eq!(pace.first_batch(), 1);
            pace.record(1, 1);
            pace.record(1, 0);
        }
        assert_eq!(pace.first_batch(), 1);
        // A stream: every round finds a message waiting.
        for _ in 0..RxPace::STREAM_AFTER {
            assert_eq!(pace.first_batch(), 1);
            pace.record(1, 1);
        }
        assert_eq!(pace.first_batch(), RECV_BATCH);
        pace.record(RECV_BATCH, 20);
        assert_eq!(pace.first_batch(), RECV_BATCH);
        // The stream dries up.
        pace.record(RECV_BATCH, 1);
        assert_eq!(pace.first_batch(), 1);
    }
}
