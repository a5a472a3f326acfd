//! The device's helper thread: the progress thread in [`ProgressMode::Thread`], or the idle
//! assistant in [`ProgressMode::Polling`].

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::ports::PORT_TICK;
use super::{Shared, ANSWER_HOLD, AWAKE};
use crate::config::ProgressMode;
use crate::sys::{self, RECV_BATCH};

pub(super) fn spawn(shared: Arc<Shared>) -> io::Result<JoinHandle<()>> {
    let name = format!("lp-{}", shared.name);
    std::thread::Builder::new().name(name).spawn(move || match shared.config.mode {
        ProgressMode::Thread => run_progress(&shared),
        ProgressMode::Polling { assist_after, .. } => run_assist(&shared, assist_after),
    })
}

/// Drives the device whenever the socket has datagrams, a timer is due, or a posting thread
/// moved the next timer earlier.
fn run_progress(shared: &Shared) {
    let mut ready = u8::MAX;
    // When the ports were last looked at (nanoseconds since the epoch; see `ports`).
    let mut ports_looked_at = 0u64;
    let tick = PORT_TICK.as_nanos() as u64;
    while !shared.stop.load(Ordering::SeqCst) {
        // Woken only by the hand-over timer while a watcher came back (or the delay has not
        // passed since the last one left): nothing to drive.
        let idle = ready == HANDOVER_ONLY && !shared.handover_due();
        let (received, timeout, active) = {
            let mut core = shared.lock();
            let holds = shared.answers_held.load(Ordering::Relaxed) || core.engine.has_held_answers();
            let (mut received, held) =
                if idle && !holds { (0, false) } else { shared.drive_for_progress(&mut core) };
            // Ports: drain what woke an idle thread; while active, every tick, what nobody read
            // since the last tick.
            let active = shared.ports_active();
            if ready & FRESH != 0 {
                received += shared.drain_fresh_ports(&mut core);
            }
            if ready & PORTS != 0 {
                received += shared.drain_unread_ports(&mut core, true);
                ports_looked_at = shared.now().as_nanos();
            } else if active && shared.now().as_nanos().saturating_sub(ports_looked_at) >= tick {
                received += shared.drain_unread_ports(&mut core, false);
                ports_looked_at = shared.now().as_nanos();
            }
            let active = active || shared.ports_active();
            // Never asleep for longer than a tick: a posting thread then wakes this one only
            // for a timer due sooner (retransmission timers are hundreds of ms away; waking
            // this thread on every idle-to-busy turn of a connection cost a context switch).
            let cap = match (held, active) {
                (true, _) => ANSWER_HOLD,
                (false, true) => PORT_TICK,
                (false, false) => IDLE_TICK,
            };
            let longest = if active { PORT_TICK } else { IDLE_TICK };
            let tick_end = shared.now().as_nanos().saturating_add(longest.as_nanos() as u64);
            let timeout = Some(shared.until_next_timer(&core).map_or(cap, |t| t.min(cap)));
            let deadline =
                core.engine.poll_timeout().map_or(tick_end, |t| t.as_nanos().min(tick_end)).max(AWAKE + 1);
            // Published under the lock: a posting thread that takes the lock after us compares
            // its new timer against this value and wakes us if it is earlier.
            shared.thread_deadline.store(deadline, Ordering::SeqCst);
            (received, timeout, active)
        };
        ready = if received < RECV_BATCH { wait_for(shared, timeout, !active) } else { !(PORTS | FRESH) };
        shared.thread_deadline.store(AWAKE, Ordering::SeqCst);
    }
}

/// The longest the progress thread sleeps (see `run_progress`).
const IDLE_TICK: Duration = Duration::from_millis(100);

/// What [`wait_for`] returns when only the hand-over timer woke the thread.
const HANDOVER_ONLY: u8 = 0b100;

/// [`wait_for`]'s bit for "a fresh port is readable" (see `ports`).
const FRESH: u8 = 0b1000;

/// [`wait_for`]'s bit for "a queue pair's port is readable".
const PORTS: u8 = 0b1_0000;

/// Sleeps until there is work or `timeout` passes. Application threads blocked in `wait` may
/// watch the socket themselves; while one does, this thread only keeps the timers and sleeps
/// until the hand-over timer says the socket went unwatched (see `SOCKET_HANDOVER_DELAY`).
/// It also sleeps on the fresh ports, and with `ports` on all of them (see `ports`: only while
/// they are idle). Returns a mask of what woke it: 1 the socket, 2 the waker, 4 the hand-over
/// timer, 8 a fresh port, 16 a port.
fn wait_for(shared: &Shared, timeout: Option<Duration>, ports: bool) -> u8 {
    let watched = !shared.socket_is_progress_threads();
    let sets = shared.port_set();
    let all = [
        shared.socket.as_fd(),
        shared.waker.as_fd(),
        shared.handover.as_fd(),
        // Placeholders (the waker again) past `count` are not watched.
        sets.map_or(shared.waker.as_fd(), |(_, fresh)| fresh.as_fd()),
        sets.map_or(shared.waker.as_fd(), |(every, _)| every.as_fd()),
    ];
    let count = match sets {
        None => 3,
        Some(_) if ports => 5,
        Some(_) => 4,
    };
    let all = &all[..count];
    let result = if watched {
        sys::wait_readable(&all[1..], timeout).map(|m| m << 1)
    } else {
        sys::wait_readable(all, timeout)
    };
    match result {
        Ok(mask) => {
            if mask & 0b010 != 0 {
                shared.waker.take();
            }
            if mask == HANDOVER_ONLY {
                return mask;
            }
            if mask & HANDOVER_ONLY != 0 {
                shared.handover_due();
            }
            mask
        }
        Err(_) => {
            // A failed poll would spin this loop; back off briefly instead of giving up.
            std::thread::sleep(Duration::from_millis(1));
            u8::MAX
        }
    }
}

/// Steps in when the application has not driven the device for `assist_after`, so ACKs,
/// responses and retransmissions keep flowing while the application is busy elsewhere, and at
/// once when an event loop waits for its notification (`Shared::assist_now`).
fn run_assist(shared: &Shared, assist_after: Duration) {
    let assist_nanos = u64::try_from(assist_after.as_nanos()).unwrap_or(u64::MAX);
    while !shared.stop.load(Ordering::SeqCst) {
        if !shared.assist_now.load(Ordering::SeqCst) {
            let _ = sys::wait_readable(&[shared.waker.as_fd()], Some(assist_after));
        }
        shared.waker.take();
        let wanted = shared.assist_now.swap(false, Ordering::SeqCst);
        let last = shared.last_driven.load(Ordering::SeqCst);
        if !wanted && shared.now().as_nanos().saturating_sub(last) < assist_nanos {
            continue;
        }
        // The application is idle: act as the progress thread until it drives again.
        while !shared.stop.load(Ordering::SeqCst) && shared.last_driven.load(Ordering::SeqCst) == last {
            let timeout = {
                let mut core = shared.lock();
                shared.drive(&mut core);
                core.stats.assists += 1;
                shared.until_next_timer(&core)
            };
            let cap = timeout.map_or(assist_after, |t| t.min(assist_after));
            if sys::wait_readable(&[shared.socket.as_fd(), shared.waker.as_fd()], Some(cap)).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            shared.waker.take();
        }
    }
}
