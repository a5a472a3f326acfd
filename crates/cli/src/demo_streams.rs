//! The stream part of `lightpath demo`: `lightpath::Stream`, the socket-like API, on loopback
//! with the default provider list (same host: shm), with soft only and with TCP only — each an
//! echo of 1 MiB checked by CRC-32. Both ends live in this one process, which says nothing
//! about speed (they share one device and two cores), so latency is left to `lightpath perf
//! stream_lat`, which runs them as two processes.

use std::io::{Read, Write};

use anyhow::{ensure, Context, Result};
use lightpath::{Listener, Options, ProviderId, Stream};

/// One configuration shown.
struct Case {
    name: &'static str,
    options: Options,
}

fn cases() -> Vec<Case> {
    // The stream's soft device takes a port of its own: the verbs measurements that follow
    // need the RoCE v2 port on 127.0.0.1.
    let defaults = Options {
        soft_udp_port: 0,
        ..Options::default().with_providers(&[ProviderId::Shm, ProviderId::Ibverbs, ProviderId::Soft])
    };
    let soft = Options { soft_udp_port: 0, ..Options::default().with_providers(&[ProviderId::Soft]) };
    vec![
        Case { name: "default providers", options: defaults },
        Case { name: "soft only", options: soft },
        Case { name: "TCP only", options: Options::tcp_only() },
    ]
}

/// Runs the stream cases.
pub fn run() -> Result<()> {
    for case in cases() {
        let (transport, detail) =
            echo_case(&case.options).with_context(|| format!("the stream demo ({}) failed", case.name))?;
        outln!("  [ok] {:<18} {:<44} {detail}", case.name, transport);
    }
    outln!(
        "\n  Their speed, as two processes: `lightpath perf stream_lat|stream_bw --provider shm|soft|tcp`."
    );
    Ok(())
}

/// Echoes 1 MiB; returns the transport and a summary.
fn echo_case(options: &Options) -> Result<(String, String)> {
    let listener = Listener::bind_with("127.0.0.1:0", options.clone())?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = listener.accept()?;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            stream.write_all(&buf[..n])?;
        }
    });
    let mut stream = Stream::connect_with(addr, options)?;
    let transport = stream.transport().to_string();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let mut back = vec![0u8; data.len()];
    for (chunk, into) in data.chunks(64 << 10).zip(back.chunks_mut(64 << 10)) {
        stream.write_all(chunk)?;
        stream.read_exact(into)?;
    }
    let (sent, echoed) = (crc32fast::hash(&data), crc32fast::hash(&back));
    ensure!(sent == echoed, "the echo differs: CRC-32 {echoed:08x}, sent {sent:08x}");
    let detail = format!("1 MiB echoed, CRC-32 {sent:08x} matches");
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest)?;
    server.join().map_err(|_| anyhow::anyhow!("the echo server panicked"))??;
    Ok((transport, detail))
}
