"""Small blocking TCP peers for the preload tests (run with or without the library).

  peers.py banner-server PORT N     accept N connections one by one; each: send a banner
                                    first, then answer each line with 'OK <line>' until QUIT
  peers.py banner-client PORT K MS  wait for the banner (send nothing before), then K lines
                                    MS ms apart, a nonblocking read with nothing pending and
                                    one more line in blocking mode; print the transcript
  peers.py echo-server PORT N       accept N connections one by one; echo until end of stream
  peers.py echo-client PORT FILE    send FILE, shut the sending side down, read the echo to
                                    the end; print 'sha256 <hex> <bytes>'
  peers.py epoll-client PORT K      K lines echoed one by one, nonblocking, the connection in
                                    an epoll only while it waits (as redis-benchmark deletes
                                    and re-adds it around each request); then, deleted, the
                                    server closes: a wait on the epoll must stay idle (prints
                                    its CPU time), and added again the end of stream is
                                    reported; prints 'ok K cpu <seconds>'
  peers.py cork-server PORT N       accept N connections one by one; answer each line 'REQ k'
                                    with 'HDR k' and 'BODY k' sent separately under TCP_CORK:
                                    uncorked after the body when k is odd, left corked (until
                                    the next request) when k is even; end at EOF
  peers.py cork-client PORT K       K requests one after the other, each answer read whole
                                    before the next; prints 'ok K'
  peers.py epoll-dup-client P1 P2   a connection to P1 is dup'ed, added to an epoll and deleted,
                                    and its first fd closed; a new connection to P2 takes that
                                    number and is added, then the first connection again
                                    through its dup: the new one's echo must still be
                                    reported; prints 'ok reused <bool>'

The address every subcommand listens on and connects to is LP_PEER_HOST (127.0.0.1 when
unset), so a server can listen on a namespace's veth address and a client reach it there.
With LP_CLEAR_ENV=1 a subcommand empties its environment first (the C environ too, through
unsetenv), as nginx does for its workers: the library must have read its settings at load.
"""
import hashlib, os, select, socket, sys, time

HOST = os.environ.get("LP_PEER_HOST", "127.0.0.1")
if os.environ.get("LP_CLEAR_ENV") == "1":
    os.environ.clear()

