"""Memory math: parameter counts from configs, weights, KV bytes per token, pool sizing."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from shoal.shared.model_memory import (
    GIB,
    MIB,
    count_parameters,
    estimate_from_config,
    estimate_memory_requirements,
    get_dtype_bytes,
    get_model_shape,
    size_kv_pool,
)

LLAMA_2_7B = LlamaConfig(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
)
LLAMA_3_8B = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
QWEN2_7B = Qwen2Config(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)

SMALL_CONFIGS = [
    LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    ),
    LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=97,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=50,
    ),
    Qwen2Config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=120,
        tie_word_embeddings=True,
    ),
    Qwen2Config(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=False,
    ),
    MistralConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=80,
    ),
]


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=lambda c: f"{c.model_type}")
def test_parameter_count_matches_the_real_model(config: object) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert count_parameters(config) == model.num_parameters()


def test_seven_billion_llama_in_fp16_is_13_5_gb_of_weights() -> None:
    shape = get_model_shape(LLAMA_2_7B, "float16")
    assert shape.num_parameters == 6_738_415_616  # Llama-2-7B
    assert shape.weight_bytes == 13_476_831_232
    assert 13.4e9 < shape.weight_bytes < 13.5e9
    assert shape.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # 512 KiB


def test_kv_bytes_use_real_kv_heads_and_head_dim() -> None:
    llama3 = get_model_shape(LLAMA_3_8B, "bfloat16")
    assert llama3.num_parameters == 8_030_261_248  # Llama-3-8B
    assert llama3.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB, not 2 x 32 x 4096 x 2
    qwen = get_model_shape(QWEN2_7B, "bfloat16")
    assert qwen.num_parameters == 7_615_616_512  # Qwen2-7B
    assert qwen.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    explicit = get_model_shape(SMALL_CONFIGS[2], "float32")
    assert explicit.head_dim == 32  # config.head_dim, not hidden_size // heads (16)
    assert explicit.kv_bytes_per_token == 2 * 2 * 1 * 32 * 4


def test_the_meta_device_counts_other_architectures() -> None:
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    assert count_parameters(config) == AutoModelForCausalLM.from_config(config).num_parameters()


def test_estimate_adds_up() -> None:
    shape = get_model_shape(LLAMA_2_7B, "float16")
    estimate = estimate_memory_requirements(
        shape, kv_cache_tokens=4096, max_num_batched_tokens=512, max_num_seqs=32
    )
    assert estimate.weight_bytes == shape.weight_bytes
    assert estimate.kv_cache_bytes == 4096 * 524288 == 2 * GIB
    assert estimate.runtime_overhead_bytes == 512 * MIB
    per_token = 4 * 4096 + (64 + 64) * 128 + 3 * 11008
    logits = 32 * 32000 * 6
    assert estimate.activation_bytes == 512 * per_token * 2 + logits
    assert estimate.total_bytes == (
        estimate.weight_bytes + estimate.kv_cache_bytes + estimate.activation_bytes + 512 * MIB
    )
    assert 15 * GIB < estimate.total_bytes < 15.5 * GIB
    larger = estimate_memory_requirements(shape, kv_cache_tokens=8192)
    assert larger.kv_cache_bytes == 2 * estimate.kv_cache_bytes


def test_estimate_from_config_uses_the_config_dtype() -> None:
    config = LlamaConfig(**{**LLAMA_2_7B.to_dict(), "dtype": "bfloat16"})
    assert estimate_from_config(config, kv_cache_tokens=0).weight_bytes == 13_476_831_232
    assert estimate_from_config(config, 0, dtype="float32").weight_bytes == 2 * 13_476_831_232


def test_a_cpu_worker_runs_a_bfloat16_llama_in_float32_and_is_sized_so() -> None:
    """The native CPU forward keeps bfloat16 only in its products' panels: activations, the
    KV cache, the embedding and the norms are float32, and placement must reserve that."""
    gpu = get_model_shape(LLAMA_3_8B, "bfloat16")
    cpu = get_model_shape(LLAMA_3_8B, "bfloat16", on_cpu=True)
    float32 = get_model_shape(LLAMA_3_8B, "float32")
    assert cpu.kv_bytes_per_token == float32.kv_bytes_per_token == 2 * gpu.kv_bytes_per_token
    embedding, norms = 128256 * 4096, (2 * 32 + 1) * 4096
    assert cpu.num_float32_parameters == embedding + norms
    assert cpu.weight_bytes == gpu.weight_bytes + 2 * (embedding + norms)  # +1 GB: the embedding
    assert cpu.num_parameters == gpu.num_parameters
    cpu_estimate = estimate_from_config(LLAMA_3_8B, 65536, "bfloat16", on_cpu=True, max_num_seqs=32)
    float32_estimate = estimate_from_config(LLAMA_3_8B, 65536, "float32", max_num_seqs=32)
    assert cpu_estimate.kv_cache_bytes == float32_estimate.kv_cache_bytes
    assert cpu_estimate.activation_bytes == float32_estimate.activation_bytes
    qwen = get_model_shape(QWEN2_7B, "bfloat16", on_cpu=True)  # q/k/v biases stay float32 too
    assert qwen.num_float32_parameters == 152064 * 3584 + (2 * 28 + 1) * 3584 + 28 * (3584 + 2 * 512)
    # Everything else is sized as its dtype: float32 and float16 weights on the CPU, other
    # architectures (run by transformers in their own dtype), and any model on a GPU.
    assert get_model_shape(LLAMA_3_8B, "float32", on_cpu=True) == float32
    assert get_model_shape(LLAMA_3_8B, "float16", on_cpu=True) == get_model_shape(LLAMA_3_8B, "float16")
    gemma = GemmaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=100)
    assert get_model_shape(gemma, "bfloat16", on_cpu=True) == get_model_shape(gemma, "bfloat16")


def test_dtype_bytes() -> None:
    assert get_dtype_bytes(torch.bfloat16) == 2
    assert get_dtype_bytes("torch.float32") == 4
    assert get_dtype_bytes("float16") == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        get_dtype_bytes("complex64")


def test_size_kv_pool() -> None:
    assert (
        size_kv_pool(allocation_bytes=10_000, weight_bytes=3_000, reserve_bytes=1_000, kv_bytes_per_block=512)
        == 11
    )
    assert size_kv_pool(4_000, 3_000, 1_500, 512) == 0
    shape = get_model_shape(LLAMA_3_8B, "bfloat16")
    num_blocks = size_kv_pool(24 * GIB, shape.weight_bytes, 2 * GIB, shape.get_kv_bytes_per_block(16))
    assert num_blocks == (24 * GIB - shape.weight_bytes - 2 * GIB) // (16 * 131072)
