//! The tokio driver (feature `tokio`): the same streams as [`crate::Stream`], driven by
//! readiness instead of blocking. `AsyncRead`/`AsyncWrite` are implemented, so
//! `tokio::io::split`, `copy` and `copy_bidirectional` work.
//!
//! A stream waits through `AsyncFd` on what its readiness fd ([`crate::Stream::readiness_fd`])
//! would hold, each registered on its own: for an RDMA stream its share of the completion
//! queue's notification (armed before every wait, as a completion channel is), its queue
//! pair's own port if it has one (soft), and its TCP connection, whose readiness tells a woken
//! task whether the connection had news (the peer's goodbye or death) worth a `recv`; for a
//! TCP stream the socket itself. A reading task and a writing task (`tokio::io::split`) share
//! the registrations through a waker that wakes both (`SideWakers`). The descriptors are
//! registered by number, not as duplicates, and no readiness epoll is made: a tokio RDMA
//! stream holds no descriptor beyond its connection's own (issue 15), and a datagram reaches
//! the runtime's epoll without a nested one in between.
//!
//! No lost wake-ups: whichever call polls an RDMA connection handles its completions, so a
//! write, a flush or the look before a wait can take in the bytes a reader is waiting for (or
//! a reader the credit a writer is waiting for), and no fd fires for them afterwards. A call
//! that handled what the other half waits for therefore wakes the task waiting there (issue
//! 17: hyper's HTTP/1.1 client polls read, then writes and flushes in the same task, and
//! stalled for good when the flush took in the response); a reader is not woken for the
//! completions of its own side's writes.
//!
//! Connecting and accepting are async code on the runtime's reactor: the negotiation is the
//! blocking calls' state machine (`crate::negotiate`) driven by socket readiness and tokio
//! timers, the probe awaited on the connection's notification fd. No thread is taken, a
//! dropped `connect` future closes what it had opened, and [`Listener`] negotiates each
//! connection in a task of its own and queues the results, so `accept` is cancel-safe and a
//! runtime shuts down without waiting for Lightpath.
//!
//! Messages and zero copy: [`Stream::send_msg`] completes once the whole message is handed to
//! the transport (a large one flows through a full ring in parts, the task sleeping between
//! them). [`Stream::register_buf`], [`Stream::write_buf`], [`Stream::send_msg_buf`],
//! [`Stream::read_buf`] and [`Stream::recv_msg_buf`] are the blocking stream's zero-copy calls
//! with the same semantics; none blocks the runtime (a rendezvous' fetch or READs in flight
//! are waited for by sleeping on the fd). Over TCP they return `Unsupported`, as the blocking
//! ones do.
//!
//! Cancel safety: dropping a `send_msg` (or small `write_buf` / `send_msg_buf`) future before
//! it completes either sent nothing or accepted the message, whose rest is then sent before
//! anything else (it is never cut short). Dropping a zero-copy future whose transfer has
//! started (the peer may be reading the buffer, or READs may be writing into it) closes the
//! connection, fencing its queue pair so that the buffer may be reused at once — as a blocking
//! write timeout does; one dropped before the transfer started changes nothing.
//!
//! Writes: `poll_write_vectored` writes the slices in turn within one call
//! (`is_write_vectored` is true), so hyper and others hand over a header and a body without
//! first copying them into one buffer.
//!
//! Flushing: `poll_flush` hands everything written to the transport (corked records posted,
//! kept bytes pushed) and does not wait for the peer's acknowledgement, as a kernel socket's
//! flush does not; the blocking [`crate::Stream`]'s `flush` does wait for it.
//!
//! Closing: dropping a stream never blocks the runtime. The clean close (everything written
//! is sent and acknowledged, then the goodbye) finishes on Lightpath's background thread, so
//! the bytes still reach a live peer. A program that needs to know they did — or that exits
//! right after — awaits [`Stream::close`] (or `AsyncWriteExt::shutdown`) first. (`shutdown`,
//! like a socket's, does not fail when the peer had closed its side and then went away before
//! acknowledging; `close` reports that too.)

use std::future::poll_fn;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use ::tokio::net::ToSocketAddrs;
use ::tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use ::tokio::task::{AbortHandle, JoinSet};
use lightpath_soft::AdaptiveSpin;

use crate::completions::PortLook;
use crate::negotiate::{advance, Advanced, Handshake, Negotiated};
use crate::options::Options;
use crate::rdma::RdmaStream;
use crate::stream::Backend;
use crate::stream_zero_copy::ZeroCopyCall;
use crate::{RegisteredBuf, Transport};

/// An asynchronous Lightpath stream.
pub struct Stream {
    // Field order is drop order: deregister before the stream closes its fds.
    registration: Registration,
    /// The tasks waiting to read and to write, for the wake-ups no fd gives (see
    /// [`Stream::poll_io`]).
    waiting: [Option<Waker>; 2],
    /// Each side's arming it is still waiting on (see [`Armed`]).
    armed: [Option<Armed>; 2],
    /// Armings of the connection so far, by either side (they share the queue pair's
    /// doorbell: the later one's `WakeFor` holds).
    armings: u64,
    /// Per side: its last arming took in the queue pair's own descriptor (or skipped it by
    /// this rule), and neither the port's nor the notification's registration reported
    /// readiness since (to either side). Every datagram that reaches the descriptor makes the
    /// port's registration ready (an edge per arrival, seen when the reactor next turns), an
    /// arming that could not take everything in rings the notification, and a side looks at
    /// the readiness before it arms: while this holds, nothing arrived since that look that
    /// will not announce itself, and the next arming skips the look ([`PortLook::Skip`]),
    /// which would have found nothing: one `recvmmsg` per wait, a fifth of a soft
    /// request/response's system calls on each side.
    port_quiet: [bool; 2],
    /// The tasks waiting on the registrations, by side, and the waker tokio holds for both
    /// (see [`SideWakers`]).
    side_wakers: Arc<SideWakers>,
    registration_waker: Waker,
    inner: crate::Stream,
}

/// The tasks of both sides waiting on the same registrations. tokio keeps one waker per
/// direction of a registration, and what an RDMA stream waits on only ever reports
/// readability, for readers and writers alike: the registrations are given this waker, which
/// wakes the task of each side that waits (in hyper both are one task; after
/// `tokio::io::split` they are two, and each looks again when woken).
#[derive(Debug, Default)]
struct SideWakers(Mutex<[Option<Waker>; 2]>);

impl SideWakers {
    /// Records `waker` as the task of `side` waiting.
    fn set(&self, side: Side, waker: &Waker) {
        let mut wakers = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let slot = &mut wakers[side as usize];
        if !slot.as_ref().is_some_and(|held| held.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }

    /// `side` waits no more.
    fn clear(&self, side: Side) {
        let mut wakers = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        wakers[side as usize] = None;
    }
}

impl Wake for SideWakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let wakers = std::mem::take(&mut *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        for waker in wakers.into_iter().flatten() {
            waker.wake();
        }
    }
}

/// A descriptor the stream owns (its TCP socket, its connection's notification eventfd, its
/// queue pair's port), registered with tokio by number: a duplicate per registration (and the
/// readiness epoll they went through) was four descriptors more per RDMA stream. The
/// registration is dropped before the stream hands its descriptors to the background close
/// (see `Drop for Stream`), and nothing else closes or replaces them while the stream lives.
#[derive(Debug)]
struct StreamFd(RawFd);

impl AsRawFd for StreamFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A side's wait in progress: what it armed for, the connection's event count right after
/// arming, and which arming it was. While nothing was seen since (no readiness, the same count,
/// no arming by the other side), a task polled again for other reasons (hyper's dispatcher is,
/// by its own channels) has nothing new to look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Armed {
    wake: lightpath_verbs::WakeFor,
    events: u64,
    arming: u64,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tokio::Stream").field("inner", &self.inner).finish()
    }
}

