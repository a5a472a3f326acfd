/*
 * verbs_peer: an RC test peer on libibverbs, for the Lightpath interop suite.
 *
 * One process is the server (TCP listener, RESPONDER of the operation), the other the client
 * (connects, REQUESTER). They exchange their QP and buffer details over TCP in the text format
 * of interop/PROTOCOL.md, connect their RC QPs, and the client runs one kind of operation
 * ITERS times, one at a time, checking every result against known patterns. At the end the
 * server checks its own side (received data, written memory, atomic result) and reports its
 * verdict to the client. Both print PASS or FAIL and exit 0 only if both sides passed.
 *
 *   server:  verbs_peer -o OP [options]
 *   client:  verbs_peer -o OP [options] SERVER_HOST
 *
 * No rdma_cm: addresses come from the GID table (by default the IPv4-mapped RoCE v2 GID).
 * Build: gcc -std=gnu11 -O2 -Wall -o verbs_peer verbs_peer.c -libverbs
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#define PROTOCOL_TAG "LP1"
#define DEFAULT_TCP_PORT 18516
#define MAX_LINE 256
#define RECV_WINDOW 256 /* receives kept posted at once by the responder */

/* ------------------------------------------------------------------------ operations */

enum op {
    OP_SEND = 1,
    OP_SEND_IMM = 2,
    OP_WRITE = 3,
    OP_WRITE_IMM = 4,
    OP_READ = 5,
    OP_CMP_SWAP = 6,
    OP_FETCH_ADD = 7,
};

static const struct {
    enum op op;
    const char *name;
    size_t default_size;
} op_table[] = {
    {OP_SEND, "send", 10000},
    {OP_SEND_IMM, "send_imm", 10000},
    {OP_WRITE, "write", 10000},
    {OP_WRITE_IMM, "write_imm", 10000},
    {OP_READ, "read", 1 << 20},
    {OP_CMP_SWAP, "cmp_swap", 8},
    {OP_FETCH_ADD, "fetch_add", 8},
};
#define N_OPS (sizeof(op_table) / sizeof(op_table[0]))

static const char *op_name(enum op op)
{
    for (size_t i = 0; i < N_OPS; i++)
        if (op_table[i].op == op)
            return op_table[i].name;
    return "?";
}

static bool op_from_name(const char *name, enum op *op)
{
    for (size_t i = 0; i < N_OPS; i++)
        if (strcmp(op_table[i].name, name) == 0) {
            *op = op_table[i].op;
            return true;
        }
    return false;
}

static size_t op_default_size(enum op op)
{
    for (size_t i = 0; i < N_OPS; i++)
        if (op_table[i].op == op)
            return op_table[i].default_size;
    return 0;
}

static bool op_is_atomic(enum op op) { return op == OP_CMP_SWAP || op == OP_FETCH_ADD; }
/* Operations that consume a receive WR at the responder. */
static bool op_uses_recv(enum op op)
{
    return op == OP_SEND || op == OP_SEND_IMM || op == OP_WRITE_IMM;
}
static bool op_has_imm(enum op op) { return op == OP_SEND_IMM || op == OP_WRITE_IMM; }

/* ------------------------------------------------------------------------ known values
 * All defined in interop/PROTOCOL.md; the Lightpath side computes the same numbers.
 */

/* Byte i of the pattern with this seed. */
static uint8_t pattern_byte(uint32_t seed, uint32_t i)
{
    uint32_t x = i * 0x9E3779B1u + seed * 0x85EBCA77u;
    x ^= x >> 15;
    return (uint8_t)x;
}

/* Seed of the pattern of iteration k of an operation. */
static uint32_t pattern_seed(enum op op, uint32_t k) { return ((uint32_t)op << 24) | k; }

static void fill_pattern(uint8_t *buf, size_t len, uint32_t seed)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = pattern_byte(seed, (uint32_t)i);
}

/* Returns the offset of the first wrong byte, or -1 if buf holds the pattern. */
static long check_pattern(const uint8_t *buf, size_t len, uint32_t seed)
{
    for (size_t i = 0; i < len; i++)
        if (buf[i] != pattern_byte(seed, (uint32_t)i))
            return (long)i;
    return -1;
}

/* Immediate data of iteration k (host order; on the wire it is big-endian). */
static uint32_t imm_value(enum op op, uint32_t k) { return 0x1F000000u | ((uint32_t)op << 16) | (k & 0xFFFF); }

#define CMP_SWAP_INITIAL 0x1122334455667788ull
#define FETCH_ADD_INITIAL 0xFFFFFFFFFFFFFF00ull
#define POISON_BYTE 0xE5

