/*
 * The inner loop of the Q4_1 kernel in crates/hrm-model/src/quant_matmul.rs (AVX2, one
 * activation row), copied in C to time its arithmetic alone: weight rows that stay in the L1,
 * one thread, no thread team, no memory traffic, and so none of the kernel's prefetches. Only
 * the AVX2 form: on CPUs with AVX-512 VNNI the kernel runs `vpdpbusd` instead, which this copy
 * leaves out. docs/performance.md gives what it measured on a Zen 3 core, on whose VM `perf
 * stat` has no counters ("Machine A on 2026-12-04", and the group sums in "Machine A on
 * 2026-12-05"), and on a Zen 5 ("The Zen 5 on 2026-12-04").
 *
 *     gcc -O2 -mavx2 -mfma -mf16c benches/q4_1_loop.c -o /tmp/q4_1_loop
 *     /tmp/q4_1_loop 18      # blocks a row: 18 for SmolLM2's qkv, o and gate_up; 48 for down
 *
 * For five variants of the loop it prints the nanoseconds and cycles (at the clock given as the
 * second argument, 2.85 GHz if none) a pair of blocks takes, and the weights read per second (40
 * bytes a pair: 32 of quants, 8 of scales and minimums), the best of seven timings each:
 *   cross-lane    each pair's scales spread with `vpermps`, as the kernel does;
 *   in-lane       each group's scales reordered once, each pair's spread with `vpermilps`;
 *   in-lane, two  the same with odd pairs in a second accumulator;
 *   no products   the integer products replaced by adds (wrong sums, the same loads);
 *   group sums    each group's four pairs of lane sums added, by unpacks and adds, into one
 *                 register of its eight blocks' sums, then one convert, permute and `fmadd` a
 *                 group instead of one a pair (the same products, summed in another order).
 * The sums are printed so that the compiler keeps the work (the no-products variant's is wrong).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_BLOCKS 96
#define BYTES_PER_ROW(nb) ((nb) / 2 * 32 + (nb) * 4)
/* Rows of weights in about 20 KB, so that they stay in the L1. */
#define WEIGHT_BYTES 20480

static int nb;
static uint8_t weights[WEIGHT_BYTES + 4096] __attribute__((aligned(64)));
static int8_t act_quants[MAX_BLOCKS / 2 * 64] __attribute__((aligned(64)));
/* Padded to whole groups, as the kernel's activation rows are. */
static float act_scales[MAX_BLOCKS + 8], act_sums[MAX_BLOCKS + 8];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline float sum_lanes(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

enum variant { CROSS_LANE, IN_LANE, IN_LANE_TWO, NO_PRODUCTS, GROUP_SUMS };

struct lanes {
    __m256 acc, odd, min;
};

/* One group of up to eight blocks (`pairs` pairs) of the row at `row`, from block `g`. */
static inline __attribute__((always_inline)) void group(const uint8_t *row, int g, int pairs,
                                                        enum variant v, struct lanes *l) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t *scales = row + nb / 2 * 32;
    /* A short group's scales run on into the minimums or the next row: the kernel clears the
     * lanes past the row's blocks, and so does this copy. */
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 kept = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(2 * pairs), lane));
    __m256 d_w = _mm256_and_ps(
        kept, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * g))));
    __m256 dd = _mm256_mul_ps(d_w, _mm256_loadu_ps(act_scales + g));
    if (v == IN_LANE || v == IN_LANE_TWO)
        dd = _mm256_permutevar8x32_ps(dd, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    __m256 m_w = _mm256_and_ps(
        kept, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * nb + 2 * g))));
    l->min = _mm256_fmadd_ps(m_w, _mm256_loadu_ps(act_sums + g), l->min);
    /* GROUP_SUMS: the group's pairs' lane sums, zero past a short group's last pair. */
    __m256i pair_lanes[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                             _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
    for (int i = 0; i < pairs; i++) {
        int p = g / 2 + i;
        __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 32 * p));
        __m256i w0 = _mm256_and_si256(packed, low);
        __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        __m256i x0 = _mm256_load_si256((const __m256i *)(act_quants + 64 * p));
        __m256i x1 = _mm256_load_si256((const __m256i *)(act_quants + 64 * p + 32));
        __m256i pair_sums =
            v == NO_PRODUCTS
                ? _mm256_add_epi16(_mm256_add_epi16(w0, x0), _mm256_add_epi16(w1, x1))
                : _mm256_madd_epi16(
                      _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)),
                      ones);
        if (v == GROUP_SUMS) {
            pair_lanes[i] = pair_sums;
            continue;
        }
        __m256 sums = _mm256_cvtepi32_ps(pair_sums);
        __m256 scale;
        if (v == IN_LANE || v == IN_LANE_TWO) {
            switch (i) {
            case 0: scale = _mm256_permute_ps(dd, 0x00); break;
            case 1: scale = _mm256_permute_ps(dd, 0x55); break;
            case 2: scale = _mm256_permute_ps(dd, 0xAA); break;
            default: scale = _mm256_permute_ps(dd, 0xFF);
            }
        } else {
            int a = 2 * i, b = 2 * i + 1;
            scale = _mm256_permutevar8x32_ps(dd, _mm256_setr_epi32(a, a, a, a, b, b, b, b));
        }
        if (v == IN_LANE_TWO && (i & 1))
            l->odd = _mm256_fmadd_ps(scale, sums, l->odd);
        else
            l->acc = _mm256_fmadd_ps(scale, sums, l->acc);
    }
    if (v == GROUP_SUMS) {
        /* Pair i holds block 2i in its low four lanes and 2i + 1 in its high four. Interleaving
         * two pairs' lanes and adding halves each block's lanes, twice: the result holds blocks
         * 0, 2, 4, 6 in its low half and 1, 3, 5, 7 in its high half, so the scales are
         * permuted to match. */
        __m256i *r = pair_lanes;
        __m256i t0 =
            _mm256_add_epi32(_mm256_unpacklo_epi32(r[0], r[1]), _mm256_unpackhi_epi32(r[0], r[1]));
        __m256i t1 =
            _mm256_add_epi32(_mm256_unpacklo_epi32(r[2], r[3]), _mm256_unpackhi_epi32(r[2], r[3]));
        __m256i blocks =
            _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
        __m256 scales = _mm256_permutevar8x32_ps(dd, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        l->acc = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(blocks), l->acc);
    }
}

