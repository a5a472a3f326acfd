/*
 * Runs as every rank of a job (started by the crate's tests through `lightpath launch`'s
 * library function): checks the C ABI's results against values computed here.
 *
 *   collectives all      every call, blocking and nonblocking, several sizes and types; exits 0
 *                        if all results are right
 *   collectives invalid  bad arguments get LP_ERR_INVALID_ARGUMENT and a message, and the
 *                        communicator still works afterwards
 *   collectives die      rank 1 leaves after a barrier; the others' next call must fail naming it
 *   collectives die-nonblocking
 *                        the same with nonblocking calls outstanding: lp_wait on the last one
 *                        must fail naming rank 1 within the timeout
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lightpath_coll.h"

static int rank_, size_;

#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, "rank %d: check failed at line %d: ", rank_, __LINE__);              \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fprintf(stderr, "\n");                                                               \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

#define OK(call)                                                                                 \
    do {                                                                                         \
        int status_ = (call);                                                                    \
        CHECK(status_ == LP_OK, "%s returned %s: %s", #call, lp_status_name(status_),            \
              lp_last_error());                                                                  \
    } while (0)

static long value(int rank, size_t i) { return (long)((rank * 7 + i * 13) % 5) - 2; }

static long sum_at(size_t i) {
    long s = 0;
    for (int r = 0; r < size_; r++) s += value(r, i);
    return s;
}

static long max_at(size_t i) {
    long m = value(0, i);
    for (int r = 1; r < size_; r++)
        if (value(r, i) > m) m = value(r, i);
    return m;
}

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    CHECK(p != NULL, "out of memory");
    return p;
}

static void check_nonblocking(lp_comm *comm);

static void check_all(lp_comm *comm) {
    static const size_t sizes[] = {0, 1, 7, 1000, 70000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        size_t p = (size_t)size_;
        float *f = xmalloc(n * sizeof *f);
        long *in = xmalloc(n * sizeof *in), *out = xmalloc(n * sizeof *out);
        double *d = xmalloc(n * sizeof *d);
        unsigned char *bytes = xmalloc(n), *gathered = xmalloc(n * p);
        int *scatter_in = xmalloc(n * p * sizeof *scatter_in), *scatter_out = xmalloc(n * sizeof *scatter_out);
        long *a2a_in = xmalloc(n * p * sizeof *a2a_in), *a2a_out = xmalloc(n * p * sizeof *a2a_out);

        /* allreduce f32 sum, in place (NULL sendbuf) */
        for (size_t i = 0; i < n; i++) f[i] = (float)value(rank_, i);
        OK(lp_allreduce(comm, NULL, f, n, LP_F32, LP_SUM));
        for (size_t i = 0; i < n; i++) CHECK(f[i] == (float)sum_at(i), "allreduce f32 n=%zu i=%zu", n, i);

        /* allreduce i64 max, out of place */
        for (size_t i = 0; i < n; i++) in[i] = value(rank_, i);
        OK(lp_allreduce(comm, in, out, n, LP_I64, LP_MAX));
        for (size_t i = 0; i < n; i++) CHECK(out[i] == max_at(i), "allreduce i64 max n=%zu i=%zu", n, i);
        for (size_t i = 0; i < n; i++) CHECK(in[i] == value(rank_, i), "allreduce changed its input");

        /* allreduce f64 avg, in place (sendbuf == recvbuf) */
        for (size_t i = 0; i < n; i++) d[i] = (double)(value(rank_, i) * size_);
        OK(lp_allreduce(comm, d, d, n, LP_F64, LP_AVG));
        for (size_t i = 0; i < n; i++) CHECK(d[i] == (double)sum_at(i), "allreduce f64 avg n=%zu i=%zu", n, i);

        /* reduce i64 sum to the last rank: the others' buffers stay as they were */
        for (size_t i = 0; i < n; i++) out[i] = value(rank_, i);
        OK(lp_reduce(comm, out, n, LP_I64, LP_SUM, size_ - 1));
        for (size_t i = 0; i < n; i++)
            CHECK(out[i] == (rank_ == size_ - 1 ? sum_at(i) : value(rank_, i)), "reduce n=%zu i=%zu", n, i);

        /* broadcast f64 from rank 1 % size */
        int root = 1 % size_;
        for (size_t i = 0; i < n; i++) d[i] = rank_ == root ? (double)value(root, i) : -99.0;
        OK(lp_broadcast(comm, d, n, LP_F64, root));
        for (size_t i = 0; i < n; i++) CHECK(d[i] == (double)value(root, i), "broadcast n=%zu i=%zu", n, i);

        /* allgather u8, out of place and in place */
        for (size_t i = 0; i < n; i++) bytes[i] = (unsigned char)value(rank_, i);
        OK(lp_allgather(comm, bytes, gathered, n, LP_U8));
        for (size_t r = 0; r < p; r++)
            for (size_t i = 0; i < n; i++)
                CHECK(gathered[r * n + i] == (unsigned char)value((int)r, i), "allgather n=%zu", n);
        memset(gathered, 0, n * p);
        memcpy(gathered + (size_t)rank_ * n, bytes, n);
        OK(lp_allgather(comm, NULL, gathered, n, LP_U8));
        for (size_t r = 0; r < p; r++)
            for (size_t i = 0; i < n; i++)
                CHECK(gathered[r * n + i] == (unsigned char)value((int)r, i), "allgather in place n=%zu", n);

        /* reduce_scatter i32 sum */
        for (size_t i = 0; i < n * p; i++) scatter_in[i] = (int)value(rank_, i);
        OK(lp_reduce_scatter(comm, scatter_in, scatter_out, n, LP_I32, LP_SUM));
        for (size_t i = 0; i < n; i++)
            CHECK(scatter_out[i] == (int)sum_at((size_t)rank_ * n + i), "reduce_scatter n=%zu i=%zu", n, i);

        /* alltoall i64: block r of rank q's input is q * 1000000 + r * 1000 + i */
        for (size_t r = 0; r < p; r++)
            for (size_t i = 0; i < n; i++) a2a_in[r * n + i] = (long)rank_ * 1000000 + (long)r * 1000 + (long)(i % 1000);
        OK(lp_alltoall(comm, a2a_in, a2a_out, n, LP_I64));
        for (size_t q = 0; q < p; q++)
            for (size_t i = 0; i < n; i++)
                CHECK(a2a_out[q * n + i] == (long)q * 1000000 + (long)rank_ * 1000 + (long)(i % 1000),
                      "alltoall n=%zu", n);

        free(f), free(in), free(out), free(d), free(bytes), free(gathered);
        free(scatter_in), free(scatter_out), free(a2a_in), free(a2a_out);
    }

    /* f16 and bf16 sums of ones: the bit patterns of size_ as a half / bfloat16 */
    static const unsigned short f16_of[] = {0, 0x3C00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600, 0x4700, 0x4800};
    static const unsigned short bf16_of[] = {0, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100};
    if (size_ <= 8) {
        unsigned short h[33], b[33];
        for (int i = 0; i < 33; i++) h[i] = 0x3C00, b[i] = 0x3F80;
        OK(lp_allreduce(comm, NULL, h, 33, LP_F16, LP_SUM));
        OK(lp_allreduce(comm, NULL, b, 33, LP_BF16, LP_SUM));
        for (int i = 0; i < 33; i++) CHECK(h[i] == f16_of[size_] && b[i] == bf16_of[size_], "f16/bf16 sums");
    }

    /* allgatherv: rank r gives r + 1 elements of value r */
    {
        size_t counts[64], total = 0;
        CHECK(size_ <= 64, "at most 64 ranks here");
        for (int r = 0; r < size_; r++) counts[r] = (size_t)r + 1, total += counts[r];
        int mine[64], all[64 * 65 / 2];
        for (int i = 0; i <= rank_; i++) mine[i] = rank_;
        OK(lp_allgatherv(comm, mine, all, counts, LP_I32));
        size_t at = 0;
        for (int r = 0; r < size_; r++)
            for (int i = 0; i <= r; i++) CHECK(all[at++] == r, "allgatherv from rank %d", r);
        CHECK(at == total, "allgatherv total");
    }

    /* alltoallv: rank q sends r + 1 copies of q * 100 + r to rank r */
    {
        size_t sendcounts[64], recvcounts[64], sent = 0, received = 0;
        for (int r = 0; r < size_; r++) {
            sendcounts[r] = (size_t)r + 1, sent += sendcounts[r];
            recvcounts[r] = (size_t)rank_ + 1, received += recvcounts[r];
        }
        long *sbuf = xmalloc(sent * sizeof *sbuf), *rbuf = xmalloc(received * sizeof *rbuf);
        size_t at = 0;
        for (int r = 0; r < size_; r++)
            for (size_t i = 0; i < sendcounts[r]; i++) sbuf[at++] = rank_ * 100 + r;
        OK(lp_alltoallv(comm, sbuf, sendcounts, rbuf, recvcounts, LP_I64));
        at = 0;
        for (int q = 0; q < size_; q++)
            for (size_t i = 0; i < recvcounts[q]; i++) CHECK(rbuf[at++] == q * 100 + rank_, "alltoallv from %d", q);
        free(sbuf), free(rbuf);
    }

    /* send/recv around a ring */
    if (size_ > 1) {
        int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
        double token[5] = {rank_, rank_ + 0.5, 2, 3, 4}, got[5] = {0};
        if (rank_ % 2 == 0) {
            OK(lp_send(comm, token, 5, LP_F64, next));
            OK(lp_recv(comm, got, 5, LP_F64, prev));
        } else {
            OK(lp_recv(comm, got, 5, LP_F64, prev));
            OK(lp_send(comm, token, 5, LP_F64, next));
        }
        CHECK(got[0] == prev && got[1] == prev + 0.5, "recv from rank %d", prev);
    }

    /* split: even and odd ranks, reversed by key; odd ranks of a 1-rank job take no part */
    {
        lp_comm *half = NULL;
        int color = rank_ % 2;
        OK(lp_comm_split(comm, color, -rank_, &half));
        CHECK(half != NULL, "split gave no communicator");
        int members = (size_ - color + 1) / 2;
        CHECK(lp_comm_size(half) == members, "split size %d, want %d", lp_comm_size(half), members);
        CHECK(lp_comm_rank(half) == members - 1 - rank_ / 2, "split rank %d", lp_comm_rank(half));
        long one = 1;
        OK(lp_allreduce(half, NULL, &one, 1, LP_I64, LP_SUM));
        CHECK(one == members, "allreduce over the split gave %ld", one);
        lp_comm_destroy(half);
        lp_comm *none = (lp_comm *)&one;
        OK(lp_comm_split(comm, -1, 0, &none));
        CHECK(none == NULL, "a negative color still gave a communicator");
    }
    OK(lp_barrier(comm));
    check_nonblocking(comm);
}

