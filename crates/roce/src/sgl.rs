//! Scatter/gather lists: copying a message's bytes between registered memory (through the
//! region table's checks) and a packet, at any byte offset of the message.
//!
//! Each copy goes straight between the region and the datagram buffer: the engine never
//! stages payload in a buffer of its own.

use lightpath_verbs::Sge;

use crate::memory::{LocalProtectionError, MrTable};

/// Total length of a scatter/gather list (saturating).
pub(crate) fn total_len(sges: &[Sge]) -> u64 {
    sges.iter().map(|s| u64::from(s.length)).sum()
}

/// Checks every entry of `sges` against the region table; `write` asks for LOCAL_WRITE.
/// Zero-length entries are not checked (nothing is ever accessed through them).
pub(crate) fn validate(mrs: &MrTable, sges: &[Sge], write: bool) -> Result<(), LocalProtectionError> {
    for sge in sges.iter().filter(|s| s.length > 0) {
        mrs.local(sge.lkey, sge.addr, u64::from(sge.length), write)?;
    }
    Ok(())
}

/// Visits the pieces of `[offset, offset + len)` of the list's concatenated bytes, each as
/// (entry, offset inside the entry, length, offset inside the requested range).
fn for_each_piece(
    sges: &[Sge],
    mut offset: u64,
    len: usize,
    mut visit: impl FnMut(&Sge, u64, usize, usize) -> Result<(), LocalProtectionError>,
) -> Result<(), LocalProtectionError> {
    let mut done = 0usize;
    for sge in sges {
        if done == len {
            break;
        }
        let sge_len = u64::from(sge.length);
        if offset >= sge_len {
            offset -= sge_len;
            continue;
        }
        let take = ((sge_len - offset) as usize).min(len - done);
        visit(sge, offset, take, done)?;
        done += take;
        offset = 0;
    }
    if done == len {
        Ok(())
    } else {
        Err(LocalProtectionError)
    }
}

/// Copies bytes `[offset, offset + dst.len())` of the list into `dst`.
pub(crate) fn gather(
    mrs: &MrTable,
    sges: &[Sge],
    offset: u64,
    dst: &mut [u8],
) -> Result<(), LocalProtectionError> {
    let len = dst.len();
    for_each_piece(sges, offset, len, |sge, at, take, out| {
        let (memory, region_offset) = mrs.local(sge.lkey, sge.addr + at, take as u64, false)?;
        memory.read(region_offset, &mut dst[out..out + take]);
        Ok(())
    })
}

/// Where bytes `[offset, offset + len)` of the list are, if they lie in one entry whose
/// region's memory stays in place (`RegionMemory::stable_addr`): the address of the first.
pub(crate) fn stable_span(mrs: &MrTable, sges: &[Sge], offset: u64, len: usize) -> Option<usize> {
    let mut found = None;
    for_each_piece(sges, offset, len, |sge, at, take, _| {
        if take != len {
            return Err(LocalProtectionError);
        }
        let (memory, region_offset) = mrs.local(sge.lkey, sge.addr + at, take as u64, false)?;
        found = memory.stable_addr().and_then(|base| base.checked_add(region_offset));
        Ok(())
    })
    .ok()?;
    found
}

/// Copies `src` into bytes `[offset, offset + src.len())` of the list.
pub(crate) fn scatter(
    mrs: &MrTable,
    sges: &[Sge],
    offset: u64,
    src: &[u8],
) -> Result<(), LocalProtectionError> {
    for_each_piece(sges, offset, src.len(), |sge, at, take, from| {
        let (memory, region_offset) = mrs.local(sge.lkey, sge.addr + at, take as u64, true)?;
        memory.write(region_offset, &src[from..from + take]);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use lightpath_verbs::AccessFlags;

    use super::*;
    use crate::memory::VecMemory;

    #[test]
    fn gather_and_scatter_cross_entries() {
        let mut mrs = MrTable::new(4);
        let memory = Arc::new(VecMemory::from_bytes((0u8..32).collect()));
        let keys = mrs.register(memory.clone(), 100, AccessFlags::LOCAL_WRITE).unwrap();
        let sges = [
            Sge { addr: 104, length: 3, lkey: keys.lkey },
            Sge { addr: 100, length: 0, lkey: 0xdead },
            Sge { addr: 120, length: 5, lkey: keys.lkey },
        ];
        assert_eq!(total_len(&sges), 8);
        assert!(validate(&mrs, &sges, true).is_ok());
        let mut out = [0u8; 4];
        gather(&mrs, &sges, 2, &mut out).unwrap();
        assert_eq!(out, [6, 20, 21, 22]);
        scatter(&mrs, &sges, 1, &[0xAA, 0xBB, 0xCC]).unwrap();
        let bytes = memory.snapshot();
        assert_eq!(&bytes[4..7], &[4, 0xAA, 0xBB]);
        assert_eq!(&bytes[19..22], &[19, 0xCC, 21]);
        // Past the end of the list.
        assert!(gather(&mrs, &sges, 6, &mut out).is_err());
    }

    #[test]
    fn bad_keys_are_reported() {
        let mut mrs = MrTable::new(4);
        let keys = mrs.register(Arc::new(VecMemory::new(8)), 0, AccessFlags::NONE).unwrap();
        let sges = [Sge { addr: 0, length: 8, lkey: keys.lkey }];
        assert!(validate(&mrs, &sges, false).is_ok());
        assert!(validate(&mrs, &sges, true).is_err());
        assert!(scatter(&mrs, &sges, 0, &[1]).is_err());
        let bad = [Sge { addr: 0, length: 9, lkey: keys.lkey }];
        assert!(validate(&mrs, &bad, false).is_err());
    }
}
