// Torch bindings of Shoal's KV-cache kernels: validate tensors, fill the
// launcher structs of kv_ops.h, launch on the current stream of the tensors'
// device.
//
// Only generic c10 APIs are used for the device and its stream (no c10/cuda
// headers), so this file compiles against any torch build; scripts/check_kernels.sh
// compiles it against the CPU wheel on machines without a GPU.
//
// It includes only what it uses (ATen's Tensor, at::empty, c10's device guard and
// torch's pybind11 casters), not <torch/extension.h>, which pulls in all of libtorch's
// C++ API: the host compile takes ~5 s instead of ~20-25 s (the JIT build and CI).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>

#include "kv_ops.h"

namespace {

cudaStream_t current_stream(const c10::Device& device) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  return static_cast<cudaStream_t>(stream.native_handle());
}

void check_launch(cudaError_t error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, "shoal ", op, " kernel launch failed: ", cudaGetErrorString(error));
}

shoal::ScalarType scalar_type(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat:
      return shoal::ScalarType::kFloat32;
    case at::kHalf:
      return shoal::ScalarType::kFloat16;
    case at::kBFloat16:
      return shoal::ScalarType::kBFloat16;
    default:
      TORCH_CHECK(false, "shoal KV ops support float32, float16 and bfloat16, got ", tensor.scalar_type());
  }
}

void check_on(const at::Tensor& tensor, const c10::Device& device, const char* name) {
  TORCH_CHECK(tensor.device() == device, name, " must be on ", device, ", got ", tensor.device());
}

void check_index(const at::Tensor& tensor, at::ScalarType dtype, int64_t dims, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == dtype, name, " must be ", dtype, ", got ", tensor.scalar_type());
  TORCH_CHECK(tensor.dim() == dims, name, " must have ", dims, " dims, got ", tensor.sizes());
  TORCH_CHECK(tensor.is_contiguous(), name, " must be contiguous");
}

