#!/usr/bin/env python3
"""Checks the output of `lightpath decode --pcap FILE --json` for the interop suite.

    check_decode_json.py DECODE.json|- EXPECTED_PACKETS [--sample FILE]

`-` reads the decode output from standard input, so the suite pipes `lightpath decode` into
this check instead of writing gigabytes of JSON first; one JSON object per line is read as it
comes (other shapes are read whole). `--sample FILE` keeps the first 200 lines for the record.

Accepted shapes: a JSON array of packet objects, an object with a "packets" array, or one
JSON object per line. Each packet must carry an ICRC verdict, as `"icrc_ok": true|false` or
`"icrc": {"ok"|"valid": true|false}`, `"icrc": {"status": "ok"|"bad"}` (what lightpath
decode prints today) or `"icrc": "ok"|"bad"`; "unchecked" counts as no verdict. Passes (exit 0) only if there
are EXPECTED_PACKETS packets (what interop/tools/pcap_roce.py counted) and every verdict is
good. The last line printed is the one-line verdict.
"""

import argparse
import json
import sys


def load_packets(text):
    text = text.strip()
    if not text:
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get("packets"), list):
        return doc["packets"]
    raise ValueError("expected an array of packets or an object with a \"packets\" array")


def icrc_verdict(packet):
    """True/False for a stated verdict, None if the packet states none."""
    if not isinstance(packet, dict):
        return None
    if isinstance(packet.get("icrc_ok"), bool):
        return packet["icrc_ok"]
    icrc = packet.get("icrc")
    if isinstance(icrc, dict):
        for key in ("ok", "valid"):
            if isinstance(icrc.get(key), bool):
                return icrc[key]
        icrc = icrc.get("status")
    if isinstance(icrc, str):
        word = icrc.lower()
        if word in ("ok", "valid", "good"):
            return True
        if word in ("bad", "invalid", "mismatch", "wrong"):
            return False
    return None


def stream_packets(lines, sample):
    """Packets from `lines`: one JSON object per line, read as they come; any other shape
    (an array, an object with "packets", pretty-printed JSON) is read whole. The first
    `sample["left"]` lines are copied to `sample["out"]`."""
    first = True
    for line in lines:
        if sample is not None and sample["left"] > 0:
            sample["out"].write(line)
            sample["left"] -= 1
        if not line.strip():
            continue
        if first:
            first = False
            try:
                packet = json.loads(line)
            except json.JSONDecodeError:
                packet = None
            if not isinstance(packet, dict):
                yield from load_packets(line + "".join(lines))
                return
            yield packet
            continue
        yield json.loads(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("decode", help="the output of `lightpath decode --json`, or - for stdin")
    ap.add_argument("expected", type=int, help="the packet count pcap_roce.py found")
    ap.add_argument("--sample", metavar="FILE", help="keep the first 200 lines of the output")
    args = ap.parse_args()
    sample = {"out": open(args.sample, "w"), "left": 200} if args.sample else None
    good = count = bad_total = missing_total = 0
    bad = []
    missing = []
    try:
        source = sys.stdin if args.decode == "-" else open(args.decode)
        with source:
            for index, packet in enumerate(stream_packets(source, sample)):
                count += 1
                verdict = icrc_verdict(packet)
                if verdict is True:
                    good += 1
                elif verdict is False:
                    bad_total += 1
                    if len(bad) < 20:
                        bad.append(index)
                else:
                    missing_total += 1
                    if len(missing) < 20:
                        missing.append(index)
    except (ValueError, OSError) as err:
        print(f"cannot read the decode output: {err}")
        return 1
    finally:
        if sample:
            sample["out"].close()
    if bad:
        print(f"packets with a bad ICRC (first indexes): {bad}")
    if missing:
        print(f"packets without an ICRC verdict (first indexes): {missing}")
    ok = not bad_total and not missing_total and count == args.expected
    print(f"lightpath decode: {count} packets (independent count {args.expected}), "
          f"{good} ICRC ok, {bad_total} bad, {missing_total} without verdict: {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
