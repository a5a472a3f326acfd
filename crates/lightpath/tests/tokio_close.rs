//! Closing tokio streams without blocking the runtime: a dropped stream whose peer has not
//! acknowledged its bytes (the peer process is stopped) lets a current-thread runtime run other
//! tasks, and the bytes still arrive once the peer runs again; `close().await` waits for the
//! acknowledgements while other tasks run; dropped streams whose peer reads only later deliver
//! everything with a clean end of stream (soft, shm, tcp); a `send_msg` waiting for the peer's
//! receive credits is woken when the peer reads.
#![cfg(feature = "tokio")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Waker};

use common::{checksum, pattern, shm, soft};
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, Transport};
use rustix::process::{kill_process, waitpid, Pid, Signal, WaitOptions};
use tokio::io::AsyncWrite;

/// Child-process side of the stopped-peer tests: connects over soft, says so, then reads to
/// the end and reports what it got: length, checksum, how the stream ended, and how the
/// connection closed. The last tells a finished clean close (the peer said goodbye: writing
/// fails with `BrokenPipe`) from one given up (no goodbye: `ConnectionReset`).
#[test]
fn child_reader() {
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_CLOSE_ADDR") else { return };
    let mut stream = lightpath::Stream::connect_with(addr.as_str(), &soft()).expect("child connect");
    println!("connected {}", stream.transport());
    std::io::stdout().flush().unwrap();
    let mut got = Vec::new();
    let ended = match stream.read_to_end(&mut got) {
        Ok(_) => "eof".to_string(),
        Err(err) => format!("{:?}", err.kind()),
    };
    // Writes go through until the receive credits run out; the blocked write then looks at
    // the TCP connection and fails with what it finds there.
    let closed = loop {
        if let Err(err) = stream.write(b"x") {
            break format!("{:?}", err.kind());
        }
    };
    println!("received {} {:x} {ended} {closed}", got.len(), checksum(&got));
    std::io::stdout().flush().unwrap();
}

