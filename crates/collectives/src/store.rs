//! A rendezvous key-value store speaking c10d TCPStore's wire protocol (the subset ranks need:
//! VALIDATE, PING, SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY), server and client.
//!
//! Why this protocol: under torchrun, the elastic agent already serves a TCPStore on
//! `MASTER_PORT`; a client that speaks it joins that store with no libtorch. Elsewhere
//! (`lightpath launch`, mpirun, srun) rank 0 or the launcher serves [`StoreServer`], and a
//! PyTorch process could use it as a `TCPStore` too.
//!
//! Protocol (host byte order, little-endian on every supported machine): a request is one
//! query byte then its arguments; strings and values are a `u64` length then bytes.
//! VALIDATE carries `u32` 0x3C85F7CE and has no reply; PING echoes a `u32`; SET has no reply;
//! GET replies with the value; ADD takes an `i64` and replies with the new value (stored as
//! decimal text, as c10d does); CHECK and WAIT take a `u64` key count then keys and reply with
//! one byte (CHECK: 0 ready, 1 not ready; WAIT: 0 once all keys exist).
//!
//! The client also speaks the numbering of PyTorch before 2.0 (no VALIDATE, every other query
//! one lower), found when the server drops a connection that starts with VALIDATE: Debian's
//! torch 1.13 serves that (torchrun's agent store there).
//!
//! The server never panics on input: an unknown query, a bad magic number or a length above
//! [`MAX_VALUE`] closes that connection only.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// c10d's validation magic number.
pub const MAGIC: u32 = 0x3C85_F7CE;
/// Largest key or value accepted (64 MiB).
pub const MAX_VALUE: u64 = 64 << 20;

const Q_VALIDATE: u8 = 0;
const Q_SET: u8 = 1;
const Q_GET: u8 = 3;
const Q_ADD: u8 = 4;
const Q_CHECK: u8 = 5;
const Q_WAIT: u8 = 6;
const Q_GETNUMKEYS: u8 = 7;
const Q_DELETE_KEY: u8 = 8;
const Q_PING: u8 = 13;

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

/// A store server: a listening socket and one thread per client connection.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        Self::serve(listener)
    }

    /// Serves on an already bound listener.
    pub fn serve(listener: TcpListener) -> io::Result<StoreServer> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new().name("lightpath-store".into()).spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let table = table.clone();
                        let stop = stop2.clone();
                        let _ = std::thread::Builder::new()
                            .name("lightpath-store-conn".into())
                            .spawn(move || serve_conn(conn, &table, &stop));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })?;
        Ok(StoreServer { addr, stop, thread: Some(thread) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}
fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}
fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
fn read_blob(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let len = read_u64(r)?;
    if len > MAX_VALUE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("store: length {len} above the {MAX_VALUE} limit"),
        ));
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}
fn read_keys(r: &mut impl Read) -> io::Result<Vec<Vec<u8>>> {
    let n = read_u64(r)?;
    if n > 1 << 16 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "store: too many keys"));
    }
    (0..n).map(|_| read_blob(r)).collect()
}
fn put_blob(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

fn serve_conn(mut conn: TcpStream, table: &Table, stop: &AtomicBool) {
    let _ = conn.set_nodelay(true);
    // A read timeout lets the thread notice the server stopping.
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reader = match conn.try_clone() {
        Ok(c) => io::BufReader::new(c),
        Err(_) => return,
    };
    loop {
        let query = match read_u8(&mut reader) {
            Ok(q) => q,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                continue;
            }
            Err(_) => return,
        };
        // The arguments follow at once; give them a generous deadline.
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let reply = handle(query, &mut reader, table, stop);
        let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
        match reply {
            Ok(Some(bytes)) => {
                if conn.write_all(&bytes).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(_) => {
                let _ = conn.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

/// Locks the table until `ready` holds, looking again at every change (and every 200 ms, for
/// `stop`: an error once the server stops).
fn wait_until<'a>(
    table: &'a Table,
    stop: &AtomicBool,
    ready: impl Fn(&HashMap<Vec<u8>, Vec<u8>>) -> bool,
) -> io::Result<std::sync::MutexGuard<'a, HashMap<Vec<u8>, Vec<u8>>>> {
    let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
    while !ready(&map) {
        if stop.load(Ordering::Relaxed) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "store: stopping"));
        }
        map =
            table.changed.wait_timeout(map, Duration::from_millis(200)).unwrap_or_else(|e| e.into_inner()).0;
    }
    Ok(map)
}

