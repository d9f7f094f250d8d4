/* Paged decode attention for the CPU path: the native half of kernels/cpu.py's decode.
 *
 * Each decoding sequence has one query row (q_len 1) that attends to its whole
 * context, read straight from the cache blocks through its block table: no gather
 * into a contiguous copy. Built and loaded with cpu_cache_ops.c by
 * kernels/cpu_native.py (plain C11 plus GCC/clang vector extensions, no torch or
 * Python headers, no -march). The cache layout and the contract are in
 * kernels/ops.py and docs/kernels.md; here a layer's key or value cache is
 * num_blocks blocks of block_size token rows, each row num_kv_heads * head_dim
 * elements (float32, bfloat16 or float16), and the query and output rows have
 * the cache's dtype.
 *
 * How (docs/kernels.md, "Native decode attention"):
 *   - per sequence, tiles of TILE tokens; per tile and kv head, the query heads
 *     that share the kv head (up to 8 at a time) score every key row of the
 *     tile while it is in registers (GQA: a K/V row is read once per group, not
 *     once per query head), then the online softmax (running max and sum per
 *     query head, float32) rescales the accumulators once per tile, then the
 *     value rows of the tile are summed into them;
 *   - head_dim in chunks of 16 elements held as two 8-float vectors; bfloat16
 *     and float16 are widened in registers and everything is accumulated in
 *     float32. A 16-element chunk of a 2-byte dtype is loaded as 8 32-bit words,
 *     whose low halves (even elements) and high halves (odd elements) become the
 *     two vectors: no shuffle. The query is loaded the same way, so its dot
 *     products with the keys are unchanged; the accumulators hold the output in
 *     that order and the store puts it back ("chunk order");
 *   - the code is generic vector-extension C compiled twice: for the baseline
 *     ISA (SSE2 on x86-64) and, on x86-64, with target("avx2,fma"), chosen at
 *     run time with __builtin_cpu_supports. The two differ only in how 8 dot
 *     products are reduced horizontally (8-wide shuffles are scalarized by GCC
 *     without AVX, so the baseline reduces 4-wide halves).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_model.h"

#if defined(__GNUC__) && !defined(__clang__)
/* 32-byte vectors as arguments of (always inlined) functions built without AVX. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define SHOAL_HAS_AVX2_PATH 1
#else
#define SHOAL_HAS_AVX2_PATH 0
#endif

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FLOAT16 = 2 };
enum { ISA_BEST = 0, ISA_BASELINE = 1, ISA_AVX2 = 2 };
enum {
    DECODE_OK = -1,
    DECODE_BAD_GEOMETRY = -2,
    DECODE_NO_MEMORY = -3,
    DECODE_NO_ISA = -4,
};

#define CHUNK 16 /* head_dim elements per step: two 8-float vectors */
#define TILE 32  /* tokens scored before their values are summed (one rescale per tile) */
#define MAX_SUBGROUP 8

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define SHUFFLE4(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v4i __attribute__((vector_size(16)));
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#define SHUFFLE4(a, b, ...) __builtin_shuffle(a, b, (v4i){__VA_ARGS__})
#endif

/* --- 8-float vectors ---------------------------------------------------------------- */

/* As a shuffle: GCC 12 builds some {x, x, ..., x} initializers lane by lane (vinsertps),
 * a shuffle always as one broadcast. */
ALWAYS_INLINE v8f splat(float x) {
    const v8f one = {x};
    return SHUFFLE8(one, one, 0, 0, 0, 0, 0, 0, 0, 0);
}

ALWAYS_INLINE v8f load8(const void *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void store8(void *p, v8f v) { memcpy(p, &v, sizeof v); }

/* Asks for num_bytes from p into L2 (locality 2): the next tile's rows, a tile ahead. */
ALWAYS_INLINE void prefetch_bytes(const char *p, int64_t num_bytes) {
    for (int64_t offset = 0; offset < num_bytes; offset += 64) {
        __builtin_prefetch(p + offset, 0, 2);
    }
}

ALWAYS_INLINE v8f select8(v8i mask, v8f yes, v8f no) {
    return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask));
}

ALWAYS_INLINE v8f max8(v8f a, v8f b) { return select8(a > b, a, b); }

