"""The session cache policy: each chat session's KV between turns, on the GPU, the CPU, or dropped.

After a turn, a session's full KV blocks stay cached (`check_in`), grouped into chunks of
`blocks_per_chunk` blocks keyed by (session, chunk index). Each chunk is in exactly one tier,
and the tiers of a session are always three runs, in this order::

    chunk      0         1         2        3        4        5        6
    tier    DROPPED   DROPPED     CPU      CPU      GPU      GPU      GPU
                                                  (+copy)  (+copy)
            0 ........ num_dropped ....... gpu_start .......... shadow_end ..... num_chunks

* dropped chunks are always a prefix: a dropped chunk's K/V is rebuilt by running the model
  over its tokens, and the one prefill that runs the new turn rebuilds a leading run of
  chunks for the price of its tokens (`CostModel.get_rebuild_seconds`). Whole chunks go,
  every layer: dropping only late layers would save almost no compute (layer l's K/V needs
  layers 0..l-1 run over the same tokens).
* CPU chunks sit in the host pool and come back with a batched copy.
* GPU chunks hold references to KV pool blocks; the first ones may also have a copy in the
  host pool (copied ahead: their eviction then only drops the GPU reference).

Eviction works on each session's next victim only (the order within a session is fixed):

* GPU -> CPU (`demote`): the first GPU chunk; losing it costs its swap-in.
* CPU -> dropped: the first CPU chunk; losing it costs its rebuild minus its swap-in.
* GPU -> dropped, directly: the first GPU chunk of a session with no CPU chunk; costs its
  rebuild. Used when the host pool is full and this is cheaper than dropping CPU chunks to
  make room, and always when there is no CPU tier.

Each kind has a `RetentionIndex` of sessions by retention value (cost / time idle) of that
victim. Freeing GPU blocks takes the lowest-valued demotion; when the host pool has no room
for it, it compares demoting (plus dropping the lowest-valued CPU victim) with dropping the
lowest-valued GPU chunk directly, and does the cheaper. A session being served is not in the
cache at all: `check_out` hands its blocks to the engine, `check_in` takes them back.

Pure and synchronous: no torch, no I/O; the clock and the cost model are injected. Side
effects leave as data (`SessionActions`): block pairs to copy GPU -> CPU and GPU block
references to give back to the block pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.kv_cache.host_pool import HostBlockPool
from shoal.shared.kv_cache.retention_index import RetentionIndex
from shoal.shared.kv_cache.session_types import (
    RestorePlan,
    SessionActions,
    SessionCacheConfig,
    SessionCacheStats,
    SessionInfo,
    SessionRestore,
    Tier,
)

__all__ = [
    "RestorePlan",
    "SessionActions",
    "SessionCache",
    "SessionCacheConfig",
    "SessionCacheStats",
    "SessionInfo",
    "SessionRestore",
    "Tier",
]


class _Chunk:
    __slots__ = ("first_block", "gpu_block_ids", "host_block_ids", "num_blocks")

    def __init__(self, first_block: int, gpu_block_ids: list[int]) -> None:
        self.first_block = first_block
        self.num_blocks = len(gpu_block_ids)
        self.gpu_block_ids: list[int] | None = gpu_block_ids
        self.host_block_ids: list[int] | None = None


class _Session:
    __slots__ = (
        "chunks",
        "gpu_start",
        "last_active",
        "num_blocks",
        "num_dropped",
        "order",
        "rebuild_seconds",
        "session_id",
        "shadow_end",
        "swap_seconds",
    )

    def __init__(self, session_id: str, chunks: list[_Chunk], last_active: float, order: int) -> None:
        self.session_id = session_id
        self.chunks = chunks
        self.num_blocks = sum(chunk.num_blocks for chunk in chunks)
        self.num_dropped = 0
        self.gpu_start = 0
        self.shadow_end = 0
        self.last_active = last_active
        self.order = order
        self.rebuild_seconds: list[float] = []
        self.swap_seconds: list[float] = []

    def get_first_block(self, chunk_index: int) -> int:
        return self.chunks[chunk_index].first_block if chunk_index < len(self.chunks) else self.num_blocks


class SessionCache:
    """Cached sessions of one replica across the GPU, CPU and dropped tiers (see module doc).

    Args:
        config: budgets, chunking, timeouts.
        cost_model: what rebuilding and copying back a chunk cost.
        clock: seconds, monotonic (injected: tests and the simulator drive it).
    """

    def __init__(self, config: SessionCacheConfig, cost_model: CostModel, clock: Callable[[], float]) -> None:
        self.config = config
        self.cost_model = cost_model
        self._clock = clock
        self._host = HostBlockPool(config.cpu_budget_blocks)
        self._sessions: dict[str, _Session] = {}
        # Cached sessions in check-in order, oldest first: expiry reads from the front.
        self._by_activity: dict[str, None] = {}
        # Sessions with copied-ahead chunks, in the order they got their first one.
        self._with_copies: dict[str, None] = {}
        self._demote_index = RetentionIndex(config.min_idle_s, config.bucket_ratio)
        self._cpu_drop_index = RetentionIndex(config.min_idle_s, config.bucket_ratio)
        self._gpu_drop_index = RetentionIndex(config.min_idle_s, config.bucket_ratio)
        self._orders = itertools.count()
        self._num_gpu_blocks = 0
        self._num_cpu_blocks = 0
        self._num_copy_blocks = 0
        self._num_dropped_blocks = 0
        self._num_demoted_chunks = 0
        self._num_dropped_chunks = 0
        self._num_swapped_out_blocks = 0
        self._num_expired_sessions = 0

    # ------------------------------------------------------------------ queries

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def get_num_gpu_blocks(self) -> int:
        """KV pool blocks held by cached sessions (all of them can be reclaimed)."""
        return self._num_gpu_blocks

    def get_num_free_host_blocks(self) -> int:
        return self._host.get_num_free_blocks()

    def get_session(self, session_id: str) -> SessionInfo | None:
        session = self._sessions.get(session_id)
        return None if session is None else self._info(session)

    def get_sessions(self) -> list[SessionInfo]:
        """Every cached session, least recently active first."""
        return [self._info(self._sessions[session_id]) for session_id in self._by_activity]

    def get_tiers(self, session_id: str) -> list[Tier]:
        """The tier of each chunk of a cached session, in chunk order."""
        session = self._sessions[session_id]
        return [
            Tier.DROPPED if index < session.num_dropped else Tier.CPU if index < session.gpu_start else Tier.GPU
            for index in range(len(session.chunks))
        ]

    def get_num_copied_ahead_chunks(self, session_id: str) -> int:
        session = self._sessions[session_id]
        return session.shadow_end - session.gpu_start

    def get_stats(self) -> SessionCacheStats:
        return SessionCacheStats(
            num_sessions=len(self._sessions),
            num_gpu_blocks=self._num_gpu_blocks,
            num_cpu_blocks=self._num_cpu_blocks,
            num_copied_ahead_blocks=self._num_copy_blocks,
            num_dropped_blocks=self._num_dropped_blocks,
            num_host_blocks=self._host.num_blocks,
            num_demoted_chunks=self._num_demoted_chunks,
            num_dropped_chunks=self._num_dropped_chunks,
            num_swapped_out_blocks=self._num_swapped_out_blocks,
            num_expired_sessions=self._num_expired_sessions,
        )

    def plan_restore(self, session_id: str, num_blocks: int) -> RestorePlan | None:
        """How `check_out(session_id, num_blocks)` would bring the blocks back; no change.

        Leading CPU chunks whose rebuild costs no more than their copy back are recomputed
        with the dropped ones. None when the session is not cached.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return None
        num_blocks = min(num_blocks, session.num_blocks)
        recompute_end = session.num_dropped
        while recompute_end < session.gpu_start and (
            session.rebuild_seconds[recompute_end] <= session.swap_seconds[recompute_end]
        ):
            recompute_end += 1
        num_dropped = min(session.get_first_block(recompute_end), num_blocks)
        num_host = min(session.get_first_block(session.gpu_start), num_blocks) - num_dropped
        return RestorePlan(num_blocks, num_dropped, num_host, num_blocks - num_dropped - num_host)

    # ------------------------------------------------------------------ turns

    def check_in(self, session_id: str, gpu_block_ids: list[int]) -> SessionActions:
        """Cache a session's full KV blocks after a turn (the caller's references pass to the
        cache), replacing what was cached for it. Enforces the GPU budget.

        Args:
            gpu_block_ids: KV pool blocks of the session's leading full blocks, in order.
        """
        actions = SessionActions()
        if session_id in self._sessions:
            self._remove(self._sessions[session_id], actions)
        if not gpu_block_ids:
            return actions
        actions.removed_session_ids.clear()  # replaced, not removed: the id stays cached
        blocks_per_chunk = self.config.blocks_per_chunk
        chunks = [
            _Chunk(start, gpu_block_ids[start : start + blocks_per_chunk])
            for start in range(0, len(gpu_block_ids), blocks_per_chunk)
        ]
        session = _Session(session_id, chunks, self._clock(), next(self._orders))
        block_size = self.config.block_size
        for chunk in chunks:
            session.rebuild_seconds.append(
                self.cost_model.get_rebuild_seconds(chunk.num_blocks * block_size, chunk.first_block * block_size)
            )
            session.swap_seconds.append(self.cost_model.get_swap_seconds(chunk.num_blocks))
        self._sessions[session_id] = session
        self._by_activity[session_id] = None
        self._num_gpu_blocks += session.num_blocks
        self._index(session)
        now = self._clock()
        while self._num_gpu_blocks > self.config.gpu_budget_blocks:
            freed = self._evict_gpu_chunk(now, actions)
            assert freed, "a cached session's GPU chunk can always be demoted or dropped"
        return actions

    def check_out(self, session_id: str, num_blocks: int) -> SessionRestore | None:
        """Take a returning session out of the cache for a turn that reuses its first
        `num_blocks` blocks (the tokens that match the new prompt); the rest is discarded.

        Returns:
            Where each reused block comes from (see `SessionRestore`), or None when the
            session is not cached.
        """
        plan = self.plan_restore(session_id, num_blocks)
        if plan is None:
            return None
        session = self._sessions[session_id]
        self._unlink(session)
        host_end = plan.num_dropped_blocks + plan.num_host_blocks
        host_block_ids: list[int] = []
        gpu_block_ids: list[int] = []
        freed_gpu_block_ids: list[int] = []
        for chunk in session.chunks:
            first = chunk.first_block
            # Offsets inside the chunk where the reused ranges end.
            host_stop = min(max(host_end - first, 0), chunk.num_blocks)
            keep_stop = min(max(plan.num_blocks - first, 0), chunk.num_blocks)
            if chunk.gpu_block_ids is not None:
                gpu_block_ids += chunk.gpu_block_ids[:keep_stop]
                freed_gpu_block_ids += chunk.gpu_block_ids[keep_stop:]
                if chunk.host_block_ids is not None:
                    self._host.free(chunk.host_block_ids)
            elif chunk.host_block_ids is not None:
                drop_stop = min(max(plan.num_dropped_blocks - first, 0), chunk.num_blocks)
                host_block_ids += chunk.host_block_ids[drop_stop:host_stop]
                self._host.free_after_step(chunk.host_block_ids[drop_stop:host_stop])
                self._host.free(chunk.host_block_ids[:drop_stop])
                self._host.free(chunk.host_block_ids[host_stop:])
        return SessionRestore(plan, host_block_ids, gpu_block_ids, freed_gpu_block_ids)

    def end_step(self) -> None:
        """A step's copies ran: host blocks copied back in it may be reused."""
        self._host.end_step()

    # ------------------------------------------------------------------ memory pressure

    def reclaim_gpu(self, num_blocks: int, keep_session_id: str | None = None) -> tuple[int, SessionActions]:
        """Free at least `num_blocks` KV pool blocks by demoting or dropping chunks, lowest
        retention value first, sparing `keep_session_id`.

        Returns:
            (GPU blocks freed: fewer only when no cached chunk is left on the GPU, actions)
        """
        actions = SessionActions()
        kept = self._sessions.get(keep_session_id) if keep_session_id is not None else None
        if kept is not None:
            self._unindex(kept)
        now = self._clock()
        num_freed = 0
        while num_freed < num_blocks:
            freed = self._evict_gpu_chunk(now, actions)
            if not freed:
                break
            num_freed += freed
        if kept is not None:
            self._index(kept)
        return num_freed, actions

    def copy_ahead(self, num_free_gpu_blocks: int) -> list[tuple[int, int]]:
        """While free KV pool blocks (plus those a copied-ahead chunk frees without a copy) are
        under `copy_ahead_free_blocks`, copy the GPU chunks next in eviction order to free
        host blocks. Never evicts anything for it.

        Returns:
            (GPU block, host block) pairs to copy; the GPU blocks stay in use.
        """
        deficit = self.config.copy_ahead_free_blocks - num_free_gpu_blocks - self._num_copy_blocks
        if deficit <= 0 or not self._host.get_num_free_blocks():
            return []
        now = self._clock()
        pairs: list[tuple[int, int]] = []
        visited: list[_Session] = []
        while deficit > 0:
            session_id = self._demote_index.get_min(now)
            if session_id is None:
                break
            session = self._sessions[session_id]
            self._demote_index.discard(session_id)
            visited.append(session)
            index = session.shadow_end
            while deficit > 0 and index < len(session.chunks):
                chunk = session.chunks[index]
                assert chunk.gpu_block_ids is not None and chunk.host_block_ids is None, (
                    "chunks past shadow_end are on the GPU without a copy"
                )
                host_block_ids = self._host.try_allocate_n(chunk.num_blocks)
                if host_block_ids is None:
                    deficit = 0
                    break
                pairs += zip(chunk.gpu_block_ids, host_block_ids, strict=True)
                chunk.host_block_ids = host_block_ids
                self._num_copy_blocks += chunk.num_blocks
                self._num_swapped_out_blocks += chunk.num_blocks
                deficit -= chunk.num_blocks
                index += 1
            if index > session.shadow_end:
                session.shadow_end = index
                self._with_copies[session_id] = None
        for session in visited:
            self._index(session)
        return pairs

    def expire(self) -> SessionActions:
        """Forget sessions idle for `idle_timeout_s` or longer."""
        actions = SessionActions()
        deadline = self._clock() - self.config.idle_timeout_s
        while self._by_activity:
            session = self._sessions[next(iter(self._by_activity))]
            if session.last_active > deadline:
                break
            self._remove(session, actions)
            self._num_expired_sessions += 1
        return actions

    def drop_session(self, session_id: str) -> SessionActions | None:
        """Forget one session now; None if it is not cached."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        actions = SessionActions()
        self._remove(session, actions)
        return actions

    # ------------------------------------------------------------------ eviction

    def _evict_gpu_chunk(self, now: float, actions: SessionActions) -> int:
        """Demote or drop one GPU chunk (see module doc); returns the GPU blocks freed."""
        session_id = self._demote_index.get_min(now)
        if session_id is None:
            return 0
        session = self._sessions[session_id]
        chunk = session.chunks[session.gpu_start]
        if chunk.host_block_ids is None:
            need = chunk.num_blocks
            if self._host.get_num_free_blocks() < need:
                self._discard_copies(need)
            if self._host.get_num_free_blocks() < need:
                target = self._choose_gpu_drop(now, session_id, need)
                if target is not None:
                    return self._drop_leading_chunk(self._sessions[target], actions)
                while self._host.get_num_free_blocks() < need:
                    victim_id = self._cpu_drop_index.get_min(now)
                    if victim_id is None:
                        break
                    self._drop_leading_chunk(self._sessions[victim_id], actions)
                if self._host.get_num_free_blocks() < need:
                    # Host blocks still waiting for this step's copies: drop instead.
                    target = self._gpu_drop_index.get_min(now)
                    assert target is not None, "with no CPU victim left, the GPU victim itself is droppable"
                    return self._drop_leading_chunk(self._sessions[target], actions)
        return self._demote(session, actions)

    def _choose_gpu_drop(self, now: float, demote_id: str, need: int) -> str | None:
        """The session whose first (GPU) chunk to drop instead of demoting `demote_id`'s,
        or None when demoting, after dropping the lowest-valued CPU chunk, is cheaper."""
        drop_id = self._gpu_drop_index.get_min(now)
        cpu_victim_id = self._cpu_drop_index.get_min(now)
        if cpu_victim_id is None or self._host.num_blocks < need:
            assert drop_id is not None, "with no CPU victim, the GPU victim itself is droppable"
            return drop_id
        if drop_id is None:
            return None
        demote_value = self._demote_index.get_value(demote_id, now) + self._cpu_drop_index.get_value(
            cpu_victim_id, now
        )
        return drop_id if self._gpu_drop_index.get_value(drop_id, now) < demote_value else None

    def _demote(self, session: _Session, actions: SessionActions) -> int:
        chunk = session.chunks[session.gpu_start]
        assert chunk.gpu_block_ids is not None, "the chunk at gpu_start is on the GPU"
        if chunk.host_block_ids is None:
            host_block_ids = self._host.try_allocate_n(chunk.num_blocks)
            assert host_block_ids is not None, "room in the host pool was made before demoting"
            actions.swap_out += zip(chunk.gpu_block_ids, host_block_ids, strict=True)
            chunk.host_block_ids = host_block_ids
            self._num_swapped_out_blocks += chunk.num_blocks
        else:
            self._num_copy_blocks -= chunk.num_blocks
        actions.freed_gpu_block_ids += chunk.gpu_block_ids
        chunk.gpu_block_ids = None
        self._num_gpu_blocks -= chunk.num_blocks
        self._num_cpu_blocks += chunk.num_blocks
        self._num_demoted_chunks += 1
        session.gpu_start += 1
        self._after_gpu_start_moved(session)
        self._index(session)
        return chunk.num_blocks

    def _drop_leading_chunk(self, session: _Session, actions: SessionActions) -> int:
        """Drop the session's first chunk still held; returns the GPU blocks freed."""
        chunk = session.chunks[session.num_dropped]
        num_gpu_freed = 0
        if chunk.gpu_block_ids is not None:
            assert session.num_dropped == session.gpu_start, "only a session without CPU chunks drops a GPU chunk"
            actions.freed_gpu_block_ids += chunk.gpu_block_ids
            num_gpu_freed = chunk.num_blocks
            self._num_gpu_blocks -= chunk.num_blocks
            if chunk.host_block_ids is not None:
                self._host.free(chunk.host_block_ids)
                self._num_copy_blocks -= chunk.num_blocks
            session.gpu_start += 1
        else:
            assert chunk.host_block_ids is not None, "a held chunk is on the GPU or the CPU"
            self._host.free(chunk.host_block_ids)
            self._num_cpu_blocks -= chunk.num_blocks
            if actions.swap_out:  # demoted earlier in this call: its copy is void now
                freed = set(chunk.host_block_ids)
                actions.swap_out = [pair for pair in actions.swap_out if pair[1] not in freed]
        chunk.gpu_block_ids = chunk.host_block_ids = None
        session.num_dropped += 1
        self._num_dropped_chunks += 1
        self._num_dropped_blocks += chunk.num_blocks
        if session.num_dropped == len(session.chunks):
            self._remove(session, actions)
        else:
            self._after_gpu_start_moved(session)
            self._index(session)
        return num_gpu_freed

    def _discard_copies(self, need: int) -> None:
        """Free copied-ahead host blocks (they cost nothing to lose) until `need` are free:
        the newest copy of the session that got its copies first goes first, so each
        session's copies stay a run from its first GPU chunk."""
        while self._host.get_num_free_blocks() < need and self._with_copies:
            session = self._sessions[next(iter(self._with_copies))]
            chunk = session.chunks[session.shadow_end - 1]
            assert chunk.host_block_ids is not None, "chunks before shadow_end have a copy"
            self._host.free(chunk.host_block_ids)
            chunk.host_block_ids = None
            self._num_copy_blocks -= chunk.num_blocks
            session.shadow_end -= 1
            if session.shadow_end == session.gpu_start:
                del self._with_copies[session.session_id]

    def _after_gpu_start_moved(self, session: _Session) -> None:
        if session.shadow_end <= session.gpu_start:
            session.shadow_end = session.gpu_start
            self._with_copies.pop(session.session_id, None)

    # ------------------------------------------------------------------ bookkeeping

    def _index(self, session: _Session) -> None:
        """Enter the session's next victims in the eviction indexes (or leave them)."""
        session_id = session.session_id
        has_gpu = session.gpu_start < len(session.chunks)
        has_cpu = session.num_dropped < session.gpu_start
        last_active, order = session.last_active, session.order
        if has_gpu:
            cost = session.swap_seconds[session.gpu_start]
            self._demote_index.set(session_id, cost, last_active, order)
        else:
            self._demote_index.discard(session_id)
        if has_cpu:
            index = session.num_dropped
            cost = max(0.0, session.rebuild_seconds[index] - session.swap_seconds[index])
            self._cpu_drop_index.set(session_id, cost, last_active, order)
        else:
            self._cpu_drop_index.discard(session_id)
        if has_gpu and not has_cpu:
            self._gpu_drop_index.set(session_id, session.rebuild_seconds[session.gpu_start], last_active, order)
        else:
            self._gpu_drop_index.discard(session_id)

    def _unindex(self, session: _Session) -> None:
        self._demote_index.discard(session.session_id)
        self._cpu_drop_index.discard(session.session_id)
        self._gpu_drop_index.discard(session.session_id)

    def _unlink(self, session: _Session) -> None:
        """Take the session out of every structure and counter (its blocks are the caller's)."""
        session_id = session.session_id
        self._unindex(session)
        del self._sessions[session_id]
        del self._by_activity[session_id]
        self._with_copies.pop(session_id, None)
        for chunk in session.chunks:
            if chunk.gpu_block_ids is not None:
                self._num_gpu_blocks -= chunk.num_blocks
                if chunk.host_block_ids is not None:
                    self._num_copy_blocks -= chunk.num_blocks
            elif chunk.host_block_ids is not None:
                self._num_cpu_blocks -= chunk.num_blocks
            else:
                self._num_dropped_blocks -= chunk.num_blocks

    def _remove(self, session: _Session, actions: SessionActions) -> None:
        """Forget a session: every block it holds is given back."""
        self._unlink(session)
        for chunk in session.chunks:
            if chunk.gpu_block_ids is not None:
                actions.freed_gpu_block_ids += chunk.gpu_block_ids
            if chunk.host_block_ids is not None:
                self._host.free(chunk.host_block_ids)
        actions.removed_session_ids.append(session.session_id)

    def _info(self, session: _Session) -> SessionInfo:
        num_dropped = session.get_first_block(session.num_dropped)
        gpu_start = session.get_first_block(session.gpu_start)
        return SessionInfo(
            session_id=session.session_id,
            num_blocks=session.num_blocks,
            num_gpu_blocks=session.num_blocks - gpu_start,
            num_cpu_blocks=gpu_start - num_dropped,
            num_dropped_blocks=num_dropped,
            last_active=session.last_active,
        )
