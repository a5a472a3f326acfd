/* What a hand-over of bytes between two cores costs, the way a shm ring moves them: one thread
 * copies BYTES into a shared buffer, the other copies them out, turn by turn, for SECONDS;
 * every 50 ms window alternates the writer's way of copying, plain memcpy or streaming
 * (non-temporal) stores, and prints the round trip and each side's copy in microseconds.
 *
 * On a machine whose two cores share a cache the plain copy wins; where they do not (AMD
 * EPYC cores of different CCDs, or virtual CPUs the host placed so) the plain writer's copy is
 * several times slower and streaming stores win. On this project's 2-vCPU VM the host
 * switches between the two every few seconds to minutes (1 MiB: plain 60-75 us per round,
 * writer 31-50 us, in one case; 200-290 us, writer 130-210 us, in the other; streaming
 * 92-105 us in both). crates/shm/src/outbound_copy.rs chooses between the two by measuring.
 *
 *   cc -O2 -pthread -o /tmp/ccc scripts/cross_core_copy.c && /tmp/ccc [SECONDS] [BYTES]
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <emmintrin.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static size_t n = 1 << 20;
static char *shared, *src, *dst;
static atomic_int turn, stop;
static double read_time;
static long reads;

/* Streaming stores of 16-byte pieces (the buffers are page aligned and n a multiple of 64),
 * then a fence, as lightpath_shm does. */
static void copy_streaming(char *to, const char *from, size_t len) {
    for (size_t i = 0; i + 64 <= len; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(from + i)), b = _mm_loadu_si128((const __m128i *)(from + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + i + 32)), d = _mm_loadu_si128((const __m128i *)(from + i + 48));
        _mm_stream_si128((__m128i *)(to + i), a);
        _mm_stream_si128((__m128i *)(to + i + 16), b);
        _mm_stream_si128((__m128i *)(to + i + 32), c);
        _mm_stream_si128((__m128i *)(to + i + 48), d);
    }
    _mm_sfence();
}

static void *reader(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) {
        while (atomic_load(&turn) != 1)
            if (atomic_load(&stop)) return NULL;
        double t = now_s();
        memcpy(dst, shared, n);
        read_time += now_s() - t;
        reads++;
        atomic_store(&turn, 0);
    }
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2;
    if (argc > 2) n = (strtoull(argv[2], NULL, 10) + 63) / 64 * 64;
    shared = aligned_alloc(4096, n);
    src = aligned_alloc(4096, n);
    dst = aligned_alloc(4096, n);
    memset(shared, 0, n);
    memset(src, 1, n);
    memset(dst, 2, n);
    pthread_t t;
    pthread_create(&t, NULL, reader, NULL);
    printf("# %zu bytes per hand-over; us per round trip, writer's copy, reader's copy\n", n);
    double start = now_s();
    while (now_s() - start < seconds) {
        for (int streaming = 0; streaming < 2; streaming++) {
            read_time = 0;
            reads = 0;
            double write_time = 0, t0 = now_s();
            long rounds = 0;
            while (now_s() - t0 < 0.05) {
                while (atomic_load(&turn) != 0) {}
                double w = now_s();
                if (streaming) copy_streaming(shared, src, n);
                else memcpy(shared, src, n);
                write_time += now_s() - w;
                atomic_store(&turn, 1);
                rounds++;
            }
            while (atomic_load(&turn) != 0) {}
            printf("%s round %4.0f writer %4.0f reader %4.0f%s", streaming ? "streaming" : "plain", (now_s() - t0) / rounds * 1e6,
                   write_time / rounds * 1e6, reads ? read_time / reads * 1e6 : 0.0, streaming ? "\n" : "  |  ");
        }
    }
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    return 0;
}
