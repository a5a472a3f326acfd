//! [`SoftQp`]: a reliable-connected queue pair of the engine.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use lightpath_verbs::{
    BatchError, Error, QpAttr, QpCaps, QpEndpoint, QpState, QueuePair, RecvWr, Result, SendWr, WakeFor,
};

use lightpath_roce::QpStats;

use crate::cq::{CqInner, SoftCq};
use crate::driver::{PortDoorbell, QpPort};
use crate::pd::SoftPd;

/// A queue pair of a [`SoftDevice`](crate::SoftDevice). It holds its protection domain and both
/// completion queues alive; dropping it destroys the engine's queue pair (outstanding requests
/// are discarded without completions, as `ibv_destroy_qp` does).
pub struct SoftQp {
    pd: SoftPd,
    // Kept only to hold the queues alive for as long as the engine may complete into them.
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    qpn: u32,
    caps: QpCaps,
    /// The UDP port of its own its waiter sleeps on (see the driver's `ports`), once given.
    port: OnceLock<Arc<QpPort>>,
}

impl SoftQp {
    pub(crate) fn create(pd: SoftPd, send_cq: &SoftCq, recv_cq: &SoftCq, caps: QpCaps) -> Result<Self> {
        let same_device = |cq: &SoftCq| Arc::ptr_eq(&cq.inner.device, &pd.device);
        if !same_device(send_cq) || !same_device(recv_cq) {
            return Err(Error::InvalidAttribute("completion queue belongs to another device"));
        }
        let qpn = pd.device.lock().engine.create_qp(send_cq.inner.handle, recv_cq.inner.handle, caps)?;
        Ok(Self {
            pd,
            _send_cq: Arc::clone(&send_cq.inner),
            _recv_cq: Arc::clone(&recv_cq.inner),
            qpn,
            caps,
            port: OnceLock::new(),
        })
    }
}

impl SoftQp {
    /// This queue pair's counters: datagrams and bytes each way, retransmissions, NAKs and
    /// RNR NAKs each way, and datagrams for it dropped for a bad ICRC. (The device-wide
    /// counters, including datagrams that reached no queue pair, are
    /// [`SoftDevice::stats`](crate::SoftDevice::stats).)
    pub fn stats(&self) -> Result<QpStats> {
        self.pd.device.lock().engine.qp_stats(self.qpn)
    }
}

