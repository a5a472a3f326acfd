//! A tokio reader whose peer process is killed while it sends learns so within seconds, over
//! shm and soft: the peer's death shows only on the TCP connection (the kernel closes it), and
//! the tokio driver looks at that connection only when it has news, not after every wake-up,
//! so its news must never be slept through, even when it comes together with data.
#![cfg(feature = "tokio")]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{shm, soft};
use lightpath::tokio::Listener;
use lightpath::Options;
use rustix::process::{kill_process, Pid, Signal};
use tokio::io::AsyncReadExt;

/// Child-process side: connects with the provider named in `LIGHTPATH_TEST_DEATH_PROVIDER`,
/// says so, then writes a small message every 200 µs until it is killed.
#[test]
fn child_sender() {
    let Ok(addr) = std::env::var("LIGHTPATH_TEST_DEATH_ADDR") else { return };
    let options = match std::env::var("LIGHTPATH_TEST_DEATH_PROVIDER").as_deref() {
        Ok("shm") => shm(),
        _ => soft(),
    };
    let mut stream = lightpath::Stream::connect_with(addr.as_str(), &options).expect("child connect");
    println!("connected {}", stream.transport());
    std::io::stdout().flush().unwrap();
    loop {
        if stream.write_all(b"0123456789abcdef").is_err() {
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Reads from a child that sends until it is killed (SIGKILL, while its messages flow); the
/// read must end (end of stream or an error) long before the guard.
async fn killed_sender(options: Options, provider: &str) {
    let listener = Listener::bind_with("127.0.0.1:0", options).await.unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_sender", "--nocapture", "--test-threads=1"])
        .env("LIGHTPATH_TEST_DEATH_ADDR", listener.local_addr().unwrap().to_string())
        .env("LIGHTPATH_TEST_DEATH_PROVIDER", provider)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut stream, _) = listener.accept().await.unwrap();
    assert!(stream.transport().is_rdma(), "{}", stream.transport());
    // The harness prints its own lines first; all are read (a closed pipe would kill the
    // child's prints), the first with the child's report is handed over.
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines() {
            let Ok(line) = line else { return };
            if let Some(at) = line.find("connected ") {
                let _ = tx.send(line[at..].to_string());
            }
        }
    });
    let line =
        tokio::task::spawn_blocking(move || rx.recv().expect("the child reported nothing")).await.unwrap();
    assert!(line.starts_with("connected rdma/"), "{line}");
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < 16 * 50 {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "the child is still sending");
        got += n;
    }
    kill_process(Pid::from_child(&child), Signal::KILL).unwrap();
    let guard = Duration::from_secs(20);
    let ended = tokio::time::timeout(guard, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(err) => return Err(err),
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the reader was never told that its peer died ({provider})");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(!status.success(), "the child was killed: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_learns_that_its_shm_peer_was_killed_while_sending() {
    for _ in 0..3 {
        killed_sender(shm(), "shm").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_learns_that_its_soft_peer_was_killed_while_sending() {
    for _ in 0..3 {
        killed_sender(soft(), "soft").await;
    }
}