static void expect_invalid(int status, const char *what);

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void sleep_us(long us) {
    struct timespec t = {us / 1000000, (us % 1000000) * 1000L};
    nanosleep(&t, NULL);
}

/* Polls a request with lp_test until it completes; returns its status. */
static int poll_to_completion(lp_request *req, long *polls) {
    int done = 0, status = LP_OK;
    *polls = 0;
    while (!done) {
        status = lp_test(req, &done);
        ++*polls;
        if (!done) sleep_us(20); /* the application's work would go here */
    }
    return status;
}

/* Nonblocking calls: several outstanding at once, completed in another order than issued
 * (the last first, one by polling), results checked against the values computed here. */
static void check_nonblocking(lp_comm *comm) {
    static const size_t sizes[] = {0, 1, 7, 1000, 70000};
    size_t p = (size_t)size_;
    int root = (size_ - 1) % size_;
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        float *f = xmalloc(n * sizeof *f);
        long *in = xmalloc(n * sizeof *in), *out = xmalloc(n * sizeof *out);
        double *d = xmalloc(n * sizeof *d);
        unsigned char *bytes = xmalloc(n), *gathered = xmalloc(n * p);
        int *scatter_in = xmalloc(n * p * sizeof *scatter_in), *scatter_out = xmalloc(n * sizeof *scatter_out);
        long *a2a_in = xmalloc(n * p * sizeof *a2a_in), *a2a_out = xmalloc(n * p * sizeof *a2a_out);
        for (size_t i = 0; i < n; i++) {
            f[i] = (float)value(rank_, i);
            in[i] = value(rank_, i);
            out[i] = -77;
            d[i] = rank_ == root ? (double)value(root, i) : -99.0;
            bytes[i] = (unsigned char)value(rank_, i);
        }
        memset(gathered, 0xEE, n * p);
        for (size_t i = 0; i < n * p; i++) scatter_in[i] = (int)value(rank_, i);
        for (size_t r = 0; r < p; r++)
            for (size_t i = 0; i < n; i++) a2a_in[r * n + i] = (long)rank_ * 1000000 + (long)r * 1000 + (long)(i % 1000);

        lp_request *req[7];
        OK(lp_iallreduce(comm, NULL, f, n, LP_F32, LP_SUM, &req[0]));
        OK(lp_iallreduce(comm, in, out, n, LP_I64, LP_MAX, &req[1]));
        OK(lp_ibroadcast(comm, d, n, LP_F64, root, &req[2]));
        OK(lp_iallgather(comm, bytes, gathered, n, LP_U8, &req[3]));
        OK(lp_ireduce_scatter(comm, scatter_in, scatter_out, n, LP_I32, LP_SUM, &req[4]));
        OK(lp_ialltoall(comm, a2a_in, a2a_out, n, LP_I64, &req[5]));
        OK(lp_ibarrier(comm, &req[6]));
        for (int i = 0; i < 7; i++) CHECK(req[i] != NULL, "request %d is NULL", i);

        /* The last first, then the rest from the end, the first one by polling. */
        OK(lp_wait(req[6]));
        OK(lp_wait(req[5]));
        for (size_t q = 0; q < p; q++)
            for (size_t i = 0; i < n; i++)
                CHECK(a2a_out[q * n + i] == (long)q * 1000000 + (long)rank_ * 1000 + (long)(i % 1000),
                      "ialltoall n=%zu", n);
        OK(lp_wait(req[3]));
        for (size_t r = 0; r < p; r++)
            for (size_t i = 0; i < n; i++)
                CHECK(gathered[r * n + i] == (unsigned char)value((int)r, i), "iallgather n=%zu", n);
        OK(lp_wait(req[4]));
        for (size_t i = 0; i < n; i++)
            CHECK(scatter_out[i] == (int)sum_at((size_t)rank_ * n + i), "ireduce_scatter n=%zu i=%zu", n, i);
        OK(lp_wait(req[2]));
        for (size_t i = 0; i < n; i++) CHECK(d[i] == (double)value(root, i), "ibroadcast n=%zu i=%zu", n, i);
        OK(lp_wait(req[1]));
        for (size_t i = 0; i < n; i++) CHECK(out[i] == max_at(i), "iallreduce i64 max n=%zu i=%zu", n, i);
        for (size_t i = 0; i < n; i++) CHECK(in[i] == value(rank_, i), "iallreduce changed its input");
        long polls;
        OK(poll_to_completion(req[0], &polls));
        for (size_t i = 0; i < n; i++) CHECK(f[i] == (float)sum_at(i), "iallreduce f32 n=%zu i=%zu", n, i);

        /* A completed request is gone: completing it again is refused, not a crash. */
        int done = 0;
        expect_invalid(lp_wait(req[0]), "waiting a completed request");
        expect_invalid(lp_test(req[6], &done), "testing a completed request");
        CHECK(done == 1, "lp_test of a completed request set done to %d", done);
        /* The next request takes the table slot the last one freed (req[0]'s): the old handle
         * still names nothing, and using it leaves the new request alone. */
        lp_request *fresh;
        long one = 1;
        OK(lp_iallreduce(comm, NULL, &one, 1, LP_I64, LP_SUM, &fresh));
        CHECK(fresh != req[0], "a new request got the handle of a completed one");
        expect_invalid(lp_wait(req[0]), "waiting a completed request whose slot was reused");
        OK(lp_wait(fresh));
        CHECK(one == size_, "the request after a stale wait gave %ld", one);

        free(f), free(in), free(out), free(d), free(bytes), free(gathered);
        free(scatter_in), free(scatter_out), free(a2a_in), free(a2a_out);
    }

    /* lp_test never blocks: rank 0 joins an allreduce 500 ms late, so every other rank's first
     * lp_test finds it pending (a blocking lp_test would return only once it completed, after
     * one call). */
    {
        size_t n = 70000;
        double *x = xmalloc(n * sizeof *x);
        for (size_t i = 0; i < n; i++) x[i] = (double)value(rank_, i);
        if (rank_ == 0) sleep_us(500000);
        lp_request *req;
        OK(lp_iallreduce(comm, NULL, x, n, LP_F64, LP_SUM, &req));
        long polls;
        double start = now_ms();
        int status = poll_to_completion(req, &polls);
        double waited = now_ms() - start;
        CHECK(status == LP_OK, "polled iallreduce: %s: %s", lp_status_name(status), lp_last_error());
        for (size_t i = 0; i < n; i++) CHECK(x[i] == (double)sum_at(i), "polled iallreduce i=%zu", i);
        if (size_ > 1 && rank_ != 0)
            CHECK(polls > 1, "lp_test returned done after %ld polls and %.1f ms", polls, waited);
        free(x);
    }

    /* A blocking call made while requests are pending runs after them (the order of issue). */
    {
        long a = rank_, b = rank_ + 1;
        lp_request *ra;
        OK(lp_iallreduce(comm, NULL, &a, 1, LP_I64, LP_SUM, &ra));
        OK(lp_allreduce(comm, NULL, &b, 1, LP_I64, LP_MAX));
        CHECK(b == size_, "blocking allreduce behind a request gave %ld", b);
        OK(lp_wait(ra));
        CHECK(a == (long)size_ * (size_ - 1) / 2, "iallreduce before a blocking call gave %ld", a);
    }

    /* Destroying a communicator with a request pending (rank 0 joins it 300 ms late): the call
     * has finished when lp_comm_destroy returns, and the request is still completed after. */
    {
        lp_comm *dup = NULL;
        OK(lp_comm_split(comm, 0, rank_, &dup));
        long v[5] = {1, 2, 3, 4, rank_};
        lp_request *r;
        if (rank_ == 0) sleep_us(300000);
        OK(lp_iallreduce(dup, NULL, v, 5, LP_I64, LP_SUM, &r));
        lp_comm_destroy(dup);
        CHECK(v[0] == size_ && v[3] == 4L * size_ && v[4] == (long)size_ * (size_ - 1) / 2,
              "iallreduce on a destroyed communicator gave %ld %ld %ld", v[0], v[3], v[4]);
        OK(lp_wait(r));
    }
}

