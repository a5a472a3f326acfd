//! tonic gRPC over Lightpath streams, over shm, soft and the TCP fallback: the server is fed
//! the listener's streams through `serve_with_incoming`, the client dials through a connector
//! (`Endpoint::connect_with_connector`). One unary method (a blob in, its length and CRC-32
//! out) and one server-streaming method (a blob in, `count` numbered copies out, large enough
//! together to fill the rings many times).
//!
//! The messages are written by hand with prost's derive and the service's routing by hand
//! with tonic's `Grpc` helpers, as the generated code would be, so the tests need no protoc.
#![cfg(feature = "tokio")]

mod common;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use common::pattern;
use futures_util::StreamExt;
use hyper_util::rt::TokioIo;
use lightpath::tokio::{Listener, Stream};
use lightpath::{Options, ProviderId};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::http;
use tonic::server::{Grpc, NamedService, ServerStreamingService, UnaryService};
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

const LIMIT: Duration = Duration::from_secs(60);
const SERVICE: &str = "lightpath.test.Check";

/// A blob, and for the streaming call how many copies to send back (or which copy this is).
#[derive(Clone, PartialEq, prost::Message)]
struct Blob {
    #[prost(bytes = "vec", tag = "1")]
    data: Vec<u8>,
    #[prost(uint32, tag = "2")]
    count: u32,
}

/// A blob's length and CRC-32.
#[derive(Clone, PartialEq, prost::Message)]
struct Digest {
    #[prost(uint64, tag = "1")]
    len: u64,
    #[prost(uint32, tag = "2")]
    crc: u32,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Copies = Pin<Box<dyn futures_util::Stream<Item = Result<Blob, Status>> + Send>>;

struct DigestMethod;

impl UnaryService<Blob> for DigestMethod {
    type Response = Digest;
    type Future = BoxFuture<Result<Response<Digest>, Status>>;

    fn call(&mut self, request: Request<Blob>) -> Self::Future {
        let data = request.into_inner().data;
        Box::pin(
            async move { Ok(Response::new(Digest { len: data.len() as u64, crc: crc32fast::hash(&data) })) },
        )
    }
}

struct CopiesMethod;

impl ServerStreamingService<Blob> for CopiesMethod {
    type Response = Blob;
    type ResponseStream = Copies;
    type Future = BoxFuture<Result<Response<Copies>, Status>>;

    fn call(&mut self, request: Request<Blob>) -> Self::Future {
        let Blob { data, count } = request.into_inner();
        let copies =
            futures_util::stream::iter((0..count).map(move |i| Ok(Blob { data: data.clone(), count: i })));
        Box::pin(async move { Ok(Response::new(Box::pin(copies) as Copies)) })
    }
}

/// The service, routed by hand as tonic's generated servers do.
#[derive(Clone)]
struct Check;

impl NamedService for Check {
    const NAME: &'static str = SERVICE;
}

impl tower::Service<http::Request<tonic::body::Body>> for Check {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        match request.uri().path().strip_prefix(&format!("/{SERVICE}/")) {
            Some("Digest") => Box::pin(async move {
                Ok(Grpc::new(ProstCodec::<Digest, Blob>::default()).unary(DigestMethod, request).await)
            }),
            Some("Copies") => Box::pin(async move {
                Ok(Grpc::new(ProstCodec::<Blob, Blob>::default())
                    .server_streaming(CopiesMethod, request)
                    .await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// A Lightpath stream as tonic's server wants its connections (`Connected`).
struct Conn(Stream);

impl Connected for Conn {
    type ConnectInfo = Option<std::net::SocketAddr>;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.peer_addr().ok()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

async fn unary_and_streaming(options: Options) {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let next = listener.accept().await.map(|(stream, _)| Conn(stream));
        Some((next, listener))
    });
    let server = tokio::spawn(tonic::transport::Server::builder().serve_with_incoming(Check, incoming));

    let connector = tower::service_fn(move |_: http::Uri| {
        let options = options.clone();
        async move { Stream::connect_with(addr, &options).await.map(TokioIo::new) }
    });
    let channel = tonic::transport::Endpoint::from_static("http://lightpath.test")
        .connect_with_connector(connector)
        .await
        .unwrap();
    let mut client = tonic::client::Grpc::new(channel);

    for (i, size) in [0usize, 1, 100, 64 << 10, 1 << 20].into_iter().enumerate() {
        let data = pattern(size, i as u32);
        client.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static("/lightpath.test.Check/Digest");
        let digest: Digest = client
            .unary(Request::new(Blob { data: data.clone(), count: 0 }), path, ProstCodec::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(digest, Digest { len: size as u64, crc: crc32fast::hash(&data) });
    }

    let data = pattern(100_000, 42);
    client.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/lightpath.test.Check/Copies");
    let mut copies = client
        .server_streaming(
            Request::new(Blob { data: data.clone(), count: 40 }),
            path,
            ProstCodec::<Blob, Blob>::default(),
        )
        .await
        .unwrap()
        .into_inner();
    let mut seen = 0;
    while let Some(copy) = copies.next().await {
        let copy = copy.unwrap();
        assert_eq!(copy.count, seen, "copies in order");
        assert!(copy.data == data, "copy {seen} differs");
        seen += 1;
    }
    assert_eq!(seen, 40);

    client.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/lightpath.test.Check/Nothing");
    let refused = client
        .unary::<_, Digest, _>(Request::new(Blob::default()), path, ProstCodec::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unimplemented);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_shm() {
    tokio::time::timeout(LIMIT, unary_and_streaming(Options::default().with_providers(&[ProviderId::Shm])))
        .await
        .expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_soft() {
    tokio::time::timeout(LIMIT, unary_and_streaming(Options::default().with_providers(&[ProviderId::Soft])))
        .await
        .expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tcp() {
    tokio::time::timeout(LIMIT, unary_and_streaming(Options::tcp_only())).await.expect("timed out");
}
