//! The atomics the ring's ordering argument rests on: `std`'s normally, `loom`'s when the crate
//! is built with `--cfg loom` for the model check.

#[cfg(loom)]
pub use loom::sync::atomic::{fence, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, Ordering};
