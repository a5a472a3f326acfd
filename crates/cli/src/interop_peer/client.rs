//! The client: the requester. It connects, exchanges endpoint lines, runs the operation ITERS
//! times (ITERS + 1 for `cmp_swap`), one at a time, checking each completion and what came
//! back, then reports its verdict (`DONE`) and reads the server's (`RESULT`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lightpath_verbs::{Device, MemoryRegion, SendOp, SendWr, WcStatus};

use super::known::{self, POISON_BYTE};
use super::line::{EndpointLine, LineStream};
use super::op::Op;
use super::peer::Peer;
use super::{check_agreement, Config, Report};
use crate::pingpong::endpoint::random_psn;
use crate::pingpong::source::DeviceSource;
use crate::pingpong::tcp;

/// Longest single wait for a completion before the deadline is checked again.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Runs the client; `Ok(true)` if both sides passed.
pub fn run<S: DeviceSource>(config: &Config, source: &S, report: &mut Report) -> Result<bool> {
    let server = config.server.as_deref().unwrap_or_default();
    let stream = tcp::connect(server, config.tcp_port, Instant::now() + config.timeout)?;
    let device = source.for_client(&stream)?;
    let description = source.describe(&device);
    let peer = Peer::new(device, config.shape, config.port_num)?;
    let local = peer.endpoint(random_psn(), config.mtu);
    let shape = config.shape;
    report.say(format_args!(
        "op={} size={} iters={} gid_index={} server={server} ({description})",
        shape.op,
        shape.size,
        shape.iters,
        peer.qp_endpoint().gid_index
    ));

    let mut lines = LineStream::new(stream);
    let ours = local.format();
    report.verbose(format_args!("-> {}", ours.trim_end()));
    lines.send(&ours)?;
    let line = lines.read_line(Instant::now() + config.timeout).context("bad or missing server line")?;
    let line = line.context("bad or missing server line: \"\" (timed out)")?;
    report.verbose(format_args!("<- {line}"));
    let remote =
        EndpointLine::parse(&line).with_context(|| format!("bad or missing server line: \"{line}\""))?;
    check_agreement(&shape, &remote)?;
    let path_mtu = peer.connect(&local, &remote, config.retry_cnt)?;
    report.say(format_args!(
        "connected: path MTU {path_mtu}, local QPN 0x{:06x} PSN 0x{:06x}, remote QPN 0x{:06x} PSN 0x{:06x}",
        local.qpn, local.psn, remote.qpn, remote.psn
    ));

    let start = Instant::now();
    let deadline = start + config.timeout;
    // cmp_swap runs one extra operation whose compare must fail.
    let total = if shape.op == Op::CmpSwap { shape.iters + 1 } else { shape.iters };
    for k in 0..total {
        if report.failures() > 0 {
            break;
        }
        run_one(&peer, &remote, k, deadline, config.inject_fault, report)?;
    }
    let seconds = start.elapsed().as_secs_f64();

    let done = format!("DONE {}\n", if report.failures() > 0 { "FAIL" } else { "PASS" });
    report.verbose(format_args!("-> {}", done.trim_end()));
    lines.send(&done)?;
    let result = lines.read_line(Instant::now() + config.timeout);
    if let Ok(Some(line)) = &result {
        report.verbose(format_args!("<- {line}"));
    }
    let server_pass = match result {
        Ok(Some(line)) if line == "RESULT PASS" => true,
        Ok(Some(line)) => {
            report.say(format_args!("FAIL: server says \"{line}\""));
            false
        }
        Ok(None) | Err(_) => {
            report.say("FAIL: no RESULT line from the server");
            false
        }
    };
    let pass = report.failures() == 0 && server_pass;
    outln!(
        "{} lightpath interop-peer client op={} size={} iters={} mtu={} time={seconds:.3}s (own checks: {} failures)",
        if pass { "PASS" } else { "FAIL" },
        shape.op,
        shape.size,
        shape.iters,
        config.mtu,
        report.failures()
    );
    Ok(pass)
}

