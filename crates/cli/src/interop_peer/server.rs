//! The server: the responder. It prepares its memory (READ slots filled, atomic word set, the
//! rest poisoned) and its receives before the client can send, accepts one connection,
//! exchanges endpoint lines, then checks every receive completion while it waits for the
//! client's `DONE`, checks its memory, and answers `RESULT`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lightpath_verbs::{Device, MemoryRegion, WcOpcode, WcStatus, WorkCompletion};

use super::known;
use super::line::{EndpointLine, LineStream};
use super::op::Op;
use super::peer::{Peer, RECV_WINDOW};
use super::{check_agreement, Config, Report};
use crate::pingpong::endpoint::random_psn;
use crate::pingpong::source::DeviceSource;
use crate::pingpong::tcp;

/// Longest wait for a completion before the client's line is looked for again.
const WAIT_SLICE: Duration = Duration::from_millis(5);

/// The responder, ready before the client may send.
struct Prepared<D: Device> {
    peer: Peer<D>,
    local: EndpointLine,
    /// Receives posted so far (receive k is posted k-th).
    posted: u32,
}

fn prepare<D: Device>(
    config: &Config,
    device: D,
    description: String,
    report: &Report,
) -> Result<Prepared<D>> {
    let shape = config.shape;
    let peer = Peer::new(device, shape, config.port_num)?;
    let mr = peer.mr();
    match shape.op {
        Op::Read => {
            for k in 0..shape.iters {
                mr.write(
                    shape.slot(k),
                    &known::pattern(known::pattern_seed(shape.op, k), shape.size as usize),
                )?;
            }
        }
        Op::CmpSwap => mr.write_u64(0, known::CMP_SWAP_INITIAL)?,
        Op::FetchAdd => mr.write_u64(0, known::FETCH_ADD_INITIAL)?,
        _ => {}
    }
    let mut posted = 0;
    if shape.op.uses_recv() {
        while posted < shape.iters && posted < RECV_WINDOW {
            peer.post_recv_slot(posted)?;
            posted += 1;
        }
    }
    let local = peer.endpoint(random_psn(), config.mtu);
    report.say(format_args!(
        "op={} size={} iters={} gid_index={} ({description})",
        shape.op,
        shape.size,
        shape.iters,
        peer.qp_endpoint().gid_index
    ));
    Ok(Prepared { peer, local, posted })
}

/// Runs the server; `Ok(true)` if both sides passed.
pub fn run<S: DeviceSource>(config: &Config, source: &S, report: &mut Report) -> Result<bool> {
    let accept_deadline = Instant::now() + config.timeout;
    let listen = |report: &Report| -> Result<std::net::TcpListener> {
        let listener = tcp::listen_any(config.tcp_port)?;
        report.say(format_args!("listening on TCP port {}", config.tcp_port));
        Ok(listener)
    };
    // With a known place (--bind, or an ibverbs device) everything is ready before the client
    // can connect, in the protocol's order; otherwise the soft device's address is the one the
    // client reaches us at.
    let (mut prepared, stream) = match source.before_accept()? {
        Some(device) => {
            let description = source.describe(&device);
            let prepared = prepare(config, device, description, report)?;
            let stream = tcp::accept_one(&listen(report)?, accept_deadline)?;
            (prepared, stream)
        }
        None => {
            let stream = tcp::accept_one(&listen(report)?, accept_deadline)?;
            let device = source.for_server(&stream)?;
            let description = source.describe(&device);
            (prepare(config, device, description, report)?, stream)
        }
    };
    let shape = config.shape;
    let mut lines = LineStream::new(stream);
    let line = lines.read_line(Instant::now() + config.timeout).context("bad or missing client line")?;
    let line = line.context("bad or missing client line: \"\" (timed out)")?;
    report.verbose(format_args!("<- {line}"));
    let remote =
        EndpointLine::parse(&line).with_context(|| format!("bad or missing client line: \"{line}\""))?;
    check_agreement(&shape, &remote)?;
    let path_mtu = prepared.peer.connect(&prepared.local, &remote, config.retry_cnt)?;
    report.say(format_args!(
        "connected: path MTU {path_mtu}, local QPN 0x{:06x} PSN 0x{:06x}, remote QPN 0x{:06x} PSN 0x{:06x}",
        prepared.local.qpn, prepared.local.psn, remote.qpn, remote.psn
    ));
    let ours = prepared.local.format();
    report.verbose(format_args!("-> {}", ours.trim_end()));
    lines.send(&ours)?;

    // Serve receives while waiting for the client's DONE line.
    let expected = if shape.op.uses_recv() { shape.iters } else { 0 };
    let deadline = Instant::now() + config.timeout;
    let (mut done, mut client_pass, mut received) = (false, false, 0u32);
    while !done || received < expected {
        if let Some(wc) = prepared.peer.next_completion(deadline, WAIT_SLICE)? {
            if received >= expected {
                report
                    .fail(format_args!("unexpected completion: opcode {:?} status {}", wc.opcode, wc.status));
            } else {
                check_recv(&prepared.peer, &wc, received, report)?;
                received += 1;
                if prepared.posted < shape.iters {
                    prepared.peer.post_recv_slot(prepared.posted)?;
                    prepared.posted += 1;
                }
            }
            continue;
        }
        if !done {
            if let Some(line) = lines.poll_line().context("connection to the client lost before DONE")? {
                report.verbose(format_args!("<- {line}"));
                let Some(verdict) = line.strip_prefix("DONE ") else {
                    bail!("expected DONE, got \"{line}\"");
                };
                done = true;
                client_pass = verdict == "PASS";
            }
        }
        if Instant::now() > deadline {
            report.fail(format_args!(
                "timeout: {received} of {expected} receives completed, DONE {}",
                if done { "received" } else { "not received" }
            ));
            break;
        }
    }

    check_memory(&prepared.peer, report)?;
    let result = format!("RESULT {}\n", if report.failures() > 0 { "FAIL" } else { "PASS" });
    if done {
        report.verbose(format_args!("-> {}", result.trim_end()));
        lines.send(&result)?;
    }
    drop(lines);
    if !client_pass {
        report.say("the client reported FAIL (or never reported)");
    }
    let pass = report.failures() == 0 && client_pass;
    outln!(
        "{} lightpath interop-peer server op={} size={} iters={} mtu={} (own checks: {} failures)",
        if pass { "PASS" } else { "FAIL" },
        shape.op,
        shape.size,
        shape.iters,
        config.mtu,
        report.failures()
    );
    Ok(pass)
}

