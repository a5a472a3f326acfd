//! The receive queue: a fixed ring of posted receive requests, allocated once.

use lightpath_verbs::Sge;

#[derive(Debug, Default)]
pub(crate) struct RecvWqe {
    pub(crate) wr_id: u64,
    pub(crate) sges: Vec<Sge>,
    /// Total bytes the entries can take.
    pub(crate) capacity: u64,
}

/// The ring of receive WQEs; the responder consumes from the head.
#[derive(Debug)]
pub(crate) struct RecvQueue {
    slots: Vec<RecvWqe>,
    head: u64,
    tail: u64,
}

impl RecvQueue {
    pub(crate) fn new(capacity: u32, max_sge: u32) -> Self {
        let slots = (0..capacity)
            .map(|_| RecvWqe { sges: Vec::with_capacity(max_sge as usize), ..RecvWqe::default() })
            .collect();
        Self { slots, head: 0, tail: 0 }
    }

    pub(crate) fn is_full(&self) -> bool {
        self.tail - self.head >= self.slots.len() as u64
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    fn slot(&self, counter: u64) -> usize {
        (counter % self.slots.len() as u64) as usize
    }

    /// Adds a receive request (the caller checked `is_full`).
    pub(crate) fn push(&mut self, wr_id: u64, sges: &[Sge]) {
        let index = self.slot(self.tail);
        let wqe = &mut self.slots[index];
        wqe.wr_id = wr_id;
        wqe.sges.clear();
        wqe.sges.extend_from_slice(sges);
        wqe.capacity = crate::sgl::total_len(sges);
        self.tail += 1;
    }

    /// The oldest posted receive request.
    pub(crate) fn front(&self) -> Option<&RecvWqe> {
        (!self.is_empty()).then(|| &self.slots[self.slot(self.head)])
    }

    /// Retires the oldest request, returning its `wr_id`.
    pub(crate) fn pop(&mut self) -> Option<u64> {
        let wr_id = self.front()?.wr_id;
        self.head += 1;
        Some(wr_id)
    }

    pub(crate) fn clear(&mut self) {
        self.head = 0;
        self.tail = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_capacity() {
        let mut rq = RecvQueue::new(2, 2);
        assert!(rq.front().is_none());
        rq.push(7, &[Sge { addr: 0, length: 10, lkey: 1 }, Sge { addr: 20, length: 5, lkey: 1 }]);
        rq.push(8, &[]);
        assert!(rq.is_full());
        assert_eq!(rq.front().map(|w| w.capacity), Some(15));
        assert_eq!(rq.pop(), Some(7));
        assert_eq!(rq.front().map(|w| w.capacity), Some(0));
        assert_eq!(rq.pop(), Some(8));
        assert_eq!(rq.pop(), None);
    }
}
