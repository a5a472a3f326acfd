//! Completion queues shared by many connections.
//!
//! A device's connections do not each get a completion queue: their queue pairs report to a
//! few shared ones ([`Hub`]s, from the device's [`HubPool`]), and a router hands every
//! completion to its connection's [`Inbox`] by queue-pair number. One poll then serves every
//! connection with work, a blocked server thread per connection does not mean a queue (and,
//! on hardware, an interrupt channel) per connection, and the threads blocked on a device
//! take turns watching its queue instead of all watching it (see `hub` for the protocol).
//!
//! A connection sees its share through [`ConnCompletions`], which offers what it used from
//! its own queue: `poll`, `wait`, and the arm / fd / take protocol of completion channels,
//! served by a per-connection eventfd.
//!
//! Waiting for one connection: where the provider lets a queue pair have a doorbell of its own
//! (`QueuePair::set_waiter_fd`: shm hands it to the peer with the queue pair's introduction),
//! the inbox's eventfd is that doorbell. A connection of a hub with others then waits without
//! the hub's leader, router or notifier between its peer and itself: it arms the queue pair
//! (`QueuePair::arm_waiter`, which also moves the provider forward), takes what the queue has,
//! and sleeps on the eventfd, which the peer writes when it publishes news for this queue pair
//! and the hub writes when another thread routes a completion here. One wake-up per message,
//! of exactly the thread (or event loop) that waits, as kernel TCP does. Event loops always
//! wait so; a blocked thread keeps the leader's path (the provider's own wait, which spins
//! before it sleeps) only as its device's one connection: with others, even on hubs of their
//! own (shm's), the provider's wait has one thread watch the device for all and wake the rest,
//! two wake-ups per message (see `ConnCompletions::waits_alone`). A soft queue pair
//! with a port of its own (by default, `Options::soft_qp_port`) hands the waiter a second
//! descriptor to sleep on beside the eventfd (`QueuePair::waiter_poll_fd`): its news arrives
//! there, and the waiter's next arming takes it in; such a connection always waits on its
//! doorbell, and a blocked thread polls the port for a while before it sleeps (see
//! `AdaptiveSpin`).
//!
//! Capacity: a hub's queue must hold every completion its connections can have outstanding,
//! so each connection reserves its send plus receive depth when it attaches, and a full hub
//! makes the pool open another (twice as large, up to the device's `max_cqe`).

pub(crate) mod diagnostics;
mod hub;
mod inbox;
mod notifier;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lightpath_soft::AdaptiveSpin;
use lightpath_verbs::{CqOf, Device, QpOf, QueuePair, WakeFor, WorkCompletion};

pub(crate) use hub::Hub;
pub(crate) use inbox::Inbox;

use crate::error::from_verbs;

/// The shared completion queues of one device.
pub(crate) struct HubPool<D: Device> {
    hubs: Mutex<Vec<Arc<Hub<D>>>>,
    /// Connections of the device, over every hub (see [`ConnCompletions::waits_alone`]).
    connections: Arc<AtomicUsize>,
    /// Entries of the first queue (later ones double, up to the device's limit).
    first_entries: u32,
    /// Whether connections share this device's queues unless their options say otherwise
    /// (see `Options::shared_completion_queues`).
    shared_by_default: bool,
}

