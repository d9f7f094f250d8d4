"""The native CPU write_kv (kernels/csrc/cpu_cache_ops.c): bit-identical to the torch
implementation on both store paths, its build cached and reused, and the torch
implementation serving when the build fails."""

from __future__ import annotations

import ctypes
import math
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from shoal.kernels import cpu_build, cpu_kernels, ops, reference
from shoal.kernels.settings import KernelSettings

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {4: torch.int32, 2: torch.int16}
NEVER_STREAM = 1 << 62



@pytest.fixture
def process_choice() -> Iterator[None]:
    """Restores this process's choice of implementation after a test that changes it."""
    previous = cpu_kernels.try_load()
    yield
    cpu_kernels.use(previous)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaN payloads and infinities included) viewed as `dtype`."""
    bits = _BITS[dtype.itemsize]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=generator).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()]))


def head_major(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with token stride head_dim and head stride num_tokens * head_dim (a
    transposed [heads, tokens, head_dim] tensor): no token's row is contiguous."""
    return tensor.transpose(0, 1).contiguous().transpose(0, 1)


def token_strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values as rows of a wider tensor (a fused QKV projection's K part)."""
    num_tokens, num_heads, head_dim = tensor.shape
    wide = torch.empty(num_tokens, 3 * num_heads, head_dim, dtype=tensor.dtype)
    wide[:, num_heads : 2 * num_heads] = tensor
    return wide[:, num_heads : 2 * num_heads]


def misaligned_cache(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A contiguous cache starting one element past a 16-byte boundary: the streaming
    path's unaligned head and tail of every row."""
    flat = random_bits((math.prod(shape) + 1,), dtype, generator)
    return flat[1:].view(shape)


def unaligned(tensor: torch.Tensor) -> torch.Tensor:
    """The same values one element past a 16-byte boundary, rows one element apart from it."""
    num_tokens, num_heads, head_dim = tensor.shape
    wide = torch.empty(num_tokens, num_heads, head_dim + 1, dtype=tensor.dtype)
    wide[:, :, 1:] = tensor
    return wide[:, :, 1:]


LAYOUTS = {
    "contiguous": lambda tensor: tensor,
    "head_major": head_major,
    "token_strided": token_strided,
    "unaligned": unaligned,
}


def check_against_torch(
    native: cpu_kernels.CpuKernels,
    *,
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_tokens: int,
    padding: float,
    layout: str,
    stream_min_bytes: int | None,
    seed: int,
) -> None:
    """The native kernel's write against `reference.write_kv_torch`'s, both on random bits.

    Args:
        layout: how key and value are laid out (`LAYOUTS`); "unaligned" misaligns the
            caches too.
        stream_min_bytes: the kernel's threshold (0: streaming stores, None: the default).
    """
    generator = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    shape = (num_blocks, block_size, num_heads, head_dim)
    make_cache = misaligned_cache if layout == "unaligned" else random_bits
    key_cache, value_cache = make_cache(shape, dtype, generator), make_cache(shape, dtype, generator)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    make = LAYOUTS[layout]
    key = make(random_bits((num_tokens, num_heads, head_dim), dtype, generator))
    value = make(random_bits((num_tokens, num_heads, head_dim), dtype, generator))
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < padding] = -1

    wrote = native.write_kv(key, value, key_cache, value_cache, slots, stream_min_bytes=stream_min_bytes)
    reference.write_kv_torch(key, value, expected_key, expected_value, slots)

    assert wrote
    assert same_bits(key_cache, expected_key)
    assert same_bits(value_cache, expected_value)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from((1, 8, 16, 32)),
    num_heads=st.sampled_from((1, 2, 4, 8)),
    head_dim=st.sampled_from((32, 64, 80, 96, 128, 256)),
    dtype=st.sampled_from(DTYPES),
    num_tokens=st.integers(0, 48),
    padding=st.sampled_from((0.0, 0.3)),
    layout=st.sampled_from(tuple(LAYOUTS)),
    streaming=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_write_kv_matches_torch_bit_for_bit(
    native, block_size, num_heads, head_dim, dtype, num_tokens, padding, layout, streaming, seed
) -> None:
    check_against_torch(
        native,
        block_size=block_size,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        num_tokens=num_tokens,
        padding=padding,
        layout=layout,
        stream_min_bytes=0 if streaming else NEVER_STREAM,
        seed=seed,
    )


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("layout", tuple(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layout_and_store_path(native, dtype, layout, streaming) -> None:
    check_against_torch(
        native,
        block_size=16,
        num_heads=4,
        head_dim=128,
        dtype=dtype,
        num_tokens=40,
        padding=0.2,
        layout=layout,
        stream_min_bytes=0 if streaming else NEVER_STREAM,
        seed=1,
    )


def test_writes_on_both_sides_of_the_default_threshold(native) -> None:
    """`STREAM_MIN_BYTES` itself picks the store path: a decode step's few rows, and a write just past it."""
    row_bytes = 8 * 128 * 2
    for num_tokens in (16, cpu_kernels.STREAM_MIN_BYTES // (2 * row_bytes) + 1):
        check_against_torch(
            native,
            block_size=16,
            num_heads=8,
            head_dim=128,
            dtype=torch.bfloat16,
            num_tokens=num_tokens,
            padding=0.0,
            layout="contiguous",
            stream_min_bytes=None,
            seed=2,
        )


def test_a_slot_past_the_pool_raises_and_writes_nothing(native) -> None:
    key_cache = torch.zeros(2, 4, 1, 32)
    value_cache = torch.zeros_like(key_cache)
    key = torch.ones(3, 1, 32)
    with pytest.raises(IndexError, match="slot 8"):
        native.write_kv(key, key, key_cache, value_cache, torch.tensor([0, 8, 1]))
    assert not key_cache.any() and not value_cache.any()


def test_tensors_it_does_not_take_are_left_to_torch(native) -> None:
    key_cache = torch.zeros(4, 4, 2, 32)
    key = torch.ones(3, 2, 32)
    slots = torch.tensor([0, 5, 9])
    declined = [
        (key, key, key_cache.transpose(0, 1), key_cache.transpose(0, 1), slots),  # cache not contiguous
        (key.double(), key.double(), key_cache.double(), key_cache.double(), slots),  # 8-byte elements
        (key.half(), key, key_cache, key_cache.clone(), slots),  # mixed dtypes
        (key, key, key_cache, key_cache.clone(), slots.int()),  # int32 slots
        (key[:2], key[:2], key_cache, key_cache.clone(), slots),  # fewer rows than slots
        (key.transpose(1, 2).contiguous().transpose(1, 2), key, key_cache, key_cache.clone(), slots),
    ]
    for arguments in declined:
        assert not native.write_kv(*arguments)
    assert not key_cache.any()


def test_cpu_write_kv_runs_the_native_kernel_or_torch_with_the_same_results(native, process_choice) -> None:
    generator = torch.Generator().manual_seed(3)
    shape = (6, 16, 2, 64)
    key = head_major(random_bits((50, 2, 64), torch.bfloat16, generator))
    slots = torch.randperm(96, generator=generator)[:50]
    slots[::7] = -1
    results = []
    for choice in (native, None):
        cpu_kernels.use(choice)
        key_cache, value_cache = (
            torch.zeros(shape, dtype=torch.bfloat16),
            torch.zeros(shape, dtype=torch.bfloat16),
        )
        ops.write_kv(key, key, key_cache, value_cache, slots)
        results.append(key_cache)
    assert same_bits(results[0], results[1])


# --- the build ------------------------------------------------------------------


def fake_compiler(directory: Path, body: str) -> list[str]:
    """A compiler command: a shell script answering --version, then running `body`."""
    script = directory / "fake-cc"
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo fake-cc 1.0; exit 0; fi\n{body}\n')
    script.chmod(0o755)
    return [str(script)]


def counting_compiler(directory: Path) -> tuple[list[str], Path]:
    """The machine's compiler behind a script that counts compiles (not --version calls)."""
    real = cpu_build.default_compiler()
    count = directory / "compiles"
    command = fake_compiler(directory, f'echo compile >> "{count}"\nexec {" ".join(real)} "$@"')
    return command, count


def tiny_source(directory: Path) -> Path:
    """A C source that compiles in milliseconds, for the tests of the build's caching."""
    source = directory / "tiny.c"
    source.write_text("int shoal_tiny(void) { return 1; }\n")
    return source


def num_compiles(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def test_a_second_load_reuses_the_cached_build(tmp_path) -> None:
    """The cache's rules, on a small source (the real one takes seconds to compile; the
    `native` fixture builds and loads it)."""
    compiler, count = counting_compiler(tmp_path)
    cache = tmp_path / "cache"
    tiny = tiny_source(tmp_path)
    first = cpu_build.build(compiler, [cache], [tiny])
    second = cpu_build.build(compiler, [cache], [tiny])
    assert first == second and num_compiles(count) == 1
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert ctypes.CDLL(str(second)).shoal_tiny() == 1
    # A changed source is another build next to it.
    tiny.write_text(tiny.read_text() + "/* changed */\n")
    assert cpu_build.build(compiler, [cache], [tiny]) != first
    assert num_compiles(count) == 2


def test_a_directory_others_can_write_is_not_used(native, tmp_path) -> None:
    compiler, _ = counting_compiler(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    private = tmp_path / "private"
    assert cpu_build.build(compiler, [shared, private], [tiny_source(tmp_path)]).parent == private
    assert not list(shared.iterdir())


def test_a_failed_build_falls_back_to_torch_and_says_why(tmp_path, process_choice) -> None:
    compiler = fake_compiler(tmp_path, 'echo "fake-cc: error: out of luck" >&2\nexit 1')
    with capture_logs() as logs:
        kernels = cpu_kernels.select(KernelSettings(), compiler, [tmp_path / "cache"])
    assert kernels is None
    (event,) = logs
    assert event["event"] == "kernels.cpu_native_unavailable" and event["log_level"] == "warning"
    assert "out of luck" in event["error"]
    assert not [path for path in (tmp_path / "cache").iterdir()], "no partial library is left behind"

    cpu_kernels.use(kernels)
    key_cache = torch.zeros(3, 4, 2, 32)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(5, 2, 32)
    slots = torch.tensor([3, -1, 11, 0, 7])
    reference.write_kv(key, key, key_cache, value_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache.view(12, 2, 32)[slot], key[token])


def test_a_missing_compiler_or_the_torch_choice_selects_torch(tmp_path) -> None:
    with capture_logs() as logs:
        assert cpu_kernels.select(KernelSettings(), [str(tmp_path / "no-such-cc")], [tmp_path]) is None
    assert "does not run" in logs[0]["error"]
    with capture_logs() as logs:
        assert cpu_kernels.select(KernelSettings(cpu="torch"), [str(tmp_path / "no-such-cc")]) is None
    assert logs == []


def test_the_torch_setting_writes_with_torch_and_builds_nothing(native, kernel_settings) -> None:
    """``cpu = "torch"`` (configured): the process's choice is the torch implementation, and
    `reference.write_kv` gives what `write_kv_torch` gives; back to ``native``, the library."""
    kernel_settings(cpu="torch")
    assert cpu_kernels.try_load() is None
    key = torch.randn(5, 2, 32)
    slots = torch.tensor([3, -1, 11, 0, 7])
    key_cache, expected = torch.zeros(3, 4, 2, 32), torch.zeros(3, 4, 2, 32)
    reference.write_kv(key, key, key_cache, key_cache.clone(), slots)
    reference.write_kv_torch(key, key, expected, expected.clone(), slots)
    assert torch.equal(key_cache, expected)
    kernel_settings(cpu="native")
    assert isinstance(cpu_kernels.try_load(), cpu_kernels.CpuKernels)


def test_cc_from_the_environment_is_split_like_a_shell_would() -> None:
    assert cpu_build.default_compiler({"CC": "ccache gcc -m64"}) == ["ccache", "gcc", "-m64"]
    if shutil.which("cc") or shutil.which("gcc"):
        assert Path(cpu_build.default_compiler({})[0]).name in ("cc", "gcc")
