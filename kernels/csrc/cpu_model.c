/* The native forward pass of a Llama-style decoder (Llama, Mistral, Qwen2) on the CPU, in
 * float32, over the paged KV cache: every layer of one batch in one call, on the library's
 * threads (cpu_threads.c), instead of ~60 torch ops per layer dispatched from Python.
 *
 * Per layer, each phase split over the threads and separated by a barrier:
 *
 *   h += delta; x = RMSNorm(h)          rows           (layer 0: h = embeddings, no add)
 *   qkv = x Wqkv^T (+ bias)              panels         one product for q, k and v
 *   rotary(q, k); write_kv(k, v)         rows / seqs    then attention: decode rows here
 *   attention                            seqs           (shoal_decode_attention_range);
 *                                                       any other batch: the caller's
 *                                                       callback, on thread 0 (torch)
 *   delta = attn Wo^T                    panels
 *   h += delta; x = RMSNorm(h)           rows
 *   act = SiLU(x Wg^T) * (x Wu^T)        panels         one product, SiLU * up fused
 *   delta = act Wd^T                     panels
 *
 * and at the end, for the rows whose logits are wanted only: h += delta, the final norm,
 * and (unless the caller does it) the lm_head product. The arithmetic is Hugging Face's,
 * in float32; sums over k run in another order than MKL's (docs/engine.md).
 *
 * Everything that decides where memory is read or written is checked before anything
 * runs (token ids, positions, slots, logit rows, the decode plan).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_model.h"

/* Bytes of K/V written by one layer from which write_kv uses streaming stores (as
 * kernels/cpu_kernels.py's STREAM_MIN_BYTES). */
#define STREAM_MIN_BYTES (1024 * 1024)

enum {
    FORWARD_OK = -1,
    FORWARD_BAD_TOKEN = -2,
    FORWARD_BAD_POSITION = -3,
    FORWARD_BAD_SLOT = -4,
    FORWARD_BAD_DECODE_PLAN = -5,
    FORWARD_BAD_LOGIT_ROW = -6,
    FORWARD_NO_MEMORY = -7,
    FORWARD_BAD_GEOMETRY = -8,
};

struct shoal_layer_weights {
    const float *input_norm; /* [hidden] */
    const float *post_norm;  /* [hidden] */
    struct shoal_linear qkv; /* [q + 2 kv] outputs */
    struct shoal_linear o;
    struct shoal_linear gate_up; /* SILU_MUL: 2 x intermediate */
    struct shoal_linear down;
    char *key_cache; /* [num_slots, num_kv_heads, head_dim] float32 */
    char *value_cache;
};

struct shoal_model {
    int64_t num_layers;
    int64_t hidden;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t intermediate;
    int64_t vocab;
    double eps;
    double scale; /* attention's softmax scale */
    const float *embedding; /* [vocab, hidden] */
    const float *final_norm;
    const struct shoal_linear *lm_head; /* NULL: the caller computes the logits from final_rows */
    const float *inv_freq; /* [head_dim / 2]: the rotary frequencies (transformers' rotary_emb.inv_freq) */
    double rope_scaling;   /* its attention_scaling (1 for most rotary types) */
    int64_t num_slots;
    const struct shoal_layer_weights *layers;
};

typedef void (*shoal_attend_fn)(int64_t layer);

struct shoal_step {
    int64_t num_tokens;
    const int64_t *token_ids;
    const int64_t *positions;
    const int64_t *slot_mapping;
    const struct shoal_decode_plan *decode; /* every row a decode row: attention here */
    shoal_attend_fn attend;                 /* otherwise, per layer, on thread 0 */
    int64_t num_logit_rows;
    const int64_t *logit_rows;
    float *rope;       /* [num_tokens, head_dim]: each row's cos (half) then sin (half) */
    float *hidden;     /* [num_tokens, hidden] */
    float *delta;      /* [num_tokens, hidden] */
    float *normed;     /* [num_tokens, hidden] */
    float *qkv;        /* [num_tokens, (heads + 2 kv_heads) head_dim] */
    float *attn;       /* [num_tokens, heads head_dim] */
    float *act;        /* [num_tokens, intermediate] */
    float *final_rows; /* [num_logit_rows, hidden] */
    float *logits;     /* [num_logit_rows, vocab] when the model has an lm_head */
    int64_t num_threads;
};