/// A child running `child_reader` against `addr`, and its report lines.
struct ChildReader {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl ChildReader {
    fn spawn(addr: std::net::SocketAddr) -> ChildReader {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_reader", "--nocapture", "--test-threads=1"])
            .env("LIGHTPATH_TEST_CLOSE_ADDR", addr.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                // The harness writes "test child_reader ... " in front of the first line.
                let report = ["connected ", "received "].iter().find_map(|tag| line.find(tag));
                if let Some(at) = report {
                    if tx.send(line[at..].to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        ChildReader { child, lines }
    }

    fn pid(&self) -> Pid {
        Pid::from_child(&self.child)
    }

    /// Stops the child (SIGSTOP) and waits until it is stopped: from then on its RDMA device
    /// acknowledges nothing, while its TCP connection stays open (the kernel keeps it).
    fn stop(&self) {
        kill_process(self.pid(), Signal::STOP).unwrap();
        let (_, status) = waitpid(Some(self.pid()), WaitOptions::UNTRACED).unwrap().unwrap();
        assert!(status.stopped(), "the child stopped: {status:?}");
    }

    /// The child's next report line, waited for on the blocking pool.
    async fn report(&mut self) -> String {
        let lines = std::mem::replace(&mut self.lines, mpsc::channel().1);
        let (line, lines) = tokio::task::spawn_blocking(move || (lines.recv(), lines)).await.unwrap();
        self.lines = lines;
        line.expect("the child ended without reporting")
    }

    fn finish(mut self) {
        assert!(self.child.wait().unwrap().success(), "the child's test failed");
    }
}

/// A listener, a stopped-to-be child connected to it, and the accepted stream.
async fn stream_to_a_child() -> (Stream, ChildReader) {
    let listener = Listener::bind_with("127.0.0.1:0", soft()).await.unwrap();
    let mut child = ChildReader::spawn(listener.local_addr().unwrap());
    let (stream, _) = listener.accept().await.unwrap();
    assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
    assert!(child.report().await.starts_with("connected rdma/soft"));
    (stream, child)
}

/// Another task of the runtime: counts `steps` turns, yielding between them, then lets the
/// stopped child run again (SIGCONT). Until it has run, the child acknowledges nothing.
fn resume_after_steps(pid: Pid, steps: usize, progress: Arc<AtomicUsize>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for _ in 0..steps {
            progress.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
        }
        kill_process(pid, Signal::CONT).unwrap();
    })
}

/// The stream's bytes, written while the child is stopped, so none is acknowledged.
async fn write_unacknowledged(stream: &mut Stream) -> Vec<u8> {
    use tokio::io::AsyncWriteExt;
    let data = pattern(32 << 10, 11);
    for chunk in data.chunks(4096) {
        stream.write_all(chunk).await.unwrap();
    }
    data
}

#[tokio::test(flavor = "current_thread")]
async fn dropping_a_stream_whose_peer_is_stopped_does_not_block_the_runtime() {
    let (mut stream, mut child) = stream_to_a_child().await;
    child.stop();
    let data = write_unacknowledged(&mut stream).await;
    let progress = Arc::new(AtomicUsize::new(0));
    let other = resume_after_steps(child.pid(), 100, Arc::clone(&progress));
    // The child acknowledges nothing until the other task has run, and that task runs only
    // once this one gives the (single) runtime thread back. A drop that waited for the
    // acknowledgements would wait until the queue pair gave up retrying (seconds) and close
    // without a goodbye; the child would then find its connection reset.
    drop(stream);
    assert_eq!(progress.load(Ordering::SeqCst), 0, "nothing else ran inside drop");
    other.await.unwrap();
    assert_eq!(progress.load(Ordering::SeqCst), 100, "the other task ran to its end");
    let report = child.report().await;
    assert_eq!(report, format!("received {} {:x} eof BrokenPipe", data.len(), checksum(&data)));
    child.finish();
}

#[tokio::test(flavor = "current_thread")]
async fn close_awaits_the_acknowledgements_while_other_tasks_run() {
    let (mut stream, mut child) = stream_to_a_child().await;
    child.stop();
    let data = write_unacknowledged(&mut stream).await;
    let progress = Arc::new(AtomicUsize::new(0));
    let other = resume_after_steps(child.pid(), 100, Arc::clone(&progress));
    // close() can only finish once the child acknowledges, i.e. after the other task resumed
    // it: so the other task made all its progress while close() was waiting.
    stream.close().await.unwrap();
    assert_eq!(progress.load(Ordering::SeqCst), 100);
    other.await.unwrap();
    let report = child.report().await;
    assert_eq!(report, format!("received {} {:x} eof BrokenPipe", data.len(), checksum(&data)));
    child.finish();
}

/// Writes until the stream would block, without waiting (a no-op waker: nothing polls again).
fn fill_without_waiting(stream: &mut Stream) -> Vec<u8> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut sent = Vec::new();
    for salt in 0.. {
        let chunk = pattern(16 << 10, salt);
        match Pin::new(&mut *stream).poll_write(&mut cx, &chunk) {
            Poll::Ready(Ok(n)) => sent.extend_from_slice(&chunk[..n]),
            Poll::Ready(Err(err)) => panic!("write: {err}"),
            Poll::Pending => break,
        }
    }
    sent
}

/// A tokio stream is written to (over RDMA until its ring is full: the peer reads nothing) and
/// dropped; the peer, a blocking stream on its own thread, starts reading only afterwards and
/// gets every byte and a clean end of stream.
async fn dropped_stream_delivers_to_a_late_reader(options: Options, expect_rdma: bool) {
    let listener = lightpath::Listener::bind_with("127.0.0.1:0", options.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        go_rx.recv().unwrap();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).map(|_| got)
    });
    let mut stream = Stream::connect_with(addr, &options).await.unwrap();
    assert_eq!(stream.transport().is_rdma(), expect_rdma, "{}", stream.transport());
    let sent = if expect_rdma {
        fill_without_waiting(&mut stream)
    } else {
        // A framed TCP record cut short by a full socket can never be closed cleanly (its
        // length is on the wire), so over TCP write whole records that the socket takes.
        use tokio::io::AsyncWriteExt;
        let data = pattern(100_000, 5);
        stream.write_all(&data).await.unwrap();
        data
    };
    assert!(!sent.is_empty());
    let progress = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&progress);
    let other = tokio::spawn(async move {
        for _ in 0..10 {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
        }
    });
    drop(stream);
    other.await.unwrap();
    assert_eq!(progress.load(Ordering::SeqCst), 10);
    go_tx.send(()).unwrap();
    let got = tokio::task::spawn_blocking(move || reader.join().unwrap()).await.unwrap();
    let got = got.expect("a clean end of stream, not a reset");
    assert_eq!(got.len(), sent.len());
    assert_eq!(checksum(&got), checksum(&sent));
}