ALWAYS_INLINE float hmax8(v8f v) {
    float best = v[0];
    for (int i = 1; i < 8; ++i) {
        best = v[i] > best ? v[i] : best;
    }
    return best;
}

ALWAYS_INLINE float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* e^x for x <= 0 (scores minus their running max), 0 below -87 (and for -inf).
 * Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n
 * built in the exponent bits; about 1 ulp. */
ALWAYS_INLINE v8f exp8(v8f x) {
    const v8f magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v8i underflow = x < splat(-87.0f);
    x = select8(underflow, splat(-87.0f), x);
    const v8f shifted = x * splat(1.44269504088896341f) + magic;
    const v8f n = shifted - magic;
    const v8i exponent = (v8i)shifted - (v8i)magic;
    v8f r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    const v8f two_to_n = (v8f)((exponent + 127) << 23);
    return (v8f)((v8i)(p * two_to_n) & ~underflow);
}

/* Horizontal sums of 8 vectors: {sum acc[0], ..., sum acc[7]}. */

/* With AVX: vhaddps-style in-lane shuffles, then the two 128-bit halves. */
ALWAYS_INLINE v8f hadd8(v8f a, v8f b) {
    return SHUFFLE8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE8(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

ALWAYS_INLINE v8f reduce8_wide(const v8f acc[8]) {
    const v8f q0 = hadd8(hadd8(acc[0], acc[1]), hadd8(acc[2], acc[3]));
    const v8f q1 = hadd8(hadd8(acc[4], acc[5]), hadd8(acc[6], acc[7]));
    return SHUFFLE8(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Without AVX (two 16-byte registers per vector): halves added, then 4x4 transposes. */
ALWAYS_INLINE v4f half4(v8f v, int high) {
    v4f half;
    memcpy(&half, (const char *)&v + (high ? 16 : 0), sizeof half);
    return half;
}

ALWAYS_INLINE v4f sum4x4(v4f a, v4f b, v4f c, v4f d) {
    const v4f ab = SHUFFLE4(a, b, 0, 4, 1, 5) + SHUFFLE4(a, b, 2, 6, 3, 7);
    const v4f cd = SHUFFLE4(c, d, 0, 4, 1, 5) + SHUFFLE4(c, d, 2, 6, 3, 7);
    return SHUFFLE4(ab, cd, 0, 1, 4, 5) + SHUFFLE4(ab, cd, 2, 3, 6, 7);
}

ALWAYS_INLINE v8f reduce8_narrow(const v8f acc[8]) {
    v4f halves[8];
    for (int i = 0; i < 8; ++i) {
        halves[i] = half4(acc[i], 0) + half4(acc[i], 1);
    }
    const v4f low = sum4x4(halves[0], halves[1], halves[2], halves[3]);
    const v4f high = sum4x4(halves[4], halves[5], halves[6], halves[7]);
    v8f sums;
    memcpy(&sums, &low, sizeof low);
    memcpy((char *)&sums + sizeof low, &high, sizeof high);
    return sums;
}

/* --- dtypes --------------------------------------------------------------------------- */

/* float16 bits (in the low 16 bits of each lane) to float32: the exponent is rebiased by
 * a multiplication (subnormals included), infinities and NaNs keep an all-ones exponent. */
ALWAYS_INLINE v8f float16_to_float8(v8u half) {
    const v8u magnitude = (half & 0x7FFFu) << 13;
    const v8u sign = (half & 0x8000u) << 16;
    const v8f finite = (v8f)magnitude * splat(0x1p112f);
    const v8i inf_or_nan = (v8i)((half & 0x7FFFu) >= 0x7C00u);
    const v8u special = magnitude | 0x7F800000u;
    return (v8f)((((v8u)finite & ~(v8u)inf_or_nan) | (special & (v8u)inf_or_nan)) | sign);
}

/* Elements [index, index + 16) of a row, widened to float32, as two vectors in chunk
 * order: float32 elements 0-7 and 8-15; 2-byte elements 0, 2, ..., 14 and 1, 3, ..., 15. */
ALWAYS_INLINE void load_chunk(const char *row, int64_t index, const int dtype, v8f *first, v8f *second) {
    if (dtype == DTYPE_FLOAT32) {
        const float *elements = (const float *)row + index;
        *first = load8(elements);
        *second = load8(elements + 8);
        return;
    }
    v8u words;
    memcpy(&words, (const uint16_t *)row + index, sizeof words);
    if (dtype == DTYPE_BFLOAT16) { /* a bfloat16 is the high half of a float32 */
        *first = (v8f)(words << 16);
        *second = (v8f)(words & 0xFFFF0000u);
    } else {
        *first = float16_to_float8(words & 0xFFFFu);
        *second = float16_to_float8(words >> 16);
    }
}

/* float32 to bfloat16 bits (low 16 bits of each lane), rounding to nearest even; NaNs
 * stay NaNs (quieted). */
ALWAYS_INLINE v8u bfloat16_bits8(v8f x) {
    const v8u bits = (v8u)x;
    const v8u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const v8u nan = (v8u)((bits & 0x7FFFFFFFu) > 0x7F800000u);
    return (rounded & ~nan) | (((bits >> 16) | 0x40u) & nan);
}

/* float32 to float16 bits, rounding to nearest even, in integer arithmetic only. */
static uint16_t float16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) {
        return sign | 0x7E00u; /* NaN */
    }
    if (magnitude >= 0x477FF000u) {
        return sign | 0x7C00u; /* 65520 and more round to infinity */
    }
    if (magnitude < 0x38800000u) { /* below 2^-14: a float16 subnormal, or zero */
        if (magnitude < 0x33000000u) {
            return sign; /* below 2^-25 */
        }
        const uint32_t shift = 126u - (magnitude >> 23); /* 14 .. 24 */
        const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
        uint32_t half = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1u);
        const uint32_t tie = 1u << (shift - 1u);
        half += rest > tie || (rest == tie && (half & 1u));
        return sign | (uint16_t)half;
    }
    uint32_t half = (magnitude - 0x38000000u) >> 13; /* rebias the exponent from 127 to 15 */
    const uint32_t rest = magnitude & 0x1FFFu;
    half += rest > 0x1000u || (rest == 0x1000u && (half & 1u)); /* a carry rounds up the exponent */
    return sign | (uint16_t)half;
}

/* Stores a chunk (two vectors in chunk order) as elements [index, index + 16) of a row. */
ALWAYS_INLINE void store_chunk(char *row, int64_t index, const int dtype, v8f first, v8f second) {
    if (dtype == DTYPE_FLOAT32) {
        float *elements = (float *)row + index;
        store8(elements, first);
        store8(elements + 8, second);
    } else if (dtype == DTYPE_BFLOAT16) {
        const v8u words = bfloat16_bits8(first) | (bfloat16_bits8(second) << 16);
        memcpy((uint16_t *)row + index, &words, sizeof words);
    } else {
        uint16_t halves[CHUNK];
        for (int i = 0; i < 8; ++i) {
            halves[2 * i] = float16_bits(first[i]);
            halves[2 * i + 1] = float16_bits(second[i]);
        }
        memcpy((uint16_t *)row + index, halves, sizeof halves);
    }
}

/* --- one tile of one kv head, for a subgroup of its query heads ----------------------- */

/* scores[g * TILE + t] = scale * (q_g . k_t) for the subgroup's num_group (1, 2, 4 or 8)
 * query heads g and the tile's num_tokens key rows (rows[t] + offset). 8 dot products at a
 * time (8 / num_group tokens per round), reduced together. q: num_group rows of head_dim
 * floats in chunk order. The same kv head's part of next->num_tokens rows of the next
 * tile is prefetched along the way, when next->rows is not NULL. */
struct next_tile {
    const char *const *rows; /* NULL: nothing to prefetch */
    int num_tokens;
};

ALWAYS_INLINE void prefetch_next(const struct next_tile *next, int first, int count, int64_t offset,
                                 int64_t num_bytes) {
    if (next->rows == NULL) {
        return;
    }
    for (int t = first; t < first + count && t < next->num_tokens; ++t) {
        prefetch_bytes(next->rows[t] + offset, num_bytes);
    }
}

ALWAYS_INLINE void tile_scores(float *scores, const float *q, int64_t head_dim, const char *const *rows,
                               int64_t offset, int num_tokens, const struct next_tile *next, float scale,
                               const int dtype, const int num_group, const int isa) {
    const int per_round = 8 / num_group;
    const int64_t head_bytes = head_dim * (dtype == DTYPE_FLOAT32 ? 4 : 2);
    for (int first = 0; first < num_tokens; first += per_round) {
        prefetch_next(next, first, per_round, offset, head_bytes);
        const char *keys[8];
        for (int j = 0; j < per_round; ++j) { /* past the end: the last row again, result unused */
            keys[j] = rows[first + j < num_tokens ? first + j : num_tokens - 1] + offset;
        }
        v8f acc[8];
        for (int i = 0; i < 8; ++i) {
            acc[i] = splat(0.0f);
        }
        for (int64_t index = 0; index < head_dim; index += CHUNK) {
            for (int j = 0; j < per_round; ++j) {
                v8f k0, k1;
                load_chunk(keys[j], index, dtype, &k0, &k1);
                for (int g = 0; g < num_group; ++g) {
                    const float *qc = q + g * head_dim + index;
                    acc[g * per_round + j] += load8(qc) * k0;
                    acc[g * per_round + j] += load8(qc + 8) * k1;
                }
            }
        }
        const v8f sums = (isa == ISA_AVX2 ? reduce8_wide(acc) : reduce8_narrow(acc)) * splat(scale);
        for (int g = 0; g < num_group; ++g) {
            for (int j = 0; j < per_round && first + j < num_tokens; ++j) {
                scores[g * TILE + first + j] = sums[g * per_round + j];
            }
        }
    }
}

/* The online softmax step of a tile: scores become weights exp(score - new max); each
 * head's running max and sum are updated, and alpha[g] is the factor its accumulator
 * must be rescaled by (e^(old max - new max); 0 before the first tile). */
ALWAYS_INLINE void tile_softmax(float *scores, int num_tokens, float *running_max, float *running_sum,
                                float *alpha, const int num_group) {
    const int padded = (num_tokens + 7) & ~7;
    for (int g = 0; g < num_group; ++g) {
        float *s = scores + g * TILE;
        for (int t = num_tokens; t < padded; ++t) {
            s[t] = -__builtin_inff(); /* weight 0 */
        }
        v8f highest = load8(s);
        for (int t = 8; t < padded; t += 8) {
            highest = max8(highest, load8(s + t));
        }
        const float tile_max = hmax8(highest);
        const float new_max = tile_max > running_max[g] ? tile_max : running_max[g];
        v8f total = splat(0.0f);
        for (int t = 0; t < padded; t += 8) {
            const v8f weights = exp8(load8(s + t) - splat(new_max));
            store8(s + t, weights);
            total += weights;
        }
        alpha[g] = exp8(splat(running_max[g] - new_max))[0];
        running_sum[g] = running_sum[g] * alpha[g] + hsum8(total);
        running_max[g] = new_max;
    }
}

/* acc[g] = alpha[g] * acc[g] + sum over the tile's tokens t of weights[g * TILE + t] * v_t,
 * chunk by chunk, for up to 4 query heads at a time (a value chunk is loaded once per 4
 * heads); fewer heads keep several tokens in flight (independent accumulators). */
ALWAYS_INLINE void tile_values(float *acc, const float *weights, const float *alpha, int64_t head_dim,
                               const char *const *rows, int64_t offset, int num_tokens,
                               const struct next_tile *next, const int dtype, const int num_group) {
    const int per_pass = num_group < 4 ? num_group : 4; /* heads per pass */
    const int in_flight = 4 / per_pass;                  /* tokens per step */
    const int64_t head_bytes = head_dim * (dtype == DTYPE_FLOAT32 ? 4 : 2);
    for (int64_t index = 0; index < head_dim; index += CHUNK) {
        /* the next tile's rows spread over the chunks: TILE / chunks rows per chunk */
        const int64_t num_chunks = head_dim / CHUNK, chunk = index / CHUNK;
        const int first = (int)(chunk * TILE / num_chunks), last = (int)((chunk + 1) * TILE / num_chunks);
        prefetch_next(next, first, last - first, offset, head_bytes);
        for (int g0 = 0; g0 < num_group; g0 += per_pass) {
            v8f sum0[4], sum1[4]; /* [head * in_flight + token] */
            for (int j = 0; j < per_pass; ++j) {
                float *a = acc + (g0 + j) * head_dim + index;
                for (int u = 0; u < in_flight; ++u) {
                    sum0[j * in_flight + u] = u ? splat(0.0f) : load8(a) * splat(alpha[g0 + j]);
                    sum1[j * in_flight + u] = u ? splat(0.0f) : load8(a + 8) * splat(alpha[g0 + j]);
                }
            }
            int t = 0;
            for (; t + in_flight <= num_tokens; t += in_flight) {
                for (int u = 0; u < in_flight; ++u) {
                    v8f v0, v1;
                    load_chunk(rows[t + u] + offset, index, dtype, &v0, &v1);
                    for (int j = 0; j < per_pass; ++j) {
                        const v8f w = splat(weights[(g0 + j) * TILE + t + u]);
                        sum0[j * in_flight + u] += w * v0;
                        sum1[j * in_flight + u] += w * v1;
                    }
                }
            }
            for (; t < num_tokens; ++t) {
                v8f v0, v1;
                load_chunk(rows[t] + offset, index, dtype, &v0, &v1);
                for (int j = 0; j < per_pass; ++j) {
                    const v8f w = splat(weights[(g0 + j) * TILE + t]);
                    sum0[j * in_flight] += w * v0;
                    sum1[j * in_flight] += w * v1;
                }
            }
            for (int j = 0; j < per_pass; ++j) {
                for (int u = 1; u < in_flight; ++u) {
                    sum0[j * in_flight] += sum0[j * in_flight + u];
                    sum1[j * in_flight] += sum1[j * in_flight + u];
                }
                float *a = acc + (g0 + j) * head_dim + index;
                store8(a, sum0[j * in_flight]);
                store8(a + 8, sum1[j * in_flight]);
            }
        }
    }
}

/* Scratch of one call, in floats: per query head its query and accumulator (head_dim
 * each, chunk order), running max and sum; per subgroup the tile's scores and alphas. */
struct scratch {
    float *q, *acc, *running_max, *running_sum, *alpha, *scores;
};

/* The rows of one tile and, to prefetch, of the next (NULL: none, or already asked for). */
struct tile_rows {
    const char *const *keys;
    const char *const *values;
    int num_tokens;
    struct next_tile next_keys, next_values;
};

ALWAYS_INLINE void subgroup_tile(const struct scratch *s, int64_t head, int64_t head_dim,
                                 const struct tile_rows *rows, int64_t offset, float scale, const int dtype,
                                 const int num_group, const int isa) {
    tile_scores(s->scores, s->q + head * head_dim, head_dim, rows->keys, offset, rows->num_tokens,
                &rows->next_keys, scale, dtype, num_group, isa);
    tile_softmax(s->scores, rows->num_tokens, s->running_max + head, s->running_sum + head, s->alpha,
                 num_group);
    tile_values(s->acc + head * head_dim, s->scores, s->alpha, head_dim, rows->values, offset, rows->num_tokens,
                &rows->next_values, dtype, num_group);
}

/* One tile of a subgroup, specialized: per ISA, dtype and subgroup size (1, 2, 4, 8). */
typedef void (*tile_function)(const struct scratch *s, int64_t head, int64_t head_dim, const struct tile_rows *rows,
                              int64_t offset, float scale);

#define TILE_FUNCTION(target, isa, isa_name, dtype, dtype_name, group)                                      \
    target static void tile_##isa_name##_##dtype_name##_##group(                                             \
        const struct scratch *s, int64_t head, int64_t head_dim, const struct tile_rows *rows, int64_t offset, \
        float scale) {                                                                                       \
        subgroup_tile(s, head, head_dim, rows, offset, scale, dtype, group, isa);                            \
    }
