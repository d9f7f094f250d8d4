// The fused element-wise layer ops on CUDA: RMSNorm (with the residual add before it),
// rotary embedding in place on q and k, SiLU(gate) * up. The CUDA twins of the native CPU
// code in cpu_fused.c; the contract and the torch reference are in kernels/layer_ops.py and
// kernels/layer_reference.py (transformers' arithmetic: float32 inside, each op's result
// rounded to the tensors' dtype where transformers rounds it).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "dtype_convert.cuh"

#include "kv_ops.h"

namespace shoal {
namespace {

using shoal::from_float;
using shoal::to_float;

// A value rounded to T and back: where transformers keeps an intermediate in the model's dtype.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

constexpr int kNormThreads = 256;

// One thread block per row: residual += x (rounded to T), then the float32 sum of squares
// (warp shuffles, then one value per warp through shared memory), then
// out = weight * T(x * rsqrt(mean + eps)).
template <typename T>
__global__ void rms_norm_kernel(RmsNormArgs args) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(args.x) + row * args.x_stride;
  T* residual = args.residual ? static_cast<T*>(args.residual) + row * args.residual_stride : nullptr;
  T* out = static_cast<T*>(args.out) + row * args.out_stride;
  const T* weight = static_cast<const T*>(args.weight);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < args.hidden; i += blockDim.x) {
    float value = to_float(x[i]);
    if (residual != nullptr) {
      const T total = from_float<T>(to_float(residual[i]) + value);
      residual[i] = total;
      value = to_float(total);
    }
    sum += value * value;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  __shared__ float warp_sums[kNormThreads / 32];
  __shared__ float inverse;
  if (threadIdx.x % 32 == 0) {
    warp_sums[threadIdx.x / 32] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
      total += warp_sums[w];
    }
    inverse = 1.0f / sqrtf(total / static_cast<float>(args.hidden) + args.eps);
  }
  __syncthreads();
  const T* source = residual != nullptr ? residual : x;  // the sum, as written above
  for (int64_t i = threadIdx.x; i < args.hidden; i += blockDim.x) {
    out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(source[i]) * inverse));
  }
}

// One thread per (token, head, i < head_dim / 2): the pair (i, i + half) of q or k.
template <typename T>
__global__ void rotary_kernel(RotaryArgs args) {
  const int64_t half = args.head_dim / 2;
  const int64_t heads = args.num_query_heads + args.num_key_heads;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= args.num_tokens * heads * half) {
    return;
  }
  const int64_t i = index % half, head = (index / half) % heads, token = index / (half * heads);
  T* row = head < args.num_query_heads
               ? static_cast<T*>(args.query) + token * args.query_token_stride + head * args.query_head_stride
               : static_cast<T*>(args.key) + token * args.key_token_stride +
                     (head - args.num_query_heads) * args.key_head_stride;
  const T* cos = static_cast<const T*>(args.cos) + token * args.cos_sin_stride;
  const T* sin = static_cast<const T*>(args.sin) + token * args.cos_sin_stride;
  const float first = to_float(row[i]), second = to_float(row[i + half]);
  const float c = to_float(cos[i]), s = to_float(sin[i]);
  row[i] = from_float<T>(round_to<T>(first * c) + round_to<T>(-second * s));
  row[i + half] = from_float<T>(round_to<T>(second * c) + round_to<T>(first * s));
}

// One thread per output element: T(T(silu(gate)) * up).
template <typename T>
__global__ void silu_mul_kernel(SiluMulArgs args) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= args.num_rows * args.n) {
    return;
  }
  const int64_t row = index / args.n, j = index % args.n;
  const T* gate_up = static_cast<const T*>(args.gate_up) + row * args.gate_up_stride;
  const float gate = to_float(gate_up[j]);
  const float activated = round_to<T>(gate / (1.0f + expf(-gate)));
  static_cast<T*>(args.out)[row * args.out_stride + j] = from_float<T>(activated * to_float(gate_up[args.n + j]));
}

template <template <typename> class Launch, typename Args>
cudaError_t dispatch(const Args& args, ScalarType dtype, cudaStream_t stream) {
  switch (dtype) {
    case ScalarType::kFloat32:
      Launch<float>::run(args, stream);
      break;
    case ScalarType::kFloat16:
      Launch<__half>::run(args, stream);
      break;
    case ScalarType::kBFloat16:
      Launch<__nv_bfloat16>::run(args, stream);
      break;
  }
  return cudaGetLastError();
}

template <typename T>
struct LaunchRmsNorm {
  static void run(const RmsNormArgs& args, cudaStream_t stream) {
    rms_norm_kernel<T><<<static_cast<unsigned>(args.num_rows), kNormThreads, 0, stream>>>(args);
  }
};

template <typename T>
struct LaunchRotary {
  static void run(const RotaryArgs& args, cudaStream_t stream) {
    const int64_t total = args.num_tokens * (args.num_query_heads + args.num_key_heads) * (args.head_dim / 2);
    rotary_kernel<T><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(args);
  }
};

template <typename T>
struct LaunchSiluMul {
  static void run(const SiluMulArgs& args, cudaStream_t stream) {
    const int64_t total = args.num_rows * args.n;
    silu_mul_kernel<T><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(args);
  }
};

}  // namespace

cudaError_t rms_norm(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0) {
    return cudaSuccess;
  }
  return dispatch<LaunchRmsNorm>(args, args.dtype, stream);
}

cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0 || args.head_dim < 2) {
    return cudaSuccess;
  }
  return dispatch<LaunchRotary>(args, args.dtype, stream);
}

cudaError_t silu_mul(const SiluMulArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0 || args.n == 0) {
    return cudaSuccess;
  }
  return dispatch<LaunchSiluMul>(args, args.dtype, stream);
}

}  // namespace shoal
