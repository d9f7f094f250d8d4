"""Every CUDA source compiles for sm_80 and sm_90 (compile only: no GPU needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_kernels.sh"


@pytest.mark.skipif(
    shutil.which("nvcc") is None, reason="nvcc is not on PATH: the CUDA compile check needs it"
)
def test_cuda_kernels_compile_for_sm80_and_sm90() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHON": sys.executable, "SHOAL_CUDA_ARCHS": "80 90"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("cache_ops.cu:sm_80", "cache_ops.cu:sm_90", "paged_attention.cu:sm_80", "bindings.cpp:host"):
        assert f"ok      {name}" in result.stdout
