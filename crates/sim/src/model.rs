//! The reference model: what every region must contain after a run, given which operations
//! were executed.
//!
//! Operations of one direction execute at the responder in posting order. Those before the
//! first operation that did not succeed (or before the last one whose receive completed) ran
//! exactly once, so their effects are known to the byte; a later one may have run partly
//! before the connection failed, so the bytes it targets are "unknown"; one at or after a
//! negative operation never ran, so it must have changed nothing. Every byte that is not
//! unknown must match exactly, which also proves that nothing outside a target range was
//! written.

use crate::op::OpKind;
use crate::workload::{DirectionPlan, PlannedOp, RemoteOffset, RemoteRegion, Span};

/// Whether (and how surely) the responder executed an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Execution {
    /// Exactly once.
    Certain,
    /// Perhaps, perhaps partly.
    Maybe,
    /// Not at all.
    Never,
}

/// Expected contents of one region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedRegion {
    /// Name for reports.
    pub name: &'static str,
    /// Expected bytes.
    pub bytes: Vec<u8>,
    /// Bytes whose value the model cannot know.
    pub unknown: Vec<bool>,
}

impl ExpectedRegion {
    fn new(name: &'static str, initial: &[u8]) -> Self {
        Self { name, bytes: initial.to_vec(), unknown: vec![false; initial.len()] }
    }

    fn set(&mut self, offset: usize, data: &[u8]) {
        self.bytes[offset..offset + data.len()].copy_from_slice(data);
        self.unknown[offset..offset + data.len()].fill(false);
    }

    fn forget(&mut self, offset: usize, len: usize) {
        self.unknown[offset..offset + len].fill(true);
    }

    fn scatter(&mut self, spans: &[Span], data: &[u8]) {
        let mut rest = data;
        for span in spans {
            let n = span.len.min(rest.len());
            self.set(span.offset, &rest[..n]);
            rest = &rest[n..];
        }
    }

    fn forget_spans(&mut self, spans: &[Span]) {
        for span in spans {
            self.forget(span.offset, span.len);
        }
    }

    fn word(&self, offset: usize) -> u64 {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&self.bytes[offset..offset + 8]);
        u64::from_ne_bytes(bytes)
    }

    /// The first byte where `actual` differs from the expectation: (offset, expected, actual).
    pub fn first_mismatch(&self, actual: &[u8]) -> Option<(usize, u8, u8)> {
        if actual.len() != self.bytes.len() {
            return Some((actual.len().min(self.bytes.len()), 0, 0));
        }
        self.bytes
            .iter()
            .zip(actual)
            .enumerate()
            .find(|(i, (want, got))| !self.unknown[*i] && want != got)
            .map(|(i, (want, got))| (i, *want, *got))
    }
}

/// What the model expects of a direction, given the observed execution of each operation.
#[derive(Clone, Debug)]
pub struct DirectionModel {
    /// Requester regions, then responder regions (see [`DirectionModel::regions`]).
    pub src: ExpectedRegion,
    /// READ/atomic destination.
    pub sink: ExpectedRegion,
    /// WRITE/READ/atomic target.
    pub target: ExpectedRegion,
    /// Receive buffers.
    pub recv_area: ExpectedRegion,
    /// Region without remote write.
    pub no_write: ExpectedRegion,
    /// Region without remote read/atomic.
    pub no_read: ExpectedRegion,
    /// Regions SENDs with invalidate name.
    pub invalidatable: Vec<ExpectedRegion>,
    /// Per operation: the value an atomic found (its expected result).
    pub atomic_results: Vec<Option<u64>>,
}

/// What the checker learned about each operation before building the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpFacts {
    /// How surely the responder executed it.
    pub execution: Execution,
    /// Whether the requester saw it succeed (so READ/atomic results have landed).
    pub succeeded: bool,
}

/// The region offset of a valid target access.
pub fn target_offset(op: &PlannedOp) -> Option<usize> {
    match op.remote {
        Some(remote)
            if remote.region == RemoteRegion::Target && !remote.bad_rkey && op.negative.is_none() =>
        {
            match remote.offset {
                RemoteOffset::At(offset) => Some(offset),
                _ => None,
            }
        }
        _ => None,
    }
}

