//! Talks to a TCPStore (c10d's or Lightpath's) from the command line, or serves one:
//!
//!   store_tool serve PORT                 serve until killed
//!   store_tool set HOST:PORT KEY VALUE
//!   store_tool get HOST:PORT KEY          waits up to 10 s for the key
//!   store_tool add HOST:PORT KEY N        prints the new value

use lightpath_collectives::store::{StoreClient, StoreServer};
use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: store_tool serve PORT | set ADDR KEY VALUE | get ADDR KEY | add ADDR KEY N";
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["serve", port] => {
            let server = StoreServer::bind(("127.0.0.1", port.parse::<u16>()?))?;
            println!("serving on {}", server.local_addr());
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        [cmd, addr, key, ref rest @ ..] => {
            let mut client = StoreClient::connect(addr.parse()?, Duration::from_secs(10))?;
            match (cmd, rest) {
                ("set", [value]) => client.set(key, value.as_bytes())?,
                ("get", []) => {
                    println!("{}", String::from_utf8_lossy(&client.get(key, Duration::from_secs(10))?))
                }
                ("add", [n]) => println!("{}", client.add(key, n.parse()?)?),
                _ => return Err(usage.into()),
            }
        }
        _ => return Err(usage.into()),
    }
    Ok(())
}
