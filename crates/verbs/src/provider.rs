//! The provider traits: one verbs API, many implementations.
//!
//! Everything above the transport (the stream layer, collectives, the LD_PRELOAD library, tools)
//! is written against these traits; each provider implements them: the soft provider (the
//! RoCE v2 engine over UDP sockets), the ibverbs provider (rdma-core's libibverbs loaded at run
//! time) and the shm provider (shared memory between processes). A single suite of conformance
//! tests ([`crate::conformance`]) is run against every provider, as rustls runs one test suite
//! against each of its crypto providers.
//!
//! # Design choices
//!
//! **Static dispatch.** Each trait names the concrete object types of its provider through
//! associated types ([`Device::Pd`], [`ProtectionDomain::Qp`], …), so code generic over a
//! [`Device`] is monomorphised per provider: `post_send`, `post_recv` and `poll` are plain
//! direct calls that the compiler can inline, with no vtable on the hot path. Code that wants to
//! pick a provider at run time wraps the generic code in its own enum or `dyn` layer *above* the
//! hot loop. The aliases [`PdOf`], [`CqOf`], [`MrOf`] and [`QpOf`] keep generic signatures short.
//!
//! **Shared objects, `&self` everywhere.** Verbs objects are shared between threads (one thread
//! posts, another polls, a third waits on the completion fd), so every method takes `&self` and
//! every object is `Send + Sync`; providers use interior mutability (a lock around a software
//! engine, or the C library's own locking).
//!
//! **Teardown by ownership.** A provider object keeps alive everything it depends on: a queue
//! pair holds its protection domain and both completion queues, a memory region its protection
//! domain, and all of them the device. Dropping is destroying, and it is safe in any order: a
//! completion queue dropped by the application while a queue pair still uses it is only
//! released when that queue pair goes. Nothing can be used after it is freed, and there is no
//! `destroy` that can fail with `Busy` at a bad moment.
//!
//! **Memory is owned by the library.** [`ProtectionDomain::alloc_mr`] returns a region the
//! provider allocated and pinned itself (page aligned, registered with the device). Its bytes
//! are reached through copying accessors ([`MemoryRegion::read`], [`MemoryRegion::write`]), never
//! through a long-lived `&[u8]`: a remote peer may write into the region at any time, as a NIC
//! does by DMA, so handing out a Rust reference to those bytes would let safe code observe a data
//! race. The completion that reports an incoming SEND, WRITE with immediate or READ response is
//! the application's signal that the bytes it names have arrived. Providers may add scoped,
//! lock-protected slice access of their own (the soft provider does). Registering memory the
//! application already owns is offered only where the provider can pin it safely: the buffer
//! is moved into the region ([`ProtectionDomain::reg_vec`]), so it cannot be freed or resized
//! while the device may still touch it.
//!
//! **Completion readiness as a file descriptor.** [`CompletionQueue::notify_fd`] exposes a file
//! descriptor that epoll/poll/tokio's `AsyncFd` can wait on, armed and acknowledged like a
//! libibverbs completion channel: `request_notify`, poll the queue empty, wait for the fd, then
//! `take_notify` and poll again. [`CompletionQueue::wait`] packages that loop with a timeout for
//! blocking callers.
//!
//! **Waiting for one queue pair** (extensions a provider may offer; the defaults decline): a
//! thread gives the queue pair an eventfd of its own ([`QueuePair::set_waiter_fd`]); an event
//! loop's task gives it a wake-up call instead ([`QueuePair::set_waiter_task`]), and a peer
//! process then rings the device's [`TaskDoorbell`], one descriptor for all the device's queue
//! pairs. Either is armed for one wait with [`QueuePair::arm_waiter`].
//!
//! **Errors.** A verbs call that is refused returns [`crate::Error`] and changes nothing; a work
//! request that was accepted always ends in exactly one [`crate::WorkCompletion`] if it was
//! signaled or failed (errors complete even unsignaled requests), whose
//! [`crate::WcStatus`] says how it ended.

use std::os::fd::RawFd;
use std::time::Duration;

use crate::{
    AccessFlags, DeviceAttr, Error, Gid, PortAttr, QpAttr, QpCaps, QpEndpoint, QpState, RecvWr, RemoteRegion,
    Result, SendWr, Sge, WorkCompletion,
};

/// A family of devices (one per provider): lists them and opens one by name.
pub trait Provider: Send + Sync {
    /// The device type this provider opens.
    type Device: Device;

