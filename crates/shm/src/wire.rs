//! The few messages shm devices exchange over their Unix sockets (everything else moves through
//! shared memory): a queue pair introducing itself to its peer's device, a queue pair leaving
//! its peer (or refusing an introduction), and a question about a memory region with its
//! answer.
//!
//! Version 4: one connection carries the messages of every queue pair of one device towards
//! another device (a *link*, see `engine/link.rs`), so a queue pair that goes says
//! so (`Goodbye`) instead of closing a connection of its own.
//!
//! Version 5: an introduction says whether the queue pair's waiter is a task (see
//! `crate::activity`), and carries its device's descriptors (doorbell, activity area, task
//! doorbell) only when it is the first on its link: later ones on the same link refer to them.
//! Three descriptors fewer to pass, check and close per connection and side.
//!
//! Every message starts with the 4-byte magic `LPSM`, a version byte and a kind byte; fields
//! are little-endian at fixed offsets. Decoding checks the exact length of each kind and
//! returns `None` for anything else, so a socket peer that is not a Lightpath shm device (or a
//! broken one) is recognised and dropped.

use lightpath_verbs::Gid;

const MAGIC: [u8; 4] = *b"LPSM";
const VERSION: u8 = 5;
/// Largest encoded message.
pub(crate) const MAX_MESSAGE: usize = 64;

const KIND_HELLO: u8 = 1;
const KIND_REGION_QUERY: u8 = 2;
const KIND_REGION_REPLY: u8 = 3;
const KIND_PING: u8 = 4;
const KIND_PONG: u8 = 5;
const KIND_GOODBYE: u8 = 6;

/// A region handed over with an introduction: what a region question's answer says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RegionOffer {
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: u32,
}

/// `Hello` flags: which optional descriptors follow the four fixed ones, and how the queue
/// pair's waiter is told of news.
const HELLO_WAITER: u32 = 1;
const HELLO_REGION: u32 = 2;
const HELLO_TASK: u32 = 4;
const HELLO_DEVICE: u32 = 8;

/// How an introduced queue pair's waiter hears of news (see `crate::activity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaiterKind {
    /// Nobody waits for it alone: news rings the device.
    Device,
    /// A thread waits on the queue pair's own doorbell, which follows as a descriptor.
    Own,
    /// A task waits: news sets its task bit and rings the device's task doorbell.
    Task,
}

/// A control message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// A queue pair reached RTR and introduces itself to the device of its destination. Carries
    /// one to six descriptors: the queue pair's shared segment; then, with `device` (the first
    /// introduction on its link; later ones refer to these), its device's doorbell, its
    /// device's activity area, in which `slot` is the queue pair's (see `crate::activity`),
    /// and its device's task doorbell; then, if `waiter` is [`WaiterKind::Own`], the queue
    /// pair's own doorbell (an eventfd, written when the slot's waiting bit is set: its owner
    /// waits for it alone); then, with `region`, the memfd of a region shared with this queue
    /// pair's peer only (handed over here instead of on the first question about it).
    /// Version 3: the area has waiting bits; version 4: the region; version 5: task bits, the
    /// task doorbell, device descriptors once per link.
    Hello {
        from_gid: Gid,
        from_qpn: u32,
        to_qpn: u32,
        slot: u32,
        waiter: WaiterKind,
        device: bool,
        region: Option<RegionOffer>,
    },
    /// "Describe your region with remote key `rkey`, as seen by your queue pair `qpn`."
    RegionQuery { tag: u32, qpn: u32, rkey: u32 },
    /// The answer; when `found`, carries the region's memfd.
    RegionReply { tag: u32, found: bool, addr: u64, len: u64, access: u32 },
    /// Is anyone there (used to probe a rendezvous)?
    Ping { tag: u32 },
    /// Yes.
    Pong { tag: u32 },
    /// "My queue pair `from_qpn` is no longer paired with your `to_qpn`": it was destroyed or
    /// reset, or (sent back on the connection an introduction came over) the introduction of
    /// `to_qpn` names a queue pair that does not exist or does not expect it.
    Goodbye { from_qpn: u32, to_qpn: u32 },
}

