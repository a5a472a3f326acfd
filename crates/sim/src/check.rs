//! The invariant checker: compares what a run did with what the model says it must have done.
//!
//! Checked per direction: every posted work request completes exactly once and in order
//! (signaled ones with a completion, unsignaled ones silently unless they fail), with an
//! allowed status — successes, then at most one error, then flushes; completions carry the
//! right opcode, lengths, immediate data and QP numbers; receives match the messages that
//! consumed them; every region holds exactly what the model expects, its guards are intact,
//! and the engine never accessed memory out of bounds. Clean runs must also leave every QP in
//! RTS.
//!
//! The one error a direction may report is exact:
//! * a negative request fails with its own status (REM_ACCESS_ERR or REM_INV_REQ_ERR), and
//!   every request before it succeeds — on any network that loses nothing, however it
//!   reorders or duplicates;
//! * if the network loses datagrams, the NAK of a negative request (or an answer before it)
//!   may be lost while the responder is already in ERR: then the oldest incomplete request
//!   at or before the negative one ends in RETRY_EXC_ERR instead (digest §6.3, §6.7);
//! * RETRY_EXC_ERR anywhere only when the faults make it likely
//!   ([`SimConfig::may_exhaust_retries`]) or a node died;
//! * the other direction of a connection with a negative request reports no error at all:
//!   its requester is the QP that went to ERR, so everything it has outstanding is flushed.

use std::collections::BTreeMap;

use lightpath_verbs::{QpState, WcStatus, WorkCompletion};

use crate::config::SimConfig;
use crate::driver::{recv_wr_id, send_wr_id, DirectionObservation, Observation};
use crate::model::{DirectionModel, Execution, OpFacts};
use crate::op::{Negative, OpKind};
use crate::report::OpCounts;
use crate::workload::{DirectionPlan, Workload};

/// At most this many failures are kept per run (the first ones matter).
const MAX_FAILURES: usize = 20;

/// How one send work request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Never handed to the engine (its node died first).
    NotPosted,
    /// Refused by `post_send` while the QP was in ERR (equivalent to a flush).
    RefusedInError,
    /// Refused by `post_send` as locally invalid (only allowed for misaligned atomics).
    RefusedLocally,
    /// A completion with this status.
    Completed(WcStatus),
    /// Unsignaled and followed by a completed request: succeeded silently.
    Silent,
    /// No completion although one was due.
    Missing,
}

impl Outcome {
    fn is_success(self) -> bool {
        matches!(self, Outcome::Completed(WcStatus::Success) | Outcome::Silent)
    }

    fn is_flush(self) -> bool {
        matches!(self, Outcome::Completed(WcStatus::WrFlushErr) | Outcome::RefusedInError)
    }
}

/// What the checker found in one run.
#[derive(Debug, Default)]
pub struct CheckResult {
    /// Violated invariants.
    pub failures: Vec<String>,
    /// Per operation kind.
    pub ops: BTreeMap<OpKind, OpCounts>,
    /// Application bytes of successful operations.
    pub bytes_delivered: u64,
    /// Requests that ended with RETRY_EXC_ERR.
    pub retry_exhausted: u64,
    /// Directions whose connection carried a damaged datagram that an engine processed
    /// (see [`Observation::undetected_corruption`]): only memory safety is checked there.
    pub unverifiable: u64,
}

impl CheckResult {
    fn fail(&mut self, message: String) {
        if self.failures.len() < MAX_FAILURES {
            self.failures.push(message);
        }
    }
}

/// Checks every invariant of a run.
pub fn check(config: &SimConfig, workload: &Workload, obs: &Observation) -> CheckResult {
    let mut result = CheckResult::default();
    if let Some(abort) = &obs.abort {
        result.fail(abort.clone());
    }
    for (d, (plan, dir_obs)) in workload.directions.iter().zip(&obs.directions).enumerate() {
        DirectionCheck::new(config, workload, obs, d, plan, dir_obs).run(&mut result);
    }
    result
}

struct DirectionCheck<'a> {
    config: &'a SimConfig,
    obs: &'a Observation,
    d: usize,
    plan: &'a DirectionPlan,
    dir: &'a DirectionObservation,
    /// Some operation of this connection is a negative case.
    connection_negative: bool,
    requester_alive: bool,
    responder_alive: bool,
}

