#!/usr/bin/env python3
"""Independent RoCE v2 capture checker for the interop suite (standard library only).

Reads a classic libpcap file (Ethernet, as `tcpdump -w` writes), recomputes the ICRC of every
IPv4 UDP/4791 packet, and optionally writes a few packets of each kind as text vectors.
It is deliberately separate from `lightpath decode`: the suite runs both and requires them to
agree, so a bug in Lightpath's ICRC code cannot hide behind itself.

    pcap_roce.py CAPTURE.pcap [--json] [--json-out FILE] [--vectors DIR] [--per-kind N]
    pcap_roce.py --self-test

ICRC (RoCE v2, IBA annex A17): CRC-32 (zlib) over 8 bytes of 0xFF, then the IPv4 header with
TOS, TTL and header checksum set to all ones, the UDP header with the checksum set to all ones,
the BTH with byte 4 set to 0xFF, then the rest of the packet up to the ICRC; the ICRC is sent
least-significant byte first.
"""

import argparse
import json
import os
import struct
import sys
import zlib

ROCE_PORT = 4791

OPCODES = {
    0x00: "RC_SEND_FIRST", 0x01: "RC_SEND_MIDDLE", 0x02: "RC_SEND_LAST",
    0x03: "RC_SEND_LAST_WITH_IMMEDIATE", 0x04: "RC_SEND_ONLY", 0x05: "RC_SEND_ONLY_WITH_IMMEDIATE",
    0x06: "RC_RDMA_WRITE_FIRST", 0x07: "RC_RDMA_WRITE_MIDDLE", 0x08: "RC_RDMA_WRITE_LAST",
    0x09: "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE", 0x0A: "RC_RDMA_WRITE_ONLY",
    0x0B: "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", 0x0C: "RC_RDMA_READ_REQUEST",
    0x0D: "RC_RDMA_READ_RESPONSE_FIRST", 0x0E: "RC_RDMA_READ_RESPONSE_MIDDLE",
    0x0F: "RC_RDMA_READ_RESPONSE_LAST", 0x10: "RC_RDMA_READ_RESPONSE_ONLY",
    0x11: "RC_ACKNOWLEDGE", 0x12: "RC_ATOMIC_ACKNOWLEDGE", 0x13: "RC_COMPARE_SWAP",
    0x14: "RC_FETCH_ADD", 0x16: "RC_SEND_LAST_WITH_INVALIDATE",
    0x17: "RC_SEND_ONLY_WITH_INVALIDATE", 0x64: "UD_SEND_ONLY",
    0x65: "UD_SEND_ONLY_WITH_IMMEDIATE", 0x81: "CNP",
}


def icrc_of_ipv4(ip):
    """(computed, found) ICRC of an IPv4 packet (IP header .. ICRC), or raises ValueError."""
    ihl = (ip[0] & 0x0F) * 4
    if ip[0] >> 4 != 4 or ihl < 20 or len(ip) < ihl + 8 + 12 + 4:
        raise ValueError("not an IPv4 RoCE packet")
    masked = bytearray(ip[: ihl + 8 + 12])
    masked[1] = 0xFF  # TOS
    masked[8] = 0xFF  # TTL
    masked[10:12] = b"\xff\xff"  # header checksum
    masked[ihl + 6 : ihl + 8] = b"\xff\xff"  # UDP checksum
    masked[ihl + 8 + 4] = 0xFF  # BTH byte 4: FECN, BECN, reserved
    crc = zlib.crc32(b"\xff" * 8)
    crc = zlib.crc32(bytes(masked), crc)
    crc = zlib.crc32(ip[ihl + 8 + 12 : -4], crc)
    (found,) = struct.unpack("<I", ip[-4:])
    return crc, found


