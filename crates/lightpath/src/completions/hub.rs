//! [`Hub`]: one completion queue shared by many connections of a device, and the router that
//! hands each completion to its connection's [`Inbox`].
//!
//! Routing is serialised by one lock (the *router*), so each connection sees its completions in
//! the order the queue produced them. Whoever needs progress routes: a connection polling for
//! its own completions routes everything it finds, for everybody. Blocked threads take turns
//! as the *leader*, the one thread asleep in the queue's own `wait` (where a provider does its
//! network work); the others sleep on their inbox's eventfd and are woken by the leader when a
//! completion of theirs arrives. When the leader leaves it wakes one sleeper to take its place,
//! so while anyone sleeps someone watches the queue. Event loops that arm their inbox are
//! served by the provider's completion hook where it has one (the soft provider calls it from
//! its progress thread: the completion is routed, and the event loop woken, by the thread
//! that made it), and otherwise by the hub's notifier thread (see `notifier`), one wake-up
//! further away.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use lightpath_verbs::{CompletionQueue, CqOf, Device, WcOpcode, WcStatus, WorkCompletion};

use super::inbox::Inbox;
use super::notifier::Notifier;

/// Completions taken from the queue per poll.
const BATCH: usize = 64;

/// How a look takes from the shared queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Take {
    /// `CompletionQueue::poll`: the provider may do its work first.
    Poll,
    /// `CompletionQueue::take_queued`: only what the queue holds, for the look right after an
    /// arming (`QueuePair::arm_waiter` moved the provider forward and left its completions in
    /// the queue).
    Queued,
}

/// One shared completion queue and the connections whose queue pairs use it.
pub(crate) struct Hub<D: Device> {
    cq: CqOf<D>,
    /// Entries of `cq`, and how many the attached connections may have outstanding together.
    capacity: u32,
    reserved: Mutex<u32>,
    routes: Mutex<HashMap<u32, Arc<Inbox>>>,
    /// Entries in `routes` (updated under its lock).
    attached: AtomicUsize,
    /// The routing lock, with the buffer polls fill.
    router: Mutex<Vec<WorkCompletion>>,
    /// A thread is asleep in the queue's `wait`.
    leader: AtomicBool,
    /// Inboxes whose owners went to sleep (some may have woken since), for the hand-off.
    sleepers: Mutex<VecDeque<Arc<Inbox>>>,
    /// Entries in `sleepers` (updated under its lock), so a leader leaving with nobody
    /// listed takes no lock.
    listed: AtomicUsize,
    notifier: OnceLock<Notifier>,
    /// The provider calls `on_completions` when the queue gains entries, so no notifier
    /// thread is needed (see `ensure_notifier`).
    hooked: AtomicBool,
    /// Serialises choosing between the hook and the notifier thread.
    notify_setup: Mutex<()>,
    /// The provider's hook found the router lock taken: its holder routes once more after
    /// letting go (see [`Routing`]).
    route_pending: AtomicBool,
    /// A doorbell waiter found the router lock held by the leader and went to sleep without
    /// routing: the leader routes once more on its way out (see `poll_for_locked`).
    route_wanted: AtomicBool,
    /// Completions for queue pairs no longer attached (dropped).
    strays: AtomicU32,
}

/// The router lock held: derefs to the poll buffer; when dropped it unlocks, then routes
/// what a completion hook could not while the lock was taken (see `Hub::on_completions`).
pub(crate) struct Routing<'a, D: Device> {
    hub: &'a Hub<D>,
    guard: Option<MutexGuard<'a, Vec<WorkCompletion>>>,
}

