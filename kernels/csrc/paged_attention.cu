// Varlen causal paged attention with GQA, reading K/V straight from the blocks.
//
// One thread block per (query token, kv head, group of up to kMaxGroup query
// heads sharing that kv head, context partition), so each K/V row is read once
// for the whole group. The block's warps take the partition's positions
// round-robin; each warp keeps an online softmax (running max, running sum,
// weighted V) per query head in float32, and the warps' results are merged at
// the end. Contexts are cut by row length into partitions of a fixed length
// (attention_partitions.h): a row whose context fits one partition is written by
// its block directly; a longer row's blocks write their partition's (max, sum,
// weighted V) to a workspace and a second kernel merges them (flash-decoding), so
// a 32K-token row in a big batch runs on 64 thread blocks per head chunk, and a
// small decode batch over a long context still uses every SM.
#include <algorithm>
#include <cassert>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "dtype_convert.cuh"

#include "attention_partitions.h"
#include "kv_ops.h"

namespace shoal {
namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr int kThreads = kWarpSize * kNumWarps;
constexpr int kMaxGroup = 8;  // query heads per thread block
constexpr int kUnroll = 2;    // context positions a warp loads before using them
// The most workspace a split takes (partitions grow past 512 positions beyond it): only
// a call with thousands of long rows (prefill rows that the engine did not route to
// SDPA) reaches it.
constexpr int64_t kMaxWorkspaceBytes = int64_t{256} << 20;

using shoal::from_float;
using shoal::to_float;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, mask);
  }
  return x;
}