def read_pcap(path):
    """Yields (timestamp, frame bytes) from a classic pcap file."""
    with open(path, "rb") as f:
        header = f.read(24)
        if len(header) < 24:
            return
        magic = header[:4]
        if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
            endian = "<"
        elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
            endian = ">"
        else:
            raise ValueError(f"{path}: not a classic pcap file (pcapng is not supported)")
        nano = magic in (b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d")
        (linktype,) = struct.unpack(endian + "I", header[20:24])
        if linktype != 1:
            raise ValueError(f"{path}: link type {linktype}, expected Ethernet (1)")
        while True:
            rec = f.read(16)
            if len(rec) < 16:
                return
            sec, frac, caplen, _ = struct.unpack(endian + "IIII", rec)
            data = f.read(caplen)
            if len(data) < caplen:
                return
            yield sec + frac / (1e9 if nano else 1e6), data


def packets(path):
    """Yields one dict per IPv4 UDP/4791 frame in the capture."""
    for index, (ts, frame) in enumerate(read_pcap(path)):
        off, ethertype = 14, struct.unpack(">H", frame[12:14])[0] if len(frame) >= 14 else 0
        if ethertype == 0x8100 and len(frame) >= 18:
            off, ethertype = 18, struct.unpack(">H", frame[16:18])[0]
        if ethertype != 0x0800:
            continue
        ip = frame[off:]
        if len(ip) < 28 or ip[9] != 17:
            continue
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack(">H", ip[2:4])[0]
        ip = ip[:total]
        sport, dport = struct.unpack(">HH", ip[ihl : ihl + 4])
        if dport != ROCE_PORT:
            continue
        pkt = {
            "frame": index, "time": ts,
            "src": ".".join(str(b) for b in ip[12:16]), "dst": ".".join(str(b) for b in ip[16:20]),
            "sport": sport, "ip_id": struct.unpack(">H", ip[4:6])[0], "ip_flags": ip[6] >> 5,
            "ttl": ip[8], "hex": ip.hex(), "frame_hex": frame.hex(),
        }
        bth = ip[ihl + 8 : ihl + 20]
        if len(bth) == 12:
            pkt.update({
                "opcode": bth[0], "opcode_name": OPCODES.get(bth[0], "UNKNOWN"),
                "solicited": bool(bth[1] & 0x80), "pad": (bth[1] >> 4) & 3,
                "pkey": struct.unpack(">H", bth[2:4])[0],
                "dest_qpn": int.from_bytes(bth[5:8], "big"), "ack_req": bool(bth[8] & 0x80),
                "psn": int.from_bytes(bth[9:12], "big"),
            })
        try:
            computed, found = icrc_of_ipv4(ip)
            pkt.update(icrc_computed=computed, icrc_found=found, icrc_ok=computed == found)
        except ValueError as err:
            pkt.update(icrc_ok=False, error=str(err))
        yield pkt


class VectorWriter:
    """Writes up to per_kind packets of each (source, opcode) as text files."""

    def __init__(self, directory, per_kind):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.per_kind, self.seen, self.names = directory, per_kind, {}, []

    def offer(self, p):
        key = (p["src"], p.get("opcode_name", "TRUNCATED"))
        n = self.seen.get(key, 0)
        if n >= self.per_kind:
            return
        self.seen[key] = n + 1
        name = f"{p['src']}-{key[1].lower()}-{n + 1}.txt"
        with open(os.path.join(self.directory, name), "w") as f:
            f.write(f"# {key[1]} from {p['src']} to {p['dst']} (frame {p['frame']} of the capture)\n")
            f.write(f"# UDP sport {p['sport']}, IPv4 id 0x{p['ip_id']:04x} flags {p['ip_flags']} ttl {p['ttl']}\n")
            if "opcode" in p:
                f.write(f"# BTH opcode 0x{p['opcode']:02x} dest_qpn 0x{p['dest_qpn']:06x} "
                        f"psn 0x{p['psn']:06x} ack_req {int(p['ack_req'])} pad {p['pad']} "
                        f"pkey 0x{p['pkey']:04x}\n")
            if "icrc_found" in p:
                f.write(f"# ICRC on the wire 0x{p['icrc_found']:08x} (little-endian bytes), "
                        f"recomputed 0x{p['icrc_computed']:08x}: {'ok' if p['icrc_ok'] else 'BAD'}\n")
            f.write("# Ethernet frame:\n")
            f.write(p["frame_hex"] + "\n")
        self.names.append(name)


def self_test():
    """Known vectors (RoCE v2 digest §5.3): a ConnectX CNP and two RC packets."""
    cases = [
        ("45c2003c718c4000401191610a0011010a00120100" "0012b7002800008100ffff40000118" "00000000"
         + "00" * 16 + "82fd002a"),
        ("45000034123440004011b31ec0a87a0ac0a87a0bc13212b7002000000430ffff0000001180123456"
         "68656c6c6f000000" "38d5d262"),
        ("450000304321400040118235c0a87a0bc0a87a0ac13212b7001c00001100ffff0000001200123456"
         "1f000001" "aba96887"),
    ]
    ok = True
    for hexstr in cases:
        ip = bytes.fromhex(hexstr)
        computed, found = icrc_of_ipv4(ip)
        bad = bytearray(ip)
        bad[-6] ^= 0x01
        flipped, _ = icrc_of_ipv4(bytes(bad))
        masked_only = bytearray(ip)
        masked_only[8] ^= 0x3F  # TTL is masked: the ICRC must not change
        ttl_changed, _ = icrc_of_ipv4(bytes(masked_only))
        good = computed == found and flipped != found and ttl_changed == found
        ok &= good
        print(f"{'ok ' if good else 'BAD'} icrc 0x{computed:08x} wire 0x{found:08x}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pcap", nargs="?")
    ap.add_argument("--json", action="store_true", help="print a JSON summary")
    ap.add_argument("--json-out", metavar="FILE",
                    help="also write the JSON summary to FILE (one pass gives both forms)")
    ap.add_argument("--vectors", metavar="DIR", help="write text vectors to DIR")
    ap.add_argument("--per-kind", type=int, default=3, help="vectors per (source, opcode)")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.pcap:
        ap.error("a capture file is required")
    # streamed: a capture of MiB-sized READs holds tens of thousands of packets
    summary = {"packets": 0, "icrc_bad": 0, "by_source": {}, "bad_frames": []}
    writer = VectorWriter(args.vectors, args.per_kind) if args.vectors else None
    for p in packets(args.pcap):
        summary["packets"] += 1
        if not p["icrc_ok"]:
            summary["icrc_bad"] += 1
            if len(summary["bad_frames"]) < 50:
                summary["bad_frames"].append(p["frame"])
        src = summary["by_source"].setdefault(p["src"], {"packets": 0, "icrc_ok": 0, "opcodes": {}})
        src["packets"] += 1
        src["icrc_ok"] += p["icrc_ok"]
        name = p.get("opcode_name", "TRUNCATED")
        src["opcodes"][name] = src["opcodes"].get(name, 0) + 1
        if writer:
            writer.offer(p)
    if writer:
        summary["vectors"] = writer.names
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(summary, out, indent=1, sort_keys=True)
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        for src, s in sorted(summary["by_source"].items()):
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["opcodes"].items()))
            print(f"{src}: {s['packets']} packets, ICRC ok {s['icrc_ok']}: {kinds}")
        print(f"total {summary['packets']} packets, {summary['icrc_bad']} with a bad ICRC")
    return 1 if summary["icrc_bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
