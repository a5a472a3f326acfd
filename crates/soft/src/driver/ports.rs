//! Queue-pair ports: UDP sockets of their own for queue pairs whose waiters want to be woken
//! by the kernel directly.
//!
//! Why: with one socket per device, a datagram for a queue pair whose thread sleeps wakes
//! whoever watches the device socket (an application thread or the progress thread), which
//! runs the engine and then wakes the owner: two wake-ups per message, each several
//! microseconds on a virtual machine, and with many connections most of a server's CPU
//! (measured: 4 context switches and 6 eventfd calls per request over 16 connections, against
//! 1.7 context switches for kernel TCP). A queue pair with a port receives on a socket of its
//! own, bound to the device's address on a port the kernel picks; the stream negotiation
//! tells the peer that port (`QueuePair::own_udp_port`), and the peer addresses this queue
//! pair's datagrams to it (its address vector's `udp_dport`). The owner sleeps on the port
//! together with its doorbell eventfd, so the kernel wakes exactly that thread (or event
//! loop), which drives the engine itself ([`QueuePair::arm_waiter`]): one wake-up per
//! message, as kernel TCP has. Datagrams still leave through the device socket (the ICRC is
//! sealed for its port), and whatever arrives there for the queue pair (from a peer that did
//! not take the port) is handled as before, the doorbell rung by whoever drives it.
//!
//! Nobody may leave a port unread for long: the peer's requests and acknowledgements must be
//! answered even while the owner computes instead of waiting (a peer that gets no ACK retries
//! and finally gives up). The progress thread therefore looks at the ports too:
//! - *Active* (a port saw traffic within [`PORTS_ACTIVE_FOR`]): it does not sleep on them (its
//!   wake-up per datagram is what ports exist to avoid), but every [`PORT_TICK`] it asks
//!   epoll which ports are readable, and drains a port found readable on two ticks in a row
//!   with no drain in between (its owner is not reading it; counted in `port_rescues`).
//!   Answers an owner held back for its reply go out at the same tick if no post took them
//!   (`late_answers`).
//! - *Idle*: it sleeps on the ports' epoll too, and drains what wakes it (the first datagram
//!   after a quiet spell may so wake two threads), then turns active.
//! - *Fresh* ports, whose owner never armed them yet (a connection still negotiating: its
//!   probe arrives before anyone waits on the stream), it always sleeps on and drains at once:
//!   waiting for two ticks there cost every connection set-up a millisecond or two (1,000
//!   connections to an event-loop server were accepted 4x slower). A port leaves that set
//!   at its owner's first arming (one `epoll_ctl` per connection).
//!
//! [`QueuePair::arm_waiter`]: lightpath_verbs::QueuePair::arm_waiter

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lightpath_verbs::WakeFor;
use rustix::event::epoll;

use super::socket::RoceSocket;

/// How often an active progress thread looks for ports nobody reads.
pub(crate) const PORT_TICK: Duration = Duration::from_millis(1);

/// How long after the last datagram on any port the progress thread stays active.
pub(crate) const PORTS_ACTIVE_FOR: Duration = Duration::from_millis(100);

/// Ports one look of the progress thread reports at most.
const PORTS_PER_LOOK: usize = 256;

/// Send buffer of a port's socket: it never sends.
const PORT_SEND_BUFFER: usize = 4096;

const NOT_ARMED: u8 = 0;
const ARMED_ARRIVALS: u8 = 1;
const ARMED_ANYTHING: u8 = 2;

/// What wakes a port's waiter when a thread other than the waiter makes news for it.
#[derive(Clone)]
pub(crate) enum PortDoorbell {
    /// An eventfd (`QueuePair::set_waiter_fd`): a blocked thread or an event loop watches it.
    Fd(Arc<OwnedFd>),
    /// A call that wakes an event loop's task (`QueuePair::set_waiter_task`): no descriptor.
    Task(lightpath_verbs::TaskWake),
}

impl std::fmt::Debug for PortDoorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PortDoorbell::Fd(fd) => f.debug_tuple("Fd").field(fd).finish(),
            PortDoorbell::Task(_) => f.write_str("Task"),
        }
    }
}

