//! Many concurrent RDMA connections in one process: a thousand over soft and hundreds over shm
//! (tokio driver), and a hundred blocking threads each on a connection of its own, over both;
//! all open at once, each carrying verified request/response traffic. A soft device's
//! connections share its completion queues, so these also check that every completion reaches
//! its connection; shm connections get queues of their own by default, and run once more
//! sharing them (`Options::shared_completion_queues`).
#![cfg(feature = "tokio")]

mod common;

use common::pattern;
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONNS: usize = 1000;
/// Connections of the shm run: with both ends in this process each shm connection holds about
/// twenty descriptors (per side its TCP socket, link sockets, memfds of its segment and two
/// regions, eventfds, the readiness epoll and tokio's duplicate), so a thousand would not fit
/// a 20,000-descriptor limit; `perf stream_rr --conns 1000` runs them in two processes.
const SHM_CONNS: usize = 400;

/// One of these tests at a time: each holds thousands of descriptors.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn small(provider: ProviderId) -> Options {
    Options {
        recv_depth: 16,
        send_depth: 16,
        ..Options::default().with_providers(&[provider]).with_ring_size(16 << 10)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_connections_over_soft() {
    concurrent_connections(ProviderId::Soft, CONNS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_concurrent_connections_over_shm() {
    concurrent_connections(ProviderId::Shm, SHM_CONNS).await;
}

// The guard serialises whole tests: this future runs on its test's own thread (the runtime's
// `block_on`), never on a worker another task could need.
#[allow(clippy::await_holding_lock)]
async fn concurrent_connections(provider: ProviderId, conns: usize) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let listener = Listener::bind_with("127.0.0.1:0", small(provider)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..conns {
            let (mut stream, _) = listener.accept().await.unwrap();
            assert_eq!(stream.transport(), Transport::Rdma(provider));
            tasks.push(tokio::spawn(async move {
                let mut buf = [0u8; 64];
                let mut served = 0u32;
                loop {
                    match stream.read_exact(&mut buf).await {
                        Ok(_) => {}
                        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return served,
                        Err(err) => panic!("server read: {err}"),
                    }
                    buf.reverse();
                    stream.write_all(&buf).await.unwrap();
                    served += 1;
                }
            }));
        }
        let mut total = 0;
        for task in tasks {
            total += task.await.unwrap();
        }
        total
    });
    let mut clients = Vec::with_capacity(conns);
    while clients.len() < conns {
        // Fifty negotiations at a time.
        let batch: Vec<_> = (0..50)
            .map(|_| tokio::spawn(async move { Stream::connect_with(addr, &small(provider)).await }))
            .collect();
        for handle in batch {
            clients.push(handle.await.unwrap().unwrap());
        }
    }
    assert!(clients.iter().all(|s| s.transport().is_rdma()));
    // Every connection is open now; each runs ten verified round trips, all at once.
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, mut stream)| {
            tokio::spawn(async move {
                for round in 0..10u32 {
                    let request = pattern(64, (c as u32) << 8 | round);
                    stream.write_all(&request).await.unwrap();
                    let mut reply = [0u8; 64];
                    stream.read_exact(&mut reply).await.unwrap();
                    reply.reverse();
                    assert_eq!(&reply[..], &request[..], "connection {c} round {round}");
                }
                stream.shutdown().await.unwrap();
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(server.await.unwrap(), (conns * 10) as u32);
}

/// A thread per connection on both sides, every thread blocked in a read most of the time:
/// the blocked threads of a device take turns watching its shared completion queue.
fn hundred_blocking_threads(provider: ProviderId, shared_completion_queues: Option<bool>) {
    use std::io::{Read, Write};
    const THREADS: usize = 100;
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let options = Options { shared_completion_queues, ..small(provider) };
    let listener = lightpath::Listener::bind_with("127.0.0.1:0", options.clone()).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut threads = Vec::new();
        for _ in 0..THREADS {
            let (mut stream, _) = listener.accept().unwrap();
            assert_eq!(stream.transport(), Transport::Rdma(provider));
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                let mut served = 0u32;
                while stream.read_exact(&mut buf).is_ok() {
                    buf.reverse();
                    stream.write_all(&buf).unwrap();
                    served += 1;
                }
                served
            }));
        }
        threads.into_iter().map(|t| t.join().unwrap()).sum::<u32>()
    });
    let clients: Vec<_> = (0..THREADS)
        .map(|c| {
            let mut stream = lightpath::Stream::connect_with(addr, &options).unwrap();
            std::thread::spawn(move || {
                for round in 0..20u32 {
                    let request = pattern(64, (c as u32) << 8 | round);
                    stream.write_all(&request).unwrap();
                    let mut reply = [0u8; 64];
                    stream.read_exact(&mut reply).unwrap();
                    reply.reverse();
                    assert_eq!(&reply[..], &request[..], "connection {c} round {round}");
                }
            })
        })
        .collect();
    for client in clients {
        client.join().unwrap();
    }
    assert_eq!(server.join().unwrap(), (THREADS * 20) as u32);
}

#[test]
fn hundred_blocking_threads_over_soft() {
    hundred_blocking_threads(ProviderId::Soft, None);
}

#[test]
fn hundred_blocking_threads_over_shm() {
    hundred_blocking_threads(ProviderId::Shm, None);
}

#[test]
fn hundred_blocking_threads_over_shm_sharing_completion_queues() {
    hundred_blocking_threads(ProviderId::Shm, Some(true));
}
