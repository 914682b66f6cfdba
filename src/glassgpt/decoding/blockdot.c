/* Integer dot products of Q8_0 / Q4_0 weight blocks with Q8_0 activation blocks (glassgpt).
 *
 * Built on first use by glassgpt.decoding.kernels with the machine's own C compiler
 * (-O3 -march=native -fopenmp), loaded through ctypes; glassgpt.decoding.blocks holds the
 * written-out torch reference these functions are tested against bit for bit.
 *
 * Formats (llama.cpp's, one block = 32 consecutive values of a row, K a multiple of 32):
 *   Q8_0 weights  q int8 (N, K) and d fp16 (N, K/32): w = q * d
 *   Q4_0 weights  p uint8 (N, K/2) and d fp16 (N, K/32): within a block, byte j holds value j
 *                 in its low nibble and value j + 16 in its high one; w = (nibble - 8) * d
 *   activations   each row of x (M, K) quantized to Q8_0 here, once per call:
 *                 d = amax / 127 stored as fp16, q = round-to-nearest-even(x * 127 / amax)
 *
 * The sum of a row with a weight row, in the order of ggml's AVX2 vec_dot (so that llama.cpp's
 * Q8_0 file gives the same sums): per block, 8 int32 lanes each summing 4 consecutive products
 * (exact); per lane acc = fma(float(lane), d_w * d_x, acc) over the blocks in order; then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
 *
 * With AVX512-VNNI the lanes are vpdpbusd (unsigned x signed bytes): the weight bytes are made
 * unsigned (q + 128 for Q8_0, the nibble itself for Q4_0) and the accumulator starts at the
 * lane's correction, -128 (or -8) times the sum of its 4 activation values, computed once a
 * call: the integers are those of the signed products.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BLOCKDOT_VNNI 1
#else
#define BLOCKDOT_VNNI 0
#endif

#define QK 32
#define LANES 8
#define TILE 2 /* weight rows a task: Q4_0 multiplies two at once, Q8_0 one at a time (measured
                  fastest each: Q4_0 1.3x and Q8_0 2.4x four rows at once, BENCHMARKS.md) */

/* fp16 values: the compiler's _Float16 (gcc 12, clang 15), else F16C's conversions (gcc 11 on
 * any AVX2 CPU); both round to nearest even, as ggml's GGML_FP32_TO_FP16. */
#if defined(__FLT16_MAX__)
typedef _Float16 half;
#define HALF_TO_FLOAT(h) ((float)(h))
#define FLOAT_TO_HALF(f) ((half)(f))
#elif defined(__F16C__)
#include <immintrin.h>
typedef uint16_t half;
#define HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define FLOAT_TO_HALF(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT)
#else
#error "blockdot.c needs a compiler with _Float16 or a CPU with F16C"
#endif

int blockdot_has_vnni(void) { return BLOCKDOT_VNNI; }

/* x (M, K) -> q (M, K) int8 and d (M, K/32) fp16: ggml's quantize_row_q8_0 (x86). */
void blockdot_quantize_q8_0(const float *x, int64_t M, int64_t K, int8_t *q, half *d) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < M * nb; i++) {
        const float *v = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        d[i] = FLOAT_TO_HALF(amax / 127.0f);
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < QK; j++) q[i * QK + j] = (int8_t)nearbyintf(v[j] * id);
    }
}

static float hsum8(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* The weight value at position j of block b of a row, as a signed integer. */
static inline int weight_at(int kind, const void *row, int64_t b, int j) {
    if (kind == 8) return ((const int8_t *)row)[b * QK + j];
    const uint8_t byte = ((const uint8_t *)row)[b * (QK / 2) + (j & 15)];
    return (j < 16 ? (byte & 15) : (byte >> 4)) - 8;
}

/* Portable path: the same lanes and order, in plain C (fmaf is exactly rounded). */
static void dot_rows_plain(int kind, const int8_t *xq, const float *xd, int64_t K,
                           const void *w, const half *wd, int64_t r0, int64_t r1, float *y) {
    const int64_t nb = K / QK, row_bytes = kind == 8 ? K : K / 2;
    for (int64_t r = r0; r < r1; r++) {
        const void *row = (const char *)w + r * row_bytes;
        float acc[LANES] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const float scale = HALF_TO_FLOAT(wd[r * nb + b]) * xd[b];
            for (int l = 0; l < LANES; l++) {
                int32_t s = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++) s += weight_at(kind, row, b, j) * xq[b * QK + j];
                acc[l] = fmaf((float)s, scale, acc[l]);
            }
        }
        y[r] = hsum8(acc);
    }
}

#if BLOCKDOT_VNNI
/* 32 unsigned weight bytes of block b of a Q4_0 row: its low nibbles, then its high ones. */
static inline __m256i q4_block(const uint8_t *row, int64_t b) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
}

/* Two blocks (b, b + 1) of unsigned weight bytes in one register. */
static inline __m512i unsigned_pair(int kind, const void *row, int64_t b) {
    if (kind == 8) {
        const __m512i q = _mm512_loadu_si512((const int8_t *)row + b * QK);
        return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80)); /* q + 128 */
    }
    /* 32 bytes: block b's 16 then block b + 1's; their low nibbles, then their high ones */
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)((const uint8_t *)row + b * 16));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
    /* [b low, b+1 low, b high, b+1 high] -> [b low, b high, b+1 low, b+1 high] */
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline __m256i unsigned_one(int kind, const void *row, int64_t b) {
    if (kind == 8) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)((const int8_t *)row + b * QK));
        return _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
    }
    return q4_block((const uint8_t *)row, b);
}