struct forward_job {
    const struct shoal_model *model;
    const struct shoal_step *step;
    float *scratch; /* per thread: shoal_decode_scratch_floats */
    int64_t scratch_floats;
    int isa;
    int64_t seq_bounds[SHOAL_MAX_THREADS + 1]; /* decode sequences of each thread */
};

static void split(int64_t count, int thread, int num_threads, int64_t *begin, int64_t *end) {
    *begin = count * thread / num_threads;
    *end = count * (thread + 1) / num_threads;
}

static void gemm_share(const struct shoal_linear *w, const float *x, int64_t x_stride, float *y, int64_t y_stride,
                       int64_t num_rows, int thread, int num_threads, int isa) {
    int64_t begin, end;
    split(shoal_num_panels(w), thread, num_threads, &begin, &end);
    if (begin < end) {
        shoal_gemm_panels(w, x, x_stride, y, y_stride, num_rows, begin, end, isa);
    }
}

/* Rotary on a row's q and k heads, then its k and v into the layer's cache. */
static void rope_and_write(const struct shoal_model *m, const struct shoal_step *s,
                           const struct shoal_layer_weights *layer, int64_t row, int64_t qkv_stride) {
    const int64_t d = m->head_dim, q_width = m->num_heads * d, kv_width = m->num_kv_heads * d;
    float *q = s->qkv + row * qkv_stride;
    const float *c = s->rope + row * d, *sn = c + d / 2;
    shoal_rotary_row(q, m->num_heads, d, d, c, sn);
    shoal_rotary_row(q + q_width, m->num_kv_heads, d, d, c, sn);
    const int64_t bytes = 2 * s->num_tokens * kv_width * (int64_t)sizeof(float);
    shoal_write_kv((const char *)(q + q_width), (const char *)(q + q_width + kv_width), 0, d * 4, 0, d * 4,
                   layer->key_cache, layer->value_cache, s->slot_mapping + row, 1, 1, m->num_kv_heads, d * 4,
                   m->num_slots, bytes >= STREAM_MIN_BYTES);
}

