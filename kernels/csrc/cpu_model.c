/* The native forward pass of a Llama-style decoder (Llama, Mistral, Qwen2) on the CPU, in
 * float32, over the paged KV cache: every layer of one batch in one call, on the library's
 * threads (cpu_threads.c), instead of ~60 torch ops per layer dispatched from Python.
 *
 * Per layer, each phase split over the threads and separated by a barrier:
 *
 *   h += delta; x = RMSNorm(h)          rows           (layer 0: h = embeddings, no add)
 *   qkv = x Wqkv^T (+ bias)              panels         one product for q, k and v
 *   rotary(q, k); write_kv(k, v)         rows
 *   attention                            row groups     with a decode plan, one entry per row
 *                                                       (shoal_decode_attention_range: a
 *                                                       decode row, or a prefill row as a
 *                                                       sequence ending at its position);
 *                                        items          with a decode plan of sequences and
 *                                                       their query counts, the tiled causal
 *                                                       attention (cpu_prefill_attention.c),
 *                                                       by (sequence, kv head, query tile);
 *                                                       otherwise the caller's callback, on
 *                                                       whichever thread claims it (torch)
 *   delta = attn Wo^T                    panels
 *   h += delta; x = RMSNorm(h)           rows
 *   act = SiLU(x Wg^T) * (x Wu^T)        panels         one product, SiLU * up fused
 *   delta = act Wd^T                     panels
 *
 * and at the end, for the rows whose logits are wanted only: h += delta, the final norm,
 * and (unless the caller does it) the lm_head product.
 *
 * The last layer's work past its K/V write matters only for those rows. When fewer rows are
 * wanted than the batch holds (a prefill wants its last row; a chunk that does not end its
 * prompt wants none) and attention runs natively, the wanted rows are gathered to the top
 * of the buffers after the K/V write, and the last layer's attention (as decode rows), its
 * products and norms run for them alone: the "tail" (about 1 / num_layers of a prefill). The arithmetic is Hugging Face's,
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
    const struct shoal_decode_plan *decode; /* one entry per row: attention here (see below) */
    int64_t decode_rows_are_sequences;     /* every entry a different sequence's only row (no prefill
                                              rows): each thread writes and attends its own rows in
                                              one phase; otherwise all K/V are written first */
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
    int64_t *argmax;   /* [num_logit_rows]: each row's most likely token (with an lm_head), or NULL */
    int64_t num_threads;
    const int32_t *prefill_num_queries; /* with decode: its entries are sequences of this many query
                                           rows each (from decode->rows[s]), attended by the tiled
                                           causal kernel after all K/V are written; NULL otherwise */
    int64_t whole_last_layer;           /* compute the last layer for every row, wanted or not (no tail:
                                           tests and benchmarks compare the two) */
};

enum phase_kind {
    PHASE_EMBED,      /* rows: embedding rows and their rotary cos/sin */
    PHASE_INPUT_NORM, /* rows: h += delta (not in layer 0); x = norm(h) */
    PHASE_QKV,        /* panels */
    PHASE_DECODE,     /* groups of plan entries: (rotary and K/V write when every row is its own
                         sequence's, then) attention of their rows */
    PHASE_ROPE_WRITE, /* rows: rotary and K/V write, when rows of one sequence attend to each other */
    PHASE_ATTEND,     /* one item: the caller's attention callback */
    PHASE_PREFILL,    /* (sequence, kv head, query tile) items: the tiled causal attention */
    PHASE_O,          /* panels */
    PHASE_POST_NORM,  /* rows */
    PHASE_GATE_UP,    /* panels */
    PHASE_DOWN,       /* panels */
    PHASE_FINAL_NORM, /* logit rows */
    PHASE_LM_HEAD,    /* panels */
    PHASE_ARGMAX,     /* logit rows */
    PHASE_GATHER,     /* one item: the logit rows' residual and query moved to rows 0 .. n-1 (the tail) */
};

#define MAX_GROUPS (4 * SHOAL_MAX_THREADS)

/* A decode plan's sequences cut into the items of a decode phase. */
struct decode_groups {
    const struct shoal_decode_plan *plan;
    int64_t num_groups;
    int64_t bounds[MAX_GROUPS + 1]; /* decode sequences of each group */
    int64_t head_parts; /* items per group: its kv heads cut in this many parts (1: whole) */
    int writes;         /* the items rotate and write their rows' K/V first (every row its own sequence's) */
};