/* `rows` (<= TILE) weight rows from r against one quantized activation row; corr: (nb, 8)
 * int32. Always inlined with a constant `rows`, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_tile_vnni(int kind, const int8_t *xq, const float *xd, const int32_t *corr,
                          int64_t K, const void *w, const half *wd, int64_t r, int rows,
                          float *y, float *scales) {
    const int64_t nb = K / QK, row_bytes = kind == 8 ? K : K / 2;
    const void *row[TILE];
    __m256 acc[TILE];
    for (int t = 0; t < rows; t++) {
        row[t] = (const char *)w + (r + t) * row_bytes;
        acc[t] = _mm256_setzero_ps();
        const half *row_d = wd + (r + t) * nb;
        int64_t b = 0;
        for (; b + 16 <= nb; b += 16) {  /* d_w * d_x, 16 blocks at a time */
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row_d + b)));
            _mm512_storeu_ps(scales + t * nb + b, _mm512_mul_ps(dw, _mm512_loadu_ps(xd + b)));
        }
        for (; b < nb; b++) scales[t * nb + b] = HALF_TO_FLOAT(row_d[b]) * xd[b];
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i x = _mm512_loadu_si512(xq + b * QK);
        const __m512i c = _mm512_loadu_si512(corr + b * LANES);
        for (int t = 0; t < rows; t++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, unsigned_pair(kind, row[t], b), x));
            acc[t] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm256_set1_ps(scales[t * nb + b]), acc[t]);
            acc[t] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(f, 1), _mm256_set1_ps(scales[t * nb + b + 1]), acc[t]);
        }
    }
    for (; b < nb; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + b * LANES));
        for (int t = 0; t < rows; t++) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(c, unsigned_one(kind, row[t], b), x));
            acc[t] = _mm256_fmadd_ps(f, _mm256_set1_ps(scales[t * nb + b]), acc[t]);
        }
    }
    for (int t = 0; t < rows; t++) {
        float lanes[LANES];
        _mm256_storeu_ps(lanes, acc[t]);
        y[r + t] = hsum8(lanes);
    }
}

/* A whole tile of Q4_0 rows, `kind` and TILE known to the compiler; else (Q8_0, a last
 * row) one row at a time. */
static void dot_tile_any(int kind, const int8_t *xq, const float *xd, const int32_t *corr,
                         int64_t K, const void *w, const half *wd, int64_t r, int rows,
                         float *y, float *scales) {
    if (rows == TILE && kind == 4) {
        dot_tile_vnni(4, xq, xd, corr, K, w, wd, r, TILE, y, scales);
    } else {
        for (int t = 0; t < rows; t++) {
            if (kind == 8) dot_tile_vnni(8, xq, xd, corr, K, w, wd, r + t, 1, y, scales);
            else dot_tile_vnni(4, xq, xd, corr, K, w, wd, r + t, 1, y, scales);
        }
    }
}
#endif

/* y (M, N) = x (M, K) . w (N, K)^T (+ bias): kind 8 (Q8_0 weights) or 4 (Q4_0). Returns 0, or
 * -1 if scratch memory could not be had. */
int blockdot_matmul(int kind, const float *x, int64_t M, int64_t K, const void *w,
                    const half *wd, int64_t N, const float *bias, float *y, int threads) {
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)(M * K));
    half *xh = malloc((size_t)(M * nb) * sizeof(half));
    float *xd = malloc((size_t)(M * nb) * sizeof(float));
    int32_t *corr = malloc((size_t)(M * nb * LANES) * sizeof(int32_t));
    if (!xq || !xh || !xd || !corr) {
        free(xq); free(xh); free(xd); free(corr);
        return -1;
    }
    blockdot_quantize_q8_0(x, M, K, xq, xh);
    const int32_t shift = kind == 8 ? 128 : 8; /* the unsigned weights' offset */
    for (int64_t i = 0; i < M * nb; i++) {
        xd[i] = HALF_TO_FLOAT(xh[i]);
        for (int l = 0; l < LANES; l++) {
            const int8_t *v = xq + i * QK + 4 * l;
            corr[i * LANES + l] = -shift * (v[0] + v[1] + v[2] + v[3]);
        }
    }
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t r = tile * TILE;
        const int rows = (int)(N - r < TILE ? N - r : TILE);
        float scales[TILE * 512];
        for (int64_t m = 0; m < M; m++) {
            float *ym = y + m * N;
#if BLOCKDOT_VNNI
            if (nb <= 512) {
                        dot_tile_any(kind, xq + m * K, xd + m * nb, corr + m * nb * LANES, K, w, wd,
                             r, rows, ym, scales);
                continue;
            }
#endif
            (void)scales;
            dot_rows_plain(kind, xq + m * K, xd + m * nb, K, w, wd, r, r + rows, ym);
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
    free(xq); free(xh); free(xd); free(corr);
    return 0;
}
