//! The transport: a full mesh of Lightpath streams between the ranks (shm on one host, soft
//! or ibverbs between hosts, TCP when nothing else works; the negotiation picks per pair),
//! plus one plain TCP control connection per pair, and the driver that runs a
//! [`Schedule`](crate::schedule::Schedule) over them.
//!
//! Why a control connection: the data streams carry raw bytes whose boundaries only the
//! schedules know, so nothing else can be sent on them. The control connection carries one
//! line, `bye` on a clean close or `abort ...` when a rank gives up, and its end without
//! `bye` means the process died: the kernel closes its sockets, so every other rank learns it
//! within a wake-up, whether or not it was talking to that rank.
//!
//! The driver is single-threaded and nonblocking. For each round of a schedule it moves every
//! step as far as the streams allow, looking at each stream with [`lightpath::Stream::drive`]
//! (reap completions, post queued records; no system call) at most once per look, whatever
//! the number of steps on it. A send's first write goes without a look (a full stream says
//! `WouldBlock`), and so does its hand-over when the stream knows it
//! ([`lightpath::Stream::handed_over_now`]); a receive reads without a look of its own (a
//! read reaps completions itself). A drive reaps the shm device's completions, and a small
//! exchange (a send and a receive on one stream) used to drive its stream three times per
//! call, which was most of its time (2 ranks, 8 B allreduce: the send step alone p50 550-720
//! ns of a ~880 ns round); it is now a write and a read. A receive is done with its last
//! byte. A send is done once the stream
//! has accepted all its bytes *and handed them to the transport* (no bytes kept, no records
//! waiting for send-queue room or receive credits): from then on they reach the peer without
//! this rank calling again, and the stream copied them, so the caller may reuse the buffer.
//! (Over shm they are published in this rank's segment, which a peer drains when this
//! process's socket hangs up, so a rank that crashes right after a call still delivers its
//! part of it; over soft they left in datagrams, unless the socket refused some for a
//! moment: those go with the process, and the peers' call then fails naming it.)
//! It does not wait for the peer's acknowledgement: that wait cost a round trip and often a
//! wake-up per step (allreduce, 2 ranks over shm, fastest call: 8 B 1.6-2.1 us and 1 KiB
//! 48 us before, 0.7-1.2 us for both now).
//!
//! When nothing moves, the rank keeps looking for 2 ms, then sleeps in `poll` on the streams'
//! readiness descriptors and the control sockets. Looking without sleeping is what small calls
//! need (a wake-up costs tens of microseconds, milliseconds on a loaded machine). A rank bound
//! to its own CPU, with a CPU for every rank of the host and only shm peers, busy-polls for
//! the first 50 us (as
//! Open MPI does when not oversubscribed); otherwise, and after that, it yields the CPU between
//! looks (`sched_yield`), so that a rank never holds a CPU that the peer it waits for needs.
//! `LIGHTPATH_COLL_SPIN_US` sets the busy-poll time. A call fails, rather than hangs, when a peer
//! it still needs dies (control connection closed without `bye`, data stream reset or closed
//! early), when another rank aborts, or when a peer it waits for makes no progress for the
//! configured timeout; the control connections are read every 64 looks and at every wake-up.
//! A death fails the call that needs the dead rank, not whatever call runs when it is seen: a
//! rank that returns from a call and then crashes has sent its part of that call, and the
//! others finish it (with one more look at the streams after the death is seen, for data that
//! landed just before) and fail the next call that addresses it.

use crate::dtype;
use crate::error::Error;
use crate::schedule::{Buf, Region, Schedule, Step};
use lightpath_verbs::copy;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// What a `PeerFailed` says of a rank whose control connection closed without `bye`.
const DIED: &str = "its process exited (control connection closed without goodbye)";
const HELLO_MAGIC: u32 = 0x4C50_434F; // "LPCO"
const STAGE: usize = 256 << 10;
/// How long a rank whose streams show nothing busy-polls them before yielding the core.
/// How long a rank bound to its own CPU busy-polls before it starts yielding (see
/// `Mesh::choose_spin`).
const SPIN: Duration = Duration::from_micros(50);
/// How long a rank whose streams show nothing keeps looking, yielding the core between looks,
/// before it sleeps in `poll`.
const YIELD: Duration = Duration::from_millis(2);
/// Bytes of each same-host pipe's ring (messages of up to a quarter of it, less 16 bytes).
const PIPE_CAPACITY: usize = 64 << 10;
/// Messages up to this many bytes go through a same-host peer's pipe instead of its stream
/// (`LIGHTPATH_COLL_PIPE_MAX`, 0 turns pipes off; each pair uses the smaller of its two
/// ranks' settings).
const PIPE_MAX: usize = 4 << 10;
/// How long a rank waiting for a pipe message sleeps at most before looking again (a pipe has
/// no wake-up).
const PIPE_NAP: Duration = Duration::from_millis(1);
/// Starts a pipe offer: "LPP2" (pipes of packed records; "LPPI", the pipes of lines before
/// them, is refused: a rank of an older build fails the set-up instead of misreading).
const PIPE_MAGIC: u32 = 0x4C50_5032;
/// Bytes of a pipe offer: magic, offered, largest message, ring size, the pipe's address
/// (bytes 16..72), the probe word's address, the descriptor threshold.
const OFFER_LEN: usize = 88;
/// Messages from this many bytes on go to a same-host peer as a descriptor through the pipe,
/// and the peer copies them straight out of this process's memory (`LIGHTPATH_COLL_CMA_MIN`,
/// 0 turns it off; each pair uses the larger of its two settings). Below it the stream wins:
/// its 2 MiB ring lets a sender run ahead where a descriptor waits for the reader (2 ranks,
/// p50, stream against descriptors: broadcast 1 MiB 39-42 against 60-78 us, allreduce 1 MiB
/// 95-171 against 120-135 us; broadcast 16 MiB 6.3-8.3 against 2.8-3.1 ms).
const CMA_MIN: usize = 8 << 20;
/// A message sent as a descriptor from this many bytes on is copied half by its receiver and
/// half by its sender, at the same time (`LIGHTPATH_COLL_CMA_HELP_MIN`, 0 turns it off): a
/// sender waiting for the receiver's acknowledgement has a core with nothing else to do. The
/// receiver asks through the pipe's shared words (`lightpath_shm::pipe::PipeReceiver::
/// ask_help`); the sender writes its half with `process_vm_writev` and answers, and the
/// receiver acknowledges once both halves are in. Two threads copying 8 MiB each with
/// `process_vm_readv` here took 1.6-2.0 ms against 2.8-2.9 ms for one thread copying 16 MiB.
const HELP_MIN: usize = 1 << 20;
/// While a rank spins, it reads the clock once every this many idle looks.
const CLOCK_EVERY: u32 = 16;
/// How many passes over a round of pipe messages that move nothing `Mesh::run_piped` makes
/// before it hands the round to `run_steps` (which waits, yields, sleeps and checks for
/// failures): a few hundred nanoseconds, what a peer a step behind needs.
const PIPED_PASSES: u32 = 32;

/// What `Mesh::run_piped` did with a round.
enum PipedRound {
    /// Not every message of the round goes whole through a pipe: nothing tried.
    Unsuited,
    /// Every message moved: the round is done.
    Done,
    /// Some did not move in time: bit `i` is set for each of the round's message steps
    /// (in order) that did.
    Partly(u64),
}

struct Peer {
    data: lightpath::Stream,
    ctl: TcpStream,
    /// The peer said `bye` (a clean close): its control connection ending is no failure.
    left: bool,
    /// A `bye` line arrived (the end of the connection that follows is no failure).
    said_bye: bool,
    /// Its control connection ended without `bye`: the process died. What it sent before
    /// dying may still be read; a call fails once it needs more from it (or must send to it).
    died: bool,
    /// The peer's answer to our last `ping`: `Some(Some(r))` waits for rank r, `Some(None)`
    /// for nobody.
    pong: Option<Option<usize>>,
    ctl_buf: Vec<u8>,
    /// Both ways of a same-host pipe, when both ranks set one up (see `Mesh::setup_pipes`).
    pipe: Option<Pipe>,
}

