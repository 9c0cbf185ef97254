/* Routed experts on the CPU for experts kept in host RAM: NVFP4 and FP8-block matrix-vector products,
 * and a whole expert MLP pass (gate and up, clamped SwiGLU, down) over a batch of (row, expert) pairs.
 *
 * NVFP4:     y[r, n] = sum_k x[r, k] * e2m1(code[n, k]) * fp8(scale[n, k / 16]) * global[n]
 * FP8 block: y[r, n] = sum_k x[r, k] * e4m3(w[n, k]) * scale_inv[n / bn, k / bk]
 *
 * Decode-sized batches read each weight byte once and never expand the matrix: per output row the
 * packed codes stream through, are turned into weights in registers, and every row of x (up to
 * MAX_ROWS) reuses them. NVFP4 rows of x are stored split, their even columns then their odd ones,
 * so the low nibbles of a run of bytes meet contiguous even columns and the high nibbles odd ones.
 * Three code paths, picked at run time (the caller may cap the level to compare them):
 *   portable C (the reference), AVX2 (NVFP4: a byte shuffle looks up exact int8 weights, multiplied with
 *   x in 16-bit integers by vpmaddwd; FP8: F16C widens e4m3), AVX-512 (one permute looks 16 codes up as
 *   floats; e4m3 widened 16 at a time), and, where the CPU has AVX-512 VNNI, NVFP4 with x in 16-bit
 *   integers split into byte planes (see prepare_row_x8_planes; FP8 takes the AVX-512 path there).
 * The expert pass runs on the kernels' own thread pool (thread_pool.c), sized by the caller, whose
 * workers stay awake between a decode step's layers; one fork-join a pass (experts_forward).
 *
 * Called through ctypes (no Python or torch headers): buffers are contiguous, the fp8 -> float table
 * comes from the caller so the codec lives in one place.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "thread_pool.h"

#define GROUP 16
#define MAX_ROWS 8 /* rows of x handled per pass over the weights */
#ifndef TILE /* a build may set it (-DTILE=...) to compare unit sizes */
#define TILE 32 /* output rows of one matrix per unit of work in the expert pass */
#endif

enum { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AVX512_VNNI = 3 };
enum { NVFP4 = 0, FP8_BLOCK = 1 };

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* One quantized matrix, or a stack of them (one per expert, `expert` selects). */
typedef struct {
    int32_t format;        /* NVFP4 or FP8_BLOCK */
    int64_t n, k;          /* output rows, input columns */
    const uint8_t *data;   /* NVFP4 codes [E, n, k/2]; FP8 e4m3 bytes [E, n, k] */
    const uint8_t *scales; /* NVFP4 group scales [E, n, k/16] (e4m3 bytes); FP8: unused */
    const float *factors;  /* NVFP4 global [E, 1 or n]; FP8 scale_inv [E, ceil(n/bn), ceil(k/bk)] */
    int64_t global_stride; /* NVFP4: 0 (one global per matrix) or 1 (one per row) */
    int64_t bn, bk;        /* FP8 block */
} matrix;

/* ---------------------------------------------------------------- NVFP4 rows */

/* One weight row against `rows` split rows of x (xs: even columns at [0, k/2), odd at [k/2, k) of each
 * row, rows `x_stride` apart); out[r * out_stride] = the product. Portable, the reference. */