#[tokio::test(flavor = "current_thread")]
async fn dropped_stream_delivers_to_a_late_reader_over_soft() {
    dropped_stream_delivers_to_a_late_reader(soft(), true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn dropped_stream_delivers_to_a_late_reader_over_shm() {
    dropped_stream_delivers_to_a_late_reader(shm(), true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn dropped_stream_delivers_to_a_late_reader_over_tcp() {
    dropped_stream_delivers_to_a_late_reader(Options::tcp_only(), false).await;
}

/// Messages until the receive credits run out while the peer reads nothing, then the peer
/// reads: the blocked `send_msg` must be woken (credit returns alone raise no completion on
/// the sender; the driver asks the peer for a wake-up).
async fn send_msg_wakes_when_the_peer_reads(options: Options) {
    const MESSAGES: usize = 300;
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&sent);
    let sender = tokio::spawn(async move {
        let mut stream = Stream::connect_with(addr, &options).await.unwrap();
        for i in 0..MESSAGES {
            stream.send_msg(&pattern(100, i as u32)).await.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
        }
        stream.close().await.unwrap();
    });
    let (mut stream, _) = listener.accept().await.unwrap();
    assert!(stream.transport().is_rdma());
    // Let the sender run until it stops making progress: it is then waiting for credits.
    let mut last = usize::MAX;
    let mut still = 0;
    while still < 200 {
        tokio::task::yield_now().await;
        let now = sent.load(Ordering::SeqCst);
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    assert!(last < MESSAGES, "the sender ran out of receive credits ({last} sent)");
    let receive_all = async {
        for i in 0..MESSAGES {
            let msg = stream.recv_msg().await.unwrap().expect("a message");
            assert_eq!(msg, pattern(100, i as u32), "message {i}");
        }
        assert_eq!(stream.recv_msg().await.unwrap(), None);
        sender.await.unwrap();
    };
    // A guard against a hang (the failure this test exists for), not a measurement.
    let guard = std::time::Duration::from_secs(60);
    tokio::time::timeout(guard, receive_all).await.expect("the blocked sender was never woken");
}

#[tokio::test(flavor = "current_thread")]
async fn send_msg_wakes_when_the_peer_reads_over_soft() {
    send_msg_wakes_when_the_peer_reads(soft()).await;
}

#[tokio::test(flavor = "current_thread")]
async fn send_msg_wakes_when_the_peer_reads_over_shm() {
    send_msg_wakes_when_the_peer_reads(shm()).await;
}

/// In a child process that `stream_of_an_exited_child` started: connects to
/// `LIGHTPATH_TEST_QUIT_ADDR` with the providers named in `LIGHTPATH_TEST_QUIT_PROVIDER` and
/// reads the server's greeting. `None` in any other process.
fn greeted_child() -> Option<lightpath::Stream> {
    let addr = std::env::var("LIGHTPATH_TEST_QUIT_ADDR").ok()?;
    let options = match std::env::var("LIGHTPATH_TEST_QUIT_PROVIDER").as_deref() {
        Ok("shm") => shm(),
        _ => soft(),
    };
    let mut stream = lightpath::Stream::connect_with(addr.as_str(), &options).expect("child connect");
    let mut greeting = [0u8; 5];
    stream.read_exact(&mut greeting).expect("the greeting");
    Some(stream)
}

/// Ends a child process at once, as a client process that ends right after its last request.
fn child_exits(said: &str) -> ! {
    println!("{said}");
    std::io::stdout().flush().unwrap();
    std::process::exit(0);
}

/// Child-process side of `shutdown_after_the_peer_closed_and_exited`: closes its sending side
/// and exits (no clean close: its process is gone).
#[test]
fn child_quitter() {
    let Some(mut stream) = greeted_child() else { return };
    stream.shutdown(std::net::Shutdown::Write).expect("half close");
    child_exits("quitting");
}

/// Child-process side of `close_after_the_peer_closed_cleanly_and_exited`: closes cleanly (a
/// blocking drop: its records acknowledged, then its goodbye) and exits; its queue pair goes
/// with it.
#[test]
fn child_closer() {
    let Some(stream) = greeted_child() else { return };
    drop(stream);
    child_exits("closed");
}

/// Runs the child test `child` against a listener with `options` (`provider` names them to the
/// child), greets it, reads its stream to the end and waits for its process to end: the
/// server's stream, whose peer is gone.
async fn stream_of_an_exited_child(child: &str, options: Options, provider: &str) -> Stream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = Listener::bind_with("127.0.0.1:0", options).await.unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--nocapture", "--test-threads=1"])
        .env("LIGHTPATH_TEST_QUIT_ADDR", listener.local_addr().unwrap().to_string())
        .env("LIGHTPATH_TEST_QUIT_PROVIDER", provider)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut stream, _) = listener.accept().await.unwrap();
    assert!(stream.transport().is_rdma(), "{}", stream.transport());
    stream.write_all(b"hello").await.unwrap();
    stream.flush().await.unwrap();
    let mut rest = Vec::new();
    let read = stream.read_to_end(&mut rest).await;
    assert!(matches!(read, Ok(0)), "the child sends nothing, then closes: {read:?}");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "the child's test failed: {status:?}");
    stream
}

/// A client process closes its side and exits without finishing its close; the server,
/// having read the end of the stream, shuts its own side down (what hyper does): that is
/// `Ok`, as over a TCP socket, not a reset the server would log as an error for every client
/// that exited.
async fn shutdown_after_the_peer_closed_and_exited(options: Options, provider: &str) {
    use tokio::io::AsyncWriteExt;
    let mut stream = stream_of_an_exited_child("child_quitter", options, provider).await;
    // The child's process is gone: whatever this side still waits for will never come.
    let guard = std::time::Duration::from_secs(60);
    let shutdown = tokio::time::timeout(guard, stream.shutdown()).await.expect("shutdown hung");
    assert!(shutdown.is_ok(), "{shutdown:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn shutdown_after_the_peer_closed_and_exited_over_shm() {
    shutdown_after_the_peer_closed_and_exited(shm(), "shm").await;
}

#[tokio::test(flavor = "current_thread")]
async fn shutdown_after_the_peer_closed_and_exited_over_soft() {
    shutdown_after_the_peer_closed_and_exited(soft(), "soft").await;
}

/// A client process closes cleanly and exits; the server, having read the end of the stream
/// (and the client's goodbye), closes too. Its close record can no longer be acknowledged
/// (the client's queue pair went with its process), and nothing needs it to be: the client
/// read all it wanted and said so. `close` is `Ok` at once; it used to wait for the soft
/// queue pair's retries to run out (about two seconds) and then report a reset.
async fn close_after_the_peer_closed_cleanly_and_exited(options: Options, provider: &str) {
    let stream = stream_of_an_exited_child("child_closer", options, provider).await;
    let guard = std::time::Duration::from_secs(60);
    let closed = tokio::time::timeout(guard, stream.close()).await.expect("close hung");
    assert!(closed.is_ok(), "{closed:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn close_after_the_peer_closed_cleanly_and_exited_over_shm() {
    close_after_the_peer_closed_cleanly_and_exited(shm(), "shm").await;
}

#[tokio::test(flavor = "current_thread")]
async fn close_after_the_peer_closed_cleanly_and_exited_over_soft() {
    close_after_the_peer_closed_cleanly_and_exited(soft(), "soft").await;
}

/// Child-process side of `a_dropped_stream_delivers_all_when_its_process_exits`: a tokio
/// program that connects, writes `LIGHTPATH_TEST_EXIT_LEN` bytes, drops the stream (its close
/// goes to the background) and exits at once, as a short-lived client does.
#[test]
fn child_exiter() {
    use tokio::io::AsyncWriteExt;
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_EXIT_ADDR") else { return };
    let len: usize = std::env::var("LIGHTPATH_TEST_EXIT_LEN").unwrap().parse().unwrap();
    let options = match std::env::var("LIGHTPATH_TEST_EXIT_PROVIDER").as_deref() {
        Ok("shm") => shm(),
        _ => soft(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut stream = Stream::connect_with(addr.as_str(), &options).await.expect("child connect");
        stream.write_all(&pattern(len, 7)).await.expect("write");
        drop(stream);
    });
    drop(runtime);
    std::process::exit(0);
}

/// What a process that drops its last stream and exits right away had written arrives whole,
/// followed by a clean end of stream, as over a TCP socket (the kernel finishes a socket's
/// close after its process is gone; Lightpath's background close runs in the process).
async fn a_dropped_stream_delivers_all_when_its_process_exits(options: Options, provider: &str) {
    use tokio::io::AsyncReadExt;
    let len = 4 << 20;
    let listener = Listener::bind_with("127.0.0.1:0", options).await.unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_exiter", "--nocapture", "--test-threads=1"])
        .env("LIGHTPATH_TEST_EXIT_ADDR", listener.local_addr().unwrap().to_string())
        .env("LIGHTPATH_TEST_EXIT_PROVIDER", provider)
        .env("LIGHTPATH_TEST_EXIT_LEN", len.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (mut stream, _) = listener.accept().await.unwrap();
    assert!(stream.transport().is_rdma(), "{}", stream.transport());
    let mut got = Vec::new();
    let guard = std::time::Duration::from_secs(60);
    let read = tokio::time::timeout(guard, stream.read_to_end(&mut got)).await.expect("read hung");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "the child's test failed: {status:?}");
    assert_eq!((got.len(), checksum(&got)), (len, checksum(&pattern(len, 7))), "{read:?}");
    assert!(read.is_ok(), "the stream ended with {read:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_dropped_stream_delivers_all_when_its_process_exits_over_shm() {
    a_dropped_stream_delivers_all_when_its_process_exits(shm(), "shm").await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_dropped_stream_delivers_all_when_its_process_exits_over_soft() {
    a_dropped_stream_delivers_all_when_its_process_exits(soft(), "soft").await;
}
