"""What rebuilding or restoring a session's KV costs: a prefill cost model fitted by measurement.

Prefilling `n` new tokens after `ctx` tokens whose K/V is already cached costs, in one forward
pass::

    seconds = per_pass + per_token * n + per_token_pair * (n * ctx + n * (n + 1) / 2)
              ^fixed     ^projections, MLPs  ^attention: new token i reads ctx + i + 1 keys

Linear in the context for a fixed `n` (the seed's "exponential" growth was wrong). A dropped
chunk is recomputed inside the prefill that also runs the new turn's tokens, so rebuilding it
costs its tokens' share (`get_rebuild_seconds`), never the pass's fixed part. Restoring a chunk
from the CPU tier costs its copy (`get_swap_seconds`).

The constants are fitted by least squares with non-negative coefficients
(`fit_prefill_costs`, `fit_swap_costs`) from timings the worker takes of the served model on
its own device (`services/worker/engine/cost_profile.py`), or read from a saved profile
(`CostProfile`). Pure: no torch, no I/O (profiles go to and from bytes).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CostModel:
    """Seconds a prefill or a swap of session KV takes on one replica."""

    seconds_per_token: float
    """Per new token: projections, MLP, norms (everything but attention)."""
    seconds_per_token_pair: float
    """Attention: per (new token, context token it attends to) pair."""
    seconds_per_pass: float = 0.0
    """Fixed cost of a forward pass (launches, sampling); not charged to a rebuilt chunk."""
    swap_seconds_per_block: float = 0.0
    """Copying one KV block (every layer, K and V) between the GPU and the CPU tier."""
    swap_seconds_per_call: float = 0.0
    """Fixed cost of one batched copy call."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value!r}")

    def get_prefill_seconds(self, num_tokens: int, num_context_tokens: int) -> float:
        """One forward pass computing `num_tokens` tokens after `num_context_tokens` cached ones."""
        if num_tokens <= 0:
            return 0.0
        return self.seconds_per_pass + self.get_rebuild_seconds(num_tokens, num_context_tokens)

    def get_rebuild_seconds(self, num_tokens: int, num_context_tokens: int) -> float:
        """What `num_tokens` tokens at positions `num_context_tokens`.. add to a prefill."""
        pairs = num_tokens * num_context_tokens + num_tokens * (num_tokens + 1) / 2
        return self.seconds_per_token * num_tokens + self.seconds_per_token_pair * pairs

    def get_swap_seconds(self, num_blocks: int) -> float:
        """What copying `num_blocks` blocks adds to a batched copy (the call's fixed cost excluded)."""
        return self.swap_seconds_per_block * num_blocks


@dataclass(frozen=True)
class PrefillSample:
    """One timed forward pass: `num_tokens` new tokens after `num_context_tokens` cached ones."""

    num_tokens: int
    num_context_tokens: int
    seconds: float


@dataclass(frozen=True)
class SwapSample:
    """One timed batched copy of `num_blocks` blocks."""

    num_blocks: int
    seconds: float


def fit_prefill_costs(samples: Sequence[PrefillSample]) -> tuple[float, float, float]:
    """Least-squares fit of (per_pass, per_token, per_token_pair) to timed passes, all >= 0.

    Raises:
        ValueError: fewer than three samples, or samples that do not vary enough to tell the
            three terms apart (e.g. every pass the same length at the same context).
    """
    if len(samples) < 3:
        raise ValueError(f"fitting a prefill cost needs at least 3 timed passes, got {len(samples)}")
    rows = [
        [1.0, float(s.num_tokens), s.num_tokens * s.num_context_tokens + s.num_tokens * (s.num_tokens + 1) / 2]
        for s in samples
    ]
    targets = [s.seconds for s in samples]
    per_pass, per_token, per_pair = _fit_non_negative(rows, targets)
    if per_token == per_pair == 0.0:
        # Timings too noisy to show any growth with tokens (a machine busy with other work):
        # a model in which rebuilding costs nothing would rank every chunk as free to drop.
        # Charge the time to the tokens instead.
        per_token, per_pair = _fit_non_negative([row[1:] for row in rows], targets)
        per_pass = 0.0
    return per_pass, per_token, per_pair