impl<D: Device> std::ops::Deref for Routing<'_, D> {
    type Target = Vec<WorkCompletion>;
    fn deref(&self) -> &Vec<WorkCompletion> {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<D: Device> std::ops::DerefMut for Routing<'_, D> {
    fn deref_mut(&mut self) -> &mut Vec<WorkCompletion> {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<D: Device> Drop for Routing<'_, D> {
    fn drop(&mut self) {
        drop(self.guard.take());
        // Only hooks raise the flag: without one, no fence on every poll. (A hook that fired
        // while `hooked` was being set is covered by the installer's own look right after.)
        if !self.hub.hooked.load(Ordering::Relaxed) {
            return;
        }
        // Pairs with the fence in `on_completions`: either the hook's `try_lock` found the
        // lock free, or this load sees its flag.
        fence(Ordering::SeqCst);
        if self.hub.route_pending.load(Ordering::Relaxed) {
            self.hub.on_completions();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every structure here stays consistent between statements: a panic elsewhere leaves
    // nothing half-done.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<D: Device> Hub<D> {
    /// A hub around `cq`, which holds `capacity` completions.
    pub(crate) fn new(cq: CqOf<D>, capacity: u32) -> Self {
        Self {
            cq,
            capacity,
            reserved: Mutex::new(0),
            routes: Mutex::new(HashMap::new()),
            attached: AtomicUsize::new(0),
            router: Mutex::new(vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); BATCH]),
            leader: AtomicBool::new(false),
            sleepers: Mutex::new(VecDeque::new()),
            listed: AtomicUsize::new(0),
            notifier: OnceLock::new(),
            hooked: AtomicBool::new(false),
            notify_setup: Mutex::new(()),
            route_pending: AtomicBool::new(false),
            route_wanted: AtomicBool::new(false),
            strays: AtomicU32::new(0),
        }
    }

    /// Takes the router lock.
    fn routing(&self) -> Routing<'_, D> {
        Routing { hub: self, guard: Some(lock(&self.router)) }
    }

    /// Takes the router lock if it is free.
    fn try_routing(&self) -> Option<Routing<'_, D>> {
        let guard = match self.router.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(Routing { hub: self, guard: Some(guard) })
    }

    /// The provider's completion hook: routes what the queue gained, waking the event loops
    /// it is for, from the provider's own thread. If another thread holds the router lock
    /// (it may be this one, deeper in the stack: a poll that made the provider work), the
    /// flag makes that holder route once more when it lets go, so nothing waits for a
    /// notifier.
    pub(super) fn on_completions(&self) {
        self.route_pending.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let Some(mut routing) = self.try_routing() else { return };
        self.route_pending.store(false, Ordering::Relaxed);
        let _ = self.drain(&mut routing);
        // Dropping `routing` routes again if a hook came meanwhile.
    }

    /// Completions the queue holds.
    pub(super) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// The shared queue (for `create_qp`).
    pub(crate) fn cq(&self) -> &CqOf<D> {
        &self.cq
    }

    /// Reserves room for `entries` more outstanding completions; false if the queue is full.
    pub(super) fn reserve(&self, entries: u32) -> bool {
        let mut reserved = lock(&self.reserved);
        if self.capacity - *reserved < entries {
            return false;
        }
        *reserved += entries;
        true
    }

    /// Gives back a reservation.
    pub(crate) fn release(&self, entries: u32) {
        let mut reserved = lock(&self.reserved);
        *reserved = reserved.saturating_sub(entries);
    }

    /// Routes completions of queue pair `qpn` to `inbox` from now on.
    pub(super) fn attach(&self, qpn: u32, inbox: Arc<Inbox>) {
        let mut routes = lock(&self.routes);
        routes.insert(qpn, inbox);
        self.attached.store(routes.len(), Ordering::Relaxed);
    }

    /// Stops routing for `qpn` (its queue pair is gone); later completions of it are dropped.
    pub(super) fn detach(&self, qpn: u32) {
        let mut routes = lock(&self.routes);
        routes.remove(&qpn);
        self.attached.store(routes.len(), Ordering::Relaxed);
    }

    /// How many connections use the queue.
    pub(super) fn attached(&self) -> usize {
        self.attached.load(Ordering::Relaxed)
    }

    /// Completions that arrived for queue pairs no longer attached.
    #[cfg(test)]
    pub(super) fn strays(&self) -> u32 {
        self.strays.load(Ordering::Relaxed)
    }

    /// Hands `wcs` to their inboxes and wakes the owners that wait. The caller holds the
    /// router lock.
    fn route(&self, wcs: &[WorkCompletion]) {
        if wcs.is_empty() {
            return;
        }
        let mut to_wake: Vec<Arc<Inbox>> = Vec::new();
        {
            let routes = lock(&self.routes);
            let mut rest = wcs;
            while let Some(first) = rest.first() {
                // Runs of one queue pair go in with one lock of its inbox.
                let run = rest.iter().take_while(|wc| wc.qp_num == first.qp_num).count();
                let (now, later) = rest.split_at(run);
                rest = later;
                match routes.get(&first.qp_num) {
                    Some(inbox) => {
                        if inbox.push(now) && !to_wake.iter().any(|i| Arc::ptr_eq(i, inbox)) {
                            to_wake.push(Arc::clone(inbox));
                        }
                    }
                    None => {
                        self.strays.fetch_add(run as u32, Ordering::Relaxed);
                    }
                }
            }
        }
        for inbox in to_wake {
            inbox.wake();
        }
    }

    /// Polls the queue empty and routes everything, with the router lock held.
    fn drain(&self, buf: &mut [WorkCompletion]) -> lightpath_verbs::Result<bool> {
        let mut any = false;
        loop {
            let n = self.cq.poll(buf)?;
            self.route(&buf[..n]);
            any |= n > 0;
            if n < buf.len() {
                return Ok(any);
            }
        }
    }

    /// Polls the queue for the connection of queue pair `qpn` (whose inbox is `inbox`): its
    /// own completions go straight into `out` while there is room (no inbox on the way, the
    /// common case of a connection polling for itself), everything else is routed. Returns 0
    /// at once if another thread is routing (it routes for all).
    ///
    /// Order: a thread that routed before this one took the router lock may have put some of
    /// this connection's completions into its inbox after the caller last found it empty.
    /// Those are older than anything the queue gives now, so they are taken first, under the
    /// lock; polling the queue past them would hand the connection a later completion before
    /// an earlier one (a record's arrival before the one ahead of it in the stream).
    pub(crate) fn poll_for(
        &self,
        inbox: &Inbox,
        qpn: u32,
        out: &mut [WorkCompletion],
    ) -> lightpath_verbs::Result<usize> {
        let Some(routing) = self.try_routing() else { return Ok(0) };
        self.poll_routing(routing, inbox, qpn, out, Take::Poll)
    }

    /// Like `poll_for`, but waits for the router lock if another thread routes: when it
    /// returns, everything the queue held when it was called is in `out` or routed, or will
    /// be routed by the leader (a thread about to sleep on its inbox's eventfd relies on that,
    /// see `ConnCompletions::wait`).
    ///
    /// The leader holds the lock for as long as it sleeps in the queue's wait (up to a
    /// liveness slice): a doorbell waiter does not wait for it. Every completion ends that
    /// sleep and the leader routes what it finds; and it routes once more after letting go
    /// should this have asked (`route_wanted`), so what the queue gained while it was on its
    /// way out is not left unrouted. Waiting for the lock instead made every doorbell waiter
    /// of a hub where other connections' threads lead (soft queue pairs with ports of their
    /// own beside ones without, once the device's ports ran out) sleep through the leader's
    /// whole wait: a thread-per-connection server with 12 connections and 2 ports per device
    /// answered 0.2k requests/s, against 19k once it no longer waited.
    ///
    /// It is the look right after an arming (`QueuePair::arm_waiter`), which moved the
    /// provider forward: the queue is taken as it is (`Take::Queued`), as by `poll_for_all`.
    pub(crate) fn poll_for_locked(
        &self,
        inbox: &Inbox,
        qpn: u32,
        out: &mut [WorkCompletion],
    ) -> lightpath_verbs::Result<usize> {
        if let Some(routing) = self.try_routing() {
            return self.poll_routing(routing, inbox, qpn, out, Take::Queued);
        }
        if self.leader.load(Ordering::SeqCst) {
            // What the leader routes here must wake the owner: a thread about to sleep is
            // counted asleep already, but an event loop's inbox is not armed (its queue pair's
            // doorbell serves it, see `ConnCompletions::arm_doorbell`), and completions made
            // before its arming ring no doorbell. Armed before the look below, so that what
            // the leader routed before is popped here and what it routes after wakes.
            inbox.arm();
            self.route_wanted.store(true, Ordering::SeqCst);
            // Either the leader's check after it stopped leading sees the request, or this
            // sees that nobody leads any more (and waits for the lock below).
            if self.leader.load(Ordering::SeqCst) {
                return Ok(inbox.pop(out));
            }
            // Taken below under the lock: a wake-up the arming causes meanwhile is spurious.
            inbox.disarm();
        }
        self.poll_for_all(inbox, qpn, out)
    }

    /// Like `poll_for_locked`, but waits for the router lock whoever holds it (a leader may
    /// hold it for its whole wait): when it returns, everything the queue held when it was
    /// called is in `out` or routed. For a look that must see everything now.
    pub(crate) fn poll_for_all(
        &self,
        inbox: &Inbox,
        qpn: u32,
        out: &mut [WorkCompletion],
    ) -> lightpath_verbs::Result<usize> {
        self.poll_routing(self.routing(), inbox, qpn, out, Take::Queued)
    }

    /// The leader stopped leading (its lock let go, `leader` cleared): routes what the queue
    /// holds if a doorbell waiter relied on it (see `poll_for_locked`).
    fn route_if_wanted(&self) {
        if !self.route_wanted.swap(false, Ordering::SeqCst) {
            return;
        }
        let mut routing = self.routing();
        let _ = self.drain(&mut routing);
    }

    fn poll_routing(
        &self,
        mut guard: Routing<'_, D>,
        inbox: &Inbox,
        qpn: u32,
        out: &mut [WorkCompletion],
        take: Take,
    ) -> lightpath_verbs::Result<usize> {
        // With the router lock held nobody else routes: what the inbox holds now is all that
        // was routed here, and older than what the queue gives next (see `poll_for`). The
        // queue is still drained below (its own completions after these in `out`, or behind
        // what is left in the inbox once `out` is full), as `poll_for_locked` promises.
        let buf: &mut Vec<WorkCompletion> = &mut guard;
        let mut taken = inbox.pop(out);
        loop {
            let n = match take {
                Take::Poll => self.cq.poll(buf)?,
                Take::Queued => self.cq.take_queued(buf)?,
            };
            taken = self.keep_own(qpn, out, taken, &mut buf[..n]);
            if n < buf.len() {
                return Ok(taken);
            }
        }
    }

    /// Of the completions `wcs` just taken from the queue (router lock held, and the caller's
    /// inbox emptied into `out` first, or `out` full), moves queue pair `qpn`'s into `out`
    /// after the `taken` already there, in order, while there is room (once one has gone to
    /// the inbox, all later ones must follow it there), and routes the rest. Returns the new
    /// count in `out`.
    fn keep_own(
        &self,
        qpn: u32,
        out: &mut [WorkCompletion],
        mut taken: usize,
        wcs: &mut [WorkCompletion],
    ) -> usize {
        let mut others = 0;
        for i in 0..wcs.len() {
            let wc = wcs[i];
            if wc.qp_num == qpn && taken < out.len() {
                out[taken] = wc;
                taken += 1;
            } else {
                wcs[others] = wc;
                others += 1;
            }
        }
        self.route(&wcs[..others]);
        taken
    }

    /// Routes whatever the queue has, waiting for the router lock if need be.
    pub(super) fn route_now(&self) -> lightpath_verbs::Result<bool> {
        self.drain(&mut self.routing())
    }

    /// Blocks until `inbox` has completions or `timeout` passes; moves them into `out`.
    pub(crate) fn wait(
        &self,
        inbox: &Arc<Inbox>,
        qpn: u32,
        out: &mut [WorkCompletion],
        timeout: Duration,
    ) -> lightpath_verbs::Result<usize> {
        let deadline = Instant::now() + timeout;
        let result = self.wait_inner(inbox, qpn, out, deadline);
        // Whoever leaves while others sleep and no one leads passes the watch on.
        if !self.leader.load(Ordering::SeqCst) {
            self.hand_off();
        }
        result
    }

    fn wait_inner(
        &self,
        inbox: &Arc<Inbox>,
        qpn: u32,
        out: &mut [WorkCompletion],
        deadline: Instant,
    ) -> lightpath_verbs::Result<usize> {
        loop {
            let n = inbox.pop(out);
            if n > 0 {
                return Ok(n);
            }
            let n = self.poll_for(inbox, qpn, out)?;
            if n > 0 {
                return Ok(n);
            }
            let n = inbox.pop(out);
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            if self.leader.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                let led = self.lead(inbox, qpn, out, deadline);
                self.leader.store(false, Ordering::SeqCst);
                self.route_if_wanted();
                return led;
            }
            self.follow(inbox, left);
        }
    }

    /// Sleeps on `inbox` (up to `left`) while another thread leads, listed so that the
    /// leader's hand-off wakes it when the leader goes.
    ///
    /// It sleeps only if, once it counts as asleep, a thread still leads *and* the inbox is
    /// still listed. The leader may have left since the exchange in `wait_inner`; and its
    /// hand-off may have taken this inbox off the list while it was not yet asleep (skipping
    /// it for one that was). Had it slept then under the next leader, unlisted, that leader's
    /// hand-off would not have known it, and with nobody left to lead, nobody would have
    /// watched the queue: every blocked connection on it slept until its wait's timeout (a
    /// 20 ms liveness slice for stream calls, none for the set-up probe). Not sleeping, it
    /// looks again and lists itself anew.
    fn follow(&self, inbox: &Arc<Inbox>, left: Duration) {
        self.list_sleeper(inbox);
        self.sleep_if_still_following(inbox, left);
    }

    /// The second half of `follow`, once `inbox` was listed.
    fn sleep_if_still_following(&self, inbox: &Inbox, left: Duration) {
        inbox.sleep_while(left, || inbox.listed.load(Ordering::SeqCst) && self.leader.load(Ordering::SeqCst));
    }

    /// The leader's turn: sleep in the queue's own `wait`, routing what arrives, until this
    /// connection has something or the deadline passes. Its own completions go straight into
    /// `out` (no inbox on the way: with one busy connection, the leader is the only waiter
    /// and the queue's wait is all there is between the peer and this thread).
    fn lead(
        &self,
        inbox: &Inbox,
        qpn: u32,
        out: &mut [WorkCompletion],
        deadline: Instant,
    ) -> lightpath_verbs::Result<usize> {
        let mut guard = self.routing();
        let buf: &mut Vec<WorkCompletion> = &mut guard;
        loop {
            // Whatever was routed here before this thread took the lock comes first; with
            // the lock held nobody else routes, so what the queue gives next is newer.
            let n = inbox.pop(out);
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            let n = self.cq.wait(buf, left)?;
            let taken = self.keep_own(qpn, out, 0, &mut buf[..n]);
            if taken > 0 {
                return Ok(taken);
            }
        }
    }

    fn list_sleeper(&self, inbox: &Arc<Inbox>) {
        if !inbox.listed.swap(true, Ordering::SeqCst) {
            let mut sleepers = lock(&self.sleepers);
            sleepers.push_back(Arc::clone(inbox));
            self.listed.store(sleepers.len(), Ordering::SeqCst);
        }
    }

    /// Wakes one listed sleeper (if any still sleeps) so that it takes the lead.
    fn hand_off(&self) {
        // Nobody listed (the common case of one busy connection): no lock. A sleeper that
        // lists itself after this look sees no leader and does not sleep.
        if self.listed.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut sleepers = lock(&self.sleepers);
        while let Some(inbox) = sleepers.pop_front() {
            // Unlisted before the look: an owner not yet asleep then sees this and does not
            // sleep (see `follow`); one asleep already is seen here and woken.
            inbox.listed.store(false, Ordering::SeqCst);
            if inbox.is_sleeping() {
                inbox.wake();
                break;
            }
        }
        self.listed.store(sleepers.len(), Ordering::SeqCst);
    }

    /// Starts the notifier thread (once), which routes for armed inboxes.
    pub(super) fn ensure_notifier(self: &Arc<Self>) -> std::io::Result<()>
    where
        D: 'static,
    {
        if self.notifier.get().is_some() || self.hooked.load(Ordering::Acquire) {
            return Ok(());
        }
        let _setup = lock(&self.notify_setup);
        if self.notifier.get().is_some() || self.hooked.load(Ordering::Acquire) {
            return Ok(());
        }
        // Where the provider calls a hook from its own threads, that is the notifier.
        let hub = Arc::downgrade(self);
        let hook: lightpath_verbs::CompletionHook = Arc::new(move || {
            if let Some(hub) = hub.upgrade() {
                hub.on_completions();
            }
        });
        if self.cq.set_completion_hook(hook).unwrap_or(false) {
            self.hooked.store(true, Ordering::Release);
            return Ok(());
        }
        let notifier = Notifier::start(self)?;
        let _ = self.notifier.set(notifier);
        Ok(())
    }
}

