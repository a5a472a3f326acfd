//! The send queue: a fixed ring of work-queue entries (WQEs) allocated when the queue pair is
//! created, so posting reuses each slot's buffers instead of allocating.
//!
//! Three counters walk the ring (they only grow; the slot is `counter % capacity`):
//! `head` is the oldest WQE not yet completed, `started` the first WQE that has never been
//! transmitted (every WQE before it has its PSNs assigned), and `tail` the next free slot.

use lightpath_verbs::{SendOp, Sge, WcOpcode};
use lightpath_wire::Psn;

/// One posted send request.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
    pub(crate) fence: bool,
    /// Whether the payload is `inline_data` (copied at post time) rather than `sges`.
    pub(crate) inline: bool,
    pub(crate) sges: Vec<Sge>,
    pub(crate) inline_data: Vec<u8>,
    /// Message length in bytes.
    pub(crate) length: u32,
    /// First PSN of the message (assigned when first transmitted).
    pub(crate) first_psn: Psn,
    /// PSNs the message consumes: its packets for SEND/WRITE, one per response packet for
    /// READ, one for an atomic.
    pub(crate) psn_count: u32,
    /// An error decided for this WQE; reported when the queue is flushed in order.
    pub(crate) error: Option<lightpath_verbs::WcStatus>,
}

impl SendWqe {
    /// An empty slot whose buffers are sized for `max_sge` entries.
    fn empty(max_sge: u32) -> Self {
        Self {
            wr_id: 0,
            op: SendOp::Send,
            signaled: false,
            solicited: false,
            fence: false,
            inline: false,
            sges: Vec::with_capacity(max_sge as usize),
            inline_data: Vec::new(),
            length: 0,
            first_psn: Psn::default(),
            psn_count: 0,
            error: None,
        }
    }

    pub(crate) fn op(&self) -> SendOp {
        self.op
    }

    pub(crate) fn last_psn(&self) -> Psn {
        self.first_psn.add(self.psn_count.saturating_sub(1))
    }

    /// Whether `psn` falls within this message's PSNs.
    pub(crate) fn contains(&self, psn: Psn) -> bool {
        let offset = psn.distance_from(self.first_psn);
        offset >= 0 && (offset as u32) < self.psn_count
    }

    pub(crate) fn is_read(&self) -> bool {
        matches!(self.op(), SendOp::Read { .. })
    }

    pub(crate) fn is_read_or_atomic(&self) -> bool {
        self.op().is_read_or_atomic()
    }

    pub(crate) fn wc_opcode(&self) -> WcOpcode {
        wc_opcode(self.op())
    }
}

/// The completion opcode of a send operation.
pub(crate) fn wc_opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => WcOpcode::Send,
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
        SendOp::Read { .. } => WcOpcode::RdmaRead,
        SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
    }
}

/// The ring of send WQEs.
#[derive(Debug)]
pub(crate) struct SendQueue {
    slots: Vec<SendWqe>,
    pub(crate) head: u64,
    pub(crate) started: u64,
    pub(crate) tail: u64,
}

impl SendQueue {
    pub(crate) fn new(capacity: u32, max_sge: u32) -> Self {
        let slots = (0..capacity).map(|_| SendWqe::empty(max_sge)).collect();
        Self { slots, head: 0, started: 0, tail: 0 }
    }

    pub(crate) fn is_full(&self) -> bool {
        self.tail - self.head >= self.slots.len() as u64
    }

    /// Whether every posted WQE has completed.
    pub(crate) fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    /// Whether some transmitted WQE awaits its acknowledgement or response.
    pub(crate) fn has_outstanding(&self) -> bool {
        self.head < self.started
    }

    /// The slot for the next post. The caller fills it and then calls [`SendQueue::commit`].
    pub(crate) fn next_free(&mut self) -> &mut SendWqe {
        let index = self.slot(self.tail);
        &mut self.slots[index]
    }

    pub(crate) fn commit(&mut self) {
        self.tail += 1;
    }

    fn slot(&self, counter: u64) -> usize {
        (counter % self.slots.len() as u64) as usize
    }

    pub(crate) fn get(&self, counter: u64) -> &SendWqe {
        &self.slots[self.slot(counter)]
    }

    pub(crate) fn get_mut(&mut self, counter: u64) -> &mut SendWqe {
        let index = self.slot(counter);
        &mut self.slots[index]
    }

    /// The transmitted WQE whose PSN range holds `psn`, searching from the head.
    pub(crate) fn find_started(&self, psn: Psn) -> Option<u64> {
        (self.head..self.started).find(|&i| self.get(i).contains(psn))
    }

    /// Forgets every WQE (RESET).
    pub(crate) fn clear(&mut self) {
        self.head = 0;
        self.started = 0;
        self.tail = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_counters_and_psn_ranges() {
        let mut sq = SendQueue::new(2, 1);
        assert!(sq.is_empty());
        for id in 0..2 {
            let wqe = sq.next_free();
            wqe.wr_id = id;
            wqe.op = SendOp::Send;
            wqe.first_psn = Psn::new(0xFF_FFFE + id as u32 * 3);
            wqe.psn_count = 3;
            sq.commit();
        }
        assert!(sq.is_full());
        sq.started = 2;
        assert!(sq.has_outstanding());
        // The first message spans 0xFFFFFE, 0xFFFFFF, 0 (across the wrap).
        assert_eq!(sq.get(0).last_psn(), Psn::new(0));
        assert_eq!(sq.find_started(Psn::new(0)), Some(0));
        assert_eq!(sq.find_started(Psn::new(1)), Some(1));
        assert_eq!(sq.find_started(Psn::new(4)), None);
        sq.head = 1;
        assert!(!sq.is_full());
        assert_eq!(sq.next_free().wr_id, 0);
    }
}
