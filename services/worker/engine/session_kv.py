"""Chat sessions' KV in the engine: the session cache policy wired to the block pool.

`SessionKV` joins the pure `SessionCache` (which chunk of which session is on the GPU, the
CPU or dropped) to the engine's block tables (`KVCacheManager` over `BlockPool`). It is what
the batch scheduler calls (`SessionHooks`): a finished turn's blocks become the session's
chunks (`release`), a returning turn starts from them (`try_start`), and cached sessions'
blocks give way when running sequences need the pool (`reclaim`). Copies leave as block
pairs taken with the step plan (`take_swaps`): the runner copies GPU -> CPU first, then
CPU -> GPU, then runs the pass.

How it shares the pool with the prefix cache (docs/sessions.md): a cached session holds one
reference to each of its GPU blocks, so they are "used" blocks the prefix cache's LRU can
never evict or hand out; they keep their content hash, so other sequences (another session
with the same system prompt) still reuse them by hash while the session holds them. When
the session lets a block go (demoted, dropped, expired), the reference is freed and a
hashed block becomes cached-free: reusable by hash until the LRU evicts it. A returning
session looks its copied-out and dropped blocks up by hash first, so a GPU copy that is
still cached-free is taken back instead of copied or recomputed.

A session keeps its tokens and its blocks' hashes, so a returning turn is matched by
comparing token ids (a client that edited its history reuses only the matching prefix) and
its history is never hashed again. Pure bookkeeping like the policies it joins: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.generation import FinishReason
from shoal.shared.kv_cache.block_pool import BlockHash, BlockPool
from shoal.shared.kv_cache.manager import KVCacheManager
from shoal.shared.kv_cache.session_cache import RestorePlan, SessionActions, SessionCache, SessionInfo
from shoal.shared.kv_cache.session_settings import SessionSettings
from shoal.shared.messages import SessionStats

__all__ = ["SessionKV", "SessionSettings", "SessionStats"]


@dataclass(frozen=True)
class _StartPlan:
    num_prefix_hits: int
    """Leading dropped blocks still in the prefix cache (taken, not recomputed)."""
    revived: list[bool]
    """Per copied-out block: its GPU copy is still in the prefix cache (taken, not copied)."""
    num_new_blocks: int
    """Blocks for the new tokens of the first step."""
    num_needed: int
    """Free blocks the start takes."""


class SessionKV:
    """The engine's session cache (see module doc); implements the scheduler's `SessionHooks`.

    Args:
        cache: the policy, sized in blocks of the KV pool's block size.
        kv_cache: the engine's block tables (and, through it, the block pool).
        block_bytes: bytes of one block (KV pool and host pool alike), for the byte figures.
    """

    def __init__(self, cache: SessionCache, kv_cache: KVCacheManager, block_bytes: int) -> None:
        self.cache = cache
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes
        self._pool: BlockPool = kv_cache.pool
        self._block_size = kv_cache.block_size
        self._token_ids: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # host block -> KV pool block: a later copy into the same host block replaces an
        # earlier one (whose chunk was dropped meanwhile), so one call never writes a host
        # block twice.
        self._pending_out: dict[int, int] = {}
        self._pending_in: list[tuple[int, int]] = []
        self._counted_seqs: set[str] = set()
        self.num_hits = self.num_misses = 0
        self.num_gpu_reused_tokens = self.num_cpu_restored_tokens = self.num_prefix_cached_tokens = 0
        self.num_recomputed_tokens = self.num_new_tokens = 0
        self.num_swapped_in_blocks = 0
        self.exposed_swap_seconds = 0.0

    # ------------------------------------------------------------------ queries

    def get_num_gpu_blocks(self) -> int:
        return self.cache.get_num_gpu_blocks()

    def get_sessions(self) -> list[SessionInfo]:
        return self.cache.get_sessions()

    def get_stats(self) -> SessionStats:
        stats = self.cache.get_stats()
        block_bytes = self.block_bytes
        return SessionStats(
            num_sessions=stats.num_sessions,
            gpu_bytes=stats.num_gpu_blocks * block_bytes,
            cpu_bytes=(stats.num_cpu_blocks + stats.num_copied_ahead_blocks) * block_bytes,
            host_pool_bytes=stats.num_host_blocks * block_bytes,
            num_hits=self.num_hits,
            num_misses=self.num_misses,
            num_gpu_reused_tokens=self.num_gpu_reused_tokens,
            num_cpu_restored_tokens=self.num_cpu_restored_tokens,
            num_prefix_cached_tokens=self.num_prefix_cached_tokens,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_new_tokens=self.num_new_tokens,
            swap_in_bytes=self.num_swapped_in_blocks * block_bytes,
            swap_out_bytes=stats.num_swapped_out_blocks * block_bytes,
            exposed_swap_seconds=self.exposed_swap_seconds,
            num_demoted_chunks=stats.num_demoted_chunks,
            num_dropped_chunks=stats.num_dropped_chunks,
            num_expired_sessions=stats.num_expired_sessions,
        )

    # ------------------------------------------------------------------ SessionHooks

    def try_start(self, seq: Sequence, max_num_new_tokens: int) -> bool | None:
        """Start a returning turn from its session's KV (see `SessionHooks.try_start`)."""
        session_id = seq.session_id
        assert session_id is not None, "only a session's turn starts from a session"
        if session_id not in self.cache:
            self._count(seq, hit=False)
            return None
        block_size = self._block_size
        prompt = seq.token_ids
        # The prompt's last token is always computed (its logits are needed).
        num_blocks = min(_common_prefix_length(prompt, self._token_ids[session_id]), len(prompt) - 1) // block_size
        plan = self.cache.plan_restore(session_id, num_blocks)
        assert plan is not None, "a cached session has a restore plan"
        if plan.num_blocks <= plan.num_dropped_blocks:
            # Nothing cached matches past the dropped prefix: the session's KV is stale.
            self._apply(self.cache.drop_session(session_id) or SessionActions())
            self._count(seq, hit=False)
            return None
        block_hashes = self._block_hashes[session_id][:num_blocks]
        start = self._plan_start(plan, block_hashes, len(prompt), max_num_new_tokens)
        if start.num_needed > self._pool.get_num_free_blocks():
            self.reclaim(start.num_needed - self._pool.get_num_free_blocks(), keep_session_id=session_id)
            start = self._plan_start(plan, block_hashes, len(prompt), max_num_new_tokens)
            if start.num_needed > self._pool.get_num_free_blocks():
                return False
        restore = self.cache.check_out(session_id, num_blocks)
        assert restore is not None and restore.plan == plan, "check_out follows the plan it was given"
        self._pool.free_n(restore.freed_gpu_block_ids)
        del self._token_ids[session_id], self._block_hashes[session_id]
        block_ids: list[int] = []
        pool = self._pool
        # Every block the plan found in the prefix cache is taken before any is allocated: an
        # allocation may evict cached-free blocks, the very ones the plan counted on.
        num_prefix_hits = start.num_prefix_hits
        pool.take_cached_prefix(block_hashes[:num_prefix_hits], block_ids)
        revived: dict[int, int] = {}
        for index, is_revived in enumerate(start.revived):
            if is_revived:
                found: list[int] = []
                num_hits = pool.take_cached_prefix([block_hashes[plan.num_dropped_blocks + index]], found)
                assert num_hits == 1, "a block found in the prefix cache is taken"
                revived[index] = found[0]
        # 1. leading dropped blocks still in the prefix cache (taken above), then the rest of the hole
        allocated = pool.try_allocate_n(plan.num_dropped_blocks - num_prefix_hits, block_ids)
        assert allocated, "the hole's blocks were counted"
        # 2. copied-out blocks: their GPU copy if still cached (taken above), else a copy back
        num_swapped = 0
        for index, host_block_id in enumerate(restore.host_block_ids):
            block_id = revived.get(index)
            if block_id is None:
                block_id = pool.try_allocate()
                assert block_id is not None, "copied-back blocks were counted"
                self._pending_in.append((host_block_id, block_id))
                num_swapped += 1
            block_ids.append(block_id)
        # 3. blocks still on the GPU, in place; 4. room for the new tokens of this step
        block_ids += restore.gpu_block_ids
        allocated = pool.try_allocate_n(start.num_new_blocks, block_ids)
        assert allocated, "the new tokens' blocks were counted"
        if len(seq.block_hashes) < len(block_hashes):
            seq.block_hashes[len(seq.block_hashes) :] = block_hashes[len(seq.block_hashes) :]
        self.kv_cache.adopt_sequence(seq.seq_id, block_ids, seq.block_hashes, num_registered_blocks=num_blocks)
        # Copied-back blocks hold their K/V before any pass reads them (copies run first).
        host_start = plan.num_dropped_blocks
        if num_prefix_hits == plan.num_dropped_blocks:  # no hole before them
            self.kv_cache.register_blocks(seq.seq_id, host_start, host_start + plan.num_host_blocks)
        seq.num_computed_tokens = num_blocks * block_size
        seq.hole_start = num_prefix_hits * block_size
        seq.hole_end = plan.num_dropped_blocks * block_size
        self._count(seq, hit=True)
        self.num_gpu_reused_tokens += plan.num_gpu_blocks * block_size
        self.num_cpu_restored_tokens += num_swapped * block_size
        self.num_prefix_cached_tokens += (num_prefix_hits + plan.num_host_blocks - num_swapped) * block_size
        self.num_recomputed_tokens += (plan.num_dropped_blocks - num_prefix_hits) * block_size
        self.num_new_tokens += len(prompt) - num_blocks * block_size
        self.num_swapped_in_blocks += num_swapped
        return True

    def release(self, seq: Sequence, finish_reason: FinishReason) -> None:
        """Keep a finished turn's full computed blocks as its session's chunks.

        A turn that failed, or was cancelled before its dropped prefix was recomputed, frees
        its blocks instead (its K/V is not a prefix of known content).
        """
        session_id = seq.session_id
        assert session_id is not None, "only a session's turn is released to a session"
        self._counted_seqs.discard(seq.seq_id)
        if not self.kv_cache.has_sequence(seq.seq_id):
            return
        if finish_reason == "error" or seq.num_hole_tokens:
            self.kv_cache.free(seq.seq_id)
            return
        num_blocks = seq.num_computed_tokens // self._block_size
        block_ids = self.kv_cache.detach(seq.seq_id)
        self._pool.free_n(block_ids[num_blocks:][::-1])
        actions = self.cache.check_in(session_id, block_ids[:num_blocks])
        if session_id in self.cache:
            self._token_ids[session_id] = seq.token_ids[: num_blocks * self._block_size]
            self._block_hashes[session_id] = seq.block_hashes[:num_blocks]
        self._apply(actions)

    def reclaim(self, num_blocks: int, keep_session_id: str | None = None) -> int:
        """Free at least `num_blocks` pool blocks held by cached sessions (fewer only when no
        session has a GPU chunk left to give); returns how many the pool gained.

        A block two sessions share (a common system prompt, by hash) is freed only when both
        let it go, so the policy may have to give up more chunks than blocks are wanted."""
        if num_blocks <= 0:
            return 0
        pool = self._pool
        num_free_before = pool.get_num_free_blocks()
        wanted = num_free_before + num_blocks
        while (num_missing := wanted - pool.get_num_free_blocks()) > 0:
            num_released, actions = self.cache.reclaim_gpu(num_missing, keep_session_id)
            self._apply(actions)
            if not num_released:
                break
        return pool.get_num_free_blocks() - num_free_before

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(KV pool -> host, host -> KV pool) pairs for the next forward pass; drains."""
        swap_out = [(block_id, host_block_id) for host_block_id, block_id in self._pending_out.items()]
        swap_in = self._pending_in
        self._pending_out, self._pending_in = {}, []
        return swap_out, swap_in

    # ------------------------------------------------------------------ the engine's upkeep

    def end_step(self, swap_in_seconds: float = 0.0) -> None:
        """A step's copies ran (`swap_in_seconds`: how long the pass waited for them)."""
        self.exposed_swap_seconds += swap_in_seconds
        self.cache.end_step()

    def expire(self) -> None:
        self._apply(self.cache.expire())

    def copy_ahead(self) -> None:
        """Copy the next eviction victims to the host pool while free blocks run low."""
        for block_id, host_block_id in self.cache.copy_ahead(self._pool.get_num_free_blocks()):
            self._pending_out[host_block_id] = block_id

    def drop(self, session_id: str) -> bool:
        """Forget a cached session now; False if it is not cached."""
        actions = self.cache.drop_session(session_id)
        if actions is None:
            return False
        self._apply(actions)
        return True

    # ------------------------------------------------------------------ internals

    def _apply(self, actions: SessionActions) -> None:
        for block_id, host_block_id in actions.swap_out:
            self._pending_out[host_block_id] = block_id
        self._pool.free_n(actions.freed_gpu_block_ids)
        for session_id in actions.removed_session_ids:
            self._token_ids.pop(session_id, None)
            self._block_hashes.pop(session_id, None)

    def _plan_start(
        self, plan: RestorePlan, block_hashes: list[BlockHash], num_prompt_tokens: int, max_num_new_tokens: int
    ) -> _StartPlan:
        """Which blocks of a restore the prefix cache still has, and what the rest needs."""
        pool = self._pool
        block_size = self._block_size
        num_dropped = plan.num_dropped_blocks
        num_prefix_hits = pool.get_cached_prefix(block_hashes[:num_dropped])[0]
        revived = [
            index < len(block_hashes) and pool.get_cached_block(block_hashes[index]) is not None
            for index in range(num_dropped, num_dropped + plan.num_host_blocks)
        ]
        num_hole_tokens = (num_dropped - num_prefix_hits) * block_size
        num_cached_tokens = plan.num_blocks * block_size
        # As the scheduler splits its budget: the hole first, new tokens with what is left.
        num_new_tokens = max(0, min(num_prompt_tokens - num_cached_tokens, max_num_new_tokens - num_hole_tokens))
        num_new_blocks = -(-(num_cached_tokens + num_new_tokens) // block_size) - plan.num_blocks
        # Blocks taken from the prefix cache that are cached-free leave the free count too.
        indexes = [*range(num_prefix_hits)]
        indexes += [num_dropped + offset for offset, is_revived in enumerate(revived) if is_revived]
        num_revived_free = 0
        for index in indexes:
            block_id = pool.get_cached_block(block_hashes[index])
            assert block_id is not None, "blocks found in the prefix cache a moment ago are still there"
            num_revived_free += pool.get_ref_count(block_id) == 0
        num_fresh = (num_dropped - num_prefix_hits) + revived.count(False) + num_new_blocks
        return _StartPlan(num_prefix_hits, revived, num_new_blocks, num_fresh + num_revived_free)

    def _count(self, seq: Sequence, *, hit: bool) -> None:
        """Count a turn's hit or miss once, however often it is tried or preempted."""
        if seq.seq_id in self._counted_seqs:
            return
        self._counted_seqs.add(seq.seq_id)
        if hit:
            self.num_hits += 1
        else:
            self.num_misses += 1


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (an unedited history): one C-level compare
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
