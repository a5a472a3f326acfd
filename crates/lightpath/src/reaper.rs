//! What becomes of a connection after its owner let go of it: a clean close finished in the
//! background, then an RDMA connection's queue pair kept alive until its peer closes too.
//!
//! Background close: a tokio stream that is dropped (or a stream given to
//! `Stream::close_in_background`) must not make its thread wait for the peer's
//! acknowledgements, up to `Options::linger`. Its connection is stepped here instead, without
//! blocking, until everything written has been acknowledged (then the goodbye goes out as a
//! blocking drop would send it), the connection fails, or the linger time passes.
//!
//! Parking: a side that closes first has sent everything and seen it acknowledged, but its
//! peer may still be reading the last bytes and returning credits with RDMA WRITEs. Destroying
//! the queue pair at once would make those writes fail on the peer (retry exhaustion), which
//! would look like a crash. So a closed connection is parked here, with its memory, until the
//! peer's TCP connection closes or the linger time passes.
//!
//! One thread (started on first use) looks at every entry every few milliseconds.

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::rdma::RdmaStream;
use crate::tcp::TcpConn;

/// A closed connection waiting for its peer.
pub(crate) trait Parked: Send {
    /// Whether the peer has closed (or vanished), so the connection can go.
    fn peer_done(&mut self) -> bool;
}

/// How long a TCP stream's background close may wait for room for its close record (a TCP
/// connection knows no `Options`; this is their default linger).
const TCP_CLOSE_LINGER: Duration = Duration::from_secs(10);
/// How often the thread looks at the entries.
const TICK: Duration = Duration::from_millis(5);

/// A clean close still under way.
enum Closing {
    /// Waiting for the peer to acknowledge the last records.
    Rdma(Box<dyn RdmaStream>),
    /// Waiting for room in the socket for the close record (the peer is not reading).
    Tcp(TcpConn),
}

enum Stage {
    Closing(Closing),
    Parked(Box<dyn Parked>),
}

struct Entry {
    stage: Stage,
    /// When the entry is given up (closing) or released (parked).
    until: Instant,
}

/// What one step of a background close came to.
enum Step {
    /// It must wait for the peer: try again later.
    Wait(Closing),
    /// Closed cleanly; keep this for the peer for at most the duration.
    Park(Box<dyn Parked>, Duration),
    /// Over (cleanly without anything to keep, or given up because the connection failed).
    Done,
}

fn entries() -> MutexGuard<'static, Vec<Entry>> {
    static ENTRIES: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
    let list = ENTRIES.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("lightpath-reaper".into()).spawn(reap);
        // Without the thread, entries would never go: say so, once.
        if let Err(err) = spawned {
            eprintln!("lightpath: cannot start the reaper thread ({err}); closed connections linger");
        }
        Mutex::new(Vec::new())
    });
    list.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Parks `conn` for at most `linger`.
pub(crate) fn park(conn: Box<dyn Parked>, linger: Duration) {
    entries().push(Entry { stage: Stage::Parked(conn), until: Instant::now() + linger });
}

/// Closes `conn` cleanly without blocking the caller: finished here if nothing is left to
/// wait for, else in the background (for at most the connection's linger time).
pub(crate) fn close_rdma(conn: Box<dyn RdmaStream>) {
    let linger = conn.linger();
    begin(Closing::Rdma(conn), linger);
}

/// Closes a TCP stream cleanly without blocking the caller (see [`close_rdma`]).
pub(crate) fn close_tcp(conn: TcpConn) {
    begin(Closing::Tcp(conn), TCP_CLOSE_LINGER);
}

fn begin(closing: Closing, linger: Duration) {
    match step(closing) {
        Step::Wait(closing) => {
            entries().push(Entry { stage: Stage::Closing(closing), until: Instant::now() + linger })
        }
        Step::Park(conn, linger) => park(conn, linger),
        Step::Done => {}
    }
}

/// Advances a close as far as it goes without waiting.
fn step(closing: Closing) -> Step {
    match closing {
        Closing::Rdma(mut conn) => {
            // Bytes kept from an accepted message go before the close record (an empty write
            // pushes them without waiting; see `Stream::set_nonblocking`). An error means the
            // connection can send nothing more, which the next call finds out too.
            let kept = conn.write(&[], crate::rdma::Deadline::Now);
            if matches!(&kept, Err(err) if err.kind() == std::io::ErrorKind::WouldBlock) {
                return Step::Wait(Closing::Rdma(conn));
            }
            if !conn.close_would_finish() {
                return Step::Wait(Closing::Rdma(conn));
            }
            // Everything is acknowledged (or the connection is over): this only says goodbye.
            conn.close();
            if conn.closed_cleanly() {
                let linger = conn.linger();
                Step::Park(conn.into_parked(), linger)
            } else {
                Step::Done
            }
        }
        Closing::Tcp(mut conn) => {
            // An owed message goes first, as far as the socket takes it now.
            if conn.tcp().set_nonblocking(true).is_err() {
                return Step::Done;
            }
            match conn.push_kept() {
                Ok(true) => {}
                Ok(false) => return Step::Wait(Closing::Tcp(conn)),
                Err(_) => return Step::Done,
            }
            if !crate::readiness::socket_writable(conn.tcp()) {
                return Step::Wait(Closing::Tcp(conn));
            }
            // Nothing is owed and the socket has room, so writing the 8-byte close record
            // does not block.
            conn.close();
            Step::Done
        }
    }
}

fn reap() {
    loop {
        std::thread::sleep(TICK);
        // Stepped and destroyed outside the lock: both take device locks, and droppers must
        // not wait for them to add entries.
        let taken = std::mem::take(&mut *entries());
        let now = Instant::now();
        let mut kept = Vec::with_capacity(taken.len());
        for entry in taken {
            if now >= entry.until {
                continue;
            }
            match entry.stage {
                Stage::Parked(mut conn) => {
                    if !conn.peer_done() {
                        kept.push(Entry { stage: Stage::Parked(conn), until: entry.until });
                    }
                }
                Stage::Closing(closing) => match step(closing) {
                    Step::Wait(closing) => {
                        kept.push(Entry { stage: Stage::Closing(closing), until: entry.until })
                    }
                    Step::Park(conn, linger) => {
                        kept.push(Entry { stage: Stage::Parked(conn), until: now + linger })
                    }
                    Step::Done => {}
                },
            }
        }
        entries().append(&mut kept);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};

    use lightpath_stream::frame::{FrameHeader, HEADER_LEN};
    use lightpath_stream::RecordKind;

    use super::*;

    #[test]
    fn a_tcp_close_record_waits_in_the_background_for_room() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut reader, _) = listener.accept().unwrap();
        writer.set_nonblocking(true).unwrap();
        let filler = [0x55u8; 1 << 16];
        let mut filled = 0;
        loop {
            match (&writer).write(&filler) {
                Ok(n) => filled += n,
                Err(err) if err.kind() == ErrorKind::WouldBlock => break,
                Err(err) => panic!("filling the socket: {err}"),
            }
        }
        // The socket is full and the reader reads only after this returns: a close that
        // waited for room here would never return.
        close_tcp(TcpConn::new(writer, true, Vec::new()));
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), filled + HEADER_LEN, "the filler, then the close record, then the end");
        assert!(got[..filled].iter().all(|&b| b == 0x55));
        assert_eq!(got[filled..], FrameHeader { kind: RecordKind::Close, len: 0 }.encode());
    }
}
