//! A simulated many-rank network that runs schedules in memory, deterministically.
//!
//! It is the strictest transport a schedule can meet: a send completes only when the receiver
//! has taken the message (no buffering at all), receives must match sends one for one in order
//! and length, and the order in which ranks move is shuffled by a seed. A schedule that passes
//! here cannot deadlock on a transport that buffers, whatever its buffer sizes, and cannot
//! mismatch messages.

use crate::dtype;
use crate::schedule::{Buf, Region, Schedule, Step};
use std::collections::VecDeque;

/// One rank's buffers for a simulated call.
#[derive(Clone, Debug, Default)]
pub struct Buffers {
    /// The input (read-only for the schedule).
    pub input: Vec<u8>,
    /// The output.
    pub output: Vec<u8>,
}

/// Why a simulation failed.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimError {
    /// No rank could move: the named ranks are stuck in the given rounds.
    Deadlock { stuck: Vec<(usize, usize)> },
    /// A receive met a message of another length.
    LengthMismatch { from: usize, to: usize, sent: usize, expected: usize },
    /// Messages were left undelivered when every rank had finished.
    Leftover { from: usize, to: usize },
    /// A step addressed a rank outside the job or a region outside its buffer.
    BadStep { rank: usize, step: String },
}

struct Message {
    bytes: Vec<u8>,
    /// (rank, step index) of the sender's step, completed on delivery.
    sender_step: usize,
}

struct RankState {
    round: usize,
    started: bool,
    done: Vec<bool>,
    scratch: Vec<u8>,
}

fn region<'a>(bufs: &'a Buffers, scratch: &'a [u8], r: Region) -> Option<&'a [u8]> {
    let buf: &[u8] = match r.buf {
        Buf::Input => &bufs.input,
        Buf::Output => &bufs.output,
        Buf::Scratch => scratch,
    };
    buf.get(r.offset..r.offset.checked_add(r.len)?)
}

fn region_mut<'a>(bufs: &'a mut Buffers, scratch: &'a mut [u8], r: Region) -> Option<&'a mut [u8]> {
    let buf: &mut [u8] = match r.buf {
        Buf::Input => return None, // never written
        Buf::Output => &mut bufs.output,
        Buf::Scratch => scratch,
    };
    buf.get_mut(r.offset..r.offset.checked_add(r.len)?)
}

