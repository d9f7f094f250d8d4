// write_kv, copy_blocks and swap_blocks: pure data movement, so the kernels move
// raw bits in the widest vector the layout allows and never look at the dtype.
#include <cassert>
#include <cstdint>
#include <initializer_list>

#include <cuda_runtime.h>

#include "kv_ops.h"

namespace shoal {
namespace {

constexpr int kCopyThreads = 256;

// One thread block per token: copies the token's key and value rows (every kv
// head) into its slot.
template <typename Vec>
__global__ void write_kv_kernel(const WriteKvArgs args) {
  const int64_t token = blockIdx.x;
  const int64_t slot = args.slot_mapping[token];
  if (slot < 0) {
    return;  // padding
  }
  assert(slot < args.num_slots && "write_kv: slot past the end of the cache");
  const int64_t elements_per_vec = sizeof(Vec) / args.element_bytes;
  const int64_t vecs_per_head = args.head_dim / elements_per_vec;
  const int64_t vecs_per_row = vecs_per_head * args.num_kv_heads;
  const int64_t row_bytes = args.num_kv_heads * args.head_dim * args.element_bytes;
  Vec* key_row = reinterpret_cast<Vec*>(static_cast<char*>(args.key_cache) + slot * row_bytes);
  Vec* value_row = reinterpret_cast<Vec*>(static_cast<char*>(args.value_cache) + slot * row_bytes);
  const char* key = static_cast<const char*>(args.key);
  const char* value = static_cast<const char*>(args.value);
  for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
    const int64_t head = i / vecs_per_head;
    const int64_t dim = (i % vecs_per_head) * elements_per_vec;
    const int64_t key_offset = token * args.key_token_stride + head * args.key_head_stride + dim;
    const int64_t value_offset = token * args.value_token_stride + head * args.value_head_stride + dim;
    key_row[i] = *reinterpret_cast<const Vec*>(key + key_offset * args.element_bytes);
    value_row[i] = *reinterpret_cast<const Vec*>(value + value_offset * args.element_bytes);
  }
}

// grid = (num_pairs, num_planes): one thread block copies one block of one
// layer's key or value plane.
template <typename Vec>
__global__ void copy_blocks_kernel(const CopyBlocksArgs args) {
  const int64_t pair = blockIdx.x;
  const int64_t plane = blockIdx.y;
  const int64_t src_block = args.block_mapping[2 * pair];
  const int64_t dst_block = args.block_mapping[2 * pair + 1];
  assert(src_block >= 0 && src_block < args.src_num_blocks && "copy_blocks: source block out of range");
  assert(dst_block >= 0 && dst_block < args.dst_num_blocks && "copy_blocks: destination block out of range");
  const Vec* src = reinterpret_cast<const Vec*>(
      static_cast<const char*>(args.src) + (plane * args.src_num_blocks + src_block) * args.block_bytes);
  Vec* dst = reinterpret_cast<Vec*>(
      static_cast<char*>(args.dst) + (plane * args.dst_num_blocks + dst_block) * args.block_bytes);
  const int64_t num_vecs = args.block_bytes / static_cast<int64_t>(sizeof(Vec));
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    dst[i] = src[i];
  }
}

// The widest of 16/8/4 bytes that divides every address and byte stride, or
// min_bytes (an element's size) when none does.
int vector_bytes(int64_t min_bytes, std::initializer_list<int64_t> byte_quantities) {
  for (int bytes = 16; bytes > min_bytes; bytes /= 2) {
    bool fits = true;
    for (const int64_t quantity : byte_quantities) {
      fits = fits && quantity % bytes == 0;
    }
    if (fits) {
      return bytes;
    }
  }
  return static_cast<int>(min_bytes);
}

int64_t address(const void* pointer) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(pointer)); }

template <typename Vec>
void launch_write_kv(const WriteKvArgs& args, cudaStream_t stream) {
  const int64_t vecs_per_row = args.num_kv_heads * args.head_dim * args.element_bytes / sizeof(Vec);
  const int64_t warps = (vecs_per_row + 31) / 32;
  const int threads = static_cast<int>(warps * 32 < kCopyThreads ? warps * 32 : kCopyThreads);
  write_kv_kernel<Vec><<<static_cast<unsigned int>(args.num_tokens), threads, 0, stream>>>(args);
}

template <typename Vec>
void launch_copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(args.num_pairs), static_cast<unsigned int>(args.num_planes));
  copy_blocks_kernel<Vec><<<grid, kCopyThreads, 0, stream>>>(args);
}

}  // namespace

cudaError_t write_kv(const WriteKvArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) {
    return cudaSuccess;
  }
  const int64_t bytes = args.element_bytes;
  switch (vector_bytes(bytes, {address(args.key), address(args.value), address(args.key_cache),
                        address(args.value_cache), args.head_dim * bytes, args.key_token_stride * bytes,
                        args.key_head_stride * bytes, args.value_token_stride * bytes,
                        args.value_head_stride * bytes})) {
    case 16:
      launch_write_kv<uint4>(args, stream);
      break;
    case 8:
      launch_write_kv<uint2>(args, stream);
      break;
    case 4:
      launch_write_kv<uint32_t>(args, stream);
      break;
    default:
      launch_write_kv<uint16_t>(args, stream);
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream) {
  if (args.num_pairs == 0 || args.num_planes == 0) {
    return cudaSuccess;
  }
  switch (vector_bytes(2, {address(args.src), address(args.dst), args.block_bytes})) {
    case 16:
      launch_copy_blocks<uint4>(args, stream);
      break;
    case 8:
      launch_copy_blocks<uint2>(args, stream);
      break;
    case 4:
      launch_copy_blocks<uint32_t>(args, stream);
      break;
    default:
      launch_copy_blocks<uint16_t>(args, stream);
  }
  return cudaGetLastError();
}

cudaError_t mapped_device_pointer(const void* host_pointer, void** device_pointer) {
  cudaPointerAttributes attributes;
  const cudaError_t error = cudaPointerGetAttributes(&attributes, host_pointer);
  if (error != cudaSuccess) {
    return error;
  }
  if (attributes.type != cudaMemoryTypeHost || attributes.devicePointer == nullptr) {
    return cudaErrorInvalidHostPointer;
  }
  *device_pointer = attributes.devicePointer;
  return cudaSuccess;
}

}  // namespace shoal
