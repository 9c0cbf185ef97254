/* Matrix-vector products on the CPU for routed experts kept in host RAM, NVFP4 and FP8 block.
 *
 * NVFP4:     y[r, n] = sum_k x[r, k] * e2m1(code[n, k]) * fp8(scale[n, k / 16]) * global[n]
 * FP8 block: y[r, n] = sum_k x[r, k] * e4m3(w[n, k]) * scale_inv[n / bn, k / bk]
 *
 * Decode-sized batches read each weight byte once and never expand the matrix: per output row the
 * packed codes stream through, their 4-bit codes are looked up in registers (AVX2: a byte shuffle over
 * a 16-entry table of exact int8 values), and every row of x reuses the looked-up values.
 * x is split into its even and odd columns first, so the low nibbles of 8 bytes meet 8 contiguous
 * even columns and the high nibbles 8 odd ones. Output rows are shared among `threads` OpenMP
 * threads (the caller sizes the pool; it is not torch's intra-op pool).
 *
 * Called through ctypes (no Python or torch headers): buffers are contiguous, the group scales'
 * fp8 -> float table comes from the caller so the codec lives in one place.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 16
#define MAX_ROWS 8 /* rows of x handled per pass over the weights */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* One output row for `rows` rows of split x: portable C, the reference for the SIMD path. */
static void row_scalar(const float *xe, const float *xo, int64_t rows, int64_t half_k, const uint8_t *codes,
                       const uint8_t *scales, const float *fp8_table, float global, float *out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *e = xe + r * half_k, *o = xo + r * half_k;
        float acc = 0.0f;
        for (int64_t g = 0; g < half_k / (GROUP / 2); g++) {
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

__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Twice the E2M1 values as int8, by code: one byte shuffle looks up 16 codes at once, exactly. */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

__attribute__((target("avx2,fma"))) static inline __m256 widen(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); /* the low 8 int8 lanes as 8 floats */
}

/* The same row with AVX2, two groups (16 bytes, 32 codes) per step: a byte shuffle turns the low and
 * the high nibbles into int8 weights (x2), widened 8 at a time and reused by every row of x. Each
 * group's sum is scaled once; four accumulators per row keep the adds of one group off the next. */
__attribute__((target("avx2,fma"))) static void row_avx2(const float *xe, const float *xo, int64_t rows,
                                                        int64_t half_k, const uint8_t *codes,
                                                        const uint8_t *scales, const float *fp8_table,
                                                        float global, float *out, int64_t out_stride) {
    const __m128i table = _mm_loadu_si128((const __m128i *)E2M1_X2), nibble = _mm_set1_epi8(15);
    const int64_t groups = half_k / 8;
    __m256 acc[MAX_ROWS][2];
    for (int64_t r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 2) {
        const int pair = g + 1 < groups; /* a last odd group runs alone */
        __m128i bytes = pair ? _mm_loadu_si128((const __m128i *)(codes + g * 8))
                             : _mm_loadl_epi64((const __m128i *)(codes + g * 8));
        __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble));
        __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
        __m256 w[4] = {widen(even), widen(odd), widen(_mm_srli_si128(even, 8)), widen(_mm_srli_si128(odd, 8))};
        __m256 scale[2] = {_mm256_set1_ps(0.5f * fp8_table[scales[g]]),
                           _mm256_set1_ps(pair ? 0.5f * fp8_table[scales[g + 1]] : 0.0f)};
        for (int64_t r = 0; r < rows; r++) {
            const float *e = xe + r * half_k + g * 8, *o = xo + r * half_k + g * 8;
            for (int j = 0; j <= pair; j++) {
                __m256 part = _mm256_mul_ps(w[2 * j], _mm256_loadu_ps(e + 8 * j));
                part = _mm256_fmadd_ps(w[2 * j + 1], _mm256_loadu_ps(o + 8 * j), part);
                acc[r][j] = _mm256_fmadd_ps(part, scale[j], acc[r][j]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r * out_stride] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) * global;
}

/* x [rows, k] fp32; codes [n, k/2]; scales [n, k/16] (fp8 bytes); global [n] with stride 0 or 1;
 * y [rows, n] fp32. simd: 1 = AVX2 where the CPU has it, 0 = portable. Returns 0, or -1 on bad shapes. */
int nvfp4_gemv(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint8_t *scales,
               const float *global, int64_t global_stride, int64_t n, const float *fp8_table, float *y,
               int threads, int simd) {
    if (k % GROUP || rows < 0 || n < 0) return -1;
    const int64_t half_k = k / 2;
    float *split = malloc(sizeof(float) * (size_t)(rows * k + 1));
    if (!split) return -1;
    float *xe = split, *xo = split + rows * half_k;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < half_k; j++) {
            xe[r * half_k + j] = x[r * k + 2 * j];
            xo[r * half_k + j] = x[r * k + 2 * j + 1];
        }
    const int avx2 = simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < n; row++) {
        const uint8_t *c = codes + row * half_k, *s = scales + row * (k / GROUP);
        const float gs = global[row * global_stride];
        for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            int64_t count = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
            const float *e = xe + r0 * half_k, *o = xo + r0 * half_k;
            if (avx2)
                row_avx2(e, o, count, half_k, c, s, fp8_table, gs, y + r0 * n + row, n);
            else
                row_scalar(e, o, count, half_k, c, s, fp8_table, gs, y + r0 * n + row, n);
        }
    }
    free(split);
    return 0;
}

