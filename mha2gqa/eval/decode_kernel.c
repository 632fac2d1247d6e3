/* One-token grouped attention on CPU, reading each cached kv head once for its whole group.
 *
 * Built and loaded by decode_kernel.py (plain C, no torch headers). For each (sequence, kv head) item, the G
 * query rows folded onto the kv head (q, G x D) attend on its cached keys and values (T x D each, rows
 * contiguous):
 *   pass 1  s[t][g] = scale * q[g] . k[t] + bias[g][t]   (each key row read once, for all G rows)
 *   pass 2  the softmax over t of each row, in float32
 *   pass 3  out[g] = sum_t w[t][g] v[t]                   (each value row read once, for all G rows)
 * The scores are t-major: pass 1 writes 16 at a time and pass 3 reads a row's G weights side by side. A
 * position whose bias is -inf in every row is skipped in passes 1 and 3 (a static cache's room not yet written
 * is never read); a row with no position left gives zeros (SDPA gives NaN there). Storage: float32 or
 * bfloat16 (a uint16 holding the top half of a float32); the arithmetic is float32. With AVX-512 (the build is
 * -march=native) passes 1 and 3 run on 16-lane vectors where D is a multiple of 16 (and, for pass 1, G is at most
 * 16); plain loops otherwise. PyTorch's CPU kernels for this shape (a batched product of 1-8 rows by T columns,
 * then another) read K/V at about a third of a streaming read on one core (docs/benchmarks.md, "Decode on
 * CPU"); this is a flash-decoding kernel's loop nest without tiles: at a decode step's sizes a head's G x T
 * scores fit in L2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One row of D values of storage `bf16` (else float32) into float32. */
static inline void load_row(const void *src, int bf16, float *dst, const int D) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_float(s[d]);
    } else {
        memcpy(dst, src, (size_t)D * sizeof(float));
    }
}

typedef struct {
    const void *q, *k, *v;
    const float *bias; /* additive, float32; NULL: none */
    void *out;
    int64_t batch, kv_heads, group, tokens, dim;
    int64_t q_strides[3];    /* b, h, g (elements; d is contiguous) */
    int64_t k_strides[3];    /* b, h, t */
    int64_t v_strides[3];    /* b, h, t */
    int64_t bias_strides[4]; /* b, h, g, t (0 where broadcast) */
    int64_t out_strides[3];  /* b, h, g */
    float scale;
    int bf16;
} decode_args;

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values of a row (float32 or bfloat16 storage) as float32. */
static inline __m512 load16(const char *p, int bf16) {
    if (bf16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    return _mm512_loadu_ps((const float *)p);
}

/* The sums of 16 vectors' lanes, in one vector (lane i: the sum of v[i]): a transposing tree of shuffles and
 * adds, 3 instructions a sum where reducing each vector on its own takes 8. */
static inline __m512 sum16(const __m512 *v) {
    __m512 t[8], r[4];
    for (int i = 0; i < 8; i++) /* 256-bit halves: [v2i c0+c2, v2i c1+c3, v2i+1 c0+c2, v2i+1 c1+c3] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* 128-bit lane L: v[4i + L]'s four partial sums */
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 x0 = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
    __m512 x1 = _mm512_add_ps(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
    __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x0), _mm512_castps_pd(x1))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x0), _mm512_castps_pd(x1))));
    /* z[4L + j] is the sum of v[4j + L] */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* Pass 1's dot products for rows [t, t + 16 / G) into scores[t * G ...] (t-major): each key row read once, its
 * 16-lane products summed over the row in registers, the row sums by one sum16 (lanes past the block's
 * (16 / G) * G dot products are zero and not stored). */