// The sequence that owns query row `token`: the last s with query_start_loc[s] <= token.
__device__ int find_sequence(const int32_t* query_start_loc, int num_seqs, int64_t token) {
  int low = 0;
  int high = num_seqs - 1;
  while (low < high) {
    const int mid = (low + high + 1) / 2;
    if (query_start_loc[mid] <= token) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

struct QueryRow {
  bool valid;     // false for a row no sequence owns (a broken query_start_loc)
  int seq;
  int num_seen;   // context positions this row attends to: [0, num_seen)
};

__device__ QueryRow locate_row(const PagedAttentionArgs& args, int64_t token) {
  // The contract's batch checks (shoal.kernels.contract.check_attention_batch), which the
  // host runs on CUDA only in debug mode: every row belongs to exactly one sequence.
  // Without them a row past query_start_loc[-1] would be left unwritten, and one before
  // query_start_loc[0] would read before its sequence's first position.
  assert(args.query_start_loc[0] == 0 && "paged_attention: query_start_loc[0] != 0");
  assert(args.query_start_loc[args.num_seqs] == args.num_tokens &&
         "paged_attention: query_start_loc[-1] != the query's rows");
  const int seq = find_sequence(args.query_start_loc, static_cast<int>(args.num_seqs), token);
  const int q_start = args.query_start_loc[seq];
  const int q_end = args.query_start_loc[seq + 1];
  assert(q_start <= token && token < q_end && "paged_attention: query_start_loc decreases");
  if (token < q_start || token >= q_end) {
    return {false, seq, 0};  // only where asserts are compiled out: the row stays unwritten
  }
  // Row token - q_start is position seq_len - q_len + (token - q_start) and sees
  // every position up to and including itself.
  const int num_seen = args.seq_lens[seq] - (q_end - q_start) + static_cast<int>(token - q_start) + 1;
  assert(num_seen >= 1 && "paged_attention: q_len > seq_len");
  assert((num_seen + args.block_size - 1) / args.block_size <= args.max_blocks_per_seq &&
         "paged_attention: seq_len needs more blocks than block_tables has columns");
  return {true, seq, num_seen};
}

__host__ __device__ int64_t partition_length(const PagedAttentionArgs& args) {
  return args.partition_length;
}

// Rows that fit one partition are written by the attention kernel itself, not merged.
__device__ __forceinline__ bool writes_directly(const PagedAttentionArgs& args, const QueryRow& row) {
  return args.num_partitions == 1 || row.num_seen <= partition_length(args);
}

// Workspace layout, per (token, head, partition) = index i:
// maxes[i], totals[i], and weighted V at values[i * head_dim + d].
struct Workspace {
  float* maxes;
  float* totals;
  float* values;
};

__host__ __device__ int64_t workspace_entries(const PagedAttentionArgs& args) {
  return args.num_tokens * args.num_heads * args.num_partitions;
}

__device__ Workspace workspace(const PagedAttentionArgs& args) {
  const int64_t entries = workspace_entries(args);
  return {args.workspace, args.workspace + entries, args.workspace + 2 * entries};
}

// Lane l of a warp holds head dims l, l + 32, l + 64, ...: kDimsPerLane of them,
// so head_dim <= 32 * kDimsPerLane; loads of one row are coalesced.
template <typename scalar_t, int kDimsPerLane>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const PagedAttentionArgs args) {
  constexpr int kMaxDim = kWarpSize * kDimsPerLane;
  __shared__ float query_smem[kMaxGroup][kMaxDim];
  __shared__ float warp_max[kNumWarps][kMaxGroup];
  __shared__ float warp_total[kNumWarps][kMaxGroup];
  __shared__ float warp_acc[kNumWarps][kMaxGroup][kMaxDim];

  const int64_t token = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int chunk = static_cast<int>(blockIdx.z / args.num_partitions);  // which kMaxGroup heads
  const int64_t partition = blockIdx.z % args.num_partitions;
  const int group = static_cast<int>(args.num_heads / args.num_kv_heads);
  const int first_head = kv_head * group + chunk * kMaxGroup;
  const int num_members = min(kMaxGroup, group - chunk * kMaxGroup);
  const int head_dim = static_cast<int>(args.head_dim);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;

  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    // One block checks that query_start_loc never decreases (a sequence with a negative
    // q_len owns no row, so no row's own checks would see it).
    for (int64_t seq = threadIdx.x; seq < args.num_seqs; seq += kThreads) {
      assert(args.query_start_loc[seq] <= args.query_start_loc[seq + 1] &&
             "paged_attention: query_start_loc decreases");
    }
  }
  const QueryRow row = locate_row(args, token);
  const int64_t length = partition_length(args);
  const int start = static_cast<int>(partition * length);
  if (!row.valid || start >= row.num_seen) {
    return;  // no queries here, or past this row's context (the merge skips it)
  }
  const int end = start + length < row.num_seen ? static_cast<int>(start + length) : row.num_seen;

  const scalar_t* query = static_cast<const scalar_t*>(args.query);
  for (int i = threadIdx.x; i < kMaxGroup * kMaxDim; i += kThreads) {
    const int member = i / kMaxDim;
    const int dim = i % kMaxDim;
    float q = 0.0f;  // zero past head_dim and past the group: they meet zero K
    if (member < num_members && dim < head_dim) {
      const int64_t offset = token * args.query_token_stride + (first_head + member) * args.query_head_stride + dim;
      q = to_float(query[offset]) * args.scale;
    }
    query_smem[member][dim] = q;
  }
  __syncthreads();

  float running_max[kMaxGroup];
  float running_total[kMaxGroup];
  float acc[kMaxGroup][kDimsPerLane];
#pragma unroll
  for (int m = 0; m < kMaxGroup; ++m) {
    running_max[m] = -INFINITY;
    running_total[m] = 0.0f;
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) {
      acc[m][e] = 0.0f;
    }
  }

  const scalar_t* key_cache = static_cast<const scalar_t*>(args.key_cache);
  const scalar_t* value_cache = static_cast<const scalar_t*>(args.value_cache);
  const int32_t* block_table = args.block_tables + row.seq * args.max_blocks_per_seq;
  const int64_t slot_stride = args.num_kv_heads * args.head_dim;

  for (int base = start + warp; base < end; base += kNumWarps * kUnroll) {
    float keys[kUnroll][kDimsPerLane];
    float values[kUnroll][kDimsPerLane];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int position = base + u * kNumWarps;
      const bool seen = position < end;
      int64_t row = 0;
      if (seen) {
        const int64_t block = block_table[position / args.block_size];
        assert(block >= 0 && block < args.num_blocks && "paged_attention: block id out of range");
        row = ((block * args.block_size + position % args.block_size) * slot_stride) + kv_head * args.head_dim;
      }
#pragma unroll
      for (int e = 0; e < kDimsPerLane; ++e) {
        const int dim = e * kWarpSize + lane;
        const bool load = seen && dim < head_dim;
        keys[u][e] = load ? to_float(key_cache[row + dim]) : 0.0f;
        values[u][e] = load ? to_float(value_cache[row + dim]) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kNumWarps >= end) {
        break;  // uniform across the warp
      }
#pragma unroll
      for (int m = 0; m < kMaxGroup; ++m) {
        if (m >= num_members) {
          break;  // uniform across the block
        }
        float partial = 0.0f;
#pragma unroll
        for (int e = 0; e < kDimsPerLane; ++e) {
          partial += query_smem[m][e * kWarpSize + lane] * keys[u][e];
        }
        const float score = warp_sum(partial);
        const float new_max = fmaxf(running_max[m], score);
        const float rescale = expf(running_max[m] - new_max);  // 0 for the first position
        const float weight = expf(score - new_max);
        running_total[m] = running_total[m] * rescale + weight;
#pragma unroll
        for (int e = 0; e < kDimsPerLane; ++e) {
          acc[m][e] = acc[m][e] * rescale + weight * values[u][e];
        }
        running_max[m] = new_max;
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kMaxGroup; ++m) {
    if (lane == 0) {
      warp_max[warp][m] = running_max[m];
      warp_total[warp][m] = running_total[m];
    }
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) {
      warp_acc[warp][m][e * kWarpSize + lane] = acc[m][e];
    }
  }
  __syncthreads();

  // Warp 0 always saw the partition's first position, so the merged max is
  // finite; a warp that saw nothing has max -inf and weighs exp(-inf) = 0.
  scalar_t* out = static_cast<scalar_t*>(args.out);
  const Workspace partials = workspace(args);
  for (int i = threadIdx.x; i < num_members * head_dim; i += kThreads) {
    const int member = i / head_dim;
    const int dim = i % head_dim;
    float merged_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      merged_max = fmaxf(merged_max, warp_max[w][member]);
    }
    float total = 0.0f;
    float weighted = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float rescale = expf(warp_max[w][member] - merged_max);
      total += warp_total[w][member] * rescale;
      weighted += warp_acc[w][member][dim] * rescale;
    }
    if (writes_directly(args, row)) {
      const int64_t offset = token * args.out_token_stride + (first_head + member) * args.out_head_stride + dim;
      out[offset] = from_float<scalar_t>(weighted / total);
    } else {
      const int64_t entry = (token * args.num_heads + first_head + member) * args.num_partitions + partition;
      partials.values[entry * head_dim + dim] = weighted;
      if (dim == 0) {
        partials.maxes[entry] = merged_max;
        partials.totals[entry] = total;
      }
    }
  }
}

