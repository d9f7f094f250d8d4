/* The element-wise parts of a decoder layer, fused: RMSNorm (with the residual add before
 * it), rotary embedding in place on q and k, SiLU(gate) * up. The native model forward
 * (cpu_model.c) runs them between its products; shoal.kernels.ops exposes them (torch
 * reference in kernels/reference.py, CUDA twins in kernels/csrc/fused_ops.cu).
 *
 * Float32, in Hugging Face's order of operations (LlamaRMSNorm, apply_rotary_pos_emb,
 * SiLU then the product), with no fused multiply-adds, so that the only difference from
 * transformers is the order in which the RMSNorm's squares are summed.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_model.h"
#include "cpu_vec.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

void shoal_rms_norm_rows(float *out, int64_t out_stride, const float *x, int64_t x_stride, float *residual,
                         int64_t residual_stride, const float *weight, int64_t num_rows, int64_t hidden,
                         float eps) {
    for (int64_t row = 0; row < num_rows; ++row) {
        const float *in = x + row * x_stride;
        float *target = out + row * out_stride;
        if (residual != NULL) { /* residual = residual + x: the layer's sum, normalized next */
            float *sum = residual + row * residual_stride;
            for (int64_t i = 0; i < hidden; ++i) {
                sum[i] = sum[i] + in[i];
            }
            in = sum;
        }
        float lanes[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16) {
            for (int j = 0; j < 16; ++j) {
                lanes[j] += in[i + j] * in[i + j];
            }
        }
        for (; i < hidden; ++i) {
            lanes[0] += in[i] * in[i];
        }
        float total = 0.0f;
        for (int j = 0; j < 16; ++j) {
            total += lanes[j];
        }
        const float inverse = 1.0f / __builtin_sqrtf(total / (float)hidden + eps);
        for (i = 0; i < hidden; ++i) {
            target[i] = weight[i] * (in[i] * inverse);
        }
    }
}

void shoal_rotary_row(float *row, int64_t num_heads, int64_t head_stride, int64_t head_dim, const float *cos,
                      const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t head = 0; head < num_heads; ++head) {
        float *x = row + head * head_stride;
        for (int64_t i = 0; i < half; ++i) {
            const float first = x[i], second = x[i + half];
            x[i] = first * cos[i] + (-second) * sin[i];
            x[i + half] = second * cos[i] + first * sin[i];
        }
    }
}

void shoal_rope_row(float *out, int64_t position, const float *inv_freq, int64_t head_dim, float scaling) {
    const int64_t half = head_dim / 2;
    const float where = (float)position;
    for (int64_t i = 0; i < half; ++i) {
        const float freq = where * inv_freq[i];
        out[i] = (float)cos((double)freq) * scaling;
        out[half + i] = (float)sin((double)freq) * scaling;
    }
}

void shoal_silu_mul_row(float *out, const float *gate, const float *up, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const v16f result = silu_mul16(load16(gate + j), load16(up + j));
        memcpy(out + j, &result, sizeof result);
    }
    for (; j < n; ++j) { /* lane by lane: the same arithmetic */
        out[j] = silu_mul16(splat16(gate[j]), splat16(up[j]))[0];
    }
}

int64_t shoal_argmax(const float *row, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
        const float x = row[i], top = row[best];
        if (top != top) {
            break; /* a NaN is the maximum (torch.argmax's rule): the first one */
        }
        if (x > top || x != x) {
            best = i;
        }
    }
    return best;
}

/* --- the ops' entry points (shoal.kernels.cpu_kernels) ------------------------------------- */

/* ops.rms_norm: out[r] = weight * norm(x[r] (+ residual[r], stored back)); strides in floats. */
void shoal_rms_norm(float *out, int64_t out_stride, const float *x, int64_t x_stride, float *residual,
                    int64_t residual_stride, const float *weight, int64_t num_rows, int64_t hidden, double eps) {
    shoal_rms_norm_rows(out, out_stride, x, x_stride, residual, residual_stride, weight, num_rows, hidden,
                        (float)eps);
}

/* ops.rotary_embedding: q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] in place
 * (strides in floats), with each token's cos and sin [tokens, head_dim] as transformers' rotary
 * embedding returns them (both halves equal; the first is read). */
void shoal_rotary(float *query, int64_t query_token_stride, int64_t query_head_stride, int64_t num_query_heads,
                  float *key, int64_t key_token_stride, int64_t key_head_stride, int64_t num_key_heads,
                  const float *cos, const float *sin, int64_t cos_sin_stride, int64_t num_tokens, int64_t head_dim) {
    for (int64_t token = 0; token < num_tokens; ++token) {
        const float *c = cos + token * cos_sin_stride, *s = sin + token * cos_sin_stride;
        shoal_rotary_row(query + token * query_token_stride, num_query_heads, query_head_stride, head_dim, c, s);
        shoal_rotary_row(key + token * key_token_stride, num_key_heads, key_head_stride, head_dim, c, s);
    }
}

/* ops.silu_mul: out[r, j] = silu(gate_up[r, j]) * gate_up[r, n + j], j < n. */
void shoal_silu_mul(float *out, int64_t out_stride, const float *gate_up, int64_t gate_up_stride, int64_t num_rows,
                    int64_t n) {
    for (int64_t row = 0; row < num_rows; ++row) {
        const float *in = gate_up + row * gate_up_stride;
        shoal_silu_mul_row(out + row * out_stride, in, in + n, n);
    }
}
