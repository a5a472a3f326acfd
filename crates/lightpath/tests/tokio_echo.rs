//! The tokio driver: echo through `tokio::io::split` + `copy`, and a proxy built on
//! `copy_bidirectional` between a Lightpath stream and a plain tokio TCP stream, over the soft
//! provider and over TCP.
#![cfg(feature = "tokio")]

mod common;

use common::{checksum, pattern};
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn soft() -> Options {
    Options::default().with_providers(&[ProviderId::Soft])
}

async fn split_copy_echo(options: Options, expect_rdma: bool) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let (mut reader, mut writer) = tokio::io::split(stream);
        let copied = tokio::io::copy(&mut reader, &mut writer).await.unwrap();
        writer.shutdown().await.unwrap();
        copied
    });
    let mut stream = Stream::connect_with(addr, &options).await.unwrap();
    assert_eq!(stream.transport().is_rdma(), expect_rdma, "{}", stream.transport());
    let data = pattern(3 << 20, 4);
    let (mut reader, mut writer) = tokio::io::split(&mut stream);
    let send = async {
        writer.write_all(&data).await.unwrap();
        writer.shutdown().await.unwrap();
    };
    let receive = async {
        let mut back = Vec::new();
        reader.read_to_end(&mut back).await.unwrap();
        back
    };
    let ((), back) = tokio::join!(send, receive);
    assert_eq!(back.len(), data.len());
    assert_eq!(checksum(&back), checksum(&data));
    assert_eq!(server.await.unwrap(), data.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_and_copy_over_soft() {
    split_copy_echo(soft(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_and_copy_over_tcp() {
    split_copy_echo(Options::tcp_only(), false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn copy_bidirectional_proxy_and_messages() {
    // A plain tokio TCP echo server behind a Lightpath proxy.
    let backend = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = backend.accept().await.unwrap();
        let (mut r, mut w) = conn.split();
        tokio::io::copy(&mut r, &mut w).await.unwrap();
    });
    let listener = Listener::bind_with("127.0.0.1:0", soft()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = tokio::spawn(async move {
        let (mut front, _) = listener.accept().await.unwrap();
        assert_eq!(front.transport(), Transport::Rdma(ProviderId::Soft));
        let greeting = front.recv_msg().await.unwrap().unwrap();
        front.send_msg(&greeting).await.unwrap();
        let mut back = tokio::net::TcpStream::connect(backend_addr).await.unwrap();
        tokio::io::copy_bidirectional(&mut front, &mut back).await.unwrap()
    });
    let mut stream = Stream::connect_with(addr, &soft()).await.unwrap();
    stream.send_msg(b"hello proxy").await.unwrap();
    assert_eq!(stream.recv_msg().await.unwrap().as_deref(), Some(&b"hello proxy"[..]));
    let data = pattern(200_000, 9);
    stream.write_all(&data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(back, data);
    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    let (up, down) = proxy.await.unwrap();
    assert_eq!((up, down), (data.len() as u64, data.len() as u64));
}
