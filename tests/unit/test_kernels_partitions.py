"""The CUDA launcher's context partitions (kernels/csrc/attention_partitions.h), on the CPU.

The header is plain C: compiled here with the system C compiler, the same function the
CUDA launcher calls is checked without a GPU (split by row length into 512-position
partitions, shorter ones only to fill the SMs, the grid and workspace limits).
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from shoal.kernels import cpu_build

HEADER = Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "attention_partitions.h"
H100_SMS = 132
NO_LIMIT = 0
WORKSPACE_LIMIT = 256 << 20  # paged_attention.cu's kMaxWorkspaceBytes


class Plan(ctypes.Structure):
    _fields_ = [
        ("num_partitions", ctypes.c_int64),
        ("partition_length", ctypes.c_int64),
        ("workspace_bytes", ctypes.c_int64),
    ]


@pytest.fixture(scope="module")
def plan_partitions(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    try:
        compiler = cpu_build.default_compiler()
    except cpu_build.NativeBuildError as exc:
        pytest.skip(str(exc))
    build = tmp_path_factory.mktemp("partitions")
    shim = build / "shim.c"
    shim.write_text(
        f'#include "{HEADER}"\n'
        "void plan(int64_t t, int64_t kv, int64_t h, int64_t d, int64_t c, int64_t w, int64_t sms,\n"
        "          int64_t max_ws, ShoalPartitionPlan* out) {\n"
        "  *out = shoal_plan_partitions(t, kv, h, d, c, w, sms, max_ws);\n"
        "}\n"
    )
    library = build / "libshim.so"
    subprocess.run([*compiler, "-O1", "-std=c11", "-Wall", "-Werror", "-fPIC", "-shared", str(shim), "-o",
                    str(library)], check=True, capture_output=True, timeout=60)
    lib = ctypes.CDLL(str(library))
    lib.plan.argtypes = [ctypes.c_int64] * 8 + [ctypes.POINTER(Plan)]

    def call(num_tokens: int, num_kv_heads: int, num_heads: int, width: int, *, head_dim: int = 128,
             num_sms: int = H100_SMS, max_workspace: int = WORKSPACE_LIMIT) -> Plan:
        head_chunks = -(-(num_heads // num_kv_heads) // 8)
        out = Plan()
        lib.plan(num_tokens, num_kv_heads, num_heads, head_dim, head_chunks, width, num_sms, max_workspace,
                 ctypes.byref(out))
        return out

    return call


def test_a_long_row_in_a_big_batch_is_split_in_512_position_partitions(plan_partitions) -> None:
    # 64 decode rows, one of them 32K long: the old whole-grid rule left it unsplit (64 x 8
    # blocks already exceed 2 x 132), one thread block per head chunk over 32K positions.
    plan = plan_partitions(64, 8, 32, 32768)
    assert plan.num_partitions == 64
    assert plan.partition_length == 512
    assert plan.workspace_bytes == 64 * 32 * 64 * (128 + 2) * 4


def test_short_contexts_are_not_split(plan_partitions) -> None:
    plan = plan_partitions(256, 8, 32, 256)
    assert (plan.num_partitions, plan.partition_length, plan.workspace_bytes) == (1, 256, 0)
    # Long enough for two partitions: a split, rows of one partition are written directly.
    assert plan_partitions(256, 8, 32, 1024).num_partitions == 2


def test_a_small_batch_gets_shorter_partitions_to_fill_the_sms(plan_partitions) -> None:
    # One decode row, 8 kv heads, a 2K context: 4 partitions of 512 give 32 thread blocks of
    # the 264 wanted; partitions shrink to the 256-position minimum (64 blocks).
    plan = plan_partitions(1, 8, 32, 2048)
    assert (plan.num_partitions, plan.partition_length) == (8, 256)
    # With a long context, 512-position partitions already fill the GPU: they stay 512.
    plan = plan_partitions(1, 8, 32, 32768)
    assert (plan.num_partitions, plan.partition_length) == (64, 512)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 4096])
@pytest.mark.parametrize("width", [257, 1000, 4096, 32768, 131072, 1 << 20])
def test_partitions_cover_the_width_within_the_grid_and_workspace_limits(plan_partitions, num_tokens, width) -> None:
    plan = plan_partitions(num_tokens, 8, 32, width)
    assert plan.num_partitions * plan.partition_length >= width
    assert (plan.num_partitions - 1) * plan.partition_length < width  # no partition past the width
    assert plan.num_partitions <= 65535
    assert plan.workspace_bytes <= WORKSPACE_LIMIT
    if plan.num_partitions > 1:
        assert plan.partition_length >= 256


def test_the_grid_limit_lengthens_partitions(plan_partitions) -> None:
    # 64 query heads per kv head: 8 head chunks, so at most 65535 // 8 partitions.
    plan = plan_partitions(1, 1, 64, 8 << 20, head_dim=64, max_workspace=NO_LIMIT)
    assert plan.num_partitions <= 65535 // 8
    assert plan.num_partitions * plan.partition_length >= 8 << 20


def test_many_long_prefill_rows_double_the_partition_length_to_bound_the_workspace(plan_partitions) -> None:
    unbounded = plan_partitions(2048, 8, 32, 32768, max_workspace=NO_LIMIT)
    assert unbounded.workspace_bytes > WORKSPACE_LIMIT
    bounded = plan_partitions(2048, 8, 32, 32768)
    assert bounded.workspace_bytes <= WORKSPACE_LIMIT
    assert bounded.partition_length in (1024, 2048, 4096, 8192, 16384)

