/* Float32 products on packed weights for the native model forward (cpu_model.c):
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), the shape of every linear layer.
 *
 * The weight is packed once (shoal_pack_linear) into panels of 32 output columns, each
 * panel [num_in][32] floats, so a product streams each panel once from memory, in order,
 * and reads it again from L2 for further blocks of rows. A micro-kernel multiplies up to
 * 12 rows (AVX-512; 3 with AVX2) by one panel, its 2 x rows accumulators in registers, then
 * the epilogue adds the bias, or fuses SiLU(gate) * up for a gate/up pair, and stores.
 * With few rows (a decode step of one sequence) the kernel keeps several independent
 * chains of sums over k and prefetches the panel ahead: it is then a read of the weights at
 * memory speed. Measured on the 2-core Zen 5 development VM (docs/engine.md): at one thread
 * 250-270 GFLOPS from 8 rows up and ~35 GB/s of weights for one row, faster than oneDNN's
 * packed sgemm at every row count tried.
 *
 * Bfloat16 weights (struct shoal_linear's dtype, SHOAL_WEIGHTS_BF16; shoal_pack_linear_bf16):
 * the same panels at half the bytes, two columns to a 32-bit word, widened to float32 in
 * registers (a shift, a mask) by kernels that are otherwise the float32 ones: a product equals
 * the float32 product of the rounded weights on the same code path, bit for bit.
 *
 * Code paths, chosen at run time: AVX-512F, AVX2 + FMA, and generic C. Each sums over k in
 * order within a chain (one chain per output for more than two rows), so a row's results do
 * not depend on the other rows of the batch, except for which kernel ran it (1, 2 or more
 * rows), which changes only the order of additions.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_model.h"
#include "cpu_vec.h"

/* No contraction of the epilogue's arithmetic into fused multiply-adds: SiLU then computes
 * exactly as ops.silu_mul does (cpu_fused.c). The kernels' FMAs are explicit intrinsics. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SHOAL_X86 1
#else
#define SHOAL_X86 0
#endif

#define TILE_MAX_ROWS 12 /* the most rows of any micro-kernel */
#ifndef PREFETCH_STEPS
#define PREFETCH_STEPS 64 /* how many k steps (128 bytes of panel each) ahead the kernels prefetch */
#endif

int64_t shoal_num_panels(const struct shoal_linear *w) {
    return (w->num_out + SHOAL_PANEL - 1) / SHOAL_PANEL;
}

/* Columns of PACK_K_BLOCK k at a time: the panel's 32 source rows' next 256 bytes each stay
 * in L1 while they are transposed 4 x 4 into the block's panel rows (a c-outer loop wrote one
 * float per 128 bytes). A load copies every product weight
 * through here (docs/benchmarks.md, "Sleep and wake"). */
#define PACK_K_BLOCK 64

/* The row of W that column c of panel p holds, or -1 (zero padding). A gate/up pair
 * (SILU_MUL) interleaves them by panel: 16 gate columns, then the same 16 up columns. */
static int64_t panel_source_row(int64_t p, int64_t c, int64_t num_out, int64_t epilogue) {
    if (epilogue == SHOAL_EPILOGUE_SILU_MUL) {
        const int64_t inter = num_out / 2, j = p * 16 + (c % 16);
        return j < inter ? (c < 16 ? j : inter + j) : -1;
    }
    return p * SHOAL_PANEL + c < num_out ? p * SHOAL_PANEL + c : -1;
}

/* Packs W [num_out, num_in] (row-major) into panels; SILU_MUL: W is [2 * inter, num_in],
 * gate rows then up rows, and num_out = 2 * inter with inter a multiple of 16. */