// grid = (num_tokens, num_heads): combines a row's partitions into the output.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) merge_partitions_kernel(const PagedAttentionArgs args) {
  const int64_t token = blockIdx.x;
  const int64_t head = blockIdx.y;
  const QueryRow row = locate_row(args, token);
  if (!row.valid || writes_directly(args, row)) {
    return;  // a row of one partition: already written
  }
  const int64_t num_used = (row.num_seen + partition_length(args) - 1) / partition_length(args);
  const int64_t first = (token * args.num_heads + head) * args.num_partitions;
  const Workspace partials = workspace(args);
  float merged_max = -INFINITY;
  for (int64_t p = 0; p < num_used; ++p) {
    merged_max = fmaxf(merged_max, partials.maxes[first + p]);
  }
  scalar_t* out = static_cast<scalar_t*>(args.out);
  for (int64_t dim = threadIdx.x; dim < args.head_dim; dim += kThreads) {
    float total = 0.0f;
    float weighted = 0.0f;
    for (int64_t p = 0; p < num_used; ++p) {
      const float rescale = expf(partials.maxes[first + p] - merged_max);
      total += partials.totals[first + p] * rescale;
      weighted += partials.values[(first + p) * args.head_dim + dim] * rescale;
    }
    out[token * args.out_token_stride + head * args.out_head_stride + dim] = from_float<scalar_t>(weighted / total);
  }
}