/// A same-host peer's pipes, the largest message they carry for this pair, and from which
/// size on messages go by descriptor (read from the sender's memory, see `Mesh::setup_pipes`).
struct Pipe {
    tx: lightpath_shm::pipe::PipeSender,
    rx: lightpath_shm::pipe::PipeReceiver,
    max: usize,
    /// `usize::MAX` when either side cannot read the other's memory or has it turned off.
    cma_min: usize,
    /// Descriptors sent so far (the peer acknowledges each once it has read the bytes).
    cma_sent: u64,
    /// Descriptor messages from this many bytes on are copied half by this rank and half by
    /// the sender, at the same time (`usize::MAX`: never; see `HELP_MIN`).
    help_min: usize,
}

/// The connections of one process to every other rank of the job.
pub(crate) struct Mesh {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    peers: Vec<Option<Peer>>,
    pub(crate) timeout: Duration,
    /// The first failure; every later call returns it.
    pub(crate) poisoned: Option<Error>,
    stages: Vec<Vec<u8>>,
    scratch: Vec<u8>,
    /// The rank the current call waits for, while it waits (answered to `ping`s).
    waiting_on: Option<usize>,
    /// Set by `Communicator::abort` from any thread.
    aborted: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// How long an idle rank busy-polls before it starts yielding the core between looks
    /// (`Mesh::choose_spin`; see `run_round`).
    spin: Duration,
    /// The `drive` of each peer's stream taken in the current look of `run_round`, if any:
    /// every step on that stream uses it, so a look drives a stream once, not once per step
    /// (a drive reaps the device's completions: ~150 ns over shm, the larger part of a small
    /// call's time when an exchange drove its stream three times).
    looked: Vec<Option<lightpath::Driven>>,
    /// The steps of the round being run (kept to reuse its allocation).
    pending: Vec<Pending>,
    /// Where a pipe message is received before it is copied or reduced into place.
    pipe_buf: Vec<u8>,
}

/// One send or receive step of the round being run.
struct Pending {
    peer: usize,
    region: Region,
    kind: u8, // 0 send, 1 recv, 2 recv-reduce (or recv-combine, with `with`)
    /// A recv-combine's left operand (`region = with op received`).
    with: Option<Region>,
    done: usize,
    stage: usize,
    fill: usize,
    /// Finished: a receive has all its bytes; a send has had all of them accepted and
    /// handed over to the transport.
    finished: bool,
    /// The message goes through the peer's pipe (whole, or as a descriptor), not its stream.
    piped: bool,
    /// It goes as a descriptor of where its bytes are: `Some(0)` until a send's descriptor is
    /// in the pipe, then the number the peer acknowledges it by.
    cma: Option<u64>,
    /// A send's bytes were offered to the stream at least once.
    tried: bool,
    /// A descriptor send whose receiver asked for help was helped (see `Pipe::help_min`).
    helped: bool,
    /// A descriptor receive that asked its sender for help: the message's number, where the
    /// bytes are in the sender, and where the sender's part starts.
    help: Option<(u64, u64, usize)>,
}

impl Peer {
    /// A peer just connected: nothing said on its control connection yet.
    fn new(data: lightpath::Stream, ctl: TcpStream) -> Peer {
        Peer {
            data,
            ctl,
            left: false,
            said_bye: false,
            died: false,
            pong: None,
            ctl_buf: Vec::new(),
            pipe: None,
        }
    }
}

fn hello(rank: usize, size: usize) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    h[8..].copy_from_slice(&(size as u32).to_le_bytes());
    h
}

fn parse_hello(h: &[u8; 12], size: usize) -> Result<usize, String> {
    let magic = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    let rank = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
    let their_size = u32::from_le_bytes(h[8..].try_into().expect("4 bytes")) as usize;
    if magic != HELLO_MAGIC {
        return Err(format!("a connection that is not a Lightpath rank (hello {:02x?})", &h[..4]));
    }
    if their_size != size || rank >= size {
        return Err(format!("a rank of another job (rank {rank} of {their_size}, this job has {size})"));
    }
    Ok(rank)
}

/// Listeners a rank opens before publishing its address.
pub(crate) struct Listeners {
    data: lightpath::Listener,
    ctl: TcpListener,
}

impl Listeners {
    pub(crate) fn bind(ip: IpAddr, options: lightpath::Options) -> io::Result<Listeners> {
        Ok(Listeners {
            data: lightpath::Listener::bind_with((ip, 0), options)?,
            ctl: TcpListener::bind((ip, 0))?,
        })
    }

    /// `ip data_port ctl_port`, what other ranks need to connect.
    pub(crate) fn address(&self) -> io::Result<String> {
        let d = self.data.local_addr()?;
        let c = self.ctl.local_addr()?;
        Ok(format!("{} {} {}", d.ip(), d.port(), c.port()))
    }
}

/// Parses [`Listeners::address`].
pub(crate) fn parse_address(text: &str) -> Option<(SocketAddr, SocketAddr)> {
    let mut it = text.split_whitespace();
    let ip: IpAddr = it.next()?.parse().ok()?;
    let d: u16 = it.next()?.parse().ok()?;
    let c: u16 = it.next()?.parse().ok()?;
    Some((SocketAddr::new(ip, d), SocketAddr::new(ip, c)))
}

impl Mesh {
    /// Connects to every lower rank (whose addresses `addresses` gives) and accepts every
    /// higher one; each connection starts with a hello naming the rank and the job size.
    pub(crate) fn connect(
        rank: usize,
        size: usize,
        listeners: Listeners,
        mut lower_address: impl FnMut(usize) -> Result<(SocketAddr, SocketAddr), Error>,
        options: &lightpath::Options,
        timeout: Duration,
        init_timeout: Duration,
    ) -> Result<Mesh, Error> {
        if std::env::var_os("LIGHTPATH_COLL_DIAGNOSE").is_some() {
            lightpath::enable_diagnostics();
        }
        let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
        let deadline = Instant::now() + init_timeout;
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        for (j, slot) in peers.iter_mut().enumerate().take(rank) {
            let (data_addr, ctl_addr) = lower_address(j)?;
            let fail =
                |what: &str, e: io::Error| Error::bootstrap(format!("rank {rank}: {what} rank {j}: {e}"));
            let mut data = lightpath::Stream::connect_timeout(&data_addr, left(), options)
                .map_err(|e| fail("connecting data to", e))?;
            data.write_all(&hello(rank, size)).map_err(|e| fail("hello to", e))?;
            let mut ctl = TcpStream::connect_timeout(&ctl_addr, left())
                .map_err(|e| fail("connecting control to", e))?;
            ctl.write_all(&hello(rank, size)).map_err(|e| fail("hello to", e))?;
            *slot = Some(Peer::new(data, ctl));
        }
        // Accept the higher ranks, data and control, in any order.
        let expected = size - 1 - rank;
        let mut data_from: Vec<Option<lightpath::Stream>> = (0..size).map(|_| None).collect();
        for _ in 0..expected {
            let (mut data, from) = listeners
                .data
                .accept_timeout(left())
                .map_err(|e| Error::bootstrap(format!("rank {rank}: waiting for higher ranks: {e}")))?;
            data.set_read_timeout(Some(left())).map_err(Error::bootstrap)?;
            let mut h = [0u8; 12];
            if let Err(e) = data.read_exact(&mut h) {
                return Err(Error::bootstrap(format!("rank {rank}: no hello from {from}: {e}")));
            }
            let peer =
                parse_hello(&h, size).map_err(|e| Error::bootstrap(format!("rank {rank}: {from}: {e}")))?;
            if peer <= rank || data_from[peer].is_some() {
                return Err(Error::bootstrap(format!(
                    "rank {peer} joined twice (second connection from {from})"
                )));
            }
            data.set_read_timeout(None).map_err(Error::bootstrap)?;
            data_from[peer] = Some(data);
        }
        listeners.ctl.set_nonblocking(true).map_err(Error::bootstrap)?;
        for _ in 0..expected {
            let (mut ctl, from) = loop {
                match listeners.ctl.accept() {
                    Ok(c) => break c,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => {
                        return Err(Error::bootstrap(format!(
                            "rank {rank}: waiting for control connections: {e}"
                        )))
                    }
                }
            };
            ctl.set_nonblocking(false).map_err(Error::bootstrap)?;
            ctl.set_read_timeout(Some(left())).map_err(Error::bootstrap)?;
            let mut h = [0u8; 12];
            ctl.read_exact(&mut h)
                .map_err(|e| Error::bootstrap(format!("rank {rank}: no hello from {from}: {e}")))?;
            let peer =
                parse_hello(&h, size).map_err(|e| Error::bootstrap(format!("rank {rank}: {from}: {e}")))?;
            let data = match data_from.get_mut(peer).and_then(Option::take) {
                Some(d) if peer > rank && peers[peer].is_none() => d,
                _ => {
                    return Err(Error::bootstrap(format!(
                        "rank {peer} joined twice or out of order (control connection from {from})"
                    )))
                }
            };
            peers[peer] = Some(Peer::new(data, ctl));
        }
        Self::setup_pipes(rank, &mut peers, deadline)?;
        for p in peers.iter_mut().flatten() {
            p.ctl.set_nonblocking(true).map_err(Error::bootstrap)?;
            p.ctl.set_nodelay(true).map_err(Error::bootstrap)?;
            p.data.set_nonblocking(true).map_err(Error::bootstrap)?;
            p.data.set_nodelay(true).map_err(Error::bootstrap)?;
        }
        Ok(Mesh {
            rank,
            size,
            peers,
            timeout,
            poisoned: None,
            stages: Vec::new(),
            scratch: Vec::new(),
            waiting_on: None,
            aborted: Default::default(),
            spin: Duration::ZERO,
            looked: vec![None; size],
            pending: Vec::new(),
            pipe_buf: Vec::new(),
        })
    }