static void nvfp4_row_scalar(const float *xs, int64_t x_stride, int64_t rows, int64_t half_k, int64_t g0,
                             const uint8_t *codes, const uint8_t *scales, const float *fp8_table, float global,
                             float *out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *e = xs + r * x_stride, *o = e + half_k;
        float acc = 0.0f;
        for (int64_t g = g0; g < half_k / (GROUP / 2); g++) {
            float part = 0.0f;
            for (int j = 0; j < GROUP / 2; j++) {
                uint8_t b = codes[g * (GROUP / 2) + j];
                part += E2M1[b & 15] * e[g * (GROUP / 2) + j] + E2M1[b >> 4] * o[g * (GROUP / 2) + j];
            }
            acc += part * fp8_table[scales[g]];
        }
        out[r * out_stride] = acc * global;
    }
}

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Twice the E2M1 values as int8, by code: one byte shuffle looks up 16 codes at once, exactly. */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* ... plus 12, as unsigned bytes (AVX-512 VNNI multiplies an unsigned byte by a signed one). */
#define E2M1_X2_BIAS 12
static const uint8_t E2M1_X2_BIASED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* The integer NVFP4 paths (AVX2, AVX-512 VNNI) read x as 16-bit integers: per group of 16 columns a float
 * scale (the group's largest |x| over X16_TOP) and the columns rounded to it, so the products of the int8
 * weights (x2) and x add up exactly in int32, where a float path widens every weight to float and needs an
 * FMA per 8 or 16. The rounding is the only change: at most half a step, 1/65278 of the group's largest |x|
 * (bf16 activations round ~100x coarser). A prepared row of k columns takes the k floats the other paths use:
 * its 2k bytes of integers, then each group's float scale.
 * AVX2 (vpmaddwd, 16 products a step): k int16, the even columns then the odd ones; 4 copies of each scale (a
 * 2-group step loads them as one vector).
 * AVX-512 VNNI (vpdpbusd, 64 products of an unsigned byte and a signed one): each x = 256 a + b with a and b
 * signed bytes (b = x's low byte as signed, so |x| <= X16_TOP = 32639 keeps a within a byte), 4 planes of
 * k/2: b of the even columns, of the odd, a of the even, of the odd; the weights as unsigned bytes u = w + 12,
 * looked up by one shuffle: sum w x = 256 sum u a + sum u b - 12 sum x, exactly, in int32. The last sum is
 * x's alone: each group's -12 sum x times its scale is kept after the scales, and a weight row adds its
 * scales' dot product with them. An offset on x instead (x + 32768, unsigned bytes against signed weights)
 * left the weights' own sums to compute at every step: two more vpdpbusd and a shift in every 128 codes. */
#define X16_SCALES(k) ((k) / 2)                   /* float offset of a prepared row's scales */
#define X8_CORRECTIONS(k) ((k) / 2 + (k) / GROUP) /* ... and of its groups' corrections (VNNI) */
#define X16_TOP 32639

/* Group `g` of src rounded to int16 as above -> its scale. */
static float x16_group(const float *src, int64_t g, int16_t q[GROUP]) {
    float top = 0.0f;
    for (int j = 0; j < GROUP; j++) top = fmaxf(top, fabsf(src[g * GROUP + j]));
    const float inverse = top > 0.0f ? (float)X16_TOP / top : 0.0f;
    for (int j = 0; j < GROUP; j++) q[j] = (int16_t)lrintf(src[g * GROUP + j] * inverse);
    return top / (float)X16_TOP;
}

static void prepare_row_x16(const float *src, int64_t k, float *dst, int copies, int64_t g0, int64_t g1) {
    const int64_t half_k = k / 2;
    int16_t *out = (int16_t *)dst, q[GROUP];
    for (int64_t g = g0; g < g1; g++) {
        const float scale = x16_group(src, g, q);
        for (int j = 0; j < GROUP / 2; j++) {
            out[g * 8 + j] = q[2 * j];
            out[half_k + g * 8 + j] = q[2 * j + 1];
        }
        for (int c = 0; c < copies; c++) dst[X16_SCALES(k) + g * copies + c] = scale;
    }
}

static void prepare_row_x8_planes(const float *src, int64_t k, float *dst, int64_t g0, int64_t g1) {
    const int64_t half_k = k / 2;
    uint8_t *planes = (uint8_t *)dst;
    int16_t q[GROUP];
    for (int64_t g = g0; g < g1; g++) {
        const float scale = x16_group(src, g, q);
        int32_t sum = 0;
        dst[X16_SCALES(k) + g] = scale;
        for (int j = 0; j < GROUP; j++) {
            const int8_t low = (int8_t)(uint8_t)(q[j] & 255), high = (int8_t)((q[j] - low) / 256);
            const int64_t at = (j % 2) * half_k + g * 8 + j / 2; /* even columns' plane, then the odd */
            planes[at] = (uint8_t)low;
            planes[k + at] = (uint8_t)high;
            sum += q[j];
        }
        dst[X8_CORRECTIONS(k) + g] = -(float)(E2M1_X2_BIAS * sum) * scale;
    }
}

/* The SIMD row kernels below take the count of x rows as a compile-time constant (1..MAX_ROWS): each
 * count gets its own straight-line code with every accumulator in a register (a run-time count left
 * them in memory, one store-to-load round trip per step). ROWS_DISPATCH calls `kernel_body(ROWS, ...)`
 * for the run-time `rows`. */
#define ROWS_DISPATCH(rows, kernel_body, ...)                                                                  \
    switch (rows) {                                                                                         \
    case 1: kernel_body(1, __VA_ARGS__); break;                                                             \
    case 2: kernel_body(2, __VA_ARGS__); break;                                                             \
    case 3: kernel_body(3, __VA_ARGS__); break;                                                             \
    case 4: kernel_body(4, __VA_ARGS__); break;                                                             \
    case 5: kernel_body(5, __VA_ARGS__); break;                                                             \
    case 6: kernel_body(6, __VA_ARGS__); break;                                                             \
    case 7: kernel_body(7, __VA_ARGS__); break;                                                             \
    default: kernel_body(MAX_ROWS, __VA_ARGS__); break;                                                     \
    }

/* AVX2, two groups (16 bytes, 32 codes) per step against prepared int16 rows: byte shuffles look the low
 * nibbles (even columns) and the high ones (odd) up as int8 weights x2, widened to int16 and reused by every
 * row of x; two vpmaddwd and an add give 8 int32 sums, 4 per group, scaled by weight scale x x scale. A last
 * odd group runs alone, its other half zero. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
nvfp4_rows_avx2(const int rows, const float *xs, int64_t x_stride, int64_t half_k, int64_t g0, const uint8_t *codes,
                const uint8_t *scales, const float *fp8_table, float global, float *out, int64_t out_stride) {
    const __m128i table = _mm_loadu_si128((const __m128i *)E2M1_X2), nibble = _mm_set1_epi8(15);
    const int64_t groups = half_k / 8;
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = g0; g < groups; g += 2) {
        const int pair = g + 1 < groups;
        const __m128i bytes = pair ? _mm_loadu_si128((const __m128i *)(codes + g * 8))
                                   : _mm_loadl_epi64((const __m128i *)(codes + g * 8));
        const __m256i we = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble)));
        const __m256i wo =
            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)));
        const __m256 ws = _mm256_setr_m128(_mm_set1_ps(fp8_table[scales[g]]),
                                           _mm_set1_ps(pair ? fp8_table[scales[g + 1]] : 0.0f));
        for (int r = 0; r < rows; r++) {
            const float *row = xs + r * x_stride;
            const int16_t *e = (const int16_t *)row + g * 8, *o = e + half_k;
            const __m256i xe = pair ? _mm256_loadu_si256((const __m256i *)e)
                                    : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)e));
            const __m256i xo = pair ? _mm256_loadu_si256((const __m256i *)o)
                                    : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)o));
            const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(we, xe), _mm256_madd_epi16(wo, xo));
            const float *xscale = row + X16_SCALES(2 * half_k) + g * 4; /* each group's, 4 times */
            const __m256 scale = _mm256_mul_ps(ws, pair ? _mm256_loadu_ps(xscale)
                                                        : _mm256_zextps128_ps256(_mm_loadu_ps(xscale)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = hsum256(acc[r]) * 0.5f * global;
}

__attribute__((target("avx2,fma"))) static void nvfp4_row_avx2(const float *xs, int64_t x_stride, int64_t rows,
                                                              int64_t half_k, int64_t g0, const uint8_t *codes,
                                                              const uint8_t *scales, const float *fp8_table,
                                                              float global, float *out, int64_t out_stride) {
    ROWS_DISPATCH(rows, nvfp4_rows_avx2, xs, x_stride, half_k, g0, codes, scales, fp8_table, global, out, out_stride)
}

/* AVX-512, two groups per step: 16 bytes widen to 16 lanes; a float permute reads its index from the
 * low 4 bits of a lane, so the low nibbles index the E2M1 table directly and the high ones after a
 * shift. Lanes 0-7 belong to the first group, 8-15 to the second: one scale vector serves both.
 * Consecutive steps add into two accumulators per row, so one row of x is not bound by the latency
 * of a single chain of FMAs. */
__attribute__((target("avx512f"), always_inline)) static inline void
nvfp4_step_avx512(const int rows, const float *xs, int64_t x_stride, int64_t half_k, const uint8_t *codes,
                  const uint8_t *scales, const float *fp8_table, int64_t g, int64_t groups, __m512 *acc) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    const int pair = g + 1 < groups;
    const __mmask16 lanes = pair ? 0xFFFF : 0x00FF;
    __m128i bytes = pair ? _mm_loadu_si128((const __m128i *)(codes + g * 8))
                         : _mm_loadl_epi64((const __m128i *)(codes + g * 8));
    __m512i idx = _mm512_cvtepu8_epi32(bytes);
    __m512 we = _mm512_permutexvar_ps(idx, table);
    __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
    __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(fp8_table[scales[g]]),
                                        _mm512_set1_ps(pair ? fp8_table[scales[g + 1]] : 0.0f));
    for (int r = 0; r < rows; r++) {
        const float *e = xs + r * x_stride + g * 8, *o = e + half_k;
        __m512 part = _mm512_mul_ps(we, _mm512_maskz_loadu_ps(lanes, e));
        part = _mm512_fmadd_ps(wo, _mm512_maskz_loadu_ps(lanes, o), part);
        acc[r] = _mm512_fmadd_ps(part, scale, acc[r]);
    }
}

__attribute__((target("avx512f"), always_inline)) static inline void
nvfp4_rows_avx512(const int rows, const float *xs, int64_t x_stride, int64_t half_k, int64_t g0,
                  const uint8_t *codes, const uint8_t *scales, const float *fp8_table, float global, float *out,
                  int64_t out_stride) {
    const int64_t groups = half_k / 8;
    __m512 acc[2][MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    int64_t g = g0;
    for (; g + 4 <= groups; g += 4) {
        nvfp4_step_avx512(rows, xs, x_stride, half_k, codes, scales, fp8_table, g, groups, acc[0]);
        nvfp4_step_avx512(rows, xs, x_stride, half_k, codes, scales, fp8_table, g + 2, groups, acc[1]);
    }
    for (; g < groups; g += 2) nvfp4_step_avx512(rows, xs, x_stride, half_k, codes, scales, fp8_table, g, groups, acc[0]);
    for (int r = 0; r < rows; r++) out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r])) * global;
}

