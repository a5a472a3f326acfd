//! The queue-pair state machine: `modify_qp` checks a transition and its attributes (the
//! rules live in `lightpath_verbs::QpAttr::validate_transition`), applies the attributes,
//! and sets up or tears down the requester and responder.

use lightpath_verbs::{Error, Gid, QpAttr, QpState, Result, MAX_LIGHTPATH_PMTU};

use super::requester::Requester;
use super::responder::Responder;
use super::timers::QpTimers;
use super::{Qp, MAX_RD_ATOMIC};
use crate::event::Ctx;
use crate::sport::udp_source_port;

impl Qp {
    /// Applies `attr`. Nothing changes when an error is returned.
    pub(crate) fn modify(&mut self, ctx: &mut Ctx<'_>, attr: &QpAttr, local_gid: Gid) -> Result<()> {
        let from = self.state;
        attr.validate_transition(from)?;
        let to = attr.state.unwrap_or(from);
        check_engine_limits(attr, local_gid)?;
        // The path MTU fixes how PSNs map to message offsets; changing it under traffic would
        // corrupt messages in flight, so it is only taken on the way to RTR.
        if (attr.path_mtu.is_some() || attr.lightpath_pmtu.is_some())
            && !matches!(to, QpState::Reset | QpState::Init | QpState::Rtr)
        {
            return Err(Error::InvalidAttribute("path_mtu can only be set up to the INIT->RTR transition"));
        }
        if attr.lightpath_pmtu.is_some()
            && !attr.av.map_or(self.params.lightpath_peer, |av| av.lightpath_peer)
        {
            return Err(Error::InvalidAttribute(
                "lightpath_pmtu is for a Lightpath soft peer (an address vector with lightpath_peer)",
            ));
        }
        if to == QpState::Reset {
            self.reset();
            return Ok(());
        }

        let p = &mut self.params;
        if let Some(access) = attr.access {
            p.access = access;
        }
        if let Some(av) = attr.av {
            p.peer_ip = av.dgid.to_ip();
            p.flow_label = av.flow_label;
            p.dst_port = av.udp_dport;
            p.lightpath_peer = av.lightpath_peer;
            p.lightpath_bundles = av.lightpath_peer && av.lightpath_bundles;
        }
        if let Some(mtu) = attr.path_mtu {
            p.pmtu = mtu.bytes();
        }
        if let Some(bytes) = attr.lightpath_pmtu {
            p.pmtu = bytes;
        }
        if let Some(qpn) = attr.dest_qp_num {
            p.dest_qpn = qpn;
        }
        if let Some(psn) = attr.rq_psn {
            p.rq_psn = psn;
        }
        if let Some(psn) = attr.sq_psn {
            p.sq_psn = psn;
        }
        if let Some(value) = attr.max_dest_rd_atomic {
            p.max_dest_rd_atomic = value;
        }
        if let Some(value) = attr.min_rnr_timer {
            p.min_rnr_timer = value;
        }
        if let Some(value) = attr.timeout {
            p.timeout = value;
        }
        if let Some(value) = attr.retry_cnt {
            p.retry_cnt = value;
        }
        if let Some(value) = attr.rnr_retry {
            p.rnr_retry = value;
        }
        if let Some(value) = attr.max_rd_atomic {
            p.max_rd_atomic = value;
        }
        p.src_port = udp_source_port(p.flow_label, self.qpn, p.dest_qpn);
        p.max_send_window = super::requester::send_window_bound(p.lightpath_peer, p.pmtu);

        match (from, to) {
            (_, QpState::Err) if from != QpState::Err => self.enter_error(ctx, false),
            (QpState::Init, QpState::Rtr) => {
                self.resp = Responder::start(self.params.rq_psn, self.params.max_dest_rd_atomic);
                self.answers_held = false;
                self.state = to;
            }
            (QpState::Rtr, QpState::Rts) => {
                self.req = Requester::start(self.params.sq_psn, self.params.retry_cnt, self.params.rnr_retry);
                self.req.window = self.max_send_window();
                self.state = to;
            }
            _ => self.state = to,
        }
        Ok(())
    }

    /// Any → RESET: every queue emptied without completions, every counter back to zero.
    fn reset(&mut self) {
        self.state = QpState::Reset;
        self.sq.clear();
        self.rq.clear();
        self.req = Requester::default();
        self.resp = Responder::default();
        self.answers_held = false;
        self.timers = QpTimers::default();
        let local_ip = self.params.local_ip;
        self.params = super::Params::new(local_ip);
    }
}

/// Checks what the verbs-level validation cannot know: this engine has one GID, one port and
/// one P_Key, and rxe's READ/atomic depth limit.
fn check_engine_limits(attr: &QpAttr, local_gid: Gid) -> Result<()> {
    if attr.port_num.is_some_and(|port| port != 1) {
        return Err(Error::InvalidAttribute("port_num: the engine has one port (1)"));
    }
    if attr.pkey_index.is_some_and(|index| index != 0) {
        return Err(Error::InvalidAttribute("pkey_index: only index 0 (P_Key 0xFFFF) exists"));
    }
    if let Some(av) = attr.av {
        if av.sgid_index != 0 {
            return Err(Error::InvalidAttribute("sgid_index: the engine has one GID (index 0)"));
        }
        if av.dgid.is_ipv4_mapped() != local_gid.is_ipv4_mapped() {
            return Err(Error::InvalidAttribute("dgid and the local GID are of different IP versions"));
        }
    }
    if attr.lightpath_pmtu.is_some_and(|bytes| !(256..=MAX_LIGHTPATH_PMTU).contains(&bytes)) {
        return Err(Error::InvalidAttribute("lightpath_pmtu outside 256..=32768 bytes"));
    }
    if attr.dest_qp_num == Some(0) {
        return Err(Error::InvalidAttribute("dest_qp_num 0 is not a valid QPN"));
    }
    if attr.max_rd_atomic.is_some_and(|v| v > MAX_RD_ATOMIC)
        || attr.max_dest_rd_atomic.is_some_and(|v| v > MAX_RD_ATOMIC)
    {
        return Err(Error::InvalidAttribute("max_rd_atomic / max_dest_rd_atomic above 128"));
    }
    Ok(())
}