    /// Sets up a pipe each way with every peer reached over shm (a same-host process), over
    /// its data stream, before any call: each side offers a pipe it made (`LPP2`, whether it
    /// offers one, its largest pipe message, the ring's size, `pid:fd`), then says whether it
    /// could open the peer's; the pair uses pipes only if both offered and both opened (a
    /// peer whose `/proc/<pid>/fd` this process may not open, or pipes turned off on either
    /// side, keeps the stream alone). All offers are written before any is read, and they fit
    /// in the streams' buffers, so no pair waits on the other.
    fn setup_pipes(rank: usize, peers: &mut [Option<Peer>], deadline: Instant) -> Result<(), Error> {
        use lightpath_shm::pipe::{PipeReceiver, PipeSender};
        let env = |name: &str, default: usize| {
            std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
        };
        let max = env("LIGHTPATH_COLL_PIPE_MAX", PIPE_MAX);
        let cma_min = env("LIGHTPATH_COLL_CMA_MIN", CMA_MIN);
        let fail = |j: usize, what: &str, e: io::Error| {
            // `LIGHTPATH_COLL_DIAGNOSE=1`: the state of every connection of this process, for
            // a set-up that stalled (see `lightpath::diagnostics`).
            let state = if std::env::var_os("LIGHTPATH_COLL_DIAGNOSE").is_some() {
                format!("\n{}", lightpath::diagnostics())
            } else {
                String::new()
            };
            Error::bootstrap(format!("rank {rank}: setting up the pipe with rank {j}: {what}: {e}{state}"))
        };
        let left = || Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
        let shm =
            |p: &Peer| matches!(p.data.transport(), lightpath::Transport::Rdma(lightpath::ProviderId::Shm));
        let mut senders: Vec<Option<PipeSender>> = Vec::new();
        for (j, slot) in peers.iter_mut().enumerate() {
            let sender = match slot {
                Some(p) if shm(p) => {
                    let sender = if max > 0 { PipeSender::create(PIPE_CAPACITY).ok() } else { None };
                    let mut offer = [0u8; OFFER_LEN];
                    offer[..4].copy_from_slice(&PIPE_MAGIC.to_le_bytes());
                    if let Some(s) = &sender {
                        offer[4] = 1;
                        let largest = max.min(s.max_message()) as u32;
                        offer[8..12].copy_from_slice(&largest.to_le_bytes());
                        offer[12..16].copy_from_slice(&(s.capacity() as u32).to_le_bytes());
                        let address = s.address();
                        offer[16..16 + address.len()].copy_from_slice(address.as_bytes());
                        offer[72..80].copy_from_slice(&PipeSender::probe_address().to_le_bytes());
                        offer[80..88].copy_from_slice(&(cma_min as u64).to_le_bytes());
                    }
                    // Writes have the set-up's deadline too: a flush waits for the peer's
                    // acknowledgement, and one that never comes must fail the set-up, not
                    // hang it.
                    p.data.set_write_timeout(left()).map_err(|e| fail(j, "timeout", e))?;
                    p.data.write_all(&offer).map_err(|e| fail(j, "offer", e))?;
                    p.data.flush().map_err(|e| fail(j, "offer", e))?;
                    sender
                }
                _ => None,
            };
            senders.push(sender);
        }
        let mut opened: Vec<Option<(PipeReceiver, usize, Option<usize>)>> = Vec::new();
        for (j, slot) in peers.iter_mut().enumerate() {
            let receiver = match slot {
                Some(p) if shm(p) => {
                    p.data.set_read_timeout(left()).map_err(|e| fail(j, "timeout", e))?;
                    let mut offer = [0u8; OFFER_LEN];
                    p.data.read_exact(&mut offer).map_err(|e| fail(j, "reading the offer", e))?;
                    if offer[..4] != PIPE_MAGIC.to_le_bytes() {
                        return Err(Error::bootstrap(format!("rank {rank}: rank {j} sent no pipe offer")));
                    }
                    let word =
                        |i: usize| u32::from_le_bytes(offer[i..i + 4].try_into().expect("4 bytes")) as usize;
                    let long = |i: usize| u64::from_le_bytes(offer[i..i + 8].try_into().expect("8 bytes"));
                    let address = String::from_utf8_lossy(&offer[16..72]).trim_end_matches('\0').to_string();
                    let receiver = (offer[4] == 1 && senders[j].is_some())
                        .then(|| PipeReceiver::open(&address, word(12)).ok())
                        .flatten();
                    // Descriptors only if both want them and this side may read the peer's
                    // memory (tried on the word the peer pointed at).
                    let theirs = usize::try_from(long(80)).unwrap_or(0);
                    let cma = receiver
                        .as_ref()
                        .filter(|r| cma_min > 0 && theirs > 0 && r.can_read_sender_memory(long(72)))
                        .map(|_| cma_min.max(theirs));
                    let answer = u8::from(receiver.is_some()) | u8::from(cma.is_some()) << 1;
                    p.data.set_write_timeout(left()).map_err(|e| fail(j, "timeout", e))?;
                    p.data.write_all(&[answer]).map_err(|e| fail(j, "answer", e))?;
                    p.data.flush().map_err(|e| fail(j, "answer", e))?;
                    receiver.map(|r| (r, word(8), cma))
                }
                _ => None,
            };
            opened.push(receiver);
        }
        for (j, slot) in peers.iter_mut().enumerate() {
            let Some(p) = slot else { continue };
            if !shm(p) {
                continue;
            }
            let mut ack = [0u8; 1];
            p.data.read_exact(&mut ack).map_err(|e| fail(j, "reading the answer", e))?;
            p.data.set_read_timeout(None).map_err(|e| fail(j, "timeout", e))?;
            p.data.set_write_timeout(None).map_err(|e| fail(j, "timeout", e))?;
            if let (true, Some(tx), Some((rx, theirs, cma))) =
                (ack[0] & 1 == 1, senders[j].take(), opened[j].take())
            {
                let mine = max.min(tx.max_message());
                // Both ways readable, or neither way uses descriptors: both sides then put
                // every message on the same channel.
                let cma_min = cma.filter(|_| ack[0] & 2 == 2).unwrap_or(usize::MAX);
                let help_min = match env("LIGHTPATH_COLL_CMA_HELP_MIN", HELP_MIN) {
                    0 => usize::MAX,
                    n => n,
                };
                p.pipe = Some(Pipe { tx, rx, max: mine.min(theirs), cma_min, cma_sent: 0, help_min });
            }
        }
        Ok(())
    }