/// How tokio watches a stream.
enum Registration {
    /// The descriptors behind an RDMA stream's readiness fd, registered each on its own
    /// rather than through that epoll (no nested epoll between a datagram and the runtime, and
    /// no epoll descriptor per stream): the connection's notification eventfd and, for a soft
    /// queue pair with a UDP port of its own, that port (see [`crate::Stream::event_fds`]).
    /// Both sides wait on them (see [`SideWakers`]).
    ///
    /// `liveness` is the TCP connection, registered so that its readiness says whether the
    /// connection had news (the peer's goodbye, an error, its death): a side woken by data
    /// then skips looking at it. Looking after every wake-up was one `recv` system call per
    /// message (1.25 per request on a tokio `stream_rr` server over soft, 7 % of an shm
    /// server's CPU).
    ///
    /// `notify` is `None` when the connection's news comes through the completion router
    /// (its queue pair took no doorbell of its own, see `ConnCompletions::wakes_tasks`): the
    /// router wakes the task directly (`RdmaConn::poll_woken`), and the connection has no
    /// notification eventfd at all.
    ///
    /// `spin` wakes the runtime's spinner for the queue pair's device when a side goes to
    /// wait (soft, see [`ensure_spinner`]).
    Rdma {
        notify: Option<AsyncFd<StreamFd>>,
        port: Option<AsyncFd<StreamFd>>,
        liveness: AsyncFd<StreamFd>,
        spin: Option<Arc<SpinKick>>,
    },
    /// The TCP socket, readable and writable as any socket.
    Tcp(AsyncFd<StreamFd>),
    /// Deregistered: the stream is being dropped.
    Gone,
}

/// Which half of the stream a call belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Reader = 0,
    Writer = 1,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::Reader => Side::Writer,
            Side::Writer => Side::Reader,
        }
    }
}

/// What a call that would block waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Bytes or records from the peer, or a completion (an acknowledgement, a fetch).
    Completion,
    /// Room to write.
    Room,
}

/// Abandons a zero-copy call whose future is dropped before it completed.
struct AbandonOnDrop<'s, 'b> {
    stream: &'s mut Stream,
    call: Option<ZeroCopyCall<'b>>,
}

impl Drop for AbandonOnDrop<'_, '_> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            self.stream.inner.abandon(call);
        }
    }
}

/// `options` for a connection of this driver: its queue pair wakes the stream's task through
/// the device's task doorbell where the provider can (see [`Options::event_loop`]).
fn event_loop_options(options: &Options) -> Options {
    Options { event_loop: true, ..options.clone() }
}

/// A task the driver keeps in a runtime for one device: its task doorbell's dispatcher (see
/// [`ensure_dispatcher`]) or its spinner (see [`ensure_spinner`]).
struct RuntimeTask<T> {
    /// The device: its doorbell's descriptor number (one device's, while the task holds the
    /// doorbell), or its spin's address (the task holds the spin).
    device: usize,
    runtime: ::tokio::runtime::Id,
    /// Cleared when the task ends (its runtime shut down).
    running: Arc<AtomicBool>,
    /// What the device's streams are given.
    handle: T,
}

/// The dispatchers running, in every runtime.
static DISPATCHERS: Mutex<Vec<RuntimeTask<()>>> = Mutex::new(Vec::new());

/// Clears a runtime task's `running` flag when the task is dropped.
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// The handle of `registry`'s task for `device` in the current runtime, started by `start` (given
/// the runtime, and the guard the task holds while it runs) if there is none: one per device
/// and runtime. A runtime that shuts down takes its tasks with it, and the next stream
/// registered there starts another.
fn runtime_task<T: Clone>(
    registry: &Mutex<Vec<RuntimeTask<T>>>,
    device: usize,
    start: impl FnOnce(&::tokio::runtime::Handle, Running) -> io::Result<T>,
) -> io::Result<T> {
    let runtime = ::tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
    let mut tasks = registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tasks.retain(|task| task.running.load(Ordering::SeqCst));
    if let Some(task) = tasks.iter().find(|task| task.device == device && task.runtime == runtime.id()) {
        return Ok(task.handle.clone());
    }
    let running = Arc::new(AtomicBool::new(true));
    let handle = start(&runtime, Running(Arc::clone(&running)))?;
    tasks.push(RuntimeTask { device, runtime: runtime.id(), running, handle: handle.clone() });
    Ok(handle)
}

/// Sees that a task of the current runtime watches `doorbell` and dispatches its rings (one
/// per device and runtime): the streams whose queue pairs ring it are woken by that task,
/// with no descriptor of their own. Any runtime's dispatcher wakes any stream's task, so a
/// stream used in another runtime is served too; a runtime that shuts down takes its
/// dispatcher with it, and the next stream registered starts another.
///
/// After each wake-up the task keeps looking for more rings for up to `spin`
/// (`Options::event_loop_spin` of the connection that started it), with the rings held so
/// that peers do not write the doorbell meanwhile (see [`spin_for_rings`]).
fn ensure_dispatcher(doorbell: &Arc<dyn lightpath_verbs::TaskDoorbell>, spin: Duration) -> io::Result<()> {
    // A descriptor number is not negative.
    let device = usize::try_from(doorbell.fd().as_raw_fd()).unwrap_or(usize::MAX);
    runtime_task(&DISPATCHERS, device, |runtime, guard| {
        // A duplicate of its own: the registration owns it, and the doorbell's file stays open
        // while the task runs.
        let watched = register_owned(doorbell.fd().try_clone_to_owned()?, Interest::READABLE)?;
        let doorbell = Arc::clone(doorbell);
        runtime.spawn(dispatch(doorbell, watched, spin, guard));
        Ok(())
    })
}

/// The dispatcher's task (see [`ensure_dispatcher`]).
async fn dispatch(
    doorbell: Arc<dyn lightpath_verbs::TaskDoorbell>,
    watched: AsyncFd<OwnedFd>,
    spin: Duration,
    guard: Running,
) {
    let _running = guard;
    // Given up and retried as a blocked thread's doorbell wait is.
    let spin = crate::completions::wait_spin(spin);
    loop {
        match watched.readable().await {
            // Cleared before the dispatch: a ring after this point wakes the task again,
            // one before it is dispatched now. The eventfd is not read: the registration
            // is edge-triggered, and every ring is an edge (the count it keeps cannot
            // overflow in practice; a blocked thread that watches the doorbell too reads
            // it, see `TaskDoorbell::take_rings`). Reading it would be one system call
            // more per wake-up than a stream's own eventfd cost (which it does not read
            // either).
            Ok(mut ready) => ready.clear_ready(),
            Err(_) => return,
        }
        doorbell.dispatch();
        spin_for_rings(&*doorbell, &spin).await;
    }
}

/// A dispatcher spins only while its doorbell wakes at most this many connections' tasks:
/// with more, the runtime mostly has other work when one connection waits, and spins cost
/// more than the wake-ups they save (hyper over shm, 64 connections: 187 -> 161 k requests/s
/// with a spin after every wake-up; at 8 connections the spin moved the rate within noise).
const DISPATCH_SPIN_MAX_TASKS: usize = 16;

/// A yield of the spinning dispatcher that took longer than this ran other tasks: two in a
/// row and the runtime is busy, so it would not park, and the spin only adds looks.
const BUSY_YIELD: Duration = Duration::from_micros(5);

/// After a dispatch: keeps dispatching the task doorbell's bits, with its rings held (peers
/// set their task bits without writing the doorbell, see `TaskDoorbell::hold_rings`), for as
/// long as news keeps coming within `spin`'s budget of the last, then re-arms the ring (a
/// plain dispatch) before the dispatcher waits on the doorbell again.
///
/// Why: a request/response exchange between two event loops otherwise costs each side, per
/// message, the peer's eventfd write, its own runtime's park in `epoll_wait` and the kernel's
/// wake-up of it: on this VM most of a one-connection round trip. A spinning dispatcher keeps
/// its runtime awake instead: between looks it lets the runtime run its other tasks and poll
/// its reactor (`yield_now`). It stops when two yields in a row ran other tasks for longer
/// than [`BUSY_YIELD`] (a busy runtime does not park, and its reactor sees the rings anyway),
/// or when nothing came within `spin`'s budget; and, adaptively (see `AdaptiveSpin`), a
/// dispatcher whose spins keep finding nothing stops spinning. It does not give its thread's
/// core away between looks (`sched_yield`): measured with hyper over shm, that halved the
/// requests per second at 8 and 64 connections (CPU per request 5.5 -> 10 us).
async fn spin_for_rings(doorbell: &dyn lightpath_verbs::TaskDoorbell, spin: &AdaptiveSpin) {
    if doorbell.tasks() > DISPATCH_SPIN_MAX_TASKS {
        return;
    }
    let budget = spin.budget();
    if budget.is_zero() {
        return;
    }
    doorbell.hold_rings();
    // Re-arms the ring (a plain dispatch, which also takes what came since the last look) when
    // the spin ends, and also when it is cut short: a runtime that shuts down drops its
    // dispatcher at a yield, and a ring left held would keep every peer from ringing for the
    // device's other runtimes for good (seen: tokio_stress, streams of one test stalled after
    // another test's runtime ended).
    let _rearm = RearmOnDrop(doorbell);
    let found = keep_looking(budget, || doorbell.dispatch_held()).await;
    spin.record(found);
}

