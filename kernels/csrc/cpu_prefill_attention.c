/* Causal attention of prefill rows over the paged KV cache, inside the native model forward
 * (cpu_model.c): flash-attention style, the whole prefill in the pass whatever its length.
 *
 * A sequence's query rows are the last num_queries of its seq_len positions (earlier ones a
 * prefix already in the pool); its K/V rows, new ones included, are in the cache already
 * (the forward writes them first). Work comes in items of one sequence, one kv head and a
 * tile of up to QUERY_TILE query rows: the group's query heads of those rows are the item's
 * query vectors (GQA: every K/V row is read once per item, not once per query head). Per
 * item, for each tile of KEY_TILE key positions up to the item's last row's position:
 *
 *   - the scores, transposed ([key][vector]): a small product like the packed GEMM's, each
 *     key element (read in place from the cache, through the block table) broadcast against
 *     the item's query vectors, transposed once per item ([head_dim][vector]);
 *   - positions after a vector's own are masked (-inf), then the online softmax, 16 vectors
 *     at a time with no horizontal operation: running max and sum per vector in float32, the
 *     accumulator rescaled once per tile;
 *   - the weights times the tile's value rows (read in place) are added to the accumulators,
 *     a few vectors x 32 output elements at a time.
 *
 * Every vector sees position 0 in the first tile, so its running max is finite from then on
 * and a later tile masked out entirely for it adds nothing (weights e^-inf = 0).
 *
 * The code is generic vector-extension C compiled per ISA (AVX-512F, AVX2 + FMA, baseline),
 * chosen at run time like the products'. float32 caches only (the native forward's).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_model.h"
#include "cpu_vec.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SHOAL_X86 1
#else
#define SHOAL_X86 0
#endif

#define KEY_TILE 64 /* key positions per tile */
#define SPARE_KEYS 4 /* rows of scores past the tile, written by micro-kernels and not read */
#define LANES 16    /* query vectors are padded to a multiple of this (one 16-float vector) */

ALWAYS_INLINE void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

ALWAYS_INLINE v16f max16(v16f a, v16f b) { return select16(a > b, a, b); }

/* A run-time value in every lane, as one broadcast: GCC 12 builds splat16's loop (and
 * {x, x, ...}) lane by lane through the stack. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define BROADCAST16(v) __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
#else
#define BROADCAST16(v) __builtin_shuffle(v, (v16i){0})
#endif

ALWAYS_INLINE v16f broadcast16(float x) {
    const v16f one = {x};
    return BROADCAST16(one);
}

ALWAYS_INLINE v16i broadcast16i(int32_t x) {
    const v16i one = {x};
    return BROADCAST16(one);
}

/* Scratch of one item, in floats (see shoal_prefill_scratch_floats); `width` query vectors
 * (padded to LANES), vector i being row i / group and head i % group of the item. */
struct prefill_scratch {
    float *q_t;     /* [head_dim][width]: the query vectors transposed */
    float *acc;     /* [width][head_dim] */
    float *scores;  /* [KEY_TILE + SPARE_KEYS][width]: scores (then weights) transposed */
    float *running_max, *running_sum, *alpha; /* [width] */
    int32_t *positions; /* [width]: each vector's position (the last row's for padding) */
    float *zeros;   /* [head_dim]: the key row of tokens past the tile's end */
    int64_t width;
    int64_t num_vectors; /* of the item: those past it are padding */
};

static int64_t max_width(int64_t group) { return (SHOAL_PREFILL_QUERY_TILE * group + LANES - 1) / LANES * LANES; }

int64_t shoal_prefill_scratch_floats(int64_t group, int64_t head_dim) {
    const int64_t width = max_width(group);
    return width * (2 * head_dim + KEY_TILE + SPARE_KEYS + 4) + head_dim + LANES;
}

static struct prefill_scratch make_scratch(float *memory, int64_t group, int64_t head_dim) {
    const int64_t width = max_width(group);
    struct prefill_scratch s;
    s.q_t = memory;
    s.acc = s.q_t + head_dim * width;
    s.scores = s.acc + width * head_dim;
    s.running_max = s.scores + (KEY_TILE + SPARE_KEYS) * width;
    s.running_sum = s.running_max + width;
    s.alpha = s.running_sum + width;
    s.positions = (int32_t *)(s.alpha + width);
    s.zeros = s.alpha + 2 * width;
    s.width = width;
    return s;
}

/* --- generic code (any ISA, compiled once per target) ----------------------------------- */

