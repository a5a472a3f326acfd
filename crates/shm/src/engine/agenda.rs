//! [`Agenda`]: the queue pairs that need another look although no peer will mark them — those
//! that stopped reading with records left (a call reads a bounded batch), and those waiting
//! for an RNR deadline.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use super::QpCore;

/// Looks owed to queue pairs, by queue-pair number.
#[derive(Debug, Default)]
pub(crate) struct Agenda {
    /// Queue pairs with records left, in order, each at most once (`QpCore::queued`).
    ready: VecDeque<u32>,
    /// RNR deadlines, earliest first. An entry whose queue pair no longer waits for it (its
    /// `QpCore::timer` differs) is skipped when it comes up.
    timers: BinaryHeap<Reverse<(Instant, u32)>>,
}

impl Agenda {
    /// Whether [`Agenda::note`] would note anything for `qp` (read without the agenda's lock).
    pub(crate) fn wants(qp: &QpCore) -> bool {
        (qp.more_to_read && !qp.queued) || qp.wake_at.is_some_and(|at| qp.timer != Some(at))
    }

    /// Notes what `qp` needs after something worked on it.
    pub(crate) fn note(&mut self, qp: &mut QpCore) {
        if qp.more_to_read && !qp.queued {
            qp.queued = true;
            self.ready.push_back(qp.qpn);
        }
        if let Some(at) = qp.wake_at.filter(|&at| qp.timer != Some(at)) {
            qp.timer = Some(at);
            self.timers.push(Reverse((at, qp.qpn)));
        }
    }

    /// Whether no look is owed.
    pub(crate) fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.timers.is_empty()
    }

    /// The queue pairs with records left, as of now (those queued while the caller works
    /// through them wait for the next call, so a busy one cannot keep a call going).
    pub(crate) fn take_ready(&mut self) -> VecDeque<u32> {
        std::mem::take(&mut self.ready)
    }

    /// The next queue pair whose RNR deadline has passed by `now`, if its deadline is still
    /// the one it waits for (the caller clears `QpCore::timer` before looking at it).
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, u32)> {
        let &Reverse(due) = self.timers.peek().filter(|Reverse((at, _))| *at <= now)?;
        self.timers.pop();
        Some(due)
    }

    /// The earliest deadline still queued (possibly one no longer waited for: waking early
    /// costs one look).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// Whether timers are queued at all (reading the clock is needed only then).
    pub(crate) fn has_timers(&self) -> bool {
        !self.timers.is_empty()
    }
}
