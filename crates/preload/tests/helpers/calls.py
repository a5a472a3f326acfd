"""Peers for the preload tests of socket calls beyond read and write (run with or without
the library): splice, recv with MSG_TRUNC, send with MSG_MORE.

  calls.py splice-server PORT      accept one connection and echo it through a pipe with
                                   os.splice (socket -> pipe -> socket) until its end; then
                                   shut the sending side down
  calls.py trunc-more-server PORT D  accept one connection; read 'LEN n', discard the first D
                                   bytes of the n that follow with one recv(fd, NULL, D,
                                   MSG_TRUNC | MSG_WAITALL) (through ctypes: TCP takes a null
                                   buffer there), read the rest; answer 'sha256 <hex> <count>'
                                   in three sends, the first two with MSG_MORE; then send
                                   'END' with MSG_MORE and nothing after it, and wait for 'BYE'
  calls.py trunc-more-client PORT FILE D  the other side: prints 'ok' if the answer matches
                                   FILE after its first D bytes and 'END' arrived

  calls.py exec-server PORT        accept one connection; echo lines until 'REQ n', answer
                                   'ACK', then execve a new python (exec-writer) that inherits
                                   the socket and writes n bytes on it
  calls.py exec-writer FD N        (run by exec-server) read a line from FD (sent before the
                                   exec, not read by the server: the library hands it over),
                                   write N pattern bytes on FD, read 'BYE', answer 'OK <line>'
  calls.py exec-client PORT K N    K echoed lines 5 ms apart (long enough for the connection
                                   to switch), then 'REQ N' and 'EXTRA 12345' in one write;
                                   read 'ACK' and the N bytes that follow, send 'BYE', read the
                                   answer and the end; prints 'sha256 <hex> <count> <answer>'
                                   of the N bytes and the answer

  calls.py close-server PORT       accept one connection, echo 20 messages, close it and
                                   stay a second
  calls.py late-writer PORT        20 echoed messages, wait for the server's close, read the
                                   end, then 10 writes 50 ms apart; prints 'ok' and how many
                                   writes succeeded if one failed (EPIPE/ECONNRESET, as TCP's
                                   second write after a peer's close does), 'never failed' if not

The address is LP_PEER_HOST (127.0.0.1 when unset).
"""
import ctypes, hashlib, os, socket, sys, time

HOST = os.environ.get("LP_PEER_HOST", "127.0.0.1")

