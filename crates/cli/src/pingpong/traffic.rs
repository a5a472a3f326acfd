//! The ping-pong itself, as `ibv_rc_pingpong` runs it, written against the provider-neutral
//! verbs traits (the soft provider today; any provider later).
//!
//! One RC queue pair whose send and receive completions share one completion queue; one
//! region holding the send buffer (filled with 0x7b) and the receive buffer. `rx_depth`
//! receives are posted before the queue pair leaves INIT, so the peer's first SEND finds one,
//! and they are topped up in one batch whenever at most one is left. The client sends first;
//! afterwards each side posts its next SEND only when its previous SEND has completed *and* a
//! message has arrived. Queue-pair attributes are the C tool's (digest §7): responder access
//! none; RTR `max_dest_rd_atomic` 1, `min_rnr_timer` 12, hop limit 1; RTS timeout 14,
//! `retry_cnt` 7, `rnr_retry` 7, `max_rd_atomic` 1.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, CqOf, Device, Gid, MemoryRegion, MrOf, Mtu, PdOf,
    ProtectionDomain, QpAttr, QpCaps, QpOf, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

use super::oob::PeerAddress;

/// `wr_id` of every receive (as in the C tool, which uses it as a bit in `pending`).
const RECV_WRID: u64 = 1;
/// `wr_id` of every send.
const SEND_WRID: u64 = 2;
/// The payload byte of every message.
const PAYLOAD_BYTE: u8 = 0x7b;
/// The page size `-c` works in (the C tool uses the host's, 4096 on the hosts RoCE runs on).
pub const CHECK_PAGE_SIZE: usize = 4096;

/// How the run waits for completions (`-e` or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Poll the completion queue in a loop (the default).
    BusyPoll,
    /// Block on the completion queue until a completion arrives (`-e`).
    Events,
}

/// The connection parameters that come from the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathOptions {
    /// Path MTU (`-m`); the C tool uses it as given, it does not negotiate.
    pub mtu: Mtu,
    /// Service level (`-l`).
    pub sl: u8,
    /// Local port (`-i`).
    pub port_num: u8,
}

/// One side's verbs objects. Field order is drop order: the queue pair goes first.
pub struct PingPong<D: Device> {
    qp: QpOf<D>,
    mr: MrOf<D>,
    cq: CqOf<D>,
    _pd: PdOf<D>,
    _device: D,
    size: u32,
    rx_depth: u32,
    /// Receives currently posted.
    routs: u32,
}

impl<D: Device> PingPong<D> {
    /// Creates the objects, moves the queue pair to INIT and posts `rx_depth` receives.
    pub fn new(device: D, size: u32, rx_depth: u32, port_num: u8) -> Result<Self> {
        let pd = device.alloc_pd().context("allocating a protection domain")?;
        let cq = device.create_cq(rx_depth + 1).context("creating the completion queue")?;
        // [send buffer | receive buffer]: the C tool shares one buffer, but the bytes are the
        // same either way and separate halves keep an arriving message off a send in progress.
        let len = 2 * size as usize;
        let mr = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).context("registering the message buffer")?;
        mr.write(0, &vec![PAYLOAD_BYTE; len])?;
        let caps = QpCaps {
            max_send_wr: 1,
            max_recv_wr: rx_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = pd.create_qp(&cq, &cq, caps).context("creating the queue pair")?;
        let mut init = QpAttr::to_init(AccessFlags::NONE);
        init.port_num = Some(port_num);
        qp.modify(&init).context("moving the queue pair to INIT")?;
        let mut side = Self { qp, mr, cq, _pd: pd, _device: device, size, rx_depth, routs: 0 };
        side.post_recvs(rx_depth)?;
        Ok(side)
    }

    /// What this side tells the peer (the PSN is chosen by the caller).
    pub fn address(&self, psn: u32) -> PeerAddress {
        let endpoint = self.qp.endpoint();
        PeerAddress { lid: 0, qpn: endpoint.qpn, psn, gid: endpoint.gid }
    }

    /// The local GID and its index.
    fn local_gid(&self) -> (Gid, u8) {
        let endpoint = self.qp.endpoint();
        (endpoint.gid, endpoint.gid_index)
    }

