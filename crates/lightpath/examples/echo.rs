//! Blocking echo server and client.
//!
//! ```text
//! cargo run -p lightpath --example echo -- server 127.0.0.1:7000
//! cargo run -p lightpath --example echo -- client 127.0.0.1:7000 "hello"
//! ```

use std::io::{Read, Write};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("server"), Some(addr)) => {
            let listener = lightpath::Listener::bind(addr.as_str())?;
            eprintln!("echo server on {}", listener.local_addr()?);
            loop {
                let (mut stream, peer) = listener.accept()?;
                std::thread::spawn(move || {
                    eprintln!("{peer} connected over {}", stream.transport());
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 || stream.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        }
        (Some("client"), Some(addr)) => {
            let text = args.get(3).cloned().unwrap_or_else(|| "hello, lightpath".into());
            let mut stream = lightpath::Stream::connect(addr.as_str())?;
            stream.write_all(text.as_bytes())?;
            stream.shutdown(std::net::Shutdown::Write)?;
            let mut echo = String::new();
            stream.read_to_string(&mut echo)?;
            println!("{echo} (over {})", stream.transport());
            Ok(())
        }
        _ => {
            eprintln!("usage: echo server ADDR | echo client ADDR [TEXT]");
            std::process::exit(2);
        }
    }
}
