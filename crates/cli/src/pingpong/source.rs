//! Where a tool's device comes from, per provider, shared by `pingpong` and `interop-peer`: a
//! soft device is placed on an IP address that may only be known once the TCP connection is up
//! (see [`super::endpoint`]); an ibverbs device is named (`-d`, else the first one) and sends
//! from its port's RoCE v2 IPv4 GID unless `-g` gives an index.

use std::net::{IpAddr, TcpStream};

use anyhow::{anyhow, Result};
use lightpath_ibverbs::{IbvConfig, IbvDevice, IbvProvider};
use lightpath_soft::{ProgressMode, SoftDevice};
use lightpath_verbs::{Device, Mtu, Provider};

use super::endpoint::{open_soft, usable, Placement};

/// Opens the device a tool runs on.
pub(crate) trait DeviceSource {
    /// The provider's device type.
    type Device: Device;

    /// The device for a server: `Some` before any client connects when its place is already
    /// known, else `None` (then [`DeviceSource::for_server`] is called on the connection).
    fn before_accept(&self) -> Result<Option<Self::Device>>;

    /// The device for a server, once a client connected.
    fn for_server(&self, connection: &TcpStream) -> Result<Self::Device>;

    /// The device for a client connected to its server.
    fn for_client(&self, connection: &TcpStream) -> Result<Self::Device>;

    /// Words for the tools' progress lines ("soft device 10.0.0.1 UDP 4791").
    fn describe(&self, device: &Self::Device) -> String;
}

/// A soft device placed by `--bind`/`--udp-port` or `-d soft-…`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SoftSource {
    pub placement: Placement,
    pub mtu: Mtu,
    pub mode: ProgressMode,
}

impl SoftSource {
    fn open(&self, ip: IpAddr) -> Result<SoftDevice> {
        open_soft(ip, self.placement.udp_port, self.mtu, self.mode)
    }
}

impl DeviceSource for SoftSource {
    type Device = SoftDevice;

    fn before_accept(&self) -> Result<Option<SoftDevice>> {
        self.placement.bind.map(|ip| self.open(usable(ip)?)).transpose()
    }

    fn for_server(&self, connection: &TcpStream) -> Result<SoftDevice> {
        self.open(self.placement.server_ip(connection)?)
    }

    fn for_client(&self, connection: &TcpStream) -> Result<SoftDevice> {
        self.open(self.placement.client_ip(connection)?)
    }

    fn describe(&self, device: &SoftDevice) -> String {
        format!("soft device {} UDP {}", device.local_addr().ip(), device.local_addr().port())
    }
}

/// An ibverbs device: `-d` (else the first one), port `-i`, GID index `-g` (else automatic).
#[derive(Clone, Debug)]
pub(crate) struct IbvSource {
    pub device: Option<String>,
    pub port: u8,
    pub gid_index: Option<u32>,
}

impl IbvSource {
    /// Opens the device (the same whatever the connection).
    pub fn open(&self) -> Result<IbvDevice> {
        let provider =
            IbvProvider::with_config(IbvConfig { port: Some(self.port), gid_index: self.gid_index });
        let opened = match &self.device {
            Some(name) => provider.open(name),
            None => provider.open_first(),
        };
        opened.map_err(|err| match err {
            lightpath_verbs::Error::Unavailable(reason) => anyhow!("ibverbs: {reason}"),
            other => anyhow!("ibverbs: cannot open the device: {other}"),
        })
    }
}

impl DeviceSource for IbvSource {
    type Device = IbvDevice;

    fn before_accept(&self) -> Result<Option<IbvDevice>> {
        self.open().map(Some)
    }

    fn for_server(&self, _: &TcpStream) -> Result<IbvDevice> {
        self.open()
    }

    fn for_client(&self, _: &TcpStream) -> Result<IbvDevice> {
        self.open()
    }

    fn describe(&self, device: &IbvDevice) -> String {
        let source = device.source_gid();
        format!(
            "ibverbs device {} port {} GID index {} {}",
            device.name(),
            device.port(),
            source.index,
            source.gid
        )
    }
}