impl<'a> DirectionCheck<'a> {
    fn new(
        config: &'a SimConfig,
        workload: &'a Workload,
        obs: &'a Observation,
        d: usize,
        plan: &'a DirectionPlan,
        dir: &'a DirectionObservation,
    ) -> Self {
        let connection_negative = workload
            .directions
            .iter()
            .filter(|other| other.connection == plan.connection)
            .any(|other| other.negative_index().is_some());
        let alive = |node: usize| obs.alive.get(node).copied().unwrap_or(true);
        Self {
            config,
            obs,
            d,
            plan,
            dir,
            connection_negative,
            requester_alive: alive(plan.requester),
            responder_alive: alive(plan.responder),
        }
    }

    fn label(&self, index: usize) -> String {
        let op = &self.plan.ops[index];
        let negative = op.negative.map(|n| format!(" ({n:?})")).unwrap_or_default();
        format!(
            "dir {} ({}->{}) op #{index} {}{negative} len {}",
            self.d, self.plan.requester, self.plan.responder, op.kind, op.len
        )
    }

    /// Whether the network or the nodes may make any request of this direction run out of
    /// retries, whatever the workload.
    fn may_exhaust_anywhere(&self) -> bool {
        self.config.may_exhaust_retries() || !self.requester_alive || !self.responder_alive
    }

    /// Whether op `index` may legitimately end with RETRY_EXC_ERR.
    ///
    /// Besides the faults of [`Self::may_exhaust_anywhere`], exactly one case allows it: a
    /// negative request moves the responder to ERR (class C error, digest §6.10 and §9.16),
    /// after which it answers nothing. If the NAK, or the response to an earlier READ/atomic,
    /// is lost, the requester retries into silence and the oldest incomplete request — the
    /// negative one or one before it — ends with RETRY_EXC_ERR (digest §6.3: a NAK past an
    /// unanswered READ/atomic is a lost response, so the retry starts there). Over a network
    /// that loses nothing (however it reorders or duplicates) every answer arrives, so the
    /// negative request must fail with its own error.
    fn may_exhaust_at(&self, index: usize) -> bool {
        if self.may_exhaust_anywhere() {
            return true;
        }
        let negative = self.plan.negative_index().filter(|&k| self.dir.refused[k].is_none());
        negative.is_some_and(|k| index <= k) && !self.config.is_lossless()
    }

    /// Whether this connection's QPs may legitimately end in ERR.
    fn may_fail(&self) -> bool {
        self.may_exhaust_anywhere() || self.connection_negative
    }

    fn run(&self, result: &mut CheckResult) {
        if self.dir.regions.is_none() {
            return; // setup failed; already reported
        }
        let (a, b) = (self.plan.requester, self.plan.responder);
        if self
            .obs
            .undetected_corruption
            .iter()
            .any(|&(from, to)| (from, to) == (a, b) || (from, to) == (b, a))
        {
            // A damaged datagram passed the ICRC check (possible over IPv4 only): it may have
            // changed anything on this connection, so no completion or byte can be predicted.
            // What still must hold is memory safety: no access outside a region.
            result.unverifiable += 1;
            self.check_memory_safety(result);
            return;
        }
        let outcomes = self.send_outcomes(result);
        self.check_statuses(&outcomes, result);
        let recv_ok = self.check_recvs(&outcomes, result);
        let facts = self.facts(&outcomes, &recv_ok);
        let model = DirectionModel::build(self.plan, &facts, &recv_ok);
        self.check_results(&outcomes, &model, result);
        self.check_memory(&model, result);
        self.check_final_states(result);
        self.count(&outcomes, result);
    }