/* FP8 block: one output row, portable. */
static void fp8_row_scalar(const float *x, int64_t rows, int64_t k, const uint8_t *w, const float *block_scales,
                           int64_t bk, const float *fp8_table, float *out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int64_t k0 = 0; k0 < k; k0 += bk) {
            float part = 0.0f;
            for (int64_t j = k0; j < k0 + bk && j < k; j++) part += fp8_table[w[j]] * x[r * k + j];
            acc += part * block_scales[k0 / bk];
        }
        out[r * out_stride] = acc;
    }
}

/* 8 e4m3 bytes -> 8 floats / 256: the bits move into fp16 position (exact for normals and subnormals
 * alike), F16C widens them; the 256 is folded into the block scale. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 e4m3_scaled(const uint8_t *p) {
    __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
    __m128i rest = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

/* FP8 block, AVX2: 16 columns per step into two accumulators per row, each 128-column block's sum
 * scaled once. Needs k and bk multiples of 16. */
__attribute__((target("avx2,fma,f16c"))) static void fp8_row_avx2(const float *x, int64_t rows, int64_t k,
                                                                 const uint8_t *w, const float *block_scales,
                                                                 int64_t bk, float *out, int64_t out_stride) {
    __m256 acc[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < k; k0 += bk) {
        __m256 part[MAX_ROWS][2];
        for (int64_t r = 0; r < rows; r++) part[r][0] = part[r][1] = _mm256_setzero_ps();
        const int64_t end = k0 + bk < k ? k0 + bk : k;
        for (int64_t j = k0; j < end; j += 16) {
            __m256 w0 = e4m3_scaled(w + j), w1 = e4m3_scaled(w + j + 8);
            for (int64_t r = 0; r < rows; r++) {
                part[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + j), part[r][0]);
                part[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + j + 8), part[r][1]);
            }
        }
        __m256 scale = _mm256_set1_ps(256.0f * block_scales[k0 / bk]);
        for (int64_t r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(part[r][0], part[r][1]), scale, acc[r]);
    }
    for (int64_t r = 0; r < rows; r++) out[r * out_stride] = hsum(acc[r]);
}

/* x [rows, k] fp32; w [n, k] e4m3 bytes; scale_inv [ceil(n / bn), ceil(k / bk)] fp32; y [rows, n] fp32.
 * simd: 1 = AVX2/F16C where the CPU has them and the shapes allow, 0 = portable. Returns 0, or -1. */
int fp8_block_gemv(const float *x, int64_t rows, int64_t k, const uint8_t *w, const float *scale_inv, int64_t bn,
                   int64_t bk, int64_t n, const float *fp8_table, float *y, int threads, int simd) {
    if (rows < 0 || n < 0 || bn <= 0 || bk <= 0) return -1;
    const int64_t kb = (k + bk - 1) / bk;
    const int avx2 = simd && k % 16 == 0 && bk % 16 == 0 && __builtin_cpu_supports("avx2") &&
                     __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < n; row++) {
        const uint8_t *wr = w + row * k;
        const float *sr = scale_inv + (row / bn) * kb;
        for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            int64_t count = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
            if (avx2)
                fp8_row_avx2(x + r0 * k, count, k, wr, sr, bk, y + r0 * n + row, n);
            else
                fp8_row_scalar(x + r0 * k, count, k, wr, sr, bk, fp8_table, y + r0 * n + row, n);
        }
    }
    return 0;
}
