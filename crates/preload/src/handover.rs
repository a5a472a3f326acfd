//! What an `execve` hands the new program of a connection that had switched: the bytes the
//! peer sent over the stream that this program had not read yet (see `State::send_back`,
//! which takes them off the stream before the exec). The new program cannot reach the stream;
//! without them it would read the socket and miss them. Each connection whose socket survives
//! the exec (no `FD_CLOEXEC`) and has unread bytes gets a memfd holding them, inherited by the
//! new program and named in `LIGHTPATH_PRELOAD_INHERITED` (`memfd:fd+fd,...`, one entry per
//! connection with all of its descriptors); the library in the new program (`adopt`, at
//! load) tracks those descriptors as plain TCP connections whose first reads return the
//! bytes. A new program without the library (a static binary, an environment without
//! `LD_PRELOAD`) cannot have them: they are lost, and the memfd stays open in it.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::sync::Arc;

use libc::{c_char, c_int};

use crate::conn::Conn;
use crate::table;

/// The variable that names the memfds.
const VAR: &str = "LIGHTPATH_PRELOAD_INHERITED";

/// The memfds made for one exec, and the variable naming them.
#[derive(Default)]
pub(crate) struct Handover {
    memfds: Vec<c_int>,
    var: Option<CString>,
}

impl Handover {
    /// Sends every switched connection of this process back on TCP (see `State::send_back`)
    /// and puts the unread bytes of those the new program inherits into memfds.
    pub(crate) fn prepare(me: u32, flush_limit: std::time::Duration) -> Handover {
        let mut by_conn: BTreeMap<u64, (Arc<Conn>, Vec<c_int>)> = BTreeMap::new();
        for (fd, conn) in table::all() {
            if conn.owner != me {
                continue;
            }
            let entry = by_conn.entry(conn.id).or_insert_with(|| (Arc::clone(&conn), Vec::new()));
            if inherited(fd) {
                entry.1.push(fd);
            }
        }
        let mut handover = Handover::default();
        let mut entries = Vec::new();
        for (conn, fds) in by_conn.values() {
            let unread = {
                let mut state = conn.lock();
                state.send_back(flush_limit);
                state.peeked.clone()
            };
            if fds.is_empty() || unread.is_empty() {
                continue;
            }
            let Some(memfd) = memfd_with(&unread) else { continue };
            handover.memfds.push(memfd);
            let fds: Vec<String> = fds.iter().map(|fd| fd.to_string()).collect();
            entries.push(format!("{memfd}:{}", fds.join("+")));
        }
        if !entries.is_empty() {
            handover.var = CString::new(format!("{VAR}={}", entries.join(","))).ok();
        }
        handover
    }

    /// The environment for the new program: `envp` (null: this process's) without an older
    /// `LIGHTPATH_PRELOAD_INHERITED`, plus this one's; `None` when there is nothing to hand
    /// over (the caller's environment goes as it is). The pointers live as long as `self`
    /// and `envp`.
    ///
    /// # Safety
    /// `envp` is null or a null-terminated array of C strings.
    pub(crate) unsafe fn environment(&self, envp: *const *const c_char) -> Option<Vec<*const c_char>> {
        let var = self.var.as_ref()?;
        let envp = if envp.is_null() {
            // SAFETY: reading the C library's own environment pointer.
            unsafe { environ_now() }
        } else {
            envp
        };
        let mut out = Vec::new();
        let prefix = format!("{VAR}=");
        let mut at = envp;
        // SAFETY: a null-terminated array of C strings (the caller's contract).
        while !at.is_null() && !unsafe { *at }.is_null() {
            // SAFETY: as above.
            let entry = unsafe { *at };
            // SAFETY: each entry is a C string.
            if !unsafe { CStr::from_ptr(entry) }.to_bytes().starts_with(prefix.as_bytes()) {
                out.push(entry);
            }
            // SAFETY: within the array, up to its terminating null.
            at = unsafe { at.add(1) };
        }
        out.push(var.as_ptr());
        out.push(std::ptr::null());
        Some(out)
    }

    /// The exec failed: the memfds are closed (the connections keep their unread bytes).
    pub(crate) fn abandon(self) {
        for memfd in self.memfds {
            // SAFETY: a descriptor this handover made and nobody else holds.
            unsafe { crate::real::close(memfd) };
        }
    }
}

/// The C library's environment now.
///
/// # Safety
/// No other thread changes the environment meanwhile.
unsafe fn environ_now() -> *const *const c_char {
    extern "C" {
        static environ: *const *const c_char;
    }
    // SAFETY: the C library's global, read once.
    unsafe { environ }
}

/// Whether `fd` survives an exec.
fn inherited(fd: c_int) -> bool {
    // SAFETY: F_GETFD has no memory preconditions.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags >= 0 && flags & libc::FD_CLOEXEC == 0
}

/// A memfd (inherited across exec) holding `bytes`, at offset 0.
fn memfd_with(bytes: &[u8]) -> Option<c_int> {
    let name = c"lightpath-inherited";
    // SAFETY: a valid C string; no flags (the descriptor is to be inherited).
    let memfd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
    if memfd < 0 {
        return None;
    }
    let mut written = 0;
    while written < bytes.len() {
        // SAFETY: the rest of `bytes` is readable.
        let n = unsafe { libc::write(memfd, bytes[written..].as_ptr().cast(), bytes.len() - written) };
        if n <= 0 {
            // SAFETY: our own descriptor.
            unsafe { crate::real::close(memfd) };
            return None;
        }
        written += n as usize;
    }
    // SAFETY: our own descriptor.
    unsafe { libc::lseek(memfd, 0, libc::SEEK_SET) };
    Some(memfd)
}

/// At load: tracks the descriptors an exec handed over (see the module doc), each connection
/// with its unread bytes first, and forgets the variable (a program this one execs gets its
/// own, if any).
pub(crate) fn adopt() {
    let Ok(value) = std::env::var(VAR) else { return };
    // SAFETY: at load, before the program's own threads.
    unsafe { std::env::remove_var(VAR) };
    for entry in value.split(',') {
        let Some((memfd, fds)) = entry.split_once(':') else { continue };
        let Ok(memfd) = memfd.parse::<c_int>() else { continue };
        let unread = read_all(memfd);
        // SAFETY: the memfd the exec handed over, read to its end.
        unsafe { crate::real::close(memfd) };
        let fds: Vec<c_int> = fds.split('+').filter_map(|fd| fd.parse().ok()).collect();
        if unread.is_empty() || fds.is_empty() || !fds.iter().all(|&fd| crate::conn::is_tcp(fd)) {
            continue;
        }
        let conn = Arc::new(Conn::inherited(unread, fds.len()));
        for fd in fds {
            table::insert(fd, Arc::clone(&conn));
        }
    }
}

fn read_all(fd: c_int) -> Vec<u8> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    loop {
        // SAFETY: `chunk` is writable for its length.
        let n = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) };
        if n <= 0 {
            return out;
        }
        out.extend_from_slice(&chunk[..n as usize]);
    }
}
