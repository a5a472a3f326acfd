//! Connect/close cycles (issue 15: "nothing leaks over 100,000 connect/close cycles"): one
//! process runs a listener and a client; the client connects, sends 64 bytes, reads the echo
//! and closes, over and over, and the process's resident memory and open descriptors are
//! reported as it goes. A leak per connection shows as growth between the report after the
//! warm-up and the last one (the first connections open the device, its threads and pools),
//! both taken once closes have settled. Exits with an error if descriptors grew.
//!
//!   cargo run --release --example cycles -- shm 100000
//!   cargo run --release --example cycles -- soft 100000 --json
//!
//! Providers: shm, soft, tcp (Lightpath's TCP fallback: RDMA disabled on both sides).

use std::io::{Read, Write};
use std::time::Instant;

use lightpath::{Listener, Options, ProviderId, Stream};

/// Resident set in KiB and open descriptors of this process.
fn usage() -> (u64, usize) {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    (pages * 4, fds)
}

/// [`usage`] once closes have settled: a dropped stream finishes its clean close on
/// Lightpath's background thread, so descriptors of the last connections go away shortly after
/// the drop. Waits until the descriptor count has not fallen for 300 ms (at most 10 s).
fn settled_usage() -> (u64, usize) {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let mut last = usage();
    let mut steady_since = Instant::now();
    while Instant::now() < deadline && steady_since.elapsed() < std::time::Duration::from_millis(300) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let now = usage();
        if now.1 < last.1 {
            steady_since = Instant::now();
        }
        last = now;
    }
    last
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = args.first().map(String::as_str).unwrap_or("shm");
    let count: usize = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(10_000);
    let json = args.iter().any(|a| a == "--json");
    let options = match provider {
        "shm" => Options::default().with_providers(&[ProviderId::Shm]),
        "soft" => Options::default().with_providers(&[ProviderId::Soft]),
        "tcp" => Options::default().with_providers(&[]),
        other => return Err(std::io::Error::other(format!("unknown provider {other} (shm, soft, tcp)"))),
    };
    let listener = Listener::bind_with("127.0.0.1:0", options.clone())?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        for _ in 0..count {
            let (mut stream, _) = listener.accept()?;
            let mut buf = [0u8; 64];
            stream.read_exact(&mut buf)?;
            stream.write_all(&buf)?;
            // The client closes first; its EOF ends this connection.
            let mut rest = [0u8; 1];
            let _ = stream.read(&mut rest)?;
        }
        Ok(())
    });
    let warm_up = (count / 10).clamp(1, 1000);
    let mut reports = Vec::new();
    let started = Instant::now();
    let mut transport = None;
    for i in 1..=count {
        let mut stream = Stream::connect_with(addr, &options)?;
        transport.get_or_insert(stream.transport());
        let message = [i as u8; 64];
        stream.write_all(&message)?;
        let mut back = [0u8; 64];
        stream.read_exact(&mut back)?;
        if back != message {
            return Err(std::io::Error::other(format!("cycle {i}: the echo differs")));
        }
        drop(stream);
        if i == warm_up || i % (count / 10).max(1) == 0 || i == count {
            let (rss_kib, fds) = if i == warm_up || i == count { settled_usage() } else { usage() };
            let rate = i as f64 / started.elapsed().as_secs_f64();
            reports.push((i, rss_kib, fds, rate));
            if !json {
                eprintln!(
                    "{provider}: {i:>7} cycles  rss {rss_kib:>8} KiB  fds {fds:>5}  {rate:>8.0} cycles/s"
                );
            }
        }
    }
    server.join().map_err(|_| std::io::Error::other("the server thread panicked"))??;
    let &(_, rss0, fds0, _) = reports.iter().find(|r| r.0 == warm_up).expect("a warm-up report");
    let &(_, rss1, fds1, rate) = reports.last().expect("a last report");
    let per_kcycle = |a: u64, b: u64| (b as f64 - a as f64) / ((count - warm_up).max(1) as f64 / 1000.0);
    if json {
        println!(
            "{{\"provider\":\"{provider}\",\"transport\":\"{}\",\"cycles\":{count},\"warm_up\":{warm_up},\"rss_kib\":[{rss0},{rss1}],\"fds\":[{fds0},{fds1}],\"rss_kib_per_1000_cycles\":{:.1},\"cycles_per_s\":{rate:.0}}}",
            transport.map(|t| t.to_string()).unwrap_or_default(),
            per_kcycle(rss0, rss1)
        );
    } else {
        eprintln!(
            "{provider}: after warm-up ({warm_up}) rss {rss0} KiB, fds {fds0}; after {count}: rss {rss1} KiB ({:+.1} KiB per 1000 cycles), fds {fds1}",
            per_kcycle(rss0, rss1)
        );
    }
    if fds1 > fds0 {
        return Err(std::io::Error::other(format!("descriptors grew from {fds0} to {fds1}")));
    }
    Ok(())
}