/* As the kernel: whole groups with a fixed count of pairs, so that they unroll, then the rest. */
static inline __attribute__((always_inline)) float dot_row(const uint8_t *row, enum variant v) {
    struct lanes l = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int whole = nb / 8 * 8;
    for (int g = 0; g < whole; g += 8) group(row, g, 4, v, &l);
    if (whole < nb) group(row, whole, (nb - whole) / 2, v, &l);
    return sum_lanes(_mm256_add_ps(l.acc, l.odd)) + sum_lanes(l.min);
}

#define ROWS_FN(name, variant)                                                                     \
    static __attribute__((noinline)) float name(int rows) {                                       \
        float sum = 0;                                                                             \
        for (int j = 0; j < rows; j++) sum += dot_row(weights + j * BYTES_PER_ROW(nb), variant);  \
        return sum;                                                                                \
    }
ROWS_FN(cross_lane, CROSS_LANE)
ROWS_FN(in_lane, IN_LANE)
ROWS_FN(in_lane_two, IN_LANE_TWO)
ROWS_FN(no_products, NO_PRODUCTS)
ROWS_FN(group_sums, GROUP_SUMS)

static void time_variant(const char *name, float (*rows_fn)(int), int rows, double ghz) {
    long reps = 20000000L / (rows * nb);
    double best = 1e9;
    float sink = 0;
    for (int t = 0; t < 7; t++) {
        double start = now();
        for (long r = 0; r < reps; r++) sink += rows_fn(rows);
        double s = now() - start;
        if (s < best) best = s;
    }
    double pairs = (double)reps * rows * nb / 2;
    printf("%-14s %.2f ns a pair, %.2f cycles at %.2f GHz, %.1f GB/s of weights (sum %g)\n", name,
           best / pairs * 1e9, best / pairs * ghz * 1e9, ghz, pairs * 40 / best / 1e9, sink);
}

int main(int argc, char **argv) {
    nb = argc > 1 ? atoi(argv[1]) : 18;
    double ghz = argc > 2 ? atof(argv[2]) : 2.85;
    if (nb < 2 || nb > MAX_BLOCKS || nb % 2) {
        fprintf(stderr, "blocks a row: an even number from 2 to %d\n", MAX_BLOCKS);
        return 2;
    }
    int rows = WEIGHT_BYTES / BYTES_PER_ROW(nb);
    srand(1);
    for (size_t i = 0; i < sizeof weights; i++) weights[i] = rand();
    for (int r = 0; r < rows; r++) {
        uint16_t *scales = (uint16_t *)(weights + r * BYTES_PER_ROW(nb) + nb / 2 * 32);
        for (int b = 0; b < 2 * nb; b++) scales[b] = 0x2000 + rand() % 0x1000; /* small f16 */
    }
    for (size_t i = 0; i < sizeof act_quants; i++) act_quants[i] = rand() % 255 - 127;
    for (int b = 0; b < nb; b++) {
        act_scales[b] = 0.01f;
        act_sums[b] = 0.1f;
    }
    printf("%d blocks a row, %d rows (%d bytes)\n", nb, rows, rows * BYTES_PER_ROW(nb));
    time_variant("cross-lane", cross_lane, rows, ghz);
    time_variant("in-lane", in_lane, rows, ghz);
    time_variant("in-lane, two", in_lane_two, rows, ghz);
    time_variant("no products", no_products, rows, ghz);
    time_variant("group sums", group_sums, rows, ghz);
    return 0;
}