impl<D: Device + 'static> HubPool<D> {
    /// A pool whose first queue holds `first_entries` completions, whose connections share its
    /// queues by default.
    pub(crate) fn new(first_entries: u32) -> Self {
        Self {
            hubs: Mutex::new(Vec::new()),
            connections: Arc::new(AtomicUsize::new(0)),
            first_entries,
            shared_by_default: true,
        }
    }

    /// A pool whose connections each get a queue of their own unless their options ask to
    /// share (the shm provider's: its peers ring each queue pair's own doorbell).
    pub(crate) fn own_queues_by_default(first_entries: u32) -> Self {
        Self { shared_by_default: false, ..Self::new(first_entries) }
    }

    /// A hub of `device` with room for `entries` more outstanding completions, reserved;
    /// with `shared` false (or `None` where the pool's connections get queues of their own by
    /// default), a hub of its own (not kept in the pool).
    pub(crate) fn reserve(&self, device: &D, entries: u32, shared: Option<bool>) -> io::Result<Arc<Hub<D>>> {
        if !shared.unwrap_or(self.shared_by_default) {
            let cq = device.create_cq(entries).map_err(from_verbs)?;
            let hub = Self::new_hub(cq, entries);
            let reserved = hub.reserve(entries);
            debug_assert!(reserved, "a new hub has room for one connection");
            return Ok(hub);
        }
        let mut hubs = self.hubs.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(hub) = hubs.iter().find(|hub| hub.reserve(entries)) {
            return Ok(Arc::clone(hub));
        }
        let max = device.query().map_err(from_verbs)?.max_cqe.max(1);
        let largest = hubs.last().map_or(0, |hub| hub.capacity());
        let size = largest.saturating_mul(2).max(self.first_entries).max(entries).min(max);
        if size < entries {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!(
                    "lightpath: a connection needs {entries} completion entries; the device allows {max}"
                ),
            ));
        }
        let cq = device.create_cq(size).map_err(from_verbs)?;
        let hub = Self::new_hub(cq, size);
        let reserved = hub.reserve(entries);
        debug_assert!(reserved, "a new hub has room for one connection");
        hubs.push(Arc::clone(&hub));
        Ok(hub)
    }

    /// A hub around `cq`, listed for `diagnostics`.
    fn new_hub(cq: CqOf<D>, capacity: u32) -> Arc<Hub<D>> {
        let hub = Arc::new(Hub::new(cq, capacity));
        let weak: std::sync::Weak<Hub<D>> = Arc::downgrade(&hub);
        diagnostics::register(weak);
        hub
    }

    /// A connection's completions: a reservation of `entries` in a hub ([`HubPool::reserve`]),
    /// counted among the device's connections.
    pub(crate) fn connection(
        &self,
        device: &D,
        entries: u32,
        shared: Option<bool>,
    ) -> io::Result<ConnCompletions<D>> {
        let hub = self.reserve(device, entries, shared)?;
        ConnCompletions::counted(hub, entries, Arc::clone(&self.connections))
    }

    /// The device's connections now (over every hub).
    pub(crate) fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// How many shared queues the pool has opened.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.hubs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len()
    }
}

/// One connection's view of its hub: its completions, as if the queue were its own.
pub(crate) struct ConnCompletions<D: Device> {
    hub: Arc<Hub<D>>,
    inbox: Arc<Inbox>,
    /// Completion entries reserved in the hub.
    entries: u32,
    /// The queue pair routed here, once attached.
    qpn: Option<u32>,
    /// The queue pair has a doorbell of its own: the inbox's eventfd (see the module docs),
    /// or the inbox's wake-up called through `task_doorbell`.
    waiter: bool,
    /// The queue pair's news wakes the inbox's task (or sleeper) through a call, not the
    /// inbox's eventfd (an event loop's connection, see `attach`).
    task_waiter: bool,
    /// The device's task doorbell the peer rings for it, if the provider has one (shm).
    task_doorbell: Option<Arc<dyn lightpath_verbs::TaskDoorbell>>,
    /// Waiters also sleep on a descriptor of the queue pair's (`QueuePair::waiter_poll_fd`):
    /// the doorbell is the direct path even alone on the hub.
    doorbell_only: bool,
    /// The device's connections (this one included), over all its hubs.
    device_connections: Arc<AtomicUsize>,
    /// How long a blocking wait on the queue pair's doorbell looks for news before it sleeps
    /// (see `spin_on_own_port` and `spin_on_queue`), and how that paid lately.
    wait_spin: AdaptiveSpin,
}

