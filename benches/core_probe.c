/*
 * What a 2-core VM gives two threads, measured without our code: the cores' f32 FMA peak, and
 * how far apart the two cores sit (a cache line's round trip between them) beside what they read
 * from memory together. Both cores are pinned (cpus 0 and 1). docs/performance.md gives what it
 * measured on a Zen 4 AMD EPYC ("The Zen 4 on 2026-12-05"), whose VM has no hardware counters
 * for `perf stat` and whose cores changed places under it.
 *
 *     gcc -O2 -pthread benches/core_probe.c -o /tmp/core_probe
 *     /tmp/core_probe clock         # GHz, from a chain of dependent adds
 *     /tmp/core_probe peak          # GFLOP/s of twelve independent FMA chains, 256 and 512 bits
 *     /tmp/core_probe pair 30       # 30 rounds: a round trip, then both cores reading 512 MiB
 *
 * `clock` times 2e9 steps of four dependent adds of a register (one cycle each) on cpu 0. Adds of
 * an immediate read 6.65 and 11.81 GHz on an Intel Xeon of family 6 model 207, two to four times
 * the clock its FMA peak allows (its core seems to fold them before they execute). `peak` runs
 * each width on cpu 0 alone, then on both cpus at once, and prints GFLOP/s (two FLOP an FMA
 * lane). Its 512-bit form needs AVX-512F; on other CPUs only the 256-bit line is printed. `pair`
 * alternates, round after round, 20,000 hand-offs of one cache line (each core waits for the
 * other's store before its own) and an AVX2 sum of one 256 MiB half of a buffer on each core, so
 * that each round's two figures come from the same second. The sum is the bandwidth bound's kind
 * of read (benches/performance_report.py times `torch`'s sum), not a copy of it. The report's
 * bandwidth part builds this file and runs `pair 1` just before and after each round's decode.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* An unpinned thread would measure wherever the scheduler put it, so a refusal ends the run. */
static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    int err = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    if (err) {
        fprintf(stderr, "cannot pin a thread to cpu %d: %s\n", cpu, strerror(err));
        exit(1);
    }
}

/* --- clock --------------------------------------------------------------------------------- */

static void clock_rate(void) {
    pin(0);
    long steps = 2000000000L, x = 0, one = 1;
    double start = now();
    __asm__ volatile("1: add %2, %0\n add %2, %0\n add %2, %0\n add %2, %0\n sub $1, %1\n jnz 1b"
                     : "+r"(x), "+r"(steps)
                     : "r"(one));
    printf("%.2f GHz\n", 4 * 2e9 / (now() - start) / 1e9);
}

/* --- peak ---------------------------------------------------------------------------------- */

#define FMA_STEPS 50000000L
#define CHAINS 12

/* Twelve independent chains, enough to cover an FMA's latency on two pipes; the unrolled loop
 * keeps them in registers. Every chain feeds the result, so none is left out. */
#define FMA_CHAINS(name, features, vector, set1, fmadd)                                          \
    __attribute__((target(features))) static float name(void) {                                \
        vector acc[CHAINS];                                                                      \
        for (int i = 0; i < CHAINS; i++) acc[i] = set1(i * 1e-3f);                               \
        vector x = set1(0.999f), y = set1(1e-4f);                                                \
        for (long n = 0; n < FMA_STEPS; n++)                                                     \
            _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; i++)                            \
                acc[i] = fmadd(acc[i], x, y);                                                    \
        float lanes[16], total = 0;                                                              \
        for (int i = 0; i < CHAINS; i++) {                                                       \
            memcpy(lanes, &acc[i], sizeof acc[i]);                                               \
            total += lanes[0];                                                                   \
        }                                                                                        \
        return total;                                                                            \
    }

FMA_CHAINS(chains_256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps)
FMA_CHAINS(chains_512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps)

struct peak_run {
    int cpu, lanes;
    double gflops;
    float sink;
};