    /// A short name for the provider ("soft", "ibverbs", "shm").
    fn name(&self) -> &'static str;

    /// Names of the devices that [`Provider::open`] accepts right now.
    fn devices(&self) -> Result<Vec<String>>;

    /// Opens the device called `name`.
    fn open(&self, name: &str) -> Result<Self::Device>;
}

/// An open RDMA device: the root of every other object.
pub trait Device: Send + Sync + Sized {
    /// The protection domain type; its completion queues are this device's.
    type Pd: ProtectionDomain<Cq = Self::Cq>;
    /// The completion queue type.
    type Cq: CompletionQueue;

    /// The device name (as `ibv_devices` would print it, or the provider's equivalent).
    fn name(&self) -> &str;

    /// Device-wide limits.
    fn query(&self) -> Result<DeviceAttr>;

    /// State and MTU of port `port_num` (1-based); unknown ports are refused.
    fn query_port(&self, port_num: u8) -> Result<PortAttr>;

    /// The GID table of port `port_num`: entry `i` is GID index `i` (unset entries are
    /// [`Gid::ZERO`]).
    fn gids(&self, port_num: u8) -> Result<Vec<Gid>>;

    /// Allocates a protection domain.
    fn alloc_pd(&self) -> Result<Self::Pd>;

    /// Creates a completion queue with room for at least `min_entries` completions (the
    /// provider may round up; [`CompletionQueue::capacity`] says how many).
    fn create_cq(&self, min_entries: u32) -> Result<Self::Cq>;
}

/// A protection domain: memory regions and the queue pairs that may use them.
pub trait ProtectionDomain: Send + Sync {
    /// The memory region type.
    type Mr: MemoryRegion;
    /// The completion queue type (the device's).
    type Cq: CompletionQueue;
    /// The queue pair type.
    type Qp: QueuePair;

    /// Allocates and registers a zero-filled, provider-owned region of `len` bytes with the
    /// given access. Access combinations verbs forbids (remote write or remote atomic without
    /// local write, see [`AccessFlags::is_valid_for_mr`]) are refused with
    /// [`Error::InvalidAttribute`].
    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Self::Mr>;

    /// Registers memory the application owns by moving it into a region, where the provider can
    /// pin it safely. The default refuses with [`Error::Unsupported`].
    fn reg_vec(&self, memory: Vec<u8>, access: AccessFlags) -> Result<Self::Mr> {
        let _ = (memory, access);
        Err(Error::Unsupported("registering application memory"))
    }

    /// Creates a reliable-connected queue pair in state RESET whose send and receive
    /// completions go to `send_cq` and `recv_cq` (which may be the same queue).
    fn create_qp(&self, send_cq: &Self::Cq, recv_cq: &Self::Cq, caps: QpCaps) -> Result<Self::Qp>;
}

/// A registered memory region.
///
/// Addresses are the provider's virtual addresses for the region: an [`Sge`] or a remote
/// access names bytes by `addr() + offset`.
pub trait MemoryRegion: Send + Sync {
    /// Virtual address of the first byte.
    fn addr(&self) -> u64;

    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the region has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The local key (for scatter/gather entries).
    fn lkey(&self) -> u32;

    /// The remote key (for a peer's RDMA operations).
    fn rkey(&self) -> u32;

    /// The access this region grants.
    fn access(&self) -> AccessFlags;

