//! An epoll instance: a kernel-kept set of descriptors to wait on, each with a caller-chosen
//! token.
//!
//! `poll(2)` hands the kernel the whole set on every call, so a thread watching one socket per
//! connection pays for every connection on every wake-up; with epoll a descriptor is registered
//! once and a wait returns only the ready ones. Registrations are level-triggered, so what a
//! round leaves unread is reported again by the next wait, exactly as with `poll`.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::buffer::spare_capacity;
use rustix::event::epoll::{self, CreateFlags, EventData, EventFlags};
use rustix::event::Timespec;

/// An epoll instance.
pub(crate) struct Epoll {
    fd: OwnedFd,
    events: Vec<epoll::Event>,
}

impl std::fmt::Debug for Epoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epoll").field("fd", &self.fd).finish_non_exhaustive()
    }
}

impl Epoll {
    /// Events taken from the kernel per wait; more ready descriptors wait for the next call.
    const BATCH: usize = 256;

    pub(crate) fn new() -> io::Result<Self> {
        let fd = epoll::create(CreateFlags::CLOEXEC)?;
        Ok(Self { fd, events: Vec::with_capacity(Self::BATCH) })
    }

    /// Watches `source` for readable data (hang-ups and errors are always reported); its
    /// events come back with `token`. The descriptor must stay open until
    /// [`Epoll::remove`] (the kernel drops a registration only when the last descriptor for the
    /// open file closes, so a copy elsewhere would keep a forgotten one alive).
    pub(crate) fn add(&self, source: impl AsFd, token: u64) -> io::Result<()> {
        Ok(epoll::add(&self.fd, source, EventData::new_u64(token), EventFlags::IN)?)
    }

    /// Stops watching `source`. Removing what is not registered is harmless (and ignored).
    pub(crate) fn remove(&self, source: impl AsFd) {
        let _ = epoll::delete(&self.fd, source);
    }

    /// Blocks until a registered descriptor is ready or `timeout` passes (`None`: no timeout)
    /// and returns the tokens of the ready ones; an interrupted or timed-out wait returns none.
    pub(crate) fn wait(&mut self, timeout: Option<Duration>) -> io::Result<Vec<u64>> {
        let spec = timeout.map(|d| Timespec {
            tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(d.subsec_nanos()),
        });
        self.events.clear();
        match epoll::wait(&self.fd, spare_capacity(&mut self.events), spec.as_ref()) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return Ok(Vec::new()),
            Err(err) => return Err(err.into()),
        }
        Ok(self.events.iter().map(|event| event.data.u64()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::EventFd;

    #[test]
    fn reports_only_ready_descriptors_with_their_tokens() {
        let mut epoll = Epoll::new().unwrap();
        let quiet = EventFd::new(false).unwrap();
        let rung = EventFd::new(false).unwrap();
        epoll.add(&quiet, 7).unwrap();
        epoll.add(&rung, 9).unwrap();
        rung.signal(1);
        let ready = epoll.wait(Some(Duration::ZERO)).unwrap();
        assert_eq!(ready, vec![9]);
        // Level-triggered: still ready until consumed.
        assert_eq!(epoll.wait(Some(Duration::ZERO)).unwrap().len(), 1);
        rung.take();
        assert!(epoll.wait(Some(Duration::ZERO)).unwrap().is_empty());
    }

    #[test]
    fn removed_descriptors_are_no_longer_reported() {
        let mut epoll = Epoll::new().unwrap();
        let rung = EventFd::new(false).unwrap();
        epoll.add(&rung, 1).unwrap();
        rung.signal(1);
        epoll.remove(&rung);
        assert!(epoll.wait(Some(Duration::ZERO)).unwrap().is_empty());
        // Removing twice is harmless.
        epoll.remove(&rung);
    }
}
