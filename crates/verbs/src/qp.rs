//! Queue-pair states, capabilities and the attributes each state transition takes.

use crate::{AccessFlags, Gid, Mtu};

/// Queue-pair state. Discriminants are libibverbs' `ibv_qp_state` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Freshly created or reset: nothing is accepted or sent.
    Reset,
    /// Receives may be posted; nothing flows yet.
    Init,
    /// Ready to receive: the responder accepts requests.
    Rtr,
    /// Ready to send: the requester may transmit.
    Rts,
    /// Send queue drained: no new send requests start.
    Sqd,
    /// Send queue error (UC/UD only; RC errors go to `Err`).
    Sqe,
    /// Error: every outstanding and newly posted request is flushed.
    Err,
}

impl QpState {
    /// The libibverbs numeric value.
    pub fn to_raw(self) -> u32 {
        match self {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::Rtr => 2,
            QpState::Rts => 3,
            QpState::Sqd => 4,
            QpState::Sqe => 5,
            QpState::Err => 6,
        }
    }

    /// From the libibverbs numeric value, refusing unknown values.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            _ => return None,
        })
    }
}

/// Sizes fixed when a queue pair is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send requests that may be outstanding.
    pub max_send_wr: u32,
    /// Receive requests that may be posted.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 256 }
    }
}

/// How to reach the peer: RoCE always uses a global route (GRH), so a GID is mandatory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressVector {
    /// The peer's GID (its IP address).
    pub dgid: Gid,
    /// Index of the local GID to send from.
    pub sgid_index: u8,
    /// IPv4 TTL / IPv6 hop limit.
    pub hop_limit: u8,
    /// IPv4 TOS / IPv6 traffic class.
    pub traffic_class: u8,
    /// IPv6 flow label (0 = derive from the QP numbers, as rxe does for the UDP source port).
    pub flow_label: u32,
    /// Service level.
    pub sl: u8,
    /// Local port number (1-based).
    pub port_num: u8,
    /// UDP destination port of the peer's RoCE v2 endpoint; 0 means the provider's default
    /// (the soft device's own port, 4791 for hardware). Real RNICs and rxe listen only on
    /// 4791; Lightpath soft devices may listen elsewhere so several processes share an
    /// address. The ibverbs provider refuses any other value than 0 or 4791 (libibverbs cannot
    /// choose the port); the shared-memory provider ignores it (GIDs are its addresses).
    pub udp_dport: u16,
    /// The peer is a Lightpath soft device (the stream negotiation knows: only soft devices
    /// advertise their UDP port). Between two such devices the ICRC is neither computed nor
    /// checked (UDP's checksum covers the same bytes), so the sender's kernel may also
    /// renumber the IP IDs of the datagrams it cuts from one large send: the soft provider
    /// hands runs of same-size datagrams to UDP segmentation offload (one system call and one
    /// trip through the stack for up to 64 KiB). Such a peer keeps up with a wider send
    /// window (1,024 PSNs or 4 MiB in flight instead of rxe's 128 PSNs), and may take a larger
    /// path MTU ([`QpAttr::lightpath_pmtu`]). Never set it towards Linux rxe or an RNIC: they
    /// check the ICRC and would drop every datagram. False by default; IPv6 (no ID) and
    /// loopback peers are segmented regardless; other providers ignore it.
    pub lightpath_peer: bool,
    /// The peer (a Lightpath soft device, `lightpath_peer`) takes an acknowledgement and a
    /// request in one datagram: the 20-byte RC Acknowledge first, the request right behind it.
    /// Request/response traffic then sends one datagram per message instead of two (the
    /// acknowledgement of the peer's last message rides with this side's next one), which
    /// halves the kernel's per-datagram work. The stream negotiation sets it when both sides
    /// speak stream protocol version 3. Only with `lightpath_peer`; false by default; other
    /// providers ignore it.
    pub lightpath_bundles: bool,
}

impl AddressVector {
    /// A route to `dgid` from local GID index `sgid_index` with the defaults rdma-core's
    /// examples use (hop limit 64, traffic class 0, port 1) and the provider's default UDP
    /// destination port.
    pub fn new(dgid: Gid, sgid_index: u8) -> Self {
        Self {
            dgid,
            sgid_index,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            sl: 0,
            port_num: 1,
            udp_dport: 0,
            lightpath_peer: false,
            lightpath_bundles: false,
        }
    }
}

