//! The C side: structure mirrors ([`types`]), the run-time loaded library ([`library`]), the
//! inline data-path calls through the context's function table ([`ops`]), and the table of
//! sizes and offsets the layout test compares with the real header ([`layout`]).
//!
//! Everything in here is `unsafe` plumbing; the safe provider types in the crate root are the
//! only users.

pub mod layout;
pub mod library;
pub mod ops;
pub mod types;
