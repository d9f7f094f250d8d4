"""Builds Shoal's native CPU kernels (kernels/csrc/*.c) into one library, cached per user.

Plain C without torch headers: the system C compiler (``$CC``, else ``cc``, else
``gcc``) builds it in a few seconds, the first time a process needs it, into a
per-user cache directory keyed by a hash of the sources, the flags and the
compiler, so later processes load it without compiling. No ``-march``: the
cached library may be used on another machine of the same architecture (the
attention kernel picks its AVX2 code at run time). `shoal.kernels.cpu_kernels`
loads what this builds.

Only standard build variables are read from the environment: ``CC``, and
``XDG_CACHE_HOME`` for the cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from shoal.shared.errors import ShoalError

log = structlog.get_logger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = _CSRC / "cpu_cache_ops.c"
ATTENTION_SOURCE = _CSRC / "cpu_attention.c"
SOURCES = (
    SOURCE,
    ATTENTION_SOURCE,
    _CSRC / "cpu_threads.c",
    _CSRC / "cpu_gemm.c",
    _CSRC / "cpu_fused.c",
    _CSRC / "cpu_model.c",
    _CSRC / "cpu_prefill_attention.c",
)
"""What the library is compiled from (and its cache key hashes, with `HEADERS`)."""
HEADERS = (_CSRC / "cpu_model.h", _CSRC / "cpu_vec.h")
"""Included by the sources: part of the cache key, not of the compile command."""
LIBRARY_STEM = "shoal_cpu_kernels"
"""The built library is ``<stem>-<hash>.so`` in the cache directory."""
ABI_VERSION = 6
"""What ``shoal_cpu_kernels_abi()`` must return: the C signatures `shoal.kernels.cpu_kernels`
calls. Part of the cache key."""
COMPILE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=fast")
"""``-ffp-contract=fast`` lets the attention kernel's AVX2 code fuse its products and sums
(FMA); ``-std=c11`` alone turns that off. The model forward's files turn it off again for
their element-wise arithmetic (Hugging Face's rounding) and use explicit FMAs in their
products. ``-pthread``: the forward's thread pool (cpu_threads.c)."""
COMPILE_TIMEOUT_S = 120


class NativeBuildError(ShoalError, RuntimeError):
    """The native CPU kernel could not be built or loaded; the torch implementation serves."""


def default_compiler(environ: Mapping[str, str] = os.environ) -> list[str]:
    """``$CC`` split like a shell would, else ``cc``, else ``gcc``.

    Raises:
        NativeBuildError: none is set or on PATH.
    """
    if environ.get("CC", "").strip():
        return shlex.split(environ["CC"])
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return [found]
    raise NativeBuildError("no C compiler: set CC or put cc or gcc on PATH")


def default_cache_dirs(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """Where built libraries are kept, in order of preference: ``$XDG_CACHE_HOME/shoal``
    (else ``~/.cache/shoal``), then ``shoal-<uid>`` in the temp directory."""
    dirs = []
    if environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(environ["XDG_CACHE_HOME"]) / "shoal")
    else:
        with contextlib.suppress(RuntimeError):  # no home directory
            dirs.append(Path.home() / ".cache" / "shoal")
    dirs.append(Path(tempfile.gettempdir()) / f"shoal-{os.getuid()}")
    return dirs


def _is_private(path: Path, *, directory: bool) -> bool:
    """Whether only this user can have written `path`: owned by us, no group or other write bit."""
    info = path.stat()
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    return kind_ok and info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir(candidates: Sequence[Path]) -> Path:
    """The first candidate that exists or can be made and that only this user can write to.

    Raises:
        NativeBuildError: none is.
    """
    refused = []
    for candidate in candidates:
        try:
            candidate.mkdir(mode=0o700, parents=True, exist_ok=True)
            if _is_private(candidate, directory=True) and os.access(candidate, os.W_OK):
                return candidate
            refused.append(f"{candidate} (not a directory only this user can write)")
        except OSError as error:
            refused.append(f"{candidate} ({error})")
    raise NativeBuildError(f"no private directory to build in: {', '.join(refused)}")


def _compiler_identity(compiler: Sequence[str]) -> str:
    """The compiler's resolved path and ``--version`` output, for the cache key.

    Raises:
        NativeBuildError: it does not run.
    """
    try:
        result = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"C compiler {shlex.join(compiler)} does not run: {error}") from error
    if result.returncode != 0:
        raise NativeBuildError(
            f"C compiler {shlex.join(compiler)} --version failed: {result.stderr.strip() or result.returncode}"
        )
    return f"{shutil.which(compiler[0]) or compiler[0]}\n{shlex.join(compiler)}\n{result.stdout}"


def build(compiler: Sequence[str], cache_dirs: Sequence[Path], sources: Sequence[Path] = SOURCES) -> Path:
    """The library built from `sources` by `compiler`, compiled only when not already cached.

    The file name carries a hash of the sources, the flags, the compiler and the
    platform, so a changed source or compiler builds anew. A compile writes a
    temporary file in the cache directory and renames it into place, so
    processes building at the same time each load a complete library.

    Args:
        compiler: the compiler command (a list of words).
        cache_dirs: candidate cache directories (`default_cache_dirs`).
        sources: the C sources, compiled into one library.

    Returns:
        The path of the built library.

    Raises:
        NativeBuildError: no compiler, no private cache directory, or the compile failed.
    """
    digest = hashlib.sha256()
    for source in (*sources, *(HEADERS if sources == SOURCES else ())):
        try:
            digest.update(hashlib.sha256(source.read_bytes()).digest())
        except OSError as error:
            raise NativeBuildError(f"cannot read the source: {error}") from error
    for part in (
        str(ABI_VERSION),
        shlex.join(COMPILE_FLAGS),
        _compiler_identity(compiler),
        platform.machine(),
    ):
        digest.update(b"\0" + part.encode())
    directory = _private_dir(cache_dirs)
    library = directory / f"{LIBRARY_STEM}-{digest.hexdigest()[:20]}.so"
    if library.exists() and _is_private(library, directory=False):
        return library
    try:
        _compile(compiler, sources, directory, library)
    except OSError as error:  # the cache directory's file operations
        raise NativeBuildError(f"building {library}: {error}") from error
    log.info("kernels.cpu_native_built", library=str(library))
    return library


def _compile(compiler: Sequence[str], sources: Sequence[Path], directory: Path, library: Path) -> None:
    """Compiles into a temporary file of `directory`, then renames it to `library`.

    Raises:
        NativeBuildError: the compiler did not run or failed.
    """
    fd, temporary = tempfile.mkstemp(prefix=f".{LIBRARY_STEM}-", suffix=".so", dir=directory)
    os.close(fd)
    command = [*compiler, *COMPILE_FLAGS, "-I", str(_CSRC), "-o", temporary, *map(str, sources)]
    try:
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise NativeBuildError(f"{shlex.join(command)}: {error}") from error
        if result.returncode != 0:
            raise NativeBuildError(
                f"{shlex.join(command)} exited {result.returncode}: {result.stderr.strip()[-2000:]}"
            )
        os.chmod(temporary, 0o700)
        os.replace(temporary, library)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)

