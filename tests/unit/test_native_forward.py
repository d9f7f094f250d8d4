"""The native CPU forward pass (`native_forward`, kernels/csrc/cpu_model.c and cpu_gemm.c):
packed products against torch on random shapes and every code path, logits against
transformers' forward for prefill and decode batches, the same bits on any thread count,
and the models it leaves to transformers. Greedy output equal to `generate` through the
engine: test_engine_correctness.py (which runs this path for the Llama and Qwen2 models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, MistralConfig

from shoal.cli.demo_models import make_demo_models
from shoal.kernels import cpu_kernels, layer_reference
from shoal.kernels.attention_plan import plan_attention
from shoal.kernels.cpu_model import ISA_NAMES, ForwardError, PackedLinear, get_gemm_isa
from shoal.services.worker.engine import native_forward
from shoal.services.worker.engine.attention import PagedBatch
from shoal.services.worker.engine.model_runner import ModelRunner

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_demo_models(root, names=("demo/llama-5m", "demo/qwen2-25m"))
    return root


def available_isas(native: cpu_kernels.CpuKernels) -> list[int]:
    return list(range(get_gemm_isa(native) + 1))


product_cases = given(
    rows=st.integers(1, 40),
    num_out=st.integers(1, 130),
    num_in=st.integers(1, 150),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
"""Random product shapes (partial last panels, odd inputs, with and without a bias)."""


def make_product(seed: int, rows: int, num_out: int, num_in: int, with_bias: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A `product_cases` case's weight, bias (or None) and input rows."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=generator)
    bias = torch.randn(num_out, generator=generator) if with_bias else None
    return weight, bias, torch.randn(rows, num_in, generator=generator)


@settings(max_examples=30, deadline=None)
@product_cases
def test_packed_products_match_torch_on_every_code_path_and_thread_count(
    native: cpu_kernels.CpuKernels, rows: int, num_out: int, num_in: int, with_bias: bool, seed: int
) -> None:
    weight, bias, x = make_product(seed, rows, num_out, num_in, with_bias)
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    packed = PackedLinear(native, weight, bias)
    for isa in available_isas(native):
        one_thread = packed.forward(x, isa=isa)
        torch.testing.assert_close(one_thread.double(), expected, rtol=1e-5, atol=1e-5 * num_in**0.5,
                                   msg=lambda m, isa=isa: f"{ISA_NAMES[isa]}: {m}")
        for threads in (2, 3):  # each column is summed by one thread, in one order: the same bits
            assert torch.equal(packed.forward(x, isa=isa, num_threads=threads), one_thread)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 30), blocks=st.integers(1, 6), num_in=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_the_gate_up_product_fuses_silu_times_up(
    native: cpu_kernels.CpuKernels, rows: int, blocks: int, num_in: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    intermediate = 16 * blocks
    weight = torch.randn(2 * intermediate, num_in, generator=generator)
    bias = torch.randn(2 * intermediate, generator=generator)
    x = torch.randn(rows, num_in, generator=generator)
    gate_up = torch.nn.functional.linear(x, weight, bias)
    expected = torch.empty(rows, intermediate)
    layer_reference.silu_mul(expected, gate_up)
    packed = PackedLinear(native, weight, bias, silu_mul=True)
    for isa in available_isas(native):
        torch.testing.assert_close(packed.forward(x, isa=isa), expected, rtol=1e-4, atol=1e-4)


def test_a_code_path_the_cpu_lacks_is_refused(native: cpu_kernels.CpuKernels) -> None:
    packed = PackedLinear(native, torch.randn(4, 4))
    if get_gemm_isa(native) < 2:
        with pytest.raises(ValueError, match="not available"):
            packed.forward(torch.randn(1, 4), isa=2)
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(native, torch.randn(4, 4, dtype=torch.float64))


class Sequences:
    """A few sequences in a runner's KV pool, fed step by step through the native forward."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.tokens = [list(p) for p in prompts]
        self.num_computed = [0] * len(prompts)
        blocks_each = 64 // BLOCK_SIZE
        self.tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
        self.argmaxes: list[torch.Tensor | None] = []

    def step(self, want_logits: bool = True) -> torch.Tensor:
        """Computes every token not yet computed (a prefill, or one decode row per sequence):
        the logits of each sequence's last row, or of none (a chunk that does not end its
        prompt)."""
        input_ids, positions, slots, seq_lens, starts, last_rows = [], [], [], [], [0], []
        for seq, tokens in enumerate(self.tokens):
            for position in range(self.num_computed[seq], len(tokens)):
                input_ids.append(tokens[position])
                positions.append(position)
                slots.append(self.tables[seq][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            seq_lens.append(len(tokens))
            starts.append(len(input_ids))
            last_rows.append(len(input_ids) - 1)
            self.num_computed[seq] = len(tokens)
        plan = plan_attention(self.runner.layer_caches[0][0], self.tables, seq_lens, starts)
        batch = PagedBatch(layer_caches=self.runner.layer_caches, slot_mapping=torch.tensor(slots), cpu_plan=plan)
        assert self.runner.native is not None
        if not want_logits:
            last_rows = []
        keep: int | torch.Tensor = 0 if len(last_rows) == len(input_ids) else torch.tensor(last_rows, dtype=torch.int64)
        logits = self.runner.native.execute(torch.tensor([input_ids]), torch.tensor([positions]), batch, keep).clone()
        argmax = self.runner.native.last_argmax
        self.argmaxes.append(None if argmax is None else argmax.clone())
        return logits

    def greedy(self, num_decode_steps: int) -> list[torch.Tensor]:
        """The prefills' logits, then those of `num_decode_steps` greedy decode rows per sequence."""
        steps = [self.step()]
        for _ in range(num_decode_steps):
            for seq, tokens in enumerate(self.tokens):
                tokens.append(int(steps[-1][seq].argmax()))
            steps.append(self.step())
        return steps


def hf_last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m"])
@pytest.mark.parametrize("prefill_attention", ["rows", "tiled", "torch"])
def test_logits_match_transformers_for_prefill_and_decode_on_any_thread_count(
    models_root: Path, key: str, prefill_attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if prefill_attention != "rows":  # every prefill row as a decode sequence (short prefills)
        monkeypatch.setattr(native_forward, "MAX_NATIVE_PREFILL_SCORES", 0)
    if prefill_attention == "torch":  # every prefill through the per-layer torch callback
        monkeypatch.setattr(native_forward, "NATIVE_LONG_PREFILL", False)
    reference = AutoModelForCausalLM.from_pretrained(models_root / key).eval()
    model = AutoModelForCausalLM.from_pretrained(models_root / key).eval()
    assert native_forward.get_unsupported_reason(model) is None
    packed = native_forward.pack_model(model)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 4000, (length,), generator=generator).tolist() for length in (5, 17, 33)]
    logits_by_threads = []
    for threads in (1, 2):
        runner = ModelRunner(model, 3 * 64 // BLOCK_SIZE, BLOCK_SIZE, packed_model=packed,
                             threads=native_forward.ThreadPolicy(max_threads=threads, fixed=threads))
        sequences = Sequences(runner, prompts)
        steps = sequences.greedy(3)  # the prefills, then decode rows only: everything native
        for step, logits in enumerate(steps):
            for seq, tokens in enumerate(sequences.tokens):
                expected = hf_last_logits(reference, tokens[: len(tokens) - 3 + step])
                torch.testing.assert_close(logits[seq], expected, rtol=1e-4, atol=1e-4)
            argmax = sequences.argmaxes[step]
            if packed.lm_head is not None:  # computed in C with the logits
                assert argmax is not None and torch.equal(argmax, logits.argmax(dim=-1))
        logits_by_threads.append(steps)
    for one, two in zip(*logits_by_threads, strict=True):
        assert torch.equal(one, two), "thread count must not change a single bit"


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m"])
@pytest.mark.parametrize("num_prompts", [1, 2])
def test_fewer_sequences_than_threads_split_their_kv_heads_with_the_same_bits(
    models_root: Path, key: str, num_prompts: int
) -> None:
    """A decode step of fewer sequences than threads (one user's chat) cuts each sequence's kv
    heads between the threads (cpu_model.c): every head still gets transformers' logits, and
    the bits of one thread."""
    reference = AutoModelForCausalLM.from_pretrained(models_root / key).eval()
    model = AutoModelForCausalLM.from_pretrained(models_root / key).eval()
    packed = native_forward.pack_model(model)
    assert packed.num_kv_heads >= 2  # something to split
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, 4000, (length,), generator=generator).tolist() for length in (40, 23)[:num_prompts]]
    logits_by_threads = []
    for threads in (1, 2, 3):
        runner = ModelRunner(model, 2 * 64 // BLOCK_SIZE, BLOCK_SIZE, packed_model=packed,
                             threads=native_forward.ThreadPolicy(max_threads=threads, fixed=threads))
        sequences = Sequences(runner, prompts)
        steps = sequences.greedy(3)
        for seq, tokens in enumerate(sequences.tokens):
            torch.testing.assert_close(steps[-1][seq], hf_last_logits(reference, tokens), rtol=1e-4, atol=1e-4)
        logits_by_threads.append(steps)
    for steps in logits_by_threads[1:]:
        for one, other in zip(logits_by_threads[0], steps, strict=True):
            assert torch.equal(one, other), "thread count must not change a single bit"