/// Calls `look` between yields to the runtime for as long as it finds news within `budget`
/// of the last (or of the start), unless the runtime is busy: two yields in a row that took
/// longer than [`BUSY_YIELD`] ran other tasks, and a busy runtime does not park anyway.
/// Returns whether any look found news.
async fn keep_looking(budget: Duration, mut look: impl FnMut() -> bool) -> bool {
    let mut last_news = Instant::now();
    let mut found = false;
    let mut busy_yields = 0;
    loop {
        let yielded = Instant::now();
        ::tokio::task::yield_now().await;
        let now = Instant::now();
        if now - yielded > BUSY_YIELD {
            busy_yields += 1;
            if busy_yields >= 2 {
                break;
            }
        } else {
            busy_yields = 0;
        }
        if look() {
            found = true;
            last_news = now;
        } else if now - last_news >= budget {
            break;
        }
    }
    found
}

/// Dispatches its doorbell when dropped (see [`spin_for_rings`]).
struct RearmOnDrop<'a>(&'a dyn lightpath_verbs::TaskDoorbell);

impl Drop for RearmOnDrop<'_> {
    fn drop(&mut self) {
        self.0.dispatch();
    }
}

/// Starts a runtime's spinner for one device (see [`ensure_spinner`]): a stream kicks it when
/// one of its sides goes to wait.
///
/// A kick decides whether to spin, so that none wakes the spinner for nothing: not while it
/// spins, not with more than [`SPINNER_MAX_TASKS`] tasks on the device, and not while
/// spins keep finding nothing (`spin`, adaptive: one kick in so many tries again). Waking a
/// task from a stream's poll is not free: tokio then often wakes a second worker (an
/// eventfd write and futex calls), so a kick that will not spin must not wake.
#[derive(Debug)]
struct SpinKick {
    notify: ::tokio::sync::Notify,
    /// The spinner is spinning.
    spinning: AtomicBool,
    /// How long spins last, and how they paid lately.
    spin: AdaptiveSpin,
    /// The budget of the spin the last kick asked for, in nanoseconds.
    budget: std::sync::atomic::AtomicU64,
    task_spin: Arc<dyn lightpath_verbs::TaskSpin>,
}

impl SpinKick {
    /// A side of a stream of the device goes to wait: starts a spin if one is due.
    fn kick(&self) {
        if self.spinning.load(Ordering::Relaxed) || self.task_spin.tasks() > SPINNER_MAX_TASKS {
            return;
        }
        let retry = self.spin.given_up();
        let mut budget = self.spin.budget();
        // Set here, cleared by the spinner when the spin ends: one kick starts it.
        if budget.is_zero() || self.spinning.swap(true, Ordering::Relaxed) {
            return;
        }
        if retry {
            // A retry outlasts an answer that comes without the peer spinning: once both
            // sides had given up (an idle spell is enough), a retry of the usual length found
            // nothing, since the peer's answer took a wake-up of its runtime, and neither side
            // spun again (hyper, one connection: one run in five at 12 k requests/s instead
            // of 26 k).
            budget *= RETRY_SPIN_FACTOR;
        }
        self.budget.store(u64::try_from(budget.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.notify.notify_one();
    }
}

/// Kicks `spin`, if there is one (see [`SpinKick`]).
fn kick(spin: Option<&SpinKick>) {
    if let Some(spin) = spin {
        spin.kick();
    }
}

/// A spinner's retry (see [`SpinKick::kick`]) lasts this many budgets.
const RETRY_SPIN_FACTOR: u32 = 4;

/// A spinner spins only while its device wakes at most this many connections' tasks. With
/// more, a spin mostly burns a core that the peer, or the runtime's other worker, needs:
/// `lightpath perf stream_rr --server loop` (a tokio client against an epoll server, which
/// does not spin) over soft, 4 connections on one device: 71 k requests/s without the spin,
/// 50 k with it (CPU per request 22 -> 32 us), 16 connections (8 per device) 75 -> 74 k
/// (20 -> 23 us); hyper at 4 connections 51 -> 53 k, within the noise. At 1 and 2 it pays
/// (hyper 2 connections 32 -> 39 k, 1 connection about twice, see [`ensure_spinner`]).
const SPINNER_MAX_TASKS: usize = 2;

/// The spinners running, in every runtime.
static SPINNERS: Mutex<Vec<RuntimeTask<Arc<SpinKick>>>> = Mutex::new(Vec::new());

/// Sees that a task of the current runtime spins for the device behind `task_spin` (one per
/// device and runtime), and returns what starts it (`None` when `spin` is zero: no spin).
///
/// The task dispatcher's spin (see [`spin_for_rings`]) for providers whose news reaches each
/// task through a descriptor of the queue pair's own (soft: its UDP port), which the runtime's
/// reactor watches: no doorbell rings the spinner, so a stream kicks it when one of its sides
/// goes to wait (see [`SpinKick`] for when a kick spins). It then looks at the device's ports
/// between yields to the runtime (`TaskSpin::look`, one `epoll_wait` with no timeout for all
/// of them, taking in what came and waking the tasks it completed work for), for as long as
/// such wake-ups keep coming within `spin` (`Options::event_loop_spin` of the connection
/// that started it) of the last or of the kick, and not in a busy runtime. A
/// request/response exchange then finds the answer by looking instead of parking the
/// runtime in `epoll_wait` and being woken for it. The ports stay registered with the
/// reactor throughout: the spin only hurries what their readiness brings anyway.
///
/// Tried and not kept: a spinner woken by the device's ports themselves (an epoll instance
/// of them registered with the runtime) after every arrival: no wake-up per wait, but a task
/// poll and a nested epoll event per datagram, 5-8 % fewer requests/s with hyper at 8 and 64
/// connections, and its spins, counted from the last arrival, missed answers that came more
/// than a budget after the question's own arrival; and spins that end at the first wake-up
/// (the woken task kicks the next when it waits again): 30 % fewer requests/s at one
/// connection, no CPU saved with 64 KiB bodies. Measured with hyper over soft: see
/// docs/shm-scaling.md, "A soft event loop spins too".
fn ensure_spinner(
    task_spin: &Arc<dyn lightpath_verbs::TaskSpin>,
    spin: Duration,
) -> io::Result<Option<Arc<SpinKick>>> {
    if spin.is_zero() {
        return Ok(None);
    }
    let device = Arc::as_ptr(task_spin) as *const () as usize;
    runtime_task(&SPINNERS, device, |runtime, guard| {
        let kick = Arc::new(SpinKick {
            notify: ::tokio::sync::Notify::new(),
            spinning: AtomicBool::new(false),
            // Given up and retried as a blocked thread's doorbell wait is.
            spin: crate::completions::wait_spin(spin),
            budget: Default::default(),
            task_spin: Arc::clone(task_spin),
        });
        runtime.spawn(spin_when_kicked(Arc::clone(&kick), guard));
        Ok(kick)
    })
    .map(Some)
}

/// The spinner's task (see [`ensure_spinner`]).
async fn spin_when_kicked(kick: Arc<SpinKick>, guard: Running) {
    let _running = guard;
    loop {
        kick.notify.notified().await;
        let budget = Duration::from_nanos(kick.budget.load(Ordering::Relaxed));
        let found = keep_looking(budget, || kick.task_spin.look()).await;
        kick.spin.record(found);
        kick.spinning.store(false, Ordering::Relaxed);
    }
}

/// Registers `fd` with the current runtime's reactor, which owns it from now on.
fn register_owned(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: `fd` is an `OwnedFd` moved into the registration: it is open, nothing else can
    // close or replace it while the `AsyncFd` owns it, and its `as_raw_fd` always returns the
    // same number.
    unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)
}

/// Registers `fd` with the current runtime's reactor.
///
/// # Safety
///
/// `fd` is a descriptor of the stream the registration will be kept beside, in one
/// [`Stream`] (see [`StreamFd`]): open now, and neither closed nor replaced while the
/// registration lives.
unsafe fn register(fd: RawFd, interest: Interest) -> io::Result<AsyncFd<StreamFd>> {
    // SAFETY: upheld by the caller: the number refers to the same open file for the
    // registration's whole life, and `StreamFd::as_raw_fd` always returns it.
    unsafe { AsyncFd::register_with_interest(StreamFd(fd), interest) }.map_err(io::Error::from)
}

impl Stream {
    /// Connects with default options.
    pub async fn connect(addr: impl ToSocketAddrs) -> io::Result<Stream> {
        Self::connect_with(addr, &Options::default()).await
    }