__attribute__((target("avx512f"))) static void nvfp4_row_avx512(const float *xs, int64_t x_stride, int64_t rows,
                                                               int64_t half_k, int64_t g0, const uint8_t *codes,
                                                               const uint8_t *scales, const float *fp8_table,
                                                               float global, float *out, int64_t out_stride) {
    ROWS_DISPATCH(rows, nvfp4_rows_avx512, xs, x_stride, half_k, g0, codes, scales, fp8_table, global, out,
                  out_stride)
}

/* 16 e4m3 bytes widened to floats at once (as e4m3_scaled8 does 8), each 1/256 of its value: the e4m3
 * bits shifted into an fp16's, whose exponent bias is 8 more. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512 e4m3_scaled16(const uint8_t *p) {
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
    __m256i rest = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

/* Groups g..g+7 (64 bytes: 128 codes) against `rows` prepared rows (byte planes): byte shuffles look the low
 * nibbles (even columns) and the high ones (odd) up as unsigned weights x2 + 12; per row four vpdpbusd against
 * x's low and high bytes give 16 int32 sums, 2 per group (their -12 sum x is added per weight row, see
 * nvfp4_rows_x8), scaled by weight scale x x scale. Past the last group every load is masked: the x bytes there
 * are zero and so are the scales. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) static inline void
nvfp4_step_x8(const int rows, const float *xs, int64_t x_stride, int64_t half_k, const uint8_t *codes,
              const float *wscale, int64_t g, int64_t groups, __m512 *acc) {
    const int64_t left = groups - g;
    const __mmask64 lanes = left >= 8 ? ~0ULL : (1ULL << (8 * left)) - 1; /* a code byte (x byte) each */
    const __mmask8 eight = left >= 8 ? 0xFF : (1u << left) - 1;          /* a group each */
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_X2_BIASED));
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i bytes = _mm512_maskz_loadu_epi8(lanes, codes + g * 8);
    const __m512i we = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, nibble));
    const __m512i wo = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
    const __m256 ws = _mm256_maskz_loadu_ps(eight, wscale);
    const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int r = 0; r < rows; r++) {
        const float *row = xs + r * x_stride;
        const uint8_t *low = (const uint8_t *)row + g * 8, *high = low + 2 * half_k;
        __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), we, _mm512_maskz_loadu_epi8(lanes, low));
        lo = _mm512_dpbusd_epi32(lo, wo, _mm512_maskz_loadu_epi8(lanes, low + half_k));
        __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), we, _mm512_maskz_loadu_epi8(lanes, high));
        hi = _mm512_dpbusd_epi32(hi, wo, _mm512_maskz_loadu_epi8(lanes, high + half_k));
        const __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
        const __m256 scale8 = _mm256_mul_ps(ws, _mm256_maskz_loadu_ps(eight, row + X16_SCALES(2 * half_k) + g));
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(scale8));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
    }
}