struct Writer {
    bytes: [u8; MAX_MESSAGE],
    len: usize,
}

impl Writer {
    fn new(kind: u8) -> Self {
        let mut writer = Self { bytes: [0; MAX_MESSAGE], len: 0 };
        writer.put(&MAGIC);
        writer.put(&[VERSION, kind]);
        writer
    }

    fn put(&mut self, bytes: &[u8]) {
        self.bytes[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    fn u32(&mut self, value: u32) {
        self.put(&value.to_le_bytes());
    }

    fn u64(&mut self, value: u64) {
        self.put(&value.to_le_bytes());
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.bytes[..N]);
        self.bytes = &self.bytes[N..];
        out
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

impl Message {
    /// The encoded message.
    pub(crate) fn encode(&self) -> ([u8; MAX_MESSAGE], usize) {
        let writer = match *self {
            Message::Hello { from_gid, from_qpn, to_qpn, slot, waiter, device, region } => {
                let mut w = Writer::new(KIND_HELLO);
                w.put(&from_gid.0);
                w.u32(from_qpn);
                w.u32(to_qpn);
                w.u32(slot);
                let waiter_flag = match waiter {
                    WaiterKind::Device => 0,
                    WaiterKind::Own => HELLO_WAITER,
                    WaiterKind::Task => HELLO_TASK,
                };
                let flags = waiter_flag
                    | if region.is_some() { HELLO_REGION } else { 0 }
                    | if device { HELLO_DEVICE } else { 0 };
                w.u32(flags);
                let offer = region.unwrap_or(RegionOffer { rkey: 0, addr: 0, len: 0, access: 0 });
                w.u32(offer.rkey);
                w.u64(offer.addr);
                w.u64(offer.len);
                w.u32(offer.access);
                w
            }
            Message::RegionQuery { tag, qpn, rkey } => {
                let mut w = Writer::new(KIND_REGION_QUERY);
                w.u32(tag);
                w.u32(qpn);
                w.u32(rkey);
                w
            }
            Message::RegionReply { tag, found, addr, len, access } => {
                let mut w = Writer::new(KIND_REGION_REPLY);
                w.u32(tag);
                w.put(&[u8::from(found)]);
                w.u64(addr);
                w.u64(len);
                w.u32(access);
                w
            }
            Message::Ping { tag } => {
                let mut w = Writer::new(KIND_PING);
                w.u32(tag);
                w
            }
            Message::Pong { tag } => {
                let mut w = Writer::new(KIND_PONG);
                w.u32(tag);
                w
            }
            Message::Goodbye { from_qpn, to_qpn } => {
                let mut w = Writer::new(KIND_GOODBYE);
                w.u32(from_qpn);
                w.u32(to_qpn);
                w
            }
        };
        (writer.bytes, writer.len)
    }

    /// Decodes one message; `None` unless it is exactly a message of a known kind.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Message> {
        if bytes.len() < 6 || bytes[..4] != MAGIC || bytes[4] != VERSION {
            return None;
        }
        let kind = bytes[5];
        let mut r = Reader { bytes: &bytes[6..] };
        let body_len = r.bytes.len();
        let expect = |len: usize| (body_len == len).then_some(());
        Some(match kind {
            KIND_HELLO => {
                expect(56)?;
                let (from_gid, from_qpn, to_qpn, slot) = (Gid(r.take()), r.u32(), r.u32(), r.u32());
                let flags = r.u32();
                if flags & !(HELLO_WAITER | HELLO_REGION | HELLO_TASK | HELLO_DEVICE) != 0 {
                    return None;
                }
                let waiter = match (flags & HELLO_WAITER != 0, flags & HELLO_TASK != 0) {
                    (false, false) => WaiterKind::Device,
                    (true, false) => WaiterKind::Own,
                    (false, true) => WaiterKind::Task,
                    (true, true) => return None,
                };
                let offer = RegionOffer { rkey: r.u32(), addr: r.u64(), len: r.u64(), access: r.u32() };
                let region = if flags & HELLO_REGION != 0 {
                    Some(offer)
                } else if offer == (RegionOffer { rkey: 0, addr: 0, len: 0, access: 0 }) {
                    None
                } else {
                    return None;
                };
                let device = flags & HELLO_DEVICE != 0;
                Message::Hello { from_gid, from_qpn, to_qpn, slot, waiter, device, region }
            }
            KIND_REGION_QUERY => {
                expect(12)?;
                Message::RegionQuery { tag: r.u32(), qpn: r.u32(), rkey: r.u32() }
            }
            KIND_REGION_REPLY => {
                expect(25)?;
                let tag = r.u32();
                let found = match r.take::<1>()[0] {
                    0 => false,
                    1 => true,
                    _ => return None,
                };
                Message::RegionReply { tag, found, addr: r.u64(), len: r.u64(), access: r.u32() }
            }
            KIND_PING => {
                expect(4)?;
                Message::Ping { tag: r.u32() }
            }
            KIND_PONG => {
                expect(4)?;
                Message::Pong { tag: r.u32() }
            }
            KIND_GOODBYE => {
                expect(8)?;
                Message::Goodbye { from_qpn: r.u32(), to_qpn: r.u32() }
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello {
                from_gid: Gid([7; 16]),
                from_qpn: 0x12,
                to_qpn: 0xFF_FFFF,
                slot: 4095,
                waiter: WaiterKind::Device,
                device: true,
                region: None,
            },
            Message::Hello {
                from_gid: Gid([8; 16]),
                from_qpn: 1,
                to_qpn: 2,
                slot: 0,
                waiter: WaiterKind::Own,
                device: false,
                region: Some(RegionOffer {
                    rkey: 0xDEAD_BEEF,
                    addr: 0x7f00_0000_1000,
                    len: 1 << 20,
                    access: 0b111,
                }),
            },
            Message::Hello {
                from_gid: Gid([9; 16]),
                from_qpn: 3,
                to_qpn: 4,
                slot: 64,
                waiter: WaiterKind::Task,
                device: false,
                region: None,
            },
            Message::RegionQuery { tag: 9, qpn: 3, rkey: 0xDEAD_BEEF },
            Message::RegionReply {
                tag: 9,
                found: true,
                addr: 0x7f00_0000_1000,
                len: 1 << 33,
                access: 0b1111,
            },
            Message::RegionReply { tag: 10, found: false, addr: 0, len: 0, access: 0 },
            Message::Ping { tag: 1 },
            Message::Pong { tag: u32::MAX },
            Message::Goodbye { from_qpn: 5, to_qpn: 0xFF_FFFF },
        ]
    }

    #[test]
    fn messages_round_trip() {
        for message in samples() {
            let (bytes, len) = message.encode();
            assert_eq!(Message::decode(&bytes[..len]), Some(message));
        }
    }

    #[test]
    fn truncated_padded_or_foreign_bytes_are_refused() {
        for message in samples() {
            let (bytes, len) = message.encode();
            for cut in 0..len {
                assert_eq!(Message::decode(&bytes[..cut]), None, "{message:?} cut at {cut}");
            }
            assert_eq!(Message::decode(&bytes[..len + 1]), None, "{message:?} with a trailing byte");
            let mut wrong_version = bytes;
            wrong_version[4] = 1;
            assert_eq!(Message::decode(&wrong_version[..len]), None);
        }
        let (mut reply, len) = samples()[4].encode();
        reply[10] = 2;
        assert_eq!(Message::decode(&reply[..len]), None, "a found flag of 2");
        assert_eq!(Message::decode(b"LPSM\x01\x63"), None, "unknown kind");
        let (mut hello, len) = samples()[0].encode();
        hello[34] = 16;
        assert_eq!(Message::decode(&hello[..len]), None, "an unknown hello flag");
        hello[34] = 5;
        assert_eq!(Message::decode(&hello[..len]), None, "a waiter with a doorbell that is also a task");
        hello[34] = 8;
        hello[40] = 1;
        assert_eq!(Message::decode(&hello[..len]), None, "region fields without the region flag");
        assert_eq!(Message::decode(b"6.22\0\0\0\0\0\0\0\0"), None);
    }
}
