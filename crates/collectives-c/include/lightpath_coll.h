/*
 * lightpath_coll.h: collectives of Lightpath (lightpath-collectives) for C and C++.
 *
 * Link with -llightpath_coll (target/release/liblightpath_coll.so, built by
 * `cargo build --release -p lightpath-collectives-c`). Every rank of a job calls
 * lp_comm_init(), which joins the job from the launcher's environment: `lightpath launch`,
 * torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Open MPI's mpirun or Slurm's srun,
 * exactly as the Rust and Python APIs do. Ranks on one host talk over shared memory, ranks on
 * different hosts over RDMA (ibverbs) or Lightpath's soft RoCE.
 *
 * Every call returns LP_OK or an error status; a failed call leaves a description in
 * lp_last_error() (per thread), naming the rank at fault, the operation and its sequence
 * number (lp_last_error_rank(), lp_last_error_seq()). A rank that dies or stops makes the
 * others' calls fail within the timeout (LIGHTPATH_COLL_TIMEOUT_MS), never hang.
 *
 * Counts are in elements of the call's data type. Calls are collective (every rank of the
 * communicator makes the same calls in the same order), except lp_send / lp_recv. A
 * communicator may be used by one thread at a time. Calls block, except the nonblocking forms
 * (lp_iallreduce, ...; see "Nonblocking calls" below), which return a request to complete
 * later with lp_wait or lp_test.
 */
#ifndef LIGHTPATH_COLL_H
#define LIGHTPATH_COLL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. */
#define LP_OK 0
#define LP_ERR_INVALID_ARGUMENT 1 /* nothing was sent: a bad pointer, count, type, op or rank */
#define LP_ERR_PEER_FAILED 2      /* a peer's process ended or its connection broke */
#define LP_ERR_TIMEOUT 3          /* a peer made no progress within the timeout */
#define LP_ERR_ABORTED 4          /* another rank aborted the job */
#define LP_ERR_MISMATCH 5         /* ranks made different calls (LIGHTPATH_COLL_DEBUG=1) */
#define LP_ERR_BOOTSTRAP 6        /* joining the job failed */
#define LP_ERR_INTERNAL 7         /* a bug in Lightpath (reported, never a crash) */

/* Element types. */
#define LP_F32 0
#define LP_F64 1
#define LP_F16 2  /* IEEE binary16 */
#define LP_BF16 3 /* bfloat16 */
#define LP_I32 4
#define LP_I64 5
#define LP_U8 6

/* Reduction operators. Integer sums wrap on overflow; LP_AVG divides the sum by the size. */
#define LP_SUM 0
#define LP_PROD 1
#define LP_MIN 2
#define LP_MAX 3
#define LP_AVG 4

/* A communicator (opaque). */
typedef struct lp_comm lp_comm;
/* A nonblocking call in progress (opaque; see "Nonblocking calls"). */
typedef struct lp_request lp_request;

/* Joins the job described by the environment; *comm receives the world communicator. */
int lp_comm_init(lp_comm **comm);
/* This rank in the communicator, and the number of ranks (-1 for a NULL comm). */
int lp_comm_rank(const lp_comm *comm);
int lp_comm_size(const lp_comm *comm);
/* Splits by color (ranks with equal colors form a communicator, ordered by key, then by rank);
 * a negative color takes no part: *out is then NULL. Collective. */
int lp_comm_split(const lp_comm *comm, int color, int64_t key, lp_comm **out);
/* Makes every rank's current and next call fail with LP_ERR_ABORTED, naming this rank. */
void lp_comm_abort(const lp_comm *comm, const char *reason);
/* Frees a communicator (NULL is ignored). Nonblocking calls still pending on it (or on a
 * communicator split from the same world) are let finish first: each completes or fails within
 * the timeout, so this does not hang, and once it returns no call uses their buffers. Their
 * requests stay valid and must still be completed with lp_wait / lp_test, which then return at
 * once with the call's status. */
void lp_comm_destroy(lp_comm *comm);

/* recvbuf = op over every rank's sendbuf; in place when sendbuf is NULL or equals recvbuf. */
int lp_allreduce(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t count, int dtype, int op);
/* The root's buf = op over every rank's buf; the other ranks' buf is left unchanged. */
int lp_reduce(const lp_comm *comm, void *buf, size_t count, int dtype, int op, int root);
/* Every rank's buf = the root's. */
int lp_broadcast(const lp_comm *comm, void *buf, size_t count, int dtype, int root);
/* recvbuf (size * count elements) = every rank's sendbuf (count elements), in rank order; in
 * place when sendbuf is NULL (this rank's block is already in recvbuf). */
int lp_allgather(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t count, int dtype);
/* As lp_allgather with counts[r] elements from rank r (counts has size entries). */
int lp_allgatherv(const lp_comm *comm, const void *sendbuf, void *recvbuf, const size_t *counts, int dtype);
/* sendbuf holds size blocks of recvcount elements; recvbuf = op over every rank's block number
 * `rank`. */
