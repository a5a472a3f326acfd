#!/usr/bin/env python3
"""A stand-in for the server side of interop/PROTOCOL.md that has no RDMA at all.

It answers the client's LP1 line with a made-up QP (QPN 0x4c5001, PSN 0) at its own address,
so the rxe client in the VM connects its QP and sends real RoCE v2 requests to this host,
which nobody acknowledges: rxe retransmits them until its retry count runs out. The suite
uses this to capture genuine rxe packets (and check their ICRC) even before Lightpath can
answer them. Standard library only.

    oob_stub.py --bind 10.78.0.1 --port 20001
"""

import argparse
import ipaddress
import socket
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bind", required=True, help="IPv4 address to listen on (also the GID)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()
    gid = ipaddress.IPv6Address("::ffff:" + args.bind).packed.hex()
    with socket.create_server((args.bind, args.port)) as server:
        server.settimeout(args.timeout)
        conn, peer = server.accept()
        conn.settimeout(args.timeout)
        with conn, conn.makefile("rwb", buffering=0) as stream:
            line = stream.readline().decode().strip()
            print(f"client {peer[0]}: {line}")
            fields = line.split()
            if len(fields) != 10 or fields[0] != "LP1":
                print("not an LP1 line")
                return 1
            op, size, iters = fields[1], fields[8], fields[9]
            reply = f"LP1 {op} 4c5001 000000 {gid} 1024 0000000000001000 00001234 {size} {iters}\n"
            stream.write(reply.encode())
            print(f"answered: {reply.strip()}")
            done = stream.readline().decode().strip()
            print(f"client says: {done}")
            stream.write(b"RESULT FAIL (stub peer: nothing was acknowledged)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
