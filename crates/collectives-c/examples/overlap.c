/*
 * Overlapping compute with communication, as data-parallel training does: while the gradients
 * of one layer are summed across ranks (lp_iallreduce), the next layer's are computed; lp_wait
 * collects the sum when it is needed. Prints the time of the allreduce alone, of the compute
 * alone and of both overlapped, and checks the sum.
 *
 *   cargo build --release -p lightpath-collectives-c
 *   cc -O2 -I crates/collectives-c/include crates/collectives-c/examples/overlap.c \
 *      -L target/release -llightpath_coll -Wl,-rpath,$PWD/target/release -o overlap
 *   target/release/lightpath launch -n 2 -- ./overlap [ELEMENTS]     # or mpirun -n 2 ./overlap
 *
 * The buffer given to lp_iallreduce belongs to the call until lp_wait (or lp_test saying done)
 * returns: the compute works on another buffer meanwhile. The call runs on a thread of
 * Lightpath's, and over shared memory moving and reducing the bytes takes CPU and memory
 * bandwidth: overlap pays when a core is left for it. With as many ranks as cores, the two
 * share one and nothing is hidden (measured on a loaded 2-CPU machine, 2 ranks, 4M floats:
 * allreduce 7-21 ms, compute 36-63 ms, overlapped about their sum or more).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "lightpath_coll.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* Stands for the next layer's backward pass: a few passes of arithmetic over its buffer. */
static void compute(float *next, size_t n, int passes) {
    for (int k = 0; k < passes; k++)
        for (size_t i = 0; i < n; i++) next[i] = next[i] * 0.5f + (float)(i % 7);
}

static int fail(int status, const char *what) {
    fprintf(stderr, "%s: %s: %s\n", what, lp_status_name(status), lp_last_error());
    return 1;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)1 << 22;
    lp_comm *comm;
    int status = lp_comm_init(&comm);
    if (status != LP_OK) return fail(status, "joining the job");
    int rank = lp_comm_rank(comm), size = lp_comm_size(comm);
    float *grad = malloc(n * sizeof *grad), *next = malloc(n * sizeof *next);
    if (!grad || !next) return fail(LP_ERR_INTERNAL, "malloc");
    for (size_t i = 0; i < n; i++) next[i] = 1.0f;

    /* The allreduce alone (after one to warm up), then the compute alone. */
    for (size_t i = 0; i < n; i++) grad[i] = 0.0f;
    if ((status = lp_allreduce(comm, NULL, grad, n, LP_F32, LP_SUM)) != LP_OK) return fail(status, "allreduce");
    for (size_t i = 0; i < n; i++) grad[i] = (float)(rank + 1);
    double t0 = now_ms();
    if ((status = lp_allreduce(comm, NULL, grad, n, LP_F32, LP_SUM)) != LP_OK) return fail(status, "allreduce");
    double comm_ms = now_ms() - t0;
    int passes = 8;
    t0 = now_ms();
    compute(next, n, passes);
    double compute_ms = now_ms() - t0;

    /* Both: start the allreduce, compute while it runs, then wait for it. */
    for (size_t i = 0; i < n; i++) grad[i] = (float)(rank + 1);
    if ((status = lp_barrier(comm)) != LP_OK) return fail(status, "barrier");
    t0 = now_ms();
    lp_request *req;
    if ((status = lp_iallreduce(comm, NULL, grad, n, LP_F32, LP_SUM, &req)) != LP_OK)
        return fail(status, "iallreduce");
    compute(next, n, passes); /* grad is not touched until lp_wait returns */
    if ((status = lp_wait(req)) != LP_OK) return fail(status, "the overlapped allreduce");
    double both_ms = now_ms() - t0;

    float want = (float)size * (float)(size + 1) / 2.0f;
    for (size_t i = 0; i < n; i++)
        if (grad[i] != want) {
            fprintf(stderr, "rank %d: grad[%zu] = %g, want %g\n", rank, i, grad[i], want);
            return 1;
        }
    printf("rank %d of %d, %zu floats: allreduce %.2f ms, compute %.2f ms, overlapped %.2f ms "
           "(%.2f ms hidden)\n",
           rank, size, n, comm_ms, compute_ms, both_ms, comm_ms + compute_ms - both_ms);
    free(grad), free(next);
    lp_comm_destroy(comm);
    return 0;
}