    /// Copies `dst.len()` bytes starting at `offset` out of the region. Refused with
    /// [`Error::InvalidAttribute`] if the range is not inside the region.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// [`MemoryRegion::read`] into memory not yet initialised (the spare capacity of a
    /// caller's buffer, which would otherwise be zeroed first only to be overwritten); returns
    /// `dst`, now initialised. Every provider of this workspace overrides it with one copy; this
    /// default (for others) reads into a temporary buffer first, an allocation per call.
    fn read_uninit<'a>(
        &self,
        offset: usize,
        dst: &'a mut [std::mem::MaybeUninit<u8>],
    ) -> Result<&'a mut [u8]> {
        let mut bytes = vec![0u8; dst.len()];
        self.read(offset, &mut bytes)?;
        Ok(dst.write_copy_of_slice(&bytes))
    }

    /// Copies `src` into the region at `offset`. Refused with [`Error::InvalidAttribute`] if
    /// the range is not inside the region.
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;

    /// Reads the host-order `u64` at `offset` (as atomics leave it).
    fn read_u64(&self, offset: usize) -> Result<u64> {
        let mut bytes = [0u8; 8];
        self.read(offset, &mut bytes)?;
        Ok(u64::from_ne_bytes(bytes))
    }

    /// Writes a host-order `u64` at `offset` (as atomics expect it).
    fn write_u64(&self, offset: usize, value: u64) -> Result<()> {
        self.write(offset, &value.to_ne_bytes())
    }

    /// A scatter/gather entry for `len` bytes at `offset`. Not checked against the region's
    /// bounds: the provider checks when the request is executed, as hardware does.
    fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge { addr: self.addr().wrapping_add(offset as u64), length: len, lkey: self.lkey() }
    }

    /// The region as a peer addresses it (address, length, rkey).
    fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr(), len: self.len() as u64, rkey: self.rkey() }
    }

    /// Lets only the first peer queue pair that reaches this region remotely keep doing so,
    /// much as a memory window bound to a queue pair: a provider that learns about a peer's
    /// access by a question (shm) answers the first and refuses every later one, and drops
    /// what it kept only to share the region (shm: the region's memfd) once that peer has it.
    /// For a region meant for one connection's peer, such as a stream's receive ring, so that
    /// an idle connection costs no descriptor for it. Returns whether the provider does
    /// anything; the default does nothing and returns false (RDMA hardware and soft check each
    /// access against the rkey alone and keep nothing per region to share).
    fn share_with_first_peer_only(&self) -> bool {
        false
    }
}

