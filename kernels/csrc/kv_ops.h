// Host API of Shoal's KV-cache kernels: raw pointers, element strides and a stream.
//
// The .cu files implement these launchers with CUDA headers only; bindings.cpp
// turns torch tensors into these structs. The layout and the contract are
// documented in kernels/ops.py and docs/kernels.md: a layer's key or value
// cache is [num_blocks, block_size, num_kv_heads, head_dim], contiguous, and a
// pool is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace shoal {

enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct WriteKvArgs {
  const void* key;    // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  const void* value;  // same shape, strides of its own
  void* key_cache;    // [num_slots, num_kv_heads, head_dim], contiguous
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]; < 0 = padding
  int64_t num_tokens;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t key_token_stride;  // all strides in elements
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  int64_t num_slots;  // num_blocks * block_size
  int64_t element_bytes;
};

struct PagedAttentionArgs {
  void* out;          // [num_tokens, num_heads, head_dim], last dim contiguous
  const void* query;  // same shape, strides of its own
  const void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* value_cache;
  const int32_t* block_tables;     // [num_seqs, max_blocks_per_seq], contiguous
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  int64_t num_tokens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_blocks_per_seq;
  int64_t query_token_stride;  // all strides in elements
  int64_t query_head_stride;
  int64_t out_token_stride;
  int64_t out_head_stride;
  float scale;
  ScalarType dtype;
  // Split-context mode (see paged_attention_plan, attention_partitions.h): each query
  // row's context is cut into partitions of partition_length positions, processed by
  // separate thread blocks into `workspace`, then merged; rows of one partition are
  // written directly. num_partitions = 1: no split, no workspace.
  int64_t num_partitions;
  int64_t partition_length;
  float* workspace;
};

struct PagedAttentionPlan {
  int64_t num_partitions;
  int64_t partition_length;
  int64_t workspace_bytes;  // to allocate on the device and pass as args.workspace
};

// Copies whole blocks between two pools (or inside one): for every
// (src_block, dst_block) pair and every one of the num_planes = num_layers * 2
// [num_blocks, block_bytes] planes. Either pointer may be a pinned host
// buffer's mapped device address (see mapped_device_pointer).
struct CopyBlocksArgs {
  const void* src;
  void* dst;
  const int64_t* block_mapping;  // [num_pairs, 2], contiguous, on the device
  int64_t num_pairs;
  int64_t num_planes;
  int64_t src_num_blocks;
  int64_t dst_num_blocks;
  int64_t block_bytes;  // block_size * num_kv_heads * head_dim * element_bytes
};

// The fused layer ops (layer_ops.cu; kernels/layer_ops.py). Strides in elements; the last
// dim of every tensor contiguous. The tensors share `dtype`.
struct RmsNormArgs {
  void* out;             // [num_rows, hidden]
  const void* x;         // [num_rows, hidden]
  void* residual;        // [num_rows, hidden], updated to residual + x; nullptr for none
  const void* weight;    // [hidden]
  int64_t num_rows;
  int64_t hidden;
  int64_t out_stride;
  int64_t x_stride;
  int64_t residual_stride;
  float eps;
  ScalarType dtype;
};

struct RotaryArgs {
  void* query;           // [num_tokens, num_query_heads, head_dim], in place
  void* key;             // [num_tokens, num_key_heads, head_dim], in place
  const void* cos;       // [num_tokens, head_dim] (the first half is read; transformers' halves are equal)
  const void* sin;
  int64_t num_tokens;
  int64_t num_query_heads;
  int64_t num_key_heads;
  int64_t head_dim;
  int64_t query_token_stride;
  int64_t query_head_stride;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t cos_sin_stride;
  ScalarType dtype;
};

struct SiluMulArgs {
  void* out;             // [num_rows, n]
  const void* gate_up;   // [num_rows, 2 n]: gate then up
  int64_t num_rows;
  int64_t n;
  int64_t out_stride;
  int64_t gate_up_stride;
  ScalarType dtype;
};

// Head dims up to this many are supported by paged_attention.
constexpr int64_t kMaxHeadDim = 256;

cudaError_t write_kv(const WriteKvArgs& args, cudaStream_t stream);
// The context partitions paged_attention uses on the current device (by row length;
// shorter ones when too few thread blocks would fill its SMs) and the workspace they need.
cudaError_t paged_attention_plan(const PagedAttentionArgs& args, PagedAttentionPlan* plan);
cudaError_t paged_attention(const PagedAttentionArgs& args, cudaStream_t stream);
cudaError_t copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream);
cudaError_t rms_norm(const RmsNormArgs& args, cudaStream_t stream);
cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream);
cudaError_t silu_mul(const SiluMulArgs& args, cudaStream_t stream);

// The device address of a pinned (page-locked) host pointer, usable by kernels.
// Fails for pageable memory.
cudaError_t mapped_device_pointer(const void* host_pointer, void** device_pointer);

}  // namespace shoal
