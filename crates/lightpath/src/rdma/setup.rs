//! Setting up an RDMA connection: the verbs objects before the peer is known, connecting the
//! queue pair to the peer's endpoint, and the probe that proves the path works.

use super::*;
use lightpath_stream::negotiate::{BUNDLES_VERSION, RESTARTS_VERSION};

/// Verbs objects of one side before the peer's endpoint is known. Field order is drop order.
pub(crate) struct RdmaSetup<D: Device> {
    qp: QpOf<D>,
    recv_mr: MrOf<D>,
    cq: ConnCompletions<D>,
    pd: PdOf<D>,
    device: D,
    psn: u32,
    gid: Gid,
    udp_port: u16,
    mtu: Mtu,
    /// The largest Lightpath-extension path MTU this side's device carries (soft devices).
    lightpath_pmtu: Option<u32>,
    options: Options,
}

impl<D: Device + 'static> RdmaSetup<D> {
    /// Creates the queue pair (in INIT) on one of the device's shared completion queues
    /// (from `hubs`), and the receive region. A blocking wait on the queue pair's doorbell
    /// looks for news for up to `wait_spin` before it sleeps (while that pays).
    pub(crate) fn new(
        device: D,
        hubs: &HubPool<D>,
        udp_port: u16,
        mtu: Mtu,
        lightpath_pmtu: Option<u32>,
        wait_spin: Duration,
        options: &Options,
    ) -> io::Result<Self> {
        let ring = options.ring_size.max(4096);
        let pd = device.alloc_pd().map_err(from_verbs)?;
        // Every work request can complete once, plus the probe.
        let entries = options.send_depth + options.recv_depth + 1;
        let mut cq = hubs.connection(&device, entries, options.shared_completion_queues)?;
        let caps = QpCaps {
            max_send_wr: options.send_depth,
            max_recv_wr: options.recv_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        let qp = pd.create_qp(cq.cq(), cq.cq(), caps).map_err(from_verbs)?;
        // A soft queue pair (the one kind with a UDP port) gets a doorbell, and with it a port
        // of its own, only where the options ask for one; other providers' doorbells cost
        // nothing extra and are always taken, whatever `soft_qp_port` says.
        cq.attach(&qp, udp_port == 0 || options.soft_qp_port == Some(true), options.event_loop)?;
        // A blocking wait on a port of its own spins first, as one on the device's socket
        // does; one on a doorbell alone (shm) too.
        cq.set_wait_spin(wait_spin);
        // Where the peer writes straight into this ring (shm: both sides use one provider),
        // neither side keeps a staging mirror; the ring gets that memory instead, so memory
        // per connection stays about twice `ring_size` and a writer runs ahead twice as far.
        let ring = match qp.write_direct(0, 0, &[]) {
            Some(_) => ring.checked_mul(2).unwrap_or(ring),
            None => ring,
        };
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        qp.modify(&QpAttr::to_init(access)).map_err(from_verbs)?;
        let recv_mr = pd.alloc_mr(SLOT_AREA + ring as usize, access).map_err(from_verbs)?;
        // Only the peer's queue pair ever writes here (this connection's protection domain
        // holds this one queue pair): shm then keeps no descriptor for the ring once the peer
        // has it.
        recv_mr.share_with_first_peer_only();
        let gid = qp.endpoint().gid;
        let psn = random_psn(qp.qpn());
        let options = Options { ring_size: ring, ..options.clone() };
        Ok(Self { qp, recv_mr, cq, pd, device, psn, gid, udp_port, mtu, lightpath_pmtu, options })
    }

    /// What the peer needs to reach this side.
    pub(crate) fn endpoint(&self) -> RdmaEndpoint {
        let mut gid = self.gid.0;
        if self.options.fault_blackhole_rdma {
            // An address on this host where nothing listens: packets to it vanish.
            gid = Gid::from_ip("127.254.254.254".parse().expect("constant address")).0;
        }
        RdmaEndpoint {
            gid,
            // A soft queue pair with a port of its own is reached there (the kernel then wakes
            // its waiter directly); otherwise at the device's port.
            udp_port: self.qp.own_udp_port().filter(|_| self.udp_port != 0).unwrap_or(self.udp_port),
            qpn: self.qp.qpn(),
            psn: self.psn,
            // A soft device offers its larger Lightpath MTU (at most 32 KiB: fits the field).
            mtu: self
                .lightpath_pmtu
                .unwrap_or(self.mtu.bytes())
                .max(self.mtu.bytes())
                .min(u32::from(u16::MAX)) as u16,
            ring_addr: self.recv_mr.addr() + SLOT_AREA as u64,
            ring_len: self.options.ring_size,
            ring_rkey: self.recv_mr.rkey(),
            credit_addr: self.recv_mr.addr(),
            credit_rkey: self.recv_mr.rkey(),
            recv_depth: self.options.recv_depth as u16,
        }
    }

    /// Connects the queue pair to `peer`, allocates the staging mirror and posts the initial
    /// receives. The result may receive at once; it sends only after the caller says so.
    /// `version`: the stream protocol version both sides speak, which says whether the peer's
    /// soft device takes acknowledgement bundles (`AddressVector::lightpath_bundles`) and
    /// whether its receiver takes ring restarts (`ConnConfig::ring_restarts`).
    pub(crate) fn connect(self, peer: &RdmaEndpoint, tcp: TcpStream, version: u8) -> io::Result<RdmaConn<D>> {
        let offered = u32::from(peer.mtu);
        let mtu = Mtu::largest_fitting(offered).unwrap_or(Mtu::Mtu256).min(self.mtu);
        // Between two soft devices (the peer advertises its UDP port, and this side has a
        // Lightpath MTU), the smaller of the two offers: both sides compute the same value.
        let lightpath_pmtu = self
            .lightpath_pmtu
            .filter(|_| peer.udp_port != 0)
            .map(|mine| mine.min(offered))
            .filter(|&bytes| bytes > mtu.bytes());
        let mut av = AddressVector::new(Gid(peer.gid), self.qp.endpoint().gid_index);
        // Soft devices of several processes share an address on different UDP ports; a peer
        // without one (hardware) listens on the RoCE v2 port.
        av.udp_dport = if peer.udp_port == 0 { lightpath_soft::ROCE_PORT } else { peer.udp_port };
        // Only a soft device advertises its UDP port, and a soft device checks ICRCs whatever
        // the IPv4 identification: our soft device may then let the kernel segment large sends
        // to it (rxe and RNICs, behind an ibverbs peer, would drop renumbered segments).
        av.lightpath_peer = peer.udp_port != 0;
        av.lightpath_bundles = av.lightpath_peer && version >= BUNDLES_VERSION;
        let rtr = QpAttr { lightpath_pmtu, ..QpAttr::to_rtr(av, mtu, peer.qpn, peer.psn) };
        self.qp.modify(&rtr).map_err(from_verbs)?;
        let mut rts = QpAttr::to_rts(self.psn);
        // 268 ms ACK timeout, 7 retries: about 2 s before a silent path is declared dead, so a
        // progress thread starved for a second on a busy machine does not kill the connection
        // (a peer that dies is noticed through its TCP connection much sooner).
        rts.timeout = Some(16);
        self.qp.modify(&rts).map_err(from_verbs)?;
        // A provider that reaches the peer's memory itself (shm) takes the writer's bytes
        // straight into the peer's ring: no staging mirror (half the memory) and one copy.
        let staging = if self.qp.write_direct(peer.ring_addr, peer.ring_rkey, &[]).is_some() {
            None
        } else {
            Some(self.pd.alloc_mr(peer.ring_len as usize, AccessFlags::LOCAL_WRITE).map_err(from_verbs)?)
        };
        let depth = self.options.recv_depth;
        let recvs: Vec<RecvWr<'_>> = (0..depth).map(|i| RecvWr::new(u64::from(i), &[])).collect();
        self.qp.post_recv_batch(&recvs).map_err(|err| from_verbs(err.error))?;
        let config = ConnConfig {
            local_ring: self.options.ring_size,
            peer_ring: peer.ring_len,
            local_recv_depth: depth,
            peer_recv_depth: u32::from(peer.recv_depth),
            send_depth: self.options.send_depth,
            max_record: max_record_for(peer.ring_len),
            cork_depth: if self.options.nodelay { 0 } else { 2 },
            ring_restarts: version >= RESTARTS_VERSION,
        };
        config.validate().map_err(invalid)?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(RdmaConn {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            core: Conn::new(config),
            qp: self.qp,
            recv_mr: self.recv_mr,
            staging,
            cq: self.cq,
            _pd: self.pd,
            _device: self.device,
            peer: *peer,
            wcs: vec![WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 32],
            failed: None,
            tcp,
            control: Vec::new(),
            peer_bye: None,
            tcp_eof: false,
            tcp_checked_at: None,
            tcp_watched: false,
            armed_for_arrivals: false,
            read_shut: false,
            spin: self.options.spin,
            linger: self.options.linger,
            event_loop_spin: self.options.event_loop_spin,
            message: Vec::new(),
            rendezvous: super::rendezvous::Rendezvous::new(&self.options),
            send_state: super::stream_ops::SendState::default(),
            events: 0,
            arrivals: 0,
        })
    }
}

