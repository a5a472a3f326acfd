//! One side's verbs objects for the interop protocol, written against the provider-neutral
//! traits: the registered buffer (slot k at `k × SIZE`, or one 8-byte word for atomics, every
//! unused byte poisoned), the RC queue pair with full remote access, and the queue-pair
//! attributes of verbs_peer (PROTOCOL.md: RTR `max_dest_rd_atomic` 16, `min_rnr_timer` 12,
//! hop limit 64; RTS timeout 14, `retry_cnt` from `-R`, `rnr_retry` 7, `max_rd_atomic` 16).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lightpath_verbs::{
    AccessFlags, AddressVector, CompletionQueue, CqOf, Device, MemoryRegion, MrOf, Mtu, PdOf,
    ProtectionDomain, QpAttr, QpCaps, QpOf, QueuePair, RecvWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

use super::known::POISON_BYTE;
use super::line::EndpointLine;
use super::op::Op;

/// Receives the responder keeps posted at once.
pub const RECV_WINDOW: u32 = 256;

/// Everything either role accepts from the peer.
const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// The sizes of a run, agreed by both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub op: Op,
    pub size: u64,
    pub iters: u32,
}

impl Shape {
    /// Bytes of the buffer: a slot per iteration, or one page holding the atomic word.
    pub fn buffer_len(&self) -> usize {
        if self.op.is_atomic() {
            4096
        } else {
            (self.size * u64::from(self.iters)) as usize
        }
    }

    /// Offset of slot `k` (atomics always use offset 0).
    pub fn slot(&self, k: u32) -> usize {
        if self.op.is_atomic() {
            0
        } else {
            (u64::from(k) * self.size) as usize
        }
    }
}

/// One side's verbs objects. Field order is drop order: the queue pair goes first.
pub struct Peer<D: Device> {
    qp: QpOf<D>,
    mr: MrOf<D>,
    cq: CqOf<D>,
    _pd: PdOf<D>,
    device: D,
    pub shape: Shape,
    pub port_num: u8,
}

impl<D: Device> Peer<D> {
    /// Allocates and poisons the buffer and creates the queue pair in INIT.
    pub fn new(device: D, shape: Shape, port_num: u8) -> Result<Self> {
        let pd = device.alloc_pd().context("ibv_alloc_pd failed")?;
        let cq = device.create_cq(2 * RECV_WINDOW + 16).context("ibv_create_cq failed")?;
        let caps = QpCaps {
            max_send_wr: 16,
            max_recv_wr: RECV_WINDOW,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = pd.create_qp(&cq, &cq, caps).context("ibv_create_qp failed")?;
        let len = shape.buffer_len();
        let mr = pd.alloc_mr(len, ACCESS).with_context(|| format!("ibv_reg_mr({len} bytes) failed"))?;
        mr.write(0, &vec![POISON_BYTE; len])?;
        let mut init = QpAttr::to_init(ACCESS);
        init.port_num = Some(port_num);
        qp.modify(&init).context("modify QP to INIT failed")?;
        Ok(Self { qp, mr, cq, _pd: pd, device, shape, port_num })
    }

    /// The queue pair's endpoint (GID, GID index, number).
    pub fn qp_endpoint(&self) -> lightpath_verbs::QpEndpoint {
        self.qp.endpoint()
    }

    /// The registered buffer.
    pub fn mr(&self) -> &MrOf<D> {
        &self.mr
    }

    /// This side's endpoint line.
    pub fn endpoint(&self, psn: u32, mtu: u32) -> EndpointLine {
        let endpoint = self.qp.endpoint();
        EndpointLine {
            op: self.shape.op,
            qpn: endpoint.qpn,
            psn,
            gid: endpoint.gid,
            mtu,
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            size: self.shape.size,
            iters: self.shape.iters,
        }
    }

    /// Moves the queue pair to RTR and RTS towards `remote`, with the smaller of both MTUs.
    /// Returns the path MTU.
    pub fn connect(&self, local: &EndpointLine, remote: &EndpointLine, retry_cnt: u8) -> Result<Mtu> {
        let mtu = Mtu::from_bytes(remote.mtu)
            .with_context(|| format!("peer sent an invalid MTU {}", remote.mtu))?;
        let local_mtu =
            Mtu::from_bytes(local.mtu).with_context(|| format!("invalid local MTU {}", local.mtu))?;
        let path_mtu = mtu.min(local_mtu);
        let active = self.device.query_port(self.port_num)?.active_mtu;
        if path_mtu > active {
            bail!("path MTU {path_mtu} exceeds the port's active MTU {active}: raise the link MTU");
        }
        let sgid_index = self.qp.endpoint().gid_index;
        let mut av = AddressVector::new(remote.gid, sgid_index);
        av.hop_limit = 64;
        av.port_num = self.port_num;
        let mut rtr = QpAttr::to_rtr(av, path_mtu, remote.qpn, remote.psn);
        rtr.max_dest_rd_atomic = Some(16);
        rtr.min_rnr_timer = Some(12);
        self.qp.modify(&rtr).context("modify QP to RTR failed")?;
        let mut rts = QpAttr::to_rts(local.psn);
        rts.timeout = Some(14);
        rts.retry_cnt = Some(retry_cnt);
        rts.rnr_retry = Some(7);
        rts.max_rd_atomic = Some(16);
        self.qp.modify(&rts).context("modify QP to RTS failed")?;
        Ok(path_mtu)
    }

    /// Posts the receive of iteration `k`: slot k for SEND; no buffer for WRITE with immediate,
    /// whose data arrives by RDMA.
    pub fn post_recv_slot(&self, k: u32) -> Result<()> {
        let slot = [self.mr.sge(self.shape.slot(k), self.shape.size as u32)];
        let sges: &[Sge] = if self.shape.op == Op::WriteImm { &[] } else { &slot };
        self.qp.post_recv(&RecvWr::new(u64::from(k), sges)).context("ibv_post_recv failed")
    }

    /// Posts a send work request.
    pub fn post_send(&self, wr: &lightpath_verbs::SendWr<'_>) -> Result<()> {
        self.qp.post_send(wr).map_err(anyhow::Error::from)
    }

    /// Waits for one completion until `deadline` (or for at most `slice`, whichever is
    /// sooner); `None` if none arrived.
    pub fn next_completion(&self, deadline: Instant, slice: Duration) -> Result<Option<WorkCompletion>> {
        let mut wc = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0)];
        let left = deadline.saturating_duration_since(Instant::now()).min(slice);
        let count = self.cq.wait(&mut wc, left).context("ibv_poll_cq failed")?;
        Ok((count == 1).then_some(wc[0]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_layout() {
        let data = Shape { op: Op::Write, size: 10000, iters: 5 };
        assert_eq!(data.buffer_len(), 50000);
        assert_eq!(data.slot(3), 30000);
        let atomic = Shape { op: Op::FetchAdd, size: 8, iters: 5 };
        assert_eq!(atomic.buffer_len(), 4096);
        assert_eq!(atomic.slot(3), 0);
    }
}
