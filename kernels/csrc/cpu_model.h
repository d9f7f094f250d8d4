/* Internal interfaces of the native CPU library's model forward (cpu_threads.c, cpu_gemm.c,
 * cpu_fused.c, cpu_model.c, and the decode attention of cpu_attention.c). Not a public
 * header: Python reaches these through the exported shoal_* functions only
 * (kernels/cpu_kernels.py, kernels/cpu_model.py). Plain C11, no torch headers.
 */
#ifndef SHOAL_CPU_MODEL_H
#define SHOAL_CPU_MODEL_H

#include <stdint.h>

/* --- threads (cpu_threads.c) ------------------------------------------------------------ */

#define SHOAL_MAX_THREADS 64
#define SHOAL_MAX_PHASES 4096

/* One phase of a program: num_items independent items, run(context, item) for each, any
 * thread, in any order; every item of the phases before is done when one of these starts. */
struct shoal_phase {
    void (*run)(const void *context, int64_t item);
    const void *context;
    int64_t num_items;
};

/* Runs the phases on the caller and up to num_threads - 1 helpers (one program at a time per
 * process) and returns when every item is done. Returns 0, or -1 for more than
 * SHOAL_MAX_PHASES phases or 2^20 - 1 items (nothing run). */
int shoal_run_phases(const struct shoal_phase *phases, int64_t num_phases, int num_threads);

/* Tells idle helpers not to look for another program (they sleep until the next one is
 * posted): the caller's next work is not shared, or there is none for a while. Running a
 * program on one thread says the same. */
void shoal_rest_threads(void);

/* out[4]: helper threads started; programs posted to them; helpers' idle waits that ended
 * asleep because they were told to rest; ... because they looked for the next program for
 * their whole idle window. */
void shoal_thread_stats(int64_t *out);

/* --- products (cpu_gemm.c) --------------------------------------------------------------- */

#define SHOAL_PANEL 32 /* output columns per packed panel */

enum { SHOAL_EPILOGUE_STORE = 0, SHOAL_EPILOGUE_SILU_MUL = 1 };

/* The panels' element type. BF16: a panel is [num_in][16] 32-bit words, word j of step k
 * holding column j's bfloat16 in its low half and column j + 16's in its high half (the
 * columns of the float32 layout, same order); a kernel widens them to float32 in registers
 * (a shift, a mask) and computes as for float32 panels. Half the bytes to stream. */
enum { SHOAL_WEIGHTS_F32 = 0, SHOAL_WEIGHTS_BF16 = 1 };

/* A packed weight: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for n < num_out.
 * Panels of SHOAL_PANEL output columns: panels[p][k][c] = W[p * 32 + c][k], zero past num_out.
 * With the SILU_MUL epilogue the panels interleave a gate/up pair: panel p holds gate columns
 * 16p .. 16p+15 then the up columns with the same indices, and y[m, j] = silu(gate_j) * up_j
 * for j < num_out / 2. */
struct shoal_linear {
    const void *panels; /* float (SHOAL_WEIGHTS_F32) or uint32_t words of two bf16 (SHOAL_WEIGHTS_BF16) */
    const float *bias; /* [num_out] (SILU_MUL: gate biases then up biases, 2 x num_out / 2), or NULL */
    int64_t num_out;
    int64_t num_in;
    int64_t epilogue;
    int64_t dtype; /* SHOAL_WEIGHTS_* */
};

/* y = x W^T for the columns of panels [panel_begin, panel_end); x rows x_stride floats apart,
 * y rows y_stride apart. isa: SHOAL_ISA_*. */
void shoal_gemm_panels(const struct shoal_linear *w, const float *x, int64_t x_stride, float *y,
                       int64_t y_stride, int64_t num_rows, int64_t panel_begin, int64_t panel_end, int isa);

int64_t shoal_num_panels(const struct shoal_linear *w);

enum { SHOAL_ISA_GENERIC = 0, SHOAL_ISA_AVX2 = 1, SHOAL_ISA_AVX512 = 2 };
int shoal_gemm_best_isa(void);

/* --- element-wise (cpu_fused.c) ---------------------------------------------------------- */

/* rows of x (x_stride apart): with residual, residual += x first (in place) and the norm is
 * of the sum; out = weight * (r * rsqrt(mean(r^2) + eps)), float32, in Hugging Face's order. */
void shoal_rms_norm_rows(float *out, int64_t out_stride, const float *x, int64_t x_stride, float *residual,
                         int64_t residual_stride, const float *weight, int64_t num_rows, int64_t hidden, float eps);

/* Rotary embedding (rotate-half layout) in place on one row of num_heads heads of head_dim,
 * head_stride floats apart; cos and sin are the position's head_dim / 2 values (the two
 * halves of a head use the same ones, as transformers' cat((freqs, freqs)) makes them). */