/* Value of the cmp_swap word before iteration k (k = 0 is the initial value). */
static uint64_t cmp_swap_value(uint32_t k)
{
    return CMP_SWAP_INITIAL ^ ((uint64_t)k * 0x9E3779B97F4A7C15ull);
}

/* Addend of fetch_add iteration k. The first one already wraps past 2^64. */
static uint64_t fetch_add_addend(uint32_t k) { return (uint64_t)(k + 1) * 0x0000000100000001ull + 0x80; }

/* ------------------------------------------------------------------------ options */

struct options {
    const char *device;   /* -d, default: the first device */
    int ib_port;          /* -i */
    int gid_index;        /* -g, -1: auto (IPv4-mapped RoCE v2) */
    int mtu;              /* -m, bytes */
    size_t size;          /* -s, bytes per operation */
    uint32_t iters;       /* -n */
    int tcp_port;         /* -p */
    int timeout_s;        /* -t */
    int retry_cnt;        /* -R: transport retries (rxe treats 7 as infinite) */
    enum op op;           /* -o */
    bool verbose;         /* -v */
    bool inject_fault;    /* -x: requester makes one deliberate mistake (checks the checks) */
    const char *server;   /* client role if set */
};

/* What each side tells the other (one PROTOCOL.md line). */
struct endpoint {
    enum op op;
    uint32_t qpn;
    uint32_t psn;
    uint8_t gid[16];
    int mtu;
    uint64_t addr;
    uint32_t rkey;
    size_t size;
    uint32_t iters;
};

static struct options opt = {
    .device = NULL, .ib_port = 1, .gid_index = -1, .mtu = 1024, .size = 0, .iters = 5,
    .tcp_port = DEFAULT_TCP_PORT, .timeout_s = 60, .retry_cnt = 7, .op = OP_SEND, .verbose = false, .inject_fault = false,
    .server = NULL,
};

static const char *role(void) { return opt.server ? "client" : "server"; }

static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("verbs_peer %s: ", role());
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
}

/* Verification failures are collected (the first few are printed) rather than aborting, so
 * one run reports everything that is wrong. */
static unsigned failures;
static void fail(const char *fmt, ...)
{
    va_list ap;
    failures++;
    if (failures > 20)
        return;
    va_start(ap, fmt);
    printf("verbs_peer %s: FAIL: ", role());
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
}

/* Setup errors: no point going on. Exit code 2. */
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("verbs_peer %s: ERROR: ", role());
    vprintf(fmt, ap);
    printf("\nFAIL verbs_peer %s op=%s (setup error)\n", role(), op_name(opt.op));
    fflush(stdout);
    va_end(ap);
    exit(2);
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "verbs_peer: FAIL: overall timeout (-t) expired\n";
    ssize_t ignored = write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    _exit(1);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int mtu_to_enum(int mtu, enum ibv_mtu *out)
{
    switch (mtu) {
    case 256: *out = IBV_MTU_256; return 0;
    case 512: *out = IBV_MTU_512; return 0;
    case 1024: *out = IBV_MTU_1024; return 0;
    case 2048: *out = IBV_MTU_2048; return 0;
    case 4096: *out = IBV_MTU_4096; return 0;
    default: return -1;
    }
}

static void usage(FILE *f)
{
    fprintf(f,
        "usage: verbs_peer -o OP [options]               (server: responder)\n"
        "       verbs_peer -o OP [options] SERVER_HOST   (client: requester)\n"
        "  -o OP    send | send_imm | write | write_imm | read | cmp_swap | fetch_add\n"
        "  -s SIZE  bytes per operation (default: read 1048576, atomics 8, others 10000)\n"
        "  -n N     iterations (default 5)\n"
        "  -m MTU   path MTU in bytes: 256 512 1024 2048 4096 (default 1024); the smaller of\n"
        "           both sides' values is used\n"
        "  -g IDX   GID index (default: the IPv4-mapped RoCE v2 GID)\n"
        "  -d DEV   RDMA device (default: the first one)   -i PORT  its port (default 1)\n"
        "  -p PORT  TCP port of the out-of-band exchange (default %d)\n"
        "  -t SEC   overall timeout (default 60)           -v       verbose\n"
        "  -R N     QP retry_cnt 0..7 (default 7; note rxe treats 7 as infinite)\n"
        "  -x       client only: make one deliberate mistake in iteration 0 (wrong byte,\n"
        "           address, immediate or operand), so the run must FAIL: tests the checks\n"
        "Exit code: 0 PASS (both sides), 1 FAIL, 2 setup or usage error.\n"
        "Protocol: interop/PROTOCOL.md\n",
        DEFAULT_TCP_PORT);
}