/* The weight row's group scales are widened 16 at a time (e4m3_scaled16, the /256 folded into the global)
 * into a block on the stack before its steps; the last few one by one from the table. */
#define SCALE_BLOCK 64
/* Bytes of codes ahead of the step that each cache line's prefetch asks for (rows of a tile are contiguous,
 * so the stream runs on into the next row). 4 KiB against 1 KiB: 8 experts at batch 1 on the H200's 16
 * Xeon cores 67.8 against 58.1 GB/s (75% of the read rate against 60%), on 2 cores 14.9 against 12.2
 * (ops/BENCHMARKS.md): a core's misses need that much in flight to cover the loaded memory's latency. */
#ifndef PREFETCH_AHEAD /* a build may set it (-DPREFETCH_AHEAD=...) to compare distances */
#define PREFETCH_AHEAD 4096
#endif
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) static inline void
nvfp4_rows_x8(const int rows, const float *xs, int64_t x_stride, int64_t half_k, int64_t g0, const uint8_t *codes,
              const uint8_t *scales, const float *fp8_table, float global, float *out, int64_t out_stride) {
    const int64_t groups = half_k / 8;
    float wscale[SCALE_BLOCK];
    __m512 acc[MAX_ROWS], fix[MAX_ROWS]; /* fix: the weight scales' dot product with x's group corrections */
    for (int r = 0; r < rows; r++) acc[r] = fix[r] = _mm512_setzero_ps();
    for (int64_t b0 = g0; b0 < groups; b0 += SCALE_BLOCK) {
        const int64_t b1 = b0 + SCALE_BLOCK < groups ? b0 + SCALE_BLOCK : groups;
        int64_t g = b0;
        for (; g + 16 <= b1; g += 16) _mm512_storeu_ps(wscale + (g - b0), e4m3_scaled16(scales + g));
        for (; g < b1; g++) wscale[g - b0] = fp8_table[scales[g]] / 256.0f;
        for (g = b0; g < b1; g += 16) {
            const __mmask16 in = b1 - g >= 16 ? 0xFFFF : (__mmask16)((1u << (b1 - g)) - 1);
            const __m512 ws = _mm512_maskz_loadu_ps(in, wscale + (g - b0));
            const float *corrections = xs + X8_CORRECTIONS(2 * half_k) + g;
            for (int r = 0; r < rows; r++)
                fix[r] = _mm512_fmadd_ps(ws, _mm512_maskz_loadu_ps(in, corrections + r * x_stride), fix[r]);
        }
        for (g = b0; g < b1; g += 8) {
            _mm_prefetch((const char *)(codes + g * 8) + PREFETCH_AHEAD, _MM_HINT_T0);
            nvfp4_step_x8(rows, xs, x_stride, half_k, codes, wscale + (g - b0), g, b1, acc);
        }
    }
    for (int r = 0; r < rows; r++)
        out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], fix[r])) * 128.0f * global;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void
nvfp4_row_x8(const float *xs, int64_t x_stride, int64_t rows, int64_t half_k, int64_t g0, const uint8_t *codes,
             const uint8_t *scales, const float *fp8_table, float global, float *out, int64_t out_stride) {
    ROWS_DISPATCH(rows, nvfp4_rows_x8, xs, x_stride, half_k, g0, codes, scales, fp8_table, global, out, out_stride)
}

/* ---------------------------------------------------------------- FP8 block rows */

/* One weight row against `rows` rows of x (rows `x_stride` apart); portable. */
static void fp8_row_scalar(const float *x, int64_t x_stride, int64_t rows, int64_t k, int64_t first,
                           const uint8_t *w, const float *block_scales, int64_t bk, const float *fp8_table, float *out,
                           int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int64_t k0 = first; k0 < k; k0 += bk) {
            float part = 0.0f;
            for (int64_t j = k0; j < k0 + bk && j < k; j++) part += fp8_table[w[j]] * x[r * x_stride + j];
            acc += part * block_scales[k0 / bk];
        }
        out[r * out_stride] = acc;
    }
}