#define TILE_FUNCTIONS(target, isa, isa_name)                                                                \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT32, f32, 1)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT32, f32, 2)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT32, f32, 4)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT32, f32, 8)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_BFLOAT16, bf16, 1)                                            \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_BFLOAT16, bf16, 2)                                            \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_BFLOAT16, bf16, 4)                                            \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_BFLOAT16, bf16, 8)                                            \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT16, f16, 1)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT16, f16, 2)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT16, f16, 4)                                              \
    TILE_FUNCTION(target, isa, isa_name, DTYPE_FLOAT16, f16, 8)                                              \
    static const tile_function tiles_##isa_name[3][4] = {                                                    \
        {tile_##isa_name##_f32_1, tile_##isa_name##_f32_2, tile_##isa_name##_f32_4, tile_##isa_name##_f32_8}, \
        {tile_##isa_name##_bf16_1, tile_##isa_name##_bf16_2, tile_##isa_name##_bf16_4,                       \
         tile_##isa_name##_bf16_8},                                                                          \
        {tile_##isa_name##_f16_1, tile_##isa_name##_f16_2, tile_##isa_name##_f16_4, tile_##isa_name##_f16_8}, \
    };

TILE_FUNCTIONS(, ISA_BASELINE, baseline)
#if SHOAL_HAS_AVX2_PATH
/* The same code with AVX2 and FMA (products and sums fused: built with -ffp-contract=fast). */
TILE_FUNCTIONS(__attribute__((target("avx2,fma"))), ISA_AVX2, avx2)
#endif

/* The key and value row pointers of the tile starting at position start (at most TILE
 * positions before seq_len); *block and *in_block walk the block table from position
 * start on. Returns the tile's number of tokens (0 past the end). */
static int tile_row_pointers(const int32_t *table, int64_t start, int64_t seq_len, int64_t block_size,
                             int64_t row_bytes, const char *key_cache, const char *value_cache,
                             const char **key_rows, const char **value_rows, int64_t *block, int64_t *in_block) {
    const int num_tokens = (int)(seq_len - start < TILE ? (seq_len > start ? seq_len - start : 0) : TILE);
    for (int t = 0; t < num_tokens; ++t) {
        const int64_t offset = ((int64_t)table[*block] * block_size + *in_block) * row_bytes;
        key_rows[t] = key_cache + offset;
        value_rows[t] = value_cache + offset;
        if (++*in_block == block_size) {
            *in_block = 0;
            ++*block;
        }
    }
    return num_tokens;
}

/* Sequences [seq_begin, seq_end), kv heads [kv_begin, kv_end) and their query heads. tiles:
 * the ISA's tile functions for the plan's dtype, by subgroup size 1, 2, 4, 8. */
static void decode_batch(const struct shoal_decode_plan *plan, int64_t seq_begin, int64_t seq_end, int64_t kv_begin,
                         int64_t kv_end, int64_t num_heads, char *out, int64_t out_token_stride,
                         int64_t out_head_stride, const char *query, int64_t query_token_stride,
                         int64_t query_head_stride, const char *key_cache, const char *value_cache, float scale,
                         const struct scratch *s, const tile_function tiles[4]) {
    const int dtype = (int)plan->dtype;
    const int64_t head_dim = plan->head_dim, num_kv_heads = plan->num_kv_heads;
    const int64_t group = num_heads / num_kv_heads, block_size = plan->block_size;
    const int64_t element_bytes = dtype == DTYPE_FLOAT32 ? 4 : 2;
    const int64_t row_bytes = num_kv_heads * head_dim * element_bytes; /* one token's K (or V) */
    const int64_t head_begin = kv_begin * group, head_end = kv_end * group;
    const char *key_rows[2][TILE];
    const char *value_rows[2][TILE];
    for (int64_t seq = seq_begin; seq < seq_end; ++seq) {
        const int32_t *table = plan->block_tables + seq * plan->table_stride;
        const int64_t seq_len = plan->seq_lens[seq], row = plan->rows[seq];
        for (int64_t head = head_begin; head < head_end; ++head) {
            const char *q_row = query + (row * query_token_stride + head * query_head_stride) * element_bytes;
            for (int64_t index = 0; index < head_dim; index += CHUNK) {
                v8f first, second;
                load_chunk(q_row, index, dtype, &first, &second);
                store8(s->q + head * head_dim + index, first);
                store8(s->q + head * head_dim + index + 8, second);
            }
            s->running_max[head] = -__builtin_inff();
            s->running_sum[head] = 0.0f;
        }
        memset(s->acc + head_begin * head_dim, 0, (size_t)((head_end - head_begin) * head_dim) * sizeof(float));
        /* Row pointers of tile i in key_rows[i % 2]; tile i + 1's are made before tile i runs,
         * so that its rows can be prefetched while tile i is computed. */
        int64_t block = 0, in_block = 0;
        int num_tokens = tile_row_pointers(table, 0, seq_len, block_size, row_bytes, key_cache, value_cache,
                                           key_rows[0], value_rows[0], &block, &in_block);
        for (int64_t start = 0, tile = 0; start < seq_len; start += TILE, ++tile) {
            const int current = (int)(tile & 1);
            struct tile_rows rows = {key_rows[current], value_rows[current], num_tokens, {NULL, 0}, {NULL, 0}};
            const int next_tokens =
                tile_row_pointers(table, start + TILE, seq_len, block_size, row_bytes, key_cache, value_cache,
                                  key_rows[!current], value_rows[!current], &block, &in_block);
            for (int64_t kv_head = kv_begin; kv_head < kv_end; ++kv_head) {
                const int64_t offset = kv_head * head_dim * element_bytes;
                /* the kv head's query heads, 8, 4, 2, 1 at a time; the first subgroup prefetches */
                for (int64_t done = 0; done < group;) {
                    const int64_t left = group - done;
                    const int size_index = left >= 8 ? 3 : left >= 4 ? 2 : left >= 2 ? 1 : 0;
                    if (done == 0 && next_tokens > 0) {
                        rows.next_keys = (struct next_tile){key_rows[!current], next_tokens};
                        rows.next_values = (struct next_tile){value_rows[!current], next_tokens};
                    } else {
                        rows.next_keys.rows = rows.next_values.rows = NULL;
                    }
                    tiles[size_index](s, kv_head * group + done, head_dim, &rows, offset, scale);
                    done += 1 << size_index;
                }
            }
            num_tokens = next_tokens;
        }
        for (int64_t head = head_begin; head < head_end; ++head) {
            char *out_row = out + (row * out_token_stride + head * out_head_stride) * element_bytes;
            const v8f inverse = splat(1.0f / s->running_sum[head]);
            const float *a = s->acc + head * head_dim;
            for (int64_t index = 0; index < head_dim; index += CHUNK) {
                store_chunk(out_row, index, dtype, load8(a + index) * inverse, load8(a + index + 8) * inverse);
            }
        }
    }
}

int64_t shoal_decode_scratch_floats(int64_t num_heads, int64_t head_dim) {
    return num_heads * (2 * head_dim + 2) + MAX_SUBGROUP * (TILE + 1);
}

static struct scratch make_scratch(float *memory, int64_t num_heads, int64_t head_dim) {
    const int64_t head_floats = num_heads * head_dim;
    struct scratch s;
    s.q = memory;
    s.acc = s.q + head_floats;
    s.running_max = s.acc + head_floats;
    s.running_sum = s.running_max + num_heads;
    s.alpha = s.running_sum + num_heads;
    s.scores = s.alpha + MAX_SUBGROUP;
    return s;
}

/* The fastest code path this CPU runs: ISA_AVX2 or ISA_BASELINE. */
int64_t shoal_decode_attention_isa(void) {
#if SHOAL_HAS_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return ISA_AVX2;
    }
#endif
    return ISA_BASELINE;
}

/* Everything the kernel reads through the plan, checked before any cache is touched:
 * returns DECODE_OK, DECODE_BAD_GEOMETRY, or the first sequence with a length below 1, a
 * row outside [0, num_tokens), more blocks than its table has, or a block id outside
 * [0, num_blocks). */
int64_t shoal_decode_check(const struct shoal_decode_plan *plan, int64_t num_tokens, int64_t num_heads) {
    if (plan->head_dim <= 0 || plan->head_dim % CHUNK || plan->num_kv_heads <= 0 || num_heads <= 0 ||
        num_heads % plan->num_kv_heads || plan->block_size <= 0 || plan->num_seqs < 0 ||
        plan->dtype < DTYPE_FLOAT32 || plan->dtype > DTYPE_FLOAT16) {
        return DECODE_BAD_GEOMETRY;
    }
    for (int64_t seq = 0; seq < plan->num_seqs; ++seq) {
        const int64_t seq_len = plan->seq_lens[seq], row = plan->rows[seq];
        const int64_t num_blocks = (seq_len + plan->block_size - 1) / plan->block_size;
        if (seq_len < 1 || row < 0 || row >= num_tokens || num_blocks > plan->table_stride) {
            return seq;
        }
        const int32_t *table = plan->block_tables + seq * plan->table_stride;
        for (int64_t i = 0; i < num_blocks; ++i) {
            if (table[i] < 0 || table[i] >= plan->num_blocks) {
                return seq;
            }
        }
    }
    return DECODE_OK;
}

/* out[rows[s], h] = softmax(scale * q K^T) V of query row rows[s], head h, over sequence
 * s's seq_lens[s] context positions, for every decoding sequence s of the plan.
 *
 * query and out are [num_tokens, num_heads, head_dim] with the given token and head
 * strides (in elements; the head_dim elements of a head contiguous); the caches are
 * contiguous [num_blocks, block_size, num_kv_heads, head_dim]; query head h reads kv
 * head h / (num_heads / num_kv_heads). isa: ISA_BEST, ISA_BASELINE or ISA_AVX2 (for tests).
 *
 * Returns DECODE_OK (-1); the first sequence the plan gets wrong (check_plan), with
 * nothing read or written; DECODE_BAD_GEOMETRY, DECODE_NO_MEMORY, or DECODE_NO_ISA (AVX2
 * asked for on a CPU without it). */
int64_t shoal_decode_attention(const struct shoal_decode_plan *plan, char *out, int64_t out_token_stride,
                               int64_t out_head_stride, const char *query, int64_t query_token_stride,
                               int64_t query_head_stride, int64_t num_tokens, int64_t num_heads,
                               const char *key_cache, const char *value_cache, double scale, int64_t isa) {
    const int64_t checked = shoal_decode_check(plan, num_tokens, num_heads);
    if (checked != DECODE_OK) {
        return checked;
    }
    const int64_t best = shoal_decode_attention_isa();
    if (isa == ISA_BEST) {
        isa = best;
    } else if (isa != ISA_BASELINE && (isa != ISA_AVX2 || best != ISA_AVX2)) {
        return DECODE_NO_ISA;
    }
    if (plan->num_seqs == 0) {
        return DECODE_OK;
    }
    float *memory = malloc((size_t)shoal_decode_scratch_floats(num_heads, plan->head_dim) * sizeof(float));
    if (memory == NULL) {
        return DECODE_NO_MEMORY;
    }
    const struct scratch s = make_scratch(memory, num_heads, plan->head_dim);
    const tile_function *tiles = tiles_baseline[plan->dtype];
#if SHOAL_HAS_AVX2_PATH
    if (isa == ISA_AVX2) {
        tiles = tiles_avx2[plan->dtype];
    }
#endif
    decode_batch(plan, 0, plan->num_seqs, 0, plan->num_kv_heads, num_heads, out, out_token_stride, out_head_stride,
                 query, query_token_stride, query_head_stride, key_cache, value_cache, (float)scale, &s, tiles);
    free(memory);
    return DECODE_OK;
}

/* Sequences [seq_begin, seq_end) and kv heads [kv_begin, kv_end) of a checked plan
 * (shoal_decode_check), the best code path, with the caller's scratch: the native model
 * forward's attention, run by several threads over disjoint ranges of sequences (or of one
 * sequence's kv heads). */
void shoal_decode_attention_range(const struct shoal_decode_plan *plan, int64_t seq_begin, int64_t seq_end,
                                  int64_t kv_begin, int64_t kv_end, char *out, int64_t out_token_stride, int64_t out_head_stride, const char *query,
                                  int64_t query_token_stride, int64_t query_head_stride, int64_t num_heads,
                                  const char *key_cache, const char *value_cache, float scale, float *scratch) {
    static int64_t best = -1;
    if (best < 0) {
        best = shoal_decode_attention_isa();
    }
    const struct scratch s = make_scratch(scratch, num_heads, plan->head_dim);
    const tile_function *tiles = tiles_baseline[plan->dtype];
#if SHOAL_HAS_AVX2_PATH
    if (best == ISA_AVX2) {
        tiles = tiles_avx2[plan->dtype];
    }
#endif
    decode_batch(plan, seq_begin, seq_end, kv_begin, kv_end, num_heads, out, out_token_stride, out_head_stride, query,
                 query_token_stride, query_head_stride, key_cache, value_cache, scale, &s, tiles);
}