    /// Connects with the given options. The TCP connect and the negotiation run on the
    /// runtime's reactor (no thread is taken); dropping the future at any point closes
    /// whatever it had opened. Host names are resolved as `tokio::net::lookup_host` does.
    pub async fn connect_with(addr: impl ToSocketAddrs, options: &Options) -> io::Result<Stream> {
        let mut last_err = None;
        for addr in ::tokio::net::lookup_host(addr).await? {
            match ::tokio::net::TcpStream::connect(addr).await {
                Ok(tcp) => {
                    let tcp = tcp.into_std()?;
                    let options = &event_loop_options(options);
                    let handshake = Handshake::client(&tcp, options)?;
                    return Self::from_negotiated(negotiate(handshake, tcp).await?, options);
                }
                Err(err) => last_err = Some(err),
            }
        }
        Err(last_err.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "lightpath: the address resolved to nothing")
        }))
    }

    /// A stream from a finished negotiation.
    fn from_negotiated(negotiated: Negotiated, options: &Options) -> io::Result<Stream> {
        let mut inner = crate::Stream::from_negotiated(negotiated, options.spin)?;
        inner.set_nonblocking(true)?;
        Self::from_std(inner)
    }

    /// Wraps a blocking stream (it is switched to nonblocking mode). Should that fail, the
    /// stream is closed in the background, as a dropped tokio stream is.
    ///
    /// A soft stream connected with [`Options::soft_qp_port`] `Some(false)` has no UDP port of
    /// its own: its messages reach this runtime through the device's progress thread and the
    /// completion router, two hand-offs more than with a port (about a fifth more CPU per
    /// request in `lightpath perf`'s request/response client).
    pub fn from_std(mut inner: crate::Stream) -> io::Result<Stream> {
        match Self::registration(&mut inner) {
            Ok(registration) => {
                let side_wakers = Arc::new(SideWakers::default());
                Ok(Stream {
                    registration,
                    waiting: [None, None],
                    armed: [None, None],
                    armings: 0,
                    port_quiet: [false; 2],
                    registration_waker: Waker::from(side_wakers.clone()),
                    side_wakers,
                    inner,
                })
            }
            Err(err) => {
                inner.hand_off_close();
                Err(err)
            }
        }
    }

    fn registration(inner: &mut crate::Stream) -> io::Result<Registration> {
        inner.set_nonblocking(true)?;
        let registration = if inner.transport().is_rdma() {
            let (tcp, notify, port, spin) = match inner.backend_mut() {
                Backend::Rdma(conn) => {
                    // `liveness` below: the driver looks at the connection when it has news.
                    conn.set_tcp_watched(true);
                    let notify = match conn.wakes_tasks() {
                        true => None,
                        false => Some(conn.notify_fd().ok_or_else(|| {
                            io::Error::new(
                                io::ErrorKind::Unsupported,
                                "lightpath: this provider's completion queue has no notification fd",
                            )
                        })?),
                    };
                    if let Some(doorbell) = conn.task_doorbell() {
                        ensure_dispatcher(&doorbell, conn.event_loop_spin())?;
                    }
                    let spin = match conn.task_spin() {
                        Some(task_spin) => ensure_spinner(&task_spin, conn.event_loop_spin())?,
                        None => None,
                    };
                    (conn.tcp().as_raw_fd(), notify, conn.poll_fd(), spin)
                }
                _ => return Err(io::ErrorKind::NotConnected.into()),
            };
            // The registrations go into the `Stream` that holds `inner`, which drops them
            // before handing its backend off (`Drop for Stream`; only `hand_off_close` moves
            // the backend, and with it these descriptors, out). The connection's notification
            // eventfd and its queue pair's port are its own (one inbox per connection, one
            // port per queue pair), set before the connection was made, and kept as long as
            // the connection.
            let notify = match notify {
                // SAFETY: the connection's notification eventfd, open now, kept as said above.
                Some(notify) => Some(unsafe { register(notify, Interest::READABLE) }?),
                None => None,
            };
            let port = match port {
                // SAFETY: the queue pair's own port, open now, kept as said above.
                Some(port) => Some(unsafe { register(port, Interest::READABLE) }?),
                None => None,
            };
            // SAFETY: the stream's TCP socket, open now, kept as said above.
            let liveness = unsafe { register(tcp, Interest::READABLE) }?;
            Registration::Rdma { notify, port, liveness, spin }
        } else {
            let fd = inner.readiness_fd()?.as_raw_fd();
            // SAFETY: the stream's TCP socket, kept in the `Stream` as above.
            Registration::Tcp(unsafe { register(fd, Interest::READABLE | Interest::WRITABLE) }?)
        };
        Ok(registration)
    }

    /// Closes the stream cleanly and waits until the peer has acknowledged everything written
    /// (RDMA) or the socket has taken it (TCP), reporting a failure to do so. Dropping a stream
    /// closes it too, without waiting (the close finishes in the background).
    pub async fn close(mut self) -> io::Result<()> {
        poll_fn(|cx| self.poll_io(cx, Side::Writer, |s| s.shutdown(std::net::Shutdown::Write))).await?;
        poll_fn(|cx| self.poll_io(cx, Side::Writer, |s| s.flush())).await
        // Dropping `self` now only says goodbye: nothing is left to wait for.
    }

    /// Which transport carries the data.
    pub fn transport(&self) -> Transport {
        self.inner.transport()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }

    /// This side's address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// The blocking stream inside (in nonblocking mode).
    pub fn get_ref(&self) -> &crate::Stream {
        &self.inner
    }

    /// Sends one message; completes once all of it is handed to the transport (a message
    /// larger than the peer's ring goes in parts as the peer reads). See the module docs for
    /// cancel safety.
    pub async fn send_msg(&mut self, msg: &[u8]) -> io::Result<()> {
        poll_fn(|cx| self.poll_io(cx, Side::Writer, |s| s.send_msg(msg))).await?;
        self.push_kept().await
    }

    /// Waits until bytes kept from an accepted message (see `crate::Stream::set_nonblocking`)
    /// have gone.
    async fn push_kept(&mut self) -> io::Result<()> {
        poll_fn(|cx| {
            self.poll_io(cx, Side::Writer, |s| match s.push_kept()? {
                true => Ok(()),
                false => Err(io::ErrorKind::WouldBlock.into()),
            })
        })
        .await
    }

    /// Registers a zero-filled buffer of `len` bytes with this stream's RDMA device, for the
    /// zero-copy calls and one-sided transfers (`Unsupported` over TCP). See
    /// [`crate::Stream::register_buf`].
    pub fn register_buf(&self, len: usize) -> io::Result<RegisteredBuf> {
        self.inner.register_buf(len)
    }

    /// Writes `len` bytes of the registered buffer `local` (from `offset`) into the stream;
    /// completes when the buffer may be reused. From the rendezvous threshold up the peer
    /// fetches them from the buffer itself. See [`crate::Stream::write_buf`] and, for cancel
    /// safety, the module docs.
    pub async fn write_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<()> {
        let call = ZeroCopyCall::Write { local, offset, len };
        self.zero_copy(call, Side::Writer, |s| s.write_buf(local, offset, len)).await?;
        self.push_kept().await
    }

    /// Sends `local[offset..offset + len]` as one message; completes when the buffer may be
    /// reused. See [`crate::Stream::send_msg_buf`] and, for cancel safety, the module docs.
    pub async fn send_msg_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<()> {
        let call = ZeroCopyCall::SendMsg { local, offset, len };
        self.zero_copy(call, Side::Writer, |s| s.send_msg_buf(local, offset, len)).await?;
        self.push_kept().await
    }

    /// Reads stream bytes into `local[offset..offset + len]`: how many once at least one is
    /// there, 0 at end of stream. A peer's rendezvous is READ straight into the buffer. See
    /// [`crate::Stream::read_buf`] and, for cancel safety, the module docs.
    pub async fn read_buf(&mut self, local: &RegisteredBuf, offset: usize, len: usize) -> io::Result<usize> {
        let call = ZeroCopyCall::Read { local, offset, len };
        self.zero_copy(call, Side::Reader, |s| s.read_buf(local, offset, len)).await
    }

    /// Receives one message into `local` from `offset`: its length, or `None` once the peer
    /// has closed; a message that does not fit is refused (`InvalidInput`) and kept. See
    /// [`crate::Stream::recv_msg_buf`] and, for cancel safety, the module docs.
    pub async fn recv_msg_buf(&mut self, local: &RegisteredBuf, offset: usize) -> io::Result<Option<usize>> {
        let call = ZeroCopyCall::RecvMsg { local, offset };
        self.zero_copy(call, Side::Reader, |s| s.recv_msg_buf(local, offset)).await
    }

    /// Runs the zero-copy `op` to completion; if the future is dropped first, `call` is
    /// abandoned (see the module docs).
    async fn zero_copy<T>(
        &mut self,
        call: ZeroCopyCall<'_>,
        side: Side,
        mut op: impl FnMut(&mut crate::Stream) -> io::Result<T>,
    ) -> io::Result<T> {
        if !self.inner.transport().is_rdma() {
            // Refused at once (`Unsupported`), whatever the socket's readiness.
            return op(&mut self.inner);
        }
        let mut guard = AbandonOnDrop { stream: self, call: Some(call) };
        let result = poll_fn(|cx| guard.stream.poll_io(cx, side, &mut op)).await;
        guard.call = None;
        result
    }

    /// Receives one message; `None` once the peer has closed.
    pub async fn recv_msg(&mut self) -> io::Result<Option<Vec<u8>>> {
        poll_fn(|cx| self.poll_io(cx, Side::Reader, |s| s.recv_msg())).await
    }

    /// Completions and credit returns the RDMA connection has handled, and how many of them
    /// a reader waits for ((0, 0) over TCP; see `RdmaConn::arrivals`).
    fn events(&mut self) -> (u64, u64) {
        match self.inner.backend_mut() {
            Backend::Rdma(conn) => (conn.events(), conn.arrivals()),
            _ => (0, 0),
        }
    }

    /// Whether what a call handled (`before` and after, as [`Stream::events`] counts) may be
    /// what the task waiting on `side` waits for: a writer waits for anything (room, an
    /// acknowledgement, the peer's goodbye); a reader for what the peer sends, or for anything
    /// while it needs its own requests acknowledged to go on (see `RdmaConn::reader_wake`).
    fn concerns(&mut self, side: Side, before: (u64, u64)) -> bool {
        let after = self.events();
        match side {
            Side::Writer => after.0 != before.0,
            Side::Reader => {
                after.1 != before.1
                    || (after.0 != before.0
                        && matches!(self.inner.backend_mut(), Backend::Rdma(conn)
                            if matches!(conn.reader_wake(), lightpath_verbs::WakeFor::Anything)))
            }
        }
    }

    /// Tries `op` (a call of the `side` half) until it does not say `WouldBlock`, waiting for
    /// readiness in between.
    ///
    /// No lost wake-ups: an RDMA connection's completions are handled by whichever call polls
    /// them, so a write (or a flush, or the look before waiting) can take in the bytes a
    /// reader waits for, or a reader the credit a writer waits for — and then no fd will ever
    /// fire for them. So when a call handled something the task waiting on the other half
    /// waits for, that task is woken to look again (a spurious look costs one nonblocking
    /// call). Only then: a writer's call nearly always handles the completions of its own
    /// writes, and waking the reader for those — in hyper the same task — made tokio
    /// reschedule the task and wake a second worker to steal it after every request.
    fn poll_io<T>(
        &mut self,
        cx: &mut Context<'_>,
        side: Side,
        op: impl FnMut(&mut crate::Stream) -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        let before = self.events();
        let result = self.poll_io_inner(cx, side, op);
        let other = side.other();
        if self.waiting[other as usize].is_some() && self.concerns(other, before) {
            if let Some(waker) = self.waiting[other as usize].take() {
                waker.wake();
            }
        }
        let slot = &mut self.waiting[side as usize];
        if result.is_pending() {
            if !slot.as_ref().is_some_and(|waker| waker.will_wake(cx.waker())) {
                *slot = Some(cx.waker().clone());
            }
        } else {
            // This side waits no more: a waker left here (its task woken by the fd, not
            // through this slot) would only be woken again, for nothing, by the other half.
            *slot = None;
        }
        result
    }

    fn poll_io_inner<T>(
        &mut self,
        cx: &mut Context<'_>,
        side: Side,
        mut op: impl FnMut(&mut crate::Stream) -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        if let Registration::Tcp(fd) = &self.registration {
            // As tokio's own sockets do: the call is tried only while tokio believes the
            // socket ready, and a `WouldBlock` clears that belief. Trying first and asking
            // after made hyper's successive reads (head, body, keep-alive) one failing system
            // call each.
            // A read with an answer in hand (see `tcp_input_without_socket`) goes at once
            // (once: should it still say `WouldBlock`, it waits for the socket like any other).
            let mut at_once = side == Side::Reader && self.inner.tcp_input_without_socket();
            loop {
                let mut guard = match side {
                    _ if std::mem::take(&mut at_once) => None,
                    Side::Reader => Some(ready!(fd.poll_read_ready(cx))?),
                    Side::Writer => Some(ready!(fd.poll_write_ready(cx))?),
                };
                match op(&mut self.inner) {
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                        if let Some(guard) = guard.as_mut() {
                            guard.clear_ready();
                        }
                    }
                    other => return Poll::Ready(other),
                }
            }
        }
        loop {
            let wait = match op(&mut self.inner) {
                // Waiting for an acknowledgement or a fetch is waiting for a completion, as a
                // read is, not for room (the stream may be writable all along).
                Err(err) if crate::stream::AwaitingPeer::is(&err) => Wait::Completion,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => match side {
                    Side::Reader => Wait::Completion,
                    Side::Writer => Wait::Room,
                },
                other => return Poll::Ready(other),
            };
            ready!(self.poll_ready(cx, side, wait))?;
        }
    }

    /// Ready when an RDMA stream may have made progress (so the caller tries again); TCP
    /// streams wait in `poll_io_inner`.
    fn poll_ready(&mut self, cx: &mut Context<'_>, side: Side, wait: Wait) -> Poll<io::Result<()>> {
        match (self.inner.backend_mut(), &self.registration) {
            (Backend::Rdma(conn), Registration::Rdma { notify, port, liveness, spin }) => {
                if wait == Wait::Room {
                    // Credit returns raise no completion here unless the peer knows we wait.
                    conn.note_write_blocked();
                    if conn.writable_now() {
                        // Room came back (by a credit word, which raises no event) since the
                        // call looked: it is used now rather than slept through.
                        return Poll::Ready(Ok(()));
                    }
                }
                // The registrations wake whichever sides wait (see `SideWakers`): this task is
                // recorded for its side before tokio is asked, and tokio holds the shared waker.
                self.side_wakers.set(side, cx.waker());
                let mut shared = Context::from_waker(&self.registration_waker);
                // The TCP connection is looked at only when it had news (the peer's goodbye,
                // its death; see `Registration::Rdma`); the look reads it until it would block,
                // and a clear after news that came meanwhile is ignored by tokio, so none is
                // slept through. Asked before every wait, by either side, which also leaves the
                // shared waker with the registration: the news wakes both. Not once the look
                // found the connection's end: tokio keeps a closed socket ready for good (a
                // writer flushing after the peer's goodbye spun on it), and nothing more can
                // come on it.
                if !conn.tcp_ended() {
                    if let Poll::Ready(news) = liveness.poll_read_ready(&mut shared) {
                        let mut news = news?;
                        conn.poll_tcp();
                        news.clear_ready();
                        self.side_wakers.clear(side);
                        return Poll::Ready(Ok(()));
                    }
                }
                // Readiness seen here is usually what woke the task (tokio polls the call
                // again from the top), or left from a datagram the last call took in without
                // waiting. Either way it is consumed before this arming, which takes in
                // everything up to now: the port (a full look, since readiness was seen), the
                // completions routed to this connection and those in the queue; if that finds
                // anything, the caller retries its call. Left set, it made the wait below return
                // at once, for one more round of call, arming and look at the socket per
                // message. Cleared before the arming, so an event after this point wakes the
                // task again. The notification eventfd is not read: every news it was rung for
                // is in the port or the queue, where the arming looks, and a doorbell left rung
                // costs nothing (the registration is edge-triggered, and every later ring is an
                // edge again). Reading it was one system call per message that mostly found
                // nothing (the wake-up came from the queue pair's port).
                if take_readiness(notify.as_ref(), port.as_ref(), &**conn, &mut shared)? {
                    // Both sides wait on these registrations: what one side consumed, the
                    // other no longer sees, so neither may skip its next arming or look.
                    self.armed = [None, None];
                    self.port_quiet = [false; 2];
                }
                let armed = &mut self.armed[side as usize];
                // A reader is woken by what the peer sends, not by the acknowledgement of its
                // own requests (unless it needs them to go on); a writer by anything.
                let wake = match (side, wait) {
                    (Side::Reader, Wait::Completion) => conn.reader_wake(),
                    _ => lightpath_verbs::WakeFor::Anything,
                };
                // Still armed for the same thing and nothing seen since: the look above left
                // the shared waker with the registrations (and this task with its side), and
                // arming again would only look at the port
                // once more (a system call per poll; hyper's client polled its reader five
                // times per request). Any completion handled since (by the call just tried,
                // or by the other side's arming, which takes in this side's news without a
                // doorbell) changes the count, and an arming by the other side (which may have
                // narrowed the doorbell to arrivals) changes `armings`: either arms again.
                if *armed == Some(Armed { wake, events: conn.events(), arming: self.armings }) {
                    kick(spin.as_deref());
                    return Poll::Pending;
                }
                self.armings += 1;
                // Either arming leaves the port taken in up to now (or the doorbell rung: see
                // `QueuePair::arm_waiter`), whatever it found.
                let quiet = std::mem::replace(&mut self.port_quiet[side as usize], true);
                let look = if quiet { PortLook::Skip } else { PortLook::TakeIn };
                if !conn.arm(wake, look)? {
                    *armed = None;
                    self.side_wakers.clear(side);
                    return Poll::Ready(Ok(()));
                }
                *armed = Some(Armed { wake, events: conn.events(), arming: self.armings });
                // Cleared before the retry: an event after this point wakes the task again,
                // one before it is handled by the retry (the eventfd is not read, as above).
                if !take_readiness(notify.as_ref(), port.as_ref(), &**conn, &mut shared)? {
                    kick(spin.as_deref());
                    return Poll::Pending;
                }
                self.armed = [None, None];
                self.port_quiet = [false; 2];
                self.side_wakers.clear(side);
                Poll::Ready(Ok(()))
            }
            _ => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}

/// Whether `notify` or `port` (the registrations a wait covers besides the TCP connection) is
/// ready, clearing what is; each one not ready keeps `cx`'s waker. Without `notify`, the
/// connection's own wake-up of the task (`RdmaConn::poll_woken`) stands in for it.
fn take_readiness(
    notify: Option<&AsyncFd<StreamFd>>,
    port: Option<&AsyncFd<StreamFd>>,
    conn: &dyn RdmaStream,
    cx: &mut Context<'_>,
) -> io::Result<bool> {
    let mut any = notify.is_none() && conn.poll_woken(cx.waker());
    for fd in notify.into_iter().chain(port) {
        if let Poll::Ready(guard) = fd.poll_read_ready(cx) {
            guard?.clear_ready();
            any = true;
        }
    }
    Ok(any)
}

/// Dropping never blocks the runtime: the clean close is handed to Lightpath's background
/// thread (see the module documentation and [`Stream::close`]).
impl Drop for Stream {
    fn drop(&mut self) {
        // Deregistered while the descriptors are still the stream's (see `StreamFd`).
        self.registration = Registration::Gone;
        self.inner.hand_off_close();
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = ready!(this.poll_io(cx, Side::Reader, |s| {
            // Over RDMA the bytes are copied straight into the spare capacity, which is not
            // zeroed first (that memset was ~5% of a hyper server's CPU with 64 KiB bodies).
            // SAFETY: `read_uninit` writes nothing but initialised bytes (copies of ring
            // bytes) into the slice, so no byte of the buffer is de-initialised.
            if let Some(n) = s.read_uninit(unsafe { buf.unfilled_mut() })? {
                return Ok(n);
            }
            // Otherwise `ReadBuf` zero-fills what it hands out: only as much as this read can
            // fill is asked for (hyper offers hundreds of KiB of spare capacity).
            let want = s.read_size_hint()?.min(buf.remaining());
            s.read(buf.initialize_unfilled_to(want))
        }))?;
        // SAFETY: the read above filled the first `n` unfilled bytes, through `read_uninit`
        // or into memory `initialize_unfilled_to` had initialised.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().poll_io(cx, Side::Writer, |s| s.write(buf))
    }

    /// Writes the slices in turn within one call, as far as they fit, as one record: a caller
    /// with a header and a body in separate buffers (hyper, with `is_write_vectored`) hands
    /// both over without first copying them into one buffer, and the peer gets one record
    /// (one completion, one wake-up) rather than two.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_io(cx, Side::Writer, |s| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Hands everything written to the transport (corked records posted, kept bytes pushed)
    /// without waiting for the peer's acknowledgement — a kernel socket's flush promises no
    /// more. hyper flushes after every message: waiting for the acknowledgement there cost a
    /// round trip and two more wake-ups per request. [`Stream::close`] and `poll_shutdown`
    /// still wait until the peer has acknowledged everything.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_io(cx, Side::Writer, |s| s.hand_over())
    }

    /// Waits, as [`Stream::close`] does, until the peer has acknowledged everything — except
    /// that a peer which had closed its side and then went away (its process exited before
    /// acknowledging this close) ends the shutdown without an error, as a socket's
    /// `shutdown` after the peer's FIN does: hyper's server logged "error shutting down
    /// connection" for every client process that exited. [`Stream::close`] still reports it.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = match ready!(this.poll_io(cx, Side::Writer, |s| s.shutdown(std::net::Shutdown::Write))) {
            Ok(()) => ready!(this.poll_io(cx, Side::Writer, |s| s.flush())),
            Err(err) => Err(err),
        };
        match result {
            Err(err) if this.inner.close_met_a_closed_peer(&err) => Poll::Ready(Ok(())),
            other => Poll::Ready(other),
        }
    }
}

