//! Engine configuration: the local address, the RoCE UDP port and resource limits.

use lightpath_verbs::Gid;

/// How an [`Engine`](crate::Engine) is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// The engine's one local address (GID index 0).
    pub gid: Gid,
    /// UDP destination port of every transmit (4791).
    pub roce_port: u16,
    /// Check the ICRC of received datagrams.
    pub verify_icrc: bool,
    /// Most queue pairs alive at once.
    pub max_qps: u32,
    /// Most memory regions registered at once.
    pub max_mrs: u32,
    /// Most completion queues alive at once.
    pub max_cqs: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
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
            max_qps: 4096,
            max_mrs: 65536,
            max_cqs: 4096,
            max_cqe: 65536,
        }
    }
}