@pytest.mark.parametrize("prefill_attention", ["rows", "tiled"])
def test_the_last_layer_runs_for_the_wanted_rows_only_and_writes_the_same_cache(
    models_root: Path, prefill_attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that wants fewer rows' logits than it holds (cpu_model.c's tail): the prompts'
    first chunks want none, their last chunks one row each. Every layer's K/V is bit for bit
    that of a pass computing the whole last layer, the wanted rows' logits match it and
    transformers, and the decode steps after it are the same bits."""
    if prefill_attention == "tiled":
        monkeypatch.setattr(native_forward, "MAX_NATIVE_PREFILL_SCORES", 0)
    reference = AutoModelForCausalLM.from_pretrained(models_root / "demo/llama-5m").eval()
    model = AutoModelForCausalLM.from_pretrained(models_root / "demo/llama-5m").eval()
    packed = native_forward.pack_model(model)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 4000, (length,), generator=generator).tolist() for length in (9, 30, 21)]
    results = []
    for wanted_rows_only in (True, False):
        monkeypatch.setattr(native_forward, "LAST_LAYER_WANTED_ROWS_ONLY", wanted_rows_only)
        runner = ModelRunner(model, 3 * 64 // BLOCK_SIZE, BLOCK_SIZE, packed_model=packed,
                             threads=native_forward.ThreadPolicy(max_threads=2, fixed=2))
        sequences = Sequences(runner, [prompt[: len(prompt) // 2] for prompt in prompts])
        first_chunks = sequences.step(want_logits=False)
        assert first_chunks.shape[0] == 0
        sequences.tokens = [list(prompt) for prompt in prompts]
        steps = [sequences.step()]
        for _ in range(2):
            for seq, tokens in enumerate(sequences.tokens):
                tokens.append(int(steps[-1][seq].argmax()))
            steps.append(sequences.step())
        for seq, tokens in enumerate(sequences.tokens):
            torch.testing.assert_close(steps[-1][seq], hf_last_logits(reference, tokens), rtol=1e-4, atol=1e-4)
        caches = [tensor.clone() for layer in runner.layer_caches for tensor in layer]
        results.append((steps, caches))
    (tail_steps, tail_caches), (whole_steps, whole_caches) = results
    assert all(torch.equal(one, other) for one, other in zip(tail_caches, whole_caches, strict=True))
    torch.testing.assert_close(tail_steps[0], whole_steps[0], rtol=1e-5, atol=1e-5)
    assert not torch.equal(tail_steps[0], whole_steps[0]) or prefill_attention == "rows", (
        "the tiled kernel and the decode kernel sum in another order: equal bits would mean no tail ran"
    )
    for one, other in zip(tail_steps[1:], whole_steps[1:], strict=True):
        assert torch.equal(one, other), "decode steps over the same cache are the same bits"


def test_a_batch_with_an_index_out_of_range_is_refused(models_root: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(models_root / "demo/llama-5m").eval()
    runner = ModelRunner(model, 48, BLOCK_SIZE, packed_model=native_forward.pack_model(model))
    sequences = Sequences(runner, [[5, 6, 7]])
    sequences.tokens[0][1] = model.config.vocab_size  # not a token
    with pytest.raises(ForwardError, match="vocabulary"):
        sequences.step()


def test_models_it_does_not_run_stay_on_transformers(models_root: Path) -> None:
    llama = AutoModelForCausalLM.from_pretrained(models_root / "demo/llama-5m")
    assert "bfloat16" in (native_forward.get_unsupported_reason(llama.to(torch.bfloat16)) or "")
    mistral = AutoModelForCausalLM.from_config(MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=300,
    ))
    assert "head_dim 24" in (native_forward.get_unsupported_reason(mistral) or "")


def test_packing_twice_returns_the_first_packing(models_root: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(models_root / "demo/llama-5m")
    parameter_bytes = sum(p.numel() * 4 for name, p in model.named_parameters() if "proj" in name or "lm_head" in name)
    packed = native_forward.pack_model(model)
    assert packed.nbytes == parameter_bytes, "the panels hold exactly the products' weights (dims multiples of 32)"
    assert all(p.numel() == 0 for name, p in model.named_parameters() if "proj" in name)
    assert native_forward.pack_model(model) is packed


def test_auto_threads_share_only_large_passes() -> None:
    policy = native_forward.ThreadPolicy(max_threads=2)
    assert policy.get_num_threads(1, 740_000) == 1  # llama-5m, one sequence
    assert policy.get_num_threads(8, 740_000) == 2
    assert policy.get_num_threads(1, 7_470_000) == 2  # llama-100m: its weights stream from memory
    assert native_forward.ThreadPolicy(max_threads=1).get_num_threads(1000, 10**9) == 1
    assert native_forward.ThreadPolicy(max_threads=4, fixed=3).get_num_threads(1, 1) == 3