static void expect_invalid(int status, const char *what) {
    CHECK(status == LP_ERR_INVALID_ARGUMENT, "%s returned %s, not LP_ERR_INVALID_ARGUMENT", what,
          lp_status_name(status));
    CHECK(strlen(lp_last_error()) > 0, "%s left no message", what);
}

static void check_invalid(lp_comm *comm) {
    float x[8] = {0};
    expect_invalid(lp_allreduce(NULL, NULL, x, 8, LP_F32, LP_SUM), "a NULL communicator");
    expect_invalid(lp_allreduce(comm, NULL, x, 8, 99, LP_SUM), "data type 99");
    CHECK(strstr(lp_last_error(), "99") != NULL, "the message does not name the type: %s", lp_last_error());
    expect_invalid(lp_allreduce(comm, NULL, x, 8, LP_F32, -1), "reduction -1");
    expect_invalid(lp_allreduce(comm, NULL, NULL, 8, LP_F32, LP_SUM), "a NULL buffer");
    expect_invalid(lp_allreduce(comm, x, x + 1, 4, LP_F32, LP_SUM), "overlapping buffers");
    expect_invalid(lp_allreduce(comm, NULL, x, (size_t)-1, LP_F32, LP_SUM), "a count beyond memory");
    expect_invalid(lp_broadcast(comm, x, 8, LP_F32, size_), "root == size");
    expect_invalid(lp_broadcast(comm, x, 8, LP_F32, -3), "a negative root");
    expect_invalid(lp_send(comm, x, 1, LP_F32, 12345), "a peer beyond the job");
    expect_invalid(lp_allgatherv(comm, x, x, NULL, LP_F32), "NULL counts");
    expect_invalid(lp_comm_init(NULL), "a NULL result pointer");
    CHECK(lp_comm_rank(NULL) == -1 && lp_comm_size(NULL) == -1, "rank/size of NULL");
    CHECK(lp_last_error_rank() == -1 && lp_last_error_seq() == -1, "an argument error names a rank or call");
    lp_comm_destroy(NULL);

    /* Nonblocking forms: the same checks, *req NULL after a refusal; NULL requests refused. */
    lp_request *req = (lp_request *)x;
    expect_invalid(lp_iallreduce(comm, NULL, x, 8, 99, LP_SUM, &req), "a nonblocking call with data type 99");
    CHECK(req == NULL, "a refused call left a request");
    CHECK(strstr(lp_last_error(), "99") != NULL, "the message does not name the type: %s", lp_last_error());
    expect_invalid(lp_iallreduce(comm, NULL, x, 8, LP_F32, LP_SUM, NULL), "a NULL request pointer");
    expect_invalid(lp_iallreduce(comm, x, x + 1, 4, LP_F32, LP_SUM, &req), "overlapping nonblocking buffers");
    expect_invalid(lp_ibroadcast(comm, x, 8, LP_F32, size_, &req), "a nonblocking root == size");
    expect_invalid(lp_iallgather(comm, x, NULL, 8, LP_F32, &req), "a NULL nonblocking recvbuf");
    expect_invalid(lp_ireduce_scatter(NULL, x, x, 1, LP_F32, LP_SUM, &req), "a NULL communicator (nonblocking)");
    expect_invalid(lp_ialltoall(comm, x, x, 1, LP_F32, &req), "nonblocking alltoall in place");
    expect_invalid(lp_ibarrier(NULL, &req), "ibarrier on NULL");
    CHECK(req == NULL, "a refused call left a request");
    expect_invalid(lp_wait(NULL), "waiting NULL");
    int done = 0;
    expect_invalid(lp_test(NULL, &done), "testing NULL");
    CHECK(done == 1, "testing NULL set done to %d", done);
    expect_invalid(lp_wait((lp_request *)(uintptr_t)0x12345), "waiting a made-up request");
    CHECK(strstr(lp_last_error(), "not a pending request") != NULL, "message: %s", lp_last_error());
    /* A NULL done pointer leaves the request pending; it then completes normally. */
    float y[3] = {1, 2, 3};
    OK(lp_iallreduce(comm, NULL, y, 3, LP_F32, LP_SUM, &req));
    expect_invalid(lp_test(req, NULL), "a NULL done pointer");
    OK(lp_wait(req));
    CHECK(y[0] == size_ && y[2] == 3 * size_, "iallreduce after a refused lp_test gave %f", y[0]);

    /* Nothing was sent: the communicator still works. */
    float one = 1;
    OK(lp_allreduce(comm, NULL, &one, 1, LP_F32, LP_SUM));
    CHECK(one == size_, "allreduce after the refused calls gave %f", one);
}

