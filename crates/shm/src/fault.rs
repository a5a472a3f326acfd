//! Fault injection for tests: a queue pair scribbles on its *own* shared segment, or something
//! scribbles on a device's activity area (which every peer can write), exactly as a broken or
//! hostile peer process could, so tests can check that the other side survives; and counters
//! of the engine's work, so tests can check what a call costs. Not part of the supported API.

use std::sync::atomic::Ordering;

use lightpath_verbs::{Error, Result};

use crate::device::ShmDevice;
use crate::qp::ShmQp;
use crate::ring::{max_payload_for, HEADER};
use crate::segment::{OFF_ACKED, OFF_HEAD, OFF_NAK, OFF_STATE, RING_OFFSET};

/// What to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Pseudo-random bytes over the whole ring, plus a record stamp where the peer reads next
    /// (so the peer parses whatever the bytes say).
    RingGarbage { seed: u64 },
    /// A SEND record claiming a payload longer than the ring.
    OversizedRecord,
    /// A record of an unknown kind.
    UnknownKind,
    /// A SEND record with a message number the peer does not expect.
    WrongSequence,
    /// An acknowledgement count larger than the number of messages the peer sent.
    AckedBeyondSent,
    /// A NAK with a reason that does not exist.
    BadNak,
    /// A consumer position that is not a record boundary (the peer's producer reads it back).
    HeadGarbage,
    /// A status word without its validity bit.
    StatusGarbage,
    /// A direct SEND whose source descriptor points far outside the sender's region `rkey`.
    ForgedDescriptor { rkey: u32 },
}

/// Writes `fault` into `qp`'s segment and, like a peer publishing something, marks the peer
/// queue pair in its device's activity area (a peer that scribbles without telling anyone is
/// only a peer that went quiet). Fails if the queue pair has no link.
pub fn inject(qp: &ShmQp, fault: Fault) -> Result<()> {
    qp.with_core(|core, _| {
        let link = core.link.as_ref().ok_or(Error::InvalidState(core.state))?;
        let map = link.outbox.map();
        let capacity = map.len() - RING_OFFSET;
        let tail = link.producer.tail();
        let at = RING_OFFSET + (tail % capacity as u64) as usize;
        let forge = |kind: u8, len: u32, word2: u64, word3: u64| {
            let info = u64::from(kind) | u64::from(len) << 32;
            let ok = map.store_u64(at + 8, info, Ordering::Relaxed)
                && map.store_u64(at + 16, word2, Ordering::Relaxed)
                && map.store_u64(at + 24, word3, Ordering::Relaxed)
                && map.store_u64(at, !tail, Ordering::Release);
            debug_assert!(ok);
        };
        let word = |offset: usize, value: u64| {
            let ok = map.store_u64(offset, value, Ordering::Release);
            debug_assert!(ok);
        };
        match fault {
            Fault::RingGarbage { seed } => {
                let mut state = seed | 1;
                let mut bytes = vec![0u8; capacity];
                for chunk in bytes.chunks_mut(8) {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
                }
                let written = map.write(RING_OFFSET, &bytes);
                debug_assert!(written);
                let mut header = [0u8; HEADER];
                let read = map.read(at, &mut header);
                debug_assert!(read);
                word(at, !tail);
            }
            Fault::OversizedRecord => forge(1, max_payload_for(capacity) + 1, 0, u64::from(u32::MAX)),
            Fault::UnknownKind => forge(0x77, 0, 0, 0),
            Fault::WrongSequence => forge(1, 0, 0xFFFF, 0),
            Fault::AckedBeyondSent => word(OFF_ACKED, u64::MAX),
            Fault::BadNak => word(OFF_NAK, 1 << 8 | 0xEE),
            Fault::HeadGarbage => word(OFF_HEAD, 3),
            Fault::StatusGarbage => word(OFF_STATE, 0x7777),
            Fault::ForgedDescriptor { rkey } => {
                let mut descriptor = [0u8; 16];
                descriptor[0..4].copy_from_slice(&rkey.to_le_bytes());
                descriptor[4..8].copy_from_slice(&4096u32.to_le_bytes());
                descriptor[8..16].copy_from_slice(&(u64::MAX - 100).to_le_bytes());
                let written = map.write(at + HEADER, &descriptor);
                debug_assert!(written);
                forge(3, 16, 0, 4096);
            }
        }
        core.published = true;
        core.ring_peer();
        Ok(())
    })?
}

/// What a device's engine has done since it opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Times a queue pair was looked at (its ring, acknowledgements and queues).
    pub looks: u64,
    /// Times every queue pair was looked at, marked or not (the fallback for lost marks).
    pub full_scans: u64,
}

/// The engine counters of `device`.
pub fn counters(device: &ShmDevice) -> EngineCounters {
    let core = device.inner.shared.lock_core();
    EngineCounters { looks: core.looks, full_scans: core.full_scans }
}

/// Clears every activity mark of `device`, as a hostile peer could: news marked so far is found
/// only by the fallback that looks at every queue pair now and then.
pub fn clear_activity(device: &ShmDevice) {
    device.inner.shared.ctx.activity.clear_marks();
}

/// Writes pseudo-random bytes over the whole activity area of `device` (marks, sleep word,
/// rung word), as a hostile peer could.
pub fn scribble_activity(device: &ShmDevice, seed: u64) {
    let map = device.inner.shared.ctx.activity.mapping();
    let mut state = seed | 1;
    for offset in (0..map.len()).step_by(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let written = map.store_u64(offset, state, Ordering::Release);
        debug_assert!(written);
    }
}