/// Runs a negotiation on the runtime's reactor: the same state machine and nonblocking step
/// as the blocking listener's loop (see `crate::negotiate::advance`), its waits turned into
/// readiness and timers. The socket is registered with the reactor only once the negotiation
/// has to wait (a server whose client's hello has arrived already takes its first step
/// without a turn of the reactor).
/// Dropping the future drops the TCP connection and whatever the negotiation had set up.
async fn negotiate(mut handshake: Handshake, tcp: std::net::TcpStream) -> io::Result<Negotiated> {
    tcp.set_nonblocking(true)?;
    // Declared after `tcp`, so dropped before it, however this future ends.
    let mut registration: Option<AsyncFd<StreamFd>> = None;
    loop {
        match advance(&mut handshake, &tcp) {
            Advanced::Done => {
                drop(registration);
                return handshake.finish(tcp);
            }
            Advanced::Probe { deadline } => {
                let result = match handshake.probe_conn() {
                    Some(conn) => match ::tokio::time::timeout_at(deadline.into(), wait_probe(conn)).await {
                        Ok(result) => result,
                        Err(_elapsed) => Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the RDMA probe was not acknowledged",
                        )),
                    },
                    None => Err(io::Error::other("lightpath: no probe to wait for")),
                };
                handshake.probe_finished(result);
            }
            Advanced::Wait { write, deadline } => {
                let fd = match registration {
                    Some(ref fd) => fd,
                    // SAFETY: `tcp` stays open, and keeps its number, until after the
                    // registration is dropped (above, or by the declaration order).
                    None => registration.insert(unsafe {
                        register(tcp.as_raw_fd(), Interest::READABLE | Interest::WRITABLE)
                    }?),
                };
                let interest = if write { Interest::WRITABLE } else { Interest::READABLE };
                // The step that returned found the socket not ready (its read or write would
                // block), so the readiness seen is cleared before the next step tries again.
                let ready = async {
                    let mut guard = fd.ready(interest).await?;
                    guard.clear_ready();
                    Ok::<(), io::Error>(())
                };
                match ::tokio::time::timeout_at(deadline.into(), ready).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) if write => handshake.write_failed(err),
                    Ok(Err(err)) => handshake.read_failed(err),
                    // Past the deadline, the next step gives up on the peer.
                    Err(_elapsed) => {}
                }
            }
        }
    }
}