    /// Matches send completions to operations and checks identity, order and uniqueness.
    fn send_outcomes(&self, result: &mut CheckResult) -> Vec<Outcome> {
        let n = self.plan.ops.len();
        let mut wcs: Vec<Option<&WorkCompletion>> = vec![None; n];
        let mut last_index: Option<usize> = None;
        for wc in &self.dir.send_wcs {
            let index = (0..n).find(|&i| send_wr_id(self.d, i) == wc.wr_id);
            let Some(index) = index else {
                result.fail(format!(
                    "dir {}: send completion with unknown wr_id {:#x}: {wc:?}",
                    self.d, wc.wr_id
                ));
                continue;
            };
            if wc.qp_num != self.dir.requester_qpn {
                result.fail(format!(
                    "{}: completion names QP {:#x}, not {:#x}",
                    self.label(index),
                    wc.qp_num,
                    self.dir.requester_qpn
                ));
            }
            if wcs[index].is_some() {
                result.fail(format!(
                    "{}: completed twice ({:?} then {:?})",
                    self.label(index),
                    wcs[index].map(|w| w.status),
                    wc.status
                ));
                continue;
            }
            if last_index.is_some_and(|last| index < last) {
                result.fail(format!(
                    "{}: completed after a later request (send completions out of order)",
                    self.label(index)
                ));
            }
            last_index = Some(index);
            wcs[index] = Some(wc);
        }
        let last_completed = wcs.iter().rposition(Option::is_some);
        (0..n)
            .map(|i| {
                let op = &self.plan.ops[i];
                if !self.dir.posted[i] {
                    return Outcome::NotPosted;
                }
                if let Some(refusal) = &self.dir.refused[i] {
                    return if refusal.qp_state == Some(QpState::Err) {
                        Outcome::RefusedInError
                    } else if op.negative == Some(Negative::MisalignedAtomic) {
                        Outcome::RefusedLocally
                    } else {
                        result.fail(format!("{}: post_send refused: {}", self.label(i), refusal.error));
                        Outcome::RefusedLocally
                    };
                }
                match wcs[i] {
                    Some(wc) => Outcome::Completed(wc.status),
                    None if !op.signaled && last_completed.is_some_and(|last| last > i) => Outcome::Silent,
                    None => Outcome::Missing,
                }
            })
            .collect()
    }

    /// Checks the sequence of statuses: successes, then at most one allowed error, then flushes.
    fn check_statuses(&self, outcomes: &[Outcome], result: &mut CheckResult) {
        let negative = self.plan.negative_index();
        let mut failed_at: Option<usize> = None;
        let mut errors = 0;
        for (i, &outcome) in outcomes.iter().enumerate() {
            let op = &self.plan.ops[i];
            match outcome {
                Outcome::NotPosted | Outcome::RefusedLocally => {}
                Outcome::Missing => {
                    if self.requester_alive && self.obs.abort.is_none() {
                        result.fail(format!("{}: never completed", self.label(i)));
                    }
                    failed_at.get_or_insert(i);
                }
                Outcome::Silent | Outcome::Completed(WcStatus::Success) => {
                    if let Some(first) = failed_at {
                        result.fail(format!("{}: succeeded after op #{first} had failed", self.label(i)));
                    }
                    if op.negative.is_some() {
                        result.fail(format!(
                            "{}: succeeded although it must fail with {:?}",
                            self.label(i),
                            op.negative.map(|n| n.expected_status())
                        ));
                    }
                    if let (Outcome::Completed(_), false) = (outcome, op.signaled) {
                        result.fail(format!(
                            "{}: unsignaled request reported a successful completion",
                            self.label(i)
                        ));
                    }
                }
                _ if outcome.is_flush() => {
                    if !self.may_fail() {
                        result.fail(format!("{}: flushed in a run where nothing may fail", self.label(i)));
                    } else if self.config.is_lossless()
                        && negative.is_some_and(|k| failed_at.is_none() && i <= k)
                    {
                        // Lossless: the negative request itself must be the first to fail.
                        result.fail(format!(
                            "{}: flushed before the negative op #{} failed",
                            self.label(i),
                            negative.unwrap_or(0)
                        ));
                    }
                    failed_at.get_or_insert(i);
                }
                Outcome::Completed(status) => {
                    errors += 1;
                    if status == WcStatus::RetryExcErr {
                        result.retry_exhausted += 1;
                    }
                    if let Some(first) = failed_at.filter(|_| errors == 1) {
                        result.fail(format!(
                            "{}: error {status:?} reported after op #{first} had already ended with {:?} (completions must report the first error, then flushes)",
                            self.label(i),
                            outcomes[first]
                        ));
                    } else if errors > 1 {
                        result
                            .fail(format!("{}: a second error {status:?} (expected a flush)", self.label(i)));
                    }
                    failed_at.get_or_insert(i);
                    let expected = op.negative.map(Negative::expected_status);
                    let allowed = Some(status) == expected
                        || (status == WcStatus::RetryExcErr && self.may_exhaust_at(i));
                    if !allowed {
                        let want = match expected {
                            Some(s) => format!("{s:?}"),
                            None => "success".to_string(),
                        };
                        result.fail(format!("{}: completed with {status:?}, expected {want}", self.label(i)));
                    }
                    if self.config.is_lossless() && negative.is_some_and(|k| i < k) && expected.is_none() {
                        result.fail(format!(
                            "{}: failed before the negative op #{}",
                            self.label(i),
                            negative.unwrap_or(0)
                        ));
                    }
                }
                _ => {}
            }
        }
        if self.config.is_black_hole() && self.requester_alive {
            // Nothing ever arrives: the first request must exhaust its retries, the rest flush.
            let first =
                outcomes.iter().position(|o| !matches!(o, Outcome::NotPosted | Outcome::RefusedLocally));
            if let Some(first) = first {
                if outcomes[first] != Outcome::Completed(WcStatus::RetryExcErr) {
                    result.fail(format!(
                        "{}: expected RetryExcErr on a black-hole link, got {:?}",
                        self.label(first),
                        outcomes[first]
                    ));
                }
            }
        }
        if let (Some(k), true) = (negative, self.config.is_lossless()) {
            if outcomes[k] == Outcome::Missing || outcomes[k].is_success() {
                return;
            }
            if failed_at == Some(k) && outcomes[k].is_flush() {
                result.fail(format!("{}: flushed instead of failing with its own error", self.label(k)));
            }
        }
    }

