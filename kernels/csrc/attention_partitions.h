/* How paged_attention cuts its query rows' contexts into partitions (flash-decoding).
 *
 * Plain C with no CUDA header: paged_attention.cu's launcher calls it with the device's
 * SM count, and the CPU test suite compiles this header with the system C compiler and
 * checks the same function (tests/unit/test_kernels_partitions.py), so the CUDA launch
 * policy is exercised on machines without a GPU.
 *
 * The policy (docs/kernels.md, "CUDA kernels"):
 *
 *   - contexts are cut by row length into fixed partitions of kPartitionTokens (512, as
 *     vLLM's paged attention v2) positions: a row of n positions uses ceil(n / length)
 *     of them, each one thread block per (row, kv head, head chunk); a row that fits one
 *     partition writes its output directly and is not merged;
 *   - when even that leaves fewer thread blocks than twice the SMs (a few decode rows),
 *     partitions shrink down to kMinPartitionTokens (256) to fill the GPU;
 *   - the grid's partition dimension has one entry per partition of the longest context
 *     the block table can hold (`width` = max_blocks_per_seq * block_size, which the
 *     engine pads to its batch's longest sequence): at most 65535 / head_chunks
 *     (gridDim.z), longer partitions past that;
 *   - partial results take (head_dim + 2) floats per (row, head, partition) of a
 *     workspace; partitions double in length until it fits max_workspace_bytes.
 */
#ifndef SHOAL_ATTENTION_PARTITIONS_H_
#define SHOAL_ATTENTION_PARTITIONS_H_

#include <stdint.h>

#define SHOAL_PARTITION_TOKENS 512
#define SHOAL_MIN_PARTITION_TOKENS 256
#define SHOAL_MAX_GRID_Z 65535

typedef struct ShoalPartitionPlan {
  int64_t num_partitions;   /* grid entries per (row, kv head, head chunk); 1 = no split */
  int64_t partition_length; /* positions per partition (the width when there is no split) */
  int64_t workspace_bytes;  /* float32 workspace of the split: 0 without one */
} ShoalPartitionPlan;

static inline int64_t shoal_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static inline int64_t shoal_partition_workspace_bytes(int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                                      int64_t num_partitions) {
  return num_tokens * num_heads * num_partitions * (head_dim + 2) * (int64_t)sizeof(float);
}

/* The partitions of one paged_attention call.
 *
 * num_tokens: query rows; num_kv_heads, num_heads, head_dim: the cache's and query's heads;
 * head_chunks: thread blocks per (row, kv head) for the query heads of the group;
 * width: max_blocks_per_seq * block_size; num_sms: the device's multiprocessors;
 * max_workspace_bytes: the most workspace a split may take (0: no limit). */
static inline ShoalPartitionPlan shoal_plan_partitions(int64_t num_tokens, int64_t num_kv_heads, int64_t num_heads,
                                                       int64_t head_dim, int64_t head_chunks, int64_t width,
                                                       int64_t num_sms, int64_t max_workspace_bytes) {
  ShoalPartitionPlan plan;
  plan.num_partitions = 1;
  plan.partition_length = width > 0 ? width : 1;
  plan.workspace_bytes = 0;
  const int64_t blocks = num_tokens * num_kv_heads * head_chunks;
  if (blocks <= 0 || head_chunks <= 0 || width <= SHOAL_MIN_PARTITION_TOKENS) {
    return plan;
  }
  int64_t length = SHOAL_PARTITION_TOKENS;
  const int64_t wanted_blocks = 2 * num_sms;
  if (blocks * shoal_ceil_div(width, length) < wanted_blocks) {
    /* Too few thread blocks even at full length: shorter partitions, down to the minimum. */
    length = shoal_ceil_div(width, shoal_ceil_div(wanted_blocks, blocks));
    if (length < SHOAL_MIN_PARTITION_TOKENS) {
      length = SHOAL_MIN_PARTITION_TOKENS;
    }
    if (length > SHOAL_PARTITION_TOKENS) {
      length = SHOAL_PARTITION_TOKENS;
    }
  }
  const int64_t max_partitions = SHOAL_MAX_GRID_Z / head_chunks;
  if (max_partitions < 1) {
    return plan;
  }
  if (shoal_ceil_div(width, length) > max_partitions) {
    length = shoal_ceil_div(width, max_partitions);
  }
  while (max_workspace_bytes > 0 && length < width &&
         shoal_partition_workspace_bytes(num_tokens, num_heads, head_dim, shoal_ceil_div(width, length)) >
             max_workspace_bytes) {
    length *= 2;
  }
  const int64_t partitions = shoal_ceil_div(width, length);
  if (partitions <= 1) {
    return plan;
  }
  plan.num_partitions = partitions;
  plan.partition_length = length;
  plan.workspace_bytes = shoal_partition_workspace_bytes(num_tokens, num_heads, head_dim, partitions);
  return plan;
}

#endif /* SHOAL_ATTENTION_PARTITIONS_H_ */