/// A blocking wait on a queue pair's own descriptor (a soft queue pair's UDP port) that slept
/// at once paid a kernel wake-up per message, where the device's shared socket had its watcher
/// spin first (`SoftConfig::wait_spin`): it spins too, adaptively (see `AdaptiveSpin`), and so
/// does one on a doorbell alone (shm, see `spin_on_queue`); given up after this many spins in
/// a row found nothing (an event loop's dispatcher too, see `tokio_driver::spin_for_rings`)...
pub(crate) const SPIN_GIVE_UP_AFTER: u32 = 8;
/// ... and then tried again once every this many waits.
const SPIN_RETRY_EVERY: u32 = 64;

/// Whether an arming takes in the queue pair's own descriptor (a soft queue pair's UDP port).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PortLook {
    /// Receive what waits there (`QueuePair::arm_waiter`).
    TakeIn,
    /// The caller knows nothing came since its last arming took it in (an event loop whose
    /// registration saw no readiness since), or sleeps on it level-triggered right after
    /// (`QueuePair::arm_waiter_without_look`): one system call less per wait.
    Skip,
}

impl PortLook {
    /// Arms `qp`'s doorbell for `wake`, taking its own descriptor in or not (see
    /// `QueuePair::arm_waiter`); `Ok(false)` when it has no doorbell.
    fn arm<Q: QueuePair + ?Sized>(self, qp: &Q, wake: WakeFor) -> lightpath_verbs::Result<bool> {
        match self {
            PortLook::TakeIn => qp.arm_waiter(wake),
            PortLook::Skip => qp.arm_waiter_without_look(wake),
        }
    }
}

/// What a spin before a blocking wait (`ConnCompletions::spin`) came to.
enum Spun {
    /// This many completions, in `out`.
    Found(usize),
    /// Nothing came.
    Nothing,
    /// The queue pair has no port after all.
    NoPort,
}

/// Threads of this process in a blocking wait on a doorbell (`wait_on_doorbell`), spinning or
/// asleep.
static DOORBELL_WAITERS: AtomicUsize = AtomicUsize::new(0);

/// Doorbell waiters per core up to which a wait on a doorbell alone spins (`spin_on_queue`).
/// A spinning thread stays runnable and yields: with tens of them per core the yields take
/// turns with the threads that answer, and an answer found on the thread's next turn costs no
/// wake-up on either side; with hundreds per core every yield is a context switch that mostly
/// finds nothing (shm, `perf stream_rr -s 64 --server threads`, 2 cores: 100 connections
/// 151 -> 196 k requests/s with spinning, 1,000 connections 112 -> 59 k unbounded and 118 k
/// with this limit; see docs/shm-scaling.md, "Spinning doorbell waiters").
const SPIN_WAITERS_PER_CORE: usize = 64;

/// How many doorbell waiters the process may have for a new wait to spin.
fn spinning_waiters_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| SPIN_WAITERS_PER_CORE * lightpath_verbs::available_cores().max(1))
}

/// The spin of a wait on a queue pair's doorbell (or of an event loop's dispatcher), `limit`
/// long while it pays.
pub(crate) fn wait_spin(limit: Duration) -> AdaptiveSpin {
    AdaptiveSpin::new(limit, SPIN_GIVE_UP_AFTER, SPIN_RETRY_EVERY)
}

impl<D: Device> ConnCompletions<D> {
    /// Takes a reservation of `entries` in `hub` (made by [`HubPool::reserve`]), as the
    /// device's only connection.
    #[cfg(test)]
    pub(crate) fn new(hub: Arc<Hub<D>>, entries: u32) -> io::Result<Self> {
        Self::counted(hub, entries, Arc::new(AtomicUsize::new(0)))
    }

    /// Takes a reservation of `entries` in `hub`, counted in `device_connections`.
    fn counted(hub: Arc<Hub<D>>, entries: u32, device_connections: Arc<AtomicUsize>) -> io::Result<Self> {
        match Inbox::new() {
            Ok(inbox) => {
                device_connections.fetch_add(1, Ordering::Relaxed);
                Ok(Self {
                    hub,
                    inbox: Arc::new(inbox),
                    entries,
                    qpn: None,
                    waiter: false,
                    doorbell_only: false,
                    task_waiter: false,
                    task_doorbell: None,
                    device_connections,
                    wait_spin: wait_spin(Duration::ZERO),
                })
            }
            Err(err) => {
                hub.release(entries);
                Err(err)
            }
        }
    }