void check_layer_cache(const at::Tensor& cache, const at::Tensor& like, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              cache.sizes());
  TORCH_CHECK(cache.size(1) >= 1 && cache.size(2) >= 1 && cache.size(3) >= 1, name,
              " needs block_size, num_kv_heads and head_dim of at least 1, got ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(cache.sizes() == like.sizes() && cache.scalar_type() == like.scalar_type(), name,
              " must match key_cache's shape and dtype");
  scalar_type(cache);
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
              at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.is_cuda(), "write_kv: key_cache must be a CUDA tensor");
  const c10::Device device = key_cache.device();
  check_layer_cache(key_cache, key_cache, "key_cache");
  check_layer_cache(value_cache, key_cache, "value_cache");
  check_index(slot_mapping, at::kLong, 1, "slot_mapping");
  const int64_t num_tokens = slot_mapping.size(0);
  for (const auto& [tensor, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    TORCH_CHECK(tensor->dim() == 3 && tensor->size(0) == num_tokens && tensor->size(1) == key_cache.size(2) &&
                    tensor->size(2) == key_cache.size(3),
                name, " must be [num_tokens, num_kv_heads, head_dim], got ", tensor->sizes());
    TORCH_CHECK(tensor->scalar_type() == key_cache.scalar_type(), name, " dtype must match the cache's");
    TORCH_CHECK(num_tokens == 0 || tensor->stride(2) == 1, name, "'s last dim must be contiguous");
    check_on(*tensor, device, name);
  }
  check_on(value_cache, device, "value_cache");
  check_on(slot_mapping, device, "slot_mapping");

  const c10::DeviceGuard guard(device);
  shoal::WriteKvArgs args{};
  args.key = key.data_ptr();
  args.value = value.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.slot_mapping = slot_mapping.data_ptr<int64_t>();
  args.num_tokens = num_tokens;
  args.num_kv_heads = key_cache.size(2);
  args.head_dim = key_cache.size(3);
  args.key_token_stride = key.stride(0);
  args.key_head_stride = key.stride(1);
  args.value_token_stride = value.stride(0);
  args.value_head_stride = value.stride(1);
  args.num_slots = key_cache.size(0) * key_cache.size(1);
  args.element_bytes = key_cache.element_size();
  check_launch(shoal::write_kv(args, current_stream(device)), "write_kv");
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     int64_t partition_length) {
  TORCH_CHECK(query.is_cuda(), "paged_attention: query must be a CUDA tensor");
  const c10::Device device = query.device();
  check_layer_cache(key_cache, key_cache, "key_cache");
  check_layer_cache(value_cache, key_cache, "value_cache");
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim], got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query's shape and dtype");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query dtype must match the cache's");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query head_dim ", query.size(2), " != cache head_dim ",
              key_cache.size(3));
  TORCH_CHECK(query.size(2) <= shoal::kMaxHeadDim, "head_dim ", query.size(2), " > ", shoal::kMaxHeadDim,
              " is not supported");
  TORCH_CHECK(query.size(1) >= 1 && query.size(1) % key_cache.size(2) == 0, "num_heads ", query.size(1),
              " must be a positive multiple of num_kv_heads ", key_cache.size(2));
  TORCH_CHECK(query.numel() == 0 || (query.stride(2) == 1 && out.stride(2) == 1),
              "query's and out's last dims must be contiguous");
  check_index(block_tables, at::kInt, 2, "block_tables");
  check_index(seq_lens, at::kInt, 1, "seq_lens");
  check_index(query_start_loc, at::kInt, 1, "query_start_loc");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must have num_seqs rows");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries");
  TORCH_CHECK(num_seqs > 0 || query.size(0) == 0, "with no sequences the query must have no rows");
  check_on(out, device, "out");
  check_on(key_cache, device, "key_cache");
  check_on(value_cache, device, "value_cache");
  check_on(block_tables, device, "block_tables");
  check_on(seq_lens, device, "seq_lens");
  check_on(query_start_loc, device, "query_start_loc");

  const c10::DeviceGuard guard(device);
  shoal::PagedAttentionArgs args{};
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  args.num_tokens = query.size(0);
  args.num_seqs = num_seqs;
  args.num_heads = query.size(1);
  args.num_kv_heads = key_cache.size(2);
  args.head_dim = key_cache.size(3);
  args.block_size = key_cache.size(1);
  args.num_blocks = key_cache.size(0);
  args.max_blocks_per_seq = block_tables.size(1);
  args.query_token_stride = query.stride(0);
  args.query_head_stride = query.stride(1);
  args.out_token_stride = out.stride(0);
  args.out_head_stride = out.stride(1);
  args.scale = static_cast<float>(scale);
  args.dtype = scalar_type(query);
  shoal::PagedAttentionPlan plan{};
  check_launch(shoal::paged_attention_plan(args, &plan), "paged_attention (plan)");
  if (partition_length > 0) {  // forced by a test: partitions of this length, no planning
    const int64_t width = std::max<int64_t>(1, args.max_blocks_per_seq * args.block_size);
    plan.partition_length = std::min(partition_length, width);
    plan.num_partitions = (width + plan.partition_length - 1) / plan.partition_length;
    plan.workspace_bytes = plan.num_partitions > 1 ? args.num_tokens * args.num_heads * plan.num_partitions *
                                                         (args.head_dim + 2) * static_cast<int64_t>(sizeof(float))
                                                   : 0;
  }
  args.num_partitions = plan.num_partitions;
  args.partition_length = plan.partition_length;
  at::Tensor workspace;  // freed to torch's caching allocator after the call, stream-ordered
  if (plan.workspace_bytes > 0) {
    workspace = at::empty({plan.workspace_bytes / static_cast<int64_t>(sizeof(float))},
                             query.options().dtype(at::kFloat));
    args.workspace = workspace.data_ptr<float>();
  }
  check_launch(shoal::paged_attention(args, current_stream(device)), "paged_attention");
}