    /// Checks the receive queue; returns per receive whether it completed successfully.
    fn check_recvs(&self, outcomes: &[Outcome], result: &mut CheckResult) -> Vec<bool> {
        let n = self.plan.recvs.len();
        let mut wcs: Vec<Option<&WorkCompletion>> = vec![None; n];
        let mut last: Option<usize> = None;
        for wc in &self.dir.recv_wcs {
            let Some(index) = (0..n).find(|&i| recv_wr_id(self.d, i) == wc.wr_id) else {
                result.fail(format!(
                    "dir {}: receive completion with unknown wr_id {:#x}: {wc:?}",
                    self.d, wc.wr_id
                ));
                continue;
            };
            let label = format!(
                "dir {} recv #{index} (for op #{} {})",
                self.d, self.plan.recvs[index].op, self.plan.ops[self.plan.recvs[index].op].kind
            );
            if wcs[index].is_some() {
                result.fail(format!("{label}: completed twice"));
                continue;
            }
            if last.is_some_and(|l| index < l) {
                result.fail(format!("{label}: receive completions out of order"));
            }
            if wc.qp_num != self.dir.responder_qpn {
                result.fail(format!(
                    "{label}: completion names QP {:#x}, not {:#x}",
                    wc.qp_num, self.dir.responder_qpn
                ));
            }
            last = Some(index);
            wcs[index] = Some(wc);
        }
        let negative = self.plan.negative_index();
        let mut failed = false;
        let mut ok = vec![false; n];
        for (index, recv) in self.plan.recvs.iter().enumerate() {
            let op = &self.plan.ops[recv.op];
            let label =
                format!("dir {} recv #{index} (for op #{} {} len {})", self.d, recv.op, op.kind, op.len);
            if let Some(refusal) = &self.dir.recv_refused[index] {
                if refusal.qp_state != Some(QpState::Err) {
                    result.fail(format!("{label}: post_recv refused: {}", refusal.error));
                }
                failed = true;
                continue;
            }
            match wcs[index] {
                Some(wc) if wc.status == WcStatus::Success => {
                    ok[index] = true;
                    if failed {
                        result.fail(format!("{label}: succeeded after an earlier receive failed"));
                    }
                    if negative.is_some_and(|k| recv.op > k) {
                        result.fail(format!(
                            "{label}: completed although op #{} before it must have failed",
                            negative.unwrap_or(0)
                        ));
                    }
                    let expected_opcode = op.kind.recv_wc_opcode();
                    if Some(wc.opcode) != expected_opcode {
                        result.fail(format!("{label}: opcode {:?}, expected {expected_opcode:?}", wc.opcode));
                    }
                    if wc.byte_len as usize != op.len {
                        result.fail(format!("{label}: byte_len {}, expected {}", wc.byte_len, op.len));
                    }
                    if wc.imm_data != op.imm {
                        result.fail(format!("{label}: imm_data {:?}, expected {:?}", wc.imm_data, op.imm));
                    }
                    let expected_inv = op.invalidate.and_then(|i| self.dir.invalidated_rkeys.get(i).copied());
                    if wc.invalidated_rkey != expected_inv {
                        result.fail(format!(
                            "{label}: invalidated_rkey {:?}, expected {expected_inv:?}",
                            wc.invalidated_rkey
                        ));
                    }
                    if wc.src_qp != self.dir.requester_qpn {
                        result.fail(format!(
                            "{label}: src_qp {:#x}, expected {:#x}",
                            wc.src_qp, self.dir.requester_qpn
                        ));
                    }
                }
                Some(wc) => {
                    failed = true;
                    if wc.status != WcStatus::WrFlushErr || !self.may_fail() {
                        result.fail(format!("{label}: completed with {:?}", wc.status));
                    }
                }
                None => {
                    let sender_succeeded = outcomes.get(recv.op).is_some_and(|o| o.is_success());
                    let in_error = self.dir.final_states.1 == Some(QpState::Err);
                    let posted = self.dir.recvs_posted[index];
                    if self.responder_alive
                        && posted
                        && self.obs.abort.is_none()
                        && (sender_succeeded || in_error)
                    {
                        result.fail(format!(
                            "{label}: never completed (sender {}, responder QP {:?})",
                            if sender_succeeded { "succeeded" } else { "failed" },
                            self.dir.final_states.1
                        ));
                    }
                    failed = true;
                }
            }
            if outcomes.get(recv.op).is_some_and(|o| o.is_success()) && !ok[index] {
                result.fail(format!("{label}: the sender succeeded but the receive did not"));
            }
        }
        ok
    }