static unsigned long parse_number(const char *s, const char *what)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 0);
    if (errno || *s == '\0' || *end != '\0')
        die("bad %s: %s", what, s);
    return v;
}

static void parse_args(int argc, char **argv)
{
    int c;
    while ((c = getopt(argc, argv, "o:s:n:m:g:d:i:p:t:R:vxh")) != -1) {
        switch (c) {
        case 'o':
            if (!op_from_name(optarg, &opt.op))
                die("unknown operation %s (see -h)", optarg);
            break;
        case 's': opt.size = parse_number(optarg, "size"); break;
        case 'n': opt.iters = (uint32_t)parse_number(optarg, "iteration count"); break;
        case 'm': opt.mtu = (int)parse_number(optarg, "MTU"); break;
        case 'g': opt.gid_index = (int)parse_number(optarg, "GID index"); break;
        case 'd': opt.device = optarg; break;
        case 'i': opt.ib_port = (int)parse_number(optarg, "port"); break;
        case 'p': opt.tcp_port = (int)parse_number(optarg, "TCP port"); break;
        case 't': opt.timeout_s = (int)parse_number(optarg, "timeout"); break;
        case 'R': opt.retry_cnt = (int)parse_number(optarg, "retry count"); break;
        case 'v': opt.verbose = true; break;
        case 'x': opt.inject_fault = true; break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); exit(2);
        }
    }
    if (optind < argc)
        opt.server = argv[optind++];
    if (optind < argc) {
        usage(stderr);
        exit(2);
    }
    enum ibv_mtu ignored;
    if (mtu_to_enum(opt.mtu, &ignored))
        die("-m must be 256, 512, 1024, 2048 or 4096");
    if (op_is_atomic(opt.op)) {
        if (opt.size != 0 && opt.size != 8)
            die("atomics operate on 8 bytes; -s must be 8 (or left out)");
        opt.size = 8;
    } else if (opt.size == 0) {
        opt.size = op_default_size(opt.op);
    }
    if (opt.retry_cnt < 0 || opt.retry_cnt > 7)
        die("-R must be 0..7");
    if (opt.iters == 0 || opt.iters > 0xFFFF)
        die("-n must be 1..65535");
    if (opt.size > (1u << 30) || (uint64_t)opt.size * opt.iters > (1ull << 31))
        die("size * iterations must stay below 2 GiB");
}

/* ------------------------------------------------------------------------ out-of-band TCP */

static int tcp_listen_accept(int port)
{
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0), conn;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
        .sin_addr.s_addr = htonl(INADDR_ANY)};
    if (fd < 0)
        die("socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || listen(fd, 1))
        die("cannot listen on TCP port %d: %s", port, strerror(errno));
    say("listening on TCP port %d", port);
    conn = accept(fd, NULL, NULL);
    if (conn < 0)
        die("accept: %s", strerror(errno));
    close(fd);
    setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return conn;
}

static int tcp_connect(const char *host, int port)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res, *ai;
    char service[16];
    int one = 1, fd = -1, err;
    snprintf(service, sizeof service, "%d", port);
    if ((err = getaddrinfo(host, service, &hints, &res)))
        die("%s: %s", host, gai_strerror(err));
    /* The server may not be listening yet: retry for a while. */
    for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
        for (ai = res; ai; ai = ai->ai_next) {
            fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
            if (fd < 0)
                continue;
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
                break;
            close(fd);
            fd = -1;
        }
        if (fd < 0)
            usleep(100 * 1000);
    }
    freeaddrinfo(res);
    if (fd < 0)
        die("cannot connect to %s:%d", host, port);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static void send_line(int fd, const char *line)
{
    size_t len = strlen(line), off = 0;
    if (opt.verbose)
        say("-> %.*s", (int)len - 1, line);
    while (off < len) {
        ssize_t n = write(fd, line + off, len - off);
        if (n <= 0)
            die("TCP write: %s", n < 0 ? strerror(errno) : "closed");
        off += (size_t)n;
    }
}

/* Reads one '\n'-terminated line (without the '\n') within timeout_ms. Returns false on
 * timeout, EOF or an over-long line. */
static bool recv_line(int fd, char *line, size_t cap, int timeout_ms)
{
    size_t len = 0;
    double deadline = now_s() + timeout_ms / 1000.0;
    line[0] = '\0';
    while (len + 1 < cap) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = (int)((deadline - now_s()) * 1000);
        char ch;
        if (left <= 0 || poll(&p, 1, left) <= 0 || read(fd, &ch, 1) != 1)
            break;
        if (ch == '\n') {
            line[len] = '\0';
            if (opt.verbose)
                say("<- %s", line);
            return true;
        }
        line[len++] = ch;
        line[len] = '\0';
    }
    return false;
}