/// A function a provider calls when a completion queue gains entries (see
/// [`CompletionQueue::set_completion_hook`]).
pub type CompletionHook = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Wakes the task (of an event loop) that waits for one queue pair (see
/// [`QueuePair::set_waiter_task`]). Called by whichever thread learns of the news, possibly
/// with the provider's locks held: it must be quick, must not block, and must not call into
/// the provider.
pub type TaskWake = std::sync::Arc<dyn Fn() + Send + Sync>;

/// A device's doorbell for tasks (see [`QueuePair::set_waiter_task`]): one descriptor per
/// device, however many queue pairs' tasks it serves, where a doorbell of each queue pair's
/// own costs a descriptor per queue pair (two, with the peer's copy).
pub trait TaskDoorbell: Send + Sync + std::fmt::Debug {
    /// Readable when a peer rang for one of the device's waiting tasks (an eventfd: watch it
    /// for readability, edge- or level-triggered).
    fn fd(&self) -> std::os::fd::BorrowedFd<'_>;
    /// Calls the [`TaskWake`] of every queue pair rung for since the last dispatch. Never
    /// blocks; a call that finds nothing does nothing. Call it after each wake-up of
    /// [`TaskDoorbell::fd`] (after clearing the readiness an edge-triggered watcher saw, or
    /// [`TaskDoorbell::take_rings`] for a level-triggered one: a ring after that is either
    /// handled by this call or makes the fd ready again).
    fn dispatch(&self);
    /// Consumes the rings so far (reads the eventfd), for a watcher that waits level-triggered
    /// (`poll`), before [`TaskDoorbell::dispatch`]; whether there were any. An edge-triggered
    /// watcher (epoll with `EPOLLET`, tokio) need not: every ring is an edge of its own.
    fn take_rings(&self) -> bool;
    /// How many queue pairs' tasks the doorbell wakes now (their waiters set with
    /// [`QueuePair::set_waiter_task`]). The default says none.
    fn tasks(&self) -> usize {
        0
    }
    /// For a watcher that keeps looking for a while instead of waiting (an event loop's
    /// dispatcher spinning after a wake-up): says a ring is pending, so peers set their task
    /// bits without ringing the doorbell (each ring costs the peer a system call and this side
    /// a wake-up). The watcher then looks with [`TaskDoorbell::dispatch_held`], and ends with
    /// [`TaskDoorbell::dispatch`], which re-arms the ring and takes what came meanwhile,
    /// before it waits on [`TaskDoorbell::fd`] again. The default does nothing.
    fn hold_rings(&self) {}
    /// [`TaskDoorbell::dispatch`] without re-arming the ring (see
    /// [`TaskDoorbell::hold_rings`]); whether any queue pair was rung for. The default
    /// dispatches and says none (spinning then finds nothing and stops).
    fn dispatch_held(&self) -> bool {
        self.dispatch();
        false
    }
}

/// A device's look at news waiting for its event-loop tasks (see [`QueuePair::task_spin`]),
/// for an event loop that keeps its runtime awake for a while after one of them went to
/// wait, instead of parking it in `epoll_wait` and being woken by the kernel for the answer.
///
/// Where a provider's news reaches each task through a descriptor of the queue pair's own
/// (soft: datagrams in the queue pair's UDP port, which the event loop watches anyway), one
/// look at all of them at once costs less than a turn of the runtime's reactor, and needs no
/// doorbell: the spin only hurries wake-ups that the descriptors would bring anyway.
pub trait TaskSpin: Send + Sync + std::fmt::Debug {
    /// Takes in what waits for the device's tasks, wakes ([`TaskWake`]) those it completed
    /// work for (or that must look themselves), and says whether it woke any. Never blocks.
    fn look(&self) -> bool;
    /// How many queue pairs' tasks the look serves now.
    fn tasks(&self) -> usize;
}

/// A completion queue.
pub trait CompletionQueue: Send + Sync {
    /// How many completions the queue holds.
    fn capacity(&self) -> u32;

    /// Moves up to `out.len()` completions into `out`, oldest first, and returns how many.
    /// Never blocks. Providers without a progress thread do their network work here.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize>;

    /// Moves up to `out.len()` completions already in the queue into `out`, oldest first,
    /// without the work [`CompletionQueue::poll`] may do to make more: for a caller that has
    /// just moved the provider forward itself, as the look right after
    /// [`QueuePair::arm_waiter`] (whose completions are in the queue when it returns). Never
    /// blocks. The default is `poll`, for providers whose `poll` does no more than that.
    fn take_queued(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.poll(out)
    }

    /// Like [`CompletionQueue::poll`] but blocks until at least one completion is available or
    /// `timeout` has passed; returns 0 on timeout.
    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize>;

    /// A file descriptor that becomes readable after [`CompletionQueue::request_notify`] once a
    /// completion is added, for epoll/poll/`AsyncFd`; `None` if the provider has none.
    ///
    /// Protocol (as with a libibverbs completion channel): call `request_notify`, then `poll`
    /// until it returns 0 (to catch completions that raced the request), then wait for the fd;
    /// when it is readable call `take_notify`, poll, and repeat.
    fn notify_fd(&self) -> Option<RawFd>;

    /// Arms the queue: the next completion added makes `notify_fd` readable (once).
    fn request_notify(&self) -> Result<()>;

    /// Consumes a pending notification without blocking; returns whether one was pending.
    fn take_notify(&self) -> Result<bool>;

    /// Asks the provider to call `hook` whenever the queue gains entries, from the thread
    /// that added them (a progress thread, or one posting or polling) once it holds none of
    /// the provider's locks, so `hook` may poll this queue. Calls may be spurious, come from
    /// several threads at once, and a burst of completions may make one call; none is missed
    /// after a completion is added. Returns whether the provider will (`false`, the default:
    /// watch [`CompletionQueue::notify_fd`] instead). What an event loop's completion router
    /// uses where the provider has threads of its own, so that no thread of the router's has
    /// to sleep on the notification fd and pass each completion on (one wake-up more).
    fn set_completion_hook(&self, hook: CompletionHook) -> Result<bool> {
        let _ = hook;
        Ok(false)
    }

    /// Says that a consumer of this queue has handled what it had and is about to wait (an
    /// event loop arming its readiness). A provider that holds back its answers (ACKs) to
    /// what arrived, so that the consumer's reply carries them, sends them now: no reply is
    /// coming before the next arrival. The default does nothing.
    fn consumer_idle(&self) {}
}

/// A reliable-connected queue pair.
/// What a thread waiting for one queue pair ([`QueuePair::arm_waiter`]) wants to be woken for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeFor {
    /// Any news: also the acknowledgement of its own requests and freed room to send (a
    /// writer, or anyone waiting for a send completion).
    Anything,
    /// What the peer sends (a receive completion, a READ's data) or an error; not the
    /// acknowledgements of its own requests (a reader: on a request/response connection the
    /// request's acknowledgement would otherwise wake it once more than the response).
    Arrivals,
}

pub trait QueuePair: Send + Sync {
    /// The queue pair number.
    fn qpn(&self) -> u32;

    /// What the peer needs to address this queue pair (the GID it sends from and its number).
    fn endpoint(&self) -> QpEndpoint;

    /// The sizes the provider actually granted (they may exceed the requested ones).
    fn caps(&self) -> QpCaps;