void shoal_rotary_row(float *row, int64_t num_heads, int64_t head_stride, int64_t head_dim, const float *cos,
                      const float *sin);

/* A position's cos (out[0 .. head_dim/2)) and sin (out[head_dim/2 .. head_dim)) as
 * transformers' rotary embedding computes them in float32: freq = (float)position * inv_freq,
 * then cos and sin (rounded from double: within an ulp of torch's), times scaling. */
void shoal_rope_row(float *out, int64_t position, const float *inv_freq, int64_t head_dim, float scaling);

/* The index of the largest of n values, the first on a tie; the first NaN if any (torch.argmax). */
int64_t shoal_argmax(const float *row, int64_t n);

/* out[j] = silu(gate[j]) * up[j] = gate[j] / (1 + exp(-gate[j])) * up[j], j < n. */
void shoal_silu_mul_row(float *out, const float *gate, const float *up, int64_t n);

/* --- decode attention (cpu_attention.c) -------------------------------------------------- */

/* The batch of decoding sequences, built once per forward pass (kernels/cpu_kernels.py's
 * DecodePlan mirrors it) and used by every layer. */
struct shoal_decode_plan {
    int64_t num_seqs;
    const int32_t *block_tables; /* [num_seqs, table_stride] block ids */
    int64_t table_stride;
    const int32_t *seq_lens; /* [num_seqs] context lengths, >= 1 */
    const int32_t *rows;     /* [num_seqs] each sequence's query (and output) row */
    int64_t num_blocks;      /* of the caches the plan is used with */
    int64_t block_size;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t dtype;
};


/* shoal_decode_attention for the plan's sequences [seq_begin, seq_end) and kv heads
 * [kv_begin, kv_end) only (their query heads' outputs), with a scratch of
 * shoal_decode_scratch_floats floats, float32 caches, the best ISA; the plan must already
 * have passed shoal_decode_check. */
void shoal_decode_attention_range(const struct shoal_decode_plan *plan, int64_t seq_begin, int64_t seq_end,
                                  int64_t kv_begin, int64_t kv_end, char *out, int64_t out_token_stride, int64_t out_head_stride, const char *query,
                                  int64_t query_token_stride, int64_t query_head_stride, int64_t num_heads,
                                  const char *key_cache, const char *value_cache, float scale, float *scratch);
int64_t shoal_decode_scratch_floats(int64_t num_heads, int64_t head_dim);
int64_t shoal_decode_check(const struct shoal_decode_plan *plan, int64_t num_tokens, int64_t num_heads);

/* --- prefill attention (cpu_prefill_attention.c) ----------------------------------------- */

/* Query rows per item: an item is (sequence, kv head, a tile of this many query rows). */
#define SHOAL_PREFILL_QUERY_TILE 32

struct shoal_prefill_item {
    int32_t seq;
    int32_t kv_head;
    int32_t first; /* the tile's first query row, within the sequence's query rows */
    int32_t rows;
    int64_t cost;  /* query rows x positions attended (for the order items are claimed in) */
};

/* A plan's entries as sequences of num_queries[s] query rows each, from row plan->rows[s]:
 * 1 when they fit num_tokens (consecutive, every row once, float32, shoal_decode_check). */
int64_t shoal_prefill_check(const struct shoal_decode_plan *plan, const int32_t *num_queries, int64_t num_tokens,
                            int64_t num_heads);
int64_t shoal_prefill_num_items(const struct shoal_decode_plan *plan, const int32_t *num_queries);
/* Fills items (shoal_prefill_num_items of them), the most costly first. */
void shoal_prefill_items(const struct shoal_decode_plan *plan, const int32_t *num_queries,
                         struct shoal_prefill_item *items);
int64_t shoal_prefill_scratch_floats(int64_t group, int64_t head_dim);
/* One item of a checked plan, with a scratch of shoal_prefill_scratch_floats floats; isa: SHOAL_ISA_*. */
void shoal_prefill_attention_item(const struct shoal_decode_plan *plan, const int32_t *num_queries,
                                  const struct shoal_prefill_item *item, float *out, int64_t out_token_stride,
                                  const float *query, int64_t query_token_stride, int64_t num_heads,
                                  const float *key_cache, const float *value_cache, float scale, float *scratch,
                                  int isa);

/* --- write_kv (cpu_cache_ops.c) ---------------------------------------------------------- */

int64_t shoal_write_kv(const char *key, const char *value, int64_t key_token_stride, int64_t key_head_stride,
                       int64_t value_token_stride, int64_t value_head_stride, char *key_cache, char *value_cache,
                       const int64_t *slot_mapping, int64_t slot_stride, int64_t num_tokens, int64_t num_heads,
                       int64_t head_bytes, int64_t num_slots, int64_t streaming);

#endif
