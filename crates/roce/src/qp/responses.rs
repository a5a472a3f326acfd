//! Turning the responder's output queue into packets: ACKNOWLEDGE, ATOMIC ACKNOWLEDGE and
//! READ responses, the latter read from registered memory straight into the datagram buffer
//! one PMTU at a time.
//!
//! In ERR the queue holds only what a responder error kept — the responses owed to the
//! requests executed before the failing one, then its NAK — and those still go out; every
//! other way into ERR empties the queue.

use lightpath_verbs::AccessFlags;
use lightpath_wire::{AethRepr, AtomicAckEthRepr, Opcode, Position, Syndrome};

use super::packet::{header, read_response_opcode};
use super::response_queue::ResponseItem;
use super::Qp;
use crate::event::Ctx;

impl Qp {
    /// Writes the next responder packet into `buf`, if any is queued.
    pub(crate) fn produce_response(&mut self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Option<usize> {
        let dest_qpn = self.params.dest_qpn;
        let pmtu = u64::from(self.params.pmtu);
        loop {
            let item = *self.resp.output.front_mut()?;
            match item {
                ResponseItem::Ack { psn, syndrome, msn } => {
                    let mut h = header(Opcode::RC_ACKNOWLEDGE, dest_qpn, psn, false, false);
                    h.aeth = Some(AethRepr { syndrome, msn });
                    h.emit(0, buf).ok()?;
                    self.resp.output.pop();
                    match syndrome {
                        Syndrome::Ack { .. } => ctx.stats.acks_sent += 1,
                        Syndrome::RnrNak { .. } => {
                            ctx.stats.rnr_naks_sent += 1;
                            self.stats.rnr_naks_sent += 1;
                            tracing::debug!(
                                qpn = self.qpn,
                                psn = psn.value(),
                                "RNR NAK sent: no receive posted"
                            );
                        }
                        Syndrome::Nak(code) => {
                            ctx.stats.naks_sent += 1;
                            self.stats.naks_sent += 1;
                            tracing::debug!(qpn = self.qpn, psn = psn.value(), code = ?code, "NAK sent");
                        }
                    }
                    return Some(h.datagram_len(0));
                }
                ResponseItem::AtomicAck { psn, orig, msn } => {
                    let mut h = header(Opcode::RC_ATOMIC_ACKNOWLEDGE, dest_qpn, psn, false, false);
                    h.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn });
                    h.atomic_ack = Some(AtomicAckEthRepr { orig });
                    h.emit(0, buf).ok()?;
                    self.resp.output.pop();
                    return Some(h.datagram_len(0));
                }
                ResponseItem::ReadData { psn, va, rkey, remaining, first } => {
                    let len = remaining.min(pmtu);
                    let last = len == remaining;
                    let position = match (first, last) {
                        (true, true) => Position::Only,
                        (true, false) => Position::First,
                        (false, true) => Position::Last,
                        (false, false) => Position::Middle,
                    };
                    let memory = if len > 0 {
                        match ctx.mrs.remote(rkey, va, len, AccessFlags::REMOTE_READ) {
                            Ok(found) => Some(found),
                            Err(_) => {
                                // Deregistered or invalidated while the response streamed:
                                // abandon it; the requester's retry gets a NAK.
                                self.resp.output.pop();
                                continue;
                            }
                        }
                    } else {
                        None
                    };
                    let mut h = header(read_response_opcode(position), dest_qpn, psn, false, false);
                    if position != Position::Middle {
                        h.aeth = Some(AethRepr { syndrome: Syndrome::ACK_UNLIMITED, msn: self.resp.msn });
                    }
                    let header_len = h.emit(len as usize, buf).ok()?;
                    if let Some((memory, offset)) = memory {
                        memory.read(offset, &mut buf[header_len..header_len + len as usize]);
                    }
                    if last {
                        self.resp.output.pop();
                    } else if let Some(ResponseItem::ReadData { psn, va, remaining, first, .. }) =
                        self.resp.output.front_mut()
                    {
                        *psn = psn.add(1);
                        *va += len;
                        *remaining -= len;
                        *first = false;
                    }
                    return Some(h.datagram_len(len as usize));
                }
            }
        }
    }
}