/* 8 e4m3 bytes -> 8 floats / 256: the bits move into fp16 position (exact for normals and subnormals
 * alike), F16C widens them; the 256 is folded into the block scale. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 e4m3_scaled8(const uint8_t *p) {
    __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
    __m128i rest = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

/* AVX2: 16 columns per step into two accumulators per row, each block's sum scaled once. Needs k and
 * bk multiples of 16. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
fp8_rows_avx2(const int rows, const float *x, int64_t x_stride, int64_t k, int64_t first, const uint8_t *w,
              const float *block_scales, int64_t bk, float *out, int64_t out_stride) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k0 = first; k0 < k; k0 += bk) {
        __m256 part[MAX_ROWS][2];
        for (int r = 0; r < rows; r++) part[r][0] = part[r][1] = _mm256_setzero_ps();
        const int64_t end = k0 + bk < k ? k0 + bk : k;
        for (int64_t j = k0; j < end; j += 16) {
            __m256 w0 = e4m3_scaled8(w + j), w1 = e4m3_scaled8(w + j + 8);
            for (int r = 0; r < rows; r++) {
                part[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * x_stride + j), part[r][0]);
                part[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * x_stride + j + 8), part[r][1]);
            }
        }
        __m256 scale = _mm256_set1_ps(256.0f * block_scales[k0 / bk]);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(part[r][0], part[r][1]), scale, acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = hsum256(acc[r]);
}

__attribute__((target("avx2,fma,f16c"))) static void fp8_row_avx2(const float *x, int64_t x_stride, int64_t rows,
                                                                 int64_t k, int64_t first, const uint8_t *w,
                                                                 const float *block_scales, int64_t bk,
                                                                 const float *fp8_table, float *out,
                                                                 int64_t out_stride) {
    (void)fp8_table;
    ROWS_DISPATCH(rows, fp8_rows_avx2, x, x_stride, k, first, w, block_scales, bk, out, out_stride)
}

/* AVX-512: 16 e4m3 bytes widened at a time (e4m3_scaled16), consecutive steps into two accumulators per
 * row. Needs k and bk multiples of 16. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void
fp8_rows_avx512(const int rows, const float *x, int64_t x_stride, int64_t k, int64_t first, const uint8_t *w,
                const float *block_scales, int64_t bk, float *out, int64_t out_stride) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k0 = first; k0 < k; k0 += bk) {
        __m512 part[2][MAX_ROWS];
        for (int r = 0; r < rows; r++) part[0][r] = part[1][r] = _mm512_setzero_ps();
        const int64_t end = k0 + bk < k ? k0 + bk : k;
        int64_t j = k0;
        for (; j + 32 <= end; j += 32) {
            __m512 w0 = e4m3_scaled16(w + j), w1 = e4m3_scaled16(w + j + 16);
            for (int r = 0; r < rows; r++) {
                part[0][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * x_stride + j), part[0][r]);
                part[1][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * x_stride + j + 16), part[1][r]);
            }
        }
        if (j < end) {
            __m512 w0 = e4m3_scaled16(w + j);
            for (int r = 0; r < rows; r++)
                part[0][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * x_stride + j), part[0][r]);
        }
        __m512 scale = _mm512_set1_ps(256.0f * block_scales[k0 / bk]);
        for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(part[0][r], part[1][r]), scale, acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = _mm512_reduce_add_ps(acc[r]);
}

__attribute__((target("avx512f,avx512bw"))) static void fp8_row_avx512(const float *x, int64_t x_stride,
                                                                      int64_t rows, int64_t k, int64_t first,
                                                                      const uint8_t *w, const float *block_scales,
                                                                      int64_t bk, const float *fp8_table, float *out,
                                                                      int64_t out_stride) {
    (void)fp8_table;
    ROWS_DISPATCH(rows, fp8_rows_avx512, x, x_stride, k, first, w, block_scales, bk, out, out_stride)
}

/* ---------------------------------------------------------------- dispatch */

/* The best path this CPU has, capped by the caller's level. */
static int level_for(int cap) {
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (cap >= AVX512_VNNI && avx512 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return AVX512_VNNI;
    if (cap >= AVX512 && avx512) return AVX512;
    if (cap >= AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return AVX2;
    return PORTABLE;
}

/* The code path a cap gives on this CPU (for callers that need to know, e.g. which rounding of x). */
int simd_path(int cap) { return level_for(cap); }

/* The code paths project_rows ran rows on since the last take_paths_run(), one bit each (1 << path): what
 * the kernels executed, for tests to hold against the CPU's features (simd_path says what level_for picks). */
static _Atomic int paths_run;

int take_paths_run(void) { return atomic_exchange(&paths_run, 0); }

/* Reads first: once its bit is set, the threads share the line without writing it. */
static void note_path(int path) {
    if (!(atomic_load_explicit(&paths_run, memory_order_relaxed) & 1 << path))
        atomic_fetch_or_explicit(&paths_run, 1 << path, memory_order_relaxed);
}

/* Whether a matrix's shape suits the SIMD paths (else its rows take the portable one). */
static int simd_shape(const matrix *m) {
    return m->format == NVFP4 ? 1 : m->k % 16 == 0 && m->bk % 16 == 0;
}

/* Output rows [row0, row1) of expert `expert`'s matrix for `rows` rows of x (prepared: split for NVFP4,
 * plain for FP8), rows `x_stride` apart, over input columns [first, k) (a multiple of GROUP for NVFP4, of the
 * block for FP8; the columns before it belong to the device's part of a split expert); y[r * y_stride + row]. */
static void project_rows(const matrix *m, int64_t expert, int64_t row0, int64_t row1, int64_t first, const float *x,
                         int64_t x_stride, int64_t rows, float *y, int64_t y_stride, const float *fp8_table,
                         int level) {
    if (!simd_shape(m)) level = PORTABLE;
    if (m->format == FP8_BLOCK && level > AVX512) level = AVX512; /* FP8 has no VNNI path */
    note_path(level);
    if (m->format == NVFP4) {
        const int64_t half_k = m->k / 2;
        const uint8_t *codes = m->data + expert * m->n * half_k;
        const uint8_t *scales = m->scales + expert * m->n * (m->k / GROUP);
        const float *global = m->factors + expert * (m->global_stride ? m->n : 1);
        for (int64_t row = row0; row < row1; row++)
            for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
                const int64_t count = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
                const float *xr = x + r0 * x_stride;
                const uint8_t *c = codes + row * half_k, *s = scales + row * (m->k / GROUP);
                const float gs = global[row * m->global_stride];
                float *out = y + r0 * y_stride + row;
                const int64_t g0 = first / GROUP;
                if (level == AVX512_VNNI)
                    nvfp4_row_x8(xr, x_stride, count, half_k, g0, c, s, fp8_table, gs, out, y_stride);
                else if (level == AVX512)
                    nvfp4_row_avx512(xr, x_stride, count, half_k, g0, c, s, fp8_table, gs, out, y_stride);
                else if (level == AVX2)
                    nvfp4_row_avx2(xr, x_stride, count, half_k, g0, c, s, fp8_table, gs, out, y_stride);
                else
                    nvfp4_row_scalar(xr, x_stride, count, half_k, g0, c, s, fp8_table, gs, out, y_stride);
            }
    } else {
        const int64_t kb = (m->k + m->bk - 1) / m->bk, nb = (m->n + m->bn - 1) / m->bn;
        const uint8_t *w = m->data + expert * m->n * m->k;
        const float *block_scales = m->factors + expert * nb * kb;
        for (int64_t row = row0; row < row1; row++)
            for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
                const int64_t count = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
                const float *xr = x + r0 * x_stride;
                const uint8_t *wr = w + row * m->k;
                const float *sr = block_scales + (row / m->bn) * kb;
                float *out = y + r0 * y_stride + row;
                if (level >= AVX512)
                    fp8_row_avx512(xr, x_stride, count, m->k, first, wr, sr, m->bk, fp8_table, out, y_stride);
                else if (level == AVX2)
                    fp8_row_avx2(xr, x_stride, count, m->k, first, wr, sr, m->bk, fp8_table, out, y_stride);
                else
                    fp8_row_scalar(xr, x_stride, count, m->k, first, wr, sr, m->bk, fp8_table, out, y_stride);
            }
    }
}