impl PortDoorbell {
    fn ring(&self) {
        match self {
            // Fails only when the counter would overflow: a wake-up is pending anyway.
            PortDoorbell::Fd(fd) => {
                let _ = rustix::io::write(&**fd, &1u64.to_ne_bytes());
            }
            PortDoorbell::Task(wake) => wake(),
        }
    }
}

/// One queue pair's own receive socket and doorbell.
#[derive(Debug)]
pub(crate) struct QpPort {
    pub(crate) qpn: u32,
    pub(crate) socket: Arc<RoceSocket>,
    /// The waiter's doorbell, rung when another thread makes news for an armed waiter.
    doorbell: PortDoorbell,
    /// What the waiter armed for (`NOT_ARMED` once rung).
    armed: AtomicU8,
    /// Receive calls on the socket that returned datagrams, by anyone.
    drains: AtomicU32,
    /// The progress thread's mark: `drains + 1` when its last tick found the port readable, 0
    /// otherwise (only the progress thread writes it).
    tick_mark: AtomicU32,
    /// Someone is taking datagrams out of the socket and has not handed them all to the
    /// engine yet (see [`QpPort::start_receiving`]).
    receiving: AtomicBool,
    /// Its owner never armed it: it is in the device's set of fresh ports.
    fresh: AtomicBool,
    /// Whether this port's arming holds its queue pair's answers for the owner's reply
    /// (`NO_HOLD`, `HELD`, or `HELD_KEPT` once an empty arming kept them; see
    /// `Shared::owes_answers`).
    reply_hold: AtomicU8,
}

const NO_HOLD: u8 = 0;
const HELD: u8 = 1;
const HELD_KEPT: u8 = 2;

/// What [`QpPort::take_empty_arming`] says of an owner's arming that found nothing new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeldAnswers {
    /// Its arming holds nothing.
    None,
    /// Its arming held them and this is the first empty arming since: they may stay.
    MayKeep,
    /// They were kept through an empty arming already: they go now.
    Owed,
}

