/* How fast memcpy and process_vm_readv copy at each distance between destination and source
 * (modulo the page): on AMD Zen 3/4 with glibc before 2.39, `rep movsb` makes copies whose
 * destination lies 1-31 bytes past the source ten times slower (see crates/verbs/src/copy.rs).
 *
 *   cc -O2 -o /tmp/copy_distance scripts/copy_distance.c && /tmp/copy_distance [BYTES]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* Best of 3 rounds, in GB/s. */
static double rate(char *dst, const char *src, size_t n, int kernel) {
    double best = 1e30;
    int rounds = (int)(200000000 / n) + 1;
    for (int k = 0; k < 3; k++) {
        double t0 = now_ns();
        for (int r = 0; r < rounds; r++) {
            if (kernel) {
                struct iovec local = {dst, n}, remote = {(void *)src, n};
                if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != (ssize_t)n) return 0;
            } else {
                memcpy(dst, src, n);
                __asm__ volatile("" ::"r"(dst) : "memory");
            }
        }
        double t = (now_ns() - t0) / rounds;
        if (t < best) best = t;
    }
    return n / best;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoul(argv[1], 0, 0) : 32768;
    char *src = aligned_alloc(4096, n + 8192), *dst = aligned_alloc(4096, n + 8192);
    if (!src || !dst) return 1;
    memset(src, 1, n + 8192);
    memset(dst, 2, n + 8192);
    int distances[] = {0, 1, 8, 16, 31, 32, 48, 63, 64, 128, 4000};
    printf("%zu bytes; GB/s by (destination - source) mod 4096\n", n);
    printf("distance  memcpy  process_vm_readv\n");
    for (unsigned i = 0; i < sizeof distances / sizeof *distances; i++) {
        int d = distances[i];
        printf("%8d  %6.1f  %6.1f\n", d, rate(dst + d, src, n, 0), rate(dst + d, src, n, 1));
    }
    return 0;
}