    /// Derives how surely each operation executed at the responder.
    fn facts(&self, outcomes: &[Outcome], recv_ok: &[bool]) -> Vec<OpFacts> {
        let first_failure = outcomes.iter().position(|o| !o.is_success()).unwrap_or(outcomes.len());
        // A successful receive proves its message (and everything before it) executed.
        let proven = self
            .plan
            .recvs
            .iter()
            .zip(recv_ok)
            .filter(|(_, ok)| **ok)
            .map(|(r, _)| r.op + 1)
            .max()
            .unwrap_or(0);
        let executed_prefix = first_failure.max(proven);
        let negative = self.plan.negative_index().filter(|&k| outcomes[k] != Outcome::RefusedLocally);
        outcomes
            .iter()
            .enumerate()
            .map(|(i, outcome)| {
                let never = negative.is_some_and(|k| i >= k)
                    || matches!(
                        outcome,
                        Outcome::NotPosted | Outcome::RefusedInError | Outcome::RefusedLocally
                    );
                let execution = if never {
                    Execution::Never
                } else if i < executed_prefix {
                    Execution::Certain
                } else {
                    Execution::Maybe
                };
                OpFacts { execution, succeeded: outcome.is_success() }
            })
            .collect()
    }

    /// Checks the completion fields of successful READs and atomics, and counts bytes.
    fn check_results(&self, outcomes: &[Outcome], model: &DirectionModel, result: &mut CheckResult) {
        for (i, op) in self.plan.ops.iter().enumerate() {
            let Some(wc) = self.dir.send_wcs.iter().find(|wc| wc.wr_id == send_wr_id(self.d, i)) else {
                continue;
            };
            if wc.status != WcStatus::Success {
                continue;
            }
            if wc.opcode != op.kind.send_wc_opcode() {
                result.fail(format!(
                    "{}: completion opcode {:?}, expected {:?}",
                    self.label(i),
                    wc.opcode,
                    op.kind.send_wc_opcode()
                ));
            }
            let expected_len = match op.kind {
                OpKind::Read => Some(op.len),
                OpKind::CmpSwap | OpKind::FetchAdd => Some(8),
                _ => None, // byte_len of SEND/WRITE completions is not defined by verbs
            };
            if let Some(len) = expected_len {
                if wc.byte_len as usize != len {
                    result.fail(format!("{}: byte_len {}, expected {len}", self.label(i), wc.byte_len));
                }
            }
            if op.kind.is_atomic() && model.atomic_results[i].is_none() {
                result.fail(format!("{}: succeeded but the model could not place it", self.label(i)));
            }
        }
        let _ = outcomes;
    }

