"""llama.cpp for the peer benchmark: build `llama-server`, convert the demo models, run the server.

The source is the llama-cpp-python source distribution from the package registry, which
vendors llama.cpp under ``vendor/llama.cpp``. Everything lands in one cache directory
outside the repository (``~/.cache/shoal/llama.cpp/<version>`` unless told otherwise);
a finished build leaves a stamp file naming its CMake options, so the next run reuses it.

    python scripts/peer_llama_cpp.py build       # the build alone (~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_CACHE = Path(os.environ.get("SHOAL_PEERS_CACHE", Path.home() / ".cache" / "shoal" / "llama.cpp"))

# The server target alone, static, no web UI: LLAMA_USE_PREBUILT_UI=OFF keeps the build
# from downloading the prebuilt UI bundle (tools/ui/CMakeLists.txt, scripts/ui-assets.cmake);
# LLAMA_BUILD_UI=OFF keeps it from running npm. The server then answers the API only.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
)


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: where its sources, server binary and converter are."""

    version: str
    source_dir: Path
    server: Path

    @property
    def converter(self) -> Path:
        return self.source_dir / "convert_hf_to_gguf.py"


def get_version_dir(cache: Path, version: str) -> Path:
    return cache / f"llama-cpp-python-{version}"


def _run(argv: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(argv), flush=True)
    with log.open("a") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        result = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(argv)}\n" + "\n".join(tail))