impl SoftQp {
    /// Gives the queue pair a UDP port of its own with `doorbell` for its waiter (see
    /// [`QueuePair::set_waiter_fd`]); whether it has one. Only in RESET and INIT.
    fn open_port(&self, doorbell: PortDoorbell) -> Result<bool> {
        if self.port.get().is_some() {
            return Ok(true);
        }
        let device = &self.pd.device;
        if !matches!(device.lock().engine.qp_state(self.qpn)?, QpState::Reset | QpState::Init) {
            return Ok(false);
        }
        match device.open_port(self.qpn, doorbell) {
            Some(port) => {
                let _ = self.port.set(port);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

impl std::fmt::Debug for SoftQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftQp").field("device", &self.pd.device.name).field("qpn", &self.qpn).finish()
    }
}

/// The soft device has one port (1) and one GID (index 0); refuse anything else up front.
fn check_addressing(attr: &QpAttr) -> Result<()> {
    if attr.port_num.is_some_and(|port| port != 1) {
        return Err(Error::InvalidAttribute("port_num: a soft device has one port, number 1"));
    }
    if let Some(av) = attr.av {
        if av.sgid_index != 0 {
            return Err(Error::InvalidAttribute("sgid_index: a soft device has one GID, index 0"));
        }
        if av.port_num != 1 {
            return Err(Error::InvalidAttribute("av.port_num: a soft device has one port, number 1"));
        }
    }
    Ok(())
}

impl QueuePair for SoftQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint { gid: self.pd.device.gid, gid_index: 0, qpn: self.qpn }
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn state(&self) -> Result<QpState> {
        self.pd.device.lock().engine.qp_state(self.qpn)
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        check_addressing(attr)?;
        let device = &self.pd.device;
        if let Some(mtu) = attr.path_mtu {
            device.check_path_mtu(mtu)?;
        }
        if let Some(bytes) = attr.lightpath_pmtu {
            device.check_lightpath_pmtu(bytes)?;
        }
        let mut core = device.lock();
        let now = device.now();
        let result = core.engine.modify_qp(now, self.qpn, attr);
        device.after_call(&mut core, now);
        result
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let device = &self.pd.device;
        let mut core = device.lock();
        let now = device.now();
        let result = core.engine.post_send(now, self.qpn, wr);
        self.posted_send();
        device.after_post(core, now);
        result
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let device = &self.pd.device;
        let mut core = device.lock();
        let result = core.engine.post_recv(self.qpn, wr);
        // A receive posted in ERR completes (flushed) at once; deliver that notification.
        device.after_recv_post(&mut core);
        result
    }

    fn post_send_batch(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), BatchError> {
        self.post_batch(wrs, true, |engine, now, wr| engine.post_send(now, self.qpn, wr))
    }

    /// With the progress thread (not in polling mode) and below
    /// [`SoftConfig::max_qp_ports`](crate::SoftConfig::max_qp_ports), gives the queue pair a
    /// UDP port of its own ([`QueuePair::own_udp_port`], for the peer's address vector) that
    /// its waiter sleeps on ([`QueuePair::waiter_poll_fd`]) beside `fd`; `fd` is written when
    /// a thread other than the waiter makes news for it. `Ok(false)` past RESET and INIT, or
    /// when no port is used.
    fn set_waiter_fd(&self, fd: &Arc<OwnedFd>) -> Result<bool> {
        self.open_port(PortDoorbell::Fd(Arc::clone(fd)))
    }

    /// [`QueuePair::set_waiter_fd`] for an event loop's task: the same port of its own (its
    /// socket is what the task's event loop watches), and news another thread makes calls
    /// `wake` instead of writing an eventfd. No task doorbell: soft news never comes from
    /// another process.
    fn set_waiter_task(&self, wake: lightpath_verbs::TaskWake) -> Result<bool> {
        self.open_port(PortDoorbell::Task(wake))
    }

    /// Takes in what waits in the queue pair's port (its completions are in the completion
    /// queue when this returns; answers are held for the caller's reply) and arms the
    /// doorbell for `wake`. `Ok(false)` without a port.
    fn arm_waiter(&self, wake: WakeFor) -> Result<bool> {
        let Some(port) = self.port.get() else { return Ok(false) };
        self.pd.device.arm_port(port, wake);
        Ok(true)
    }

    /// Arms the doorbell for `wake` without receiving from the port (see the trait); answers
    /// held for the caller's reply still go out. `Ok(false)` without a port.
    fn arm_waiter_without_look(&self, wake: WakeFor) -> Result<bool> {
        let Some(port) = self.port.get() else { return Ok(false) };
        self.pd.device.arm_port_without_look(port, wake);
        Ok(true)
    }

    /// The device's look at its event loops' ports, for a queue pair whose waiter is a task
    /// (see `TaskPortSpin`).
    fn task_spin(&self) -> Option<Arc<dyn lightpath_verbs::TaskSpin>> {
        let port = self.port.get()?;
        if !port.wakes_task() {
            return None;
        }
        Some(crate::driver::TaskPortSpin::of(&self.pd.device.shared))
    }

    fn waiter_poll_fd(&self) -> Option<Arc<dyn AsFd + Send + Sync>> {
        let port = self.port.get()?;
        let socket: Arc<dyn AsFd + Send + Sync> = Arc::clone(&port.socket) as _;
        Some(socket)
    }

    fn own_udp_port(&self) -> Option<u16> {
        self.port.get().map(|port| port.udp_port())
    }

    fn post_recv_batch(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), BatchError> {
        self.post_batch(wrs, false, |engine, _, wr| engine.post_recv(self.qpn, wr))
    }
}

impl SoftQp {
    /// Runs `post` for each request under one lock, then (for sends) sends everything they
    /// produced in as few `sendmmsg` calls as possible.
    /// A send was posted: the answers an arming of this queue pair's port held for the
    /// owner's reply leave with it (see `Shared::finish_arming`).
    fn posted_send(&self) {
        if let Some(port) = self.port.get() {
            port.clear_reply_hold();
        }
    }

    fn post_batch<W>(
        &self,
        wrs: &[W],
        sends: bool,
        post: impl Fn(&mut lightpath_roce::Engine, lightpath_roce::Time, &W) -> Result<()>,
    ) -> std::result::Result<(), BatchError> {
        let device = &self.pd.device;
        let mut core = device.lock();
        let now = device.now();
        let mut outcome = Ok(());
        for (posted, wr) in wrs.iter().enumerate() {
            if let Err(error) = post(&mut core.engine, now, wr) {
                outcome = Err(BatchError { posted, error });
                break;
            }
        }
        if sends {
            self.posted_send();
            device.after_post(core, now);
        } else {
            device.after_recv_post(&mut core);
        }
        outcome
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        let device = &self.pd.device;
        let mut core = device.lock();
        // Polling mode holds the engine's answers (ACKs) back until the next post or poll; send
        // them before the queue pair goes, or a peer waiting for the ACK of its last message
        // retries into the void and ends with retry-exceeded (as a NIC would have ACKed it).
        let now = device.now();
        device.after_call(&mut core, now);
        if let Some(port) = self.port.get() {
            device.close_port(&mut core, port);
        }
        let _ = core.engine.destroy_qp(self.qpn);
    }
}