void shoal_pack_linear(const float *weight, int64_t num_out, int64_t num_in, int64_t epilogue, float *panels) {
    const int64_t num_panels = (num_out + SHOAL_PANEL - 1) / SHOAL_PANEL;
    const float *rows[SHOAL_PANEL]; /* W's row for each panel column, or NULL (zero padding) */
    for (int64_t p = 0; p < num_panels; ++p) {
        float *panel = panels + p * num_in * SHOAL_PANEL;
        for (int64_t c = 0; c < SHOAL_PANEL; ++c) {
            const int64_t source = panel_source_row(p, c, num_out, epilogue);
            rows[c] = source >= 0 ? weight + source * num_in : NULL;
        }
        for (int64_t k0 = 0; k0 < num_in; k0 += PACK_K_BLOCK) {
            const int64_t k1 = k0 + PACK_K_BLOCK < num_in ? k0 + PACK_K_BLOCK : num_in;
            for (int64_t c = 0; c < SHOAL_PANEL; c += 4) {
                int64_t k = k0;
#if SHOAL_X86
                if (rows[c] != NULL && rows[c + 1] != NULL && rows[c + 2] != NULL && rows[c + 3] != NULL) {
                    for (; k + 4 <= k1; k += 4) { /* 4 rows x 4 k, transposed in registers (SSE) */
                        __m128 r0 = _mm_loadu_ps(rows[c] + k), r1 = _mm_loadu_ps(rows[c + 1] + k);
                        __m128 r2 = _mm_loadu_ps(rows[c + 2] + k), r3 = _mm_loadu_ps(rows[c + 3] + k);
                        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
                        _mm_storeu_ps(panel + k * SHOAL_PANEL + c, r0);
                        _mm_storeu_ps(panel + (k + 1) * SHOAL_PANEL + c, r1);
                        _mm_storeu_ps(panel + (k + 2) * SHOAL_PANEL + c, r2);
                        _mm_storeu_ps(panel + (k + 3) * SHOAL_PANEL + c, r3);
                    }
                }
#endif
                for (; k < k1; ++k) {
                    for (int64_t i = c; i < c + 4; ++i) {
                        panel[k * SHOAL_PANEL + i] = rows[i] != NULL ? rows[i][k] : 0.0f;
                    }
                }
            }
        }
    }
}

/* float32 -> bfloat16, rounded to nearest, ties to even, as torch's conversion rounds (a NaN
 * becomes torch's 0x7fc0). */
static inline uint32_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0u;
    }
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

/* Packs W [num_out, num_in] (row-major; float32, or bfloat16 with weight_is_bf16, taken as it
 * is) into bf16 panels (cpu_model.h's SHOAL_WEIGHTS_BF16 layout), float32 rounded to nearest
 * even; the columns are shoal_pack_linear's (SILU_MUL: gate/up pairs). */
void shoal_pack_linear_bf16(const void *weight, int64_t weight_is_bf16, int64_t num_out, int64_t num_in,
                            int64_t epilogue, uint32_t *panels) {
    const int64_t num_panels = (num_out + SHOAL_PANEL - 1) / SHOAL_PANEL;
    const float *rows_f32[SHOAL_PANEL];
    const uint16_t *rows_bf16[SHOAL_PANEL];
    for (int64_t p = 0; p < num_panels; ++p) {
        uint32_t *panel = panels + p * num_in * (SHOAL_PANEL / 2);
        for (int64_t c = 0; c < SHOAL_PANEL; ++c) {
            const int64_t source = panel_source_row(p, c, num_out, epilogue);
            rows_f32[c] = source >= 0 && !weight_is_bf16 ? (const float *)weight + source * num_in : NULL;
            rows_bf16[c] = source >= 0 && weight_is_bf16 ? (const uint16_t *)weight + source * num_in : NULL;
        }
        for (int64_t k0 = 0; k0 < num_in; k0 += PACK_K_BLOCK) {
            const int64_t k1 = k0 + PACK_K_BLOCK < num_in ? k0 + PACK_K_BLOCK : num_in;
            for (int64_t c = 0; c < SHOAL_PANEL / 2; ++c) {
                for (int64_t k = k0; k < k1; ++k) {
                    uint32_t low = 0, high = 0;
                    if (weight_is_bf16) {
                        low = rows_bf16[c] != NULL ? rows_bf16[c][k] : 0u;
                        high = rows_bf16[c + 16] != NULL ? rows_bf16[c + 16][k] : 0u;
                    } else {
                        low = rows_f32[c] != NULL ? to_bf16(rows_f32[c][k]) : 0u;
                        high = rows_f32[c + 16] != NULL ? to_bf16(rows_f32[c + 16][k]) : 0u;
                    }
                    panel[k * (SHOAL_PANEL / 2) + c] = low | high << 16;
                }
            }
        }
    }
}