static void forward_thread(void *arg, int thread, int num_threads) {
    struct forward_job *job = arg;
    const struct shoal_model *m = job->model;
    const struct shoal_step *s = job->step;
    const int64_t hidden = m->hidden, d = m->head_dim;
    const int64_t qkv_stride = (m->num_heads + 2 * m->num_kv_heads) * d, attn_stride = m->num_heads * d;
    const int64_t num_tokens = s->num_tokens;
    int64_t row_begin, row_end;
    split(num_tokens, thread, num_threads, &row_begin, &row_end);
    const float eps = (float)m->eps;

    for (int64_t row = row_begin; row < row_end; ++row) {
        memcpy(s->hidden + row * hidden, m->embedding + s->token_ids[row] * hidden, (size_t)hidden * sizeof(float));
        shoal_rope_row(s->rope + row * d, s->positions[row], m->inv_freq, d, (float)m->rope_scaling);
    }
    shoal_job_barrier();
    for (int64_t index = 0; index < m->num_layers; ++index) {
        const struct shoal_layer_weights *layer = &m->layers[index];
        /* x = norm(h), after h += the previous layer's MLP output */
        if (index == 0) {
            shoal_rms_norm_rows(s->normed + row_begin * hidden, hidden, s->hidden + row_begin * hidden, hidden,
                                NULL, 0, layer->input_norm, row_end - row_begin, hidden, eps);
        } else {
            shoal_rms_norm_rows(s->normed + row_begin * hidden, hidden, s->delta + row_begin * hidden, hidden,
                                s->hidden + row_begin * hidden, hidden, layer->input_norm, row_end - row_begin,
                                hidden, eps);
        }
        shoal_job_barrier();
        gemm_share(&layer->qkv, s->normed, hidden, s->qkv, qkv_stride, num_tokens, thread, num_threads, job->isa);
        shoal_job_barrier();
        if (s->decode != NULL) { /* each thread: its sequences' rows, then their attention */
            const int64_t first = job->seq_bounds[thread], last = job->seq_bounds[thread + 1];
            for (int64_t seq = first; seq < last; ++seq) {
                rope_and_write(m, s, layer, s->decode->rows[seq], qkv_stride);
            }
            if (first < last) {
                shoal_decode_attention_range(s->decode, first, last, (char *)s->attn, attn_stride, d,
                                             (const char *)s->qkv, qkv_stride, d, m->num_heads, layer->key_cache,
                                             layer->value_cache, (float)m->scale,
                                             job->scratch + thread * job->scratch_floats);
            }
        } else {
            for (int64_t row = row_begin; row < row_end; ++row) {
                rope_and_write(m, s, layer, row, qkv_stride);
            }
            shoal_job_barrier();
            if (thread == 0) {
                s->attend(index);
            }
        }
        shoal_job_barrier();
        gemm_share(&layer->o, s->attn, attn_stride, s->delta, hidden, num_tokens, thread, num_threads, job->isa);
        shoal_job_barrier();
        shoal_rms_norm_rows(s->normed + row_begin * hidden, hidden, s->delta + row_begin * hidden, hidden,
                            s->hidden + row_begin * hidden, hidden, layer->post_norm, row_end - row_begin, hidden,
                            eps);
        shoal_job_barrier();
        gemm_share(&layer->gate_up, s->normed, hidden, s->act, m->intermediate, num_tokens, thread, num_threads,
                   job->isa);
        shoal_job_barrier();
        gemm_share(&layer->down, s->act, m->intermediate, s->delta, hidden, num_tokens, thread, num_threads,
                   job->isa);
        shoal_job_barrier();
    }
    int64_t logit_begin, logit_end;
    split(s->num_logit_rows, thread, num_threads, &logit_begin, &logit_end);
    for (int64_t i = logit_begin; i < logit_end; ++i) {
        const int64_t row = s->logit_rows[i];
        shoal_rms_norm_rows(s->final_rows + i * hidden, hidden, s->delta + row * hidden, hidden,
                            s->hidden + row * hidden, hidden, m->final_norm, 1, hidden, eps);
    }
    if (m->lm_head != NULL) {
        shoal_job_barrier();
        gemm_share(m->lm_head, s->final_rows, hidden, s->logits, m->vocab, s->num_logit_rows, thread, num_threads,
                   job->isa);
    }
}

static int64_t check_step(const struct shoal_model *m, const struct shoal_step *s) {
    if (s->num_tokens < 1 || m->head_dim % 2 || (s->decode == NULL && s->attend == NULL)) {
        return FORWARD_BAD_GEOMETRY;
    }
    for (int64_t row = 0; row < s->num_tokens; ++row) {
        if (s->token_ids[row] < 0 || s->token_ids[row] >= m->vocab) {
            return FORWARD_BAD_TOKEN;
        }
        if (s->positions[row] < 0) {
            return FORWARD_BAD_POSITION;
        }
        if (s->slot_mapping[row] < 0 || s->slot_mapping[row] >= m->num_slots) {
            return FORWARD_BAD_SLOT;
        }
    }
    for (int64_t i = 0; i < s->num_logit_rows; ++i) {
        if (s->logit_rows[i] < 0 || s->logit_rows[i] >= s->num_tokens) {
            return FORWARD_BAD_LOGIT_ROW;
        }
    }
    if (s->decode != NULL) {
        if (s->decode->num_seqs != s->num_tokens || s->decode->num_kv_heads != m->num_kv_heads ||
            s->decode->head_dim != m->head_dim || s->decode->dtype != 0 ||
            s->decode->num_blocks * s->decode->block_size != m->num_slots ||
            shoal_decode_check(s->decode, s->num_tokens, m->num_heads) != -1) {
            return FORWARD_BAD_DECODE_PLAN;
        }
    }
    return FORWARD_OK;
}