impl<D: Device> super::diagnostics::Describe for Hub<D>
where
    Hub<D>: Send + Sync,
{
    fn describe(&self, out: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(
            out,
            "hub capacity={} reserved={} attached={} leader={} listed={} notifier={} hooked={} route_pending={} strays={}",
            self.capacity,
            *lock(&self.reserved),
            self.attached(),
            self.leader.load(Ordering::SeqCst),
            self.listed.load(Ordering::SeqCst),
            self.notifier.get().is_some(),
            self.hooked.load(Ordering::SeqCst),
            self.route_pending.load(Ordering::SeqCst),
            self.strays.load(Ordering::Relaxed),
        );
        let mut routes: Vec<(u32, Arc<Inbox>)> =
            lock(&self.routes).iter().map(|(qpn, inbox)| (*qpn, Arc::clone(inbox))).collect();
        routes.sort_by_key(|(qpn, _)| *qpn);
        for (qpn, inbox) in routes {
            let _ = write!(out, "  qpn {qpn:#x}: ");
            inbox.describe(out);
            out.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lightpath_soft::{SoftConfig, SoftDevice};

    /// Far beyond any scheduling delay: a follower still asleep after half of it was left
    /// asleep.
    const PATIENCE: Duration = Duration::from_secs(20);

    fn hub() -> Arc<Hub<SoftDevice>> {
        let mut config = SoftConfig::with_addr("127.0.0.1:0".parse().unwrap());
        config.lock_memory = false;
        let device = SoftDevice::open(config).unwrap();
        let cq = device.create_cq(64).unwrap();
        Arc::new(Hub::new(cq, 64))
    }

    /// Another thread takes the lead.
    fn take_lead(hub: &Hub<SoftDevice>) {
        assert!(hub.leader.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_ok());
    }

    /// The leader leaves as `Hub::wait` has it leave.
    fn leave_lead(hub: &Hub<SoftDevice>) {
        hub.leader.store(false, Ordering::SeqCst);
        hub.hand_off();
    }

    /// Runs `step` (a follower's sleep) on a thread of its own, and once that thread sleeps
    /// (or gave up sleeping) lets the leader leave; returns how long the step took.
    fn follow_while_the_leader_leaves(
        hub: &Arc<Hub<SoftDevice>>,
        follower: &Arc<Inbox>,
        step: fn(&Hub<SoftDevice>, &Arc<Inbox>),
    ) -> Duration {
        let sleeper = {
            let (hub, follower) = (Arc::clone(hub), Arc::clone(follower));
            std::thread::spawn(move || {
                let started = Instant::now();
                step(&hub, &follower);
                started.elapsed()
            })
        };
        let reached = Instant::now();
        while !sleeper.is_finished() && !follower.is_sleeping() && reached.elapsed() < PATIENCE / 4 {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(50));
        leave_lead(hub);
        sleeper.join().unwrap()
    }

    /// The interleaving that stalled a queue: a follower lists itself; the leader leaves and
    /// its hand-off takes the follower off the list without waking it (it is not asleep yet);
    /// another thread takes the lead; the follower then goes to sleep. When that leader
    /// leaves in turn, its hand-off must reach the follower — or the follower must not have
    /// slept at all — since nobody else is left to watch the queue.
    #[test]
    fn a_follower_unlisted_before_it_sleeps_is_not_left_asleep() {
        let hub = hub();
        let follower = Arc::new(Inbox::new().unwrap());
        hub.list_sleeper(&follower);
        // The first leader leaves (its `leader` flag is already down).
        hub.hand_off();
        assert!(!follower.listed.load(Ordering::SeqCst), "the hand-off skipped the follower");
        // The next leader arrives before the follower sleeps.
        take_lead(&hub);
        let slept = follow_while_the_leader_leaves(&hub, &follower, |hub, follower| {
            hub.sleep_if_still_following(follower, PATIENCE)
        });
        assert!(slept < PATIENCE / 2, "the follower slept {slept:?} with nobody leading or waking it");
    }

    /// A doorbell waiter's last look before it sleeps (`poll_for_locked`) does not wait for
    /// the router lock while a leader holds it asleep in the queue's wait: it asks the leader
    /// to route once more on its way out, and the leader does. (Waiting made every doorbell
    /// waiter sleep through the leader's whole wait where connections of both kinds share a
    /// hub.)
    #[test]
    fn a_doorbell_waiter_does_not_wait_for_a_sleeping_leader() {
        let hub = hub();
        let leader_wait = Duration::from_secs(4);
        let leader = {
            let hub = Arc::clone(&hub);
            std::thread::spawn(move || {
                let inbox = Arc::new(Inbox::new().unwrap());
                let mut out = [WorkCompletion::new(
                    0,
                    lightpath_verbs::WcStatus::Success,
                    lightpath_verbs::WcOpcode::Send,
                    0,
                ); 4];
                hub.wait(&inbox, 1, &mut out, leader_wait).unwrap()
            })
        };
        let started = Instant::now();
        while hub.try_routing().is_some() || !hub.leader.load(Ordering::SeqCst) {
            assert!(started.elapsed() < PATIENCE, "the leader never took the lead");
            std::thread::yield_now();
        }
        let waiter = Inbox::new().unwrap();
        let mut out =
            [WorkCompletion::new(0, lightpath_verbs::WcStatus::Success, lightpath_verbs::WcOpcode::Send, 0);
                4];
        let looked = Instant::now();
        assert_eq!(hub.poll_for_locked(&waiter, 2, &mut out).unwrap(), 0);
        let took = looked.elapsed();
        assert!(took < leader_wait / 2, "the look waited {took:?} for the sleeping leader");
        assert!(hub.route_wanted.load(Ordering::SeqCst), "the leader was not asked to route");
        // An event loop's inbox is not armed when it looks (its doorbell serves it): what the
        // leader routes to it now must wake it all the same.
        let routed =
            WorkCompletion::new(7, lightpath_verbs::WcStatus::Success, lightpath_verbs::WcOpcode::Send, 0);
        assert!(waiter.push(&[routed]), "a completion the leader routes to the waiter would not wake it");
        assert_eq!(leader.join().unwrap(), 0);
        assert!(!hub.route_wanted.load(Ordering::SeqCst), "the leader left without routing");
    }

    /// The ordinary case: a listed follower asleep under a leader is woken by the leader's
    /// hand-off.
    #[test]
    fn a_listed_follower_is_woken_by_the_hand_off() {
        let hub = hub();
        let follower = Arc::new(Inbox::new().unwrap());
        take_lead(&hub);
        let slept = follow_while_the_leader_leaves(&hub, &follower, |hub, follower| {
            hub.follow(follower, PATIENCE);
            assert!(!follower.listed.load(Ordering::SeqCst), "the woken follower is still listed");
        });
        assert!(slept >= Duration::from_millis(50), "the follower did not sleep under a leader ({slept:?})");
        assert!(slept < PATIENCE / 2, "the hand-off did not wake the follower ({slept:?})");
    }
}