/* scores[t][i] = scale * k_t . q_i for t < num_keys and all `width` vectors. */
ALWAYS_INLINE void score_generic(const struct prefill_scratch *s, const float *const *key_rows, int num_keys,
                                 int64_t head_dim, int64_t width, float scale) {
    for (int t = 0; t < num_keys; ++t) {
        for (int64_t i = 0; i < width; i += LANES) {
            v16f acc = splat16(0.0f);
            for (int64_t k = 0; k < head_dim; ++k) {
                acc += broadcast16(key_rows[t][k]) * load16(s->q_t + k * width + i);
            }
            store16(s->scores + t * width + i, acc * broadcast16(scale));
        }
    }
}

/* acc[i] = alpha[i] acc[i] + sum_t weights[t][i] v_t for the item's vectors. */
ALWAYS_INLINE void accumulate_generic(const struct prefill_scratch *s, const float *const *value_rows,
                                      int num_keys, int64_t head_dim, int64_t num_vectors) {
    const int64_t width = s->width;
    for (int64_t i = 0; i < num_vectors; ++i) {
        float *a = s->acc + i * head_dim;
        for (int64_t index = 0; index < head_dim; index += 16) {
            v16f sum = load16(a + index) * broadcast16(s->alpha[i]);
            for (int t = 0; t < num_keys; ++t) {
                sum += broadcast16(s->scores[t * width + i]) * load16(value_rows[t] + index);
            }
            store16(a + index, sum);
        }
    }
}

/* 8-float vectors for the softmax: AVX2 compares 8 lanes in one instruction, while GCC
 * splits a 16-lane comparison (exp16's range checks) into scalar ones there. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define BROADCAST8(v) __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0)
#else
#define BROADCAST8(v) __builtin_shuffle(v, (v8i){0})
#endif

ALWAYS_INLINE v8f broadcast8(float x) {
    const v8f one = {x};
    return BROADCAST8(one);
}

ALWAYS_INLINE v8i broadcast8i(int32_t x) {
    const v8i one = {x};
    return BROADCAST8(one);
}

ALWAYS_INLINE v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

ALWAYS_INLINE v8f select8(v8i mask, v8f yes, v8f no) { return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask)); }

/* e^x for x <= 0 (scores minus their running max), 0 below -87 and for -inf: Cephes' expf,
 * as cpu_attention.c's exp8. */
