//! [`ShmProvider`]: the shm provider's one device name, and probing a peer device.

use std::time::{Duration, Instant};

use lightpath_verbs::{Error, Gid, Provider, Result};
use rustix::event::{PollFd, PollFlags};

use crate::address::rendezvous_name;
use crate::config::ShmConfig;
use crate::device::ShmDevice;
use crate::sys::{poll_fds, Memfd, SeqPacket};
use crate::wire::{Message, MAX_MESSAGE};

/// The name [`ShmProvider`] lists and opens.
pub const DEVICE_NAME: &str = "shm";

/// The shm provider. Every `open` creates a new endpoint (with its own GID) using `config`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShmProvider {
    /// Configuration of opened devices.
    pub config: ShmConfig,
}

impl Provider for ShmProvider {
    type Device = ShmDevice;

    fn name(&self) -> &'static str {
        "shm"
    }

    /// `["shm"]` when this kernel offers what the provider needs (sealable memfds).
    fn devices(&self) -> Result<Vec<String>> {
        Memfd::create("lightpath-shm-probe", 4096).map_err(|err| {
            Error::Unavailable(format!("memfd_create with sealing is not available: {err}"))
        })?;
        Ok(vec![DEVICE_NAME.to_string()])
    }

    fn open(&self, name: &str) -> Result<ShmDevice> {
        if name != DEVICE_NAME {
            return Err(Error::NotFound("shm device name (the only one is `shm`)"));
        }
        ShmDevice::open(self.config.clone())
    }
}

/// Checks that an shm device with `gid` is reachable from this process and answers, within
/// `timeout`: what a transport negotiation can call before committing to shm.
pub fn probe(gid: Gid, timeout: Duration) -> Result<()> {
    let socket = SeqPacket::connect_abstract(&rendezvous_name(gid))
        .map_err(|err| Error::Unavailable(format!("no shm device with GID {gid} here: {err}")))?;
    let tag = crate::sys::random_u64() as u32;
    let (bytes, len) = Message::Ping { tag }.encode();
    socket.send(&bytes[..len], &[])?;
    let deadline = Instant::now() + timeout;
    loop {
        let mut buf = [0u8; MAX_MESSAGE];
        match socket.recv(&mut buf)? {
            Some(received) if Message::decode(&buf[..received.len]) == Some(Message::Pong { tag }) => {
                return Ok(())
            }
            Some(_) => {
                return Err(Error::Unavailable(format!("the socket of GID {gid} is not an shm device")))
            }
            None => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Unavailable(format!("the shm device with GID {gid} did not answer")));
        }
        poll_fds(&mut [PollFd::new(&socket, PollFlags::IN)], Some(left))?;
    }
}
