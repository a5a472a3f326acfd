//! The device's helper threads: the part of the device that runs when the application does
//! not. There are two, with separate jobs, because one of them must never wait for anything.
//!
//! - The **socket thread** ([`sockets`]) accepts peer devices' links on the rendezvous
//!   socket, reads every link (peers' introductions, goodbyes and questions about memory
//!   regions on theirs; the answers to our questions on ours, handed to the asker), and
//!   notices hang-ups (a peer that crashed or closed) on every link, within microseconds. It never takes the engine
//!   lock and never waits for another device: everything it answers comes from the device's
//!   exports, and everything it learns it posts to the mailbox and then rings the driver's
//!   bell.
//! - The **driver thread** ([`driver`]) applies what the socket thread posted and — once the
//!   application has not driven the device for `ShmConfig::idle_after` — sleeps until a peer
//!   rings the doorbell (peers ring only while the device's activity area says someone
//!   sleeps) and then processes what peers marked, so peers' requests complete and
//!   notification fds fire. Driving the engine may mean asking a peer device about one of its
//!   regions and waiting for the answer (up to `ShmConfig::rpc_timeout`).
//!
//! The split is what makes those questions safe. The device asked may be this very device (two
//! queue pairs of one process connected to each other) or a device whose own driver is asking
//! us something at the same moment; either way the answer comes from a socket thread, which is
//! never the thread waiting. With a single thread doing both jobs, that thread waited for an
//! answer only it could give, and the request failed after `rpc_timeout`.
//!
//! With nothing to do both threads block without a timeout (the socket thread in
//! `epoll_wait`, the driver in `poll(2)`): an idle device costs no CPU. The driver never blocks on the engine lock (`try_lock`, retried shortly), and the
//! socket thread never touches it, so two devices whose applications hold their locks while
//! asking each other something cannot deadlock either. Both stop when the device's stop fd is
//! signalled, and the device joins both when it goes.

mod driver;
mod sockets;

use std::sync::Arc;
use std::thread::JoinHandle;

use lightpath_verbs::Gid;

use crate::device::DeviceShared;

/// The names of a device's helper threads: `lpshm-`, 8 hex digits of the GID, and `s` for the
/// socket thread or `d` for the driver thread (thread names are limited to 15 bytes), so tools
/// and tests can tell devices' threads apart.
pub fn helper_thread_names(gid: Gid) -> [String; 2] {
    let id = &gid.to_hex()[24..32];
    [format!("lpshm-{id}s"), format!("lpshm-{id}d")]
}

/// Starts both helper threads of the device `shared` describes. If the second cannot be
/// started, the first is stopped again before the error is returned.
pub(crate) fn start(shared: &Arc<DeviceShared>) -> std::io::Result<Vec<JoinHandle<()>>> {
    let [socket_name, driver_name] = helper_thread_names(shared.ctx.gid);
    let for_sockets = Arc::clone(shared);
    let sockets = std::thread::Builder::new().name(socket_name).spawn(move || sockets::run(&for_sockets))?;
    let for_driver = Arc::clone(shared);
    match std::thread::Builder::new().name(driver_name).spawn(move || driver::run(&for_driver)) {
        Ok(driver) => Ok(vec![sockets, driver]),
        Err(err) => {
            shared.stop.signal(1);
            let _ = sockets.join();
            Err(err)
        }
    }
}