    /// The shared queue, for creating the connection's queue pair on it.
    pub(crate) fn cq(&self) -> &CqOf<D> {
        self.hub.cq()
    }

    /// Routes the completions of `qp` here, and (with `doorbell`) gives it the inbox's eventfd
    /// as its own doorbell if the provider takes one (call before RTR). With `tasks` (an
    /// event loop's connection), the provider is asked first to wake the inbox through its
    /// device's task doorbell instead (`QueuePair::set_waiter_task`): no descriptor per
    /// connection.
    pub(crate) fn attach(&mut self, qp: &QpOf<D>, doorbell: bool, tasks: bool) -> io::Result<()> {
        let qpn = qp.qpn();
        if let Some(old) = self.qpn.replace(qpn) {
            self.hub.detach(old);
        }
        self.hub.attach(qpn, Arc::clone(&self.inbox));
        self.waiter = false;
        self.task_waiter = false;
        self.task_doorbell = None;
        if doorbell && tasks {
            let inbox = Arc::downgrade(&self.inbox);
            let wake: lightpath_verbs::TaskWake = Arc::new(move || {
                if let Some(inbox) = inbox.upgrade() {
                    inbox.wake();
                }
            });
            self.task_waiter = qp.set_waiter_task(wake).map_err(from_verbs)?;
            self.waiter = self.task_waiter;
            if self.task_waiter {
                self.task_doorbell = qp.task_doorbell();
            }
        }
        if doorbell && !self.waiter {
            // An eventfd of its own, which the inbox keeps only if the queue pair takes it:
            // a connection whose news comes through the router makes one when it first
            // sleeps or is asked for its notification fd, and a tokio stream's never does.
            let event = match self.inbox.shared_event() {
                Some(event) => Arc::clone(event),
                None => Inbox::new_event()?,
            };
            self.waiter = qp.set_waiter_fd(&event).map_err(from_verbs)?;
            if self.waiter {
                self.inbox.adopt_event(event);
            }
        }
        if self.waiter {
            if let Some(fd) = qp.waiter_poll_fd() {
                self.inbox.set_poll_fd(fd);
                self.doorbell_only = true;
            }
        }
        Ok(())
    }

    /// How long a blocking wait on the queue pair's doorbell looks for news, yielding the
    /// core between looks, before it sleeps (see `AdaptiveSpin`; zero, the default, never).
    pub(crate) fn set_wait_spin(&mut self, limit: Duration) {
        self.wait_spin = wait_spin(limit);
    }

    /// The device's connections, this one included.
    #[cfg(test)]
    pub(crate) fn device_connections(&self) -> usize {
        self.device_connections.load(Ordering::Relaxed)
    }

    /// Whether a wait goes straight to the queue pair's doorbell: it has one, and the device
    /// has other connections, or the queue pair's news arrives on a descriptor of its own,
    /// which only its doorbell waiters watch. The device's only connection keeps the leader's
    /// path (the provider's own wait), which is as direct then and spins before it sleeps.
    ///
    /// With other connections (even on hubs of their own, as shm's are) the provider's wait
    /// is not direct: one blocked thread watches the device and wakes the others as their
    /// completions land, two wake-ups per message. Measured over shm with a thread per
    /// connection, alternating, same build: 16 connections 43-46k -> 73-90k requests/s, 100
    /// connections 45k -> 64-69k; one connection keeps the spin (88-96k, against 44-63k
    /// through the doorbell).
    fn waits_alone(&self) -> bool {
        self.waiter
            && (self.doorbell_only
                || self.task_waiter
                || self.hub.attached() > 1
                || self.device_connections.load(Ordering::Relaxed) > 1)
    }

