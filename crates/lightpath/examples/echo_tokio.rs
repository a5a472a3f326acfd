//! The echo server and client on tokio (feature `tokio`).
//!
//! ```text
//! cargo run -p lightpath --features tokio --example echo_tokio -- server 127.0.0.1:7001
//! cargo run -p lightpath --features tokio --example echo_tokio -- client 127.0.0.1:7001 "hi"
//! ```

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("server"), Some(addr)) => {
            let listener = lightpath::tokio::Listener::bind(addr.as_str()).await?;
            eprintln!("echo server on {}", listener.local_addr()?);
            loop {
                let (stream, peer) = listener.accept().await?;
                eprintln!("{peer} connected over {}", stream.transport());
                tokio::spawn(async move {
                    let (mut reader, mut writer) = tokio::io::split(stream);
                    let _ = tokio::io::copy(&mut reader, &mut writer).await;
                    let _ = writer.shutdown().await;
                });
            }
        }
        (Some("client"), Some(addr)) => {
            let text = args.get(3).cloned().unwrap_or_else(|| "hello, lightpath".into());
            let mut stream = lightpath::tokio::Stream::connect(addr.as_str()).await?;
            stream.write_all(text.as_bytes()).await?;
            stream.shutdown().await?;
            let mut echo = String::new();
            stream.read_to_string(&mut echo).await?;
            println!("{echo} (over {})", stream.transport());
            Ok(())
        }
        _ => {
            eprintln!("usage: echo_tokio server ADDR | echo_tokio client ADDR [TEXT]");
            std::process::exit(2);
        }
    }
}