int lp_reduce_scatter(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t recvcount, int dtype,
                      int op);
/* Block r of sendbuf (count elements) goes to rank r; block r of recvbuf comes from rank r. */
int lp_alltoall(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t count, int dtype);
/* As lp_alltoall with sendcounts[r] elements to and recvcounts[r] from rank r. */
int lp_alltoallv(const lp_comm *comm, const void *sendbuf, const size_t *sendcounts, void *recvbuf,
                 const size_t *recvcounts, int dtype);
/* Returns once every rank has entered. */
int lp_barrier(const lp_comm *comm);
/* Point to point, matched in order per pair of ranks. */
int lp_send(const lp_comm *comm, const void *buf, size_t count, int dtype, int peer);
int lp_recv(const lp_comm *comm, void *buf, size_t count, int dtype, int peer);

/*
 * Nonblocking calls. lp_iallreduce, lp_ibroadcast, lp_iallgather, lp_ireduce_scatter,
 * lp_ialltoall and lp_ibarrier take the arguments of their blocking forms (same meaning, same
 * in-place conventions) plus `req`, start the call and return at once; *req receives its
 * request, which lp_wait or lp_test completes and frees.
 *
 * - Buffers: the call works on the caller's buffers themselves (nothing is copied). Until the
 *   request completes, they must stay valid, recvbuf (and an in-place or lp_ibroadcast buf)
 *   must be neither read nor written, and sendbuf must not be written.
 * - Order: calls on a process run one at a time, in the order they were issued, blocking and
 *   nonblocking alike; nonblocking calls run on one thread of Lightpath's per process (started
 *   by the first of them), each in its turn. So every rank must issue the same calls in the same
 *   order, as for blocking calls; requests may be completed in any order, and a blocking call
 *   made while requests are pending runs after them. The hand-off to that thread and back costs
 *   a few microseconds per call (8 bytes: lp_iallreduce + lp_wait 7-9 us against 1.7 us for
 *   lp_allreduce, 2 ranks on a loaded 2-CPU machine); overlapping compute with a call pays when
 *   a core is free to run the call meanwhile.
 * - Errors: arguments are checked when the call is made. A bad one makes the call return
 *   LP_ERR_INVALID_ARGUMENT with *req set to NULL (when req itself is not NULL); nothing is
 *   issued. A failure of the operation itself (a dead rank, a timeout, an abort) is the status
 *   lp_wait / lp_test return, described by lp_last_error() & co. on the thread that called them.
 * - Requests are handles, not pointers, valid until completed; lp_wait and lp_test may be
 *   called from any thread. A NULL request, or one already completed (a "double free"; a bug of
 *   the caller's), is refused with LP_ERR_INVALID_ARGUMENT, never dereferenced. (On 64-bit systems a
 *   handle comes back only after 2^40 requests of its table slot; only then could a stale one
 *   name a new request.) Every request must be completed before the process exits. There is no
 *   lp_request_free: after a failure or lp_comm_abort, pending requests complete quickly, with
 *   an error.
 */
int lp_iallreduce(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t count, int dtype, int op,
                  lp_request **req);
int lp_ibroadcast(const lp_comm *comm, void *buf, size_t count, int dtype, int root, lp_request **req);
int lp_iallgather(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t count, int dtype,
                  lp_request **req);
int lp_ireduce_scatter(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t recvcount, int dtype,
                       int op, lp_request **req);
int lp_ialltoall(const lp_comm *comm, const void *sendbuf, void *recvbuf, size_t count, int dtype,
                 lp_request **req);
int lp_ibarrier(const lp_comm *comm, lp_request **req);
/* Waits for the request's call to finish, frees the request and returns the call's status. */
int lp_wait(lp_request *req);
/* Never blocks. Sets *done to 1 when the request's call has finished: the request is then freed
 * and the call's status returned; else sets *done to 0, returns LP_OK and the request stays
 * pending. A NULL or already completed request gives LP_ERR_INVALID_ARGUMENT and *done = 1
 * (nothing is left to wait for); a NULL done gives LP_ERR_INVALID_ARGUMENT and leaves the
 * request pending. */
int lp_test(lp_request *req, int *done);

/* The last failed call on this thread: its description ("" if none; valid until the next failed
 * call on this thread), the rank it names (-1 if none) and its sequence number (-1 if none). */
const char *lp_last_error(void);
int lp_last_error_rank(void);
int64_t lp_last_error_seq(void);
/* A status code's name, e.g. "LP_ERR_TIMEOUT". */
const char *lp_status_name(int status);

#ifdef __cplusplus
}
#endif

#endif /* LIGHTPATH_COLL_H */
