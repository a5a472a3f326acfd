//! The responder's output queue: ACK/NAKs, READ response streams and atomic ACKs, in the
//! order the requests executed (so an ACK never overtakes an earlier READ's data, which the
//! peer's completer would take for a lost response).
//!
//! The queue is bounded. Consecutive ACK-like items coalesce (an ACK for PSN p acknowledges
//! everything before it), a new READ/atomic is accepted only while a slot stays free for the
//! ACK that may follow it, and when the queue is full anyway the newest ACK-like item
//! replaces the last one.

use std::collections::VecDeque;

use lightpath_wire::{Psn, Syndrome};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResponseItem {
    /// ACKNOWLEDGE with this syndrome (ACK, RNR NAK or NAK) and MSN.
    Ack { psn: Psn, syndrome: Syndrome, msn: u32 },
    /// The rest of a READ response stream: the next packet has PSN `psn` and carries bytes
    /// from `va`; `first` says whether it opens the stream (FIRST/ONLY).
    ReadData { psn: Psn, va: u64, rkey: u32, remaining: u64, first: bool },
    /// ATOMIC ACKNOWLEDGE with the original value.
    AtomicAck { psn: Psn, orig: u64, msn: u32 },
}

#[derive(Debug, Default)]
pub(crate) struct ResponseQueue {
    items: VecDeque<ResponseItem>,
    capacity: usize,
}

impl ResponseQueue {
    /// Sizes the queue for `resources` responder resources.
    pub(crate) fn reset(&mut self, resources: usize) {
        self.capacity = 2 * resources + 4;
        self.items = VecDeque::with_capacity(self.capacity);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Whether everything queued is a plain ACK (no NAK, RNR NAK, READ data or atomic ACK):
    /// output that may wait for the queue pair's next request to carry it.
    pub(crate) fn only_plain_acks(&self) -> bool {
        self.items.iter().all(|item| matches!(item, ResponseItem::Ack { syndrome: Syndrome::Ack { .. }, .. }))
    }

    pub(crate) fn clear(&mut self) {
        self.items.clear();
    }

    /// Whether a READ/atomic response may be queued now.
    pub(crate) fn has_room_for_work(&self) -> bool {
        self.items.len() + 2 <= self.capacity
    }

    /// Queues READ data or an atomic ACK (the caller checked `has_room_for_work`).
    pub(crate) fn push_work(&mut self, item: ResponseItem) {
        self.items.push_back(item);
    }

    /// Queues an ACK, NAK or RNR NAK. Returns false if it had to be dropped.
    pub(crate) fn push_ack(&mut self, psn: Psn, syndrome: Syndrome, msn: u32) -> bool {
        let item = ResponseItem::Ack { psn, syndrome, msn };
        let room = self.items.len() < self.capacity;
        match self.items.back_mut() {
            Some(last @ ResponseItem::Ack { syndrome: Syndrome::Ack { .. }, .. }) => *last = item,
            _ if room => self.items.push_back(item),
            Some(last @ ResponseItem::Ack { .. }) => *last = item,
            _ => return false,
        }
        true
    }

    /// The queued READ response stream whose next packet lies in `[first, last]` (the PSN
    /// range of one READ request), if any.
    pub(crate) fn read_stream_mut(&mut self, first: Psn, last: Psn) -> Option<&mut ResponseItem> {
        self.items.iter_mut().find(|item| match item {
            ResponseItem::ReadData { psn, .. } => psn.is_after_or_eq(first) && !psn.is_after(last),
            _ => false,
        })
    }

    pub(crate) fn front_mut(&mut self) -> Option<&mut ResponseItem> {
        self.items.front_mut()
    }

    pub(crate) fn pop(&mut self) {
        self.items.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACK: Syndrome = Syndrome::ACK_UNLIMITED;

    #[test]
    fn acks_coalesce_and_work_keeps_a_slot_for_an_ack() {
        let mut q = ResponseQueue::default();
        q.reset(1); // capacity 6
        assert!(q.push_ack(Psn::new(1), ACK, 1));
        assert!(q.push_ack(Psn::new(2), ACK, 2));
        assert_eq!(q.items.len(), 1);
        let read = ResponseItem::ReadData { psn: Psn::new(3), va: 0, rkey: 0, remaining: 0, first: true };
        let nak = Syndrome::Nak(lightpath_wire::NakCode::PsnSequenceError);
        while q.has_room_for_work() {
            q.push_work(read);
            assert!(q.push_ack(Psn::new(9), nak, 0));
        }
        assert_eq!(q.items.len(), 5);
        // A work item always leaves room for the ACK behind it; then ACKs coalesce.
        assert!(q.push_ack(Psn::new(10), ACK, 3));
        assert_eq!(q.items.len(), 6);
        assert!(q.push_ack(Psn::new(11), nak, 3));
        assert_eq!(q.items.len(), 6);
        // Full, last item a NAK: the newest ACK-like item replaces it.
        assert!(q.push_ack(Psn::new(12), ACK, 4));
        assert_eq!(q.items.back(), Some(&ResponseItem::Ack { psn: Psn::new(12), syndrome: ACK, msn: 4 }));
        assert_eq!(q.items.len(), 6);
    }
}
