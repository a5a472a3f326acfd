//! Shm GIDs and rendezvous names.
//!
//! A shm device has one GID, made up when the device is opened: the unique-local prefix
//! `fd53:484d` ("SHM") followed by 12 random bytes. The GID is also the device's address: the
//! device listens on the abstract Unix socket `lightpath-shm/<32 hex digits of the GID>`, so a
//! queue pair that is told "connect to GID g, QPN n" (by `lightpath_verbs::connect`, the
//! stream layer, or any other out-of-band exchange) knows where to knock.

use lightpath_verbs::Gid;

/// The first four bytes of every shm GID.
pub const GID_PREFIX: [u8; 4] = [0xfd, 0x53, 0x48, 0x4d];

/// Whether `gid` has the shape of an shm GID.
pub fn is_shm_gid(gid: Gid) -> bool {
    gid.0[..4] == GID_PREFIX
}

/// The abstract socket name (without its leading NUL) a device with `gid` listens on.
pub fn rendezvous_name(gid: Gid) -> Vec<u8> {
    format!("lightpath-shm/{}", gid.to_hex()).into_bytes()
}

/// A fresh random shm GID.
pub(crate) fn random_gid() -> std::io::Result<Gid> {
    let mut bytes = [0u8; 16];
    crate::sys::random_bytes(&mut bytes[4..])?;
    bytes[..4].copy_from_slice(&GID_PREFIX);
    Ok(Gid(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_are_prefixed_and_distinct() {
        let a = random_gid().expect("gid");
        let b = random_gid().expect("gid");
        assert!(is_shm_gid(a) && is_shm_gid(b));
        assert_ne!(a, b);
        assert!(!is_shm_gid("127.0.0.1".parse().expect("gid")));
        let name = rendezvous_name(a);
        assert!(name.starts_with(b"lightpath-shm/fd53484d"));
        assert_eq!(name.len(), "lightpath-shm/".len() + 32);
    }
}