fn handle(query: u8, r: &mut impl Read, table: &Table, stop: &AtomicBool) -> io::Result<Option<Vec<u8>>> {
    let bad = |what: String| Err(io::Error::new(io::ErrorKind::InvalidData, what));
    match query {
        Q_VALIDATE => {
            let magic = read_u32(r)?;
            if magic != MAGIC {
                return bad(format!("store: bad validation magic {magic:#x}"));
            }
            Ok(None)
        }
        Q_PING => Ok(Some(read_u32(r)?.to_le_bytes().to_vec())),
        Q_SET => {
            let key = read_blob(r)?;
            let value = read_blob(r)?;
            table.map.lock().unwrap_or_else(|e| e.into_inner()).insert(key, value);
            table.changed.notify_all();
            Ok(None)
        }
        Q_GET => {
            let key = read_blob(r)?;
            // c10d clients WAIT before GET; a GET of a missing key waits too.
            let map = wait_until(table, stop, |map| map.contains_key(&key))?;
            let value = &map[&key];
            let mut out = Vec::with_capacity(value.len() + 8);
            put_blob(&mut out, value);
            Ok(Some(out))
        }
        Q_ADD => {
            let key = read_blob(r)?;
            let delta = read_u64(r)? as i64;
            let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
            let old = match map.get(&key) {
                Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()) {
                    Some(n) => n,
                    None => return bad("store: ADD on a value that is not a number".into()),
                },
                None => 0,
            };
            let new = old.wrapping_add(delta);
            map.insert(key, new.to_string().into_bytes());
            drop(map);
            table.changed.notify_all();
            Ok(Some(new.to_le_bytes().to_vec()))
        }
        Q_CHECK => {
            let keys = read_keys(r)?;
            let map = table.map.lock().unwrap_or_else(|e| e.into_inner());
            let ready = keys.iter().all(|k| map.contains_key(k));
            Ok(Some(vec![if ready { 0 } else { 1 }]))
        }
        Q_WAIT => {
            let keys = read_keys(r)?;
            drop(wait_until(table, stop, |map| keys.iter().all(|k| map.contains_key(k)))?);
            Ok(Some(vec![0]))
        }
        Q_GETNUMKEYS => {
            let n = table.map.lock().unwrap_or_else(|e| e.into_inner()).len() as i64;
            Ok(Some(n.to_le_bytes().to_vec()))
        }
        Q_DELETE_KEY => {
            let key = read_blob(r)?;
            let removed = table.map.lock().unwrap_or_else(|e| e.into_inner()).remove(&key).is_some();
            Ok(Some((removed as i64).to_le_bytes().to_vec()))
        }
        other => bad(format!("store: unsupported query {other}")),
    }
}

/// A client connection to a TCPStore (c10d's, or [`StoreServer`]).
#[derive(Debug)]
pub struct StoreClient {
    conn: TcpStream,
    addr: SocketAddr,
    /// The server numbers queries as PyTorch before 2.0 did (no VALIDATE: SET = 0, GET = 2,
    /// ADD = 3, CHECK = 4; found by `connect`), e.g. Debian's torch 1.13.
    legacy: bool,
}

impl StoreClient {
    /// Connects to `addr`, retrying refused connections until `timeout` (the server may not
    /// be up yet), then checks that a TCPStore answers (VALIDATE, then a PING that must echo).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<StoreClient> {
        let mut client = StoreClient { conn: Self::dial(addr, timeout)?, addr, legacy: false };
        let nonce = std::process::id() ^ 0x5A5A_0000;
        let mut req = vec![Q_VALIDATE];
        req.extend_from_slice(&MAGIC.to_le_bytes());
        req.push(Q_PING);
        req.extend_from_slice(&nonce.to_le_bytes());
        client.conn.write_all(&req)?;
        let mut echo = [0u8; 4];
        match client.conn.read_exact(&mut echo) {
            Ok(()) if u32::from_le_bytes(echo) == nonce => return Ok(client),
            Ok(()) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{addr} does not answer as a TCPStore (PING reply wrong)"),
                ))
            }
            // A pre-2.0 c10d store drops a connection that starts with VALIDATE: try its
            // numbering, with a CHECK of no keys, which must answer "ready" (0).
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionReset
                        | io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionAborted
                ) => {}
            Err(e) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{addr} does not answer as a TCPStore (no PING reply: {e})"),
                ))
            }
        }
        client.conn = Self::dial(addr, timeout)?;
        client.legacy = true;
        let mut req = vec![Q_CHECK - 1];
        req.extend_from_slice(&0u64.to_le_bytes());
        client.conn.write_all(&req)?;
        match read_u8(&mut client.conn) {
            Ok(0) => Ok(client),
            Ok(other) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{addr} does not answer as a TCPStore (CHECK replied {other})"),
            )),
            Err(e) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{addr} does not answer as a TCPStore (no PING or CHECK reply: {e})"),
            )),
        }
    }

    fn dial(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(5);
        let conn = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2).min(timeout)) {
                Ok(c) => break c,
                Err(e)
                    if Instant::now() < deadline
                        && matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut) =>
                {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Err(e) => return Err(io::Error::new(e.kind(), format!("store {addr}: {e}"))),
            }
        };
        conn.set_nodelay(true)?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        conn.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(conn)
    }

    /// The query byte for `q` in this server's numbering.
    fn q(&self, q: u8) -> u8 {
        if self.legacy {
            q - 1
        } else {
            q
        }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> io::Result<()> {
        let mut req = vec![self.q(Q_SET)];
        put_blob(&mut req, key.as_bytes());
        put_blob(&mut req, value);
        self.conn.write_all(&req)
    }

    /// Adds `delta` to the number stored at `key` (0 if absent) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> io::Result<i64> {
        let mut req = vec![self.q(Q_ADD)];
        put_blob(&mut req, key.as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        self.conn.write_all(&req)?;
        Ok(read_u64(&mut self.conn)? as i64)
    }

    /// Whether every key exists.
    pub fn check(&mut self, keys: &[&str]) -> io::Result<bool> {
        let mut req = vec![self.q(Q_CHECK)];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_blob(&mut req, k.as_bytes());
        }
        self.conn.write_all(&req)?;
        match read_u8(&mut self.conn)? {
            0 => Ok(true),
            1 => Ok(false),
            other => Err(io::Error::new(io::ErrorKind::InvalidData, format!("store: CHECK replied {other}"))),
        }
    }

    /// Waits until `key` exists (polling with CHECK, so a timeout never leaves a reply
    /// in flight) and returns its value; `TimedOut` after `timeout`.
    pub fn get(&mut self, key: &str, timeout: Duration) -> io::Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(100);
        while !self.check(&[key])? {
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("store: key {key:?} not set within {timeout:?}"),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        let mut req = vec![self.q(Q_GET)];
        put_blob(&mut req, key.as_bytes());
        self.conn.write_all(&req)?;
        read_blob(&mut self.conn)
    }
}