fn random_psn(salt: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(salt);
    (hasher.finish() & 0xFF_FFFF) as u32
}

impl<D: Device> RdmaConn<D> {
    /// Sends a probe over the queue pair: its acknowledgement proves that the RDMA path works
    /// both ways. [`RdmaConn::probe_outcome`] or [`RdmaConn::wait_probe`] sees it.
    pub(crate) fn start_probe(&mut self) -> io::Result<()> {
        let word = CreditWord::new(0, u64::from(self.core.config().local_recv_depth)).to_bytes();
        let op = SendOp::Write { remote_addr: self.peer.credit_addr, rkey: self.peer.credit_rkey };
        self.qp.post_send(&SendWr::inline(PROBE_ID, op, &word)).map_err(from_verbs)
    }

    /// What the probe's completion says, if it is among `wcs` (other completions are of no
    /// interest before the connection is used).
    fn probe_in(wcs: &[WorkCompletion]) -> Option<io::Result<()>> {
        let wc = wcs.iter().find(|wc| wc.wr_id == PROBE_ID)?;
        Some(if wc.status.is_success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "the RDMA probe failed: {} (vendor error {:#x})",
                wc.status, wc.vendor_err
            )))
        })
    }

    /// The probe's outcome if its completion has come, without waiting.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by the tokio driver
    pub(crate) fn probe_outcome(&mut self) -> Option<io::Result<()>> {
        loop {
            let n = match self.cq.poll(&mut self.wcs) {
                Ok(n) => n,
                Err(err) => return Some(Err(from_verbs(err))),
            };
            if let Some(outcome) = Self::probe_in(&self.wcs[..n]) {
                return Some(outcome);
            }
            if n < self.wcs.len() {
                return None;
            }
        }
    }

    /// Waits (at most `timeout`) for the probe's acknowledgement.
    pub(crate) fn wait_probe(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the RDMA probe was not acknowledged"));
            }
            let n = self.cq.wait(&self.qp, &mut self.wcs, left, WakeFor::Anything).map_err(from_verbs)?;
            if let Some(outcome) = Self::probe_in(&self.wcs[..n]) {
                return outcome;
            }
        }
    }
}
