//! Big-endian field readers and writers used by the packet views.
//!
//! Callers have already checked the buffer length (`check_len`), so indexing here cannot fail
//! for the constant offsets the views pass in.

pub(crate) fn read_u16(data: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([data[at], data[at + 1]])
}

pub(crate) fn read_u24(data: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([0, data[at], data[at + 1], data[at + 2]])
}

pub(crate) fn read_u32(data: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]])
}

pub(crate) fn read_u64(data: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&data[at..at + 8]);
    u64::from_be_bytes(bytes)
}

pub(crate) fn write_u16(data: &mut [u8], at: usize, value: u16) {
    data[at..at + 2].copy_from_slice(&value.to_be_bytes());
}

/// Writes the low 24 bits of `value`; the top byte is dropped by design (QPNs, PSNs, MSNs).
pub(crate) fn write_u24(data: &mut [u8], at: usize, value: u32) {
    data[at..at + 3].copy_from_slice(&value.to_be_bytes()[1..]);
}

pub(crate) fn write_u32(data: &mut [u8], at: usize, value: u32) {
    data[at..at + 4].copy_from_slice(&value.to_be_bytes());
}

pub(crate) fn write_u64(data: &mut [u8], at: usize, value: u64) {
    data[at..at + 8].copy_from_slice(&value.to_be_bytes());
}

/// Declares a zero-copy view over a fixed-length header: the struct plus `new_unchecked`,
/// `new_checked`, `check_len` and `into_inner`.
macro_rules! fixed_len_view {
    ($(#[$doc:meta])* $name:ident, $len:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps a buffer without checking its length; accessors may panic on a short one.
            pub const fn new_unchecked(buffer: T) -> $name<T> {
                $name { buffer }
            }

            /// Wraps a buffer after checking that it holds the whole header.
            pub fn new_checked(buffer: T) -> $crate::error::Result<$name<T>> {
                let packet = Self::new_unchecked(buffer);
                packet.check_len()?;
                Ok(packet)
            }

            /// Checks that the buffer holds the whole header; after this no accessor panics.
            pub fn check_len(&self) -> $crate::error::Result<()> {
                if self.buffer.as_ref().len() < $len {
                    Err($crate::error::Error::Truncated)
                } else {
                    Ok(())
                }
            }

            /// Returns the underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
pub(crate) use fixed_len_view;
