//! Responder resources: a ring of the last `max_dest_rd_atomic` (rounded up to a power of
//! two) READ and atomic requests, so duplicates can be answered without executing twice —
//! READs are re-read from memory (possibly a sub-range), atomics answered from the stored
//! original value. As in rxe, the oldest record is overwritten when the ring is full.

use lightpath_wire::Psn;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resource {
    Read { first: Psn, last: Psn, va: u64, rkey: u32, len: u64 },
    Atomic { psn: Psn, orig: u64 },
}

#[derive(Debug, Default)]
pub(crate) struct Resources {
    ring: Vec<Option<Resource>>,
    next: usize,
}

impl Resources {
    /// Sizes the ring for `max_dest_rd_atomic` (0 disables READ and atomics).
    pub(crate) fn reset(&mut self, max_dest_rd_atomic: u8) {
        let size =
            if max_dest_rd_atomic == 0 { 0 } else { usize::from(max_dest_rd_atomic).next_power_of_two() };
        self.ring.clear();
        self.ring.resize(size, None);
        self.next = 0;
    }

    pub(crate) fn capacity(&self) -> usize {
        self.ring.len()
    }

    pub(crate) fn push(&mut self, resource: Resource) {
        if self.ring.is_empty() {
            return;
        }
        self.ring[self.next] = Some(resource);
        self.next = (self.next + 1) % self.ring.len();
    }

    /// The READ record whose PSN range holds `psn`.
    pub(crate) fn find_read(&self, psn: Psn) -> Option<Resource> {
        self.ring.iter().flatten().copied().find(|r| match *r {
            Resource::Read { first, last, .. } => psn.is_after_or_eq(first) && !psn.is_after(last),
            Resource::Atomic { .. } => false,
        })
    }

    /// The original value of the atomic executed at `psn`.
    pub(crate) fn find_atomic(&self, psn: Psn) -> Option<u64> {
        self.ring.iter().flatten().find_map(|r| match *r {
            Resource::Atomic { psn: p, orig } if p == psn => Some(orig),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_overwrites_oldest() {
        let mut res = Resources::default();
        res.reset(3);
        assert_eq!(res.capacity(), 4);
        for i in 0..5u32 {
            res.push(Resource::Atomic { psn: Psn::new(i), orig: u64::from(i) * 10 });
        }
        assert_eq!(res.find_atomic(Psn::new(0)), None);
        assert_eq!(res.find_atomic(Psn::new(4)), Some(40));
        res.push(Resource::Read { first: Psn::new(0xFF_FFFE), last: Psn::new(1), va: 0, rkey: 1, len: 1024 });
        assert!(res.find_read(Psn::new(0)).is_some());
        assert!(res.find_read(Psn::new(2)).is_none());
        res.reset(0);
        res.push(Resource::Atomic { psn: Psn::new(9), orig: 1 });
        assert_eq!(res.find_atomic(Psn::new(9)), None);
    }
}
