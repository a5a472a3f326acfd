//! `lightpath perf stream_lat|stream_bw --zero-copy`: the same tests with registered buffers on
//! both sides (`Stream::write_buf` from one, `Stream::read_buf` into one), so that sizes from
//! the rendezvous threshold up travel by RDMA READ from buffer to buffer. Each `write_buf`
//! returns once its buffer may be reused, so the bandwidth test measures that contract too.

use std::io::{Read, Write};
use std::time::Instant;

use anyhow::{ensure, Result};
use lightpath::{RegisteredBuf, Stream};

use super::{stamp, warmup, BandwidthSummary, LatencySummary, Plan, StreamArgs, StreamResult, StreamTest};

/// `read_buf` until `len` bytes are in `buf`.
fn read_buf_exact(stream: &mut Stream, buf: &RegisteredBuf, len: usize) -> Result<()> {
    let mut done = 0;
    while done < len {
        let n = stream.read_buf(buf, done, len - done)?;
        ensure!(n > 0, "the peer closed after {done} of {len} bytes");
        done += n;
    }
    Ok(())
}

fn stamped(size: usize, index: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; size];
    stamp(&mut bytes, index);
    bytes
}

/// Serves one connection's plan with registered buffers.
pub(super) fn serve(mut stream: Stream, plan: &Plan) -> Result<()> {
    for &(size, iters) in &plan.sizes {
        let buf = stream.register_buf(size)?;
        match plan.test {
            StreamTest::Lat | StreamTest::Rr => {
                for _ in 0..iters + warmup(iters) {
                    read_buf_exact(&mut stream, &buf, size)?;
                    stream.write_buf(&buf, 0, size)?;
                }
            }
            StreamTest::Bw => {
                for _ in 0..iters {
                    read_buf_exact(&mut stream, &buf, size)?;
                }
                let crc = buf.with_bytes(crc32fast::hash);
                stream.write_all(&crc.to_be_bytes())?;
            }
        }
    }
    Ok(())
}

/// The client side of a zero-copy run.
pub(super) fn client(
    args: &StreamArgs,
    stream: &mut Stream,
    transport: &str,
    sizes: &[(usize, u64)],
) -> Result<Vec<StreamResult>> {
    let mut results = Vec::new();
    for &(size, iters) in sizes {
        let send = stream.register_buf(size)?;
        let back = stream.register_buf(size)?;
        let result = |lat_us, bw_mb_s, msg_rate_mpps| StreamResult {
            test: args.test.name(),
            provider: format!("{} (zero-copy)", args.provider),
            transport: transport.to_string(),
            size,
            iters,
            conns: 1,
            server: "threads",
            polling: args.polling,
            lat_us,
            bw_mb_s,
            msg_rate_mpps,
            verified: true,
            cpu: None,
            setup_per_s: None,
        };
        match args.test {
            StreamTest::Lat | StreamTest::Rr => {
                let mut samples = Vec::with_capacity(iters as usize);
                let mut echoed = vec![0u8; size];
                for i in 0..iters + warmup(iters) {
                    let data = stamped(size, i);
                    send.write(0, &data)?;
                    let started = Instant::now();
                    stream.write_buf(&send, 0, size)?;
                    read_buf_exact(stream, &back, size)?;
                    let elapsed = started.elapsed();
                    back.read(0, &mut echoed)?;
                    ensure!(echoed == data, "the echo of iteration {i} differs");
                    if i >= warmup(iters) {
                        samples.push(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
                    }
                }
                results.push(result(LatencySummary::from_nanos(&mut samples, 2), None, None));
            }
            StreamTest::Bw => {
                send.write(0, &stamped(size, 0))?;
                let started = Instant::now();
                let mut last = Vec::new();
                for i in 0..iters {
                    if i + 1 == iters {
                        last = stamped(size, i);
                        send.write(0, &last)?;
                    }
                    stream.write_buf(&send, 0, size)?;
                }
                let mut crc = [0u8; 4];
                stream.read_exact(&mut crc)?;
                let elapsed = started.elapsed();
                ensure!(u32::from_be_bytes(crc) == crc32fast::hash(&last), "the server's checksum differs");
                let bw = BandwidthSummary::new(size as u64 * iters, iters, elapsed);
                results.push(result(None, Some(bw.bw_mb_s), Some(bw.msg_rate_mpps)));
            }
        }
    }
    Ok(results)
}