    /// Moves the queue pair to RTR and RTS towards `remote` (the C tool's `pp_connect_ctx`).
    pub fn connect(&self, remote: &PeerAddress, my_psn: u32, path: PathOptions) -> Result<()> {
        if !remote.has_global_route() {
            bail!(
                "the peer sent GID {} without an interface ID, so there is no route to it on RoCE \
                 (start ibv_rc_pingpong with -g <GID index>)",
                remote.gid.to_hex()
            );
        }
        let (local_gid, sgid_index) = self.local_gid();
        if remote.gid.is_ipv4_mapped() != local_gid.is_ipv4_mapped() {
            bail!(
                "the peer's GID {} and ours ({}) are not both IPv4 or both IPv6",
                remote.gid.to_ip(),
                local_gid.to_ip()
            );
        }
        let av = AddressVector {
            dgid: remote.gid,
            sgid_index,
            hop_limit: 1,
            traffic_class: 0,
            flow_label: 0,
            sl: path.sl,
            port_num: path.port_num,
            // ibv_rc_pingpong's handshake has no port: the peer listens on its provider's.
            udp_dport: 0,
            // The peer may be the real ibv_rc_pingpong over rxe or an RNIC.
            lightpath_peer: false,
            lightpath_bundles: false,
        };
        let mut rtr = QpAttr::to_rtr(av, path.mtu, remote.qpn, remote.psn);
        rtr.max_dest_rd_atomic = Some(1);
        rtr.min_rnr_timer = Some(12);
        self.qp.modify(&rtr).context("moving the queue pair to RTR")?;
        let mut rts = QpAttr::to_rts(my_psn);
        rts.timeout = Some(14);
        rts.retry_cnt = Some(7);
        rts.rnr_retry = Some(7);
        rts.max_rd_atomic = Some(1);
        self.qp.modify(&rts).context("moving the queue pair to RTS")?;
        Ok(())
    }

    /// `-c` on the client: the C tool writes `i / page_size % sizeof(char)` at the start of
    /// every page of its buffer before the first send. `sizeof(char)` is 1, so that is 0.
    pub fn mark_pages(&self) -> Result<()> {
        for offset in (0..self.size as usize).step_by(CHECK_PAGE_SIZE) {
            self.mr.write(offset, &[0])?;
        }
        Ok(())
    }

    /// `-c` on the server, after the run: the pages of the last message received whose first
    /// byte is not the client's mark.
    pub fn unmarked_pages(&self) -> Result<Vec<usize>> {
        let mut bad = Vec::new();
        for (page, offset) in (0..self.size as usize).step_by(CHECK_PAGE_SIZE).enumerate() {
            let mut byte = [0u8; 1];
            self.mr.read(self.size as usize + offset, &mut byte)?;
            if byte[0] != 0 {
                bad.push(page);
            }
        }
        Ok(bad)
    }

    fn post_recvs(&mut self, count: u32) -> Result<()> {
        let sge = [self.mr.sge(self.size as usize, self.size)];
        for _ in 0..count {
            self.qp
                .post_recv(&RecvWr::new(RECV_WRID, &sge))
                .with_context(|| format!("posting receive {} of {}", self.routs + 1, self.rx_depth))?;
            self.routs += 1;
        }
        Ok(())
    }

    fn post_send(&self) -> Result<()> {
        let sge = [self.mr.sge(0, self.size)];
        self.qp.post_send(&SendWr::new(SEND_WRID, SendOp::Send, &sge)).context("posting a send")
    }

