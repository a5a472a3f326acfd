//! Which READ response and ATOMIC ACKNOWLEDGE PSNs have arrived ahead of the oldest
//! unacknowledged one: a fixed bitmap indexed by the distance from that PSN.
//!
//! A reordering network can deliver a response (a later packet of a READ stream, or the answer
//! to a later atomic) before an earlier one. Its data is written to the requester's buffer at
//! once — a response's place in the buffer follows from its PSN — and the bit remembers that it
//! came, so the completer never needs it again when the earlier packet arrives. Responses that
//! land beyond the window are dropped and recovered by a retry, as go-back-N would.

/// PSNs past the oldest unacknowledged one that the window can remember.
pub(crate) const RESPONSE_WINDOW: u32 = 512;

const WORDS: usize = (RESPONSE_WINDOW / 64) as usize;

/// Bit `i` is set when the response with PSN `una + i` has arrived and been applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ResponseWindow {
    words: [u64; WORDS],
}

impl ResponseWindow {
    /// Whether the response `offset` PSNs past the oldest unacknowledged one has arrived.
    pub(crate) fn contains(&self, offset: u32) -> bool {
        offset < RESPONSE_WINDOW && self.words[(offset / 64) as usize] & (1 << (offset % 64)) != 0
    }

    /// Records the response `offset` PSNs past the oldest unacknowledged one. Returns false
    /// when the offset lies beyond the window (nothing is recorded).
    pub(crate) fn insert(&mut self, offset: u32) -> bool {
        if offset >= RESPONSE_WINDOW {
            return false;
        }
        self.words[(offset / 64) as usize] |= 1 << (offset % 64);
        true
    }

    /// The oldest unacknowledged PSN moved forward by `count`: bit `count` becomes bit 0.
    pub(crate) fn advance(&mut self, count: u32) {
        if count == 0 {
            return;
        }
        if count >= RESPONSE_WINDOW {
            *self = Self::default();
            return;
        }
        let (word_shift, bit_shift) = ((count / 64) as usize, count % 64);
        for i in 0..WORDS {
            let low = self.words.get(i + word_shift).copied().unwrap_or(0);
            let high = self.words.get(i + word_shift + 1).copied().unwrap_or(0);
            self.words[i] =
                if bit_shift == 0 { low } else { (low >> bit_shift) | (high << (64 - bit_shift)) };
        }
    }

    /// Forgets everything (a new connection, or the queue pair failed).
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_contains_and_bounds() {
        let mut window = ResponseWindow::default();
        assert!(!window.contains(0));
        assert!(window.insert(0));
        assert!(window.insert(63));
        assert!(window.insert(64));
        assert!(window.insert(RESPONSE_WINDOW - 1));
        assert!(!window.insert(RESPONSE_WINDOW));
        assert!(!window.contains(RESPONSE_WINDOW));
        for offset in [0, 63, 64, RESPONSE_WINDOW - 1] {
            assert!(window.contains(offset), "{offset}");
        }
        assert!(!window.contains(1) && !window.contains(65));
        window.clear();
        assert_eq!(window, ResponseWindow::default());
    }

    #[test]
    fn advancing_moves_every_bit_down_and_drops_the_passed_ones() {
        for shift in [1u32, 5, 63, 64, 65, 128, 200, RESPONSE_WINDOW - 1] {
            let mut window = ResponseWindow::default();
            let offsets = [0u32, 1, 62, 63, 64, 100, 127, 128, 300, RESPONSE_WINDOW - 1];
            for &offset in &offsets {
                window.insert(offset);
            }
            window.advance(shift);
            for offset in 0..RESPONSE_WINDOW {
                let expected = offsets.contains(&(offset + shift));
                assert_eq!(window.contains(offset), expected, "shift {shift} offset {offset}");
            }
        }
        let mut window = ResponseWindow::default();
        window.insert(7);
        window.advance(RESPONSE_WINDOW);
        assert_eq!(window, ResponseWindow::default());
        window.insert(7);
        window.advance(0);
        assert!(window.contains(7));
    }
}
