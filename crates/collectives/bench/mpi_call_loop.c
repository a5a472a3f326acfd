/* The loop of examples/call_loop.rs over Open MPI: time per call of a loop of small blocking
 * calls (MPI_Bcast from rank 0 or MPI_Allreduce sum of two floats), with no clock read per
 * call, after 10,000 calls of warm-up.
 *
 *   mpicc -O2 -o mpi_call_loop crates/collectives/bench/mpi_call_loop.c
 *   mpirun --allow-run-as-root -np 2 ./mpi_call_loop broadcast|allreduce [CALLS]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc < 2 || (strcmp(argv[1], "broadcast") && strcmp(argv[1], "allreduce"))) {
        if (rank == 0) fprintf(stderr, "usage: mpi_call_loop broadcast|allreduce [CALLS]\n");
        MPI_Finalize();
        return 2;
    }
    int broadcast = !strcmp(argv[1], "broadcast");
    long calls = argc > 2 ? atol(argv[2]) : 1000000;
    if (calls <= 0) calls = 1000000;
    float buf[2] = {1, 1}, out[2];
    for (int i = 0; i < 10000; i++) {
        if (broadcast) MPI_Bcast(buf, 2, MPI_FLOAT, 0, MPI_COMM_WORLD);
        else MPI_Allreduce(buf, out, 2, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (long i = 0; i < calls; i++) {
        if (broadcast) MPI_Bcast(buf, 2, MPI_FLOAT, 0, MPI_COMM_WORLD);
        else MPI_Allreduce(buf, out, 2, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    double ns = (MPI_Wtime() - start) * 1e9 / (double)calls;
    printf("rank %d: %s of 8 B, %.1f ns per call (%ld calls)\n", rank, argv[1], ns, calls);
    MPI_Finalize();
    return 0;
}
