/* write_kv for the CPU path: the native half of kernels/cpu.py.
 *
 * Plain C11 with no torch or Python headers, so that kernels/cpu_native.py
 * builds it in a fraction of a second with the system compiler on first use and
 * loads it with ctypes. Built without -march: the cached library may move to
 * another machine, so only the baseline ISA is used (SSE2 on x86-64, memcpy
 * elsewhere). The layout and the contract are in kernels/ops.py and
 * docs/kernels.md; here a layer's key or value cache is num_slots contiguous
 * rows of num_heads * head_bytes bytes, and values are only moved, never looked
 * at (any element size).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_model.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define SHOAL_X86_64 1
#else
#define SHOAL_X86_64 0
#endif

/* How many tokens ahead destination rows are prefetched (see prefetch_row). */
#define STREAMING_PREFETCH_DISTANCE 8
#define CACHED_PREFETCH_DISTANCE 2

/* Bumped whenever shoal_write_kv's signature changes; the loader checks it. */
int64_t shoal_cpu_kernels_abi(void) { return 6; }

/* Whether this build has streaming stores (x86-64); elsewhere every copy is memcpy. */
int64_t shoal_cpu_kernels_streaming(void) { return SHOAL_X86_64; }

#if SHOAL_X86_64
/* Ordinary stores, 64 bytes per step. Not memcpy: glibc's memcpy of a 1-8 KB row
 * ran at half this loop's speed into scattered uncached rows on the EPYC
 * development machine. */
static void copy_cached(char *dst, const char *src, size_t num_bytes) {
    for (; num_bytes >= 64; num_bytes -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_storeu_si128((__m128i *)dst, a);
        _mm_storeu_si128((__m128i *)(dst + 16), b);
        _mm_storeu_si128((__m128i *)(dst + 32), c);
        _mm_storeu_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, num_bytes);
}

/* Non-temporal stores: a line written whole this way goes to memory without being
 * read first (an ordinary store to an uncached line reads it, read-for-ownership:
 * a third of a scattered write's memory traffic) and leaves the cache. Bytes
 * before dst's first 16-byte boundary and after its last go through memcpy. */