static inline void dots16(const char *k, int64_t k_stride, int bf16, const float *qs, int64_t t, float *scores,
                          const int G, const int D) {
    __m512 part[16];
    const size_t size = bf16 ? 2 : 4;
    for (int i = (16 / G) * G; i < 16; i++) part[i] = _mm512_setzero_ps();
    for (int r = 0; r < 16 / G; r++) {
        const char *row = k + (t + r) * k_stride * size;
        for (int g = 0; g < G; g++) part[r * G + g] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) {
            __m512 kv = load16(row + d * size, bf16);
            for (int g = 0; g < G; g++)
                part[r * G + g] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + g * D + d), kv, part[r * G + g]);
        }
    }
    _mm512_mask_storeu_ps(scores + t * G, (__mmask16)((1u << ((16 / G) * G)) - 1u), sum16(part));
}

/* Pass 3: acc[g] = sum_t w[t][g] v[t], each value row read once (in 16-lane pieces) for all G rows; the G x D
 * accumulators stay in registers when G and D are constants (G * D / 16 <= 32 vectors). */
static inline void weigh16(const char *v, int64_t v_stride, int bf16, const float *weights, int64_t T, float *acc,
                           const int G, const int D) {
    const size_t size = bf16 ? 2 : 4;
    __m512 sum[G * D / 16];
    for (int i = 0; i < G * D / 16; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        int live = 0;
        for (int g = 0; g < G; g++) live |= weights[t * G + g] != 0.0f;
        if (!live) continue; /* a masked position: its value row is not read */
        const char *row = v + t * v_stride * size;
        for (int d = 0; d < D; d += 16) {
            __m512 piece = load16(row + d * size, bf16);
            for (int g = 0; g < G; g++)
                sum[g * D / 16 + d / 16] =
                    _mm512_fmadd_ps(_mm512_set1_ps(weights[t * G + g]), piece, sum[g * D / 16 + d / 16]);
        }
    }
    for (int i = 0; i < G * D / 16; i++) _mm512_storeu_ps(acc + i * 16, sum[i]);
}
#define HAVE_DOTS16 1
#endif

/* Inlined with constant G and D from the switch below, so the compiler keeps the G x D accumulators in
 * registers and unrolls the row loops. The scores are t-major (scores[t * G + g]): a row's G scores side by
 * side, as pass 3 reads them. */