static void format_endpoint(const struct endpoint *e, char *out, size_t cap)
{
    char gid_hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(gid_hex + 2 * i, 3, "%02x", e->gid[i]);
    snprintf(out, cap, "%s %s %06x %06x %s %d %016" PRIx64 " %08x %zu %u\n", PROTOCOL_TAG,
        op_name(e->op), e->qpn, e->psn, gid_hex, e->mtu, e->addr, e->rkey, e->size, e->iters);
}

static bool parse_endpoint(const char *line, struct endpoint *e)
{
    char tag[8], op[16], gid_hex[40];
    unsigned qpn, psn, rkey, iters;
    unsigned long long addr;
    unsigned long size;
    int mtu, used = 0;
    if (sscanf(line, "%7s %15s %x %x %39s %d %llx %x %lu %u%n", tag, op, &qpn, &psn, gid_hex,
            &mtu, &addr, &rkey, &size, &iters, &used) != 10 || line[used] != '\0')
        return false;
    if (strcmp(tag, PROTOCOL_TAG) != 0 || !op_from_name(op, &e->op) || strlen(gid_hex) != 32 ||
        qpn > 0xFFFFFF || psn > 0xFFFFFF)
        return false;
    for (int i = 0; i < 16; i++) {
        unsigned byte;
        if (sscanf(gid_hex + 2 * i, "%2x", &byte) != 1)
            return false;
        e->gid[i] = (uint8_t)byte;
    }
    e->qpn = qpn;
    e->psn = psn;
    e->mtu = mtu;
    e->addr = addr;
    e->rkey = rkey;
    e->size = size;
    e->iters = iters;
    return true;
}

/* ------------------------------------------------------------------------ verbs setup */

struct ctx {
    struct ibv_context *dev;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    uint8_t *buf;
    size_t buf_len;
    int gid_index;
    union ibv_gid gid;
    enum ibv_mtu active_mtu;
};

static bool gid_is_v4_mapped(const uint8_t *g)
{
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g, prefix, sizeof prefix) == 0;
}

static int pick_gid_index(struct ibv_context *dev, int port, int table_len)
{
    for (int i = 0; i < table_len && i < 256; i++) {
        struct ibv_gid_entry entry;
        if (ibv_query_gid_ex(dev, (uint32_t)port, (uint32_t)i, &entry, 0))
            continue;
        if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && gid_is_v4_mapped(entry.gid.raw))
            return i;
    }
    return -1;
}