/// Checks the receive completion of iteration `k`.
fn check_recv<D: Device>(peer: &Peer<D>, wc: &WorkCompletion, k: u32, report: &mut Report) -> Result<()> {
    let shape = peer.shape;
    let op = shape.op;
    if wc.status != WcStatus::Success {
        report.fail(format_args!("receive {k} completed with status {}", wc.status));
        return Ok(());
    }
    if wc.wr_id != u64::from(k) {
        report.fail(format_args!("receive completion {k} has wr_id {} (out of order)", wc.wr_id));
    }
    let want = if op == Op::WriteImm { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
    if wc.opcode != want {
        report.fail(format_args!("receive {k}: opcode {:?}, expected {want:?}", wc.opcode));
    }
    if u64::from(wc.byte_len) != shape.size {
        report.fail(format_args!("receive {k}: byte_len {}, expected {}", wc.byte_len, shape.size));
    }
    match (op.has_imm(), wc.imm_data) {
        (true, None) => report.fail(format_args!("receive {k}: no immediate data")),
        (true, Some(imm)) if imm != known::imm_value(op, k) => report.fail(format_args!(
            "receive {k}: immediate 0x{imm:08x}, expected 0x{:08x}",
            known::imm_value(op, k)
        )),
        (false, Some(_)) => report.fail(format_args!("receive {k}: unexpected immediate data")),
        _ => {}
    }
    // For SEND the data is in the receive buffer; for WRITE with immediate it was written to
    // slot k before the immediate's completion: either way slot k must hold pattern k now.
    if let Some(bad) = slot_mismatch(peer, k)? {
        report.fail(format_args!("iteration {k}: data wrong at byte {bad} of {}", shape.size));
    }
    Ok(())
}

/// The first byte of slot `k` that differs from its pattern.
fn slot_mismatch<D: Device>(peer: &Peer<D>, k: u32) -> Result<Option<usize>> {
    let shape = peer.shape;
    let mut bytes = vec![0u8; shape.size as usize];
    peer.mr().read(shape.slot(k), &mut bytes)?;
    Ok(known::first_mismatch(&bytes, known::pattern_seed(shape.op, k)))
}

/// The final state of the responder's memory.
fn check_memory<D: Device>(peer: &Peer<D>, report: &mut Report) -> Result<()> {
    let shape = peer.shape;
    match shape.op {
        Op::Write | Op::WriteImm => {
            for k in 0..shape.iters {
                if let Some(bad) = slot_mismatch(peer, k)? {
                    report.fail(format_args!("slot {k} written wrongly: byte {bad} of {}", shape.size));
                }
            }
        }
        Op::Read => {
            for k in 0..shape.iters {
                if slot_mismatch(peer, k)?.is_some() {
                    report.fail(format_args!("slot {k} changed by READs"));
                }
            }
        }
        Op::CmpSwap => {
            let (value, want) = (peer.mr().read_u64(0)?, known::cmp_swap_value(shape.iters));
            if value != want {
                report.fail(format_args!("final cmp_swap word 0x{value:016x}, expected 0x{want:016x}"));
            }
        }
        Op::FetchAdd => {
            let (value, want) = (peer.mr().read_u64(0)?, known::fetch_add_before(shape.iters));
            if value != want {
                report.fail(format_args!("final fetch_add word 0x{value:016x}, expected 0x{want:016x}"));
            }
        }
        Op::Send | Op::SendImm => {}
    }
    Ok(())
}