    /// Moves up to `out.len()` of this connection's completions into `out`, routing what
    /// the shared queue has first if none are waiting. Never blocks.
    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> lightpath_verbs::Result<usize> {
        let n = self.inbox.pop(out);
        if n > 0 || out.is_empty() {
            return Ok(n);
        }
        let Some(qpn) = self.qpn else { return Ok(0) };
        let n = self.hub.poll_for(&self.inbox, qpn, out)?;
        if n > 0 {
            return Ok(n);
        }
        Ok(self.inbox.pop(out))
    }

    /// Like `poll`, but blocks until a completion arrives or `timeout` passes (0 then). `qp`
    /// is the attached queue pair; `wake` says what the caller waits for (waiting on the queue
    /// pair's own doorbell, acknowledgements do not wake a caller waiting for arrivals; they
    /// are still returned with the next completion).
    pub(crate) fn wait(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
        timeout: Duration,
        wake: WakeFor,
    ) -> lightpath_verbs::Result<usize> {
        self.wait_and_watch(qp, out, timeout, wake, None)
    }

    /// Whether [`ConnCompletions::wait_watching`] watches its descriptor: the wait goes
    /// straight to the queue pair's doorbell (see `waits_alone`). Otherwise it waits as
    /// [`ConnCompletions::wait`] does, and the caller must look at what it watches itself.
    pub(crate) fn can_watch(&self) -> bool {
        self.qpn.is_some() && self.waits_alone()
    }

    /// [`ConnCompletions::wait`], also ended (with 0) by `watch` turning readable when
    /// [`ConnCompletions::can_watch`]: a blocked stream call sleeps on its TCP connection (the
    /// liveness channel) beside its doorbell, rather than waking every few milliseconds to
    /// look at it.
    pub(crate) fn wait_watching(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
        timeout: Duration,
        wake: WakeFor,
        watch: BorrowedFd<'_>,
    ) -> lightpath_verbs::Result<usize> {
        self.wait_and_watch(qp, out, timeout, wake, Some(watch))
    }

