#!/usr/bin/env python3
"""Checks the output of `lightpath decode --pcap FILE --json` for the interop suite.

    check_decode_json.py DECODE.json EXPECTED_PACKETS

Accepted shapes: a JSON array of packet objects, an object with a "packets" array, or one
JSON object per line. Each packet must carry an ICRC verdict, as `"icrc_ok": true|false` or
`"icrc": {"ok"|"valid": true|false}`, `"icrc": {"status": "ok"|"bad"}` (what lightpath
decode prints today) or `"icrc": "ok"|"bad"`; "unchecked" counts as no verdict. Passes (exit 0) only if there
are EXPECTED_PACKETS packets (what interop/tools/pcap_roce.py counted) and every verdict is
good. The last line printed is the one-line verdict.
"""

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


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        packets = load_packets(open(sys.argv[1]).read())
    except (ValueError, OSError) as err:
        print(f"cannot read the decode output: {err}")
        return 1
    expected = int(sys.argv[2])
    verdicts = [icrc_verdict(p) for p in packets]
    good = verdicts.count(True)
    bad = [i for i, v in enumerate(verdicts) if v is False]
    missing = [i for i, v in enumerate(verdicts) if v is None]
    if bad:
        print(f"packets with a bad ICRC (indexes): {bad[:20]}")
    if missing:
        print(f"packets without an ICRC verdict (indexes): {missing[:20]}")
    ok = not bad and not missing and len(packets) == expected
    print(f"lightpath decode: {len(packets)} packets (independent count {expected}), "
          f"{good} ICRC ok, {len(bad)} bad, {len(missing)} without verdict: {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