void check_pool(const at::Tensor& pool, const char* name) {
  TORCH_CHECK(pool.dim() == 6 && pool.size(1) == 2, name,
              " must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], got ", pool.sizes());
  TORCH_CHECK(pool.is_contiguous(), name, " must be contiguous");
  scalar_type(pool);
}

// The address a kernel on `device` uses for `pool`: its own for device memory,
// the mapped address of pinned host memory.
void* kernel_address(const at::Tensor& pool, const c10::Device& device, const char* name) {
  if (pool.is_cuda()) {
    check_on(pool, device, name);
    return pool.data_ptr();
  }
  TORCH_CHECK(pool.device().is_cpu() && pool.is_pinned(), name,
              " must be on the CUDA device or in pinned CPU memory (tensor.pin_memory())");
  void* mapped = nullptr;
  const cudaError_t error = shoal::mapped_device_pointer(pool.data_ptr(), &mapped);
  TORCH_CHECK(error == cudaSuccess, name, " is pinned but has no device mapping: ", cudaGetErrorString(error));
  return mapped;
}

void launch_copy(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping,
                 const char* op) {
  const c10::Device device = src.is_cuda() ? src.device() : dst.device();
  TORCH_CHECK(device.is_cuda(), op, ": one of the pools must be a CUDA tensor");
  check_index(block_mapping, at::kLong, 2, "block_mapping");
  TORCH_CHECK(block_mapping.size(1) == 2, "block_mapping must be [num_pairs, 2], got ", block_mapping.sizes());
  check_on(block_mapping, device, "block_mapping");

  const c10::DeviceGuard guard(device);
  shoal::CopyBlocksArgs args{};
  args.src = kernel_address(src, device, "src_cache");
  args.dst = kernel_address(dst, device, "dst_cache");
  args.block_mapping = block_mapping.data_ptr<int64_t>();
  args.num_pairs = block_mapping.size(0);
  args.num_planes = src.size(0) * 2;
  args.src_num_blocks = src.size(2);
  args.dst_num_blocks = dst.size(2);
  args.block_bytes = src.size(3) * src.size(4) * src.size(5) * src.element_size();
  check_launch(shoal::copy_blocks(args, current_stream(device)), op);
}

void copy_blocks(at::Tensor& kv_cache, const at::Tensor& block_mapping) {
  check_pool(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_cuda(), "copy_blocks: kv_cache must be a CUDA tensor");
  launch_copy(kv_cache, kv_cache, block_mapping, "copy_blocks");
}

void swap_blocks(const at::Tensor& src_cache, at::Tensor& dst_cache, const at::Tensor& block_mapping) {
  check_pool(src_cache, "src_cache");
  check_pool(dst_cache, "dst_cache");
  TORCH_CHECK(src_cache.scalar_type() == dst_cache.scalar_type(), "swap_blocks: pools differ in dtype");
  TORCH_CHECK(src_cache.size(0) == dst_cache.size(0) && src_cache.size(3) == dst_cache.size(3) &&
                  src_cache.size(4) == dst_cache.size(4) && src_cache.size(5) == dst_cache.size(5),
              "swap_blocks: pools differ in more than their block count: ", src_cache.sizes(), " vs ",
              dst_cache.sizes());
  launch_copy(src_cache, dst_cache, block_mapping, "swap_blocks");
}