static void *peak_on(void *arg) {
    struct peak_run *run = arg;
    pin(run->cpu);
    double start = now();
    run->sink = run->lanes == 16 ? chains_512() : chains_256();
    run->gflops = 2.0 * CHAINS * run->lanes * FMA_STEPS / (now() - start) / 1e9;
    return NULL;
}

static void peak(void) {
    __builtin_cpu_init();
    int widths[2] = {8, 16};
    for (int w = 0; w < 2; w++) {
        int lanes = widths[w];
        if (lanes == 16 && !__builtin_cpu_supports("avx512f")) continue;
        struct peak_run alone = {0, lanes, 0, 0}, both[2] = {{0, lanes, 0, 0}, {1, lanes, 0, 0}};
        peak_on(&alone);
        pthread_t threads[2];
        for (int c = 0; c < 2; c++) pthread_create(&threads[c], NULL, peak_on, &both[c]);
        for (int c = 0; c < 2; c++) pthread_join(threads[c], NULL);
        printf("%d-bit FMA: one core %.1f GFLOP/s; both cores %.1f + %.1f\n", lanes * 32,
               alone.gflops, both[0].gflops, both[1].gflops);
    }
}

/* --- pair ---------------------------------------------------------------------------------- */

#define HAND_OFFS 20000
#define READ_BYTES (512UL << 20)

static _Alignas(64) atomic_int line;
static pthread_barrier_t step;
static float *buffer;
static volatile float read_sink[2];

__attribute__((target("avx2"))) static float sum(const float *p, size_t n) {
    __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 32) {
        a = _mm256_add_ps(a, _mm256_load_ps(p + i));
        b = _mm256_add_ps(b, _mm256_load_ps(p + i + 8));
        c = _mm256_add_ps(c, _mm256_load_ps(p + i + 16));
        d = _mm256_add_ps(d, _mm256_load_ps(p + i + 24));
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    return out[0];
}

static const size_t HALF = READ_BYTES / sizeof(float) / 2;

/* cpu 1's side of every round: answer each hand-off, then read its half. */
static void *answer(void *arg) {
    int rounds = *(int *)arg;
    pin(1);
    for (int r = 0; r < rounds; r++) {
        pthread_barrier_wait(&step);
        for (int i = 0; i < HAND_OFFS; i++) {
            while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 1) {
            }
            atomic_store_explicit(&line, 2 * i + 2, memory_order_release);
        }
        pthread_barrier_wait(&step);
        read_sink[1] = sum(buffer + HALF, HALF);
        pthread_barrier_wait(&step);
    }
    return NULL;
}

static void pair(int rounds) {
    buffer = aligned_alloc(64, READ_BYTES);
    if (!buffer) {
        fprintf(stderr, "no memory for %lu bytes\n", READ_BYTES);
        exit(1);
    }
    memset(buffer, 0, READ_BYTES);
    pthread_barrier_init(&step, NULL, 2);
    pin(0);
    pthread_t other;
    pthread_create(&other, NULL, answer, &rounds);
    for (int r = 0; r < rounds; r++) {
        atomic_store(&line, 0);
        pthread_barrier_wait(&step);
        double start = now();
        for (int i = 0; i < HAND_OFFS; i++) {
            atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 2) {
            }
        }
        double round_trip = (now() - start) / HAND_OFFS * 1e9;
        pthread_barrier_wait(&step);
        start = now();
        read_sink[0] = sum(buffer, HALF);
        pthread_barrier_wait(&step);
        printf("round trip %.0f ns, both cores read %.1f GB/s\n", round_trip,
               READ_BYTES / (now() - start) / 1e9);
        fflush(stdout);
    }
    pthread_join(other, NULL);
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "clock") == 0) {
        clock_rate();
    } else if (argc >= 2 && strcmp(argv[1], "peak") == 0) {
        peak();
    } else if (argc >= 2 && strcmp(argv[1], "pair") == 0) {
        pair(argc >= 3 ? atoi(argv[2]) : 20);
    } else {
        fprintf(stderr, "usage: %s clock | peak | pair [rounds]\n", argv[0]);
        return 2;
    }
    return 0;
}