def listener(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((HOST, port))
    s.listen(16)
    return s

def read_line(c, buf):
    while b"\n" not in buf:
        d = c.recv(4096)
        if not d:
            return None, buf
        buf += d
    line, _, rest = buf.partition(b"\n")
    return line, rest

def banner_server(port, n):
    s = listener(port)
    for _ in range(n):
        c, _ = s.accept()
        c.sendall(b"220 lightpath-test ready\r\n")
        buf = b""
        while True:
            line, buf = read_line(c, buf)
            if line is None:
                break
            line = line.rstrip(b"\r")
            if line == b"QUIT":
                c.sendall(b"221 bye\r\n")
                break
            c.sendall(b"OK " + line + b"\r\n")
        c.close()

def banner_client(port, k, ms):
    c = socket.create_connection((HOST, port))
    buf = b""
    line, buf = read_line(c, buf)
    out = [line]
    for i in range(k):
        c.sendall(b"LINE %d %s\r\n" % (i, b"x" * (i * 37 % 3000)))
        line, buf = read_line(c, buf)
        out.append(line)
        time.sleep(ms / 1000.0)
    # Nonblocking and back (CPython switches with ioctl FIONBIO): a read with nothing
    # pending fails at once, and after switching back a read waits for its answer.
    c.setblocking(False)
    try:
        out.append(b"DATA " + c.recv(100))
    except BlockingIOError:
        out.append(b"WOULDBLOCK")
    c.setblocking(True)
    c.sendall(b"AFTER\r\n")
    line, buf = read_line(c, buf)
    out.append(line)
    c.sendall(b"QUIT\r\n")
    line, buf = read_line(c, buf)
    out.append(line)
    rest = c.recv(100)
    out.append(b"EOF" if rest == b"" and buf == b"" else b"STRAY " + buf + rest)
    c.close()
    sys.stdout.write(hashlib.sha256(b"\n".join(l or b"<none>" for l in out)).hexdigest() + " %d\n" % len(out))

def echo_server(port, n):
    s = listener(port)
    for _ in range(n):
        c, _ = s.accept()
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
        c.close()

def cork_server(port, n):
    s = listener(port)
    for _ in range(n):
        c, _ = s.accept()
        f = c.makefile("rb")
        for line in f:
            k = int(line.split()[1])
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
            c.sendall(b"HDR %d\n" % k)
            c.sendall(b"BODY %d %s\n" % (k, b"x" * (100 * k)))
            if k % 2 == 1:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        c.close()

def cork_client(port, k):
    c = socket.create_connection((HOST, port))
    f = c.makefile("rb")
    for i in range(1, k + 1):
        c.sendall(b"REQ %d\n" % i)
        assert f.readline() == b"HDR %d\n" % i
        assert f.readline() == b"BODY %d %s\n" % (i, b"x" * (100 * i))
    c.close()
    print("ok", k)

def echo_exchange(port, path, receive):
    """Sends the file at `path` in 64 KiB pieces while a thread reads the echo with
    `receive(c)` (returns b"" at the end); returns the bytes read back."""
    data = open(path, "rb").read()
    c = socket.create_connection((HOST, port))
    import threading
    got = []
    def reader():
        while True:
            d = receive(c)
            if not d:
                break
            got.append(d)
    t = threading.Thread(target=reader)
    t.start()
    view = memoryview(data)
    step = 1 << 16
    for off in range(0, len(data), step):
        c.sendall(view[off:off + step])
        time.sleep(0.001)
    c.shutdown(socket.SHUT_WR)
    t.join()
    c.close()
    return b"".join(got)

def echo_client(port, path):
    back = echo_exchange(port, path, lambda c: c.recv(65536))
    print("sha256", hashlib.sha256(back).hexdigest(), len(back))

def epoll_client(port, k):
    c = socket.create_connection((HOST, port))
    c.setblocking(False)
    fd = c.fileno()
    ep = select.epoll()

    def wait_for(mask):
        ep.register(fd, mask)
        try:
            events = ep.poll(5)
        finally:
            ep.unregister(fd)
        assert events and events[0][1] & mask, ("no event", mask, events)

    for i in range(k):
        line = b"line %d %s\n" % (i, b"y" * (i % 50))
        wait_for(select.EPOLLOUT)
        assert c.send(line) == len(line)
        back = b""
        while len(back) < len(line):
            wait_for(select.EPOLLIN)
            back += c.recv(4096)
        assert back == line, (back, line)
        time.sleep(0.001)
    # Deleted from the epoll, the connection hangs up: the server reads the end and closes.
    c.shutdown(socket.SHUT_WR)
    time.sleep(0.3)
    r, w = os.pipe()
    ep.register(r, select.EPOLLIN)
    cpu = time.process_time()
    idle = ep.poll(1.0)
    cpu = time.process_time() - cpu
    assert idle == [], ("a deleted connection reported", idle)
    ep.unregister(r)
    ep.register(fd, select.EPOLLIN)
    events = ep.poll(5)
    assert events and events[0][1] & select.EPOLLIN, ("end of stream not reported", events)
    assert c.recv(4096) == b""
    c.close()
    print("ok %d cpu %.3f" % (k, cpu))

def epoll_dup_client(port1, port2):
    a = socket.create_connection((HOST, port1))
    for i in range(20):
        a.sendall(b"a %d\n" % i)
        back = b""
        while not back.endswith(b"\n"):
            back += a.recv(4096)
        time.sleep(0.002)
    a.setblocking(False)
    ep = select.epoll()
    first = a.fileno()
    second = os.dup(first)
    ep.register(first, select.EPOLLIN)
    ep.unregister(first)
    a.detach()
    os.close(first)
    d = socket.create_connection((HOST, port2))
    d.setblocking(False)
    ep.register(d.fileno(), select.EPOLLIN)
    ep.register(second, select.EPOLLIN)
    d.send(b"hi\n")
    deadline = time.monotonic() + 5
    back = b""
    while not back.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, ("the new connection's echo was never reported", back)
        for fd, _ in ep.poll(left):
            if fd == d.fileno():
                try:
                    back += d.recv(4096)
                except BlockingIOError:
                    pass
    assert back == b"hi\n", back
    print("ok reused %s" % (d.fileno() == first))
    d.close()
    os.close(second)

def scatter_client(port, path):
    """echo-client's exchange, read back with readv and recvmsg_into into three buffers
    (7, 13 and 65536 bytes) in turn; prints the digest and the most bytes one call returned."""
    bufs = [bytearray(7), bytearray(13), bytearray(65536)]
    calls = [0]
    most = [0]
    def receive(c):
        if calls[0] % 2 == 0:
            n = os.readv(c.fileno(), bufs)
        else:
            n = c.recvmsg_into(bufs)[0]
        calls[0] += 1
        most[0] = max(most[0], n)
        return b"".join(bytes(b) for b in bufs)[:n]
    back = echo_exchange(port, path, receive)
    print("sha256", hashlib.sha256(back).hexdigest(), len(back), "most", most[0])

if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "banner-server":
        banner_server(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd == "banner-client":
        banner_client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif cmd == "echo-server":
        echo_server(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd == "echo-client":
        echo_client(int(sys.argv[2]), sys.argv[3])
    elif cmd == "scatter-client":
        scatter_client(int(sys.argv[2]), sys.argv[3])
    elif cmd == "epoll-client":
        epoll_client(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd == "cork-server":
        cork_server(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd == "cork-client":
        cork_client(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd == "epoll-dup-client":
        epoll_dup_client(int(sys.argv[2]), int(sys.argv[3]))