/// Waits for the probe's acknowledgement on the connection's notification fds (and, for a
/// connection that wakes tasks directly, its wake-up of this task).
async fn wait_probe(conn: &mut Box<dyn RdmaStream>) -> io::Result<()> {
    if let Some(doorbell) = conn.task_doorbell() {
        ensure_dispatcher(&doorbell, conn.event_loop_spin())?;
    }
    let fds = conn
        .notification_fds()?
        .into_iter()
        .map(|fd| register_owned(fd, Interest::READABLE))
        .collect::<io::Result<Vec<_>>>()?;
    loop {
        // Armed before the look: a completion after it makes an fd readable.
        conn.request_notify()?;
        if let Some(outcome) = conn.probe_outcome() {
            return outcome;
        }
        // Borrowed mutably (`Send`, unlike a shared borrow of the connection).
        let task_wakes = conn.wakes_tasks();
        let looked: &mut Box<dyn RdmaStream> = conn;
        let fds = &fds;
        poll_fn(move |cx| {
            let mut any = task_wakes && looked.poll_woken(cx.waker());
            for fd in fds {
                if let Poll::Ready(guard) = fd.poll_read_ready(cx) {
                    guard?.clear_ready();
                    any = true;
                }
            }
            if any {
                Poll::Ready(Ok::<(), io::Error>(()))
            } else {
                Poll::Pending
            }
        })
        .await?;
        conn.take_notify();
    }
}