impl QpPort {
    /// A socket on the address of `device` (the device socket), set up as that one is, with
    /// receive offload exactly when it has it (the two share receive buffers). Fails when the
    /// kernel will not give one.
    pub(crate) fn open(
        qpn: u32,
        device: &RoceSocket,
        recv_buffer: usize,
        doorbell: PortDoorbell,
    ) -> io::Result<Self> {
        let local = SocketAddr::new(device.local().ip(), 0);
        let socket = RoceSocket::bind(local, recv_buffer, PORT_SEND_BUFFER, device.gro())?;
        if socket.gro() != device.gro() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "receive offload differs from the device socket's",
            ));
        }
        Ok(Self {
            qpn,
            socket: Arc::new(socket),
            doorbell,
            armed: AtomicU8::new(NOT_ARMED),
            drains: AtomicU32::new(0),
            tick_mark: AtomicU32::new(0),
            receiving: AtomicBool::new(false),
            fresh: AtomicBool::new(true),
            reply_hold: AtomicU8::new(NO_HOLD),
        })
    }

    /// The UDP port peers send this queue pair's datagrams to.
    pub(crate) fn udp_port(&self) -> u16 {
        self.socket.local().port()
    }

    /// Arms the doorbell for `wake` (with the engine locked, after the owner's own look).
    pub(crate) fn arm(&self, wake: WakeFor) {
        let value = match wake {
            WakeFor::Anything => ARMED_ANYTHING,
            WakeFor::Arrivals => ARMED_ARRIVALS,
        };
        self.armed.store(value, Ordering::SeqCst);
    }

    /// News for this queue pair made by a thread other than its arming owner: rings the
    /// doorbell if the waiter armed for it (once per arming); whether it rang.
    pub(crate) fn news(&self, arrival: bool) -> bool {
        let wanted = match self.armed.load(Ordering::SeqCst) {
            NOT_ARMED => false,
            ARMED_ARRIVALS => arrival,
            _ => true,
        };
        if wanted && self.armed.swap(NOT_ARMED, Ordering::SeqCst) != NOT_ARMED {
            self.doorbell.ring();
            return true;
        }
        false
    }

    /// Whether its waiter is an event loop's task ([`PortDoorbell::Task`]).
    pub(crate) fn wakes_task(&self) -> bool {
        matches!(self.doorbell, PortDoorbell::Task(_))
    }

    /// Takes the right to receive from the socket until [`QpPort::finish_receiving`]: the
    /// owner receives without the engine lock and hands the datagrams over once it holds it,
    /// so a drain by another thread meanwhile could hand newer datagrams to the engine first
    /// (a sequence error and a retransmission). False if someone else holds it.
    pub(crate) fn start_receiving(&self) -> bool {
        !self.receiving.swap(true, Ordering::Acquire)
    }

    /// Gives back what [`QpPort::start_receiving`] took (everything received was handed over).
    pub(crate) fn finish_receiving(&self) {
        self.receiving.store(false, Ordering::Release);
    }

    /// This port's arming held its queue pair's answers for the owner's reply.
    pub(crate) fn hold_for_reply(&self) {
        self.reply_hold.store(HELD, Ordering::Relaxed);
    }

    /// The hold is over (the owner posted, which takes the answers along, or they were sent).
    pub(crate) fn clear_reply_hold(&self) {
        if self.reply_hold.load(Ordering::Relaxed) != NO_HOLD {
            self.reply_hold.store(NO_HOLD, Ordering::Relaxed);
        }
    }

    /// An arming of the owner found nothing new: whether answers are held for it, and if so
    /// whether this is the first such arming (which may keep them, and is counted here).
    pub(crate) fn take_empty_arming(&self) -> HeldAnswers {
        match self.reply_hold.load(Ordering::Relaxed) {
            NO_HOLD => HeldAnswers::None,
            HELD => {
                self.reply_hold.store(HELD_KEPT, Ordering::Relaxed);
                HeldAnswers::MayKeep
            }
            _ => HeldAnswers::Owed,
        }
    }

    /// The owner arms for the first time: whether the port was fresh until now.
    pub(crate) fn leave_fresh(&self) -> bool {
        self.fresh.load(Ordering::Relaxed) && self.fresh.swap(false, Ordering::SeqCst)
    }

    /// Counts a receive call that returned datagrams.
    pub(crate) fn drained(&self) {
        self.drains.fetch_add(1, Ordering::Relaxed);
    }

    /// The progress thread's tick found the port readable: whether it was readable at the
    /// previous tick too with no drain since (nobody reads it: the caller drains it).
    pub(crate) fn unread_since_last_tick(&self) -> bool {
        let mark = self.drains.load(Ordering::Relaxed).wrapping_add(1);
        if self.tick_mark.load(Ordering::Relaxed) == mark {
            self.tick_mark.store(0, Ordering::Relaxed);
            return true;
        }
        self.tick_mark.store(mark, Ordering::Relaxed);
        false
    }
}

impl AsFd for QpPort {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// The epoll instance holding every port of a device, for the progress thread.
#[derive(Debug)]
pub(crate) struct PortSet {
    epoll: OwnedFd,
}

impl PortSet {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self { epoll: epoll::create(epoll::CreateFlags::CLOEXEC)? })
    }

    /// Watches `port`'s socket for readability (level-triggered).
    pub(crate) fn add(&self, port: &QpPort) -> io::Result<()> {
        epoll::add(
            &self.epoll,
            port.as_fd(),
            epoll::EventData::new_u64(u64::from(port.qpn)),
            epoll::EventFlags::IN,
        )?;
        Ok(())
    }

    /// Stops watching `port` (before its socket may close); whether it was watched.
    pub(crate) fn remove(&self, port: &QpPort) -> bool {
        // Fails only if it was never added; nothing to undo then.
        epoll::delete(&self.epoll, port.as_fd()).is_ok()
    }

    /// The queue pair numbers of the ports readable now, at most [`PORTS_PER_LOOK`] (the
    /// kernel rotates level-triggered entries, so the next look reaches the others), into
    /// `out`. Never waits.
    pub(crate) fn readable(&self, out: &mut Vec<u32>) {
        out.clear();
        let mut events = [std::mem::MaybeUninit::<epoll::Event>::uninit(); PORTS_PER_LOOK];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        if let Ok((ready, _)) = epoll::wait(&self.epoll, &mut events, Some(&zero)) {
            out.extend(ready.iter().map(|event| event.data.u64() as u32));
        }
    }
}

impl AsFd for PortSet {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}