/// A tiny deterministic generator (xorshift) for the visiting order.
struct Shuffle(u64);
impl Shuffle {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs `schedules[r]` on `buffers[r]` for every rank `r`; `seed` shuffles the order in which
/// ranks move.
pub fn run(schedules: &[Schedule], buffers: &mut [Buffers], seed: u64) -> Result<(), SimError> {
    let p = schedules.len();
    assert_eq!(buffers.len(), p);
    // queues[from * p + to]
    let mut queues: Vec<VecDeque<Message>> = (0..p * p).map(|_| VecDeque::new()).collect();
    let mut states: Vec<RankState> = schedules
        .iter()
        .map(|s| RankState { round: 0, started: false, done: Vec::new(), scratch: vec![0; s.scratch] })
        .collect();
    // Sends whose message a receiver took: (sender, step index in its current round).
    let mut delivered: Vec<(usize, usize)> = Vec::new();
    let mut order: Vec<usize> = (0..p).collect();
    let mut shuffle = Shuffle(seed | 1);
    loop {
        for i in (1..p).rev() {
            let j = (shuffle.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let mut progress = false;
        let mut all_done = true;
        for &rank in &order {
            let sched = &schedules[rank];
            let st = &mut states[rank];
            if st.round >= sched.rounds.len() {
                continue;
            }
            all_done = false;
            let steps = &sched.rounds[st.round].steps;
            if !st.started {
                st.started = true;
                st.done = steps.iter().map(|s| !s.is_comm()).collect();
                for (idx, step) in steps.iter().enumerate() {
                    if let Step::Send { peer, from } = *step {
                        let bad = || SimError::BadStep { rank, step: format!("{step:?}") };
                        if peer >= p || peer == rank {
                            return Err(bad());
                        }
                        let bytes = region(&buffers[rank], &st.scratch, from).ok_or_else(bad)?.to_vec();
                        queues[rank * p + peer].push_back(Message { bytes, sender_step: idx });
                    }
                }
                progress = true;
            }
            // Receives: for each peer, only the first unfinished receive from it may match.
            let mut blocked = vec![false; p];
            for (idx, step) in steps.iter().enumerate() {
                let (peer, into, reduce, with) = match *step {
                    Step::Recv { peer, into } => (peer, into, false, None),
                    Step::RecvReduce { peer, into } => (peer, into, true, None),
                    Step::RecvCombine { peer, with, into } => (peer, into, true, Some(with)),
                    _ => continue,
                };
                let bad = || SimError::BadStep { rank, step: format!("{step:?}") };
                if peer >= p || peer == rank {
                    return Err(bad());
                }
                if st.done[idx] || blocked[peer] {
                    continue;
                }
                blocked[peer] = true;
                let q = &mut queues[peer * p + rank];
                let Some(front) = q.front() else { continue };
                if front.bytes.len() != into.len {
                    return Err(SimError::LengthMismatch {
                        from: peer,
                        to: rank,
                        sent: front.bytes.len(),
                        expected: into.len,
                    });
                }
                let msg = q.pop_front().expect("front exists");
                let left = match with {
                    Some(with) if with.buf != into.buf && with.len == into.len => {
                        Some(region(&buffers[rank], &st.scratch, with).ok_or_else(bad)?.to_vec())
                    }
                    Some(_) => return Err(bad()),
                    None => None,
                };
                let dst = region_mut(&mut buffers[rank], &mut st.scratch, into).ok_or_else(bad)?;
                if let Some(left) = left {
                    dtype::combine(sched.dtype, sched.op, dst, &left, &msg.bytes);
                } else if reduce {
                    dtype::reduce(sched.dtype, sched.op, dst, &msg.bytes);
                } else {
                    dst.copy_from_slice(&msg.bytes);
                }
                st.done[idx] = true;
                blocked[peer] = false;
                delivered.push((peer, msg.sender_step));
                progress = true;
            }
            // Apply deliveries to senders (their current round is the one that posted them).
            for (sender, step) in delivered.drain(..) {
                states[sender].done[step] = true;
            }
            let st = &mut states[rank];
            if st.done.iter().all(|d| *d) {
                for step in steps {
                    let bad = || SimError::BadStep { rank, step: format!("{step:?}") };
                    match *step {
                        Step::Copy { from, into } => {
                            let src = region(&buffers[rank], &st.scratch, from).ok_or_else(bad)?.to_vec();
                            let dst =
                                region_mut(&mut buffers[rank], &mut st.scratch, into).ok_or_else(bad)?;
                            if src.len() != dst.len() {
                                return Err(bad());
                            }
                            dst.copy_from_slice(&src);
                        }
                        Step::Reduce { from, into } => {
                            let src = region(&buffers[rank], &st.scratch, from).ok_or_else(bad)?.to_vec();
                            let dst =
                                region_mut(&mut buffers[rank], &mut st.scratch, into).ok_or_else(bad)?;
                            if src.len() != dst.len() {
                                return Err(bad());
                            }
                            dtype::reduce(sched.dtype, sched.op, dst, &src);
                        }
                        Step::Divide { region: r, by } => {
                            let dst = region_mut(&mut buffers[rank], &mut st.scratch, r).ok_or_else(bad)?;
                            dtype::divide(sched.dtype, dst, by);
                        }
                        _ => {}
                    }
                }
                st.round += 1;
                st.started = false;
                progress = true;
            }
        }
        if all_done {
            break;
        }
        if !progress {
            let stuck = (0..p)
                .filter(|&r| states[r].round < schedules[r].rounds.len())
                .map(|r| (r, states[r].round))
                .collect();
            return Err(SimError::Deadlock { stuck });
        }
    }
    for from in 0..p {
        for to in 0..p {
            if !queues[from * p + to].is_empty() {
                return Err(SimError::Leftover { from, to });
            }
        }
    }
    Ok(())
}
