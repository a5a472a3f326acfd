//! The sans-I/O core of Lightpath's socket-like API (`lightpath::Stream`).
//!
//! Nothing here touches a socket, a queue pair, a clock or memory: the drivers in the
//! `lightpath` facade crate (blocking and tokio) feed events in and carry out what comes
//! out, as quinn-proto's `Connection` and rustls' `ConnectionCommon` do for their drivers.
//!
//! * [`record`] — the records both transports carry and the 32-bit immediate that describes
//!   one over RDMA;
//! * [`frame`] — the same records over the TCP fallback (8-byte headers);
//! * [`credit`] — the credit word a receiver writes into its sender's credit slot;
//! * [`conn`] — ring, receive-credit and send-queue accounting of one RDMA connection;
//! * [`rendezvous`] — large zero-copy transfers fetched by the receiver with RDMA READ: the
//!   descriptor record and the state of the rendezvous being fetched;
//! * [`negotiate`] — the messages two endpoints exchange over TCP to pick a transport.
//!
//! The protocol is described in full in `docs/stream-protocol.md`.
#![forbid(unsafe_code)]

pub mod conn;
pub mod credit;
pub mod frame;
pub mod negotiate;
pub mod record;
pub mod rendezvous;

pub use conn::{Arrival, Conn, ConnConfig, Front, Op, ProtocolError, HOLD_LIMIT};
pub use credit::CreditWord;
pub use record::{Imm, RecordKind};