/// Negotiations a listener runs at once, plus negotiated streams not yet accepted; further
/// clients wait in the kernel's backlog.
const MAX_PENDING: usize = 256;

/// A negotiated stream waiting for `accept`, with its place among the [`MAX_PENDING`].
type Ready = io::Result<(Stream, SocketAddr, OwnedSemaphorePermit)>;

/// An asynchronous listener.
///
/// A task of the runtime `bind` ran in accepts TCP connections and negotiates each one in a
/// task of its own, so a silent, slow or garbage-speaking client never holds up the others;
/// negotiated streams queue in the listener until [`Listener::accept`] takes them. So
/// `accept` is cancel-safe as `tokio::net::TcpListener::accept` is: a dropped `accept` future
/// loses no connection (the next call returns it). No thread is used: when the runtime shuts
/// down, the listener's tasks simply end with it. Dropping the last handle stops accepting and
/// closes the connections not yet accepted.
#[derive(Debug, Clone)]
pub struct Listener {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    local: SocketAddr,
    ready: ::tokio::sync::Mutex<mpsc::UnboundedReceiver<Ready>>,
    acceptor: AbortHandle,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The acceptor task owns the negotiations (in its `JoinSet`): aborting it ends them.
        self.acceptor.abort();
    }
}

impl Listener {
    /// Listens with default options.
    pub async fn bind(addr: impl ToSocketAddrs) -> io::Result<Listener> {
        Self::bind_with(addr, Options::default()).await
    }

    /// Listens with the given options. Must be called within a tokio runtime, whose tasks
    /// then accept and negotiate.
    pub async fn bind_with(addr: impl ToSocketAddrs, options: Options) -> io::Result<Listener> {
        let tcp = ::tokio::net::TcpListener::bind(addr).await?;
        let local = tcp.local_addr()?;
        let (sender, receiver) = mpsc::unbounded_channel();
        let acceptor =
            ::tokio::spawn(accept_loop(tcp, Arc::new(event_loop_options(&options)), sender)).abort_handle();
        Ok(Listener {
            shared: Arc::new(Shared { local, ready: ::tokio::sync::Mutex::new(receiver), acceptor }),
        })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.shared.local)
    }

    /// The next negotiated connection and its peer's address. Cancel-safe: if the future is
    /// dropped before it completes, no connection is lost. Clients that fail negotiation
    /// (garbage, vanished) are dropped and never returned.
    pub async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        let mut ready = self.shared.ready.lock().await;
        match ready.recv().await {
            Some(Ok((stream, peer, _place))) => Ok((stream, peer)),
            Some(Err(err)) => Err(err),
            None => Err(io::Error::other("lightpath: the listener stopped")),
        }
    }
}

