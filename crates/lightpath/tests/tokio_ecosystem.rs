//! Real tokio-ecosystem peers over `lightpath::tokio::{Listener, Stream}`, over shm, soft and
//! the TCP fallback: hyper's HTTP/1.1 and HTTP/2 (client and server, through hyper-util's
//! `TokioIo`), with concurrent HTTP/2 streams multiplexed on one connection; and tokio-util's
//! `Framed` with a length-delimited codec, frames from empty to several rings long. Every
//! answer is checked and every wait bounded.
#![cfg(feature = "tokio")]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{digest, pattern, shm, soft};
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use lightpath::tokio::{Listener, Stream};
use lightpath::Options;
use tokio_util::codec::{Framed, FramedRead, FramedWrite, LengthDelimitedCodec};

/// Longest any one test may take (each takes about a second).
const LIMIT: Duration = Duration::from_secs(60);

/// Answers a request with its path, its body's length and the body's CRC-32.
async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let path = request.uri().path().to_string();
    let body = request.into_body().collect().await?.to_bytes();
    Ok(Response::new(Full::new(Bytes::from(format!("{path} {}", digest(&body))))))
}

#[derive(Clone, Copy, Debug)]
enum Http {
    One,
    Two,
}

/// A server speaking `version` on every accepted connection.
fn serve(listener: Listener, version: Http) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let io = TokioIo::new(stream);
                let service = hyper::service::service_fn(answer);
                let _ = match version {
                    Http::One => {
                        hyper::server::conn::http1::Builder::new().serve_connection(io, service).await
                    }
                    Http::Two => {
                        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, service)
                            .await
                    }
                };
            });
        }
    })
}

fn request(path: &str, body: Vec<u8>) -> Request<Full<Bytes>> {
    Request::post(path).header(hyper::header::HOST, "lightpath").body(Full::new(Bytes::from(body))).unwrap()
}

async fn check(response: Response<Incoming>, path: &str, body: &[u8]) {
    assert!(response.status().is_success(), "{}", response.status());
    let got = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(std::str::from_utf8(&got).unwrap(), format!("{path} {}", digest(body)));
}

const SIZES: [usize; 6] = [0, 1, 100, 4 << 10, 64 << 10, 600 << 10];

async fn http1(options: Options) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let server = serve(listener.clone(), Http::One);
    let stream = Stream::connect_with(listener.local_addr().unwrap(), &options).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    let driver = tokio::spawn(connection);
    for (i, size) in SIZES.iter().cycle().take(18).enumerate() {
        let body = pattern(*size, i as u32);
        let path = format!("/one/{i}");
        sender.ready().await.unwrap();
        let response = sender.send_request(request(&path, body.clone())).await.unwrap();
        check(response, &path, &body).await;
    }
    drop(sender);
    driver.await.unwrap().unwrap();
    server.abort();
}

/// HTTP/2: many requests in flight at once on one connection, each on its own stream.
async fn http2(options: Options) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let server = serve(listener.clone(), Http::Two);
    let stream = Stream::connect_with(listener.local_addr().unwrap(), &options).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
    let driver = tokio::spawn(connection);
    let mut requests = Vec::new();
    for (i, size) in SIZES.iter().cycle().take(24).enumerate() {
        let mut sender = sender.clone();
        requests.push(tokio::spawn(async move {
            let body = pattern(*size, 100 + i as u32);
            let path = format!("/two/{i}");
            sender.ready().await.unwrap();
            let response = sender.send_request(request(&path, body.clone())).await.unwrap();
            check(response, &path, &body).await;
        }));
    }
    for request in requests {
        request.await.unwrap();
    }
    drop(sender);
    driver.await.unwrap().unwrap();
    server.abort();
}

/// `Framed` with a length-delimited codec on both ends: the server echoes every frame; the
/// client writes from one task and reads the echoes in another (`tokio::io::split`, then
/// `FramedWrite` and `FramedRead`), since frames larger than the rings cannot all be written
/// before any is read back.
async fn framed(options: Options) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let codec = || LengthDelimitedCodec::builder().max_frame_length(4 << 20).new_codec();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut frames = Framed::new(stream, codec());
        let mut echoed = 0;
        while let Some(frame) = frames.next().await {
            frames.send(frame.unwrap().freeze()).await.unwrap();
            echoed += 1;
        }
        echoed
    });
    let stream = Stream::connect_with(addr, &options).await.unwrap();
    let (reader, writer) = tokio::io::split(stream);
    let sizes = [0usize, 1, 7, 4096, 65_535, 65_536, 300_000, 1 << 20, 3];
    let writing = tokio::spawn(async move {
        let mut sink = FramedWrite::new(writer, codec());
        for (i, size) in sizes.iter().enumerate() {
            sink.feed(Bytes::from(pattern(*size, i as u32))).await.unwrap();
        }
        SinkExt::<Bytes>::flush(&mut sink).await.unwrap();
        // Half close: the server sees the end of the frames and ends its echo.
        sink.get_mut().shutdown().await.unwrap();
    });
    let mut echoes = FramedRead::new(reader, codec());
    for (i, size) in sizes.iter().enumerate() {
        let frame = echoes.next().await.expect("an echoed frame").unwrap();
        assert!(frame[..] == pattern(*size, i as u32)[..], "frame {i} ({size} bytes) differs");
    }
    assert!(echoes.next().await.is_none(), "the echo ends with the stream");
    writing.await.unwrap();
    assert_eq!(server.await.unwrap(), sizes.len());
}

use tokio::io::AsyncWriteExt;

macro_rules! over_each_transport {
    ($($name:ident => $body:ident;)*) => {
        mod shm_transport {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    tokio::time::timeout(LIMIT, $body(shm())).await.expect("timed out");
                }
            )*
        }
        mod soft_transport {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    tokio::time::timeout(LIMIT, $body(soft())).await.expect("timed out");
                }
            )*
        }
        mod tcp_transport {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    tokio::time::timeout(LIMIT, $body(Options::tcp_only())).await.expect("timed out");
                }
            )*
        }
    };
}

over_each_transport! {
    hyper_http1 => http1;
    hyper_http2_multiplexed => http2;
    tokio_util_framed => framed;
}
