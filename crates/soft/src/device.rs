//! [`SoftDevice`]: one engine, one UDP socket, one GID.

use std::net::SocketAddr;
use std::sync::Arc;

use lightpath_verbs::{Device, DeviceAttr, Error, Gid, PortAttr, PortState, Result};

use crate::config::SoftConfig;
use crate::cq::SoftCq;
use crate::driver::{DeviceInner, SoftStats};
use crate::pd::SoftPd;

/// A soft RoCE v2 device: the Lightpath engine driven over one UDP socket.
///
/// Cloning gives another handle to the same device. The socket and the helper thread live as
/// long as any handle or any object created from the device.
#[derive(Clone)]
pub struct SoftDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

impl SoftDevice {
    /// Opens a device: binds the socket, builds the engine, starts the helper thread.
    pub fn open(config: SoftConfig) -> Result<Self> {
        let inner = DeviceInner::start(config)?;
        tracing::debug!(
            device = %inner.name,
            local = %inner.local(),
            gid = %inner.gid,
            mtu = inner.config.mtu.bytes(),
            "soft device opened"
        );
        Ok(Self { inner })
    }

    /// The bound socket address (with the real port if 0 was configured).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local()
    }

    /// The device's one GID (index 0): the bound IP address as a GID.
    pub fn gid(&self) -> Gid {
        self.inner.gid
    }

    /// The configuration in force (with the real bound address).
    pub fn config(&self) -> &SoftConfig {
        &self.inner.config
    }

    /// The largest path MTU this device uses towards another Lightpath soft device
    /// ([`QpAttr::lightpath_pmtu`](lightpath_verbs::QpAttr::lightpath_pmtu)): what its link
    /// carries after the RoCE v2 headers, at most 32 KiB (4096 when the link is unknown).
    pub fn max_lightpath_pmtu(&self) -> u32 {
        self.inner.max_lightpath_pmtu
    }

    /// The path MTU this device offers another Lightpath soft device by default: the largest
    /// its link carries, at most [`PREFERRED_LIGHTPATH_PMTU`](lightpath_verbs::PREFERRED_LIGHTPATH_PMTU)
    /// (32,448 bytes on loopback, where two packets then fit one segmented UDP message).
    pub fn preferred_lightpath_pmtu(&self) -> u32 {
        self.inner.max_lightpath_pmtu.min(lightpath_verbs::PREFERRED_LIGHTPATH_PMTU)
    }

    /// A snapshot of the engine's and the driver's counters, including every kind of drop.
    pub fn stats(&self) -> SoftStats {
        self.inner.stats()
    }
}

impl std::fmt::Debug for SoftDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftDevice")
            .field("name", &self.inner.name)
            .field("local", &self.local_addr())
            .finish()
    }
}

fn check_port(port_num: u8) -> Result<()> {
    if port_num == 1 {
        Ok(())
    } else {
        Err(Error::InvalidAttribute("port number: a soft device has one port, number 1"))
    }
}

impl Device for SoftDevice {
    type Pd = SoftPd;
    type Cq = SoftCq;

    fn name(&self) -> &str {
        &self.inner.name
    }

    fn query(&self) -> Result<DeviceAttr> {
        let config = &self.inner.config;
        Ok(DeviceAttr {
            phys_port_cnt: 1,
            max_qp: config.max_qps,
            max_qp_wr: 16_384,
            max_sge: 32,
            max_cq: config.max_cqs,
            max_cqe: config.max_cqe,
            max_mr: config.max_mrs,
            max_mr_size: 1 << 40,
            max_pd: u32::MAX,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_inline_data: 4096,
            atomics: true,
        })
    }

    fn query_port(&self, port_num: u8) -> Result<PortAttr> {
        check_port(port_num)?;
        Ok(PortAttr {
            state: PortState::Active,
            max_mtu: self.inner.max_mtu,
            active_mtu: self.inner.config.mtu,
            gid_tbl_len: 1,
        })
    }

    fn gids(&self, port_num: u8) -> Result<Vec<Gid>> {
        check_port(port_num)?;
        Ok(vec![self.inner.gid])
    }

    fn alloc_pd(&self) -> Result<SoftPd> {
        Ok(SoftPd::new(Arc::clone(&self.inner)))
    }

    fn create_cq(&self, min_entries: u32) -> Result<SoftCq> {
        SoftCq::new(Arc::clone(&self.inner), min_entries)
    }
}