/// Accepts TCP connections and starts a negotiation task for each, keeping at most
/// [`MAX_PENDING`] negotiating or waiting to be accepted.
async fn accept_loop(
    tcp: ::tokio::net::TcpListener,
    options: Arc<Options>,
    ready: mpsc::UnboundedSender<Ready>,
) {
    let places = Arc::new(Semaphore::new(MAX_PENDING));
    let mut negotiations = JoinSet::new();
    let mut spare = crate::listener::SpareDescriptor::new();
    loop {
        let Ok(place) = Arc::clone(&places).acquire_owned().await else { return };
        // Reap finished negotiations while waiting for the next connection.
        let accepted = poll_fn(|cx| {
            while let Poll::Ready(Some(_)) = negotiations.poll_join_next(cx) {}
            tcp.poll_accept(cx)
        })
        .await;
        match accepted {
            Ok((conn, peer)) => {
                let (options, ready) = (Arc::clone(&options), ready.clone());
                negotiations.spawn(async move {
                    let stream = async {
                        let conn = conn.into_std()?;
                        let handshake = Handshake::server(&conn, &options)?;
                        negotiate(handshake, conn).await
                    };
                    // A client that failed the negotiation is dropped: it was told why.
                    if let Ok(negotiated) = stream.await {
                        let _ = ready
                            .send(Stream::from_negotiated(negotiated, &options).map(|s| (s, peer, place)));
                    }
                });
            }
            Err(err)
                if matches!(err.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
            Err(err) => {
                if crate::listener::SpareDescriptor::exhausted(&err) {
                    // Turn a waiting client away now rather than leave it waiting (see
                    // `SpareDescriptor`; synchronous, so no other task takes the spare).
                    spare.turn_away_waiting_client(tcp.as_fd());
                }
                // Out of file descriptors and the like: report it and keep serving.
                if ready.send(Err(err)).is_err() {
                    return;
                }
                ::tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completions::SPIN_GIVE_UP_AFTER;
    use std::future::Future;
    use std::sync::atomic::AtomicUsize;

    /// A task doorbell that logs what the dispatcher does and has news for its first
    /// `news` held looks.
    #[derive(Debug, Default)]
    struct LoggedDoorbell {
        log: Mutex<Vec<&'static str>>,
        news: AtomicUsize,
        tasks: usize,
    }

    impl lightpath_verbs::TaskDoorbell for LoggedDoorbell {
        fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
            unreachable!("the spin never waits on the fd")
        }
        fn dispatch(&self) {
            self.log.lock().unwrap().push("dispatch");
        }
        fn take_rings(&self) -> bool {
            false
        }
        fn tasks(&self) -> usize {
            self.tasks
        }
        fn hold_rings(&self) {
            self.log.lock().unwrap().push("hold");
        }
        fn dispatch_held(&self) -> bool {
            self.log.lock().unwrap().push("held");
            self.news.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
        }
    }

    fn take_log(doorbell: &LoggedDoorbell) -> Vec<&'static str> {
        std::mem::take(&mut *doorbell.log.lock().unwrap())
    }

    #[test]
    fn a_spin_holds_the_rings_looks_and_ends_with_a_dispatch_that_rearms_them() {
        let runtime = ::tokio::runtime::Builder::new_current_thread().build().unwrap();
        let doorbell = LoggedDoorbell { news: AtomicUsize::new(3), ..Default::default() };
        let spin = AdaptiveSpin::new(Duration::from_micros(200), SPIN_GIVE_UP_AFTER, 1000);
        runtime.block_on(spin_for_rings(&doorbell, &spin));
        let log = take_log(&doorbell);
        assert_eq!(log.first(), Some(&"hold"), "looked before holding the rings: {log:?}");
        assert_eq!(log.last(), Some(&"dispatch"), "the rings were left held: {log:?}");
        let middle = &log[1..log.len() - 1];
        assert!(middle.iter().all(|&step| step == "held"), "{log:?}");
        assert!(!middle.is_empty(), "no look while spinning: {log:?}");
    }

    #[test]
    fn a_dispatcher_whose_spins_find_nothing_stops_spinning() {
        let runtime = ::tokio::runtime::Builder::new_current_thread().build().unwrap();
        let doorbell = LoggedDoorbell::default();
        let spin = AdaptiveSpin::new(Duration::from_micros(50), SPIN_GIVE_UP_AFTER, 1000);
        for _ in 0..SPIN_GIVE_UP_AFTER {
            runtime.block_on(spin_for_rings(&doorbell, &spin));
            let log = take_log(&doorbell);
            assert_eq!((log.first(), log.last()), (Some(&"hold"), Some(&"dispatch")), "{log:?}");
        }
        runtime.block_on(spin_for_rings(&doorbell, &spin));
        assert_eq!(take_log(&doorbell), Vec::<&str>::new(), "spun after {SPIN_GIVE_UP_AFTER} empty spins");
        // Spins that find news keep it spinning.
        let spin = AdaptiveSpin::new(Duration::from_micros(50), SPIN_GIVE_UP_AFTER, 1000);
        for _ in 0..SPIN_GIVE_UP_AFTER + 2 {
            doorbell.news.store(1, Ordering::SeqCst);
            runtime.block_on(spin_for_rings(&doorbell, &spin));
            assert_eq!(take_log(&doorbell).first(), Some(&"hold"), "gave up spinning that paid");
        }
    }

    #[test]
    fn a_spin_cut_short_rearms_the_rings() {
        let runtime = ::tokio::runtime::Builder::new_current_thread().build().unwrap();
        let doorbell = LoggedDoorbell::default();
        let spin = AdaptiveSpin::new(Duration::from_secs(60), SPIN_GIVE_UP_AFTER, 1000);
        runtime.block_on(async {
            // Polled once, it holds the rings and yields; then it is dropped there, as a
            // runtime that shuts down drops its dispatcher.
            let mut spinning = std::pin::pin!(spin_for_rings(&doorbell, &spin));
            let first = poll_fn(|cx| Poll::Ready(spinning.as_mut().poll(cx))).await;
            assert!(first.is_pending(), "the spin ended at its first poll");
            assert_eq!(take_log(&doorbell), ["hold"]);
        });
        assert_eq!(take_log(&doorbell), ["dispatch"], "a spin cut short left the rings held");
    }

    /// A device's spin look that counts its looks and finds news at look number `news_at`
    /// (counted from 1; 0: never).
    #[derive(Debug, Default)]
    struct CountedSpin {
        looks: AtomicUsize,
        news_at: AtomicUsize,
        tasks: usize,
    }

    impl lightpath_verbs::TaskSpin for CountedSpin {
        fn look(&self) -> bool {
            let look = self.looks.fetch_add(1, Ordering::SeqCst) + 1;
            look == self.news_at.load(Ordering::SeqCst)
        }
        fn tasks(&self) -> usize {
            self.tasks
        }
    }

    /// Lets a current-thread runtime's other tasks run until `done` holds (or a second).
    async fn run_others_until(done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(1);
        while !done() && Instant::now() < deadline {
            ::tokio::task::yield_now().await;
        }
    }

    #[test]
    fn a_kicked_spinner_looks_while_news_comes_then_waits_for_the_next_kick() {
        let runtime = ::tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let counted = Arc::new(CountedSpin { news_at: AtomicUsize::new(5), tasks: 1, ..Default::default() });
        let task_spin: Arc<dyn lightpath_verbs::TaskSpin> = counted.clone();
        let looks = || counted.looks.load(Ordering::SeqCst);
        runtime.block_on(async {
            assert!(
                ensure_spinner(&task_spin, Duration::ZERO).unwrap().is_none(),
                "a spinner without a spin"
            );
            let kicker = ensure_spinner(&task_spin, Duration::from_millis(2)).unwrap().unwrap();
            let again = ensure_spinner(&task_spin, Duration::from_millis(2)).unwrap().unwrap();
            assert!(Arc::ptr_eq(&kicker, &again), "a second spinner for the same device and runtime");
            ::tokio::time::sleep(Duration::from_millis(10)).await;
            assert_eq!(looks(), 0, "looked before any stream waited");
            kick(Some(&kicker));
            assert!(kicker.spinning.load(Ordering::SeqCst), "a kick started no spin");
            run_others_until(|| !kicker.spinning.load(Ordering::SeqCst)).await;
            let spun = looks();
            assert!(spun > 5, "the spin ended at its news ({spun} looks)");
            assert!(!kicker.spinning.load(Ordering::SeqCst), "the spin never ended");
            ::tokio::time::sleep(Duration::from_millis(10)).await;
            assert_eq!(looks(), spun, "looked on with no kick");
            kick(Some(&kicker));
            run_others_until(|| looks() > spun).await;
            assert!(looks() > spun, "a second kick started no spin");
        });
        let device = Arc::as_ptr(&task_spin) as *const () as usize;
        let running = || {
            let spinners = SPINNERS.lock().unwrap();
            spinners.iter().filter(|s| s.device == device && s.running.load(Ordering::SeqCst)).count()
        };
        assert_eq!(running(), 1, "one spinner for the device in its runtime");
        // The runtime is gone, and its spinner with it: the next runtime starts its own.
        drop(runtime);
        assert_eq!(running(), 0, "the spinner outlived its runtime");
        let other = ::tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        other.block_on(async {
            let kicker = ensure_spinner(&task_spin, Duration::from_micros(200)).unwrap().unwrap();
            let before = looks();
            kick(Some(&kicker));
            run_others_until(|| looks() > before).await;
            assert!(looks() > before, "no spinner in the second runtime");
        });
    }

    /// A kick that would not spin wakes nobody: with more than `SPINNER_MAX_TASKS`
    /// tasks, or once spins found nothing `SPIN_GIVE_UP_AFTER` times in a row (then one kick
    /// in so many tries again).
    #[test]
    fn kicks_that_would_not_spin_wake_nobody() {
        let runtime = ::tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let many = Arc::new(CountedSpin { tasks: SPINNER_MAX_TASKS + 1, ..Default::default() });
        let idle = Arc::new(CountedSpin { tasks: 1, ..Default::default() });
        runtime.block_on(async {
            let task_spin: Arc<dyn lightpath_verbs::TaskSpin> = many.clone();
            let kicker = ensure_spinner(&task_spin, Duration::from_micros(50)).unwrap().unwrap();
            kick(Some(&kicker));
            ::tokio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(many.looks.load(Ordering::SeqCst), 0, "looked for {} tasks", SPINNER_MAX_TASKS + 1);

            let task_spin: Arc<dyn lightpath_verbs::TaskSpin> = idle.clone();
            let kicker = ensure_spinner(&task_spin, Duration::from_micros(50)).unwrap().unwrap();
            for round in 0..SPIN_GIVE_UP_AFTER {
                let before = idle.looks.load(Ordering::SeqCst);
                kick(Some(&kicker));
                run_others_until(|| !kicker.spinning.load(Ordering::SeqCst)).await;
                assert!(idle.looks.load(Ordering::SeqCst) > before, "kick {round} did not spin");
            }
            let before = idle.looks.load(Ordering::SeqCst);
            kick(Some(&kicker));
            assert!(
                !kicker.spinning.load(Ordering::SeqCst),
                "a kick spun after {SPIN_GIVE_UP_AFTER} empty spins"
            );
            ::tokio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(idle.looks.load(Ordering::SeqCst), before);
            // One kick in so many retries, for longer than a spin (see `RETRY_SPIN_FACTOR`).
            let kicks = (0..1000).take_while(|_| {
                kick(Some(&kicker));
                !kicker.spinning.load(Ordering::SeqCst)
            });
            assert!(kicks.count() < 999, "no kick retried the spin");
            let retry = Duration::from_nanos(kicker.budget.load(Ordering::SeqCst));
            assert_eq!(retry, Duration::from_micros(50) * RETRY_SPIN_FACTOR, "a retry of the usual length");
            run_others_until(|| !kicker.spinning.load(Ordering::SeqCst)).await;
            assert!(idle.looks.load(Ordering::SeqCst) > before, "the retry looked nowhere");
        });
    }

    #[test]
    fn a_dispatcher_of_many_connections_does_not_spin() {
        let runtime = ::tokio::runtime::Builder::new_current_thread().build().unwrap();
        let spin = AdaptiveSpin::new(Duration::from_micros(50), SPIN_GIVE_UP_AFTER, 1000);
        let few = LoggedDoorbell { tasks: DISPATCH_SPIN_MAX_TASKS, ..Default::default() };
        runtime.block_on(spin_for_rings(&few, &spin));
        assert_eq!(take_log(&few).first(), Some(&"hold"), "{DISPATCH_SPIN_MAX_TASKS} tasks: no spin");
        let many = LoggedDoorbell { tasks: DISPATCH_SPIN_MAX_TASKS + 1, ..Default::default() };
        runtime.block_on(spin_for_rings(&many, &spin));
        assert_eq!(take_log(&many), Vec::<&str>::new(), "spun for {} tasks", DISPATCH_SPIN_MAX_TASKS + 1);
    }
}