void check_matrix(const at::Tensor& tensor, const at::Tensor& like, const char* name) {
  TORCH_CHECK(tensor.dim() == 2, name, " must be 2-D, got ", tensor.sizes());
  TORCH_CHECK(tensor.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(), ", got ",
              tensor.scalar_type());
  TORCH_CHECK(tensor.size(1) == 0 || tensor.stride(1) == 1, name, "'s last dim must be contiguous");
  check_on(tensor, like.device(), name);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              const std::optional<at::Tensor>& residual) {
  const c10::Device device = x.device();
  TORCH_CHECK(device.is_cuda(), "rms_norm: x must be a CUDA tensor");
  check_matrix(x, x, "x");
  check_matrix(out, x, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", x.sizes(), ", got ", out.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [", x.size(1), "] of x's dtype");
  check_on(weight, device, "weight");
  const c10::DeviceGuard guard(device);
  shoal::RmsNormArgs args{};
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.weight = weight.data_ptr();
  args.num_rows = x.size(0);
  args.hidden = x.size(1);
  args.out_stride = out.stride(0);
  args.x_stride = x.stride(0);
  if (residual.has_value()) {
    check_matrix(*residual, x, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
    args.residual = residual->data_ptr();
    args.residual_stride = residual->stride(0);
  }
  args.eps = static_cast<float>(eps);
  args.dtype = scalar_type(x);
  check_launch(shoal::rms_norm(args, current_stream(device)), "rms_norm");
}

void rotary_embedding(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin) {
  const c10::Device device = query.device();
  TORCH_CHECK(device.is_cuda(), "rotary_embedding: query must be a CUDA tensor");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "query and key must be [num_tokens, heads, head_dim], got ", query.sizes(), " and ", key.sizes());
  TORCH_CHECK(query.size(2) % 2 == 0, "head_dim must be even, got ", query.size(2));
  TORCH_CHECK((query.numel() == 0 || query.stride(2) == 1) && (key.numel() == 0 || key.stride(2) == 1),
              "query's and key's last dims must be contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "key must be ", query.scalar_type());
  check_on(key, device, "key");
  check_matrix(cos, query, "cos");
  check_matrix(sin, query, "sin");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.stride(0) == sin.stride(0) && cos.size(0) == query.size(0) &&
                  cos.size(1) == query.size(2),
              "cos and sin must be [num_tokens, head_dim] with one layout, got ", cos.sizes(), " and ", sin.sizes());
  const c10::DeviceGuard guard(device);
  shoal::RotaryArgs args{};
  args.query = query.data_ptr();
  args.key = key.data_ptr();
  args.cos = cos.data_ptr();
  args.sin = sin.data_ptr();
  args.num_tokens = query.size(0);
  args.num_query_heads = query.size(1);
  args.num_key_heads = key.size(1);
  args.head_dim = query.size(2);
  args.query_token_stride = query.stride(0);
  args.query_head_stride = query.stride(1);
  args.key_token_stride = key.stride(0);
  args.key_head_stride = key.stride(1);
  args.cos_sin_stride = cos.stride(0);
  args.dtype = scalar_type(query);
  check_launch(shoal::rotary_embedding(args, current_stream(device)), "rotary_embedding");
}

void silu_mul(at::Tensor& out, const at::Tensor& gate_up) {
  const c10::Device device = gate_up.device();
  TORCH_CHECK(device.is_cuda(), "silu_mul: gate_up must be a CUDA tensor");
  check_matrix(gate_up, gate_up, "gate_up");
  check_matrix(out, gate_up, "out");
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1),
              "gate_up must be [rows, 2 n] and out [rows, n], got ", gate_up.sizes(), " and ", out.sizes());
  const c10::DeviceGuard guard(device);
  shoal::SiluMulArgs args{};
  args.out = out.data_ptr();
  args.gate_up = gate_up.data_ptr();
  args.num_rows = out.size(0);
  args.n = out.size(1);
  args.out_stride = out.stride(0);
  args.gate_up_stride = gate_up.stride(0);
  args.dtype = scalar_type(gate_up);
  check_launch(shoal::silu_mul(args, current_stream(device)), "silu_mul");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Shoal's KV-cache CUDA kernels; call them through shoal.kernels.ops";
  m.def("write_kv", &write_kv, "Write new tokens' K/V into their slots");
  m.def("paged_attention", &paged_attention, "Varlen causal paged attention with GQA", pybind11::arg("out"),
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("query_start_loc"),
        pybind11::arg("scale"), pybind11::arg("partition_length") = 0);
  m.def("copy_blocks", &copy_blocks, "Copy blocks inside one pool, all layers");
  m.def("swap_blocks", &swap_blocks, "Copy blocks between pools (GPU <-> pinned CPU), all layers");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, after an optional residual add");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding of query and key, in place");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
}