static void setup_verbs(struct ctx *c, size_t buf_len)
{
    int n;
    struct ibv_device **list = ibv_get_device_list(&n), *chosen = NULL;
    if (!list || n == 0)
        die("no RDMA devices");
    for (int i = 0; i < n && !chosen; i++)
        if (!opt.device || strcmp(ibv_get_device_name(list[i]), opt.device) == 0)
            chosen = list[i];
    if (!chosen)
        die("no device named %s", opt.device);
    c->dev = ibv_open_device(chosen);
    if (!c->dev)
        die("cannot open %s", ibv_get_device_name(chosen));
    ibv_free_device_list(list);

    struct ibv_port_attr port;
    if (ibv_query_port(c->dev, (uint8_t)opt.ib_port, &port))
        die("cannot query port %d", opt.ib_port);
    if (port.state != IBV_PORT_ACTIVE)
        die("port %d is not ACTIVE", opt.ib_port);
    c->active_mtu = port.active_mtu;
    c->gid_index = opt.gid_index >= 0 ? opt.gid_index
                                      : pick_gid_index(c->dev, opt.ib_port, port.gid_tbl_len);
    if (c->gid_index < 0)
        die("no IPv4-mapped RoCE v2 GID on port %d (give -g)", opt.ib_port);
    if (ibv_query_gid(c->dev, (uint8_t)opt.ib_port, c->gid_index, &c->gid))
        die("cannot read GID %d", c->gid_index);

    c->pd = ibv_alloc_pd(c->dev);
    if (!c->pd)
        die("ibv_alloc_pd failed");
    c->cq = ibv_create_cq(c->dev, 2 * RECV_WINDOW + 16, NULL, NULL, 0);
    if (!c->cq)
        die("ibv_create_cq failed");
    struct ibv_qp_init_attr qia = {
        .send_cq = c->cq, .recv_cq = c->cq, .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 16, .max_recv_wr = RECV_WINDOW, .max_send_sge = 1, .max_recv_sge = 1},
    };
    c->qp = ibv_create_qp(c->pd, &qia);
    if (!c->qp)
        die("ibv_create_qp failed: %s", strerror(errno));

    c->buf_len = buf_len;
    if (posix_memalign((void **)&c->buf, 4096, buf_len))
        die("out of memory (%zu bytes)", buf_len);
    memset(c->buf, POISON_BYTE, buf_len);
    c->mr = ibv_reg_mr(c->pd, c->buf, buf_len,
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
            IBV_ACCESS_REMOTE_ATOMIC);
    if (!c->mr)
        die("ibv_reg_mr(%zu bytes) failed: %s", buf_len, strerror(errno));

    struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .pkey_index = 0,
        .port_num = (uint8_t)opt.ib_port,
        .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
            IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC};
    if (ibv_modify_qp(c->qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        die("modify QP to INIT failed: %s", strerror(errno));
}

static void connect_qp(struct ctx *c, const struct endpoint *local, const struct endpoint *remote)
{
    enum ibv_mtu path_mtu;
    int mtu = remote->mtu < local->mtu ? remote->mtu : local->mtu;
    if (mtu_to_enum(mtu, &path_mtu))
        die("peer sent an invalid MTU %d", remote->mtu);
    if (path_mtu > c->active_mtu)
        die("path MTU %d exceeds the port's active MTU (enum %d): raise the link MTU", mtu, c->active_mtu);
    struct ibv_qp_attr rtr = {
        .qp_state = IBV_QPS_RTR, .path_mtu = path_mtu, .dest_qp_num = remote->qpn,
        .rq_psn = remote->psn, .max_dest_rd_atomic = 16, .min_rnr_timer = 12,
        .ah_attr = {.is_global = 1, .port_num = (uint8_t)opt.ib_port,
            .grh = {.sgid_index = (uint8_t)c->gid_index, .hop_limit = 64}},
    };
    memcpy(rtr.ah_attr.grh.dgid.raw, remote->gid, 16);
    if (ibv_modify_qp(c->qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
            IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        die("modify QP to RTR failed: %s", strerror(errno));
    struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = (uint8_t)opt.retry_cnt,
        .rnr_retry = 7, .sq_psn = local->psn, .max_rd_atomic = 16};
    if (ibv_modify_qp(c->qp, &rts, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
            IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        die("modify QP to RTS failed: %s", strerror(errno));
    say("connected: path MTU %d, local QPN 0x%06x PSN 0x%06x, remote QPN 0x%06x PSN 0x%06x",
        mtu, local->qpn, local->psn, remote->qpn, remote->psn);
}

/* Waits for one completion until the deadline. Returns false on timeout. */
static bool poll_one(struct ctx *c, struct ibv_wc *wc, double deadline)
{
    for (;;) {
        int n = ibv_poll_cq(c->cq, 1, wc);
        if (n < 0)
            die("ibv_poll_cq failed");
        if (n == 1)
            return true;
        if (now_s() > deadline)
            return false;
    }
}

static void post_recv_slot(struct ctx *c, uint32_t k)
{
    struct ibv_sge sge = {.addr = (uintptr_t)(c->buf + (size_t)k * opt.size),
        .length = (uint32_t)opt.size, .lkey = c->mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = k, .sg_list = &sge, .num_sge = 1}, *bad;
    /* WRITE with immediate carries its data by RDMA; the receive only takes the immediate. */
    if (opt.op == OP_WRITE_IMM)
        wr.num_sge = 0;
    if (ibv_post_recv(c->qp, &wr, &bad))
        die("ibv_post_recv failed");
}

/* ------------------------------------------------------------------------ local endpoint */

static void fill_local_endpoint(struct ctx *c, struct endpoint *e)
{
    e->op = opt.op;
    e->qpn = c->qp->qp_num;
    e->psn = (uint32_t)lrand48() & 0xFFFFFF;
    memcpy(e->gid, c->gid.raw, 16);
    e->mtu = opt.mtu;
    e->addr = (uintptr_t)c->buf;
    e->rkey = c->mr->rkey;
    e->size = opt.size;
    e->iters = opt.iters;
}

static void check_agreement(const struct endpoint *remote)
{
    if (remote->op != opt.op || remote->size != opt.size || remote->iters != opt.iters)
        die("peer wants op=%s size=%zu iters=%u, we have op=%s size=%zu iters=%u",
            op_name(remote->op), remote->size, remote->iters, op_name(opt.op), opt.size, opt.iters);
}

/* Buffer size per role: slot k (k < iters) of `size` bytes for data operations; one 8-byte
 * word for atomics (the responder's target, the requester's result). */
static size_t buffer_len(void)
{
    return op_is_atomic(opt.op) ? 4096 : opt.size * opt.iters;
}

/* ------------------------------------------------------------------------ server: responder */

/* Checks one receive completion of iteration k. */
static void check_recv(struct ctx *c, const struct ibv_wc *wc, uint32_t k)
{
    if (wc->status != IBV_WC_SUCCESS) {
        fail("receive %u completed with status %s", k, ibv_wc_status_str(wc->status));
        return;
    }
    if (wc->wr_id != k)
        fail("receive completion %u has wr_id %" PRIu64 " (out of order)", k, wc->wr_id);
    enum ibv_wc_opcode want = opt.op == OP_WRITE_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
    if (wc->opcode != want)
        fail("receive %u: opcode %d, expected %d", k, wc->opcode, want);
    if (wc->byte_len != opt.size)
        fail("receive %u: byte_len %u, expected %zu", k, wc->byte_len, opt.size);
    if (op_has_imm(opt.op)) {
        if (!(wc->wc_flags & IBV_WC_WITH_IMM))
            fail("receive %u: no immediate data", k);
        else if (ntohl(wc->imm_data) != imm_value(opt.op, k))
            fail("receive %u: immediate 0x%08x, expected 0x%08x", k, ntohl(wc->imm_data),
                imm_value(opt.op, k));
    } else if (wc->wc_flags & IBV_WC_WITH_IMM) {
        fail("receive %u: unexpected immediate data", k);
    }
    /* For SEND the data is in the receive buffer, for WRITE with immediate it was written to
     * slot k before the immediate's completion: either way slot k must hold pattern k now. */
    long bad = check_pattern(c->buf + (size_t)k * opt.size, opt.size, pattern_seed(opt.op, k));
    if (bad >= 0)
        fail("iteration %u: data wrong at byte %ld of %zu", k, bad, opt.size);
}

static int run_server(void)
{
    struct ctx c = {0};
    struct endpoint local, remote;
    char line[MAX_LINE];

    setup_verbs(&c, buffer_len());
    if (opt.op == OP_READ)
        for (uint32_t k = 0; k < opt.iters; k++)
            fill_pattern(c.buf + (size_t)k * opt.size, opt.size, pattern_seed(opt.op, k));
    if (opt.op == OP_CMP_SWAP)
        *(volatile uint64_t *)c.buf = CMP_SWAP_INITIAL;
    if (opt.op == OP_FETCH_ADD)
        *(volatile uint64_t *)c.buf = FETCH_ADD_INITIAL;
    /* Receives must be posted before the peer may send: before our line goes out. */
    uint32_t posted = 0, received = 0;
    if (op_uses_recv(opt.op))
        for (; posted < opt.iters && posted < RECV_WINDOW; posted++)
            post_recv_slot(&c, posted);
    fill_local_endpoint(&c, &local);
    say("op=%s size=%zu iters=%u gid_index=%d", op_name(opt.op), opt.size, opt.iters, c.gid_index);

    int fd = tcp_listen_accept(opt.tcp_port);
    if (!recv_line(fd, line, sizeof line, opt.timeout_s * 1000) || !parse_endpoint(line, &remote))
        die("bad or missing client line: \"%s\"", line);
    check_agreement(&remote);
    connect_qp(&c, &local, &remote);
    format_endpoint(&local, line, sizeof line);
    send_line(fd, line);

    /* Serve receives while waiting for the client's DONE line. */
    double deadline = now_s() + opt.timeout_s;
    bool done = false, client_pass = false;
    while (!done || received < (op_uses_recv(opt.op) ? opt.iters : 0)) {
        struct ibv_wc wc;
        int n = ibv_poll_cq(c.cq, 1, &wc);
        if (n < 0)
            die("ibv_poll_cq failed");
        if (n == 1) {
            if (!op_uses_recv(opt.op) || received >= opt.iters) {
                fail("unexpected completion: opcode %d status %s", wc.opcode, ibv_wc_status_str(wc.status));
            } else {
                check_recv(&c, &wc, received);
                received++;
                if (posted < opt.iters)
                    post_recv_slot(&c, posted++);
            }
            continue;
        }
        if (!done) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, 0) > 0) {
                if (!recv_line(fd, line, sizeof line, 5000))
                    die("connection to the client lost before DONE");
                if (strncmp(line, "DONE ", 5) != 0)
                    die("expected DONE, got \"%s\"", line);
                done = true;
                client_pass = strcmp(line + 5, "PASS") == 0;
                /* Every operation the client posted has completed (been acknowledged), so
                 * the matching receive completions are due now: allow a short grace only. */
                if (deadline > now_s() + 5)
                    deadline = now_s() + 5;
            }
        }
        if (now_s() > deadline) {
            fail("timeout: %u of %u receives completed, DONE %s", received,
                op_uses_recv(opt.op) ? opt.iters : 0, done ? "received" : "not received");
            break;
        }
    }

    /* Final state of our memory. */
    if (opt.op == OP_WRITE || opt.op == OP_WRITE_IMM) {
        for (uint32_t k = 0; k < opt.iters; k++) {
            long bad = check_pattern(c.buf + (size_t)k * opt.size, opt.size, pattern_seed(opt.op, k));
            if (bad >= 0)
                fail("slot %u written wrongly: byte %ld of %zu", k, bad, opt.size);
        }
    } else if (opt.op == OP_READ) {
        for (uint32_t k = 0; k < opt.iters; k++)
            if (check_pattern(c.buf + (size_t)k * opt.size, opt.size, pattern_seed(opt.op, k)) >= 0)
                fail("slot %u changed by READs", k);
    } else if (opt.op == OP_CMP_SWAP) {
        uint64_t v = *(volatile uint64_t *)c.buf;
        if (v != cmp_swap_value(opt.iters))
            fail("final cmp_swap word 0x%016" PRIx64 ", expected 0x%016" PRIx64, v, cmp_swap_value(opt.iters));
    } else if (opt.op == OP_FETCH_ADD) {
        uint64_t want = FETCH_ADD_INITIAL, v = *(volatile uint64_t *)c.buf;
        for (uint32_t k = 0; k < opt.iters; k++)
            want += fetch_add_addend(k);
        if (v != want)
            fail("final fetch_add word 0x%016" PRIx64 ", expected 0x%016" PRIx64, v, want);
    }

    snprintf(line, sizeof line, "RESULT %s\n", failures ? "FAIL" : "PASS");
    if (done)
        send_line(fd, line);
    close(fd);
    if (!client_pass)
        printf("verbs_peer server: the client reported FAIL (or never reported)\n");
    bool pass = failures == 0 && client_pass;
    printf("%s verbs_peer server op=%s size=%zu iters=%u mtu=%d (own checks: %u failures)\n",
        pass ? "PASS" : "FAIL", op_name(opt.op), opt.size, opt.iters, opt.mtu, failures);
    return pass ? 0 : 1;
}

/* ------------------------------------------------------------------------ client: requester */

static void run_one(struct ctx *c, const struct endpoint *remote, uint32_t k, double deadline)
{
    uint8_t *slot = c->buf + (op_is_atomic(opt.op) ? 0 : (size_t)k * opt.size);
    struct ibv_sge sge = {.addr = (uintptr_t)slot, .length = (uint32_t)opt.size, .lkey = c->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = k, .sg_list = &sge, .num_sge = 1, .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    uint64_t remote_slot = remote->addr + (op_is_atomic(opt.op) ? 0 : (uint64_t)k * opt.size);
    uint64_t expect_orig = 0;

    switch (opt.op) {
    case OP_SEND:
    case OP_SEND_IMM:
        fill_pattern(slot, opt.size, pattern_seed(opt.op, k));
        wr.opcode = opt.op == OP_SEND ? IBV_WR_SEND : IBV_WR_SEND_WITH_IMM;
        wr.imm_data = htonl(imm_value(opt.op, k));
        break;
    case OP_WRITE:
    case OP_WRITE_IMM:
        fill_pattern(slot, opt.size, pattern_seed(opt.op, k));
        wr.opcode = opt.op == OP_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(imm_value(opt.op, k));
        wr.wr.rdma.remote_addr = remote_slot;
        wr.wr.rdma.rkey = remote->rkey;
        break;
    case OP_READ:
        wr.opcode = IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = remote_slot;
        wr.wr.rdma.rkey = remote->rkey;
        break;
    case OP_CMP_SWAP:
        wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
        wr.wr.atomic.remote_addr = remote_slot;
        wr.wr.atomic.rkey = remote->rkey;
        if (k < opt.iters) {
            wr.wr.atomic.compare_add = cmp_swap_value(k);
            wr.wr.atomic.swap = cmp_swap_value(k + 1);
            expect_orig = cmp_swap_value(k);
        } else { /* the extra, failing compare: memory must stay unchanged */
            wr.wr.atomic.compare_add = ~cmp_swap_value(opt.iters);
            wr.wr.atomic.swap = 0xDEADDEADDEADDEADull;
            expect_orig = cmp_swap_value(opt.iters);
        }
        break;
    case OP_FETCH_ADD: {
        uint64_t before = FETCH_ADD_INITIAL;
        for (uint32_t j = 0; j < k; j++)
            before += fetch_add_addend(j);
        wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
        wr.wr.atomic.remote_addr = remote_slot;
        wr.wr.atomic.rkey = remote->rkey;
        wr.wr.atomic.compare_add = fetch_add_addend(k);
        expect_orig = before;
        break;
    }
    }
    if (opt.inject_fault && k == 0) {
        switch (opt.op) {
        case OP_SEND: slot[opt.size / 2] ^= 0x01; break;
        case OP_SEND_IMM:
        case OP_WRITE_IMM: wr.imm_data = htonl(imm_value(opt.op, k) ^ 1); break;
        case OP_WRITE:
        case OP_READ: wr.wr.rdma.remote_addr += 1; break;
        case OP_CMP_SWAP: wr.wr.atomic.compare_add ^= 1; break;
        case OP_FETCH_ADD: wr.wr.atomic.compare_add += 1; break;
        }
        say("injecting a fault into iteration 0 (-x)");
    }
    if (op_is_atomic(opt.op))
        memset(slot, POISON_BYTE, 8);
    if (ibv_post_send(c->qp, &wr, &bad))
        die("ibv_post_send (iteration %u) failed: %s", k, strerror(errno));

    struct ibv_wc wc;
    if (!poll_one(c, &wc, deadline)) {
        fail("iteration %u: no completion before the timeout", k);
        return;
    }
    if (wc.status != IBV_WC_SUCCESS) {
        fail("iteration %u completed with status %s (vendor error 0x%x)", k,
            ibv_wc_status_str(wc.status), wc.vendor_err);
        return;
    }
    if (wc.wr_id != k)
        fail("iteration %u: completion has wr_id %" PRIu64, k, wc.wr_id);
    if (opt.op == OP_READ) {
        long bad_at = check_pattern(slot, opt.size, pattern_seed(opt.op, k));
        if (bad_at >= 0)
            fail("READ %u: data wrong at byte %ld of %zu (got 0x%02x, want 0x%02x)", k, bad_at,
                opt.size, slot[bad_at], pattern_byte(pattern_seed(opt.op, k), (uint32_t)bad_at));
    }
    if (op_is_atomic(opt.op)) {
        uint64_t orig;
        memcpy(&orig, slot, 8);
        if (orig != expect_orig)
            fail("%s %u: original value 0x%016" PRIx64 ", expected 0x%016" PRIx64, op_name(opt.op), k,
                orig, expect_orig);
    }
}

static int run_client(void)
{
    struct ctx c = {0};
    struct endpoint local, remote;
    char line[MAX_LINE];

    setup_verbs(&c, buffer_len());
    fill_local_endpoint(&c, &local);
    say("op=%s size=%zu iters=%u gid_index=%d server=%s", op_name(opt.op), opt.size, opt.iters,
        c.gid_index, opt.server);
    int fd = tcp_connect(opt.server, opt.tcp_port);
    format_endpoint(&local, line, sizeof line);
    send_line(fd, line);
    if (!recv_line(fd, line, sizeof line, opt.timeout_s * 1000) || !parse_endpoint(line, &remote))
        die("bad or missing server line: \"%s\"", line);
    check_agreement(&remote);
    connect_qp(&c, &local, &remote);

    double start = now_s(), deadline = start + opt.timeout_s;
    /* cmp_swap runs one extra operation whose compare must fail */
    uint32_t total = opt.op == OP_CMP_SWAP ? opt.iters + 1 : opt.iters;
    for (uint32_t k = 0; k < total && failures == 0; k++)
        run_one(&c, &remote, k, deadline);
    double seconds = now_s() - start;

    snprintf(line, sizeof line, "DONE %s\n", failures ? "FAIL" : "PASS");
    send_line(fd, line);
    bool server_pass = false;
    if (!recv_line(fd, line, sizeof line, opt.timeout_s * 1000))
        printf("verbs_peer client: FAIL: no RESULT line from the server\n");
    else if (strcmp(line, "RESULT PASS") == 0)
        server_pass = true;
    else
        printf("verbs_peer client: FAIL: server says \"%s\"\n", line);
    close(fd);
    bool pass = failures == 0 && server_pass;
    printf("%s verbs_peer client op=%s size=%zu iters=%u mtu=%d time=%.3fs (own checks: %u failures)\n",
        pass ? "PASS" : "FAIL", op_name(opt.op), opt.size, opt.iters, opt.mtu, seconds, failures);
    return pass ? 0 : 1;
}

int main(int argc, char **argv)
{
    parse_args(argc, argv);
    srand48((long)getpid() ^ (long)time(NULL));
    signal(SIGPIPE, SIG_IGN);
    signal(SIGALRM, on_alarm);
    alarm((unsigned)opt.timeout_s + 10);
    return opt.server ? run_client() : run_server();
}