static inline __attribute__((always_inline)) void attend_item(const decode_args *a, int64_t item, float *scores,
                                                              const int G, const int D) {
    const int64_t b = item / a->kv_heads, h = item % a->kv_heads, T = a->tokens;
    const size_t size = a->bf16 ? 2 : 4;
    const char *q = (const char *)a->q + (b * a->q_strides[0] + h * a->q_strides[1]) * size;
    const char *k = (const char *)a->k + (b * a->k_strides[0] + h * a->k_strides[1]) * size;
    const char *v = (const char *)a->v + (b * a->v_strides[0] + h * a->v_strides[1]) * size;
    const float *bias = a->bias ? a->bias + b * a->bias_strides[0] + h * a->bias_strides[1] : NULL;
    const int64_t bias_g = a->bias_strides[2], bias_t = a->bias_strides[3];
    float qs[G * D], row[D], acc[G * D], top[G], total[G];
    for (int g = 0; g < G; g++) {
        load_row(q + g * a->q_strides[2] * size, a->bf16, qs + g * D, D);
        for (int d = 0; d < D; d++) qs[g * D + d] *= a->scale;
        top[g] = -INFINITY;
        total[g] = 0.0f;
    }
    /* pass 1: rows in blocks of 16 / G where the vector kernel takes the shape, one by one otherwise */
    int64_t block = 1;
#ifdef HAVE_DOTS16
    if (D % 16 == 0 && G <= 16) block = 16 / G;
#endif
    for (int64_t t = 0, rows; t < T; t += rows) {
        rows = t + block <= T ? block : 1; /* the last rows of an uneven T go one by one */
        int live = bias == NULL;
        if (bias)
            for (int64_t r = 0; r < rows; r++)
                for (int g = 0; g < G; g++) live |= bias[g * bias_g + (t + r) * bias_t] != -INFINITY;
        if (!live) {
            for (int64_t i = t * G; i < (t + rows) * G; i++) scores[i] = -INFINITY;
        } else if (rows > 1) {
#ifdef HAVE_DOTS16
            dots16(k, a->k_strides[2], a->bf16, qs, t, scores, G, D);
#endif
        } else {
            load_row(k + t * a->k_strides[2] * size, a->bf16, row, D);
            for (int g = 0; g < G; g++) {
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qs[g * D + d] * row[d];
                scores[t * G + g] = dot;
            }
        }
        if (bias && live)
            for (int64_t r = 0; r < rows; r++)
                for (int g = 0; g < G; g++) scores[(t + r) * G + g] += bias[g * bias_g + (t + r) * bias_t];
    }
    for (int64_t t = 0; t < T; t++)
        for (int g = 0; g < G; g++) top[g] = scores[t * G + g] > top[g] ? scores[t * G + g] : top[g];
    /* pass 2: exp(s - max) in place and each row's total, over 16 t-major rows (16 x G scores) at a time: the
     * shifts repeat with period G, so the inner loop is G whole vectors */
    for (int g = 0; g < G; g++) top[g] = top[g] == -INFINITY ? 0.0f : top[g]; /* no position: all exps 0 */
    float shift[16 * G], sums[16 * G];
    for (int l = 0; l < 16 * G; l++) shift[l] = top[l % G], sums[l] = 0.0f;
    int64_t done = 0;
    for (; done + 16 * G <= T * G; done += 16 * G)
        for (int l = 0; l < 16 * G; l++) {
            scores[done + l] = expf(scores[done + l] - shift[l]);
            sums[l] += scores[done + l];
        }
    for (int l = 0; done + l < T * G; l++) { /* the last T % 16 rows */
        scores[done + l] = expf(scores[done + l] - shift[l]);
        sums[l] += scores[done + l];
    }
    for (int l = 0; l < 16 * G; l++) total[l % G] += sums[l];
    for (int g = 0; g < G; g++) total[g] = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
    memset(acc, 0, sizeof acc);
#ifdef HAVE_DOTS16
    if (D % 16 == 0) {
        weigh16(v, a->v_strides[2], a->bf16, scores, T, acc, G, D);
    } else
#endif
        for (int64_t t = 0; t < T; t++) { /* pass 3 */
            int live = 0;
            for (int g = 0; g < G; g++) live |= scores[t * G + g] != 0.0f;
            if (!live) continue;
            load_row(v + t * a->v_strides[2] * size, a->bf16, row, D);
            for (int g = 0; g < G; g++) {
                const float w = scores[t * G + g];
                for (int d = 0; d < D; d++) acc[g * D + d] += w * row[d];
            }
        }
    char *out = (char *)a->out + (b * a->out_strides[0] + h * a->out_strides[1]) * size;
    for (int g = 0; g < G; g++) {
        char *o = out + g * a->out_strides[2] * size;
        for (int d = 0; d < D; d++) {
            float x = acc[g * D + d] * total[g];
            if (a->bf16)
                ((uint16_t *)o)[d] = float_to_bf16(x);
            else
                ((float *)o)[d] = x;
        }
    }
}

/* Items [first, last) of batch x kv_heads; `scores` holds group x tokens floats. Returns 0, or 1 for a
 * head size this build does not take (the caller checks before: 1 <= dim <= 256). The common shapes (head
 * sizes 64 and 128; groups 1, 2, 4, 8, and SmolLM2's 3) get a copy of the item loop with constant G and D,
 * about 1.5x faster than the general one and 1 s more of compiling each. */
int decode_attend(const decode_args *a, int64_t first, int64_t last, float *scores) {
    const int G = (int)a->group, D = (int)a->dim;
    for (int64_t item = first; item < last; item++) {
#define CASE(g, d)                              \
    if (G == g && D == d) {                     \
        attend_item(a, item, scores, g, d);     \
        continue;                               \
    }
        CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(8, 64)
        CASE(1, 128) CASE(2, 128) CASE(4, 128) CASE(8, 128)
#undef CASE
        if (D < 1 || D > 256) return 1;
        attend_item(a, item, scores, G, D);
    }
    return 0;
}