/// Attributes for `modify_qp`. A field that is `Some` is applied (it is in the attribute mask);
/// `None` leaves the current value. Which fields each transition requires follows the verbs
/// specification for RC: see [`QpAttr::required_for`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAttr {
    /// Target state.
    pub state: Option<QpState>,
    /// Port number (RESET→INIT).
    pub port_num: Option<u8>,
    /// P_Key index (RESET→INIT; 0 = the default 0xFFFF).
    pub pkey_index: Option<u16>,
    /// Remote operations this QP accepts as responder (RESET→INIT).
    pub access: Option<AccessFlags>,
    /// Route to the peer (INIT→RTR).
    pub av: Option<AddressVector>,
    /// Path MTU (INIT→RTR).
    pub path_mtu: Option<Mtu>,
    /// A Lightpath extension: a path MTU in bytes beyond InfiniBand's five sizes, between two
    /// Lightpath soft devices (INIT→RTR, with an address vector whose `lightpath_peer` is
    /// set). Any size from 256 to [`MAX_LIGHTPATH_PMTU`](crate::MAX_LIGHTPATH_PMTU) that the
    /// link carries ([`lightpath_pmtu_for_link`](crate::lightpath_pmtu_for_link)): 32 KiB on
    /// loopback, 1408 bytes on a 1500-byte Ethernet link (where IB's largest fitting size is
    /// 1024), 8896 on a 9000-byte one; soft devices offer at most
    /// [`PREFERRED_LIGHTPATH_PMTU`](crate::PREFERRED_LIGHTPATH_PMTU), 32,448 bytes. Fewer, larger packets cost fewer system calls, headers
    /// and acknowledgements per byte. Both ends must set the same value (the stream
    /// negotiation takes the smaller of the two sides' offers); it replaces `path_mtu`, which
    /// stays required. Providers other than soft ignore it; the soft provider refuses a size
    /// its link cannot carry ([`Error::PathMtuTooLarge`](crate::Error::PathMtuTooLarge)).
    pub lightpath_pmtu: Option<u32>,
    /// Peer queue pair number (INIT→RTR).
    pub dest_qp_num: Option<u32>,
    /// Expected PSN of the first incoming request = the peer's `sq_psn` (INIT→RTR).
    pub rq_psn: Option<u32>,
    /// READ/atomic requests this QP can hold as responder (INIT→RTR).
    pub max_dest_rd_atomic: Option<u8>,
    /// RNR timer code advertised in RNR NAKs (INIT→RTR).
    pub min_rnr_timer: Option<u8>,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout, 0 = infinite (RTR→RTS).
    pub timeout: Option<u8>,
    /// Transport retries (RTR→RTS).
    pub retry_cnt: Option<u8>,
    /// RNR retries, 7 = infinite (RTR→RTS).
    pub rnr_retry: Option<u8>,
    /// PSN of the first request sent (RTR→RTS).
    pub sq_psn: Option<u32>,
    /// READ/atomic requests this QP may have outstanding as requester (RTR→RTS).
    pub max_rd_atomic: Option<u8>,
}

/// Names of the attributes a transition requires, used in error messages.
pub type AttrName = &'static str;

impl QpAttr {
    /// An attribute set that only changes the state.
    pub fn state(state: QpState) -> Self {
        Self { state: Some(state), ..Self::default() }
    }

    /// RESET→INIT with port 1, P_Key index 0 and the given responder access.
    pub fn to_init(access: AccessFlags) -> Self {
        Self {
            state: Some(QpState::Init),
            port_num: Some(1),
            pkey_index: Some(0),
            access: Some(access),
            ..Self::default()
        }
    }

    /// INIT→RTR towards `dest_qp_num` at `av`, with rdma-core's usual defaults
    /// (`max_dest_rd_atomic` 16, `min_rnr_timer` 12 = 0.64 ms).
    pub fn to_rtr(av: AddressVector, path_mtu: Mtu, dest_qp_num: u32, rq_psn: u32) -> Self {
        Self {
            state: Some(QpState::Rtr),
            av: Some(av),
            path_mtu: Some(path_mtu),
            dest_qp_num: Some(dest_qp_num),
            rq_psn: Some(rq_psn),
            max_dest_rd_atomic: Some(16),
            min_rnr_timer: Some(12),
            ..Self::default()
        }
    }

    /// RTR→RTS starting at `sq_psn`, with rdma-core's usual defaults (timeout 14 = 67 ms,
    /// retry_cnt 7, rnr_retry 7, `max_rd_atomic` 16).
    pub fn to_rts(sq_psn: u32) -> Self {
        Self {
            state: Some(QpState::Rts),
            sq_psn: Some(sq_psn),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(16),
            ..Self::default()
        }
    }