ALWAYS_INLINE v8f exp8(v8f x) {
    const v8f magic = broadcast8(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v8i underflow = x < broadcast8(-87.0f);
    x = select8(underflow, broadcast8(-87.0f), x);
    const v8f shifted = x * broadcast8(1.44269504088896341f) + magic;
    const v8f n = shifted - magic;
    const v8i exponent = (v8i)shifted - (v8i)magic;
    v8f r = x - n * broadcast8(0.693359375f);
    r = r - n * broadcast8(-2.12194440e-4f);
    v8f p = broadcast8(1.9875691500e-4f);
    p = p * r + broadcast8(1.3981999507e-3f);
    p = p * r + broadcast8(8.3334519073e-3f);
    p = p * r + broadcast8(4.1665795894e-2f);
    p = p * r + broadcast8(1.6666665459e-1f);
    p = p * r + broadcast8(5.0000001201e-1f);
    p = p * (r * r) + r + broadcast8(1.0f);
    const v8f two_to_n = (v8f)((exponent + 127) << 23);
    return (v8f)((v8i)(p * two_to_n) & ~underflow);
}

/* The online softmax step of a tile, 8 vectors at a time (no horizontal operation: the
 * scores are transposed): positions after a vector's own masked, scores become weights
 * e^(score - new max), each vector's running max and sum updated, alpha its accumulator's
 * rescale factor (0 for the first tile, whose old max is -inf). */
ALWAYS_INLINE void softmax_tile(const struct prefill_scratch *s, int64_t k0, int num_keys, int64_t width) {
    const v8f minus_inf = broadcast8(-__builtin_inff());
    const int diagonal = k0 + num_keys - 1 > s->positions[0]; /* some vector does not see every key */
    for (int64_t i = 0; i < width; i += 8) {
        v8i positions;
        memcpy(&positions, s->positions + i, sizeof positions);
        v8f highest = minus_inf;
        for (int t = 0; t < num_keys; ++t) {
            float *row = s->scores + t * width + i;
            v8f scores = load8(row);
            if (diagonal) {
                scores = select8(broadcast8i((int32_t)(k0 + t)) > positions, minus_inf, scores);
                store8(row, scores);
            }
            highest = select8(highest > scores, highest, scores);
        }
        const v8f old_max = load8(s->running_max + i);
        const v8f new_max = select8(highest > old_max, highest, old_max);
        v8f total = broadcast8(0.0f);
        for (int t = 0; t < num_keys; ++t) {
            float *row = s->scores + t * width + i;
            const v8f weights = exp8(load8(row) - new_max);
            store8(row, weights);
            total += weights;
        }
        const v8f alpha = exp8(old_max - new_max);
        store8(s->alpha + i, alpha);
        store8(s->running_sum + i, load8(s->running_sum + i) * alpha + total);
        store8(s->running_max + i, new_max);
    }
}

typedef void (*score_function)(const struct prefill_scratch *s, const float *const *key_rows, int num_keys,
                               int64_t head_dim, float scale);
typedef void (*accumulate_function)(const struct prefill_scratch *s, const float *const *value_rows, int num_keys,
                                    int64_t head_dim);
typedef void (*softmax_function)(const struct prefill_scratch *s, int64_t k0, int num_keys, int64_t width);

#if SHOAL_X86
/* AVX2 has 16 registers: its micro-kernels are written with intrinsics, as the products' are.
 * Scores: 3 keys x 16 or 32 vectors (12 accumulators); values: 2 vectors x 32 elements. */
#define AVX2_ROWS 3

/* Scores of the vectors [i, i + COLUMNS * LANES) against the tile's keys, ROWS keys at a time:
 * ROWS x COLUMNS accumulators of the ISA's registers (VEC, LANES floats; ZERO, LOAD, SET1,
 * FMA, MUL, STORE its intrinsics). Rows past the tile's keys read zeros and go to the spare
 * rows of the scratch. */
#define SCORE_KERNEL(NAME, TARGET, VEC, LANES_, ROWS, COLUMNS, ZERO, LOAD, SET1, FMA, MUL, STORE)            \
    __attribute__((target(TARGET), noinline)) static void NAME(const struct prefill_scratch *s,               \
                                                               const float *const *key_rows, int num_keys,     \
                                                               int64_t head_dim, int64_t i, float scale) {    \
        const int64_t width = s->width;                                                                      \
        for (int t0 = 0; t0 < num_keys; t0 += ROWS) {                                                        \
            const float *keys[ROWS];                                                                         \
            for (int r = 0; r < ROWS; ++r) {                                                                 \
                keys[r] = t0 + r < num_keys ? key_rows[t0 + r] : s->zeros;                                   \
            }                                                                                                \
            VEC acc[ROWS][COLUMNS];                                                                          \
            for (int r = 0; r < ROWS; ++r) {                                                                 \
                for (int v = 0; v < COLUMNS; ++v) {                                                          \
                    acc[r][v] = ZERO();                                                                      \
                }                                                                                            \
            }                                                                                                \
            for (int64_t k = 0; k < head_dim; ++k) {                                                         \
                VEC q[COLUMNS];                                                                              \
                for (int v = 0; v < COLUMNS; ++v) {                                                          \
                    q[v] = LOAD(s->q_t + k * width + i + LANES_ * v);                                        \
                }                                                                                            \
                for (int r = 0; r < ROWS; ++r) {                                                             \
                    const VEC x = SET1(keys[r][k]);                                                          \
                    for (int v = 0; v < COLUMNS; ++v) {                                                      \
                        acc[r][v] = FMA(x, q[v], acc[r][v]);                                                 \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            const VEC scales = SET1(scale);                                                                  \
            for (int r = 0; r < ROWS; ++r) {                                                                 \
                for (int v = 0; v < COLUMNS; ++v) {                                                          \
                    STORE(s->scores + (t0 + r) * width + i + LANES_ * v, MUL(acc[r][v], scales));            \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
#define SCORE_AVX2(COLUMNS)                                                                                 \
    SCORE_KERNEL(score_avx2_##COLUMNS, "avx2,fma", __m256, 8, AVX2_ROWS, COLUMNS, _mm256_setzero_ps,          \
                 _mm256_loadu_ps, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_storeu_ps)
SCORE_AVX2(2)
SCORE_AVX2(4)

__attribute__((target("avx2,fma"))) static void score_avx2(const struct prefill_scratch *s,
                                                            const float *const *key_rows, int num_keys,
                                                            int64_t head_dim, float scale) {
    int64_t i = 0;
    for (; i + 32 <= s->width; i += 32) {
        score_avx2_4(s, key_rows, num_keys, head_dim, i, scale);
    }
    if (i < s->width) { /* 16 left (the width is a multiple of 16) */
        score_avx2_2(s, key_rows, num_keys, head_dim, i, scale);
    }
}

/* Vectors i0 and i1 (the same one again when the item has an odd count: the same values are
 * stored twice), elements [index, index + 32): 8 accumulators in named variables (an array
 * of them GCC 12 keeps in memory as well). */
__attribute__((target("avx2,fma"), noinline)) static void accumulate_avx2_pair(
    const struct prefill_scratch *s, const float *const *value_rows, int num_keys, int64_t head_dim, int64_t i0,
    int64_t i1, int64_t index) {
    const int64_t width = s->width;
    float *out0 = s->acc + i0 * head_dim + index, *out1 = s->acc + i1 * head_dim + index;
    const __m256 alpha0 = _mm256_set1_ps(s->alpha[i0]), alpha1 = _mm256_set1_ps(s->alpha[i1]);
    __m256 a00 = _mm256_mul_ps(_mm256_loadu_ps(out0), alpha0), a01 = _mm256_mul_ps(_mm256_loadu_ps(out0 + 8), alpha0);
    __m256 a02 = _mm256_mul_ps(_mm256_loadu_ps(out0 + 16), alpha0);
    __m256 a03 = _mm256_mul_ps(_mm256_loadu_ps(out0 + 24), alpha0);
    __m256 a10 = _mm256_mul_ps(_mm256_loadu_ps(out1), alpha1), a11 = _mm256_mul_ps(_mm256_loadu_ps(out1 + 8), alpha1);
    __m256 a12 = _mm256_mul_ps(_mm256_loadu_ps(out1 + 16), alpha1);
    __m256 a13 = _mm256_mul_ps(_mm256_loadu_ps(out1 + 24), alpha1);
    const float *w0 = s->scores + i0, *w1 = s->scores + i1;
    for (int t = 0; t < num_keys; ++t) {
        const float *row = value_rows[t] + index;
        const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
        const __m256 v2 = _mm256_loadu_ps(row + 16), v3 = _mm256_loadu_ps(row + 24);
        const __m256 x0 = _mm256_broadcast_ss(w0 + t * width);
        a00 = _mm256_fmadd_ps(x0, v0, a00);
        a01 = _mm256_fmadd_ps(x0, v1, a01);
        a02 = _mm256_fmadd_ps(x0, v2, a02);
        a03 = _mm256_fmadd_ps(x0, v3, a03);
        const __m256 x1 = _mm256_broadcast_ss(w1 + t * width);
        a10 = _mm256_fmadd_ps(x1, v0, a10);
        a11 = _mm256_fmadd_ps(x1, v1, a11);
        a12 = _mm256_fmadd_ps(x1, v2, a12);
        a13 = _mm256_fmadd_ps(x1, v3, a13);
    }
    _mm256_storeu_ps(out1, a10);
    _mm256_storeu_ps(out1 + 8, a11);
    _mm256_storeu_ps(out1 + 16, a12);
    _mm256_storeu_ps(out1 + 24, a13);
    _mm256_storeu_ps(out0, a00);
    _mm256_storeu_ps(out0 + 8, a01);
    _mm256_storeu_ps(out0 + 16, a02);
    _mm256_storeu_ps(out0 + 24, a03);
}

__attribute__((target("avx2,fma"))) static void accumulate_avx2(const struct prefill_scratch *s,
                                                                 const float *const *value_rows, int num_keys,
                                                                 int64_t head_dim) {
    if (head_dim % 32) { /* a 16-element tail: the generic code (head_dim 48, 80, ...) */
        accumulate_generic(s, value_rows, num_keys, head_dim, s->num_vectors);
        return;
    }
    for (int64_t i = 0; i < s->num_vectors; i += 2) {
        const int64_t other = i + 1 < s->num_vectors ? i + 1 : i;
        for (int64_t index = 0; index < head_dim; index += 32) {
            accumulate_avx2_pair(s, value_rows, num_keys, head_dim, i, other, index);
        }
    }
}
#endif

#if SHOAL_X86
/* AVX-512 has 32 registers: scores 4 keys x 16 to 64 vectors, values 4 vectors x 64 or 16
 * elements (16 accumulators at most). The generic code, compiled for AVX-512, runs one chain
 * of FMAs per output vector: 0.55x the AVX2 micro-kernels' speed on Zen 4. */
#define AVX512_KEYS 4
#define AVX512_VECTORS 4

#define SCORE_AVX512(COLUMNS)                                                                               \
    SCORE_KERNEL(score_avx512_##COLUMNS, "avx512f", __m512, 16, AVX512_KEYS, COLUMNS, _mm512_setzero_ps,       \
                 _mm512_loadu_ps, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_storeu_ps)
SCORE_AVX512(1)
SCORE_AVX512(2)
SCORE_AVX512(4)

__attribute__((target("avx512f"))) static void score_avx512(const struct prefill_scratch *s,
                                                             const float *const *key_rows, int num_keys,
                                                             int64_t head_dim, float scale) {
    int64_t i = 0;
    for (; i + 64 <= s->width; i += 64) {
        score_avx512_4(s, key_rows, num_keys, head_dim, i, scale);
    }
    if (i + 32 <= s->width) {
        score_avx512_2(s, key_rows, num_keys, head_dim, i, scale);
        i += 32;
    }
    if (i < s->width) { /* 16 left (the width is a multiple of 16) */
        score_avx512_1(s, key_rows, num_keys, head_dim, i, scale);
    }
}

/* e^x for x <= 0, exp8's steps 16 lanes at a time with mask compares. */
__attribute__((target("avx512f"))) static inline __m512 exp_avx512(__m512 x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic);
    const __m512 n = _mm512_sub_ps(shifted, magic);
    const __m512i exponent = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(magic));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512 two_to_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(exponent, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps(kept, p, two_to_n);
}

/* softmax_tile, 16 vectors at a time. */
__attribute__((target("avx512f"))) static void softmax_tile_avx512(const struct prefill_scratch *s, int64_t k0,
                                                                    int num_keys, int64_t width) {
    const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
    const int diagonal = k0 + num_keys - 1 > s->positions[0];
    for (int64_t i = 0; i < width; i += 16) {
        const __m512i positions = _mm512_loadu_si512(s->positions + i);
        __m512 highest = minus_inf;
        for (int t = 0; t < num_keys; ++t) {
            float *row = s->scores + t * width + i;
            __m512 scores = _mm512_loadu_ps(row);
            if (diagonal) {
                const __mmask16 after = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)(k0 + t)), positions);
                scores = _mm512_mask_mov_ps(scores, after, minus_inf);
                _mm512_storeu_ps(row, scores);
            }
            highest = _mm512_max_ps(highest, scores);
        }
        const __m512 old_max = _mm512_loadu_ps(s->running_max + i);
        const __m512 new_max = _mm512_max_ps(highest, old_max);
        __m512 total = _mm512_setzero_ps();
        for (int t = 0; t < num_keys; ++t) {
            float *row = s->scores + t * width + i;
            const __m512 weights = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(row), new_max));
            _mm512_storeu_ps(row, weights);
            total = _mm512_add_ps(total, weights);
        }
        const __m512 alpha = exp_avx512(_mm512_sub_ps(old_max, new_max));
        _mm512_storeu_ps(s->alpha + i, alpha);
        _mm512_storeu_ps(s->running_sum + i, _mm512_fmadd_ps(_mm512_loadu_ps(s->running_sum + i), alpha, total));
        _mm512_storeu_ps(s->running_max + i, new_max);
    }
}

/* Vectors `vectors` (the last one repeated past the item's count: the same values are stored
 * again), elements [index, index + 16 * ELEMENTS). */
#define ACCUMULATE_AVX512(ELEMENTS)                                                                        \
    __attribute__((target("avx512f"), noinline)) static void accumulate_avx512_##ELEMENTS(                  \
        const struct prefill_scratch *s, const float *const *value_rows, int num_keys, int64_t head_dim,     \
        const int64_t *vectors, int64_t index) {                                                             \
        const int64_t width = s->width;                                                                      \
        __m512 acc[AVX512_VECTORS][ELEMENTS];                                                                \
        for (int v = 0; v < AVX512_VECTORS; ++v) {                                                           \
            const __m512 alpha = _mm512_set1_ps(s->alpha[vectors[v]]);                                      \
            for (int e = 0; e < ELEMENTS; ++e) {                                                             \
                acc[v][e] = _mm512_mul_ps(_mm512_loadu_ps(s->acc + vectors[v] * head_dim + index + 16 * e), alpha); \
            }                                                                                                \
        }                                                                                                    \
        for (int t = 0; t < num_keys; ++t) {                                                                 \
            __m512 values[ELEMENTS];                                                                         \
            for (int e = 0; e < ELEMENTS; ++e) {                                                             \
                values[e] = _mm512_loadu_ps(value_rows[t] + index + 16 * e);                                 \
            }                                                                                                \
            for (int v = 0; v < AVX512_VECTORS; ++v) {                                                       \
                const __m512 x = _mm512_set1_ps(s->scores[t * width + vectors[v]]);                          \
                for (int e = 0; e < ELEMENTS; ++e) {                                                         \
                    acc[v][e] = _mm512_fmadd_ps(x, values[e], acc[v][e]);                                    \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int v = AVX512_VECTORS - 1; v >= 0; --v) { /* the first of repeated vectors last */             \
            for (int e = 0; e < ELEMENTS; ++e) {                                                             \
                _mm512_storeu_ps(s->acc + vectors[v] * head_dim + index + 16 * e, acc[v][e]);                \
            }                                                                                                \
        }                                                                                                    \
    }
ACCUMULATE_AVX512(1)
ACCUMULATE_AVX512(4)

__attribute__((target("avx512f"))) static void accumulate_avx512(const struct prefill_scratch *s,
                                                                   const float *const *value_rows, int num_keys,
                                                                   int64_t head_dim) {
    for (int64_t i = 0; i < s->num_vectors; i += AVX512_VECTORS) {
        int64_t vectors[AVX512_VECTORS];
        for (int v = 0; v < AVX512_VECTORS; ++v) {
            vectors[v] = i + v < s->num_vectors ? i + v : s->num_vectors - 1;
        }
        int64_t index = 0;
        for (; index + 64 <= head_dim; index += 64) {
            accumulate_avx512_4(s, value_rows, num_keys, head_dim, vectors, index);
        }
        for (; index < head_dim; index += 16) { /* head_dim is a multiple of 16 */
            accumulate_avx512_1(s, value_rows, num_keys, head_dim, vectors, index);
        }
    }
}
#endif

/* One item: sequence seq's query rows [q_first, q_first + q_count) of its num_queries, the
 * query heads of kv head kv_head. score, softmax and accumulate: the ISA's micro-kernels, or
 * NULL for the generic code. */
ALWAYS_INLINE void attend_item(const struct shoal_decode_plan *plan, int64_t seq, int64_t num_queries,
                               int64_t kv_head, int64_t q_first, int64_t q_count, float *out,
                               int64_t out_token_stride, const float *query, int64_t query_token_stride,
                               int64_t num_heads, const float *key_cache, const float *value_cache, float scale,
                               struct prefill_scratch *s, const score_function score,
                               const softmax_function softmax, const accumulate_function accumulate) {
    const int64_t d = plan->head_dim, group = num_heads / plan->num_kv_heads, block_size = plan->block_size;
    const int64_t row_floats = plan->num_kv_heads * d;
    const int32_t *table = plan->block_tables + seq * plan->table_stride;
    const int64_t first_row = plan->rows[seq] + q_first;
    const int64_t first_position = plan->seq_lens[seq] - num_queries + q_first;
    const int64_t num_vectors = q_count * group;
    const int64_t width = (num_vectors + LANES - 1) / LANES * LANES;
    const int64_t num_positions = first_position + q_count; /* the last row's context */
    s->width = width;
    s->num_vectors = num_vectors;
    for (int64_t i = 0; i < width; ++i) { /* vector i: row i / group, head kv_head * group + i % group */
        const float *q = i < num_vectors
                             ? query + (first_row + i / group) * query_token_stride + (kv_head * group + i % group) * d
                             : NULL;
        for (int64_t k = 0; k < d; ++k) {
            s->q_t[k * width + i] = q != NULL ? q[k] : 0.0f;
        }
        memset(s->acc + i * d, 0, (size_t)d * sizeof(float));
        s->running_max[i] = -__builtin_inff();
        s->running_sum[i] = 0.0f;
        s->positions[i] = (int32_t)(i < num_vectors ? first_position + i / group : num_positions - 1);
    }
    memset(s->zeros, 0, (size_t)d * sizeof(float));
    const float *key_rows[KEY_TILE], *value_rows[KEY_TILE];
    for (int64_t k0 = 0; k0 < num_positions; k0 += KEY_TILE) {
        const int num_keys = (int)(num_positions - k0 < KEY_TILE ? num_positions - k0 : KEY_TILE);
        for (int t = 0; t < num_keys; ++t) {
            const int64_t position = k0 + t;
            const int64_t slot = (int64_t)table[position / block_size] * block_size + position % block_size;
            key_rows[t] = key_cache + slot * row_floats + kv_head * d;
            value_rows[t] = value_cache + slot * row_floats + kv_head * d;
        }
        if (score != NULL) {
            score(s, key_rows, num_keys, d, scale);
        } else {
            score_generic(s, key_rows, num_keys, d, width, scale);
        }
        if (softmax != NULL) {
            softmax(s, k0, num_keys, width);
        } else {
            softmax_tile(s, k0, num_keys, width);
        }
        if (accumulate != NULL) {
            accumulate(s, value_rows, num_keys, d);
        } else {
            accumulate_generic(s, value_rows, num_keys, d, num_vectors);
        }
    }
    for (int64_t i = 0; i < num_vectors; ++i) {
        float *o = out + (first_row + i / group) * out_token_stride + (kv_head * group + i % group) * d;
        const v16f inverse = broadcast16(1.0f / s->running_sum[i]);
        for (int64_t index = 0; index < d; index += 16) {
            store16(o + index, load16(s->acc + i * d + index) * inverse);
        }
    }
}

typedef void (*item_function)(const struct shoal_decode_plan *plan, int64_t seq, int64_t num_queries,
                              int64_t kv_head, int64_t q_first, int64_t q_count, float *out,
                              int64_t out_token_stride, const float *query, int64_t query_token_stride,
                              int64_t num_heads, const float *key_cache, const float *value_cache, float scale,
                              struct prefill_scratch *s);

#define ITEM_FUNCTION(NAME, TARGET, SCORE, SOFTMAX, ACCUMULATE)                                                       \
    TARGET static void NAME(const struct shoal_decode_plan *plan, int64_t seq, int64_t num_queries,           \
                            int64_t kv_head, int64_t q_first, int64_t q_count, float *out,                    \
                            int64_t out_token_stride, const float *query, int64_t query_token_stride,         \
                            int64_t num_heads, const float *key_cache, const float *value_cache, float scale, \
                            struct prefill_scratch *s) {                                                     \
        attend_item(plan, seq, num_queries, kv_head, q_first, q_count, out, out_token_stride, query,          \
                    query_token_stride, num_heads, key_cache, value_cache, scale, s, SCORE, SOFTMAX, ACCUMULATE);      \
    }
ITEM_FUNCTION(item_generic, , NULL, NULL, NULL)
#if SHOAL_X86
ITEM_FUNCTION(item_avx2, __attribute__((target("avx2,fma"))), score_avx2, NULL, accumulate_avx2)
ITEM_FUNCTION(item_avx512, __attribute__((target("avx512f"))), score_avx512, softmax_tile_avx512,
              accumulate_avx512)
#endif

static item_function item_for_isa(int isa) {
#if SHOAL_X86
    if (isa == SHOAL_ISA_AVX512) {
        return item_avx512;
    }
    if (isa == SHOAL_ISA_AVX2) {
        return item_avx2;
    }
#else
    (void)isa;
#endif
    return item_generic;
}

int64_t shoal_prefill_num_items(const struct shoal_decode_plan *plan, const int32_t *num_queries) {
    int64_t items = 0;
    for (int64_t seq = 0; seq < plan->num_seqs; ++seq) {
        items += (num_queries[seq] + SHOAL_PREFILL_QUERY_TILE - 1) / SHOAL_PREFILL_QUERY_TILE * plan->num_kv_heads;
    }
    return items;
}

static int by_cost_descending(const void *a, const void *b) {
    const struct shoal_prefill_item *x = a, *y = b;
    return (x->cost < y->cost) - (x->cost > y->cost);
}

void shoal_prefill_items(const struct shoal_decode_plan *plan, const int32_t *num_queries,
                         struct shoal_prefill_item *items) {
    int64_t count = 0;
    for (int64_t seq = 0; seq < plan->num_seqs; ++seq) {
        const int64_t nq = num_queries[seq], before = plan->seq_lens[seq] - nq;
        for (int64_t first = 0; first < nq; first += SHOAL_PREFILL_QUERY_TILE) {
            const int64_t rows = nq - first < SHOAL_PREFILL_QUERY_TILE ? nq - first : SHOAL_PREFILL_QUERY_TILE;
            for (int64_t kv_head = 0; kv_head < plan->num_kv_heads; ++kv_head) {
                items[count++] = (struct shoal_prefill_item){
                    (int32_t)seq, (int32_t)kv_head, (int32_t)first, (int32_t)rows, rows * (before + first + rows)};
            }
        }
    }
    /* the longest first: a thread that claims the last items claims short ones */
    qsort(items, (size_t)count, sizeof *items, by_cost_descending);
}

int64_t shoal_prefill_check(const struct shoal_decode_plan *plan, const int32_t *num_queries, int64_t num_tokens,
                            int64_t num_heads) {
    if (plan->dtype != 0 || shoal_decode_check(plan, num_tokens, num_heads) != -1) {
        return 0;
    }
    int64_t next_row = 0;
    for (int64_t seq = 0; seq < plan->num_seqs; ++seq) {
        const int64_t nq = num_queries[seq];
        if (nq < 1 || nq > plan->seq_lens[seq] || plan->rows[seq] != next_row || nq > INT32_MAX) {
            return 0;
        }
        next_row += nq;
    }
    return next_row == num_tokens;
}

void shoal_prefill_attention_item(const struct shoal_decode_plan *plan, const int32_t *num_queries,
                                  const struct shoal_prefill_item *item, float *out, int64_t out_token_stride,
                                  const float *query, int64_t query_token_stride, int64_t num_heads,
                                  const float *key_cache, const float *value_cache, float scale, float *scratch,
                                  int isa) {
    const int64_t group = num_heads / plan->num_kv_heads;
    struct prefill_scratch s = make_scratch(scratch, group, plan->head_dim);
    item_for_isa(isa)(plan, item->seq, num_queries[item->seq], item->kv_head, item->first, item->rows, out,
                      out_token_stride, query, query_token_stride, num_heads, key_cache, value_cache, scale, &s);
}

/* --- alone (tests and benchmarks) ---------------------------------------------------------- */

struct alone_job {
    const struct shoal_decode_plan *plan;
    const int32_t *num_queries;
    const struct shoal_prefill_item *items;
    float *out;
    int64_t out_token_stride;
    const float *query;
    int64_t query_token_stride;
    int64_t num_heads;
    const float *key_cache, *value_cache;
    float scale;
    int isa;
};

static _Thread_local float *tls_scratch;
static _Thread_local int64_t tls_scratch_floats;

static void alone_item(const void *context, int64_t item) {
    const struct alone_job *job = context;
    const int64_t floats = shoal_prefill_scratch_floats(job->num_heads / job->plan->num_kv_heads, job->plan->head_dim);
    if (tls_scratch_floats < floats) {
        free(tls_scratch);
        tls_scratch = malloc((size_t)floats * sizeof(float));
        tls_scratch_floats = tls_scratch == NULL ? 0 : floats;
        if (tls_scratch == NULL) {
            abort();
        }
    }
    shoal_prefill_attention_item(job->plan, job->num_queries, &job->items[item], job->out, job->out_token_stride,
                                 job->query, job->query_token_stride, job->num_heads, job->key_cache,
                                 job->value_cache, job->scale, tls_scratch, job->isa);
}

/* out[rows] = causal attention of every sequence's num_queries query rows (plan->rows[s] the
 * first, consecutive sequences, every row of [0, num_tokens) once) over its seq_lens[s]
 * positions in float32 caches. query and out: rows token_stride floats apart, heads head_dim
 * apart. isa: SHOAL_ISA_* or -1 for the best. Returns -1; -2 for a plan that does not fit the
 * batch (nothing read or written); -3 no memory; -4 the ISA is not available. */
int64_t shoal_prefill_attention(const struct shoal_decode_plan *plan, const int32_t *num_queries, float *out,
                                int64_t out_token_stride, const float *query, int64_t query_token_stride,
                                int64_t num_tokens, int64_t num_heads, const float *key_cache,
                                const float *value_cache, double scale, int64_t num_threads, int64_t isa) {
    if (!shoal_prefill_check(plan, num_queries, num_tokens, num_heads)) {
        return -2;
    }
    const int best = shoal_gemm_best_isa();
    if (isa < 0) {
        isa = best;
    } else if (isa > best) {
        return -4;
    }
    const int64_t num_items = shoal_prefill_num_items(plan, num_queries);
    struct shoal_prefill_item *items = malloc((size_t)(num_items > 0 ? num_items : 1) * sizeof *items);
    if (items == NULL) {
        return -3;
    }
    shoal_prefill_items(plan, num_queries, items);
    const struct alone_job job = {plan,  num_queries, items,       out,         out_token_stride, query,
                                  query_token_stride, num_heads, key_cache, value_cache, (float)scale, (int)isa};
    const struct shoal_phase phase = {alone_item, &job, num_items};
    const int status = shoal_run_phases(&phase, 1, (int)(num_threads < 1 ? 1 : num_threads));
    free(items);
    return status == 0 ? -1 : -2;
}