    /// [`ConnCompletions::wait`], watching `watch` too where the wait goes to the doorbell.
    fn wait_and_watch(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
        timeout: Duration,
        wake: WakeFor,
        watch: Option<BorrowedFd<'_>>,
    ) -> lightpath_verbs::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let Some(qpn) = self.qpn else { return Ok(0) };
        // Only with the queue pair's own doorbell: providers without one keep waking readers
        // for every routed completion, as before.
        self.inbox.set_arrivals_only(self.waiter && wake == WakeFor::Arrivals);
        if self.waits_alone() {
            if let Some(n) = self.wait_on_doorbell(qp, qpn, out, timeout, wake, watch)? {
                return Ok(n);
            }
        }
        self.hub.wait(&self.inbox, qpn, out, timeout)
    }

    /// Waits on the queue pair's own doorbell (the inbox's eventfd): arm, look once more, sleep.
    /// `None` if the queue pair turned out to have no doorbell (its link was made without one).
    fn wait_on_doorbell(
        &self,
        qp: &QpOf<D>,
        qpn: u32,
        out: &mut [WorkCompletion],
        timeout: Duration,
        wake: WakeFor,
        watch: Option<BorrowedFd<'_>>,
    ) -> lightpath_verbs::Result<Option<usize>> {
        DOORBELL_WAITERS.fetch_add(1, Ordering::Relaxed);
        /// Counts the wait out however it ends.
        struct Leave;
        impl Drop for Leave {
            fn drop(&mut self) {
                DOORBELL_WAITERS.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let _leave = Leave;
        let deadline = std::time::Instant::now() + timeout;
        let mut woken = false;
        loop {
            let n = self.inbox.pop(out);
            if n > 0 {
                return Ok(Some(n));
            }
            if woken && !self.doorbell_only {
                // Rung: the news is most likely there; take it without arming first. (With a
                // descriptor of its own, the news is usually still in it: the arming below
                // takes it in.)
                let n = self.hub.poll_for(&self.inbox, qpn, out)?;
                if n > 0 {
                    return Ok(Some(n));
                }
            }
            if !woken && self.doorbell_only {
                match self.spin_on_own_port(qp, qpn, out, wake, deadline)? {
                    Spun::Nothing => {}
                    Spun::Found(n) => return Ok(Some(n)),
                    Spun::NoPort => return Ok(None),
                }
            } else if !woken {
                if let Spun::Found(n) = self.spin_on_queue(qpn, out, deadline)? {
                    return Ok(Some(n));
                }
            }
            // The arming before the sleep looks at the queue pair's own descriptor only after a
            // wake-up (what woke it is there): otherwise it would mostly find nothing (the spin
            // just looked, or the wait just began), and the sleep watches the descriptor,
            // level-triggered, anyway: what waits there ends it at once, and the next round's
            // arming takes it in. One `recvmmsg` less per sleep.
            let look = if woken { PortLook::TakeIn } else { PortLook::Skip };
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(Some(0));
            }
            let mut found = Ok(Some(0));
            // Counted asleep first, so a completion another thread routes here from now on
            // writes the eventfd; then armed, so the peer's next news does; then one more look
            // (the arm moved the provider forward, and the router lock waits for a thread that
            // is routing), and only then the sleep.
            let slept = self.inbox.sleep_watching(left, watch, self.task_doorbell.as_deref(), || {
                found = match look.arm(qp, wake) {
                    Ok(true) => self.hub.poll_for_locked(&self.inbox, qpn, out).map(Some),
                    Ok(false) => Ok(None),
                    Err(err) => Err(err),
                };
                matches!(found, Ok(Some(0)))
            });
            woken = slept.woken;
            match found {
                Ok(Some(0)) => {}
                other => return other,
            }
            if slept.watched {
                // The caller looks at what it watches; the news it woke for, if any, waits
                // for the next call.
                return Ok(Some(self.inbox.pop(out)));
            }
        }
    }

    /// Before a blocking wait sleeps on the queue pair's own descriptor: takes in the port
    /// (an arming, `QueuePair::arm_waiter`) and looks for completions over and over (see
    /// `spin`).
    fn spin_on_own_port(
        &self,
        qp: &QpOf<D>,
        qpn: u32,
        out: &mut [WorkCompletion],
        wake: WakeFor,
        deadline: std::time::Instant,
    ) -> lightpath_verbs::Result<Spun> {
        self.spin(deadline, || {
            if !qp.arm_waiter(wake)? {
                return Ok(Spun::NoPort);
            }
            self.look_for(qpn, out)
        })
    }

    /// Before a blocking wait arms the queue pair's doorbell (one without a descriptor of the
    /// queue pair's own: shm's) and sleeps: looks for completions over and over (see `spin`);
    /// not at all while the process has more blocked doorbell waiters than
    /// [`SPIN_WAITERS_PER_CORE`] per core.
    ///
    /// Unarmed meanwhile, so a peer whose answer comes within the spin finds no waiter to
    /// ring: no eventfd write on its side, no `ppoll` and `read` and no kernel wake-up on this
    /// one. With a thread per connection on few cores the yield hands the core to whoever
    /// runs next (often the thread that answers). Measured over shm, `perf stream_rr -s 64
    /// --server threads`, alternated runs against kernel TCP (see docs/shm-scaling.md,
    /// "Spinning doorbell waiters").
    fn spin_on_queue(
        &self,
        qpn: u32,
        out: &mut [WorkCompletion],
        deadline: std::time::Instant,
    ) -> lightpath_verbs::Result<Spun> {
        if DOORBELL_WAITERS.load(Ordering::Relaxed) > spinning_waiters_limit() {
            return Ok(Spun::Nothing);
        }
        self.spin(deadline, || self.look_for(qpn, out))
    }

    /// Runs `look` over and over, yielding the core in between (on few cores the peer, or the
    /// thread that answers, may need this one), for the spin budget (see `AdaptiveSpin`, told
    /// whether the spin found anything) or until `deadline`; stops at the first look that
    /// says anything but `Nothing`.
    fn spin(
        &self,
        deadline: std::time::Instant,
        mut look: impl FnMut() -> lightpath_verbs::Result<Spun>,
    ) -> lightpath_verbs::Result<Spun> {
        let budget = self.wait_spin.budget();
        if budget.is_zero() {
            return Ok(Spun::Nothing);
        }
        let until = (std::time::Instant::now() + budget).min(deadline);
        loop {
            match look()? {
                Spun::Nothing => {}
                Spun::Found(n) => {
                    self.wait_spin.record(true);
                    return Ok(Spun::Found(n));
                }
                Spun::NoPort => return Ok(Spun::NoPort),
            }
            if std::time::Instant::now() >= until {
                self.wait_spin.record(false);
                return Ok(Spun::Nothing);
            }
            std::thread::yield_now();
        }
    }

    /// One look of a spin: the connection's completions, polling the queue if none wait.
    fn look_for(&self, qpn: u32, out: &mut [WorkCompletion]) -> lightpath_verbs::Result<Spun> {
        let n = self.hub.poll_for(&self.inbox, qpn, out)?;
        let n = if n > 0 { n } else { self.inbox.pop(out) };
        Ok(if n > 0 { Spun::Found(n) } else { Spun::Nothing })
    }

    /// Arms the queue pair's own doorbell for `wake` (an event loop's wait; see
    /// `request_notify`) and takes the completions already there into `out`, or leaves them
    /// to the hub's leader to route (see `Hub::poll_for_locked`) unless `wait_for_router`
    /// (a look that must see everything now: `Hub::poll_for_all`). `None` when the queue pair
    /// has no doorbell (nothing armed).
    fn arm_doorbell(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
        wake: WakeFor,
        wait_for_router: bool,
        look: PortLook,
    ) -> lightpath_verbs::Result<Option<usize>> {
        let (true, Some(qpn)) = (self.waiter, self.qpn) else { return Ok(None) };
        self.inbox.set_arrivals_only(wake == WakeFor::Arrivals);
        // The provider writes the fd for every completion made after the arming (by the peer's
        // news or by another thread, see `QueuePair::arm_waiter`), and what was made before is
        // taken below: the inbox is not armed as well, or a completion another thread routes
        // here would write the fd a second time (two wake-ups of the event loop per message).
        self.inbox.disarm();
        if !look.arm(qp, wake)? {
            return Ok(None);
        }
        if wait_for_router {
            return self.hub.poll_for_all(&self.inbox, qpn, out).map(Some);
        }
        self.hub.poll_for_locked(&self.inbox, qpn, out).map(Some)
    }

    /// Widens an arming of the queue pair's doorbell for arrivals only (`request_notify` with
    /// `WakeFor::Arrivals`) to every completion. Completions already there go into `out`
    /// (their number is returned): the caller handles them and, since they raised no event,
    /// looks again itself if they changed anything. Without a doorbell of its own nothing was
    /// narrowed (0).
    pub(crate) fn widen_to_anything(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
    ) -> lightpath_verbs::Result<usize> {
        Ok(self.arm_doorbell(qp, out, WakeFor::Anything, false, PortLook::TakeIn)?.unwrap_or(0))
    }

    /// Takes in what waits in the queue pair's own descriptor (a soft queue pair's UDP port),
    /// which otherwise only an arming or, a tick later, the device's progress thread reads:
    /// for a verdict that must see everything the peer sent, such as "the peer vanished"
    /// once its TCP connection ended. Completions go into `out` (their number is returned);
    /// the doorbell is left armed for anything (the caller's next wait arms it as it needs).
    /// 0 when the queue pair has no descriptor of its own (its news is in the queue already).
    pub(crate) fn take_in_own_port(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
    ) -> lightpath_verbs::Result<usize> {
        if !self.doorbell_only {
            return Ok(0);
        }
        Ok(self.arm_doorbell(qp, out, WakeFor::Anything, true, PortLook::TakeIn)?.unwrap_or(0))
    }

    /// Leaves `note()` in the inbox as this connection's state at its latest wait, when
    /// `diagnostics` notes are on (the closure is not called otherwise).
    pub(crate) fn note_wait(&self, note: impl FnOnce() -> String) {
        if diagnostics::enabled() {
            self.inbox.set_note(note());
        }
    }

    /// The fd an event loop waits on (readable after `request_notify` once a completion
    /// arrives), made now if it is not yet; `None` if it cannot be (no descriptor left).
    pub(crate) fn notify_fd(&self) -> Option<RawFd> {
        self.inbox.event_fd().ok().map(|fd| fd.as_raw_fd())
    }

    /// Whether the connection's wake-ups need no descriptor of its own: its queue pair took
    /// no doorbell (its news comes through the router), so an event loop's task can wait
    /// through [`ConnCompletions::poll_woken`] instead of the notification fd.
    pub(crate) fn wakes_tasks(&self) -> bool {
        !self.waiter || self.task_waiter
    }

    /// The device's task doorbell this connection's queue pair is woken through, if it is
    /// (see `attach`): an event loop must see that it is watched and dispatched.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn task_doorbell(&self) -> Option<&Arc<dyn lightpath_verbs::TaskDoorbell>> {
        self.task_doorbell.as_ref()
    }

    /// For an event loop's task that waits without the notification fd (see
    /// [`ConnCompletions::wakes_tasks`]): whether a wake-up came since the last call, leaving
    /// `waker` to be woken by the next one otherwise. Armed as the fd is, by `request_notify`.
    pub(crate) fn poll_woken(&self, waker: &std::task::Waker) -> bool {
        self.inbox.poll_woken(waker)
    }

    /// The queue pair's own descriptor an event loop must watch beside `notify_fd`, if it has
    /// one (`QueuePair::waiter_poll_fd`): readable when news waits that the next
    /// `request_notify` takes in.
    pub(crate) fn poll_fd(&self) -> Option<RawFd> {
        self.inbox.poll_fd().map(|fd| fd.as_raw_fd())
    }

    /// Descriptors of their own for the notification fd (unless the connection wakes tasks
    /// directly, see `wakes_tasks`) and the queue pair's own descriptor (see `notify_fd` and
    /// `poll_fd`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn notification_fds(&self) -> io::Result<Vec<std::os::fd::OwnedFd>> {
        let mut fds = Vec::with_capacity(2);
        if !self.wakes_tasks() {
            fds.push(self.inbox.event_fd()?.try_clone_to_owned()?);
        }
        if let Some(fd) = self.inbox.poll_fd() {
            fds.push(fd.try_clone_to_owned()?);
        }
        Ok(fds)
    }

    /// Consumes a pending notification; returns whether there was one.
    pub(crate) fn take_notify(&self) -> bool {
        self.inbox.take_wake()
    }
}