/* Columns [c0, c1) of row `src` (k values) into the layout the matrix's code path reads (the whole row in k
 * floats): NVFP4 splits even and odd columns, as integers on the integer paths (16-bit on AVX2, byte planes
 * on AVX-512 VNNI); for NVFP4 c0 and c1 are multiples of GROUP (or c1 = k). Any split of a row into column
 * ranges gives the same bytes as the whole row at once. */
static void prepare_columns(const matrix *m, const float *src, float *dst, int level, int64_t c0, int64_t c1) {
    if (m->format != NVFP4) {
        memcpy(dst + c0, src + c0, sizeof(float) * (size_t)(c1 - c0));
        return;
    }
    if (level == AVX2) {
        prepare_row_x16(src, m->k, dst, 4, c0 / GROUP, c1 / GROUP);
        return;
    }
    if (level == AVX512_VNNI) {
        prepare_row_x8_planes(src, m->k, dst, c0 / GROUP, c1 / GROUP);
        return;
    }
    const int64_t half_k = m->k / 2;
    for (int64_t j = c0 / 2; j < c1 / 2; j++) {
        dst[j] = src[2 * j];
        dst[half_k + j] = src[2 * j + 1];
    }
}

static int check(const matrix *m) {
    if (m->n < 0 || m->k <= 0) return -1;
    if (m->format == NVFP4) return m->k % GROUP ? -1 : 0;
    if (m->format == FP8_BLOCK) return m->bn > 0 && m->bk > 0 ? 0 : -1;
    return -1;
}

/* ---------------------------------------------------------------- entry points */

/* y [rows, n] = x [rows, k] @ matrix(expert 0)^T, output rows shared among `threads` threads. */
typedef struct {
    const matrix *m;
    const float *x; /* prepared */
    int64_t rows;
    float *y;
    const float *fp8_table;
    int level;
    int64_t next_tile;
} gemv_job;

static void gemv_share(void *context, int id, int team) {
    (void)id, (void)team;
    gemv_job *j = context;
    const int64_t tiles = (j->m->n + TILE - 1) / TILE;
    for (int64_t t = pool_claim(&j->next_tile); t < tiles; t = pool_claim(&j->next_tile)) {
        const int64_t row1 = (t + 1) * TILE < j->m->n ? (t + 1) * TILE : j->m->n;
        project_rows(j->m, 0, t * TILE, row1, 0, j->x, j->m->k, j->rows, j->y, j->m->n, j->fp8_table, j->level);
    }
}

