// The kernel's floor for a request/response exchange, without Lightpath: N "connections" of
// 64-byte requests between two processes over loopback, one epoll loop per side, each
// connection with one request outstanding. Used to tell how much of the gap between soft
// streams and kernel TCP the kernel's UDP path explains (docs/architecture.md, "System calls
// of an event loop's wait").
//
//   cc -O2 -o /tmp/floor_rr scripts/floor_rr.c
//   /tmp/floor_rr tcp 16 20000        # TCP connections (TCP_NODELAY), recv/send
//   /tmp/floor_rr udp 16 20000        # connected UDP socket pairs, recv/send
//   /tmp/floor_rr udp-soft 16 20000   # shaped like soft: a socket per connection receives
//                                     # (recvmmsg), one unconnected socket per side sends
//                                     # (sendmmsg with the peer's address), and an eventfd
//                                     # read per message
//   NESTED=1 /tmp/floor_rr udp-soft ...  # and each connection's socket inside an epoll of its
//                                     # own, which the loop's epoll watches edge-triggered
//                                     # (a Lightpath stream's readiness epoll under tokio)
//
// Prints requests/s and the CPU (user + system, both processes) per request. Run the modes
// back to back and compare ratios: this machine is noisy.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 4096
#define SIZE 64

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double cpu_seconds(const struct rusage *r) {
    return r->ru_utime.tv_sec + r->ru_utime.tv_usec * 1e-6 + r->ru_stime.tv_sec + r->ru_stime.tv_usec * 1e-6;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static struct sockaddr_in loopback(void) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    return a;
}