    /// The current state.
    fn state(&self) -> Result<QpState>;

    /// Applies `attr` (a state transition and its attributes). Transitions verbs does not
    /// allow, missing or out-of-range attributes are refused without changing anything.
    fn modify(&self, attr: &QpAttr) -> Result<()>;

    /// Posts a send work request. Refused with [`Error::InvalidState`] before RTS, with
    /// [`Error::QueueFull`] when `max_send_wr` requests are outstanding, and with
    /// [`Error::TooLarge`] for too many scatter/gather entries or oversized inline data. Local
    /// key problems are reported by the completion, not here.
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()>;

    /// Copies `bytes` from the caller's memory straight into the peer's memory at
    /// `remote_addr` (region `rkey`), now, if the provider reaches the peer's memory itself (the
    /// shm provider maps its peers' regions): an RDMA WRITE without a local region, a send
    /// queue entry or a completion, and with one copy instead of two. `None` when the provider
    /// cannot (the default; then post a WRITE), `Some(Err)` when the write is refused (not in
    /// RTS, an rkey, bound or access an RDMA WRITE would fail on, the peer gone), in which case
    /// nothing was written.
    ///
    /// Ordering: the bytes are in place before the call returns, so a request posted
    /// afterwards (a WRITE WITH IMMEDIATE announcing them) reaches the peer after them; they
    /// are *not* ordered after requests posted earlier that the provider has not carried out
    /// yet. Use it for memory that no outstanding request targets.
    ///
    /// A provider answers `None` to every call or to none, so a call with no bytes tells
    /// whether it can.
    fn write_direct(&self, remote_addr: u64, rkey: u32, bytes: &[u8]) -> Option<Result<()>> {
        let _ = (remote_addr, rkey, bytes);
        None
    }

    /// Gives the queue pair a doorbell of its own, `fd` (an eventfd, shared with the caller:
    /// the provider keeps a reference, not a duplicate, so no descriptor is added), for a
    /// thread or event loop that waits for this queue pair alone: once armed with [`QueuePair::arm_waiter`], news for this queue pair
    /// (a peer's request, data or acknowledgement) makes `fd` readable directly, with no
    /// progress thread, completion router or notifier in between; so does a completion of
    /// this queue pair that another thread makes. Call it before RTR.
    /// Returns whether the provider uses it; `false` (the default) means waiters keep using the
    /// completion queue's `wait` and notification fd.
    fn set_waiter_fd(&self, fd: &std::sync::Arc<std::os::fd::OwnedFd>) -> Result<bool> {
        let _ = fd;
        Ok(false)
    }

    /// Like [`QueuePair::set_waiter_fd`], for an event loop's task rather than a thread: news
    /// for this queue pair after an arming ([`QueuePair::arm_waiter`], the same protocol)
    /// calls `wake` instead of writing an eventfd, so the queue pair needs no descriptor of its
    /// own for it. News this process's threads make calls `wake` directly; news a peer process
    /// makes (shm) rings the device's [`TaskDoorbell`] ([`QueuePair::task_doorbell`]), whose
    /// `dispatch` calls it: whoever waits for queue pairs this way must see that the doorbell
    /// is watched and dispatched (a thread blocked on such a queue pair may watch it itself).
    /// News that arrives on the queue pair's own descriptor ([`QueuePair::waiter_poll_fd`])
    /// is seen there, as with `set_waiter_fd`. Call it before RTR. Returns whether the
    /// provider took it; `false` (the default): use `set_waiter_fd`.
    fn set_waiter_task(&self, wake: TaskWake) -> Result<bool> {
        let _ = wake;
        Ok(false)
    }

    /// The device's [`TaskDoorbell`] that a peer rings for this queue pair's task (see
    /// [`QueuePair::set_waiter_task`]), if the provider has one (shm); `None` (the default)
    /// when news only ever comes from this process's threads or the queue pair's own
    /// descriptor (soft).
    fn task_doorbell(&self) -> Option<std::sync::Arc<dyn TaskDoorbell>> {
        None
    }

    /// The device's [`TaskSpin`] for this queue pair's task (see
    /// [`QueuePair::set_waiter_task`]), if the provider has one (soft); `None` (the default)
    /// otherwise.
    fn task_spin(&self) -> Option<std::sync::Arc<dyn TaskSpin>> {
        None
    }