static void copy_streaming(char *dst, const char *src, size_t num_bytes) {
    size_t head = (size_t)(-(uintptr_t)dst & 15u);
    if (head > num_bytes) {
        head = num_bytes;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    num_bytes -= head;
    for (; num_bytes >= 64; num_bytes -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    for (; num_bytes >= 16; num_bytes -= 16, dst += 16, src += 16) {
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    }
    memcpy(dst, src, num_bytes);
}

/* Prefetches a destination row some tokens ahead. Streaming: its first line only,
 * because a scattered row's page translation is usually not in the TLB, and the
 * page walk then overlaps the copies in between (10-30% faster measured). Ordinary
 * stores: every line, into L2 (L1 is too small for rows several tokens ahead), so
 * that they are read for ownership while the rows before are copied (20-30% faster
 * for a decode step's rows in L3). */
static void prefetch_row(const char *row, int64_t row_bytes, int streaming) {
    if (streaming) {
        _mm_prefetch(row, _MM_HINT_T0);
        return;
    }
    for (int64_t offset = 0; offset < row_bytes; offset += 64) {
        _mm_prefetch(row + offset, _MM_HINT_T1);
    }
}
#endif

static void copy_chunk(char *dst, const char *src, size_t num_bytes, int streaming) {
#if SHOAL_X86_64
    if (streaming) {
        copy_streaming(dst, src, num_bytes);
    } else {
        copy_cached(dst, src, num_bytes);
    }
#else
    (void)streaming;
    memcpy(dst, src, num_bytes);
#endif
}

/* One token's row (num_heads chunks of head_bytes, head_stride bytes apart in src)
 * into a contiguous cache row. */
static void copy_row(char *dst, const char *src, int64_t num_heads, int64_t head_stride, int64_t head_bytes,
                     int streaming) {
    if (head_stride == head_bytes || num_heads == 1) { /* the source row is contiguous too */
        copy_chunk(dst, src, (size_t)(num_heads * head_bytes), streaming);
        return;
    }
    for (int64_t head = 0; head < num_heads; ++head) {
        copy_chunk(dst + head * head_bytes, src + head * head_stride, (size_t)head_bytes, streaming);
    }
}

/* key_cache[slot_mapping[i]] = key[i] and value_cache[slot_mapping[i]] = value[i]
 * for every token i whose slot is not negative (padding).
 *
 * key and value are [num_tokens, num_heads, head_bytes] with any token and head
 * strides (in bytes); the caches are num_slots contiguous rows of
 * num_heads * head_bytes bytes; slot_mapping is num_tokens int64 values,
 * slot_stride elements apart. streaming: non-temporal stores (on x86-64; for
 * writes too large to stay in the cache), else ordinary ones.
 *
 * Returns -1, or the first token whose slot is >= num_slots, in which case
 * nothing was written. */
int64_t shoal_write_kv(const char *key, const char *value, int64_t key_token_stride, int64_t key_head_stride,
                       int64_t value_token_stride, int64_t value_head_stride, char *key_cache,
                       char *value_cache, const int64_t *slot_mapping, int64_t slot_stride,
                       int64_t num_tokens, int64_t num_heads, int64_t head_bytes, int64_t num_slots,
                       int64_t streaming) {
    for (int64_t token = 0; token < num_tokens; ++token) {
        if (slot_mapping[token * slot_stride] >= num_slots) {
            return token;
        }
    }
    const int64_t row_bytes = num_heads * head_bytes;
#if SHOAL_X86_64
    const int64_t prefetch_distance = streaming ? STREAMING_PREFETCH_DISTANCE : CACHED_PREFETCH_DISTANCE;
#endif
    for (int64_t token = 0; token < num_tokens; ++token) {
        const int64_t slot = slot_mapping[token * slot_stride];
#if SHOAL_X86_64
        if (token + prefetch_distance < num_tokens) {
            const int64_t ahead = slot_mapping[(token + prefetch_distance) * slot_stride];
            if (ahead >= 0) {
                prefetch_row(key_cache + ahead * row_bytes, row_bytes, (int)streaming);
                prefetch_row(value_cache + ahead * row_bytes, row_bytes, (int)streaming);
            }
        }
#endif
        if (slot < 0) {
            continue;
        }
        copy_row(key_cache + slot * row_bytes, key + token * key_token_stride, num_heads, key_head_stride,
                 head_bytes, (int)streaming);
        copy_row(value_cache + slot * row_bytes, value + token * value_token_stride, num_heads,
                 value_head_stride, head_bytes, (int)streaming);
    }
#if SHOAL_X86_64
    if (streaming) {
        _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
    }
#endif
    return -1;
}

/* swap_blocks (and copy_blocks) on the CPU: for every (src, dst) pair of block_mapping and
 * every plane (layer x key/value), the block's bytes from the source pool into the
 * destination pool, in one pass and no temporary, the planes shared among num_threads
 * threads. A plane of a pool is num_blocks blocks of block_bytes bytes, plane_stride bytes
 * from the next plane's start. pairs: num_pairs (src, dst) int64 pairs. streaming:
 * non-temporal stores (a large move: the destination is not read soon after).
 *
 * Returns -1, or the first pair with a block id outside its pool (nothing copied then). */
struct copy_job {
    const char *src;
    char *dst;
    int64_t num_planes, src_plane_stride, dst_plane_stride, block_bytes, num_pairs;
    const int64_t *pairs;
    int streaming;
};

/* One plane (a layer's keys or values) of every pair. */
static void copy_plane(const void *context, int64_t plane) {
    const struct copy_job *job = context;
    const char *src_plane = job->src + plane * job->src_plane_stride;
    char *dst_plane = job->dst + plane * job->dst_plane_stride;
    for (int64_t pair = 0; pair < job->num_pairs; ++pair) {
        copy_chunk(dst_plane + job->pairs[2 * pair + 1] * job->block_bytes,
                   src_plane + job->pairs[2 * pair] * job->block_bytes, (size_t)job->block_bytes, job->streaming);
    }
#if SHOAL_X86_64
    if (job->streaming) {
        _mm_sfence();
    }
#endif
}

static int compare_pairs_by_source(const void *a, const void *b) {
    const int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
    return (x > y) - (x < y);
}

static int compare_ids(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The pairs in ascending source order, in a new array (the caller frees it), or NULL: when
 * two pairs share a destination (the later pair's block must land last, so the order is
 * kept) or memory is short. Reading the source blocks in address order made a move out of
 * the KV pool (scattered reads) up to 15% faster on the development machine, never slower
 * (docs/benchmarks.md): consecutive reads then fall in nearby pages more often, where a
 * random order starts each block cold. */
static int64_t *sort_pairs_by_source(const int64_t *pairs, int64_t num_pairs) {
    int64_t *sorted = malloc((size_t)num_pairs * 2 * sizeof(int64_t));
    int64_t *targets = malloc((size_t)num_pairs * sizeof(int64_t));
    if (sorted == NULL || targets == NULL) {
        free(sorted);
        free(targets);
        return NULL;
    }
    for (int64_t pair = 0; pair < num_pairs; ++pair) {
        targets[pair] = pairs[2 * pair + 1];
    }
    qsort(targets, (size_t)num_pairs, sizeof(int64_t), compare_ids);
    for (int64_t pair = 1; pair < num_pairs; ++pair) {
        if (targets[pair] == targets[pair - 1]) {
            free(sorted);
            free(targets);
            return NULL;
        }
    }
    free(targets);
    memcpy(sorted, pairs, (size_t)num_pairs * 2 * sizeof(int64_t));
    qsort(sorted, (size_t)num_pairs, 2 * sizeof(int64_t), compare_pairs_by_source);
    return sorted;
}

int64_t shoal_copy_blocks_between(const char *src, char *dst, int64_t num_planes, int64_t src_plane_stride,
                                  int64_t dst_plane_stride, int64_t block_bytes, int64_t num_src_blocks,
                                  int64_t num_dst_blocks, const int64_t *pairs, int64_t num_pairs,
                                  int64_t streaming, int64_t num_threads) {
    for (int64_t pair = 0; pair < num_pairs; ++pair) {
        const int64_t from = pairs[2 * pair], to = pairs[2 * pair + 1];
        if (from < 0 || from >= num_src_blocks || to < 0 || to >= num_dst_blocks) {
            return pair;
        }
    }
    /* Within one pool a pair's destination may be a later pair's source: the order stays. */
    int64_t *sorted = num_pairs > 1 && src != dst ? sort_pairs_by_source(pairs, num_pairs) : NULL;
    struct copy_job job = {src,       dst,   num_planes, src_plane_stride, dst_plane_stride, block_bytes,
                           num_pairs, sorted != NULL ? sorted : pairs, (int)streaming};
    const struct shoal_phase phase = {copy_plane, &job, num_planes};
    shoal_run_phases(&phase, 1, (int)num_threads);
    free(sorted);
    return -1;
}
