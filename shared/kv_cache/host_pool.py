"""Block ids of the CPU tier (the host pool): a free stack, and frees that wait for a step's copies.

The host pool's tensor has the KV pool's layout with its own block count; this module only
decides which host block holds what. A host block that a step copies FROM (a swap-in) must
not be handed out again before that step's copies ran, or a swap-out of the same step could
overwrite it first: such blocks are freed with `free_after_step` and become free at
`end_step`. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable


class HostBlockPool:
    """`num_blocks` host block ids (0 .. num_blocks - 1); a fresh pool hands out 0, 1, 2, ..."""

    __slots__ = ("_after_step", "_free_stack", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0, f"num_blocks must be >= 0, got {num_blocks}"
        self.num_blocks = num_blocks
        self._free_stack: list[int] = list(range(num_blocks - 1, -1, -1))
        self._after_step: list[int] = []

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now (not counting those freed after this step)."""
        return len(self._free_stack)

    def get_num_used_blocks(self) -> int:
        """Blocks holding data, including those freed after this step."""
        return self.num_blocks - len(self._free_stack)

    def try_allocate_n(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` block ids, or None (and nothing taken) when fewer are free."""
        stack = self._free_stack
        if num_blocks > len(stack):
            return None
        if not num_blocks:
            return []
        block_ids = stack[: -num_blocks - 1 : -1]
        del stack[-num_blocks:]
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks now (nothing reads them in this step)."""
        self._free_stack.extend(reversed(list(block_ids)))  # handed out again in this order

    def free_after_step(self, block_ids: Iterable[int]) -> None:
        """Return blocks that this step still copies from: free from `end_step` on."""
        self._after_step.extend(block_ids)

    def end_step(self) -> None:
        """The step's copies ran: blocks freed after it become free."""
        if self._after_step:
            self._free_stack.extend(reversed(self._after_step))
            self._after_step = []