/* The last layer's wanted rows, gathered (see the top of this file). */
struct tail {
    int active;
    struct shoal_decode_plan plan; /* entry i: logit row i's sequence up to its position, query row i */
    int32_t *memory;               /* the plan's block tables, lengths and rows */
};

struct forward_job {
    const struct shoal_model *model;
    const struct shoal_step *step;
    int isa;
    int64_t num_row_items;
    struct decode_groups decode;      /* the step's decode plan (no prefill plan) */
    struct decode_groups tail_decode; /* the tail's */
    struct tail tail;
    int64_t num_prefill_items;
    struct shoal_prefill_item *prefill_items; /* the most costly first */
    int64_t prefill_scratch_floats;
};

struct phase_context {
    const struct forward_job *job;
    int64_t layer;
    int kind;
    int64_t num_items;
    int64_t num_units; /* rows, panels or logit rows the items share */
    int64_t num_rows;  /* a product's input rows (the tail's: the logit rows) */
    const struct decode_groups *groups; /* PHASE_DECODE */
};

/* The attention's scratch of this thread, kept between calls (it only grows). */
static _Thread_local float *tls_scratch;
static _Thread_local int64_t tls_scratch_floats;

static float *get_scratch(int64_t floats) {
    if (tls_scratch_floats < floats) {
        free(tls_scratch);
        tls_scratch = malloc((size_t)floats * sizeof(float));
        tls_scratch_floats = tls_scratch == NULL ? 0 : floats;
    }
    return tls_scratch;
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

static void run_phase_item(const void *context, int64_t item) {
    const struct phase_context *c = context;
    const struct forward_job *job = c->job;
    const struct shoal_model *m = job->model;
    const struct shoal_step *s = job->step;
    const struct shoal_layer_weights *layer = c->layer >= 0 ? &m->layers[c->layer] : NULL;
    const int64_t hidden = m->hidden, d = m->head_dim;
    const int64_t qkv_stride = (m->num_heads + 2 * m->num_kv_heads) * d, attn_stride = m->num_heads * d;
    const int64_t first = c->num_units * item / c->num_items, last = c->num_units * (item + 1) / c->num_items;
    const float eps = (float)m->eps;
    const int64_t rows = c->num_rows;
    switch (c->kind) {
    case PHASE_EMBED:
        for (int64_t row = first; row < last; ++row) {
            memcpy(s->hidden + row * hidden, m->embedding + s->token_ids[row] * hidden,
                   (size_t)hidden * sizeof(float));
            shoal_rope_row(s->rope + row * d, s->positions[row], m->inv_freq, d, (float)m->rope_scaling);
        }
        break;
    case PHASE_INPUT_NORM:
    case PHASE_POST_NORM: {
        const int add = c->kind == PHASE_POST_NORM || c->layer > 0;
        const float *weight = c->kind == PHASE_POST_NORM ? layer->post_norm : layer->input_norm;
        shoal_rms_norm_rows(s->normed + first * hidden, hidden,
                            (add ? s->delta : s->hidden) + first * hidden, hidden,
                            add ? s->hidden + first * hidden : NULL, hidden, weight, last - first, hidden, eps);
        break;
    }
    case PHASE_QKV:
        shoal_gemm_panels(&layer->qkv, s->normed, hidden, s->qkv, qkv_stride, rows, first, last, job->isa);
        break;
    case PHASE_DECODE: {
        const struct decode_groups *g = c->groups;
        const int64_t group = item / g->head_parts, part = item % g->head_parts;
        const int64_t seq_begin = g->bounds[group], seq_end = g->bounds[group + 1];
        const int64_t kv_begin = m->num_kv_heads * part / g->head_parts;
        const int64_t kv_end = m->num_kv_heads * (part + 1) / g->head_parts;
        for (int64_t seq = seq_begin; seq < seq_end && g->writes; ++seq) {
            rope_and_write(m, s, layer, g->plan->rows[seq], qkv_stride);
        }
        float *scratch = get_scratch(shoal_decode_scratch_floats(m->num_heads, d));
        if (scratch == NULL) {
            abort(); /* a few KB: out of memory here is not recoverable */
        }
        shoal_decode_attention_range(g->plan, seq_begin, seq_end, kv_begin, kv_end, (char *)s->attn, attn_stride, d,
                                     (const char *)s->qkv, qkv_stride, d, m->num_heads, layer->key_cache,
                                     layer->value_cache, (float)m->scale, scratch);
        break;
    }
    case PHASE_ROPE_WRITE:
        for (int64_t row = first; row < last; ++row) {
            rope_and_write(m, s, layer, row, qkv_stride);
        }
        break;
    case PHASE_ATTEND:
        s->attend(c->layer);
        break;
    case PHASE_PREFILL: {
        float *scratch = get_scratch(job->prefill_scratch_floats);
        if (scratch == NULL) {
            abort(); /* tens of KB: out of memory here is not recoverable */
        }
        shoal_prefill_attention_item(s->decode, s->prefill_num_queries, &job->prefill_items[item], s->attn,
                                     attn_stride, s->qkv, qkv_stride, m->num_heads,
                                     (const float *)layer->key_cache, (const float *)layer->value_cache,
                                     (float)m->scale, scratch, job->isa);
        break;
    }
    case PHASE_O:
        shoal_gemm_panels(&layer->o, s->attn, attn_stride, s->delta, hidden, rows, first, last, job->isa);
        break;
    case PHASE_GATE_UP:
        shoal_gemm_panels(&layer->gate_up, s->normed, hidden, s->act, m->intermediate, rows, first, last, job->isa);
        break;
    case PHASE_DOWN:
        shoal_gemm_panels(&layer->down, s->act, m->intermediate, s->delta, hidden, rows, first, last, job->isa);
        break;
    case PHASE_GATHER:
        /* Ascending rows, each moved up or left in place, by one thread: no row is overwritten
         * before it is read. Only the query of qkv is read after this. */
        for (int64_t i = 0; i < s->num_logit_rows; ++i) {
            const int64_t row = s->logit_rows[i];
            if (row != i) {
                memcpy(s->hidden + i * hidden, s->hidden + row * hidden, (size_t)hidden * sizeof(float));
                memcpy(s->qkv + i * qkv_stride, s->qkv + row * qkv_stride, (size_t)attn_stride * sizeof(float));
            }
        }
        break;
    case PHASE_FINAL_NORM:
        for (int64_t i = first; i < last; ++i) {
            const int64_t row = job->tail.active ? i : s->logit_rows[i];
            shoal_rms_norm_rows(s->final_rows + i * hidden, hidden, s->delta + row * hidden, hidden,
                                s->hidden + row * hidden, hidden, m->final_norm, 1, hidden, eps);
        }
        break;
    case PHASE_ARGMAX:
        for (int64_t i = first; i < last; ++i) {
            s->argmax[i] = shoal_argmax(s->logits + i * m->vocab, m->vocab);
        }
        break;
    case PHASE_LM_HEAD:
        shoal_gemm_panels(m->lm_head, s->final_rows, hidden, s->logits, m->vocab, rows, first, last, job->isa);
        break;
    default:
        break;
    }
}

/* Items of a product's phase: groups of panels of about PRODUCT_ITEM_MACS multiply-adds, so
 * that claiming one costs little next to running it, and a thread streams a run of panels. */
#define PRODUCT_ITEM_MACS 200000

static int64_t product_items(const struct shoal_linear *w, int64_t num_rows) {
    const int64_t panels = shoal_num_panels(w);
    const int64_t per_panel = num_rows * w->num_in * SHOAL_PANEL;
    if (per_panel <= 0) {
        return 0;
    }
    const int64_t per_item = (PRODUCT_ITEM_MACS + per_panel - 1) / per_panel;
    return (panels + per_item - 1) / per_item;
}

static struct phase_context *add_phase(struct shoal_phase *phases, struct phase_context *contexts, int64_t *count,
                                       const struct forward_job *job, int64_t layer, int kind, int64_t num_items,
                                       int64_t num_units) {
    if (num_items <= 0) {
        return NULL;
    }
    struct phase_context *c = &contexts[*count];
    c->job = job;
    c->layer = layer;
    c->kind = kind;
    c->num_items = num_items;
    c->num_units = num_units;
    c->num_rows = 0;
    c->groups = NULL;
    phases[*count] = (struct shoal_phase){run_phase_item, c, num_items};
    ++*count;
    return c;
}

/* A product over num_rows rows of its input: items of runs of panels (product_items). */
static void add_product_phase(struct shoal_phase *phases, struct phase_context *contexts, int64_t *count,
                              const struct forward_job *job, int64_t layer, int kind, const struct shoal_linear *w,
                              int64_t num_rows) {
    struct phase_context *c =
        add_phase(phases, contexts, count, job, layer, kind, product_items(w, num_rows), shoal_num_panels(w));
    if (c != NULL) {
        c->num_rows = num_rows;
    }
}

static void add_decode_phase(struct shoal_phase *phases, struct phase_context *contexts, int64_t *count,
                             const struct forward_job *job, int64_t layer, const struct decode_groups *groups) {
    const int64_t items = groups->num_groups * groups->head_parts;
    struct phase_context *c = add_phase(phases, contexts, count, job, layer, PHASE_DECODE, items, items);
    if (c != NULL) {
        c->groups = groups;
    }
}

/* Groups of decode sequences of about equal total context (contiguous runs). */
static int64_t group_sequences(const struct shoal_decode_plan *plan, int64_t num_groups, int64_t *bounds) {
    if (num_groups > plan->num_seqs) {
        num_groups = plan->num_seqs;
    }
    int64_t total = 0;
    for (int64_t seq = 0; seq < plan->num_seqs; ++seq) {
        total += plan->seq_lens[seq];
    }
    int64_t seq = 0, done = 0, count = 0;
    bounds[0] = 0;
    for (int64_t group = 1; group < num_groups; ++group) {
        const int64_t target = total * group / num_groups;
        while (seq < plan->num_seqs && done + plan->seq_lens[seq] / 2 < target) {
            done += plan->seq_lens[seq++];
        }
        if (seq > bounds[count]) {
            bounds[++count] = seq;
        }
    }
    if (plan->num_seqs > bounds[count]) {
        bounds[++count] = plan->num_seqs;
    }
    return count;
}

static void plan_groups(struct decode_groups *g, const struct shoal_decode_plan *plan, int num_threads,
                        int64_t num_kv_heads, int writes) {
    g->plan = plan;
    g->num_groups = group_sequences(plan, num_threads == 1 ? 1 : 4 * num_threads, g->bounds);
    g->head_parts = 1;
    if (g->num_groups < num_threads) {
        /* Fewer sequences than threads (one user's long chat): their kv heads are split too,
         * so that every thread streams its part of the cache. */
        g->head_parts = num_kv_heads < num_threads ? num_kv_heads : num_threads;
    }
    g->writes = writes && g->head_parts == 1;
}

/* The tail's decode plan (struct tail): logit row i attends, as decode row i, to its
 * sequence's context up to its own position. Inactive when every row is wanted, when the
 * rows are not ascending, when attention is the caller's, or when a row has no plan entry.
 * Returns 0, or FORWARD_NO_MEMORY. */
static int64_t plan_tail(struct tail *t, const struct shoal_model *m, const struct shoal_step *s) {
    t->active = 0;
    t->memory = NULL;
    const struct shoal_decode_plan *plan = s->decode;
    const int64_t n = s->num_logit_rows;
    if (plan == NULL || n >= s->num_tokens || s->whole_last_layer ||
        (s->prefill_num_queries == NULL && s->decode_rows_are_sequences)) {
        return 0;
    }
    for (int64_t i = 1; i < n; ++i) {
        if (s->logit_rows[i] <= s->logit_rows[i - 1]) {
            return 0;
        }
    }
    const int64_t stride = plan->table_stride;
    t->memory = malloc((size_t)(n * stride + 2 * n + 1) * sizeof(int32_t));
    if (t->memory == NULL) {
        return FORWARD_NO_MEMORY;
    }
    int32_t *tables = t->memory, *lens = tables + n * stride, *rows = lens + n;
    int64_t i = 0, entry = 0;
    for (; i < n; ++i) {
        const int64_t row = s->logit_rows[i];
        int64_t seq_len;
        if (s->prefill_num_queries != NULL) { /* entries: sequences of consecutive query rows */
            while (entry < plan->num_seqs && plan->rows[entry] + s->prefill_num_queries[entry] <= row) {
                ++entry;
            }
            if (entry == plan->num_seqs || plan->rows[entry] > row) {
                break;
            }
            seq_len = plan->seq_lens[entry] - (plan->rows[entry] + s->prefill_num_queries[entry] - 1 - row);
        } else { /* entries: one per row, in any order (ascending: one pass over them) */
            int64_t tried = 0;
            while (tried < plan->num_seqs && plan->rows[entry] != row) {
                entry = entry + 1 == plan->num_seqs ? 0 : entry + 1;
                ++tried;
            }
            if (tried == plan->num_seqs) {
                break;
            }
            seq_len = plan->seq_lens[entry];
        }
        memcpy(tables + i * stride, plan->block_tables + entry * stride, (size_t)stride * sizeof(int32_t));
        lens[i] = (int32_t)seq_len;
        rows[i] = (int32_t)i;
    }
    t->plan = *plan;
    t->plan.num_seqs = n;
    t->plan.block_tables = tables;
    t->plan.seq_lens = lens;
    t->plan.rows = rows;
    t->active = i == n && (n == 0 || shoal_decode_check(&t->plan, n, m->num_heads) == -1);
    if (!t->active) {
        free(t->memory);
        t->memory = NULL;
    }
    return 0;
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
    if (s->decode != NULL && s->prefill_num_queries != NULL) {
        if (s->decode->num_kv_heads != m->num_kv_heads || s->decode->head_dim != m->head_dim ||
            s->decode->num_blocks * s->decode->block_size != m->num_slots ||
            !shoal_prefill_check(s->decode, s->prefill_num_queries, s->num_tokens, m->num_heads)) {
            return FORWARD_BAD_DECODE_PLAN;
        }
    } else if (s->decode != NULL) {
        if (s->decode->num_seqs != s->num_tokens || s->decode->num_kv_heads != m->num_kv_heads ||
            s->decode->head_dim != m->head_dim || s->decode->dtype != 0 ||
            s->decode->num_blocks * s->decode->block_size != m->num_slots ||
            shoal_decode_check(s->decode, s->num_tokens, m->num_heads) != -1) {
            return FORWARD_BAD_DECODE_PLAN;
        }
    }
    return FORWARD_OK;
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
    const int64_t num_phases = model->num_layers * 9 + 5;
    if (num_phases > SHOAL_MAX_PHASES) {
        return FORWARD_BAD_GEOMETRY;
    }
    struct forward_job job;
    job.model = model;
    job.step = step;
    job.isa = shoal_gemm_best_isa();
    const int64_t rows = step->num_tokens;
    job.num_row_items = rows < 4 * num_threads ? rows : 4 * num_threads;
    job.num_prefill_items = 0;
    job.prefill_items = NULL;
    job.prefill_scratch_floats = 0;
    const int prefill = step->decode != NULL && step->prefill_num_queries != NULL;
    if (plan_tail(&job.tail, model, step) != 0) {
        return FORWARD_NO_MEMORY;
    }
    if (prefill) {
        job.num_prefill_items = shoal_prefill_num_items(step->decode, step->prefill_num_queries);
        if (job.num_prefill_items > (1 << 20) - 1) {
            free(job.tail.memory);
            return FORWARD_BAD_GEOMETRY;
        }
        job.prefill_items = malloc((size_t)job.num_prefill_items * sizeof *job.prefill_items);
        if (job.prefill_items == NULL) {
            free(job.tail.memory);
            return FORWARD_NO_MEMORY;
        }
        shoal_prefill_items(step->decode, step->prefill_num_queries, job.prefill_items);
        job.prefill_scratch_floats =
            shoal_prefill_scratch_floats(model->num_heads / model->num_kv_heads, model->head_dim);
    } else if (step->decode != NULL) {
        plan_groups(&job.decode, step->decode, num_threads, model->num_kv_heads, (int)step->decode_rows_are_sequences);
    }
    if (job.tail.active) {
        plan_groups(&job.tail_decode, &job.tail.plan, num_threads, model->num_kv_heads, 0);
    }
    struct shoal_phase *phases = malloc((size_t)num_phases * sizeof *phases);
    struct phase_context *contexts = malloc((size_t)num_phases * sizeof *contexts);
    if (phases == NULL || contexts == NULL) {
        free(phases);
        free(contexts);
        free(job.prefill_items);
        free(job.tail.memory);
        return FORWARD_NO_MEMORY;
    }
    const int64_t row_items = job.num_row_items;
    const int64_t logit_rows = step->num_logit_rows;
    const int64_t logit_row_items = logit_rows < 4 * num_threads ? logit_rows : 4 * num_threads;
    int64_t count = 0;
    add_phase(phases, contexts, &count, &job, -1, PHASE_EMBED, row_items, rows);
    for (int64_t layer = 0; layer < model->num_layers; ++layer) {
        const struct shoal_layer_weights *w = &model->layers[layer];
        const int tail = job.tail.active && layer == model->num_layers - 1;
        add_phase(phases, contexts, &count, &job, layer, PHASE_INPUT_NORM, row_items, rows);
        add_product_phase(phases, contexts, &count, &job, layer, PHASE_QKV, &w->qkv, rows);
        if (tail) {
            add_phase(phases, contexts, &count, &job, layer, PHASE_ROPE_WRITE, row_items, rows);
            add_phase(phases, contexts, &count, &job, layer, PHASE_GATHER, 1, 1);
            add_decode_phase(phases, contexts, &count, &job, layer, &job.tail_decode);
        } else if (prefill) {
            add_phase(phases, contexts, &count, &job, layer, PHASE_ROPE_WRITE, row_items, rows);
            add_phase(phases, contexts, &count, &job, layer, PHASE_PREFILL, job.num_prefill_items,
                      job.num_prefill_items);
        } else if (step->decode != NULL) {
            /* A row may attend to K/V another thread writes, or a row's heads be split: write first. */
            if (!job.decode.writes) {
                add_phase(phases, contexts, &count, &job, layer, PHASE_ROPE_WRITE, row_items, rows);
            }
            add_decode_phase(phases, contexts, &count, &job, layer, &job.decode);
        } else {
            add_phase(phases, contexts, &count, &job, layer, PHASE_ROPE_WRITE, row_items, rows);
            add_phase(phases, contexts, &count, &job, layer, PHASE_ATTEND, 1, 1);
        }
        const int64_t out_rows = tail ? logit_rows : rows;
        add_product_phase(phases, contexts, &count, &job, layer, PHASE_O, &w->o, out_rows);
        add_phase(phases, contexts, &count, &job, layer, PHASE_POST_NORM, tail ? logit_row_items : row_items, out_rows);
        add_product_phase(phases, contexts, &count, &job, layer, PHASE_GATE_UP, &w->gate_up, out_rows);
        add_product_phase(phases, contexts, &count, &job, layer, PHASE_DOWN, &w->down, out_rows);
    }
    add_phase(phases, contexts, &count, &job, -1, PHASE_FINAL_NORM, logit_row_items, logit_rows);
    if (model->lm_head != NULL) {
        add_product_phase(phases, contexts, &count, &job, -1, PHASE_LM_HEAD, model->lm_head, logit_rows);
        if (step->argmax != NULL) {
            add_phase(phases, contexts, &count, &job, -1, PHASE_ARGMAX, logit_row_items, logit_rows);
        }
    }
    const int status = shoal_run_phases(phases, count, num_threads);
    free(phases);
    free(contexts);
    free(job.prefill_items);
    free(job.tail.memory);
    return status == 0 ? FORWARD_OK : FORWARD_BAD_GEOMETRY;
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
    int64_t num_items;
};

static void gemm_item(const void *context, int64_t item) {
    const struct gemm_job *job = context;
    const int64_t panels = shoal_num_panels(job->w);
    shoal_gemm_panels(job->w, job->x, job->x_stride, job->y, job->y_stride, job->num_rows,
                      panels * item / job->num_items, panels * (item + 1) / job->num_items, job->isa);
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
    struct gemm_job job = {w, x, x_stride, y, y_stride, num_rows, (int)isa, product_items(w, num_rows)};
    if (num_threads > 1 && job.num_items < num_threads) { /* small: still one item per thread */
        const int64_t panels = shoal_num_panels(w);
        job.num_items = panels < num_threads ? panels : num_threads;
    }
    const struct shoal_phase phase = {gemm_item, &job, job.num_items};
    shoal_run_phases(&phase, 1, (int)num_threads);
    return -1;
}

int64_t shoal_gemm_isa(void) { return shoal_gemm_best_isa(); }
