"""What an operator declares about a served model: its fields, their defaults, their checks.

Declared once, here. Everything else derives from `ModelSettings`:

    ModelSettings ──┬── ModelConfig  (shared/config.py)    a ``[[models]]`` entry of shoal.toml,
                    │                                     or the body of POST /admin/models
                    └── ModelSpec    (shared/messages.py) the record in ``shoal_models``: these
                                                          settings plus what the cluster learned
                                                          (sizes, measured memory, replicas, ...)

Model paths are relative to the node's models root and may never leave it
(`resolve_model_dir`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from msgspec import Struct, field

from shoal.shared.errors import ShoalError
from shoal.shared.subjects import InvalidModelKey, validate_model_key

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
SleepLevel = Literal["warm", "cold"]
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic"]
"""How a model writes function calls (vLLM's parser names; services/gateway/tool_call_parser.py)."""
ReasoningParser = Literal["deepseek_r1", "qwen3"]
"""How a reasoning model marks its thinking (vLLM's parser names; services/gateway/reasoning.py)."""
DEFAULT_KV_CACHE_TOKENS = 32 * 2048
"""A replica's default KV budget: 32 concurrent requests of 2,048 tokens (prompt and output;
the demo models' whole context) without preemption. The memory estimate placement reserves
(`shoal.shared.model_memory`) counts it, so a replica is placed with room for it; a model
that needs another figure sets ``kv_cache_tokens`` (docs/engine.md, "KV pool size")."""
MAX_REPLICAS = 1024
"""Replicas one model may have (desired, or asked for): a typo or a forged command must not
flood the scheduler."""


class InvalidModelPath(ShoalError, ValueError):
    """A model path that is absolute, climbs out of the models root, or resolves outside it."""


class FairnessSettings(Struct, kw_only=True, omit_defaults=True):
    """``[models.fairness]``: who may take this model's GPU memory, and when (seed 001)."""

    min_runtime_s: float = 10.0
    """A replica serves at least this long after it starts or wakes before it can be preempted
    (no sleep/wake thrashing)."""
    max_wait_s: float = 5.0
    """A request for this model, asleep and short of memory, waits this long for memory to free
    up by itself (an idle model going to sleep) before it preempts another model."""
    popular: bool = False
    """Never preempted nor evicted under memory pressure: it stays on its GPUs until an
    operator scales it down or evicts it. (Formerly ``dedicated``.)"""

    def __post_init__(self) -> None:
        if self.min_runtime_s < 0 or self.max_wait_s < 0:
            raise ValueError("fairness.min_runtime_s and fairness.max_wait_s must be >= 0")


class SleepSettings(Struct, kw_only=True, omit_defaults=True):
    """``[models.sleep]``: when this model sleeps, how it drains, and where its weights go."""

    idle_timeout_s: float = 0.0
    """A replica with no request for this long sleeps by itself; 0: never (the default)."""
    drain_timeout_s: float = 30.0
    """Before a replica sleeps or stops, its in-flight requests may finish for this long;
    those still running then go back to the queue (served again after the wake, or by
    another replica), none is failed."""
    level: SleepLevel = "warm"
    """Both levels keep the worker process (WARM in the cluster's records; on CUDA its context
    stays on the GPU as residual bytes). ``warm``: the weights stay in CPU RAM (moved there from
    the GPU), the wake copies them back. ``cold``: the weights are dropped too (no host RAM held
    for them: the node's CPU cache is charged ``[scheduler.placement] parked_process_bytes``),
    the wake reloads them from the model's files into place. CPU-cache pressure ends a parked
    replica of either level (its process exits; the next wake is a fresh worker)."""

    def __post_init__(self) -> None:
        if self.idle_timeout_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("sleep.idle_timeout_s and sleep.drain_timeout_s must be >= 0")


def max_model_len_error(max_model_len: int | None, checkpoint_max: int | None) -> str | None:
    """Why a model's `max_model_len` cannot be served from a checkpoint trained on
    `checkpoint_max` positions (``max_position_embeddings``); None if it can. Longer is refused,
    as vLLM refuses it: rotary positions past the trained ones give garbage, learned ones an
    index error mid-request."""
    if max_model_len is None or checkpoint_max is None or max_model_len <= checkpoint_max:
        return None
    return (f"max_model_len {max_model_len} is longer than the checkpoint's {checkpoint_max} positions "
            f"(max_position_embeddings): set max_model_len to {checkpoint_max} or less")


class ModelSettings(Struct, kw_only=True, omit_defaults=True):
    """A served model as the operator declares it."""

    key: str
    """The name clients use (``model`` in OpenAI requests), e.g. ``meta-llama/Llama-3.1-8B``."""
    path: str
    """Directory of the transformers checkpoint, relative to the models root."""
    dtype: Dtype = "auto"
    """Weights' dtype; ``auto`` takes the checkpoint's."""
    max_model_len: int | None = None
    """Prompt + completion limit in tokens; None: the model's own (``max_position_embeddings``)."""
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    """KV budget: tokens of KV cache a replica reserves beyond its weights."""
    memory_override_bytes: int | None = None
    """Serving memory per replica given by the operator; beats the estimate, not a measurement.
    In shoal.toml a size string works too (``"24GiB"``)."""
    num_gpus: int = 1
    """GPUs per replica when the model's memory figure is unknown (seed 000)."""
    min_replicas: int = 0
    """Replicas placed at registration; 0 places the model on its first request."""
    max_queue: int | None = None
    """Requests for this model waiting or running in one gateway before 429; None: the gateway's
    ``max_queue_per_model``."""
    fairness: FairnessSettings = field(default_factory=FairnessSettings)
    sleep: SleepSettings = field(default_factory=SleepSettings)
    tool_call_parser: ToolCallParser = "hermes"
    """How the model writes function calls, read from its answers to ``tool_choice: auto``:
    ``hermes`` (``<tool_call>`` JSON: Qwen2.5, Qwen3, Hermes), ``llama3_json`` (Llama 3.1-3.3),
    ``mistral`` (a JSON array) or ``pythonic`` (Llama 3.2 and 4)."""
    reasoning_parser: ReasoningParser | None = None
    """A reasoning model's thinking, split out of its chat answers into ``reasoning``:
    ``deepseek_r1`` (DeepSeek-R1, QwQ: the prompt opens the think block) or ``qwen3`` (blocks
    the answer opens with ``<think>``); None: answers are all content."""
    grammar_after_reasoning: bool = True
    """With a `reasoning_parser`: a grammar (``response_format``, a forced ``tool_choice``, vLLM's
    structured outputs) shapes only the text after ``</think>``, so the model thinks freely
    first, as vLLM has it; false: it shapes the whole answer from its first token (no thinking,
    the JSON at once)."""

    def __post_init__(self) -> None:
        try:
            validate_model_key(self.key)
        except InvalidModelKey as exc:
            raise ValueError(str(exc)) from exc
        validate_model_path(self.path)
        checks = (
            (self.kv_cache_tokens >= 0, "kv_cache_tokens must be >= 0"),
            (self.num_gpus >= 1, "num_gpus must be >= 1"),
            (0 <= self.min_replicas <= MAX_REPLICAS, f"min_replicas must be in 0..{MAX_REPLICAS}"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.memory_override_bytes is None or self.memory_override_bytes > 0,
             "memory_override_bytes must be > 0"),
            (self.max_queue is None or self.max_queue >= 1, "max_queue must be >= 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"model {self.key}: {message}")


def validate_model_path(path: str) -> str:
    """A model path is relative to the models root and may not climb out of it."""
    if not path:
        raise InvalidModelPath("model path is empty")
    pure = Path(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise InvalidModelPath(f"model path {path!r} must be relative to the models root, without '..'")
    return path


def resolve_model_dir(models_root: str | Path, path: str) -> Path:
    """The model's directory, guaranteed to lie under `models_root` (symlinks resolved)."""
    validate_model_path(path)
    root = Path(models_root).resolve()
    resolved = (root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise InvalidModelPath(f"model path {path!r} resolves outside the models root {root}")
    return resolved