static void check_death(lp_comm *comm) {
    OK(lp_barrier(comm));
    if (rank_ == 1) {
        lp_comm_destroy(comm);
        exit(0);
    }
    long v[1000] = {0};
    int status = LP_OK;
    /* The first calls may still finish with ranks that are alive; one must fail. */
    for (int i = 0; i < 50 && status == LP_OK; i++) status = lp_allreduce(comm, NULL, v, 1000, LP_I64, LP_SUM);
    CHECK(status == LP_ERR_PEER_FAILED || status == LP_ERR_TIMEOUT || status == LP_ERR_ABORTED,
          "the call after rank 1 left returned %s: %s", lp_status_name(status), lp_last_error());
    CHECK(lp_last_error_seq() >= 1, "no sequence number: %s", lp_last_error());
    /* An abort names the rank its reporter blamed: rank 1 too. */
    CHECK(lp_last_error_rank() == 1, "the error names rank %d, not 1: %s", lp_last_error_rank(), lp_last_error());
    printf("rank %d: %s: %s\n", rank_, lp_status_name(status), lp_last_error());
    lp_comm_destroy(comm);
    exit(0);
}

/* Rank 1 leaves; the others issue nonblocking calls and wait the last one first. */
static void check_death_nonblocking(lp_comm *comm) {
    OK(lp_barrier(comm));
    if (rank_ == 1) {
        lp_comm_destroy(comm);
        exit(0);
    }
    const char *t = getenv("LIGHTPATH_COLL_TIMEOUT_MS");
    double timeout_ms = t ? atof(t) : 2000;
    enum { K = 4, N = 1000 };
    static long v[K][N];
    lp_request *req[K];
    double start = now_ms();
    for (int k = 0; k < K; k++) OK(lp_iallreduce(comm, NULL, v[k], N, LP_I64, LP_SUM, &req[k]));
    int status = lp_wait(req[K - 1]);
    double took = now_ms() - start;
    CHECK(status == LP_ERR_PEER_FAILED || status == LP_ERR_TIMEOUT || status == LP_ERR_ABORTED,
          "the last request after rank 1 left returned %s: %s", lp_status_name(status), lp_last_error());
    CHECK(lp_last_error_rank() == 1, "the error names rank %d, not 1: %s", lp_last_error_rank(), lp_last_error());
    CHECK(lp_last_error_seq() >= 1, "no sequence number: %s", lp_last_error());
    CHECK(took < timeout_ms + 2000, "the failure took %.0f ms (timeout %.0f ms)", took, timeout_ms);
    printf("rank %d: %s after %.0f ms: %s\n", rank_, lp_status_name(status), took, lp_last_error());
    /* The earlier requests complete too, the first by polling; the one before the last failed
     * as well (calls run in order, so it ran before the last one, with rank 1 gone). */
    long polls;
    (void)poll_to_completion(req[0], &polls);
    (void)lp_wait(req[1]);
    CHECK(lp_wait(req[2]) != LP_OK, "a call with rank 1 gone succeeded");
    /* A request pending when the communicator is destroyed fails (fast: the communicator has
     * failed) and is still completed by lp_wait. */
    lp_request *late;
    OK(lp_iallreduce(comm, NULL, v[0], N, LP_I64, LP_SUM, &late));
    lp_comm_destroy(comm);
    status = lp_wait(late);
    CHECK(status != LP_OK && lp_last_error_rank() == 1, "the request after the failure returned %s: %s",
          lp_status_name(status), lp_last_error());
    exit(0);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "all";
    lp_comm *comm = NULL;
    OK(lp_comm_init(&comm));
    rank_ = lp_comm_rank(comm);
    size_ = lp_comm_size(comm);
    if (strcmp(mode, "all") == 0)
        check_all(comm);
    else if (strcmp(mode, "invalid") == 0)
        check_invalid(comm);
    else if (strcmp(mode, "die") == 0)
        check_death(comm);
    else if (strcmp(mode, "die-nonblocking") == 0)
        check_death_nonblocking(comm);
    else
        CHECK(0, "unknown mode %s", mode);
    lp_comm_destroy(comm);
    printf("rank %d of %d: %s ok\n", rank_, size_, mode);
    return 0;
}