    /// Runs `iters` exchanges and returns the time from the start (after the client's first
    /// send) to the last completion. `stall` bounds the time without any completion: a peer
    /// that stops answering ends the run with an error.
    pub fn run(
        &mut self,
        iters: u32,
        is_client: bool,
        waiting: Waiting,
        stall: Duration,
    ) -> Result<Duration> {
        let mut pending = RECV_WRID;
        if is_client {
            self.post_send()?;
            pending |= SEND_WRID;
        }
        let start = Instant::now();
        let (mut scnt, mut rcnt) = (0u32, 0u32);
        let mut wcs = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 2];
        let mut last_progress = Instant::now();
        while rcnt < iters || scnt < iters {
            let count = match waiting {
                Waiting::BusyPoll => self.cq.poll(&mut wcs)?,
                Waiting::Events => {
                    let left = stall.saturating_sub(last_progress.elapsed());
                    self.cq.wait(&mut wcs, left.min(Duration::from_millis(250)))?
                }
            };
            if count == 0 {
                if last_progress.elapsed() >= stall {
                    bail!(
                        "no completion for {:.1} s after {scnt} sends and {rcnt} receives of {iters}: the peer \
                         stopped responding",
                        stall.as_secs_f64()
                    );
                }
                continue;
            }
            last_progress = Instant::now();
            for wc in &wcs[..count] {
                if wc.status != WcStatus::Success {
                    bail!(
                        "Failed status {} ({}) for wr_id {} ({}) after {scnt} sends and {rcnt} receives",
                        wc.status,
                        wc.status.to_raw(),
                        wc.wr_id,
                        if wc.wr_id == SEND_WRID { "send" } else { "receive" }
                    );
                }
                match wc.wr_id {
                    SEND_WRID => scnt += 1,
                    RECV_WRID => {
                        self.routs -= 1;
                        if self.routs <= 1 {
                            self.post_recvs(self.rx_depth - self.routs)?;
                        }
                        rcnt += 1;
                    }
                    other => bail!("completion for unknown wr_id {other}"),
                }
                pending &= !wc.wr_id;
                if scnt < iters && pending == 0 {
                    self.post_send()?;
                    pending = RECV_WRID | SEND_WRID;
                }
            }
        }
        Ok(start.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use lightpath_soft::ProgressMode;

    use super::super::endpoint::open_soft;
    use super::*;

    /// Two devices on one ephemeral UDP port (retried if the port is taken on 127.0.0.2).
    fn open_pair(mode: ProgressMode) -> (lightpath_soft::SoftDevice, lightpath_soft::SoftDevice) {
        let open = |last: u8, port: u16| {
            open_soft(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)), port, Mtu::Mtu1024, mode)
        };
        for _ in 0..10 {
            let a = open(1, 0).unwrap();
            if let Ok(b) = open(2, a.local_addr().port()) {
                return (a, b);
            }
        }
        panic!("no UDP port free on both 127.0.0.1 and 127.0.0.2")
    }

    /// Both sides in one process, each on its own thread, exchanging addresses directly.
    fn ping_pong(mode: ProgressMode, waiting: Waiting, size: u32, rx_depth: u32, iters: u32) {
        let (a, b) = open_pair(mode);
        let mut client = PingPong::new(a, size, rx_depth, 1).unwrap();
        let mut server = PingPong::new(b, size, rx_depth, 1).unwrap();
        let (client_addr, server_addr) = (client.address(0x10), server.address(0xFF_FFF0));
        let path = PathOptions { mtu: Mtu::Mtu256, sl: 0, port_num: 1 };
        server.connect(&client_addr, server_addr.psn, path).unwrap();
        client.connect(&server_addr, client_addr.psn, path).unwrap();
        let stall = Duration::from_secs(20);
        let server_thread = std::thread::spawn(move || server.run(iters, false, waiting, stall));
        client.run(iters, true, waiting, stall).unwrap();
        server_thread.join().unwrap().unwrap();
    }

    #[test]
    fn busy_polling_with_a_small_receive_depth() {
        // rx_depth 2 forces a refill after every message.
        ping_pong(ProgressMode::polling(), Waiting::BusyPoll, 1000, 2, 30);
    }

    #[test]
    fn completion_events() {
        ping_pong(ProgressMode::Thread, Waiting::Events, 64, 500, 30);
    }

    #[test]
    fn a_silent_peer_ends_the_run() {
        let (a, b) = open_pair(ProgressMode::Thread);
        let mut server = PingPong::new(a, 64, 4, 1).unwrap();
        let client = PingPong::new(b, 64, 4, 1).unwrap();
        let path = PathOptions { mtu: Mtu::Mtu1024, sl: 0, port_num: 1 };
        server.connect(&client.address(1), 2, path).unwrap();
        // The client never sends: the server's wait for its first message must end.
        let err = server.run(5, false, Waiting::Events, Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains("stopped responding"), "{err}");
    }

    #[test]
    fn a_peer_without_a_gid_is_refused() {
        let (a, _b) = open_pair(ProgressMode::Thread);
        let side = PingPong::new(a, 64, 4, 1).unwrap();
        let remote = PeerAddress { lid: 0, qpn: 0x11, psn: 1, gid: Gid::ZERO };
        let path = PathOptions { mtu: Mtu::Mtu1024, sl: 0, port_num: 1 };
        let err = side.connect(&remote, 2, path).unwrap_err();
        assert!(err.to_string().contains("-g"), "{err}");
    }
}