static int client[MAX_CONNS], server[MAX_CONNS];
static struct sockaddr_in client_addr[MAX_CONNS], server_addr[MAX_CONNS];

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s tcp|udp|udp-soft CONNS ITERS\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    int tcp = strcmp(mode, "tcp") == 0, soft = strcmp(mode, "udp-soft") == 0;
    if (!tcp && !soft && strcmp(mode, "udp") != 0) {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    int n = atoi(argv[2]);
    long iters = atol(argv[3]);
    if (n < 1 || n > MAX_CONNS || iters < 1) {
        fprintf(stderr, "CONNS must be 1..%d and ITERS at least 1\n", MAX_CONNS);
        return 2;
    }
    if (tcp) {
        int listener = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = loopback();
        socklen_t len = sizeof a;
        if (bind(listener, (void *)&a, sizeof a) || listen(listener, MAX_CONNS) ||
            getsockname(listener, (void *)&a, &len))
            die("listen");
        for (int i = 0; i < n; i++) {
            int one = 1;
            client[i] = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(client[i], (void *)&a, sizeof a)) die("connect");
            server[i] = accept(listener, 0, 0);
            if (server[i] < 0) die("accept");
            setsockopt(client[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            setsockopt(server[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        }
    } else {
        for (int i = 0; i < n; i++) {
            socklen_t len = sizeof(struct sockaddr_in);
            client_addr[i] = server_addr[i] = loopback();
            client[i] = socket(AF_INET, SOCK_DGRAM, 0);
            server[i] = socket(AF_INET, SOCK_DGRAM, 0);
            if (bind(client[i], (void *)&client_addr[i], len) || bind(server[i], (void *)&server_addr[i], len) ||
                getsockname(client[i], (void *)&client_addr[i], &len) ||
                getsockname(server[i], (void *)&server_addr[i], &len))
                die("bind");
            // Coalesced receives (UDP_GRO), as soft's sockets: a segmented message arrives whole.
            int gro = 1;
            if (soft && getenv("ACKS") && strcmp(getenv("ACKS"), "gso") == 0 &&
                (setsockopt(client[i], SOL_UDP, 104, &gro, sizeof gro) ||
                 setsockopt(server[i], SOL_UDP, 104, &gro, sizeof gro)))
                die("UDP_GRO");
            // Shaped like soft, the sockets receive from anyone (the peer sends from another
            // socket); otherwise they are a connected pair.
            if (!soft && (connect(client[i], (void *)&server_addr[i], len) ||
                          connect(server[i], (void *)&client_addr[i], len)))
                die("connect");
        }
    }
    pid_t child = fork();
    if (child < 0) die("fork");
    int is_server = child == 0;
    int *fds = is_server ? server : client;
    struct sockaddr_in *peer = is_server ? client_addr : server_addr;
    int sender = -1, event = -1;
    if (soft) {
        struct sockaddr_in a = loopback();
        sender = socket(AF_INET, SOCK_DGRAM, 0);
        if (bind(sender, (void *)&a, sizeof a)) die("bind sender");
        event = eventfd(0, EFD_NONBLOCK);
    }
    int ep = epoll_create1(0);
    int nested = getenv("NESTED") != NULL;
    // ACKS=1: each send carries a second, 28-byte datagram (as soft's RC acknowledgement of
    // the peer's last message rides in the same sendmmsg as the reply).
    // ACKS=gso: the two go as one segmented message (UDP_SEGMENT), the acknowledgement the
    // shorter last segment, as soft joins an ACK to its reply while it serves several
    // connections.
    const char *acks_mode = getenv("ACKS");
    int acks = acks_mode == NULL ? 0 : strcmp(acks_mode, "gso") == 0 ? 2 : 1;
    for (int i = 0; i < n; i++) {
        struct epoll_event e = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        int watched = fds[i];
        if (nested) {
            watched = epoll_create1(0);
            if (epoll_ctl(watched, EPOLL_CTL_ADD, fds[i], &e)) die("epoll_ctl inner");
            e.events = EPOLLIN | EPOLLET;
        }
        if (epoll_ctl(ep, EPOLL_CTL_ADD, watched, &e)) die("epoll_ctl");
    }
    char buf[SIZE];
    memset(buf, 7, sizeof buf);
    long total = iters * n, done = 0;
    double started = now();
#define ACK_SIZE 28
#define SEND(i)                                                                                    \
    do {                                                                                           \
        if (soft) {                                                                                \
            struct iovec v[2] = {{buf, SIZE}, {buf, ACK_SIZE}};                                    \
            struct mmsghdr m[2] = {                                                                \
                {.msg_hdr = {.msg_name = &peer[i], .msg_namelen = sizeof peer[i], .msg_iov = &v[0], \
                             .msg_iovlen = 1}},                                                    \
                {.msg_hdr = {.msg_name = &peer[i], .msg_namelen = sizeof peer[i], .msg_iov = &v[1], \
                             .msg_iovlen = 1}}};                                                   \
            char control[CMSG_SPACE(sizeof(uint16_t))] = {0};                                     \
            if (acks == 2) {                                                                       \
                m[0].msg_hdr.msg_iovlen = 2;                                                       \
                m[0].msg_hdr.msg_control = control;                                                \
                m[0].msg_hdr.msg_controllen = sizeof control;                                      \
                struct cmsghdr *c = CMSG_FIRSTHDR(&m[0].msg_hdr);                                  \
                c->cmsg_level = SOL_UDP;                                                           \
                c->cmsg_type = 103; /* UDP_SEGMENT */                                              \
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));                                          \
                uint16_t segment = SIZE;                                                           \
                memcpy(CMSG_DATA(c), &segment, sizeof segment);                                    \
            }                                                                                      \
            sendmmsg(sender, m, acks == 1 ? 2 : 1, 0);                                             \
        } else {                                                                                   \
            send(fds[i], buf, SIZE, 0);                                                            \
        }                                                                                          \
    } while (0)
    if (!is_server)
        for (int i = 0; i < n; i++) SEND(i);
    struct epoll_event events[256];
    while (done < total) {
        int k = epoll_wait(ep, events, 256, is_server ? 1000 : -1);
        if (k <= 0) {
            if (is_server) break; // the client is done
            continue;
        }
        for (int j = 0; j < k; j++) {
            int i = (int)events[j].data.u32;
            ssize_t got;
            if (soft) {
                char in[4][SIZE];
                struct iovec v[4];
                struct mmsghdr m[4];
                memset(m, 0, sizeof m);
                for (int q = 0; q < 4; q++) {
                    v[q].iov_base = in[q];
                    v[q].iov_len = SIZE;
                    m[q].msg_hdr.msg_iov = &v[q];
                    m[q].msg_hdr.msg_iovlen = 1;
                }
                got = recvmmsg(fds[i], m, 4, MSG_DONTWAIT, 0);
                // Requests only: an acknowledgement (ACKS=1) answers nothing.
                int requests = 0;
                for (int q = 0; q < got; q++) requests += m[q].msg_len >= SIZE;
                if (got > 0 && requests == 0) continue;
                uint64_t count;
                if (got > 0 && read(event, &count, sizeof count) < 0) {
                    // Nobody writes it: the read finds nothing, as soft's mostly did.
                }
            } else {
                got = recv(fds[i], buf, SIZE, MSG_DONTWAIT);
            }
            if (got <= 0) continue;
            done++;
            if (is_server || done + n <= total) SEND(i);
        }
    }
    if (is_server) return 0;
    double secs = now() - started;
    waitpid(child, 0, 0);
    struct rusage self, children;
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &children);
    printf("%s x%d: %.1fk req/s, cpu %.1f us/req\n", mode, n, total / secs / 1e3,
           (cpu_seconds(&self) + cpu_seconds(&children)) / total * 1e6);
    return 0;
}