    /// Arms the doorbell given to [`QueuePair::set_waiter_fd`] for one wait, for the news `wake`
    /// says, and moves the
    /// queue pair forward: completions for whatever arrived before the call are in the
    /// completion queue when it returns, and anything later makes the fd readable (once per
    /// call; a spurious wake-up is possible, a lost one is not). The caller then polls its
    /// completion queue once more and sleeps on the fd if that found nothing. With a
    /// descriptor of its own ([`QueuePair::waiter_poll_fd`]), everything that reached it before
    /// the call is taken in, or, where the look could not take it all (another thread was
    /// receiving from it, a burst longer than one look takes), the doorbell is rung at once.
    /// `Ok(false)` when the queue pair has no such doorbell (the default).
    fn arm_waiter(&self, wake: WakeFor) -> Result<bool> {
        let _ = wake;
        Ok(false)
    }

    /// [`QueuePair::arm_waiter`] without the look at the queue pair's own descriptor
    /// ([`QueuePair::waiter_poll_fd`]): for a caller that watches that descriptor itself and
    /// knows it got nothing since its last arming took it in, or that sleeps on it
    /// level-triggered right after (what waits in it then ends the sleep at once, and the
    /// next arming takes it in). Everything else an arming does still happens (the doorbell
    /// is armed, answers owed go out), and completions already made are in the completion
    /// queue. Saves the look's system call where it would find nothing: with a thread per
    /// connection that waits and then takes in, the look before the sleep was one system call
    /// in five per message. The default is `arm_waiter` (providers without such a
    /// descriptor have nothing to skip).
    fn arm_waiter_without_look(&self, wake: WakeFor) -> Result<bool> {
        self.arm_waiter(wake)
    }

    /// A second descriptor a waiter on this queue pair's doorbell must sleep on besides the
    /// doorbell fd (and an event loop watch with it): readable when news for this queue pair
    /// waits that only a look ([`QueuePair::arm_waiter`]) turns into completions. The soft
    /// provider's queue pairs towards Lightpath peers receive on a UDP socket of their own, so
    /// the kernel wakes exactly the thread that waits for them, with nobody in between. Shared,
    /// not duplicated: it stays open while any holder keeps it. `None` (the default): the
    /// doorbell fd alone.
    fn waiter_poll_fd(&self) -> Option<std::sync::Arc<dyn std::os::fd::AsFd + Send + Sync>> {
        None
    }

    /// The UDP port a peer should address this queue pair's datagrams to (its
    /// `AddressVector::udp_dport`), when the queue pair receives on a port of its own (see
    /// [`QueuePair::waiter_poll_fd`]); `None` (the default): the device's port.
    fn own_udp_port(&self) -> Option<u16> {
        None
    }

    /// Posts a receive work request. Refused with [`Error::InvalidState`] in RESET and with
    /// [`Error::QueueFull`] when `max_recv_wr` receives are posted.
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()>;

    /// Posts several send requests in order, stopping at the first refusal (which reports how
    /// many were posted before it, like `ibv_post_send`'s `bad_wr`). Providers override this to
    /// post a whole batch under one lock with one doorbell; the default posts one at a time.
    fn post_send_batch(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), BatchError> {
        for (posted, wr) in wrs.iter().enumerate() {
            self.post_send(wr).map_err(|error| BatchError { posted, error })?;
        }
        Ok(())
    }

    /// Posts several receive requests in order, stopping at the first refusal.
    fn post_recv_batch(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), BatchError> {
        for (posted, wr) in wrs.iter().enumerate() {
            self.post_recv(wr).map_err(|error| BatchError { posted, error })?;
        }
        Ok(())
    }
}

/// A batch post stopped at a refused request: the first `posted` requests were accepted (and
/// will complete as usual), the one at index `posted` was refused with `error`, and the rest
/// were not looked at.
#[derive(Debug)]
pub struct BatchError {
    /// Requests accepted before the refusal.
    pub posted: usize,
    /// Why request number `posted` was refused.
    pub error: Error,
}

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "work request {} of the batch refused: {}", self.posted, self.error)
    }
}

impl std::error::Error for BatchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The protection domain type of device `D`.
pub type PdOf<D> = <D as Device>::Pd;
/// The completion queue type of device `D`.
pub type CqOf<D> = <D as Device>::Cq;
/// The memory region type of device `D`.
pub type MrOf<D> = <<D as Device>::Pd as ProtectionDomain>::Mr;
/// The queue pair type of device `D`.
pub type QpOf<D> = <<D as Device>::Pd as ProtectionDomain>::Qp;
