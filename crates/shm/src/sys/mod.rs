//! The operating-system pieces the shm provider needs: anonymous memory files (memfds) with
//! seals, shared mappings of them, eventfds, Unix `SOCK_SEQPACKET` sockets that carry file
//! descriptors, `poll`, and epoll (for the socket thread, which watches one socket per
//! connection).
//!
//! Everything here goes through `rustix` (safe wrappers around the system calls) except the
//! mapping itself: [`Mapping`] is the one place in the crate with `unsafe` code, because it
//! turns a memfd into memory and reads and writes that memory through raw pointers.

mod epoll;
mod eventfd;
mod mapping;
mod memfd;
mod poll;
mod socket;

pub(crate) use epoll::Epoll;
pub(crate) use eventfd::EventFd;
pub(crate) use mapping::Mapping;
pub(crate) use memfd::Memfd;
pub(crate) use poll::poll_fds;
pub(crate) use socket::{Listener, SeqPacket};

/// The system page size.
pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

/// Fills `buf` with random bytes from the kernel.
pub(crate) fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        filled += rustix::rand::getrandom(&mut buf[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(())
}

/// A random `u64` from the kernel (0 if the kernel refuses, which only weakens key guessing).
pub(crate) fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    match random_bytes(&mut bytes) {
        Ok(()) => u64::from_ne_bytes(bytes),
        Err(_) => 0,
    }
}
