//! Completion queues: bounded FIFOs of work completions, and the table that owns them.
//!
//! A completion that arrives at a full queue is dropped and counted (verbs would raise a CQ
//! overflow error); the application sizes its CQs for its queue depths, so this is a misuse
//! signal, not a flow-control mechanism.

use std::collections::VecDeque;

use lightpath_verbs::{Error, Result, WorkCompletion};

/// A completion queue handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CqHandle(pub u32);

#[derive(Debug)]
pub(crate) struct CompletionQueue {
    entries: VecDeque<WorkCompletion>,
    capacity: usize,
    /// Queue pairs that post into this CQ (destroying it is refused while non-zero).
    users: u32,
    /// Whether a `Completion` event for this CQ is waiting in the engine's event queue, so at
    /// most one is queued per CQ.
    event_pending: bool,
}

impl CompletionQueue {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// What happened when a completion was pushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Stored; the caller should queue a notification event.
    StoredNotify,
    /// Stored; a notification is already pending.
    Stored,
    /// The queue was full; the completion was dropped.
    Overflow,
    /// No such CQ.
    Missing,
}

struct Slot {
    generation: u16,
    cq: Option<CompletionQueue>,
}

/// The engine's completion queues.
pub(crate) struct CqTable {
    slots: Vec<Slot>,
    free: Vec<u16>,
    live: u32,
    max: u32,
    max_cqe: u32,
}

impl CqTable {
    pub(crate) fn new(max: u32, max_cqe: u32) -> Self {
        Self { slots: Vec::new(), free: Vec::new(), live: 0, max: max.min(u32::from(u16::MAX)), max_cqe }
    }

    pub(crate) fn create(&mut self, capacity: u32) -> Result<CqHandle> {
        if capacity == 0 || capacity > self.max_cqe {
            return Err(Error::InvalidAttribute("CQ capacity must be 1..=max_cqe"));
        }
        if self.live >= self.max {
            return Err(Error::QueueFull);
        }
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(Slot { generation: 0, cq: None });
                (self.slots.len() - 1) as u16
            }
        };
        let slot = &mut self.slots[usize::from(index)];
        slot.generation = slot.generation.wrapping_add(1);
        slot.cq = Some(CompletionQueue {
            // Reserve a modest amount up front; the deque grows (once) towards the capacity.
            entries: VecDeque::with_capacity((capacity as usize).min(1024)),
            capacity: capacity as usize,
            users: 0,
            event_pending: false,
        });
        self.live += 1;
        Ok(CqHandle((u32::from(slot.generation) << 16) | u32::from(index)))
    }

    fn index(&self, handle: CqHandle) -> Option<usize> {
        let index = (handle.0 & 0xFFFF) as usize;
        let slot = self.slots.get(index)?;
        (slot.cq.is_some() && u32::from(slot.generation) == handle.0 >> 16).then_some(index)
    }

    pub(crate) fn get(&self, handle: CqHandle) -> Option<&CompletionQueue> {
        self.slots[self.index(handle)?].cq.as_ref()
    }

    fn get_mut(&mut self, handle: CqHandle) -> Option<&mut CompletionQueue> {
        let index = self.index(handle)?;
        self.slots[index].cq.as_mut()
    }

    pub(crate) fn destroy(&mut self, handle: CqHandle) -> Result<()> {
        let index = self.index(handle).ok_or(Error::NotFound("completion queue"))?;
        let slot = &mut self.slots[index];
        if slot.cq.as_ref().is_some_and(|cq| cq.users > 0) {
            return Err(Error::Busy("completion queue still used by a queue pair"));
        }
        slot.cq = None;
        self.free.push(index as u16);
        self.live -= 1;
        Ok(())
    }

    pub(crate) fn exists(&self, handle: CqHandle) -> bool {
        self.index(handle).is_some()
    }

    pub(crate) fn add_user(&mut self, handle: CqHandle) {
        if let Some(cq) = self.get_mut(handle) {
            cq.users += 1;
        }
    }

    pub(crate) fn remove_user(&mut self, handle: CqHandle) {
        if let Some(cq) = self.get_mut(handle) {
            cq.users = cq.users.saturating_sub(1);
        }
    }

    pub(crate) fn push(&mut self, handle: CqHandle, wc: WorkCompletion) -> Pushed {
        let Some(cq) = self.get_mut(handle) else { return Pushed::Missing };
        if cq.entries.len() >= cq.capacity {
            return Pushed::Overflow;
        }
        cq.entries.push_back(wc);
        if cq.event_pending {
            Pushed::Stored
        } else {
            cq.event_pending = true;
            Pushed::StoredNotify
        }
    }

    /// The driver took the notification event for `handle` out of the event queue.
    pub(crate) fn event_delivered(&mut self, handle: CqHandle) {
        if let Some(cq) = self.get_mut(handle) {
            cq.event_pending = false;
        }
    }

    pub(crate) fn poll(&mut self, handle: CqHandle, out: &mut [WorkCompletion]) -> usize {
        let Some(cq) = self.get_mut(handle) else { return 0 };
        let n = out.len().min(cq.entries.len());
        for (slot, wc) in out.iter_mut().zip(cq.entries.drain(..n)) {
            *slot = wc;
        }
        n
    }
}

impl std::fmt::Debug for CqTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqTable").field("live", &self.live).finish()
    }
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::{WcOpcode, WcStatus};

    use super::*;

    fn wc(id: u64) -> WorkCompletion {
        WorkCompletion::new(id, WcStatus::Success, WcOpcode::Send, 17)
    }

    #[test]
    fn fifo_overflow_and_notification_dedup() {
        let mut table = CqTable::new(4, 16);
        let cq = table.create(2).unwrap();
        assert_eq!(table.push(cq, wc(1)), Pushed::StoredNotify);
        assert_eq!(table.push(cq, wc(2)), Pushed::Stored);
        assert_eq!(table.push(cq, wc(3)), Pushed::Overflow);
        let mut out = [wc(0); 4];
        assert_eq!(table.poll(cq, &mut out), 2);
        assert_eq!((out[0].wr_id, out[1].wr_id), (1, 2));
        table.event_delivered(cq);
        assert_eq!(table.push(cq, wc(4)), Pushed::StoredNotify);
    }

    #[test]
    fn destroy_refuses_while_used_and_handles_go_stale() {
        let mut table = CqTable::new(4, 16);
        let cq = table.create(4).unwrap();
        table.add_user(cq);
        assert!(matches!(table.destroy(cq), Err(Error::Busy(_))));
        table.remove_user(cq);
        table.destroy(cq).unwrap();
        assert!(!table.exists(cq));
        let again = table.create(4).unwrap();
        assert_ne!(again, cq);
        assert_eq!(table.push(cq, wc(1)), Pushed::Missing);
        assert!(table.create(0).is_err());
        assert!(table.create(17).is_err());
    }
}
