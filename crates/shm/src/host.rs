//! Which processes can share memory with each other: the host identity.
//!
//! Two processes can connect shm devices when they run on the same kernel (same boot) and see
//! the same abstract Unix socket names (same network namespace, where those names live). The
//! IPC namespace is included as well so that two containers that share a network namespace but
//! were deliberately given separate IPC namespaces are not joined behind their back. A stream
//! layer that negotiates transports exchanges [`HostIdentity`] strings over its TCP connection
//! and picks shm when they are equal.

use std::fmt;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::str::FromStr;

/// The kernel boot and the namespaces that decide whether two processes can use shm.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id` (a UUID, lower case).
    pub boot_id: String,
    /// Inode of `/proc/self/ns/net`.
    pub net_ns: u64,
    /// Inode of `/proc/self/ns/ipc`.
    pub ipc_ns: u64,
}

impl HostIdentity {
    /// The identity of the calling process.
    pub fn current() -> io::Result<Self> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim().to_ascii_lowercase();
        if !is_uuid(&boot_id) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "boot_id is not a UUID"));
        }
        let net_ns = std::fs::metadata("/proc/self/ns/net")?.ino();
        let ipc_ns = std::fs::metadata("/proc/self/ns/ipc")?.ino();
        Ok(Self { boot_id, net_ns, ipc_ns })
    }

    /// Whether a process with identity `other` can connect to shm devices of this one.
    pub fn can_share_with(&self, other: &HostIdentity) -> bool {
        self == other
    }

    /// The identity as 16 bytes, for protocols with a fixed-size field (equal identities give
    /// equal bytes; for one boot, different namespaces give different bytes): the boot id's
    /// bytes, the first half mixed with the network namespace and the second with the IPC
    /// namespace (each through a multiplication by an odd constant, which is invertible, so no
    /// two namespaces of one boot collide).
    pub fn to_bytes(&self) -> [u8; 16] {
        let hex: String = self.boot_id.chars().filter(|c| *c != '-').collect();
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("00"), 16).unwrap_or(0);
        }
        let mut first = [0u8; 8];
        let mut second = [0u8; 8];
        first.copy_from_slice(&bytes[..8]);
        second.copy_from_slice(&bytes[8..]);
        let first = u64::from_be_bytes(first) ^ self.net_ns.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let second = u64::from_be_bytes(second) ^ self.ipc_ns.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        bytes[..8].copy_from_slice(&first.to_be_bytes());
        bytes[8..].copy_from_slice(&second.to_be_bytes());
        bytes
    }
}

fn is_uuid(text: &str) -> bool {
    text.len() == 36
        && text.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

impl fmt::Display for HostIdentity {
    /// `boot=<uuid>,net=<inode>,ipc=<inode>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "boot={},net={},ipc={}", self.boot_id, self.net_ns, self.ipc_ns)
    }
}

impl FromStr for HostIdentity {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || format!("not a host identity (boot=<uuid>,net=<n>,ipc=<n>): {text:?}");
        let mut parts = text.split(',');
        let mut field = |name: &str| {
            parts
                .next()
                .and_then(|part| part.strip_prefix(name))
                .and_then(|v| v.strip_prefix('='))
                .ok_or_else(bad)
        };
        let boot_id = field("boot")?.to_ascii_lowercase();
        let net_ns = field("net")?.parse().map_err(|_| bad())?;
        let ipc_ns = field("ipc")?.parse().map_err(|_| bad())?;
        if parts.next().is_some() || !is_uuid(&boot_id) {
            return Err(bad());
        }
        Ok(Self { boot_id, net_ns, ipc_ns })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_identity_round_trips() {
        let here = HostIdentity::current().expect("identity");
        let text = here.to_string();
        assert!(text.starts_with("boot="), "{text}");
        let parsed: HostIdentity = text.parse().expect("parse");
        assert_eq!(parsed, here);
        assert!(here.can_share_with(&parsed));
        let elsewhere = HostIdentity { net_ns: here.net_ns + 1, ..here.clone() };
        assert!(!here.can_share_with(&elsewhere));
    }

    #[test]
    fn byte_form_tells_namespaces_and_boots_apart() {
        let here = HostIdentity::current().expect("identity");
        assert_eq!(here.to_bytes(), here.clone().to_bytes());
        assert_ne!(here.to_bytes(), [0u8; 16]);
        let other_net = HostIdentity { net_ns: here.net_ns + 1, ..here.clone() };
        let other_ipc = HostIdentity { ipc_ns: here.ipc_ns + 1, ..here.clone() };
        let other_boot =
            HostIdentity { boot_id: "123e4567-e89b-12d3-a456-426614174000".into(), ..here.clone() };
        for other in [other_net, other_ipc, other_boot] {
            assert_ne!(here.to_bytes(), other.to_bytes(), "{other}");
        }
    }

    #[test]
    fn malformed_identities_are_refused() {
        for text in [
            "",
            "boot=x,net=1,ipc=2",
            "boot=0123e4567-e89b-12d3-a456-42661417400,net=1,ipc=2",
            "boot=123e4567-e89b-12d3-a456-426614174000,net=1",
            "boot=123e4567-e89b-12d3-a456-426614174000,net=1,ipc=2,extra=3",
            "net=1,boot=123e4567-e89b-12d3-a456-426614174000,ipc=2",
            "boot=123e4567-e89b-12d3-a456-426614174000,net=-1,ipc=2",
        ] {
            assert!(text.parse::<HostIdentity>().is_err(), "{text:?} accepted");
        }
        assert!("boot=123E4567-E89B-12D3-A456-426614174000,net=1,ipc=2".parse::<HostIdentity>().is_ok());
    }
}
