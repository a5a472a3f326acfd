//! Engine configuration: the local address, the RoCE UDP port and resource limits.

use lightpath_verbs::Gid;

/// How an [`Engine`](crate::Engine) is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// The engine's one local address (GID index 0).
    pub gid: Gid,
    /// The UDP port this engine receives on (4791), which received ICRCs are checked with,
    /// and the destination port of a queue pair whose address vector names none
    /// (`udp_dport` 0). A queue pair with a `udp_dport` sends there instead, so engines on
    /// different ports (several processes sharing one IP address) can talk to each other.
    pub roce_port: u16,
    /// Check the ICRC of received datagrams.
    pub verify_icrc: bool,
    /// The UDP source port every datagram is sent from, if the driver cannot choose one per
    /// queue pair (one socket sends from the one port it is bound to). The ICRC covers the
    /// source port, so the engine seals each datagram for this port and reports it in
    /// [`Transmit::src_port`](crate::Transmit::src_port). `None` (the default): the per-QP
    /// entropy port rxe derives from the QPN pair.
    pub fixed_src_port: Option<u16>,
    /// Most queue pairs alive at once.
    pub max_qps: u32,
    /// Most memory regions registered at once.
    pub max_mrs: u32,
    /// Most completion queues alive at once.
    pub max_cqs: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
    /// Towards a Lightpath soft peer, [`Engine::poll_transmit`](crate::Engine::poll_transmit)
    /// may leave a request's payload in registered memory ([`Transmit::gathered`](crate::Transmit::gathered))
    /// when it lies in one region whose memory says where its bytes stay
    /// ([`RegionMemory::stable_addr`](crate::RegionMemory::stable_addr)): the driver sends it from
    /// there, one copy fewer per byte. Off by default.
    pub gather_payloads: bool,
}

impl EngineConfig {
    /// The IANA "roce" port.
    pub const ROCE_PORT: u16 = 4791;

    /// The default configuration for the address `gid`.
    pub fn new(gid: Gid) -> Self {
        Self { gid, ..Self::default() }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            gid: Gid::ZERO,
            roce_port: Self::ROCE_PORT,
            verify_icrc: true,
            fixed_src_port: None,
            max_qps: 4096,
            max_mrs: 65536,
            max_cqs: 4096,
            max_cqe: 65536,
            gather_payloads: false,
        }
    }
}
