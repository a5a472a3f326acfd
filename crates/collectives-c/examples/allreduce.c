/*
 * The smallest C program over Lightpath's collectives: every rank contributes its rank number
 * and prints the sum.
 *
 *   cargo build --release -p lightpath-collectives-c
 *   cc -I crates/collectives-c/include crates/collectives-c/examples/allreduce.c \
 *      -L target/release -llightpath_coll -Wl,-rpath,$PWD/target/release -o allreduce
 *   target/release/lightpath launch -n 4 -- ./allreduce      # or mpirun, srun, torchrun-style env
 */
#include <stdio.h>

#include "lightpath_coll.h"

int main(void) {
    lp_comm *comm;
    if (lp_comm_init(&comm) != LP_OK) {
        fprintf(stderr, "joining the job failed: %s\n", lp_last_error());
        return 1;
    }
    double x = lp_comm_rank(comm);
    int status = lp_allreduce(comm, NULL, &x, 1, LP_F64, LP_SUM);
    if (status != LP_OK) {
        fprintf(stderr, "%s: %s\n", lp_status_name(status), lp_last_error());
        return 1;
    }
    printf("rank %d of %d: sum of ranks = %g\n", lp_comm_rank(comm), lp_comm_size(comm), x);
    lp_comm_destroy(comm);
    return 0;
}