impl<D: Device + 'static> ConnCompletions<D> {
    /// Asks for the notification fd to become readable on the next completion of `qp` (the
    /// attached queue pair) that `wake` asks for. With the queue pair's own doorbell the arming
    /// looks: what was there goes into `out` (`Some` of their number), and anything later
    /// rings. Otherwise (`None`) the inbox is armed and the caller polls once more before it
    /// waits (as after a completion channel's arming). `look` says whether the queue pair's own
    /// descriptor is taken in too (see [`PortLook`]).
    pub(crate) fn request_notify(
        &self,
        qp: &QpOf<D>,
        out: &mut [WorkCompletion],
        wake: WakeFor,
        look: PortLook,
    ) -> io::Result<Option<usize>> {
        // An event loop cannot lead: its own doorbell is the direct path even alone on the hub.
        if let Some(n) = self.arm_doorbell(qp, out, wake, false, look).map_err(from_verbs)? {
            return Ok(Some(n));
        }
        self.inbox.set_arrivals_only(false);
        self.inbox.arm();
        self.hub.ensure_notifier()?;
        // About to wait: answers the provider held for a reply from here go now.
        lightpath_verbs::CompletionQueue::consumer_idle(self.hub.cq());
        Ok(None)
    }
}

impl<D: Device> Drop for ConnCompletions<D> {
    fn drop(&mut self) {
        if let Some(qpn) = self.qpn {
            self.hub.detach(qpn);
        }
        self.hub.release(self.entries);
        self.device_connections.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
