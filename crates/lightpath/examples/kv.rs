//! A tiny key-value service, written for `std::net` and moved to Lightpath by changing the
//! two `use` lines below — nothing else. (With `TcpListener`/`TcpStream` from `std::net` it
//! compiles and runs unchanged.)
//!
//! Protocol: one command per line, `SET key value` → `OK`, `GET key` → the value or `NONE`.
//!
//! ```text
//! cargo run -p lightpath --example kv -- server 127.0.0.1:7002
//! cargo run -p lightpath --example kv -- client 127.0.0.1:7002 "SET a 1" "GET a"
//! ```

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::sync::{Arc, Mutex};

// Before: use std::net::{TcpListener, TcpStream};
use lightpath::{Listener as TcpListener, Stream as TcpStream};

fn serve(stream: TcpStream, store: Arc<Mutex<HashMap<String, String>>>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    while reader.read_line(&mut line)? > 0 {
        let mut words = line.trim_end().splitn(3, ' ');
        let reply = match (words.next(), words.next(), words.next()) {
            (Some("SET"), Some(key), Some(value)) => {
                store.lock().unwrap().insert(key.to_string(), value.to_string());
                "OK".to_string()
            }
            (Some("GET"), Some(key), None) => {
                store.lock().unwrap().get(key).cloned().unwrap_or("NONE".into())
            }
            _ => "ERR".to_string(),
        };
        let stream = reader.get_mut();
        stream.write_all(reply.as_bytes())?;
        stream.write_all(b"\n")?;
        line.clear();
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("server"), Some(addr)) => {
            let listener = TcpListener::bind(addr.as_str())?;
            let store = Arc::new(Mutex::new(HashMap::new()));
            loop {
                let (stream, _) = listener.accept()?;
                let store = Arc::clone(&store);
                std::thread::spawn(move || serve(stream, store));
            }
        }
        (Some("client"), Some(addr)) => {
            let mut reader = BufReader::new(TcpStream::connect(addr.as_str())?);
            for command in &args[3..] {
                reader.get_mut().write_all(format!("{command}\n").as_bytes())?;
                let mut reply = String::new();
                reader.read_line(&mut reply)?;
                println!("{command} -> {}", reply.trim_end());
            }
            Ok(())
        }
        _ => {
            eprintln!("usage: kv server ADDR | kv client ADDR COMMAND...");
            std::process::exit(2);
        }
    }
}