    /// No engine access outside a region, and every guard intact.
    fn check_memory_safety(&self, result: &mut CheckResult) {
        let Some(regions) = self.dir.regions.as_ref() else { return };
        let mut all = vec![
            &regions.src,
            &regions.sink,
            &regions.target,
            &regions.recv_area,
            &regions.no_write,
            &regions.no_read,
        ];
        all.extend(regions.invalidatable.iter());
        for (i, region) in all.into_iter().enumerate() {
            if region.memory.violations() > 0 || !region.memory.guards_intact() {
                result.fail(format!(
                    "dir {} region #{i}: {} out-of-bounds accesses, guards {}",
                    self.d,
                    region.memory.violations(),
                    if region.memory.guards_intact() { "intact" } else { "overwritten" }
                ));
            }
        }
    }

    fn check_memory(&self, model: &DirectionModel, result: &mut CheckResult) {
        let Some(regions) = self.dir.regions.as_ref() else { return };
        let mut actual = vec![
            &regions.src,
            &regions.sink,
            &regions.target,
            &regions.recv_area,
            &regions.no_write,
            &regions.no_read,
        ];
        actual.extend(regions.invalidatable.iter());
        for (expected, region) in model.regions().into_iter().zip(actual) {
            let node = if matches!(expected.name, "src" | "sink") {
                self.plan.requester
            } else {
                self.plan.responder
            };
            let where_ = format!("dir {} node {node} region {}", self.d, expected.name);
            if region.memory.violations() > 0 {
                result.fail(format!(
                    "{where_}: {} out-of-bounds memory accesses by the engine",
                    region.memory.violations()
                ));
            }
            if !region.memory.guards_intact() {
                result.fail(format!("{where_}: guard bytes around the region were overwritten"));
            }
            if let Some((offset, want, got)) = expected.first_mismatch(&region.memory.snapshot()) {
                let culprit = self.covering_op(expected.name, offset);
                result.fail(format!("{where_}[{offset}]: expected {want:#04x}, found {got:#04x}{culprit}"));
            }
        }
    }

    /// Names the operation whose buffer covers `offset` of region `name`, for reports.
    fn covering_op(&self, name: &str, offset: usize) -> String {
        let inside = |spans: &[crate::workload::Span]| {
            spans.iter().any(|s| (s.offset..s.offset + s.len).contains(&offset))
        };
        for op in &self.plan.ops {
            let hit = match name {
                "sink" => inside(&op.sink),
                "target" => {
                    crate::model::target_offset(op).is_some_and(|o| (o..o + op.len).contains(&offset))
                }
                "recv" => op.recv.is_some_and(|r| inside(&self.plan.recvs[r].sges)),
                _ => false,
            };
            if hit {
                return format!(" (inside {})", self.label(op.index));
            }
        }
        " (outside every operation's range)".to_string()
    }

    fn check_final_states(&self, result: &mut CheckResult) {
        if self.may_fail() || self.obs.abort.is_some() {
            return;
        }
        let (requester, responder) = self.dir.final_states;
        for (role, state) in [("requester", requester), ("responder", responder)] {
            if let Some(state) = state {
                if state != QpState::Rts {
                    result
                        .fail(format!("dir {}: {role} QP ends in {state:?} although nothing failed", self.d));
                }
            }
        }
    }

    fn count(&self, outcomes: &[Outcome], result: &mut CheckResult) {
        // An operation passes when no failure message names it.
        for (i, op) in self.plan.ops.iter().enumerate() {
            let label = self.label(i);
            let (named, inside) = (format!("{label}:"), format!("{label})"));
            let failed = result.failures.iter().any(|f| f.contains(&named) || f.contains(&inside));
            let counts = result.ops.entry(op.kind).or_default();
            if outcomes[i] == Outcome::NotPosted {
                continue;
            }
            counts.posted += 1;
            if failed {
                counts.failed += 1;
            } else {
                counts.passed += 1;
            }
            if op.negative.is_some() {
                counts.negative += 1;
            }
            if outcomes[i].is_success() {
                counts.succeeded += 1;
                result.bytes_delivered += op.len as u64;
            }
        }
    }
}