/* --- epilogues ------------------------------------------------------------------------------ */

/* tile: rows x 32 sums. Stores y (+ bias) for the panel's valid columns. */
ALWAYS_INLINE void epilogue(const struct shoal_linear *w, int64_t panel, const float *tile, int rows, float *y,
                            int64_t y_stride) {
    if (w->epilogue == SHOAL_EPILOGUE_SILU_MUL) {
        const int64_t inter = w->num_out / 2, first = panel * 16;
        const int64_t count = inter - first < 16 ? inter - first : 16;
        v16f gate_bias = splat16(0.0f), up_bias = splat16(0.0f);
        if (w->bias != NULL && count == 16) {
            gate_bias = load16(w->bias + first);
            up_bias = load16(w->bias + inter + first);
        }
        for (int r = 0; r < rows; ++r) {
            const v16f out = silu_mul16(load16(tile + r * 32) + gate_bias, load16(tile + r * 32 + 16) + up_bias);
            if (count == 16) {
                memcpy(y + r * y_stride + first, &out, sizeof out);
            } else {
                for (int64_t c = 0; c < count; ++c) {
                    const float g = tile[r * 32 + c] + (w->bias ? w->bias[first + c] : 0.0f);
                    const float u = tile[r * 32 + 16 + c] + (w->bias ? w->bias[inter + first + c] : 0.0f);
                    y[r * y_stride + first + c] = silu_mul16(splat16(g), splat16(u))[0];
                }
            }
        }
        return;
    }
    const int64_t first = panel * SHOAL_PANEL;
    const int64_t count = w->num_out - first < SHOAL_PANEL ? w->num_out - first : SHOAL_PANEL;
    for (int r = 0; r < rows; ++r) {
        float *out = y + r * y_stride + first;
        const float *sums = tile + r * 32;
        if (w->bias != NULL) {
            for (int64_t c = 0; c < count; ++c) {
                out[c] = sums[c] + w->bias[first + c];
            }
        } else {
            memcpy(out, sums, (size_t)count * sizeof(float));
        }
    }
}

/* --- micro-kernels: rows x one panel -> tile[rows][32] ----------------------------------- */

/* panel: floats (float32 kernels) or words of two bfloat16 (bf16 kernels, cpu_model.h). */
typedef void (*micro_kernel)(const float *x, int64_t x_stride, const void *panel, int64_t num_in, float *tile);

/* Step k's 32 weights as float32, in column order: float32 panels as they are; bf16 panels
 * widened (a bfloat16 is the high half of the float32 with the same value). */
ALWAYS_INLINE void generic_weights_f32(const void *panel, int64_t k, float *out) {
    memcpy(out, (const float *)panel + k * 32, 32 * sizeof(float));
}

ALWAYS_INLINE void generic_weights_bf16(const void *panel, int64_t k, float *out) {
    const uint32_t *words = (const uint32_t *)panel + k * 16;
    uint32_t bits[32];
    for (int c = 0; c < 16; ++c) {
        bits[c] = words[c] << 16;
        bits[c + 16] = words[c] & 0xffff0000u;
    }
    memcpy(out, bits, sizeof bits);
}