    /// The attributes an RC transition from `from` to `to` requires, or `None` when the
    /// transition is not allowed at all.
    pub fn required_for(from: QpState, to: QpState) -> Option<&'static [AttrName]> {
        use QpState::*;
        Some(match (from, to) {
            (_, Reset) | (_, Err) => &[],
            (Reset, Init) => &["port_num", "pkey_index", "access"],
            (Init, Init) => &[],
            (Init, Rtr) => {
                &["av", "path_mtu", "dest_qp_num", "rq_psn", "max_dest_rd_atomic", "min_rnr_timer"]
            }
            (Rtr, Rts) => &["timeout", "retry_cnt", "rnr_retry", "sq_psn", "max_rd_atomic"],
            (Rts, Rts) | (Rts, Sqd) | (Sqd, Rts) | (Sqd, Sqd) => &[],
            _ => return None,
        })
    }

    /// Whether the named attribute is present.
    pub fn has(&self, name: AttrName) -> bool {
        match name {
            "state" => self.state.is_some(),
            "port_num" => self.port_num.is_some(),
            "pkey_index" => self.pkey_index.is_some(),
            "access" => self.access.is_some(),
            "av" => self.av.is_some(),
            "path_mtu" => self.path_mtu.is_some(),
            "dest_qp_num" => self.dest_qp_num.is_some(),
            "rq_psn" => self.rq_psn.is_some(),
            "max_dest_rd_atomic" => self.max_dest_rd_atomic.is_some(),
            "min_rnr_timer" => self.min_rnr_timer.is_some(),
            "timeout" => self.timeout.is_some(),
            "retry_cnt" => self.retry_cnt.is_some(),
            "rnr_retry" => self.rnr_retry.is_some(),
            "sq_psn" => self.sq_psn.is_some(),
            "max_rd_atomic" => self.max_rd_atomic.is_some(),
            _ => false,
        }
    }

    /// Checks that a transition is allowed and carries its required attributes, and that the
    /// values are in range (PSNs 24-bit, QPN 24-bit, timeout ≤ 31, retry counts ≤ 7, RNR timer
    /// code ≤ 31).
    pub fn validate_transition(&self, from: QpState) -> crate::Result<()> {
        let to = self.state.unwrap_or(from);
        let required = Self::required_for(from, to).ok_or(crate::Error::InvalidTransition { from, to })?;
        if let Some(missing) = required.iter().find(|name| !self.has(name)) {
            return Err(crate::Error::MissingAttribute { transition: (from, to), attribute: missing });
        }
        let psn_ok = |v: Option<u32>| v.is_none_or(|p| p < (1 << 24));
        if !psn_ok(self.rq_psn) || !psn_ok(self.sq_psn) {
            return Err(crate::Error::InvalidAttribute("PSN must fit in 24 bits"));
        }
        if !psn_ok(self.dest_qp_num) {
            return Err(crate::Error::InvalidAttribute("dest_qp_num must fit in 24 bits"));
        }
        if self.timeout.is_some_and(|t| t > 31) || self.min_rnr_timer.is_some_and(|t| t > 31) {
            return Err(crate::Error::InvalidAttribute("timer codes are 5-bit (0..=31)"));
        }
        if self.retry_cnt.is_some_and(|r| r > 7) || self.rnr_retry.is_some_and(|r| r > 7) {
            return Err(crate::Error::InvalidAttribute("retry counts are 3-bit (0..=7)"));
        }
        if self.av.is_some_and(|av| av.dgid.is_zero()) {
            return Err(crate::Error::InvalidAttribute("RoCE needs a global route: dgid must not be zero"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_raw_values() {
        for raw in 0..7 {
            assert_eq!(QpState::from_raw(raw).unwrap().to_raw(), raw);
        }
        assert_eq!(QpState::from_raw(7), None);
    }

    #[test]
    fn transition_rules() {
        let av = AddressVector::new("10.0.0.1".parse().unwrap(), 0);
        assert!(QpAttr::to_init(AccessFlags::NONE).validate_transition(QpState::Reset).is_ok());
        assert!(QpAttr::to_rtr(av, Mtu::Mtu1024, 17, 5).validate_transition(QpState::Init).is_ok());
        assert!(QpAttr::to_rts(5).validate_transition(QpState::Rtr).is_ok());
        // Skipping a state is refused.
        assert!(matches!(
            QpAttr::to_rts(5).validate_transition(QpState::Init),
            Err(crate::Error::InvalidTransition { .. })
        ));
        // A missing required attribute is named.
        let mut rtr = QpAttr::to_rtr(av, Mtu::Mtu1024, 17, 5);
        rtr.rq_psn = None;
        assert!(matches!(
            rtr.validate_transition(QpState::Init),
            Err(crate::Error::MissingAttribute { attribute: "rq_psn", .. })
        ));
        // Out-of-range values are refused.
        let mut rts = QpAttr::to_rts(1 << 24);
        assert!(rts.validate_transition(QpState::Rtr).is_err());
        rts.sq_psn = Some(0);
        rts.retry_cnt = Some(8);
        assert!(rts.validate_transition(QpState::Rtr).is_err());
        // Any state may go to ERR or RESET.
        assert!(QpAttr::state(QpState::Err).validate_transition(QpState::Rts).is_ok());
        assert!(QpAttr::state(QpState::Reset).validate_transition(QpState::Err).is_ok());
    }
}
