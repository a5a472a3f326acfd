//! Memfds: anonymous, unnamed files in memory. Every piece of memory the shm provider shares
//! (queue-pair rings, memory regions) is one memfd, so nothing is ever left in a file system:
//! the kernel frees the memory when the last descriptor and the last mapping are gone, in
//! whichever process that happens, crash or not.
//!
//! Seals make shared memory safe to map from a file descriptor a peer handed over. A peer that
//! could shrink a file we have mapped would turn every access past the new end into `SIGBUS`,
//! so every memfd is sealed against shrinking (and growing) before it leaves the process, and a
//! descriptor that arrives from a peer is accepted only if it carries the shrink seal and is as
//! large as the peer says.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{
    fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, FileType, MemfdFlags, SealFlags,
};

/// An anonymous memory file of fixed size.
#[derive(Debug)]
pub(crate) struct Memfd {
    fd: OwnedFd,
    len: u64,
}

/// Why a descriptor from a peer was refused.
#[derive(Debug)]
pub(crate) enum PeerFdError {
    /// Not a sealable memory file (fcntl refused, or not a regular file).
    NotMemfd,
    /// The file may still shrink under our mapping.
    NotSealed,
    /// Smaller than the peer claimed.
    TooSmall { actual: u64, needed: u64 },
    /// A system call failed.
    Io(io::Error),
}

impl fmt::Display for PeerFdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerFdError::NotMemfd => f.write_str("descriptor is not a sealable memory file"),
            PeerFdError::NotSealed => f.write_str("memory file is not sealed against shrinking"),
            PeerFdError::TooSmall { actual, needed } => {
                write!(f, "memory file has {actual} bytes, {needed} needed")
            }
            PeerFdError::Io(err) => write!(f, "{err}"),
        }
    }
}

impl Memfd {
    /// A new zero-filled memfd of `len` bytes (`name` shows up in `/proc/<pid>/maps` only),
    /// sealed against shrinking and growing.
    pub(crate) fn create(name: &str, len: u64) -> io::Result<Self> {
        let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        ftruncate(&fd, len)?;
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)?;
        Ok(Self { fd, len })
    }

    /// Forbids every future writable mapping (ours and the peer's); mappings that exist stay
    /// writable. Called after the owner mapped the file, so a peer can only map it read-only.
    pub(crate) fn seal_future_writes(&self) -> io::Result<()> {
        Ok(fcntl_add_seals(&self.fd, SealFlags::FUTURE_WRITE | SealFlags::SEAL)?)
    }

    /// Forbids adding seals, so a peer cannot add any either.
    pub(crate) fn seal_seals(&self) -> io::Result<()> {
        Ok(fcntl_add_seals(&self.fd, SealFlags::SEAL)?)
    }

    /// Accepts a descriptor received from a peer if it is a memfd of at least `min_len` bytes
    /// that can no longer shrink.
    pub(crate) fn from_peer(fd: OwnedFd, min_len: u64) -> Result<Self, PeerFdError> {
        let seals = fcntl_get_seals(&fd).map_err(|_| PeerFdError::NotMemfd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(PeerFdError::NotSealed);
        }
        let stat = fstat(&fd).map_err(|err| PeerFdError::Io(err.into()))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(PeerFdError::NotMemfd);
        }
        let actual = u64::try_from(stat.st_size).unwrap_or(0);
        if actual < min_len {
            return Err(PeerFdError::TooSmall { actual, needed: min_len });
        }
        Ok(Self { fd, len: actual })
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl AsFd for Memfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_memfds_pass_the_peer_checks() {
        let memfd = Memfd::create("lightpath-shm-test", 8192).expect("memfd");
        let dup = memfd.fd.try_clone().expect("dup");
        let peer = Memfd::from_peer(dup, 8192).expect("accepted");
        assert_eq!(peer.len(), 8192);
        let dup = memfd.fd.try_clone().expect("dup");
        assert!(matches!(Memfd::from_peer(dup, 8193), Err(PeerFdError::TooSmall { .. })));
    }

    #[test]
    fn unsealed_or_foreign_descriptors_are_refused() {
        let unsealed =
            memfd_create("unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
        ftruncate(&unsealed, 4096).expect("size");
        assert!(matches!(Memfd::from_peer(unsealed, 4096), Err(PeerFdError::NotSealed)));
        let file = std::fs::File::open("/proc/self/status").expect("open");
        assert!(matches!(Memfd::from_peer(file.into(), 1), Err(PeerFdError::NotMemfd)));
    }

    #[test]
    fn future_write_seal_forbids_new_writable_mappings() {
        let memfd = Memfd::create("lightpath-shm-test", 4096).expect("memfd");
        let writable = crate::sys::Mapping::new(&memfd, true).expect("writable map before the seal");
        memfd.seal_future_writes().expect("seal");
        assert!(crate::sys::Mapping::new(&memfd, true).is_err(), "writable mapping after the seal");
        let read_only = crate::sys::Mapping::new(&memfd, false).expect("read-only map");
        assert!(writable.write(0, b"still writable"));
        let mut out = [0u8; 14];
        assert!(read_only.read(0, &mut out));
        assert_eq!(&out, b"still writable");
    }
}