def fetch_sources(cache: Path, version: str) -> Path:
    """The vendored llama.cpp of llama-cpp-python ``version``, downloaded and unpacked once."""
    root = get_version_dir(cache, version)
    source_dir = root / "src" / "vendor" / "llama.cpp"
    if (source_dir / "CMakeLists.txt").exists():
        return source_dir
    root.mkdir(parents=True, exist_ok=True)
    download = root / "sdist"
    download.mkdir(exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          "-d", str(download), f"llama-cpp-python=={version}"], root / "fetch.log")
    archives = sorted(download.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip download left no sdist in {download}")
    unpack = root / "unpack"
    shutil.rmtree(unpack, ignore_errors=True)
    with tarfile.open(archives[0]) as archive:
        archive.extractall(unpack, filter="data")
    (top,) = list(unpack.iterdir())
    shutil.rmtree(root / "src", ignore_errors=True)
    top.rename(root / "src")
    shutil.rmtree(unpack, ignore_errors=True)
    if not (source_dir / "CMakeLists.txt").exists():
        raise RuntimeError(f"the sdist holds no vendor/llama.cpp: {root / 'src'}")
    return source_dir


def build_server(cache: Path = DEFAULT_CACHE, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> LlamaCpp:
    """`llama-server` built once into the cache (sources fetched first); later calls reuse it."""
    source_dir = fetch_sources(cache, version)
    root = get_version_dir(cache, version)
    build_dir = root / "build"
    server = build_dir / "bin" / "llama-server"
    stamp = root / "build.stamp"
    wanted = json.dumps({"cmake": list(CMAKE_OPTIONS)})
    if server.exists() and stamp.exists() and stamp.read_text() == wanted:
        return LlamaCpp(version, source_dir, server)
    stamp.unlink(missing_ok=True)
    log = root / "build.log"
    started = time.monotonic()
    _run(["cmake", "-S", str(source_dir), "-B", str(build_dir), *CMAKE_OPTIONS], log)
    _run(["cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{jobs}"], log)
    if not server.exists():
        raise RuntimeError(f"the build finished without {server}; see {log}")
    stamp.write_text(wanted)
    print(f"built {server} in {time.monotonic() - started:.0f} s (log: {log})", flush=True)
    return LlamaCpp(version, source_dir, server)


def get_server_commit(llama: LlamaCpp) -> str:
    """The llama.cpp build the server reports (``--version``), e.g. ``version: 1 (0c1e570)``."""
    result = subprocess.run([str(llama.server), "--version"], capture_output=True, text=True, timeout=30)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


# --- conversion -----------------------------------------------------------------------------------

# llama.cpp's pre-tokenizer names for the split regexes of tokenizer.json (src/llama-vocab.cpp quotes
# each "original regex from tokenizer.json"). The demo tokenizers use Qwen2's.
PRE_TOKENIZERS = {
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
}


def read_converter_test_text(source_dir: Path) -> str:
    """The converter's fingerprint text (``chktxt`` in ``get_vocab_base_pre``), read without running it."""
    for path in [source_dir / "conversion" / "base.py", source_dir / "convert_hf_to_gguf.py"]:
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "chktxt"
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                return node.value.value
    raise RuntimeError(f"no chktxt in llama.cpp's converter under {source_dir}")


def get_tokenizer_hash(tokenizer: Any, test_text: str) -> str:
    """The converter's pre-tokenizer fingerprint (``chkhsh``): sha256 of the ids of its test text."""
    return hashlib.sha256(str(tokenizer.encode(test_text)).encode()).hexdigest()


def get_pre_tokenizer_name(model_dir: Path) -> str:
    """llama.cpp's name for the model's pre-tokenizer, from the split regex in its tokenizer.json."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())["pre_tokenizer"] or {}
    steps = spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]
    for step in steps:
        regex = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        if regex in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[regex]
    raise RuntimeError(f"{model_dir}: no pre-tokenizer split regex that llama.cpp names ({spec})")


def convert_model(llama: LlamaCpp, model_dir: Path, outfile: Path, log: Path, outtype: str = "f32") -> Path:
    """`model_dir` as a GGUF of `outtype` (f32, or bf16: the converter's ``--outtype``) at
    `outfile` (kept when newer than the model's files).

    The converter identifies a BPE pre-tokenizer by hashing how it splits a test text and
    knows only published tokenizers' hashes; for others it stops with "BPE pre-tokenizer was
    not recognized" and no option overrides it. Its own remedy (convert_hf_to_gguf_update.py)
    downloads the listed tokenizers from the Hugging Face hub. So the converter runs here in a
    subprocess with the demo tokenizer's hash registered: `get_vocab_base_pre` answers the
    llama.cpp name of the tokenizer's split regex (Qwen2's) for that one hash, and defers to
    the converter's own list for every other.
    """
    from transformers import AutoTokenizer

    newest = max(p.stat().st_mtime for p in model_dir.iterdir())
    if outfile.exists() and outfile.stat().st_mtime > newest:
        return outfile
    outfile.parent.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("sentencepiece") is None:
        # the converter imports it for every Llama model, even one with a BPE tokenizer
        _run([sys.executable, "-m", "pip", "install", "sentencepiece"], log)
    test_text = read_converter_test_text(llama.source_dir)
    chkhsh = get_tokenizer_hash(AutoTokenizer.from_pretrained(model_dir), test_text)
    name = get_pre_tokenizer_name(model_dir)
    _run([sys.executable, str(Path(__file__).resolve()), "convert", "--source", str(llama.source_dir),
          "--register", f"{chkhsh}={name}", "--outfile", str(outfile), "--model", str(model_dir),
          "--outtype", outtype], log)
    return outfile


def _convert_in_this_process(source_dir: Path, registered: dict[str, str], model_dir: Path, outfile: Path,
                             outtype: str = "f32") -> None:
    import runpy

    sys.path[:0] = [str(source_dir), str(source_dir / "gguf-py")]
    from conversion import base  # llama.cpp's converter package

    original = base.TextModel.get_vocab_base_pre
    test_text = read_converter_test_text(source_dir)

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        name = registered.get(get_tokenizer_hash(tokenizer, test_text))
        return name if name is not None else original(self, tokenizer)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", "--outtype", outtype, "--outfile", str(outfile), str(model_dir)]
    runpy.run_path(str(source_dir / "convert_hf_to_gguf.py"), run_name="__main__")


# --- the server -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_server_argv(llama: LlamaCpp, gguf: Path, port: int, *, parallel: int, ctx_tokens: int,
                    threads: int) -> list[str]:
    """`llama-server` serving `gguf`: `parallel` slots sharing `ctx_tokens` of KV, `threads` threads.

    Everything else stays at llama.cpp's defaults (continuous batching on, prompt cache on,
    batch 2048 / micro-batch 512, flash attention auto), as a new user runs it.
    """
    return [str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel), "-c", str(ctx_tokens)]


class LlamaServer:
    """A running `llama-server`; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv = argv
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("a") as out:
            out.write("$ " + " ".join(argv) + "\n")
        self._log_file = log.open("a")
        self.process = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}): see {self.log}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server was not ready in {timeout_s:.0f} s: see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()


def start_server(llama: LlamaCpp, gguf: Path, log: Path, *, parallel: int, ctx_tokens: int,
                 threads: int) -> LlamaServer:
    port = free_port()
    server = LlamaServer(get_server_argv(llama, gguf, port, parallel=parallel, ctx_tokens=ctx_tokens,
                                         threads=threads), port, log)
    server.wait_ready()
    return server


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "convert"])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION)
    parser.add_argument("--jobs", type=int, default=2)
    # convert (run by convert_model): the converter with registered tokenizer hashes
    parser.add_argument("--source", type=Path)
    parser.add_argument("--register", action="append", default=[], help="HASH=NAME")
    parser.add_argument("--outfile", type=Path)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--outtype", choices=["f32", "bf16"], default="f32")
    args = parser.parse_args()
    if args.command == "convert":
        if args.source is None or args.outfile is None or args.model is None:
            parser.error("convert needs --source, --outfile and --model")
        registered = dict(item.split("=", 1) for item in args.register)
        _convert_in_this_process(args.source, registered, args.model, args.outfile, args.outtype)
        return
    llama = build_server(args.cache, args.version, args.jobs)
    print(llama.server, get_server_commit(llama))


if __name__ == "__main__":
    _main()