    /// Chooses how long an idle rank busy-polls before yielding (see `run_round`), for
    /// `local_size` ranks on this host: `LIGHTPATH_COLL_SPIN_US` if set, else [`SPIN`] when
    /// this thread is bound to one CPU, the host has a CPU for every local rank and every peer
    /// is reached over shm or over soft driven by the rank itself (no peer can then be waiting
    /// for this rank's CPU, and nothing this rank waits for needs it: shm moves while the
    /// ranks poll, and a soft device in polling mode receives in the rank's own looks), else
    /// 0. Open MPI decides the same way (it yields when oversubscribed). With soft's progress
    /// thread (`Config::stream` set to `ProgressMode::Thread`) the rank yields: that thread
    /// receives the peer's datagrams, on the rank's CPU when the rank is bound (2 ranks, 8 B
    /// allreduce: median ~74 us either way).
    pub(crate) fn choose_spin(&mut self, local_size: usize, soft_polled: bool) {
        let polled = self.peers.iter().flatten().all(|p| match p.data.transport() {
            lightpath::Transport::Rdma(lightpath::ProviderId::Shm) => true,
            lightpath::Transport::Rdma(lightpath::ProviderId::Soft) => soft_polled,
            _ => false,
        });
        self.spin = match std::env::var("LIGHTPATH_COLL_SPIN_US").ok().and_then(|v| v.parse().ok()) {
            Some(us) => Duration::from_micros(us),
            None if polled && bound_to_one_cpu() && local_size <= online_cpus() => SPIN,
            None => Duration::ZERO,
        };
    }

    /// The flag `Communicator::abort` sets.
    pub(crate) fn abort_flag(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        self.aborted.clone()
    }

    /// Clones of the control connections (for aborting without the mesh).
    pub(crate) fn control_clones(&self) -> Vec<TcpStream> {
        self.peers.iter().flatten().filter_map(|p| p.ctl.try_clone().ok()).collect()
    }

    /// How each peer is reached (`None` for this rank).
    pub(crate) fn transports(&self) -> Vec<Option<String>> {
        let name = |p: &Peer| {
            let transport = p.data.transport().to_string();
            match &p.pipe {
                Some(pipe) if pipe.cma_min != usize::MAX => transport + "+pipe+cma",
                Some(_) => transport + "+pipe",
                None => transport,
            }
        };
        self.peers.iter().map(|p| p.as_ref().map(name)).collect()
    }