/* level: the highest code path allowed (0 portable, 1 AVX2, 2 AVX-512). Returns 0, or -1 on bad shapes. */
int gemv(const matrix *m, const float *x, int64_t rows, float *y, const float *fp8_table, int threads, int level) {
    if (check(m) || rows < 0) return -1;
    float *prepared = malloc(sizeof(float) * (size_t)(rows * m->k + 1));
    if (!prepared) return -1;
    const int path = level_for(level);
    for (int64_t r = 0; r < rows; r++) prepare_columns(m, x + r * m->k, prepared + r * m->k, path, 0, m->k);
    gemv_job job = {m, prepared, rows, y, fp8_table, path, 0};
    pool_run(threads, gemv_share, &job, 0);
    free(prepared);
    return 0;
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* The routed experts' MLP over pairs grouped by expert, in one fork-join of the pool. Its units of work,
 * claimed in this order: each pair's input prepared, PREPARE_COLUMNS columns a unit; per expert, a tile of
 * gate and up rows with the SwiGLU of those columns, prepared for down; per expert, a tile of down rows.
 * A unit waits only for what it reads (counters per pair and per expert), never for a whole phase: at
 * batch 1 a layer's pass is one or two experts, where three barriers and a SwiGLU on one thread per pair
 * took a large part of it. Units are claimed in order and run to the end, so every wait is on a unit a
 * running thread holds. */
#define PREPARE_COLUMNS 1024
typedef struct {
    const matrix *gate, *up, *down;
    const float *x;
    int64_t pairs, groups;
    const int64_t *experts, *starts;
    const int64_t *firsts; /* per group: its first intermediate row (the rows before it run on the device) */
    const float *pair_weights;
    float limit;
    float *out, *xin, *g_out, *u_out, *h;
    const float *fp8_table;
    int level;
    int64_t chunks, tiles_in, tiles_out; /* preparing units per pair; gate-up and down tiles per expert */
    _Atomic int64_t *prepared;           /* per pair: chunks prepared */
    _Atomic int64_t *activated;          /* per group: gate-up tiles done */
    int64_t next_unit;
} experts_job;

static void wait_for(_Atomic int64_t *counter, int64_t target) {
    for (unsigned turn = 1; atomic_load_explicit(counter, memory_order_acquire) < target; turn++) pool_relax(turn);
}

static void prepare_unit(experts_job *j, int64_t unit) {
    const int64_t d = j->gate->k, p = unit / j->chunks, c0 = unit % j->chunks * PREPARE_COLUMNS;
    const int64_t c1 = c0 + PREPARE_COLUMNS < d ? c0 + PREPARE_COLUMNS : d;
    prepare_columns(j->gate, j->x + p * d, j->xin + p * d, j->level, c0, c1);
    atomic_fetch_add_explicit(&j->prepared[p], 1, memory_order_release);
}

static void gate_up_unit(experts_job *j, int64_t g, int64_t t) {
    const int64_t d = j->gate->k, inter = j->gate->n, p0 = j->starts[g], count = j->starts[g + 1] - p0;
    const int64_t first = j->firsts[g], end = (t + 1) * TILE < inter ? (t + 1) * TILE : inter;
    const int64_t row0 = t * TILE > first ? t * TILE : first, row1 = end > row0 ? end : row0;
    for (int64_t p = p0; p < p0 + count && row0 < row1; p++) wait_for(&j->prepared[p], j->chunks);
    project_rows(j->gate, j->experts[g], row0, row1, 0, j->xin + p0 * d, d, count, j->g_out + p0 * inter, inter,
                 j->fp8_table, j->level);
    project_rows(j->up, j->experts[g], row0, row1, 0, j->xin + p0 * d, d, count, j->u_out + p0 * inter, inter,
                 j->fp8_table, j->level);
    for (int64_t p = p0; p < p0 + count && row0 < row1; p++) {
        float *act = j->g_out + p * inter; /* the activation overwrites the gate, then is prepared */
        const float *up = j->u_out + p * inter;
        for (int64_t i = row0; i < row1; i++)
            act[i] = silu(fminf(act[i], j->limit)) * fminf(fmaxf(up[i], -j->limit), j->limit);
        prepare_columns(j->down, act, j->h + p * inter, j->level, row0, row1);
    }
    atomic_fetch_add_explicit(&j->activated[g], 1, memory_order_release);
}

static void down_unit(experts_job *j, int64_t g, int64_t t) {
    const int64_t d = j->down->n, inter = j->down->k, p0 = j->starts[g], count = j->starts[g + 1] - p0;
    const int64_t row0 = t * TILE, row1 = row0 + TILE < d ? row0 + TILE : d;
    wait_for(&j->activated[g], j->tiles_in);
    project_rows(j->down, j->experts[g], row0, row1, j->firsts[g], j->h + p0 * inter, inter, count, j->out + p0 * d,
                 d, j->fp8_table, j->level);
    for (int64_t p = p0; p < p0 + count; p++)
        for (int64_t c = row0; c < row1; c++) j->out[p * d + c] *= j->pair_weights[p];
}

static void expert_units(void *context, int id, int team) {
    (void)id, (void)team;
    experts_job *j = context;
    const int64_t prepare = j->pairs * j->chunks, gate_up = prepare + j->groups * j->tiles_in;
    const int64_t total = gate_up + j->groups * j->tiles_out;
    for (int64_t unit = pool_claim(&j->next_unit); unit < total; unit = pool_claim(&j->next_unit)) {
        if (unit < prepare)
            prepare_unit(j, unit);
        else if (unit < gate_up)
            gate_up_unit(j, (unit - prepare) / j->tiles_in, (unit - prepare) % j->tiles_in);
        else
            down_unit(j, (unit - gate_up) / j->tiles_out, (unit - gate_up) % j->tiles_out);
    }
}

/* The routed experts' MLP for P (row, expert) pairs grouped by expert:
 *   out[p] = weight[p] * down_e(silu(min(gate_e x_p, L)) * clamp(up_e x_p, -L, L))
 * x [P, d] fp32 (one row per pair, pairs of group g at [starts[g], starts[g + 1]) use expert
 * experts[g]); out [P, d] fp32. gate and up are [E, i, d], down [E, d, i]. firsts (NULL: all 0): group g
 * runs only intermediate rows [firsts[g], i) of its expert (gate and up rows, down columns; a multiple of
 * TILE and of the quantization blocks), the device having the rest of a split expert: the two parts add up.
 * workspace: at least P * (d + 3 * i) floats. spin_ns: how long the pool's workers wait awake for the
 * next pass (thread_pool.h). Returns 0, or -1 on bad shapes. */
int experts_forward(const matrix *gate, const matrix *up, const matrix *down, const float *x, int64_t pairs,
                    int64_t groups, const int64_t *experts, const int64_t *starts, const int64_t *firsts,
                    const float *pair_weights, float limit, float *out, float *workspace, const float *fp8_table,
                    int threads, int level, int64_t spin_ns) {
    if (check(gate) || check(up) || check(down)) return -1;
    const int64_t d = gate->k, inter = gate->n;
    if (up->k != d || up->n != inter || down->k != inter || down->n != d || up->format != gate->format ||
        pairs < 0 || groups < 0)
        return -1;
    const int64_t align = down->format == NVFP4 ? GROUP : down->bk;
    for (int64_t g = 0; firsts && g < groups; g++)
        if (firsts[g] < 0 || firsts[g] > inter || firsts[g] % align) return -1;
    _Atomic int64_t *counters = calloc((size_t)(pairs + groups + 1), sizeof(_Atomic int64_t));
    int64_t *zeros = firsts ? NULL : calloc((size_t)groups + 1, sizeof(int64_t));
    if (!counters || (!firsts && !zeros)) {
        free(counters);
        return -1;
    }
    float *xin = workspace, *g_out = xin + pairs * d, *u_out = g_out + pairs * inter, *h = u_out + pairs * inter;
    experts_job job = {gate, up, down, x, pairs, groups, experts, starts, firsts ? firsts : zeros, pair_weights,
                       limit, out, xin, g_out,
                       u_out, h, fp8_table, level_for(level), (d + PREPARE_COLUMNS - 1) / PREPARE_COLUMNS,
                       (inter + TILE - 1) / TILE, (d + TILE - 1) / TILE, counters, counters + pairs, 0};
    pool_run(threads, expert_units, &job, spin_ns);
    free(counters);
    free(zeros);
    return 0;
}

/* ---------------------------------------------------------------- a decode step's misses */

/* One MoE layer's CPU share of a decode step, shaped so a listener thread the device rings (doorbell.c) or a
 * CUDA host function (cuLaunchHostFunc) can run it inside a captured graph: every pointer and size is fixed at capture, the values behind them change
 * per step. The device copies the step's rows, top-k ids and routing weights into the pinned inputs
 * before, and copies `out` back after. `cpu_entry` maps an expert id to its host bank entry (-1: the
 * CPU does not run it); it is read at run time, so swaps between steps move experts under a captured
 * graph. Of the n missed pairs (those with an entry), in row-major order, the device takes a share over
 * PCIe in units of 1/split_units of an expert (its intermediate rows, gate and up rows with the matching
 * down columns): of N = n * split_units units, q = ((N + 1) * p - 1) / 100 (p = pcie_percent, integer
 * division: the count that lets the later side finish soonest, ties to the CPU), at most pcie_capacity
 * experts' worth; the first pairs whole and the next one's first q % split_units units, the CPU running the
 * rest of that pair's rows (the two parts add up). A whole expert as the unit left one side idle while the other ran a second expert
 * at batch 1 (two or three misses a layer). The device applies the same rule to the same ids, so the two
 * sides split the misses without talking. The totals are for metrics (read between steps): units_left
 * counts the units of the CPU's split pairs the device ran. */
typedef struct {
    const matrix *gate, *up, *down;
    const float *x;          /* [rows, d] */
    const int64_t *ids;      /* [rows, topk] */
    const float *weights;    /* [rows, topk] */
    const int64_t *cpu_entry;   /* [num_experts] */
    const int64_t *live_rows;   /* rows in use this step: a graph's padding rows are skipped */
    int64_t rows, topk, num_experts;
    int64_t pcie_percent, pcie_capacity, split_units;
    float limit;
    float *out;              /* [rows, d]: sum over the CPU's pairs of weight * expert(x); zero elsewhere */
    float *workspace;        /* rows * topk * (1 + 3 * d + 3 * i) + 1 floats */
    int64_t *scratch;        /* 6 * rows * topk + 1 */
    const float *fp8_table;
    int32_t threads, level;
    int64_t spin_ns;         /* the pool's workers wait awake this long for the next layer's step */
    int32_t status;          /* 0, or -1 once a step failed (bad shapes) */
    int64_t steps, pairs_seen, pairs_missed, pairs_run, experts_run, units_left, nanoseconds;
} host_step_args;

/* Units (of split_units per expert) of the missed pair of rank `rank` that go over PCIe (see host_step_args),
 * of `missed` misses in all. */
static int64_t pcie_units(int64_t rank, int64_t missed, int64_t percent, int64_t capacity, int64_t units) {
    int64_t share = ((missed * units + 1) * percent - 1) / 100; /* N units send ((N + 1) p - 1) / 100 */
    if (share < 0) share = 0;
    if (share > capacity * units) share = capacity * units;
    const int64_t left = share - rank * units;
    return left < 0 ? 0 : left < units ? left : units;
}

void host_step(void *arg) {
    host_step_args *a = arg;
    const int64_t start = pool_now_ns(), d = a->gate->k;
    int64_t rows = *a->live_rows < a->rows ? *a->live_rows : a->rows;
    if (rows < 0) rows = 0;
    memset(a->out, 0, sizeof(float) * (size_t)(a->rows * d));
    /* Pairs the CPU runs, ordered by bank entry (a counting pass: at most rows * topk of them). */
    const int64_t cap = a->rows * a->topk;
    int64_t *entry = a->scratch, *token = entry + cap, *experts = token + cap, *starts = experts + cap;
    int64_t *first = starts + cap + 1, *firsts = first + cap;
    float *pair_weights = a->workspace, *xs = pair_weights + cap, *ys = xs + cap * d, *ws = ys + cap * d;
    const int64_t units = a->split_units > 0 ? a->split_units : 1, unit_rows = a->gate->n / units;
    int64_t missed = 0;
    for (int64_t p = 0; p < rows * a->topk; p++) {
        const int64_t e = a->ids[p];
        missed += e >= 0 && e < a->num_experts && a->cpu_entry[e] >= 0;
    }
    int64_t pairs = 0, rank = 0, left = 0;
    for (int64_t p = 0; p < rows * a->topk; p++) {
        const int64_t e = a->ids[p];
        const int64_t bank = e >= 0 && e < a->num_experts ? a->cpu_entry[e] : -1;
        if (bank < 0) continue;
        const int64_t over = pcie_units(rank++, missed, a->pcie_percent, a->pcie_capacity, units);
        if (over == units) continue;
        left += over;
        int64_t at = pairs++; /* insertion by (entry, first row), stable */
        while (at > 0 && (entry[at - 1] > bank || (entry[at - 1] == bank && first[at - 1] > over * unit_rows))) {
            entry[at] = entry[at - 1], token[at] = token[at - 1], pair_weights[at] = pair_weights[at - 1];
            first[at] = first[at - 1];
            at--;
        }
        entry[at] = bank, token[at] = p / a->topk, pair_weights[at] = a->weights[p], first[at] = over * unit_rows;
    }
    int64_t groups = 0;
    for (int64_t p = 0; p < pairs; p++) {
        if (p == 0 || entry[p] != entry[p - 1] || first[p] != first[p - 1])
            experts[groups] = entry[p], firsts[groups] = first[p], starts[groups++] = p;
        memcpy(xs + p * d, a->x + token[p] * d, sizeof(float) * (size_t)d);
    }
    starts[groups] = pairs;
    if (pairs && experts_forward(a->gate, a->up, a->down, xs, pairs, groups, experts, starts, firsts, pair_weights,
                                 a->limit, ys, ws, a->fp8_table, a->threads, a->level, a->spin_ns))
        a->status = -1;
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t j = 0; j < d; j++) a->out[token[p] * d + j] += ys[p * d + j];
    a->steps++, a->pairs_seen += rows * a->topk, a->pairs_missed += missed, a->pairs_run += pairs;
    a->experts_run += groups, a->units_left += left;
    a->nanoseconds += pool_now_ns() - start;
}
