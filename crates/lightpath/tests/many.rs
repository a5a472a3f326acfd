//! A thousand concurrent RDMA connections in one process (tokio driver): all negotiated over
//! the soft provider, all open at once, each carrying verified request/response traffic.
#![cfg(feature = "tokio")]

mod common;

use common::pattern;
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONNS: usize = 1000;

fn small() -> Options {
    Options {
        ring_size: 16 << 10,
        recv_depth: 16,
        send_depth: 16,
        ..Options::default().with_providers(&[ProviderId::Soft])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_connections() {
    let listener = Listener::bind_with("127.0.0.1:0", small()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..CONNS {
            let (mut stream, _) = listener.accept().await.unwrap();
            assert_eq!(stream.transport(), Transport::Rdma(ProviderId::Soft));
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
    let mut clients = Vec::with_capacity(CONNS);
    while clients.len() < CONNS {
        // Fifty negotiations at a time.
        let batch: Vec<_> = (0..50)
            .map(|_| tokio::spawn(async move { Stream::connect_with(addr, &small()).await }))
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
    assert_eq!(server.await.unwrap(), (CONNS * 10) as u32);
}