int64_t head_chunks(const PagedAttentionArgs& args) {
  const int64_t group = args.num_heads / args.num_kv_heads;
  return (group + kMaxGroup - 1) / kMaxGroup;
}

template <typename scalar_t, int kDimsPerLane>
void launch(const PagedAttentionArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(args.num_tokens), static_cast<unsigned int>(args.num_kv_heads),
                  static_cast<unsigned int>(head_chunks(args) * args.num_partitions));
  paged_attention_kernel<scalar_t, kDimsPerLane><<<grid, kThreads, 0, stream>>>(args);
  if (args.num_partitions > 1) {
    const dim3 merge_grid(static_cast<unsigned int>(args.num_tokens), static_cast<unsigned int>(args.num_heads));
    merge_partitions_kernel<scalar_t><<<merge_grid, kThreads, 0, stream>>>(args);
  }
}

template <typename scalar_t>
void launch_for_head_dim(const PagedAttentionArgs& args, cudaStream_t stream) {
  if (args.head_dim <= 32) {
    launch<scalar_t, 1>(args, stream);
  } else if (args.head_dim <= 64) {
    launch<scalar_t, 2>(args, stream);
  } else if (args.head_dim <= 128) {
    launch<scalar_t, 4>(args, stream);
  } else {
    launch<scalar_t, 8>(args, stream);
  }
}

}  // namespace

cudaError_t paged_attention_plan(const PagedAttentionArgs& args, PagedAttentionPlan* plan) {
  const int64_t width = args.max_blocks_per_seq * args.block_size;
  plan->num_partitions = 1;
  plan->partition_length = width > 0 ? width : 1;
  plan->workspace_bytes = 0;
  int device = 0;
  int num_sms = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (error != cudaSuccess) {
    return error;
  }
  const ShoalPartitionPlan split =
      shoal_plan_partitions(args.num_tokens, args.num_kv_heads, args.num_heads, args.head_dim, head_chunks(args),
                            width, num_sms, kMaxWorkspaceBytes);
  plan->num_partitions = split.num_partitions;
  plan->partition_length = split.partition_length;
  plan->workspace_bytes = split.workspace_bytes;
  return cudaSuccess;
}

cudaError_t paged_attention(const PagedAttentionArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0 || args.num_seqs == 0) {
    return cudaSuccess;
  }
  if (args.head_dim > kMaxHeadDim || args.num_kv_heads < 1 || args.num_heads % args.num_kv_heads != 0 ||
      args.num_partitions < 1 || args.partition_length < 1 ||
      args.num_partitions * head_chunks(args) > SHOAL_MAX_GRID_Z ||
      (args.num_partitions > 1 && args.workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  switch (args.dtype) {
    case ScalarType::kFloat32:
      launch_for_head_dim<float>(args, stream);
      break;
    case ScalarType::kFloat16:
      launch_for_head_dim<__half>(args, stream);
      break;
    case ScalarType::kBFloat16:
      launch_for_head_dim<__nv_bfloat16>(args, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace shoal