impl DirectionModel {
    /// Runs the operations of `plan` with the given facts and returns the expected memory.
    /// `recv_succeeded[i]` tells whether receive `i` completed successfully.
    pub fn build(plan: &DirectionPlan, facts: &[OpFacts], recv_succeeded: &[bool]) -> DirectionModel {
        let mut model = DirectionModel {
            src: ExpectedRegion::new("src", &plan.src),
            sink: ExpectedRegion::new("sink", &plan.sink),
            target: ExpectedRegion::new("target", &plan.target),
            recv_area: ExpectedRegion::new("recv", &plan.recv_area),
            no_write: ExpectedRegion::new("no_write", &plan.no_write),
            no_read: ExpectedRegion::new("no_read", &plan.no_read),
            invalidatable: plan
                .invalidatable
                .iter()
                .map(|b| ExpectedRegion::new("invalidatable", b))
                .collect(),
            atomic_results: vec![None; plan.ops.len()],
        };
        for (op, fact) in plan.ops.iter().zip(facts) {
            model.apply(op, *fact);
        }
        for (recv, &ok) in plan.recvs.iter().zip(recv_succeeded) {
            let op = &plan.ops[recv.op];
            if op.kind == OpKind::WriteImm {
                continue; // its receive buffers are never written
            }
            if ok {
                model.recv_area.scatter(&recv.sges, &op.data);
            } else if facts.get(recv.op).is_some_and(|f| f.execution != Execution::Never) {
                model.recv_area.forget_spans(&recv.sges);
            }
        }
        model
    }

    fn apply(&mut self, op: &PlannedOp, fact: OpFacts) {
        let offset = target_offset(op);
        match (op.kind, fact.execution, offset) {
            (_, Execution::Never, _) => {}
            (OpKind::Write | OpKind::WriteImm, Execution::Certain, Some(offset)) => {
                self.target.set(offset, &op.data)
            }
            (OpKind::Write | OpKind::WriteImm, Execution::Maybe, Some(offset)) => {
                self.target.forget(offset, op.len)
            }
            (OpKind::Read, _, Some(offset)) => {
                if fact.succeeded {
                    let data = self.target.bytes[offset..offset + op.len].to_vec();
                    self.sink.scatter(&op.sink, &data);
                } else {
                    self.sink.forget_spans(&op.sink);
                }
            }
            (OpKind::CmpSwap | OpKind::FetchAdd, execution, Some(offset)) => {
                let args = op.atomic.unwrap_or(crate::workload::AtomicArgs { compare: 0, operand: 0 });
                if execution == Execution::Certain {
                    let old = self.target.word(offset);
                    let new = if op.kind == OpKind::CmpSwap {
                        if old == args.compare {
                            args.operand
                        } else {
                            old
                        }
                    } else {
                        old.wrapping_add(args.operand)
                    };
                    self.target.set(offset, &new.to_ne_bytes());
                    self.atomic_results[op.index] = Some(old);
                    if fact.succeeded {
                        self.sink.scatter(&op.sink, &old.to_ne_bytes());
                    } else {
                        self.sink.forget_spans(&op.sink);
                    }
                } else {
                    self.target.forget(offset, 8);
                    self.sink.forget_spans(&op.sink);
                }
            }
            // Negative operations write nothing anywhere; failed ones may have left a partial
            // READ or atomic result behind.
            (OpKind::Read | OpKind::CmpSwap | OpKind::FetchAdd, _, None)
                if !fact.succeeded && op.negative.is_none() =>
            {
                self.sink.forget_spans(&op.sink);
            }
            _ => {}
        }
    }

    /// Every expected region with its index among the direction's regions, requester side
    /// first: src, sink, target, recv, no_write, no_read, invalidatable….
    pub fn regions(&self) -> Vec<&ExpectedRegion> {
        let mut all =
            vec![&self.src, &self.sink, &self.target, &self.recv_area, &self.no_write, &self.no_read];
        all.extend(self.invalidatable.iter());
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::workload::Workload;

    #[test]
    fn certain_ops_are_exact_maybe_ops_unknown_never_ops_absent() {
        let mut config = SimConfig::default();
        config.workload.ops = vec![OpKind::Write];
        config.workload.min_ops = 3;
        config.workload.max_ops = 3;
        config.workload.negative = 0.0;
        let workload = Workload::generate(&config, 5);
        let plan = &workload.directions[0];
        let facts = [
            OpFacts { execution: Execution::Certain, succeeded: true },
            OpFacts { execution: Execution::Maybe, succeeded: false },
            OpFacts { execution: Execution::Never, succeeded: false },
        ];
        let model = DirectionModel::build(plan, &facts, &[]);
        let at = |i: usize| target_offset(&plan.ops[i]).unwrap();
        let first = &plan.ops[0];
        let second = &plan.ops[1];
        if first.len > 0 {
            assert_eq!(&model.target.bytes[at(0)..at(0) + first.len], first.data.as_slice());
        }
        assert!(model.target.unknown[at(1)..at(1) + second.len].iter().all(|u| *u));
        // The never-executed third write leaves its range as it was (unless an earlier write
        // covered it).
        let third = &plan.ops[2];
        for i in at(2)..at(2) + third.len {
            let covered = (at(0)..at(0) + first.len).contains(&i) || (at(1)..at(1) + second.len).contains(&i);
            if !covered {
                assert_eq!(model.target.bytes[i], plan.target[i]);
            }
        }
        let mut actual = model.target.bytes.clone();
        assert_eq!(model.target.first_mismatch(&actual), None);
        let outside = plan.target.len() - 1;
        actual[outside] ^= 1;
        assert_eq!(model.target.first_mismatch(&actual).map(|m| m.0), Some(outside));
    }
}
