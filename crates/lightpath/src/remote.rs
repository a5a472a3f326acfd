//! Registered buffers and one-sided remote buffers: memory the application fills or reads in
//! place, that the peer can RDMA-read or RDMA-write directly, with an optional notification
//! (a write with immediate) that arrives after the written bytes.

use lightpath_verbs::MemoryRegion;

use std::io;

/// A memory region a [`RegisteredBuf`] can wrap: any provider's, with in-place access where
/// the provider allows it.
pub(crate) trait BufRegion: MemoryRegion {
    /// Runs `f` on the bytes. The soft provider lends its memory in place; providers whose
    /// memory a peer process maps (shm) or a NIC writes by DMA (ibverbs) never hand out a Rust
    /// reference to it, so they copy out (and, for `with_bytes_mut`, back in).
    fn with_bytes_dyn(&self, f: &mut dyn FnMut(&[u8]));
    /// Mutable form of [`BufRegion::with_bytes_dyn`].
    fn with_bytes_mut_dyn(&self, f: &mut dyn FnMut(&mut [u8]));
    /// Lets `fill` write bytes `[offset, offset + len)` (checked): in place where the provider
    /// lends its memory, else through a buffer of `len` bytes copied in afterwards. How the
    /// driver moves ring or bounce bytes into an application's buffer with one copy on soft.
    fn fill_dyn(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> lightpath_verbs::Result<()>,
    ) -> lightpath_verbs::Result<()>;
    /// Runs `view` on bytes `[offset, offset + len)` (checked): in place where the provider
    /// lends its memory, else on a copy. How the driver stages a small write from a
    /// registered buffer with one copy on soft.
    fn view_dyn(&self, offset: usize, len: usize, view: &mut dyn FnMut(&[u8]))
        -> lightpath_verbs::Result<()>;
}

fn check_range(region: &dyn MemoryRegion, offset: usize, len: usize) -> lightpath_verbs::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region.len() => Ok(()),
        _ => Err(lightpath_verbs::Error::InvalidAttribute("range outside the registered buffer")),
    }
}

impl BufRegion for lightpath_soft::SoftMr {
    fn with_bytes_dyn(&self, f: &mut dyn FnMut(&[u8])) {
        self.with_bytes(f)
    }
    fn with_bytes_mut_dyn(&self, f: &mut dyn FnMut(&mut [u8])) {
        self.with_bytes_mut(f)
    }
    fn fill_dyn(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> lightpath_verbs::Result<()>,
    ) -> lightpath_verbs::Result<()> {
        check_range(self, offset, len)?;
        self.with_bytes_mut(|bytes| fill(&mut bytes[offset..offset + len]))
    }
    fn view_dyn(
        &self,
        offset: usize,
        len: usize,
        view: &mut dyn FnMut(&[u8]),
    ) -> lightpath_verbs::Result<()> {
        check_range(self, offset, len)?;
        self.with_bytes(|bytes| view(&bytes[offset..offset + len]));
        Ok(())
    }
}

/// Copy-out/copy-in access for providers that never lend their memory.
macro_rules! copying_buf_region {
    ($mr:ty) => {
        impl BufRegion for $mr {
            fn with_bytes_dyn(&self, f: &mut dyn FnMut(&[u8])) {
                let mut bytes = vec![0u8; self.len()];
                // Reading the whole region from offset 0 is always in bounds.
                let _ = self.read(0, &mut bytes);
                f(&bytes)
            }
            fn with_bytes_mut_dyn(&self, f: &mut dyn FnMut(&mut [u8])) {
                let mut bytes = vec![0u8; self.len()];
                let _ = self.read(0, &mut bytes);
                f(&mut bytes);
                let _ = self.write(0, &bytes);
            }
            fn fill_dyn(
                &self,
                offset: usize,
                len: usize,
                fill: &mut dyn FnMut(&mut [u8]) -> lightpath_verbs::Result<()>,
            ) -> lightpath_verbs::Result<()> {
                check_range(self, offset, len)?;
                let mut bytes = vec![0u8; len];
                fill(&mut bytes)?;
                self.write(offset, &bytes)
            }
            fn view_dyn(
                &self,
                offset: usize,
                len: usize,
                view: &mut dyn FnMut(&[u8]),
            ) -> lightpath_verbs::Result<()> {
                check_range(self, offset, len)?;
                let mut bytes = vec![0u8; len];
                self.read(offset, &mut bytes)?;
                view(&bytes);
                Ok(())
            }
        }
    };
}
copying_buf_region!(lightpath_shm::ShmMr);
copying_buf_region!(lightpath_ibverbs::IbvMr);