/* The sequences of each thread: contiguous ranges of about equal total context. */
static void split_sequences(const struct shoal_decode_plan *plan, int num_threads, int64_t *bounds) {
    int64_t total = 0;
    for (int64_t seq = 0; seq < plan->num_seqs; ++seq) {
        total += plan->seq_lens[seq];
    }
    int64_t seq = 0, done = 0;
    bounds[0] = 0;
    for (int thread = 1; thread < num_threads; ++thread) {
        const int64_t target = total * thread / num_threads;
        while (seq < plan->num_seqs && done + plan->seq_lens[seq] / 2 < target) {
            done += plan->seq_lens[seq++];
        }
        bounds[thread] = seq;
    }
    bounds[num_threads] = plan->num_seqs;
}

/* Runs the model over one batch (see the top of this file). Returns -1, or a negative code
 * (FORWARD_*) with nothing written when the batch is refused. */
int64_t shoal_model_forward(const struct shoal_model *model, const struct shoal_step *step) {
    const int64_t checked = check_step(model, step);
    if (checked != FORWARD_OK) {
        return checked;
    }
    int num_threads = step->num_threads < 1 ? 1 : (int)step->num_threads;
    if (num_threads > SHOAL_MAX_THREADS) {
        num_threads = SHOAL_MAX_THREADS;
    }
    struct forward_job job;
    job.model = model;
    job.step = step;
    job.isa = shoal_gemm_best_isa();
    job.scratch = NULL;
    job.scratch_floats = 0;
    if (step->decode != NULL) {
        job.scratch_floats = shoal_decode_scratch_floats(model->num_heads, model->head_dim);
        job.scratch = malloc((size_t)(job.scratch_floats * num_threads) * sizeof(float));
        if (job.scratch == NULL) {
            return FORWARD_NO_MEMORY;
        }
        split_sequences(step->decode, num_threads, job.seq_bounds);
    }
    shoal_run_job(forward_thread, &job, num_threads);
    free(job.scratch);
    return FORWARD_OK;
}

/* --- products alone (tests and benchmarks) ------------------------------------------------- */

struct gemm_job {
    const struct shoal_linear *w;
    const float *x;
    int64_t x_stride;
    float *y;
    int64_t y_stride;
    int64_t num_rows;
    int isa;
};

static void gemm_thread(void *arg, int thread, int num_threads) {
    const struct gemm_job *job = arg;
    gemm_share(job->w, job->x, job->x_stride, job->y, job->y_stride, job->num_rows, thread, num_threads, job->isa);
}

/* y = x W^T with a packed weight, on num_threads threads; isa: SHOAL_ISA_* or -1 for the best.
 * Returns -1, or -4 when the requested code path is not available. */
int64_t shoal_linear_forward(const struct shoal_linear *w, const float *x, int64_t x_stride, float *y,
                             int64_t y_stride, int64_t num_rows, int64_t num_threads, int64_t isa) {
    const int best = shoal_gemm_best_isa();
    if (isa < 0) {
        isa = best;
    } else if (isa > best) {
        return -4;
    }
    struct gemm_job job = {w, x, x_stride, y, y_stride, num_rows, (int)isa};
    shoal_run_job(gemm_thread, &job, (int)num_threads);
    return -1;
}

int64_t shoal_gemm_isa(void) { return shoal_gemm_best_isa(); }
