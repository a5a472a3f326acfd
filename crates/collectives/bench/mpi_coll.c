/* The Open MPI side of scripts/coll_compare.sh: the same loop as `lightpath perf <collective>`
 * (warm-up, then N calls each timed alone; avg = mean over ranks of each rank's mean, p50, p90
 * and p99 = mean over ranks of each rank's percentile, min and max over all calls and ranks; f32 sums, out of place
 * where the call has both buffers), printing the same JSON lines with "impl": "openmpi".
 *
 * Build: mpicc -O2 -o mpi_coll mpi_coll.c
 * Run:   mpirun -n 2 ./mpi_coll allreduce [max_bytes] [iters] [min_bytes] [touch]
 * With "touch" (as `lightpath perf --touch`), the data each call sends is rewritten before the
 * call, outside the timing: fresh data, as a training step's gradients. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static size_t iters_for(size_t bytes) {
    if (bytes <= (64u << 10)) return 1000;
    size_t n = (256u << 20) / bytes;
    return n < 20 ? 20 : (n > 1000 ? 1000 : n);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    const char *test = argc > 1 ? argv[1] : "allreduce";
    size_t max = argc > 2 ? strtoull(argv[2], NULL, 10) : (64u << 20);
    size_t fixed_iters = argc > 3 ? strtoull(argv[3], NULL, 10) : 0;
    size_t min = argc > 4 ? strtoull(argv[4], NULL, 10) : 8;
    int barrier = strcmp(test, "barrier") == 0;
    int touch = argc > 5 && strcmp(argv[5], "touch") == 0;
    float *in = malloc(max + 64), *out = malloc(max * 2 + 64);
    /* Every byte 1, as `lightpath perf` fills its buffers (each float 2.4e-38, a normal
     * number, so sums never go denormal). Not zeros: on this kind of virtual machine memory
     * written with zeros copies about 1.5x faster than memory holding data (two processes,
     * each copying 8 MiB in with process_vm_readv and 8 MiB with memcpy: 1.8 ms against 2.7
     * ms per round), which no application's buffers get. */
    memset(in, 1, max + 64);
    memset(out, 1, max * 2 + 64);
    for (size_t bytes = barrier ? 0 : min; bytes <= (barrier ? 0 : max); bytes = bytes ? bytes * 2 : 1) {
        int count = (int)(bytes / 4);
        int block = count / p;
        size_t iters = fixed_iters ? fixed_iters : iters_for(bytes);
        size_t warm = iters / 10 < 2 ? 2 : iters / 10;
        double sum = 0, lo = 1e30, hi = 0;
        double *times = malloc(iters * sizeof(double));
        for (size_t i = 0; i < warm + iters; i++) {
            if (i == warm) MPI_Barrier(MPI_COMM_WORLD);
            if (touch && !strcmp(test, "bcast")) {
                if (rank == 0) memset(out, 1, bytes);
            } else if (touch) {
                memset(in, 1, bytes);
            }
            double t = MPI_Wtime();
            if (!strcmp(test, "allreduce")) MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (!strcmp(test, "reduce")) MPI_Reduce(in, out, count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
            else if (!strcmp(test, "bcast")) MPI_Bcast(out, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
            else if (!strcmp(test, "allgather")) MPI_Allgather(in, block, MPI_FLOAT, out, block, MPI_FLOAT, MPI_COMM_WORLD);
            else if (!strcmp(test, "reduce_scatter")) MPI_Reduce_scatter_block(in, out, block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (!strcmp(test, "alltoall")) MPI_Alltoall(in, block, MPI_FLOAT, out, block, MPI_FLOAT, MPI_COMM_WORLD);
            else MPI_Barrier(MPI_COMM_WORLD);
            double us = (MPI_Wtime() - t) * 1e6;
            if (i >= warm) {
                times[i - warm] = us;
                sum += us;
                if (us < lo) lo = us;
                if (us > hi) hi = us;
            }
        }
        qsort(times, iters, sizeof(double), cmp_double);
        size_t i90 = iters * 90 / 100, i99 = iters * 99 / 100;
        double median = times[iters / 2], gmedian;
        double tail[2] = {times[i90 < iters ? i90 : iters - 1], times[i99 < iters ? i99 : iters - 1]}, gtail[2];
        free(times);
        double avg = sum / iters, gavg, glo, ghi;
        MPI_Reduce(&median, &gmedian, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(tail, gtail, 2, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&avg, &gavg, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&lo, &glo, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
        MPI_Reduce(&hi, &ghi, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            gavg /= p;
            gmedian /= p;
            gtail[0] /= p;
            gtail[1] /= p;
            size_t total = (size_t)count * 4;
            double algbw = gavg > 0 ? total / (gavg * 1e-6) / 1e9 : 0;
            double factor = !strcmp(test, "allreduce") ? 2.0 * (p - 1) / p
                          : (!strcmp(test, "allgather") || !strcmp(test, "reduce_scatter") || !strcmp(test, "alltoall")) ? (double)(p - 1) / p : 1.0;
            printf("{\"test\":\"%s\",\"impl\":\"openmpi\",\"ranks\":%d,\"dtype\":\"f32\",\"size\":%zu,\"iters\":%zu,"
                   "\"avg_us\":%.3f,\"p50_us\":%.3f,\"p90_us\":%.3f,\"p99_us\":%.3f,\"min_us\":%.3f,\"max_us\":%.3f,"
                   "\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f,\"touched\":%s}\n",
                   test, p, total, iters, gavg, gmedian, gtail[0], gtail[1], glo, ghi, algbw, algbw * factor,
                   touch ? "true" : "false");
            fflush(stdout);
        }
        if (bytes == 0) break;
    }
    free(in);
    free(out);
    MPI_Finalize();
    return 0;
}