/// Posts iteration `k`, waits for its completion and checks it.
fn run_one<D: Device>(
    peer: &Peer<D>,
    remote: &EndpointLine,
    k: u32,
    deadline: Instant,
    inject_fault: bool,
    report: &mut Report,
) -> Result<()> {
    let shape = peer.shape;
    let (op, size) = (shape.op, shape.size as usize);
    let slot = shape.slot(k);
    let mr = peer.mr();
    let remote_addr = remote.addr.wrapping_add(slot as u64);
    let rkey = remote.rkey;
    let seed = known::pattern_seed(op, k);
    let imm = known::imm_value(op, k);
    let mut expect_original = 0;
    if matches!(op, Op::Send | Op::SendImm | Op::Write | Op::WriteImm) {
        mr.write(slot, &known::pattern(seed, size))?;
    }
    let mut send_op = match op {
        Op::Send => SendOp::Send,
        Op::SendImm => SendOp::SendWithImm { imm },
        Op::Write => SendOp::Write { remote_addr, rkey },
        Op::WriteImm => SendOp::WriteWithImm { remote_addr, rkey, imm },
        Op::Read => SendOp::Read { remote_addr, rkey },
        Op::CmpSwap if k < shape.iters => {
            expect_original = known::cmp_swap_value(k);
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare: expect_original,
                swap: known::cmp_swap_value(k + 1),
            }
        }
        Op::CmpSwap => {
            // The extra operation: its compare fails and memory must stay unchanged.
            expect_original = known::cmp_swap_value(shape.iters);
            SendOp::CompareSwap { remote_addr, rkey, compare: !expect_original, swap: known::CMP_SWAP_DECOY }
        }
        Op::FetchAdd => {
            expect_original = known::fetch_add_before(k);
            SendOp::FetchAdd { remote_addr, rkey, add: known::fetch_add_addend(k) }
        }
    };
    if inject_fault && k == 0 {
        inject(&mut send_op, mr, slot + size / 2)?;
        report.say("injecting a fault into iteration 0 (-x)");
    }
    if op.is_atomic() {
        mr.write(slot, &[POISON_BYTE; 8])?;
    }
    let sge = [mr.sge(slot, size as u32)];
    peer.post_send(&SendWr::new(u64::from(k), send_op, &sge))
        .with_context(|| format!("ibv_post_send (iteration {k}) failed"))?;

    let wc = loop {
        if let Some(wc) = peer.next_completion(deadline, WAIT_SLICE)? {
            break wc;
        }
        if Instant::now() >= deadline {
            report.fail(format_args!("iteration {k}: no completion before the timeout"));
            return Ok(());
        }
    };
    if wc.status != WcStatus::Success {
        report.fail(format_args!(
            "iteration {k} completed with status {} (vendor error 0x{:x})",
            wc.status, wc.vendor_err
        ));
        return Ok(());
    }
    if wc.wr_id != u64::from(k) {
        report.fail(format_args!("iteration {k}: completion has wr_id {}", wc.wr_id));
    }
    if op == Op::Read {
        let mut got = vec![0u8; size];
        mr.read(slot, &mut got)?;
        if let Some(bad) = known::first_mismatch(&got, seed) {
            report.fail(format_args!(
                "READ {k}: data wrong at byte {bad} of {size} (got 0x{:02x}, want 0x{:02x})",
                got[bad],
                known::pattern_byte(seed, bad as u32)
            ));
        }
    }
    if op.is_atomic() {
        let original = mr.read_u64(slot)?;
        if original != expect_original {
            report.fail(format_args!(
                "{op} {k}: original value 0x{original:016x}, expected 0x{expect_original:016x}"
            ));
        }
    }
    Ok(())
}

/// The deliberate mistake of `-x`: a flipped payload byte (send), a wrong immediate
/// (send_imm, write_imm), a remote address off by one (write, read), a wrong compare
/// (cmp_swap) or a wrong addend (fetch_add).
fn inject<M: MemoryRegion>(send_op: &mut SendOp, mr: &M, flip_at: usize) -> Result<()> {
    match send_op {
        SendOp::Send => {
            let mut byte = [0u8; 1];
            mr.read(flip_at, &mut byte)?;
            mr.write(flip_at, &[byte[0] ^ 0x01])?;
        }
        SendOp::SendWithImm { imm } | SendOp::WriteWithImm { imm, .. } => *imm ^= 1,
        SendOp::Write { remote_addr, .. } | SendOp::Read { remote_addr, .. } => *remote_addr += 1,
        SendOp::CompareSwap { compare, .. } => *compare ^= 1,
        SendOp::FetchAdd { add, .. } => *add = add.wrapping_add(1),
        SendOp::SendWithInv { .. } => {}
    }
    Ok(())
}
