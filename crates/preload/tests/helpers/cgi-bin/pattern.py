#!/usr/bin/env python3
"""A CGI program for the preload tests: answers with N pattern bytes (N from the query
string), written by this process (a fork child of the server that execve'd it) straight on
the connection's socket, which it inherited as its standard output."""
import hashlib, os, sys

n = int(os.environ.get("QUERY_STRING") or "0")
block = hashlib.sha256(b"lightpath exec").digest() * 2048
body = (block * (n // len(block) + 1))[:n]
out = sys.stdout.buffer
out.write(b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % n)
out.write(body)
out.flush()
