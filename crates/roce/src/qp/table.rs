//! The queue-pair table: O(1) lookup from a 24-bit QPN.
//!
//! A QPN is `generation × stride + slot`, where `stride` is a power of two larger than the
//! slot count, so the slot is the QPN's low bits and a stale QPN (its slot since reused) no
//! longer matches. Slots 0..=16 are never used: QPN 0 is invalid on the wire, QPN 1 is the
//! GSI QP, and rxe's first user QP is 0x11, which this table reproduces.

use lightpath_verbs::{Error, Result};

use super::Qp;

/// First slot handed out (QPN 0x11 for the first queue pair, as rxe).
const FIRST_SLOT: u32 = 0x11;
const QPN_MASK: u32 = 0xFF_FFFF;

#[derive(Debug)]
struct Slot {
    generation: u32,
    qp: Option<Box<Qp>>,
}

#[derive(Debug)]
pub(crate) struct QpTable {
    slots: Vec<Slot>,
    free: Vec<u32>,
    stride: u32,
    live: u32,
    max: u32,
}

impl QpTable {
    pub(crate) fn new(max: u32) -> Self {
        let max = max.clamp(1, 1 << 20);
        let stride = (max + FIRST_SLOT).next_power_of_two();
        Self { slots: Vec::new(), free: Vec::new(), stride, live: 0, max }
    }

    pub(crate) fn len(&self) -> u32 {
        self.live
    }

    /// Reserves a slot and returns the QPN it will carry; `insert` must follow.
    pub(crate) fn allocate(&mut self) -> Result<u32> {
        if self.live >= self.max {
            return Err(Error::QueueFull);
        }
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                if self.slots.is_empty() {
                    self.slots.resize_with(FIRST_SLOT as usize, || Slot { generation: 0, qp: None });
                }
                self.slots.push(Slot { generation: 0, qp: None });
                (self.slots.len() - 1) as u32
            }
        };
        let generations = (QPN_MASK + 1) / self.stride;
        let slot = &mut self.slots[index as usize];
        // Skip the generation whose QPN would be the multicast QPN 0xFFFFFF.
        loop {
            let qpn = slot.generation * self.stride + index;
            if qpn != QPN_MASK {
                return Ok(qpn);
            }
            slot.generation = (slot.generation + 1) % generations;
        }
    }

    pub(crate) fn insert(&mut self, qp: Qp) {
        let index = (qp.qpn & (self.stride - 1)) as usize;
        self.slots[index].qp = Some(Box::new(qp));
        self.live += 1;
    }

    pub(crate) fn get(&self, qpn: u32) -> Option<&Qp> {
        let slot = self.slots.get((qpn & (self.stride - 1)) as usize)?;
        slot.qp.as_deref().filter(|qp| qp.qpn == qpn)
    }

    pub(crate) fn get_mut(&mut self, qpn: u32) -> Option<&mut Qp> {
        let slot = self.slots.get_mut((qpn & (self.stride - 1)) as usize)?;
        slot.qp.as_deref_mut().filter(|qp| qp.qpn == qpn)
    }

    pub(crate) fn remove(&mut self, qpn: u32) -> Option<Box<Qp>> {
        self.get(qpn)?;
        let index = qpn & (self.stride - 1);
        let generations = (QPN_MASK + 1) / self.stride;
        let slot = &mut self.slots[index as usize];
        let qp = slot.qp.take();
        slot.generation = (slot.generation + 1) % generations;
        self.free.push(index);
        self.live -= 1;
        qp
    }

    /// Every live queue pair (for rebuilding the timer heap).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Qp> {
        self.slots.iter().filter_map(|slot| slot.qp.as_deref())
    }
}
