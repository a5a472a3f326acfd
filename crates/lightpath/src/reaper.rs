//! Keeps closed RDMA connections' queue pairs alive until their peers close too.
//!
//! A side that closes first has sent everything and seen it acknowledged, but its peer may
//! still be reading the last bytes and returning credits with RDMA WRITEs. Destroying the
//! queue pair at once would make those writes fail on the peer (retry exhaustion), which
//! would look like a crash. So a closed connection is parked here, with its memory, until the
//! peer's TCP connection closes or the linger time passes; one thread (started on first use)
//! checks the parked connections every few milliseconds.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A closed connection waiting for its peer.
pub(crate) trait Parked: Send {
    /// Whether the peer has closed (or vanished), so the connection can go.
    fn peer_done(&mut self) -> bool;
}

struct Entry {
    conn: Box<dyn Parked>,
    until: Instant,
}

fn parked() -> &'static Mutex<Vec<Entry>> {
    static PARKED: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
    PARKED.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("lightpath-reaper".into()).spawn(reap);
        // Without the thread, parked connections would never go: say so, once.
        if let Err(err) = spawned {
            eprintln!("lightpath: cannot start the reaper thread ({err}); closed connections linger");
        }
        Mutex::new(Vec::new())
    })
}

/// Parks `conn` for at most `linger`.
pub(crate) fn park(conn: Box<dyn Parked>, linger: Duration) {
    let entry = Entry { conn, until: Instant::now() + linger };
    parked().lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(entry);
}

fn reap() {
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let done: Vec<Entry> = {
            let mut list = parked().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let now = Instant::now();
            let mut done = Vec::new();
            let mut i = 0;
            while i < list.len() {
                if now >= list[i].until || list[i].conn.peer_done() {
                    done.push(list.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            done
        };
        // Destroyed outside the lock: tearing down a queue pair takes the device lock.
        drop(done);
    }
}