def fit_swap_costs(samples: Sequence[SwapSample]) -> tuple[float, float]:
    """Least-squares fit of (per_call, per_block) to timed batched copies, both >= 0."""
    if len(samples) < 2:
        raise ValueError(f"fitting a swap cost needs at least 2 timed copies, got {len(samples)}")
    rows = [[1.0, float(s.num_blocks)] for s in samples]
    per_call, per_block = _fit_non_negative(rows, [s.seconds for s in samples])
    return per_call, per_block


def _fit_non_negative(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Non-negative least squares by enumeration: the best unconstrained fit over every subset
    of the columns whose coefficients all come out >= 0 (two or three columns: at most 7 fits)."""
    num_columns = len(rows[0])
    # Columns scaled to unit size so the normal equations stay well conditioned (the pair
    # column is 1e5 times the token column).
    scales = [max(abs(row[c]) for row in rows) or 1.0 for c in range(num_columns)]
    scaled = [[row[c] / scales[c] for c in range(num_columns)] for row in rows]
    best: tuple[float, list[float]] | None = None
    for size in range(num_columns, 0, -1):
        for columns in itertools.combinations(range(num_columns), size):
            solution = _solve_least_squares([[row[c] for c in columns] for row in scaled], targets)
            if solution is None or any(value < 0.0 for value in solution):
                continue
            coefficients = [0.0] * num_columns
            for column, value in zip(columns, solution, strict=True):
                coefficients[column] = value
            residual = sum(
                (sum(c * x for c, x in zip(coefficients, row, strict=True)) - target) ** 2
                for row, target in zip(scaled, targets, strict=True)
            )
            if best is None or residual < best[0] * (1 - 1e-12):
                best = (residual, coefficients)
    if best is None:
        raise ValueError("the timed samples do not determine a cost model (all fits degenerate)")
    return [value / scale for value, scale in zip(best[1], scales, strict=True)]


def _solve_least_squares(rows: list[list[float]], targets: list[float]) -> list[float] | None:
    """Solves the normal equations by Gaussian elimination; None when they are singular."""
    n = len(rows[0])
    matrix = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    rhs = [sum(r[i] * t for r, t in zip(rows, targets, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in matrix[col])):
            return None
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for row in range(n):
            if row != col:
                factor = matrix[row][col] / matrix[col][col]
                for k in range(col, n):
                    matrix[row][k] -= factor * matrix[col][k]
                rhs[row] -= factor * rhs[col]
    return [rhs[i] / matrix[i][i] for i in range(n)]


@dataclass(frozen=True)
class CostProfile:
    """A fitted `CostModel` and what it was measured for, as saved to and read from a file."""

    key: str
    """What the timings depend on (model shape, dtype, device, block size): a profile is used
    only by an engine whose key is equal."""
    cost_model: CostModel
    num_samples: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {"key": self.key, "num_samples": self.num_samples, "cost_model": asdict(self.cost_model)},
            indent=2,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CostProfile:
        """Reads a saved profile.

        Raises:
            ValueError: not JSON, or a field missing, of the wrong type or out of range.
        """
        try:
            decoded = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"cost profile: not JSON ({error})") from None
        if not isinstance(decoded, dict) or not isinstance(decoded.get("key"), str):
            raise ValueError("cost profile: expected an object with a string 'key'")
        fields = decoded.get("cost_model")
        if not isinstance(fields, dict):
            raise ValueError("cost profile: expected an object 'cost_model'")
        known = set(CostModel.__dataclass_fields__)
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"cost profile: unknown cost_model fields {sorted(unknown)}")
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"cost profile: cost_model.{name} must be a number, got {value!r}")
        try:
            cost_model = CostModel(**fields)
        except TypeError as error:
            raise ValueError(f"cost profile: {error}") from None
        num_samples = decoded.get("num_samples", 0)
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"cost profile: num_samples must be an int >= 0, got {num_samples!r}")
        return cls(decoded["key"], cost_model, num_samples)