def accept_one(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((HOST, port))
    s.listen(1)
    c, _ = s.accept()
    s.close()
    return c

def splice_server(port):
    c = accept_one(port)
    r, w = os.pipe()
    fd = c.fileno()
    while True:
        n = os.splice(fd, w, 65536)
        if n == 0:
            break
        while n > 0:
            n -= os.splice(r, fd, n)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    c.close()

def read_exactly(c, n):
    out = bytearray()
    while len(out) < n:
        d = c.recv(min(n - len(out), 1 << 20))
        if not d:
            raise SystemExit("end of stream after %d of %d bytes" % (len(out), n))
        out += d
    return bytes(out)

def read_line(c):
    line = b""
    while not line.endswith(b"\n"):
        d = c.recv(1)
        if not d:
            raise SystemExit("end of stream in a line: %r" % line)
        line += d
    return line[:-1]

def trunc_more_server(port, skip):
    c = accept_one(port)
    n = int(read_line(c).split()[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.recv.restype = ctypes.c_ssize_t
    libc.recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    discarded = libc.recv(c.fileno(), None, skip, socket.MSG_TRUNC | socket.MSG_WAITALL)
    if discarded != skip:
        raise SystemExit("recv(MSG_TRUNC | MSG_WAITALL) discarded %d, not %d (errno %d)"
                         % (discarded, skip, ctypes.get_errno()))
    rest = read_exactly(c, n - skip)
    c.send(b"sha256 ", socket.MSG_MORE)
    c.send(hashlib.sha256(rest).hexdigest().encode(), socket.MSG_MORE)
    c.send(b" %d\n" % len(rest))
    c.send(b"END", socket.MSG_MORE)
    if read_line(c) != b"BYE":
        raise SystemExit("no BYE")
    c.close()

def trunc_more_client(port, path, skip):
    data = open(path, "rb").read()
    c = socket.create_connection((HOST, port))
    c.settimeout(30)
    c.sendall(b"LEN %d\n" % len(data) + data)
    answer = read_line(c).decode()
    expected = "sha256 %s %d" % (hashlib.sha256(data[skip:]).hexdigest(), len(data) - skip)
    if answer != expected:
        raise SystemExit("answer %r, expected %r" % (answer, expected))
    # Sent with MSG_MORE and nothing after it: must still arrive (not be held for good).
    if read_exactly(c, 3) != b"END":
        raise SystemExit("no END")
    c.sendall(b"BYE\n")
    if c.recv(1) != b"":
        raise SystemExit("more after END")
    print("ok")

def pattern(n):
    block = hashlib.sha256(b"lightpath exec").digest() * 2048
    return (block * (n // len(block) + 1))[:n]

def exec_server(port):
    c = accept_one(port)
    f = c.makefile("rb", buffering=0)
    while True:
        line = read_line(c)
        if line.startswith(b"REQ "):
            n = int(line.split()[1])
            break
        c.sendall(line + b"\n")
    c.sendall(b"ACK\n")
    fd = c.fileno()
    os.set_inheritable(fd, True)
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "exec-writer", str(fd), str(n)])

def fd_line(fd):
    line = b""
    while not line.endswith(b"\n"):
        d = os.read(fd, 1)
        if not d:
            raise SystemExit("exec-writer: end of stream in a line: %r" % line)
        line += d
    return line

def exec_writer(fd, n):
    first = fd_line(fd).strip()
    data = pattern(n)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    line = fd_line(fd)
    os.write(fd, b"OK " + first + b"\n" if line == b"BYE\n" else b"WHAT " + line)
    os.close(fd)

def exec_client(port, k, n):
    c = socket.create_connection((HOST, port))
    c.settimeout(30)
    for i in range(k):
        c.sendall(b"PING %d\n" % i)
        if read_line(c) != b"PING %d" % i:
            raise SystemExit("bad echo")
        time.sleep(0.005)
    c.sendall(b"REQ %d\nEXTRA 12345\n" % n)
    if read_line(c) != b"ACK":
        raise SystemExit("no ACK")
    h = hashlib.sha256()
    count = 0
    while count < n:
        d = c.recv(min(1 << 20, n - count))
        if not d:
            break
        h.update(d)
        count += len(d)
    c.sendall(b"BYE\n")
    answer = b""
    while True:
        d = c.recv(4096)
        if not d:
            break
        answer += d
    print("sha256 %s %d %s" % (h.hexdigest(), count, answer.decode(errors="replace").strip()))

def close_server(port):
    c = accept_one(port)
    for _ in range(20):
        c.sendall(c.recv(100))
    c.close()
    time.sleep(1)

def late_writer(port):
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    c = socket.create_connection((HOST, port))
    for _ in range(20):
        c.sendall(b"x" * 10)
        c.recv(100)
        time.sleep(0.01)
    time.sleep(0.3)
    if c.recv(10) != b"":
        raise SystemExit("bytes after the echoes")
    for i in range(10):
        try:
            c.sendall(b"y" * 1000)
        except OSError:
            print("ok %d" % i)
            return
        time.sleep(0.05)
    print("never failed")

if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "splice-server":
        splice_server(port)
    elif mode == "trunc-more-server":
        trunc_more_server(port, int(sys.argv[3]))
    elif mode == "close-server":
        close_server(port)
    elif mode == "late-writer":
        late_writer(port)
    elif mode == "exec-server":
        exec_server(port)
    elif mode == "exec-writer":
        exec_writer(port, int(sys.argv[3]))
    elif mode == "exec-client":
        exec_client(port, int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "pattern-sha256":
        print(hashlib.sha256(pattern(port)).hexdigest())
    elif mode == "trunc-more-client":
        trunc_more_client(port, sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit("unknown mode " + mode)