/* Generic C: the compiler vectorizes the 32 columns with whatever the baseline ISA has. */
#define GENERIC_KERNEL(NAME, R, WEIGHTS)                                                                     \
    static void NAME##_##R(const float *x, int64_t x_stride, const void *panel, int64_t num_in, float *tile) { \
        float acc[R][32];                                                                                    \
        memset(acc, 0, sizeof acc);                                                                          \
        for (int64_t k = 0; k < num_in; ++k) {                                                               \
            float wk[32];                                                                                    \
            WEIGHTS(panel, k, wk);                                                                           \
            for (int r = 0; r < R; ++r) {                                                                    \
                const float xv = x[r * x_stride + k];                                                        \
                for (int c = 0; c < 32; ++c) {                                                               \
                    acc[r][c] += xv * wk[c];                                                                 \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        memcpy(tile, acc, sizeof acc);                                                                       \
    }
GENERIC_KERNEL(generic, 1, generic_weights_f32)
GENERIC_KERNEL(generic, 2, generic_weights_f32)
GENERIC_KERNEL(generic, 3, generic_weights_f32)
GENERIC_KERNEL(generic, 4, generic_weights_f32)
GENERIC_KERNEL(generic_bf16, 1, generic_weights_bf16)
GENERIC_KERNEL(generic_bf16, 2, generic_weights_bf16)
GENERIC_KERNEL(generic_bf16, 3, generic_weights_bf16)
GENERIC_KERNEL(generic_bf16, 4, generic_weights_bf16)
static const micro_kernel generic_kernels[5] = {NULL, generic_1, generic_2, generic_3, generic_4};
static const micro_kernel generic_bf16_kernels[5] = {NULL, generic_bf16_1, generic_bf16_2, generic_bf16_3,
                                                     generic_bf16_4};
#define GENERIC_MAX_ROWS 4

#if SHOAL_X86
/* Loads of step k's 32 weights into two AVX-512 registers (columns 0-15, 16-31), and the
 * prefetch of the panel PREFETCH_STEPS float32 steps (8 KiB) ahead: from memory for the
 * first block of rows, L2 after. */
#define AVX512_LOAD_F32(panel, k, w0, w1)                                                                    \
    const __m512 w0 = _mm512_loadu_ps((const float *)(panel) + (k) * 32);                                    \
    const __m512 w1 = _mm512_loadu_ps((const float *)(panel) + (k) * 32 + 16)
#define AVX512_PREFETCH_F32(panel, k)                                                                        \
    _mm_prefetch((const char *)((const float *)(panel) + ((k) + PREFETCH_STEPS) * 32), _MM_HINT_T0);         \
    _mm_prefetch((const char *)((const float *)(panel) + ((k) + PREFETCH_STEPS) * 32 + 16), _MM_HINT_T0)
#define AVX512_LOAD_BF16(panel, k, w0, w1)                                                                   \
    const __m512i w0##_words = _mm512_loadu_si512((const uint32_t *)(panel) + (k) * 16);                     \
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0##_words, 16));                                \
    const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(w0##_words, _mm512_set1_epi32((int)0xffff0000u)))
#define AVX512_PREFETCH_BF16(panel, k)                                                                       \
    _mm_prefetch((const char *)((const uint32_t *)(panel) + ((k) + 2 * PREFETCH_STEPS) * 16), _MM_HINT_T0)

/* AVX-512: R rows, CH independent chains over k (more chains for fewer rows, so that the
 * FMAs' latency is hidden: 2 x R x CH accumulators). */
#define AVX512_KERNEL(NAME, R, CH, LOAD, PREFETCH)                                                          \
    __attribute__((target("avx512f"))) static void NAME##_##R(const float *x, int64_t x_stride,             \
                                                               const void *panel, int64_t num_in,            \
                                                               float *tile) {                                \
        __m512 acc[CH][R][2];                                                                                \
        for (int c = 0; c < CH; ++c) {                                                                       \
            for (int r = 0; r < R; ++r) {                                                                    \
                acc[c][r][0] = _mm512_setzero_ps();                                                          \
                acc[c][r][1] = _mm512_setzero_ps();                                                          \
            }                                                                                                \
        }                                                                                                    \
        int64_t k = 0;                                                                                       \
        for (; k + CH <= num_in; k += CH) {                                                                  \
            for (int c = 0; c < CH; ++c) {                                                                   \
                PREFETCH(panel, k + c);                                                                      \
            }                                                                                                \
            for (int c = 0; c < CH; ++c) {                                                                   \
                LOAD(panel, k + c, w0, w1);                                                                  \
                for (int r = 0; r < R; ++r) {                                                                \
                    const __m512 xv = _mm512_set1_ps(x[r * x_stride + k + c]);                              \
                    acc[c][r][0] = _mm512_fmadd_ps(xv, w0, acc[c][r][0]);                                    \
                    acc[c][r][1] = _mm512_fmadd_ps(xv, w1, acc[c][r][1]);                                    \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (; k < num_in; ++k) {                                                                            \
            LOAD(panel, k, w0, w1);                                                                          \
            for (int r = 0; r < R; ++r) {                                                                    \
                const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);                                       \
                acc[0][r][0] = _mm512_fmadd_ps(xv, w0, acc[0][r][0]);                                        \
                acc[0][r][1] = _mm512_fmadd_ps(xv, w1, acc[0][r][1]);                                        \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; ++r) {                                                                        \
            __m512 s0 = acc[0][r][0], s1 = acc[0][r][1];                                                     \
            for (int c = 1; c < CH; ++c) {                                                                   \
                s0 = _mm512_add_ps(s0, acc[c][r][0]);                                                        \
                s1 = _mm512_add_ps(s1, acc[c][r][1]);                                                        \
            }                                                                                                \
            _mm512_storeu_ps(tile + r * 32, s0);                                                             \
            _mm512_storeu_ps(tile + r * 32 + 16, s1);                                                        \
        }                                                                                                    \
    }
#define AVX512_KERNELS(NAME, LOAD, PREFETCH)                                                                 \
    AVX512_KERNEL(NAME, 1, 4, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 2, 2, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 3, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 4, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 5, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 6, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 7, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 8, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 9, 1, LOAD, PREFETCH)                                                                \
    AVX512_KERNEL(NAME, 10, 1, LOAD, PREFETCH)                                                               \
    AVX512_KERNEL(NAME, 11, 1, LOAD, PREFETCH)                                                               \
    AVX512_KERNEL(NAME, 12, 1, LOAD, PREFETCH)                                                               \
    static const micro_kernel NAME##_kernels[13] = {NULL,      NAME##_1,  NAME##_2, NAME##_3, NAME##_4,     \
                                                    NAME##_5,  NAME##_6,  NAME##_7, NAME##_8, NAME##_9,     \
                                                    NAME##_10, NAME##_11, NAME##_12};
AVX512_KERNELS(avx512, AVX512_LOAD_F32, AVX512_PREFETCH_F32)
AVX512_KERNELS(avx512_bf16, AVX512_LOAD_BF16, AVX512_PREFETCH_BF16)
#define AVX512_MAX_ROWS 12

/* Step k's 32 weights into four AVX2 registers, columns 0-7, 8-15, 16-23, 24-31: bf16 words
 * 0-7 hold columns 0-7 (low halves) and 16-23 (high), words 8-15 columns 8-15 and 24-31. */
#define AVX2_LOAD_F32(panel, k, w)                                                                           \
    for (int v = 0; v < 4; ++v) {                                                                            \
        w[v] = _mm256_loadu_ps((const float *)(panel) + (k) * 32 + 8 * v);                                   \
    }
#define AVX2_LOAD_BF16(panel, k, w)                                                                          \
    {                                                                                                        \
        const __m256i low = _mm256_loadu_si256((const __m256i *)((const uint32_t *)(panel) + (k) * 16));     \
        const __m256i high = _mm256_loadu_si256((const __m256i *)((const uint32_t *)(panel) + (k) * 16 + 8)); \
        const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);                                            \
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(low, 16));                                              \
        w[1] = _mm256_castsi256_ps(_mm256_slli_epi32(high, 16));                                             \
        w[2] = _mm256_castsi256_ps(_mm256_and_si256(low, mask));                                             \
        w[3] = _mm256_castsi256_ps(_mm256_and_si256(high, mask));                                            \
    }

/* AVX2: 32 columns are 4 registers; up to 3 rows (12 accumulators of 16 registers). */
#define AVX2_KERNEL(NAME, R, CH, LOAD)                                                                       \
    __attribute__((target("avx2,fma"))) static void NAME##_##R(const float *x, int64_t x_stride,            \
                                                              const void *panel, int64_t num_in,             \
                                                              float *tile) {                                 \
        __m256 acc[CH][R][4];                                                                                \
        for (int c = 0; c < CH; ++c) {                                                                       \
            for (int r = 0; r < R; ++r) {                                                                    \
                for (int v = 0; v < 4; ++v) {                                                                \
                    acc[c][r][v] = _mm256_setzero_ps();                                                      \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        int64_t k = 0;                                                                                       \
        for (; k + CH <= num_in; k += CH) {                                                                  \
            for (int c = 0; c < CH; ++c) {                                                                   \
                __m256 w[4];                                                                                 \
                LOAD(panel, k + c, w)                                                                        \
                for (int r = 0; r < R; ++r) {                                                                \
                    const __m256 xv = _mm256_set1_ps(x[r * x_stride + k + c]);                               \
                    for (int v = 0; v < 4; ++v) {                                                            \
                        acc[c][r][v] = _mm256_fmadd_ps(xv, w[v], acc[c][r][v]);                              \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (; k < num_in; ++k) {                                                                            \
            __m256 w[4];                                                                                     \
            LOAD(panel, k, w)                                                                                \
            for (int r = 0; r < R; ++r) {                                                                    \
                const __m256 xv = _mm256_set1_ps(x[r * x_stride + k]);                                       \
                for (int v = 0; v < 4; ++v) {                                                                \
                    acc[0][r][v] = _mm256_fmadd_ps(xv, w[v], acc[0][r][v]);                                  \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; ++r) {                                                                        \
            for (int v = 0; v < 4; ++v) {                                                                    \
                __m256 s = acc[0][r][v];                                                                     \
                for (int c = 1; c < CH; ++c) {                                                               \
                    s = _mm256_add_ps(s, acc[c][r][v]);                                                      \
                }                                                                                            \
                _mm256_storeu_ps(tile + r * 32 + 8 * v, s);                                                  \
            }                                                                                                \
        }                                                                                                    \
    }
AVX2_KERNEL(avx2, 1, 2, AVX2_LOAD_F32)
AVX2_KERNEL(avx2, 2, 1, AVX2_LOAD_F32)
AVX2_KERNEL(avx2, 3, 1, AVX2_LOAD_F32)
AVX2_KERNEL(avx2_bf16, 1, 2, AVX2_LOAD_BF16)
AVX2_KERNEL(avx2_bf16, 2, 1, AVX2_LOAD_BF16)
AVX2_KERNEL(avx2_bf16, 3, 1, AVX2_LOAD_BF16)
static const micro_kernel avx2_kernels[4] = {NULL, avx2_1, avx2_2, avx2_3};
static const micro_kernel avx2_bf16_kernels[4] = {NULL, avx2_bf16_1, avx2_bf16_2, avx2_bf16_3};
#define AVX2_MAX_ROWS 3
#endif

int shoal_gemm_best_isa(void) {
    static int cached = -1;
    if (cached < 0) {
        int isa = SHOAL_ISA_GENERIC;
#if SHOAL_X86
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f")) {
            isa = SHOAL_ISA_AVX512;
        } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
            isa = SHOAL_ISA_AVX2;
        }
#endif
        cached = isa;
    }
    return cached;
}

/* Row blocks of a panel pass: as even as the kernel's row limit allows (13 rows run as
 * 7 + 6, not 12 + 1). */
static int next_block_rows(int64_t left, int max_rows) {
    const int64_t num_blocks = (left + max_rows - 1) / max_rows;
    return (int)((left + num_blocks - 1) / num_blocks);
}

/* Rows per pass over the panels: as many as keep their inputs (rows x num_in floats)
 * within about 192 KB of L2, next to the panel being read. */
static int64_t rows_per_pass(int64_t num_in, int max_rows) {
    int64_t rows = (192 * 1024) / (num_in * (int64_t)sizeof(float));
    rows -= rows % max_rows;
    return rows < max_rows ? max_rows : rows;
}

/* One driver per code path, so that the epilogue (SiLU's exponentials) is compiled for it too;
 * the panels' dtype picks the kernels (a bf16 panel is half a float32 one's bytes). */
#define GEMM_DRIVER(NAME, TARGET, KERNELS, BF16_KERNELS, MAX_ROWS)                                           \
    TARGET static void NAME(const struct shoal_linear *w, const float *x, int64_t x_stride, float *y,         \
                            int64_t y_stride, int64_t num_rows, int64_t panel_begin, int64_t panel_end) {     \
        const int64_t num_in = w->num_in;                                                                    \
        const int64_t pass_rows = rows_per_pass(num_in, MAX_ROWS);                                           \
        const int bf16 = w->dtype == SHOAL_WEIGHTS_BF16;                                                     \
        const micro_kernel *kernels = bf16 ? BF16_KERNELS : KERNELS;                                         \
        const int64_t panel_bytes = num_in * SHOAL_PANEL * (bf16 ? 2 : 4);                                   \
        float tile[TILE_MAX_ROWS * 32];                                                                      \
        for (int64_t first = 0; first < num_rows; first += pass_rows) {                                      \
            const int64_t end = first + pass_rows < num_rows ? first + pass_rows : num_rows;                 \
            for (int64_t p = panel_begin; p < panel_end; ++p) {                                              \
                const void *panel = (const char *)w->panels + p * panel_bytes;                               \
                for (int64_t m = first; m < end;) {                                                          \
                    const int rows = next_block_rows(end - m, MAX_ROWS);                                     \
                    kernels[rows](x + m * x_stride, x_stride, panel, num_in, tile);                          \
                    epilogue(w, p, tile, rows, y + m * y_stride, y_stride);                                  \
                    m += rows;                                                                               \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
GEMM_DRIVER(gemm_generic, , generic_kernels, generic_bf16_kernels, GENERIC_MAX_ROWS)
#if SHOAL_X86
GEMM_DRIVER(gemm_avx2, __attribute__((target("avx2,fma"))), avx2_kernels, avx2_bf16_kernels, AVX2_MAX_ROWS)
GEMM_DRIVER(gemm_avx512, __attribute__((target("avx512f"))), avx512_kernels, avx512_bf16_kernels, AVX512_MAX_ROWS)
#endif

void shoal_gemm_panels(const struct shoal_linear *w, const float *x, int64_t x_stride, float *y,
                       int64_t y_stride, int64_t num_rows, int64_t panel_begin, int64_t panel_end, int isa) {
#if SHOAL_X86
    if (isa == SHOAL_ISA_AVX512) {
        gemm_avx512(w, x, x_stride, y, y_stride, num_rows, panel_begin, panel_end);
        return;
    }
    if (isa == SHOAL_ISA_AVX2) {
        gemm_avx2(w, x, x_stride, y, y_stride, num_rows, panel_begin, panel_end);
        return;
    }
#else
    (void)isa;
#endif
    gemm_generic(w, x, x_stride, y, y_stride, num_rows, panel_begin, panel_end);
}