    /// Runs `sched`; `group[i]` is the world rank of the schedule's rank `i`.
    pub(crate) fn execute(
        &mut self,
        sched: &Schedule,
        group: &[usize],
        input: &[u8],
        output: &mut [u8],
        op: &'static str,
        seq: u64,
    ) -> Result<(), Error> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        self.check_aborted(op, seq)?;
        let mut result = self.run(sched, group, input, output, op, seq);
        if let Err(Error::PeerFailed { rank: broken, .. }) = &result {
            // A peer whose data stream broke may have aborted first (and then exited because
            // of another rank's failure): its abort names the rank really at fault. Give the
            // control connections a moment to deliver it. When this rank saw the blamed rank
            // die itself, `check_control` reports that death first-hand (`PeerFailed` naming
            // it), which is the better answer too.
            let broken = *broken;
            for _ in 0..10 {
                match self.check_control(op, seq) {
                    Err(e @ Error::Aborted { .. }) => {
                        result = Err(e);
                        break;
                    }
                    Err(e @ Error::PeerFailed { .. }) if e.rank() != Some(broken) => {
                        result = Err(e);
                        break;
                    }
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if let Err(e) = &result {
            self.fail(e.clone());
        }
        result
    }

    /// Tells every peer this rank gives up, and remembers the error.
    pub(crate) fn fail(&mut self, e: Error) {
        if self.poisoned.is_some() {
            return;
        }
        let blamed = e.rank().unwrap_or(self.rank);
        // An abort passed on keeps the first reporter's words instead of nesting them.
        let detail = match &e {
            Error::Aborted { detail, .. } => detail.clone(),
            other => other.to_string(),
        };
        let line = format!("abort {blamed} {}\n", detail.replace('\n', " "));
        for p in self.peers.iter_mut().flatten() {
            let _ = p.ctl.write(line.as_bytes());
        }
        self.poisoned = Some(e);
    }

    fn run(
        &mut self,
        sched: &Schedule,
        group: &[usize],
        input: &[u8],
        output: &mut [u8],
        op: &'static str,
        seq: u64,
    ) -> Result<(), Error> {
        if self.scratch.len() < sched.scratch {
            self.scratch.resize(sched.scratch, 0);
        }
        let es = sched.dtype.size();
        for round in &sched.rounds {
            self.run_round(&round.steps, sched, group, input, output, op, seq, es)?;
            let scratch = &mut self.scratch;
            for step in &round.steps {
                match *step {
                    Step::Copy { from, into } => {
                        // Not `copy_from_slice`: see `lightpath_verbs::copy` (a 2-rank
                        // allgather of 64 KiB took 25 µs instead of 3 where the two buffers
                        // lay at a distance glibc's memcpy is slow at).
                        if from.buf == into.buf {
                            let buf: &mut [u8] = if into.buf == Buf::Output { output } else { scratch };
                            copy::copy_within(buf, from.offset, from.len, into.offset);
                        } else {
                            let (src, dst) = two(input, output, scratch, from, into);
                            copy::copy_bytes(dst, src);
                        }
                    }
                    Step::Reduce { from, into } => {
                        if from.buf != into.buf {
                            let (src, dst) = two(input, output, scratch, from, into);
                            dtype::reduce(sched.dtype, sched.op, dst, src);
                        } else {
                            let src = slice(input, output, scratch, from).to_vec();
                            dtype::reduce(sched.dtype, sched.op, slice_mut(output, scratch, into), &src);
                        }
                    }
                    Step::Divide { region, by } => {
                        dtype::divide(sched.dtype, slice_mut(output, scratch, region), by)
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run_round(
        &mut self,
        steps: &[Step],
        sched: &Schedule,
        group: &[usize],
        input: &[u8],
        output: &mut [u8],
        op: &'static str,
        seq: u64,
        es: usize,
    ) -> Result<(), Error> {
        let moved = match self.run_piped(steps, sched, group, input, output, op, seq)? {
            PipedRound::Done => return Ok(()),
            PipedRound::Partly(moved) => moved,
            PipedRound::Unsuited => 0,
        };
        // The steps' state lives in a vector kept across rounds (no allocation per round).
        let mut pending = std::mem::take(&mut self.pending);
        pending.clear();
        let result = self.run_steps(&mut pending, steps, moved, sched, group, input, output, op, seq, es);
        if result.is_err() {
            self.settle_helps(&pending);
        }
        self.pending = pending;
        result
    }

    /// The small calls' path: a round whose every message goes whole through a same-host
    /// pipe (2 ranks, 8 B broadcast or allreduce) moves them in a few passes over its steps,
    /// without `run_steps`' bookkeeping, which took about half of such a call (~70 ns here,
    /// Open MPI's ~50). Returns [`PipedRound::Unsuited`] (nothing tried) for other rounds,
    /// and hands a round that does not finish within [`PIPED_PASSES`] idle passes to
    /// `run_steps` with what moved ([`PipedRound::Partly`]: bit `i` for the `i`th message
    /// step): the waiting, the failure checks and the timeout are all there.
    #[allow(clippy::too_many_arguments)]
    fn run_piped(
        &mut self,
        steps: &[Step],
        sched: &Schedule,
        group: &[usize],
        input: &[u8],
        output: &mut [u8],
        op: &'static str,
        seq: u64,
    ) -> Result<PipedRound, Error> {
        // Whom this rank waits for, as a ping is answered (`run_steps` sets it again).
        self.waiting_on = None;
        let mut count = 0;
        for step in steps {
            let Some((peer, Message { kind, region, .. })) = message_of(step) else { continue };
            let piped = self
                .peers
                .get(group[peer])
                .and_then(|p| p.as_ref())
                .and_then(|p| p.pipe.as_ref())
                .is_some_and(|pipe| region.len <= pipe.max);
            if !piped || count == 64 {
                return Ok(PipedRound::Unsuited);
            }
            count += 1;
            if kind == 2 && self.pipe_buf.len() < region.len {
                self.pipe_buf.resize(region.len, 0);
            }
        }
        if count == 0 {
            return Ok(PipedRound::Unsuited);
        }
        let all = if count == 64 { u64::MAX } else { (1u64 << count) - 1 };
        let mut moved = 0u64;
        let mut idle = 0;
        loop {
            let before = moved;
            // Steps on one pipe and direction go in order: one that could not move blocks the
            // later ones on its pipe and direction in this pass (`blocked`: peer and
            // direction of each, at most one entry per step).
            let mut blocked = [(usize::MAX, false); 8];
            let mut blocked_len = 0;
            let mut i = 0;
            for step in steps {
                let Some((peer, msg)) = message_of(step) else { continue };
                let (peer_rank, send) = (group[peer], msg.kind == 0);
                let bit = 1u64 << i;
                i += 1;
                if moved & bit != 0 {
                    continue;
                }
                if blocked[..blocked_len].contains(&(peer_rank, send)) {
                    continue;
                }
                let pipe =
                    self.peers[peer_rank].as_mut().and_then(|p| p.pipe.as_mut()).expect("checked above");
                let done = move_piped(
                    pipe,
                    msg,
                    sched,
                    (input, output, &mut self.scratch),
                    &mut self.pipe_buf,
                    |detail| Error::PeerFailed { rank: peer_rank, op, seq, detail },
                )?;
                if done {
                    moved |= bit;
                } else if blocked_len < blocked.len() {
                    blocked[blocked_len] = (peer_rank, send);
                    blocked_len += 1;
                } else {
                    // More blocked pipes than this pass keeps track of: the rest waits for
                    // the next pass (order is kept: nothing later is tried).
                    break;
                }
            }
            if moved == all {
                return Ok(PipedRound::Done);
            }
            if moved == before {
                idle += 1;
                if idle == PIPED_PASSES {
                    return Ok(PipedRound::Partly(moved));
                }
                std::hint::spin_loop();
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_steps(
        &mut self,
        pending: &mut Vec<Pending>,
        steps: &[Step],
        moved: u64,
        sched: &Schedule,
        group: &[usize],
        input: &[u8],
        output: &mut [u8],
        op: &'static str,
        seq: u64,
        es: usize,
    ) -> Result<(), Error> {
        let mut stage_count = 0;
        // `moved`: bit `i` set for the `i`th message step, moved whole by `run_piped`.
        for (i, step) in steps.iter().filter(|s| s.is_comm()).enumerate() {
            let Some((peer, Message { kind, region, with })) = message_of(step) else { continue };
            let stage = if kind == 2 {
                stage_count += 1;
                stage_count - 1
            } else {
                0
            };
            let peer = group[peer];
            let pipe = self.peers[peer].as_ref().and_then(|p| p.pipe.as_ref());
            let cma = pipe.is_some_and(|pipe| region.len > pipe.max && region.len >= pipe.cma_min);
            let piped = cma || pipe.is_some_and(|pipe| region.len <= pipe.max);
            let finished = i < 64 && moved & (1 << i) != 0;
            pending.push(Pending {
                peer,
                region,
                kind,
                with,
                done: if finished { region.len } else { 0 },
                stage,
                fill: 0,
                finished,
                tried: false,
                piped,
                cma: cma.then_some(0),
                helped: false,
                help: None,
            });
        }
        self.waiting_on = None;
        if pending.is_empty() {
            return Ok(());
        }
        while self.stages.len() < stage_count {
            self.stages.push(Vec::new());
        }
        for p in pending.iter() {
            if p.piped && p.kind == 2 && self.pipe_buf.len() < p.region.len.min(STAGE) {
                self.pipe_buf.resize(p.region.len.min(STAGE), 0);
            }
            if p.kind == 2 && !p.piped {
                let want = p.region.len.min(STAGE);
                let st = &mut self.stages[p.stage];
                if st.len() < want {
                    st.resize(want, 0);
                }
            }
        }
        // When the current stretch of looks that moved nothing began: read from the clock at
        // its first look, not at every move (a round that moves at once reads no clock).
        let mut idle_since: Option<Instant> = None;
        let mut idle_looks = 0u32;
        let mut idle = Duration::ZERO;
        let mut remaining = pending.iter().filter(|p| !p.finished).count();
        loop {
            let mut progressed = false;
            // Each stream is driven at most once per look, and its `Driven` serves every step
            // on it (see `Mesh::looked`).
            for p in pending.iter() {
                self.looked[p.peer] = None;
            }
            for i in 0..pending.len() {
                if pending[i].finished {
                    continue;
                }
                let (peer_rank, kind, region, piped) =
                    (pending[i].peer, pending[i].kind, pending[i].region, pending[i].piped);
                // Steps on one stream (or pipe) and direction go in order: a receive after the
                // earlier receives from that peer, a send once the earlier sends' bytes were
                // accepted (the stream keeps them in order from then on). A pipe and a stream
                // are two channels, each in order: both ranks put a message on the same one
                // (by its length).
                if pending[..i].iter().any(|q| {
                    q.peer == peer_rank
                        && (q.kind == 0) == (kind == 0)
                        && q.piped == piped
                        && !q.finished
                        && (kind != 0 || q.done < q.region.len)
                }) {
                    continue;
                }
                let Some(peer) = self.peers[peer_rank].as_mut() else {
                    return Err(Error::InvalidArgument {
                        op,
                        detail: format!("step addresses rank {peer_rank}, this rank"),
                    });
                };
                let fail =
                    |e: io::Error| Error::PeerFailed { rank: peer_rank, op, seq, detail: e.to_string() };
                let p = &mut pending[i];
                if piped && p.cma.is_some() {
                    let pipe = peer.pipe.as_mut().expect("piped steps have a pipe");
                    let broken = |detail: String| Error::PeerFailed { rank: peer_rank, op, seq, detail };
                    if kind == 0 {
                        // The descriptor (where the bytes are, how many), then the peer's
                        // acknowledgement that it read them: until then they stay untouched
                        // (a round never writes what it sends).
                        if p.done == 0 {
                            let bytes = slice(input, output, &self.scratch, region);
                            let mut desc = [0u8; 16];
                            desc[..8].copy_from_slice(&(bytes.as_ptr() as u64).to_le_bytes());
                            desc[8..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
                            if pipe.tx.try_send(&desc).map_err(|e| broken(e.to_string()))? {
                                pipe.cma_sent += 1;
                                p.cma = Some(pipe.cma_sent);
                                p.done = region.len;
                                progressed = true;
                            }
                        }
                        // The receiver may ask this rank to copy part of the message into it
                        // itself (see `HELP_MIN`). The request is the receiver's word: only a
                        // part of this message, named by its number, is served.
                        if let Some(ask) = pipe
                            .tx
                            .help_asked()
                            .filter(|ask| p.done == region.len && !p.helped && Some(ask.number) == p.cma)
                        {
                            let bytes = slice(input, output, &self.scratch, region);
                            let part = usize::try_from(ask.from)
                                .ok()
                                .zip(usize::try_from(ask.len).ok())
                                .and_then(|(from, len)| Some(from..from.checked_add(len)?))
                                .filter(|part| !part.is_empty() && part.end <= bytes.len());
                            let copied = part.is_some_and(|part| {
                                pipe.rx.write_sender_memory(ask.dst, &bytes[part]).is_ok()
                            });
                            pipe.tx.answer_help(ask.number, copied);
                            p.helped = true;
                            progressed = true;
                        }
                        if p.done == region.len
                            && p.cma.is_some_and(|number| pipe.tx.acknowledged() >= number)
                        {
                            p.finished = true;
                            remaining -= 1;
                            progressed = true;
                        }
                        continue;
                    }
                    let unreadable = |e: io::Error| broken(format!("reading its memory: {e}"));
                    if let Some((number, addr, split)) = p.help {
                        // This rank copied its part; the sender answers for the other.
                        let Some(copied) = pipe.rx.help_answer(number) else { continue };
                        if !copied {
                            let dst = &mut slice_mut(output, &mut self.scratch, region)[split..];
                            pipe.rx.read_sender_memory(addr + split as u64, dst).map_err(unreadable)?;
                        }
                        pipe.rx.acknowledge();
                        p.finished = true;
                        remaining -= 1;
                        progressed = true;
                        continue;
                    }
                    let mut desc = [0u8; 16];
                    match pipe.rx.try_recv(&mut desc).map_err(|e| broken(e.to_string()))? {
                        None => continue,
                        Some(16) => {}
                        Some(n) => return Err(broken(format!("a {n}-byte descriptor"))),
                    }
                    let addr = u64::from_le_bytes(desc[..8].try_into().expect("8 bytes"));
                    let len = u64::from_le_bytes(desc[8..].try_into().expect("8 bytes"));
                    if len != region.len as u64 {
                        return Err(broken(format!(
                            "a {len}-byte message where the call expects {}",
                            region.len
                        )));
                    }
                    if kind == 1 && region.len >= pipe.help_min {
                        // The sender copies the second half (a whole number of pages, so both
                        // halves keep the message's page offsets) while this rank copies the
                        // first; the answer is looked for on the next pass.
                        let split = (region.len / 2) & !4095;
                        let number = pipe.rx.next_number();
                        let dst = slice_mut(output, &mut self.scratch, region);
                        let (first, second) = dst.split_at_mut(split);
                        let len = second.len() as u64;
                        pipe.rx.ask_help(number, second.as_mut_ptr() as u64, split as u64, len);
                        pipe.rx.read_sender_memory(addr, first).map_err(unreadable)?;
                        p.help = Some((number, addr, split));
                        progressed = true;
                        continue;
                    }
                    if kind == 1 {
                        let dst = slice_mut(output, &mut self.scratch, region);
                        pipe.rx.read_sender_memory(addr, dst).map_err(unreadable)?;
                    } else {
                        // In stages, each reduced into place as it arrives.
                        let mut at = 0;
                        while at < region.len {
                            // Whole stages (a multiple of every element size) or the rest.
                            let n = (region.len - at).min(STAGE);
                            let stage = &mut self.pipe_buf[..n];
                            pipe.rx.read_sender_memory(addr + at as u64, stage).map_err(unreadable)?;
                            let part = |r: Region| Region { offset: r.offset + at, len: n, ..r };
                            if let Some(with) = p.with {
                                let (left, dst) =
                                    two(input, output, &mut self.scratch, part(with), part(region));
                                dtype::combine(sched.dtype, sched.op, dst, left, stage);
                            } else {
                                let dst = slice_mut(output, &mut self.scratch, part(region));
                                dtype::reduce(sched.dtype, sched.op, dst, stage);
                            }
                            at += n;
                        }
                    }
                    pipe.rx.acknowledge();
                    p.done = region.len;
                    p.finished = true;
                    remaining -= 1;
                    progressed = true;
                    continue;
                }
                if piped {
                    // A pipe message moves whole, with no look at the stream.
                    let pipe = peer.pipe.as_mut().expect("piped steps have a pipe");
                    let moved = move_piped(
                        pipe,
                        Message { kind, region, with: p.with },
                        sched,
                        (input, output, &mut self.scratch),
                        &mut self.pipe_buf,
                        |detail| Error::PeerFailed { rank: peer_rank, op, seq, detail },
                    )?;
                    if moved {
                        p.done = region.len;
                        p.finished = true;
                        remaining -= 1;
                        progressed = true;
                    }
                    continue;
                }
                // A send's first write goes without looking first: a write that finds no room
                // says so (`WouldBlock`) at the cost of a look, and at the start of a round the
                // stream nearly always has room. A receive reads without a look of its own
                // (a read looks first itself: a drive before it would reap twice), or after
                // this look's drive of the stream said there is something. Every other move
                // looks first.
                let look = if kind == 0 { p.done > 0 || p.tried } else { self.looked[peer_rank].is_some() };
                if look {
                    // One look without system calls: reaps completions, posts queued records.
                    let driven = match self.looked[peer_rank] {
                        Some(driven) => driven,
                        None => {
                            let driven = peer.data.drive().map_err(fail)?;
                            self.looked[peer_rank] = Some(driven);
                            driven
                        }
                    };
                    if p.done == region.len {
                        // A send whose bytes were all accepted, some still queued in the
                        // stream (no send-queue room or receive credits when written).
                        if driven.handed_over {
                            p.finished = true;
                            remaining -= 1;
                            progressed = true;
                        }
                        continue;
                    }
                    if (kind == 0 && !driven.writable) || (kind != 0 && !driven.readable) {
                        continue;
                    }
                }
                p.tried = true;
                let mut retried = false;
                loop {
                    let result = match kind {
                        0 => peer.data.write(&slice(input, output, &self.scratch, region)[p.done..]),
                        1 => peer.data.read(&mut slice_mut(output, &mut self.scratch, region)[p.done..]),
                        _ => {
                            let want =
                                (region.len - p.done - p.fill).min(self.stages[p.stage].len() - p.fill);
                            peer.data.read(&mut self.stages[p.stage][p.fill..p.fill + want])
                        }
                    };
                    match result {
                        Ok(0) if kind != 0 => {
                            return Err(Error::PeerFailed {
                                rank: peer_rank,
                                op,
                                seq,
                                detail: "connection closed before the call's data arrived".into(),
                            })
                        }
                        Ok(0) => break,
                        Ok(n) => {
                            progressed = true;
                            if kind == 2 {
                                p.fill += n;
                                let whole = p.fill / es * es;
                                if whole > 0 {
                                    let stage = &mut self.stages[p.stage];
                                    let part =
                                        |r: Region| Region { offset: r.offset + p.done, len: whole, ..r };
                                    if let Some(with) = p.with {
                                        let (left, dst) =
                                            two(input, output, &mut self.scratch, part(with), part(region));
                                        dtype::combine(sched.dtype, sched.op, dst, left, &stage[..whole]);
                                    } else {
                                        let dst = slice_mut(output, &mut self.scratch, part(region));
                                        dtype::reduce(sched.dtype, sched.op, dst, &stage[..whole]);
                                    }
                                    stage.copy_within(whole..p.fill, 0);
                                    p.done += whole;
                                    p.fill -= whole;
                                }
                            } else {
                                p.done += n;
                            }
                            if p.done == region.len {
                                break;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        // A read that found nothing and then saw the peer's connection end
                        // (a process that died) looked at the device before that: what the
                        // peer wrote just before dying may have landed in between. One more
                        // read looks after it.
                        Err(_) if kind != 0 && !retried => retried = true,
                        Err(e) => return Err(fail(e)),
                    }
                }
                if p.done == region.len {
                    // A receive is finished with its last byte. A send is finished once the
                    // stream holds none of its bytes back: they then reach the peer without
                    // this rank calling again, so the call may return (and the caller reuse
                    // the buffer: the stream copied them) without waiting for the peer's
                    // acknowledgement. A write posts what fits at once, so the stream
                    // usually knows without a look (`handed_over_now`); else a look says so,
                    // taken after the write, and the later steps of this look on the stream
                    // use it.
                    let finished = kind != 0 || peer.data.handed_over_now() || {
                        let driven = peer.data.drive().map_err(fail)?;
                        self.looked[peer_rank] = Some(driven);
                        driven.handed_over
                    };
                    if finished {
                        p.finished = true;
                        remaining -= 1;
                    }
                } else {
                    // Bytes moved since this look's `drive` (written, or read out of what it
                    // found): its answer is stale.
                    self.looked[peer_rank] = None;
                }
            }
            if remaining == 0 {
                return Ok(());
            }
            if progressed {
                idle_since = None;
                idle_looks = 0;
                continue;
            }
            // Nothing moved. Keep looking without sleeping (a peer a few microseconds behind
            // then costs no wake-up, which is tens of microseconds and more under load). A rank
            // bound to its own CPU busy-polls first (`choose_spin`): yielding there hands the
            // CPU to whatever else runs on it, for a scheduler slice. Otherwise, or after the
            // spin, it yields between looks: ranks may share CPUs, and one that spins while
            // the peer it waits for sits on its CPU behind it costs that peer a slice.
            // Measured on 2 loaded CPUs, 8 B allreduce of 2 ranks, average: bound, 1.2-4.6 us
            // with 50 us of spin against 46-65 us yielding at once; unbound, 59-86 us with 50
            // us of spin against 5-11 us yielding at once (medians ~1 us throughout). After
            // `YIELD`, sleep on the streams' readiness descriptors.
            // The clock is read every few idle looks, not at each: in a VM a read costs about
            // as much as a look (clock reads were 16-19% of the samples of a 2-rank 8 B
            // allreduce or broadcast loop, the benchmark's own two per call included; no
            // difference in call time was measurable either way).
            idle_looks += 1;
            idle = match idle_since {
                Some(since) if idle_looks.is_multiple_of(CLOCK_EVERY) || idle >= self.spin => since.elapsed(),
                Some(_) => idle,
                None => {
                    idle_since = Some(Instant::now());
                    Duration::ZERO
                }
            };
            if idle < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if idle < YIELD {
                // A failure shows on the control connections; look there now and then.
                if idle_looks.is_multiple_of(64) {
                    self.check_aborted(op, seq)?;
                    if self.check_control(op, seq)? {
                        continue;
                    }
                }
                self.check_dead(pending, op, seq)?;
                std::thread::yield_now();
                continue;
            }
            let waiting = pending.iter().find(|p| !p.finished).map(|p| p.peer).unwrap_or(self.rank);
            self.waiting_on = Some(waiting);
            self.check_aborted(op, seq)?;
            if self.check_control(op, seq)? {
                continue;
            }
            self.check_dead(pending, op, seq)?;
            // Finding whom to blame takes up to ~200 ms; start it early enough to report
            // within the timeout.
            let blame_after = self.timeout.saturating_sub((self.timeout / 4).min(Duration::from_millis(300)));
            if idle >= blame_after {
                let rank = self.blame(waiting, op, seq)?;
                return Err(Error::Timeout { rank, op, seq, after: self.timeout });
            }
            // A pipe has no wake-up: a rank waiting on one naps instead.
            let limit = if pending.iter().any(|p| p.piped && !p.finished) { PIPE_NAP } else { self.timeout };
            self.wait(
                &pending.iter().filter(|p| !p.finished).map(|p| (p.peer, p.kind == 0)).collect::<Vec<_>>(),
                limit.min(self.timeout - idle),
            )?;
        }
    }

    /// After a failed round: a peer must not copy into this rank's buffers once the call has
    /// returned, nor wait for this rank to copy. Descriptor sends whose receiver has not been
    /// helped say that it will not be (the receiver then copies that part itself); descriptor
    /// receives that asked for help withdraw the request and wait until the sender answered or
    /// exited (see `PipeReceiver::withdraw_help`: a sender stopped mid-copy for longer than the
    /// patience is the one case where its part could still land later).
    fn settle_helps(&mut self, pending: &[Pending]) {
        let patience = self.timeout.min(Duration::from_secs(2));
        for p in pending.iter().filter(|p| !p.finished) {
            let Some(pipe) = self.peers[p.peer].as_ref().and_then(|peer| peer.pipe.as_ref()) else {
                continue;
            };
            match (p.kind, p.cma, p.help) {
                (0, Some(number), _) if number > 0 && !p.helped => pipe.tx.answer_help(number, false),
                (1, _, Some((number, _, _))) => {
                    // The call fails either way; `false` is the rare case described above.
                    let _ = pipe.rx.withdraw_help(number, patience);
                }
                _ => {}
            }
        }
    }

    /// Fails (and remembers it) once this process called `Communicator::abort`.
    fn check_aborted(&mut self, op: &'static str, seq: u64) -> Result<(), Error> {
        if !self.aborted.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let e = Error::Aborted {
            rank: self.rank,
            reporter: self.rank,
            op,
            seq,
            detail: "this rank called abort".into(),
        };
        // The peers were told by `abort` itself.
        self.poisoned = Some(e.clone());
        Err(e)
    }

    /// Reads what the control connections say, line by line: `bye`, `abort BLAMED TEXT`,
    /// `ping` (answered at once with `pong R`, R the rank this one waits for or `-`), `pong R`;
    /// and their end (a death unless `bye` came first). Returns whether a death was seen for
    /// the first time: the caller then looks at the streams once more before
    /// [`Mesh::check_dead`] may blame it, since what the peer wrote before it died may have
    /// landed after the last look.
    fn check_control(&mut self, op: &'static str, seq: u64) -> Result<bool, Error> {
        let mut new_death = false;
        // The first `abort` line (blamed, reporter, text): reported after every connection was
        // read, so that a rank this one saw die is named as dead, not as blamed by another.
        let mut abort: Option<(usize, usize, String)> = None;
        let waiting_on = self.waiting_on;
        for (rank, slot) in self.peers.iter_mut().enumerate() {
            let Some(p) = slot else { continue };
            if p.left || p.died {
                continue;
            }
            let mut buf = [0u8; 512];
            let mut ended = false;
            loop {
                match p.ctl.read(&mut buf) {
                    Ok(0) => {
                        ended = true;
                        break;
                    }
                    Ok(n) => p.ctl_buf.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        return Err(Error::PeerFailed {
                            rank,
                            op,
                            seq,
                            detail: format!("control connection: {e}"),
                        })
                    }
                }
            }
            while let Some(end) = p.ctl_buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = p.ctl_buf.drain(..=end).collect();
                let text = String::from_utf8_lossy(&line[..line.len() - 1]).to_string();
                if text == "bye" {
                    p.said_bye = true;
                } else if text == "ping" {
                    let answer = match waiting_on {
                        Some(r) => format!("pong {r}\n"),
                        None => "pong -\n".to_string(),
                    };
                    let _ = p.ctl.write(answer.as_bytes());
                } else if let Some(rest) = text.strip_prefix("pong ") {
                    p.pong = Some(rest.parse().ok());
                } else if let Some(rest) = text.strip_prefix("abort ") {
                    let (blamed, detail) = rest.split_once(' ').unwrap_or((rest, ""));
                    abort.get_or_insert((blamed.parse().unwrap_or(rank), rank, detail.to_string()));
                }
            }
            if ended {
                if p.said_bye {
                    p.left = true;
                    continue;
                }
                // A death fails the calls that need this peer, not the one running now if it
                // needs nothing more from it (its last data arrived before it died): that call
                // finishes, and the next one that addresses the peer fails naming it.
                p.died = true;
                new_death = true;
            }
        }
        if let Some((blamed, reporter, detail)) = abort {
            // Another rank gave up because of a death this rank saw itself: report it first-hand.
            // (A rank that aborted and then exited stays the one that aborted.)
            if blamed != reporter && self.peers.get(blamed).and_then(Option::as_ref).is_some_and(|p| p.died) {
                return Err(Error::PeerFailed { rank: blamed, op, seq, detail: DIED.into() });
            }
            return Err(Error::Aborted { rank: blamed, reporter, op, seq, detail });
        }
        Ok(new_death)
    }

    /// Fails with `PeerFailed` naming a dead peer (see `Peer::died`) that an unfinished step of
    /// this round still addresses.
    fn check_dead(&self, pending: &[Pending], op: &'static str, seq: u64) -> Result<(), Error> {
        for p in pending {
            if p.finished {
                continue;
            }
            let rank = p.peer;
            if self.peers[rank].as_ref().is_some_and(|peer| peer.died) {
                return Err(Error::PeerFailed { rank, op, seq, detail: DIED.into() });
            }
        }
        Ok(())
    }

    /// Whom to blame for a stall first seen as "no progress from `peer`": asks `peer` (on
    /// the control connection) whom it waits for, and follows the chain; the first rank that
    /// does not answer within 200 ms, or answers that it waits for nobody or for a rank
    /// already on the chain, is the one at fault. A rank inside a call answers from its idle
    /// loop; a stopped one, or one busy elsewhere, does not.
    fn blame(&mut self, peer: usize, op: &'static str, seq: u64) -> Result<usize, Error> {
        let mut chain = vec![self.rank];
        let mut suspect = peer;
        while !chain.contains(&suspect) && chain.len() <= self.size {
            let Some(p) = self.peers[suspect].as_mut() else { break };
            if p.died {
                break;
            }
            p.pong = None;
            if p.ctl.write(b"ping\n").is_err() {
                break;
            }
            let deadline = Instant::now() + Duration::from_millis(200);
            let answer = loop {
                self.check_control(op, seq)?;
                if let Some(answer) = self.peers[suspect].as_mut().and_then(|p| p.pong.take()) {
                    break Some(answer);
                }
                if Instant::now() >= deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            match answer {
                Some(Some(next)) if next < self.size && !chain.contains(&next) => {
                    chain.push(suspect);
                    suspect = next;
                }
                _ => break,
            }
        }
        Ok(suspect)
    }

    /// Sleeps until a stream of `waiting` (peer, is_send) or any control connection has news,
    /// or `limit` (at most 10 ms) passes.
    fn wait(&mut self, waiting: &[(usize, bool)], limit: Duration) -> Result<(), Error> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        // The readiness protocol: poll_ready first; wait only if it reports nothing wanted.
        for &(peer, is_send) in waiting {
            if let Some(p) = self.peers[peer].as_mut() {
                match p.data.poll_ready() {
                    Ok(r) if (is_send && r.writable) || (!is_send && r.readable) => return Ok(()),
                    Ok(_) => {}
                    Err(_) => return Ok(()), // the next read or write reports it
                }
            }
        }
        let mut fds: Vec<PollFd<'_>> = Vec::new();
        for (rank, slot) in self.peers.iter().enumerate() {
            let Some(p) = slot else { continue };
            if let Some(&(_, is_send)) = waiting.iter().find(|(r, _)| *r == rank) {
                if let Ok(fd) = p.data.readiness_fd() {
                    let mut flags = PollFlags::IN;
                    if is_send && !p.data.transport().is_rdma() {
                        flags |= PollFlags::OUT;
                    }
                    fds.push(PollFd::from_borrowed_fd(fd, flags));
                }
            }
            // A closed control connection is always readable: waiting on it would spin.
            if !p.left && !p.died {
                fds.push(PollFd::new(&p.ctl, PollFlags::IN));
            }
        }
        let limit = limit.min(Duration::from_millis(10));
        let ts = Timespec { tv_sec: 0, tv_nsec: limit.as_nanos() as _ };
        let _ = poll(&mut fds, Some(&ts));
        Ok(())
    }

    /// Clean close: flush the data streams (so that peers can read everything this rank
    /// sent), say `bye` on every control connection, then wait (up to the timeout, at least
    /// 2 s) until every peer has said `bye` or gone: tearing a stream down while its peer still
    /// waits for the acknowledgement of its last write would fail that peer's last call.
    pub(crate) fn close(&mut self) {
        let linger = self.timeout.max(Duration::from_secs(2));
        let deadline = Instant::now() + linger;
        for p in self.peers.iter_mut().flatten() {
            while Instant::now() < deadline {
                match p.data.flush() {
                    Ok(()) => break,
                    Err(e)
                        if e.kind() == io::ErrorKind::WouldBlock
                            || e.kind() == io::ErrorKind::Interrupted =>
                    {
                        std::thread::sleep(Duration::from_micros(100))
                    }
                    Err(_) => break,
                }
            }
            let _ = p.ctl.write(b"bye\n");
        }
        // After a failure, peers that are gone end the wait at once (their control connection
        // closes); a stopped one costs at most half a second.
        let linger = if self.poisoned.is_some() { linger.min(Duration::from_millis(500)) } else { linger };
        let deadline = Instant::now() + linger;
        let mut buf = [0u8; 256];
        for p in self.peers.iter_mut().flatten() {
            while !p.left && !p.said_bye && Instant::now() < deadline {
                match p.ctl.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        p.ctl_buf.extend_from_slice(&buf[..n]);
                        if p.ctl_buf.windows(3).any(|w| w == b"bye") {
                            p.left = true;
                        }
                    }
                    Err(e)
                        if e.kind() == io::ErrorKind::WouldBlock
                            || e.kind() == io::ErrorKind::Interrupted =>
                    {
                        std::thread::sleep(Duration::from_micros(200))
                    }
                    Err(_) => break,
                }
            }
        }
    }
}

/// Whether this thread may run on exactly one CPU.
fn bound_to_one_cpu() -> bool {
    rustix::thread::sched_getaffinity(None).is_ok_and(|set| set.count() == 1)
}

/// How many CPUs the host has online (`/sys/devices/system/cpu/online`, e.g. `0-3,8`), or
/// what this process may use if that cannot be read.
fn online_cpus() -> usize {
    let listed = std::fs::read_to_string("/sys/devices/system/cpu/online").ok().and_then(|text| {
        text.trim()
            .split(',')
            .map(|range| match range.split_once('-') {
                Some((a, b)) => Some(b.parse::<usize>().ok()?.checked_sub(a.parse().ok()?)? + 1),
                None => range.parse::<usize>().ok().map(|_| 1),
            })
            .sum::<Option<usize>>()
    });
    listed.unwrap_or_else(lightpath_verbs::available_cores)
}

/// A round's message: `kind` 0 sends `region`, 1 receives into it, 2 receives and reduces
/// into it (or, with `with`, stores `with op received` there).
#[derive(Clone, Copy)]
struct Message {
    kind: u8,
    region: Region,
    with: Option<Region>,
}

/// The message `step` moves, with the peer (a rank of the schedule) it goes to or comes
/// from; `None` for a local step.
fn message_of(step: &Step) -> Option<(usize, Message)> {
    let (peer, kind, region, with) = match *step {
        Step::Send { peer, from } => (peer, 0, from, None),
        Step::Recv { peer, into } => (peer, 1, into, None),
        Step::RecvReduce { peer, into } => (peer, 2, into, None),
        Step::RecvCombine { peer, with, into } => (peer, 2, into, Some(with)),
        Step::Copy { .. } | Step::Reduce { .. } | Step::Divide { .. } => return None,
    };
    Some((peer, Message { kind, region, with }))
}

/// Moves `msg` through `pipe` if the pipe can take or give it now: a send copies the bytes in;
/// a plain receive copies them straight into place, a reducing one into `pipe_buf` first and
/// reduces from there. Returns whether it moved (`false`: the pipe is full, or nothing has
/// arrived); a pipe error or a message of the wrong length is `broken`'s error.
fn move_piped(
    pipe: &mut Pipe,
    msg: Message,
    sched: &Schedule,
    (input, output, scratch): (&[u8], &mut [u8], &mut [u8]),
    pipe_buf: &mut [u8],
    broken: impl Fn(String) -> Error,
) -> Result<bool, Error> {
    let Message { kind, region, with } = msg;
    if kind == 0 {
        let bytes = slice(input, output, scratch, region);
        return pipe.tx.try_send(bytes).map_err(|e| broken(e.to_string()));
    }
    let into = if kind == 1 { slice_mut(output, scratch, region) } else { &mut pipe_buf[..region.len] };
    match pipe.rx.try_recv(into).map_err(|e| broken(e.to_string()))? {
        None => Ok(false),
        Some(n) if n != region.len => {
            Err(broken(format!("a {n}-byte message where the call expects {}", region.len)))
        }
        Some(_) if kind == 1 => Ok(true),
        Some(n) => {
            let got = &pipe_buf[..n];
            if let Some(with) = with {
                let (left, dst) = two(input, output, scratch, with, region);
                dtype::combine(sched.dtype, sched.op, dst, left, got);
            } else {
                dtype::reduce(sched.dtype, sched.op, slice_mut(output, scratch, region), got);
            }
            Ok(true)
        }
    }
}

fn slice<'a>(input: &'a [u8], output: &'a [u8], scratch: &'a [u8], r: Region) -> &'a [u8] {
    let buf = match r.buf {
        Buf::Input => input,
        Buf::Output => output,
        Buf::Scratch => scratch,
    };
    &buf[r.offset..r.offset + r.len]
}

fn slice_mut<'a>(output: &'a mut [u8], scratch: &'a mut [u8], r: Region) -> &'a mut [u8] {
    let buf = match r.buf {
        Buf::Input => unreachable!("schedules never write their input"),
        Buf::Output => output,
        Buf::Scratch => scratch,
    };
    &mut buf[r.offset..r.offset + r.len]
}

/// The bytes of `from` and of `into`, two regions of different buffers (the input is never
/// written).
fn two<'a>(
    input: &'a [u8],
    output: &'a mut [u8],
    scratch: &'a mut [u8],
    from: Region,
    into: Region,
) -> (&'a [u8], &'a mut [u8]) {
    let (src, dst): (&[u8], &mut [u8]) = match (from.buf, into.buf) {
        (Buf::Input, Buf::Output) => (input, output),
        (Buf::Input, Buf::Scratch) => (input, scratch),
        (Buf::Output, Buf::Scratch) => (output, scratch),
        (Buf::Scratch, Buf::Output) => (scratch, output),
        _ => unreachable!("schedules never write their input, and these two buffers differ"),
    };
    (&src[from.offset..from.offset + from.len], &mut dst[into.offset..into.offset + into.len])
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh").field("rank", &self.rank).field("size", &self.size).finish_non_exhaustive()
    }
}
