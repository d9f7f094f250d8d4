"""Runs one step plan through the Hugging Face model over the paged KV cache.

The model sees one flattened row of every scheduled token (`input_ids` [1, num_tokens]
with explicit `position_ids`), no HF cache (`use_cache=False`), and Shoal's attention
(`attention.py`), which reads and writes the KV pools this module allocates: each layer's
on its layer's device (`kv_placement`). Only the logits of each sampling sequence's last
token are computed (`logits_to_keep`).

Two attention paths: on the CPU, a host-side `AttentionPlan` per pass; on CUDA (or on the
CPU when told, for tests) the kernels' path (`device_batch`): decode rows first on the
paged kernel, prefill rows on SDPA, index tensors on every device that holds a layer,
uploaded through pinned staging buffers without a synchronizing copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from shoal.kernels.attention_plan import plan_attention
from shoal.services.worker.engine.attention import BATCH_KWARG, PagedBatch
from shoal.services.worker.engine.batch_scheduler import StepPlan
from shoal.services.worker.engine.device_batch import StagingBuffers, build_device_batch
from shoal.services.worker.engine.kv_placement import KVPools, get_layer_devices
from shoal.services.worker.engine.layered_swap_in import LayeredSwapIn, Mode
from shoal.services.worker.engine.native_forward import NativeForward, PackedModel, ThreadPolicy
from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.page_advice import release_pages
from shoal.shared.kv_cache.manager import KVCacheManager
from shoal.shared.kv_cache.session_settings import SwapInByLayer


def allocate_zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the system commits page by page as it is first
    written: anonymous mmap pages read as zeros until then. A KV pool sized for its full
    budget (`shoal.shared.model_settings.DEFAULT_KV_CACHE_TOKENS`) then takes the process's
    memory as the load fills it, not all at start (`torch.zeros` writes every page)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: a park's `release_pages` gives private pages back (shared ones would stay).
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mmap


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool tensor on `device` (committed lazily on the CPU)."""
    if device.type == "cpu":
        return allocate_zeros_lazily(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class PromptRows:
    """Prompt rows of one chunk whose logits are kept to score the prompt (`Sequence.prompt_logprobs`)."""

    chunk: int
    """The chunk's index in the plan."""
    first_position: int
    """The prompt position of the first row (row p gives token p + 1's distribution)."""
    row: int
    """Where the rows start in the pass's logits."""
    count: int


@dataclass(frozen=True)
class PreparedStep:
    """A step's model inputs, built under the engine lock from the live block tables."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_to_keep: int | torch.Tensor
    """Rows whose logits are computed: each sampling chunk's last token (0: every row)."""
    logits_order: torch.Tensor | None
    """The computed logits' rows in plan order, when the batch lays chunks out in another."""
    batch: PagedBatch
    copy_pairs: torch.Tensor | None
    swap_out_pairs: torch.Tensor | None = None
    """int64 [n, 2] (KV pool block, host block): copied first."""
    swap_in_pairs: torch.Tensor | None = None
    """int64 [n, 2] (host block, KV pool block): copied next, before the pass."""
    prompt_rows: tuple[PromptRows, ...] = ()


class ModelRunner:
    """Owns the KV tensor and turns step plans into forward passes.

    Args:
        model: a transformers causal LM set to Shoal's attention implementation.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        num_host_blocks: blocks of the host pool (the session cache's CPU tier): same layout,
            in CPU memory (pinned when the model is on CUDA); 0 for none.
        packed_model: the model's weights packed for the native forward (`native_forward`),
            which then runs every pass instead of the model's modules.
        threads: the native forward's thread policy.
        layer_devices: each layer's KV device; None: where the layer's weights are
            (`kv_placement.get_layer_devices`). Tests inject CPU labels (``cpu:1``).
        kernels_path: run attention the kernels' way (`device_batch`) on the CPU too, as on
            CUDA; None: on CUDA only.
        swap_in_by_layer: how copies back from the host pool run (`SessionSettings`).
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        packed_model: PackedModel | None = None,
        threads: ThreadPolicy | None = None,
        layer_devices: list[torch.device] | None = None,
        kernels_path: bool | None = None,
        swap_in_by_layer: SwapInByLayer = "auto",
    ) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        """Where the inputs go (the embedding's device)."""
        output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.output_device = output_embeddings.weight.device if output_embeddings is not None else self.device
        """Where the last hidden states are cut to the logits rows (the LM head's device)."""
        self.dtype = next(model.parameters()).dtype
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        devices = layer_devices or get_layer_devices(model)
        self.pools = KVPools(devices, (num_blocks, block_size, num_kv_heads, head_dim), self.dtype, allocate_pool)
        """Each layer's KV on its layer's device; the layout is drawn in `shoal.kernels.ops`."""
        self.layer_caches = self.pools.layer_caches
        on_cuda = any(device.type == "cuda" for device in self.pools.devices)
        self.kernels_path = on_cuda if kernels_path is None else kernels_path or on_cuda
        self._staging = StagingBuffers(pinned=on_cuda)
        self.host_cache: torch.Tensor | None = None
        if num_host_blocks:
            # Pinned on CUDA: the swap kernel reads and writes it through its mapped address.
            self.host_cache = torch.zeros(
                (config.num_hidden_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim),
                dtype=self.dtype,
                device="cpu",
                pin_memory=on_cuda,
            )
        self._swap_in_timing: tuple[float, Any, Any] | LayeredSwapIn | None = None
        self.swap_in_mode: Mode | None = None
        """How a step's copies back run: layer by layer (`layered_swap_in`), or None: all
        layers in one copy before the pass."""
        if swap_in_by_layer == "auto":
            self.swap_in_mode = "thread" if on_cuda else None
        elif swap_in_by_layer != "off":
            self.swap_in_mode = swap_in_by_layer
        self._swap_helper: ThreadPoolExecutor | None = None
        self.threads = threads or ThreadPolicy(max_threads=1)
        self.last_argmax: torch.Tensor | None = None
        """The last `execute`'s most likely token per row of its logits (same order), when the
        native forward computed it; None otherwise."""
        self.last_prompt_logits: list[tuple[PromptRows, torch.Tensor]] = []
        """The last `execute`'s logits of prompt rows to score (views: read before the next pass)."""
        self.want_hidden = False
        """The next `execute` keeps the final hidden states of its logits rows (`last_hidden`):
        a pass with an embedding request."""
        self.last_hidden: torch.Tensor | None = None
        """The last `execute`'s final (normed) hidden state per row of its logits, in the same
        order, when `want_hidden` was set; None otherwise."""
        self._pass_hidden: torch.Tensor | None = None
        self.native: NativeForward | None = None
        if packed_model is not None:
            assert not self.kernels_path, "the native forward runs the CPU plan"
            self.native = NativeForward(packed_model, self.layer_caches, self.threads)

    @property
    def kv_cache_bytes(self) -> int:
        return self.pools.nbytes

    def release_kv(self) -> None:
        """A park: the KV pools' memory goes back (`KVPools.release`), and on the CPU the host
        pool's pages too (pinned on CUDA: kept). What they held is forgotten; `restore_kv`
        makes them zeroed again."""
        self._swap_in_timing = None
        self.last_argmax = None
        self.pools.release()
        if self.host_cache is not None and not self.host_cache.is_pinned():
            release_pages(self.host_cache)

    def restore_kv(self) -> None:
        """The pools back after `release_kv`, zeroed, at the same size."""
        self.pools.restore()

    @property
    def host_cache_bytes(self) -> int:
        cache = self.host_cache
        return 0 if cache is None else cache.numel() * cache.element_size()

    def rest(self) -> None:
        """The engine has nothing to run: threads kept ready for the next pass may sleep."""
        if self.native is not None:
            self.native.rest()

    def take_swap_in_seconds(self) -> float:
        """How long the last `execute`'s copies back to the GPU took (0.0 without any): the
        pass waited for them. On CUDA, read from events once the pass is done."""
        timing, self._swap_in_timing = self._swap_in_timing, None
        if timing is None:
            return 0.0
        if isinstance(timing, LayeredSwapIn):
            return timing.get_exposed_seconds()
        seconds, start, end = timing
        if start is not None:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000.0
        return seconds

    def prepare(self, plan: StepPlan, kv_cache_manager: KVCacheManager) -> PreparedStep:
        """Flatten `plan` into tensors (call while no one changes the block tables)."""
        block_size = self.block_size
        device = self.device
        input_ids: list[int] = []
        position_ids: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logit_indices: list[int] = []
        sampled_chunks: list[int] = []
        sampled_rows: list[int] = []
        prompt_rows: list[PromptRows] = []
        block_tables: list[list[int]] = []
        chunks = plan.chunks
        order: list[int] | range = range(len(chunks))
        if self.kernels_path:
            # Decoding sequences first: they are the rows the paged kernel takes (device_batch).
            order = sorted(order, key=lambda i: chunks[i].num_new_tokens != 1)
        elif self.native is None:
            # Decoding sequences first, shortest context first: the CPU attention's length
            # groups are then runs of rows, read and written in place (no row gathers). The
            # native forward's decode attention takes rows in any order.
            order = sorted(
                order, key=lambda i: (chunks[i].num_new_tokens != 1, chunks[i].num_computed_tokens)
            )
        get_block_ids = kv_cache_manager.get_block_ids
        for index in order:
            chunk = chunks[index]
            start = chunk.num_computed_tokens
            block_ids = get_block_ids(chunk.seq.seq_id)
            if chunk.num_new_tokens == 1:  # a decode row (most rows): no ranges, no loop
                end = start + 1
                input_ids.append(chunk.seq.token_ids[start])
                position_ids.append(start)
                slot_mapping.append(block_ids[start // block_size] * block_size + start % block_size)
            else:
                end = start + chunk.num_new_tokens
                input_ids += chunk.seq.token_ids[start:end]
                position_ids += range(start, end)
                position = start
                while position < end:  # one range per block touched, not one item per token
                    block_end = min(end, (position // block_size + 1) * block_size)
                    base = block_ids[position // block_size] * block_size - (position // block_size) * block_size
                    slot_mapping += range(base + position, base + block_end)
                    position = block_end
            seq_lens.append(end)
            query_start_loc.append(len(input_ids))
            block_tables.append(block_ids)
            if chunk.seq.prompt_logprobs is not None:
                self._keep_prompt_rows(index, chunk.seq, start, end, len(input_ids), logit_indices, prompt_rows)
            if chunk.samples:
                sampled_rows.append(len(logit_indices))
                logit_indices.append(len(input_ids) - 1)
                sampled_chunks.append(index)
        staging = self._staging
        staging.begin_pass()
        # logits come in batch order; `sample` and the scheduler take them in plan order
        logits_order = None
        if sampled_chunks != sorted(sampled_chunks) or prompt_rows:
            plan_rows = [sampled_rows[i] for i in sorted(range(len(sampled_chunks)), key=sampled_chunks.__getitem__)]
            logits_order = staging.upload(staging.stage("logits_order", plan_rows, torch.int64), device)
        if self.kernels_path:
            batch = PagedBatch(
                layer_caches=self.layer_caches,
                device_batch=build_device_batch(
                    staging, self.pools.layer_devices, slot_mapping, block_tables, seq_lens, query_start_loc
                ),
            )
        else:  # the CPU path reads its per-pass plan, not the kernels' tensors
            batch = PagedBatch(
                layer_caches=self.layer_caches,
                slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
                cpu_plan=plan_attention(self.layer_caches[0][0], block_tables, seq_lens, query_start_loc),
            )
        copy_pairs = torch.tensor(plan.copy_pairs, dtype=torch.int64) if plan.copy_pairs else None
        swap_out_pairs = swap_in_pairs = None
        if plan.swap_out_pairs:
            swap_out_pairs = torch.tensor(plan.swap_out_pairs, dtype=torch.int64)
        if plan.swap_in_pairs:
            swap_in_pairs = torch.tensor(plan.swap_in_pairs, dtype=torch.int64)
        # Every row sampled (a pure decode step): keep all logits, no index op.
        logits_to_keep: int | torch.Tensor = 0
        if len(logit_indices) != len(input_ids):
            logits_to_keep = staging.upload(
                staging.stage("logits_to_keep", logit_indices, torch.int64), self.output_device
            )
        input_tensor = staging.upload(staging.stage("input_ids", input_ids, torch.int64), device)
        positions = staging.upload(staging.stage("position_ids", position_ids, torch.int64), device)
        staging.end_pass()
        return PreparedStep(
            input_ids=input_tensor.view(1, -1),
            position_ids=positions.view(1, -1),
            logits_to_keep=logits_to_keep,
            logits_order=logits_order,
            batch=batch,
            copy_pairs=copy_pairs,
            swap_out_pairs=swap_out_pairs,
            swap_in_pairs=swap_in_pairs,
            prompt_rows=tuple(prompt_rows),
        )

    @staticmethod
    def _keep_prompt_rows(index: int, seq: Sequence, start: int, end: int, num_rows: int,
                          logit_indices: list[int], prompt_rows: list[PromptRows]) -> None:
        """Keep the logits of the chunk's prompt rows not yet scored (the chunk ends at batch row
        `num_rows`); the last prompt token's row is the sampling row, not a prompt score."""
        first, last = max(start, seq.num_scored_prompt_rows), min(end, seq.num_prompt_tokens - 1)
        if first < last:
            prompt_rows.append(PromptRows(index, first, len(logit_indices), last - first))
            logit_indices += range(num_rows - end + first, num_rows - end + last)

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> torch.Tensor:
        """Run the forward pass; returns logits [num_sampling_seqs, vocab_size] in chunk order.

        First the session cache's copies: KV pool -> host (a block freed by a demotion may
        be written by this pass or copied into by the swap-in below), then host -> KV pool:
        every layer before the pass, or layer by layer, each before its layer's attention
        (`swap_in_mode`, `layered_swap_in`).
        """
        if step.swap_out_pairs is not None:
            assert self.host_cache is not None, "swaps need a host pool"
            self.pools.swap_out(self.host_cache, step.swap_out_pairs)
        layered: LayeredSwapIn | None = None
        batch = step.batch
        if step.swap_in_pairs is not None:
            assert self.host_cache is not None, "swaps need a host pool"
            if self.swap_in_mode is None or step.copy_pairs is not None:
                # (a block copy of the step may read a block copied back: all layers first)
                self._swap_in(step.swap_in_pairs)
            else:
                layered = self._start_layered_swap_in(step.swap_in_pairs)
                batch = dataclasses.replace(batch, before_attention=layered.wait)
        if step.copy_pairs is not None:
            self.pools.copy_blocks(step.copy_pairs)
        self.last_argmax = self.last_hidden = None
        try:
            logits = self._forward(step, batch)
        except BaseException:
            if layered is not None:
                with contextlib.suppress(Exception):  # the pass's error is the one to raise
                    layered.finish()
            raise
        if layered is not None:
            layered.finish()
        self.last_prompt_logits = [(rows, logits[rows.row:rows.row + rows.count]) for rows in step.prompt_rows]
        hidden, self._pass_hidden = self._pass_hidden, None
        if hidden is not None:  # a copy: the native forward's rows are a buffer the next pass overwrites
            self.last_hidden = (hidden.clone() if step.logits_order is None
                                else hidden.index_select(0, step.logits_order.to(hidden.device)))
        if step.logits_order is None:
            return logits
        # The logits come back where the model's hooks put them (the LM head's device, or
        # the input's): the order follows them (a no-op on one device).
        return logits.index_select(0, step.logits_order.to(logits.device, non_blocking=True))

    def _forward(self, step: PreparedStep, batch: PagedBatch) -> torch.Tensor:
        if self.native is not None:
            logits = self.native.execute(step.input_ids, step.position_ids, batch, step.logits_to_keep)
            argmax = self.native.last_argmax
            if argmax is not None:
                self.last_argmax = argmax if step.logits_order is None else argmax.index_select(0, step.logits_order)
            if self.want_hidden:
                self._pass_hidden = self.native.last_hidden
            return logits
        captured: list[torch.Tensor] = []
        hook = (self.model.get_decoder().norm.register_forward_hook(lambda _m, _a, out: captured.append(out))
                if self.want_hidden else None)
        try:
            output = self.model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                use_cache=False,
                logits_to_keep=step.logits_to_keep,
                **{BATCH_KWARG: batch},
            )
        finally:
            if hook is not None:
                hook.remove()
        if captured:  # the final norm's output [1, T, H]: the rows the LM head read
            self._pass_hidden = _kept_rows(captured[0][0], step.logits_to_keep)
        return output.logits[0]

    def _start_layered_swap_in(self, pairs: torch.Tensor) -> LayeredSwapIn:
        assert self.host_cache is not None and self.swap_in_mode is not None
        helper = None
        if self.swap_in_mode == "thread" and self.device.type != "cuda":
            if self._swap_helper is None:
                self._swap_helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-swap-in")
            helper = self._swap_helper
        layered = LayeredSwapIn(self.pools, self.host_cache, pairs, self.swap_in_mode, helper)
        self._swap_in_timing = layered
        return layered

    def _swap_in(self, pairs: torch.Tensor) -> None:
        assert self.host_cache is not None
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.pools.swap_in(self.host_cache, pairs)
            end.record()
            self._swap_in_timing = (0.0, start, end)
        else:
            started = time.perf_counter()
            self.pools.swap_in(self.host_cache, pairs)
            self._swap_in_timing = (time.perf_counter() - started, None, None)


def _kept_rows(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The rows of `hidden` [T, H] that transformers' ``logits_to_keep`` keeps (an int k: the
    last k, 0 for all; a tensor: those indices)."""
    if isinstance(logits_to_keep, int):
        return hidden[-logits_to_keep:] if logits_to_keep else hidden
    return hidden.index_select(0, logits_to_keep.to(hidden.device))