/// A buffer registered with a stream's RDMA device (`Stream::register_buf`), usable with
/// that stream only.
///
/// Its bytes are reached through copying accessors or inside [`RegisteredBuf::with_bytes`] /
/// [`RegisteredBuf::with_bytes_mut`] (in place on the soft provider, where the device cannot
/// touch the buffer while the closure runs, so keep it short; through a copy on shm and
/// ibverbs, whose memory a peer or NIC may change at any moment). A peer that was given
/// [`RegisteredBuf::remote`] may read and write it at any time, as a NIC would by DMA.
pub struct RegisteredBuf {
    region: Box<dyn BufRegion>,
    /// The connection it was registered for.
    owner: u64,
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf").field("len", &self.len()).field("remote", &self.remote()).finish()
    }
}

impl RegisteredBuf {
    pub(crate) fn new(region: Box<dyn BufRegion>, owner: u64) -> Self {
        Self { region, owner }
    }

    /// The region, if the buffer belongs to connection `id` (another connection's keys would
    /// fail on this one's queue pair and break it).
    pub(crate) fn region_for(&self, id: u64) -> io::Result<&dyn BufRegion> {
        if self.owner != id {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "lightpath: this buffer was registered with another stream",
            ));
        }
        Ok(&*self.region)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.region.len() == 0
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> io::Result<()> {
        self.region.write(offset, src).map_err(crate::error::from_verbs)
    }

    /// Copies bytes at `offset` out of the buffer.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        self.region.read(offset, dst).map_err(crate::error::from_verbs)
    }

    /// Runs `f` on the bytes (in place on the soft provider, see the type's docs).
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        let mut f = Some(f);
        let mut out = None;
        self.region.with_bytes_dyn(&mut |bytes| out = f.take().map(|f| f(bytes)));
        out.expect("the provider runs the closure exactly once")
    }

    /// Runs `f` on the bytes mutably (in place on the soft provider, see the type's docs).
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let mut f = Some(f);
        let mut out = None;
        self.region.with_bytes_mut_dyn(&mut |bytes| out = f.take().map(|f| f(bytes)));
        out.expect("the provider runs the closure exactly once")
    }

    /// What the peer needs to read or write this buffer.
    pub fn remote(&self) -> RemoteBuf {
        RemoteBuf { addr: self.region.addr(), len: self.region.len() as u64, rkey: self.region.rkey() }
    }
}

/// A peer's buffer, as its [`RegisteredBuf::remote`] described it. Send it to the peer over
/// the stream itself (for example as a message of [`RemoteBuf::to_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteBuf {
    /// Address of the first byte (the owner's).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteBuf {
    /// 20 bytes: address, length, key (big-endian).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut out = [0u8; 20];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Parses [`RemoteBuf::to_bytes`]; `None` unless exactly 20 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<RemoteBuf> {
        let bytes: &[u8; 20] = bytes.try_into().ok()?;
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(b)
        };
        Some(RemoteBuf {
            addr: u64_at(0),
            len: u64_at(8),
            rkey: u32::from_be_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]),
        })
    }

    /// The address `offset` bytes in, if `offset + len` stays inside the buffer.
    pub(crate) fn range(&self, offset: u64, len: u64) -> io::Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr.wrapping_add(offset)),
            _ => {
                Err(io::Error::new(io::ErrorKind::InvalidInput, "lightpath: range outside the remote buffer"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_buf_bytes() {
        let remote = RemoteBuf { addr: 0x1122_3344_5566_7788, len: 4096, rkey: 0xAABBCCDD };
        assert_eq!(RemoteBuf::from_bytes(&remote.to_bytes()), Some(remote));
        assert_eq!(RemoteBuf::from_bytes(&[0u8; 19]), None);
        assert_eq!(remote.range(4000, 96).unwrap(), remote.addr + 4000);
        assert!(remote.range(4000, 97).is_err());
        assert!(remote.range(u64::MAX, 2).is_err());
    }
}
