"""ModelRunner: executes a StepPlan on the model and the paged KV cache, returns the sampled tokens.

Keeps the worker's mirror of every live request (its token ids, block table, sampling state); the
scheduler sends full request data once and only diffs afterwards.

Fault isolation: when a batched step raises, each request of the step runs again alone (KV writes of
the same tokens at the same slots are idempotent), and only the ones that still raise are reported
failed and skipped until the scheduler says they finished. A CUDA error is no one request's fault:
it propagates and stops the server.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from crane_mp.config import attention_backend_override, fault_injection_token
from crane_mp.models.kv_groups import KVGroups, group_layers, page_rows
from crane_mp.protocol import (
    DraftOutcome,
    PooledOutput,
    PromptLogprobs,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, group_spans
from crane_mp.worker.cache.state_pool import StatePool, state_bytes_per_sequence
from crane_mp.worker.models.layers import CausalLM
from crane_mp.worker.models.moe import routing_table
from crane_mp.worker.models.mrope_tables import mrope_columns, mrope_cos_sin
from crane_mp.worker.models.rope import rope_tables
from crane_mp.worker.platforms import Platform
from crane_mp.worker.platforms.device import is_device_fault
from crane_mp.worker.sampling.grammar import GrammarEngine
from crane_mp.worker.sampling.sampler import Sampler, SamplingState
from crane_mp.worker.sampling.whisper_logits import apply_whisper_rules
from crane_mp.worker.speculative.mtp import FedRows
from crane_mp.worker.step.decode_graphs import DecodeGraphs, capture_cuda
from crane_mp.worker.step.forward_context import (
    ForwardContext,
    LoraBatch,
    MediaSpan,
    StateBatch,
    forward_context,
    lora_batch,
)
from crane_mp.worker.step.host_buffers import device_longs

log = logging.getLogger("crane_mp.worker")


@dataclass(slots=True)
class RequestMirror:
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    block_table: list[int]
    sampling: SamplingState
    group_tables: list[list[int]]  # the block tables of KV groups 1, 2, ... (models/kv_groups.py)
    num_prompt_scored: int = 1  # prompt logprobs are reported for tokens [1, num_prompt_scored) so far
    pool_sum: torch.Tensor | None = None  # mean or CLS pooling: sum of the pooled tokens' final hidden states
    num_pooled: int = 0  # ... of prompt positions [0, num_pooled)
    media: Any = None  # what a media model made of the request's images or audio (its media_state)
    state_slot: int | None = None  # a hybrid model's state pool slot, while the request runs

    def progress(self) -> tuple:
        """What a step advances besides tokens, to restore when the step is redone request by request."""
        return self.num_prompt_scored, self.num_pooled, self.pool_sum

    def restore(self, progress: tuple) -> None:
        self.num_prompt_scored, self.num_pooled, self.pool_sum = progress


class ModelRunner:
    def __init__(
        self, model: CausalLM, block_size: int, max_positions: int, platform: Platform,
        attention_backend: str | None = None, grammars: GrammarEngine | None = None,
        kv_dtype: torch.dtype | None = None, share_tokens: Callable[[list[int]], list[int]] | None = None,
        recurrent_dtype: torch.dtype = torch.float32,
    ) -> None:
        """`share_tokens`: tensor parallelism's agreement on each step's sampled tokens (rank 0's);
        `recurrent_dtype`: a hybrid model's recurrent state (--mamba-ssm-cache-dtype)."""
        self.model = model
        self.share_tokens = share_tokens
        self.config = model.config
        self.block_size = block_size
        self.platform = platform
        self.device = platform.device
        self.max_positions = max_positions
        self.dtype = model.compute_dtype
        self.kv_dtype = kv_dtype or self.dtype  # the cache's storage (Platform.kv_dtype)
        self.prompt_dtype = platform.prompt_attention_dtype(self.dtype, self.kv_dtype)
        self.prompt_kernel = self.prompt_dtype is not None and platform.prompt_attention_kernel()
        self.cos, self.sin = rope_tables(self.config, max_positions, self.dtype, self.device)
        # The sliding layers' own rope (Gemma 3's local base), where the family gives them one.
        self.sliding_rope = (rope_tables(self.config, max_positions, self.dtype, self.device, sliding=True)
                             if self.config.layout.sliding_rope is not None else None)
        section = self.config.mrope_section
        self.mrope_columns = (mrope_columns(section, self.config.mrope_interleaved, self.cos.shape[-1]).to(self.device)
                              if section else None)
        self.grammars = grammars
        self.sampler = Sampler(model.logits_size, platform, grammars)  # an encoder's stub: 1
        self.requests: dict[int, RequestMirror] = {}
        self.num_blocks = 0
        self.attention_backend = platform.attention_backend(attention_backend or attention_backend_override())
        if self.attention_backend == "triton" and any(isinstance(getattr(layer, "sinks", None), torch.Tensor)
                                                      for layer in model.modules()):
            self.attention_backend = "torch"  # the Triton kernels take no attention sinks (gpt-oss)
        self.failed: dict[int, str] = {}  # req id -> error, until the scheduler finishes the request
        self._newly_failed: list[int] = []
        self.fault_token = fault_injection_token()
        self.decode_graphs: DecodeGraphs | None = None
        layers = self.model.attention_layers()
        self.kv_groups: KVGroups = group_layers([getattr(attn, "window", None) for attn in layers],
                                                [self._kv_shape(attn) for attn in layers])
        for attn, (group, _) in zip(layers, self.kv_groups.layer_slots):
            attn.kv_group = group
        # Cache tensors per slot: keys and values, or one whose rows hold both (DeepSeek's latent).
        self.kv_tensors = 1 if layers and all(getattr(attn, "latent_kv", False) for attn in layers) else 2
        self.routing = routing_table(self.model)  # tokens per expert of a mixture of experts (/metrics)
        # A hybrid model's recurrent layers and their per-sequence state (allocate_state_pool).
        self.state_layers = model.state_layers() if hasattr(model, "state_layers") else []
        self.state_pool: StatePool | None = None
        self.recurrent_dtype = recurrent_dtype
        # Speculative decoding's proposer (worker/speculative/), set at start-up; None: off.
        self.proposer = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """`num_blocks` for the scheduler, and one spare block past them for padded decode-graph rows (and
        for the entries of sliding groups' tables before their windows). The i-th layer of every KV
        group shares the i-th pair of cache tensors: the groups hold different block ids of them, each
        layer viewing the tensor in its own shape (a narrower one as more, smaller blocks)."""
        rows = self._slot_rows()
        tensors = {slot: tuple(self.platform.zeros(((num_blocks + 1) * self.block_size * row,), self.kv_dtype)
                               for _ in range(self.kv_tensors)) for slot, row in rows.items()}
        for attn, (group, slot) in zip(self.model.attention_layers(), self.kv_groups.layer_slots):
            heads, size = self._kv_shape(attn)
            shape = ((num_blocks + 1) * (rows[slot] // (heads * size)), self.block_size, heads, size)
            views = [storage.view(shape) for storage in tensors[slot]]
            attn.k_cache, attn.v_cache = views[0], views[-1]
        self.num_blocks = num_blocks

    def state_bytes_per_sequence(self) -> int:
        """A sequence's state over the recurrent layers (0 without any)."""
        return state_bytes_per_sequence(self.state_layers, self.dtype, self.recurrent_dtype)

    def allocate_state_pool(self, slots: int) -> None:
        """The recurrent layers' state for `slots` sequences at once (the memory plan's state_slots)."""
        self.state_pool = StatePool(self.state_layers, slots, self.device, self.dtype, self.recurrent_dtype)

    def _slot_rows(self) -> dict[int, int]:
        """Per cache tensor: the KV elements it keeps per token."""
        return page_rows(self.kv_groups, [math.prod(self._kv_shape(attn)) for attn in self.model.attention_layers()])

    def _kv_shape(self, attn) -> tuple[int, int]:
        """(KV heads, head size) of one attention layer's cache: the config's, unless the layer has its
        own (Gemma 4's global layers, a transformers-backend module)."""
        return (getattr(attn, "num_kv_heads", self.config.num_key_value_heads),
                getattr(attn, "head_dim", self.config.head_dim))

    @torch.inference_mode()
    def enable_decode_graphs(self, sizes: list[int], capture=capture_cuda) -> None:
        """Capture decode forwards for these batch sizes (after the KV cache is allocated: graphs keep
        its addresses)."""
        graphs = DecodeGraphs(self, sizes, capture)
        graphs.capture_all()
        self.decode_graphs = graphs

    def kv_bytes_per_token(self) -> int:
        """Bytes of one block id's KV per token: every layer's, or one KV group's."""
        rows = self._slot_rows() or {0: self.config.num_hidden_layers * self.config.num_key_value_heads
                                     * self.config.head_dim}
        return self.kv_tensors * sum(rows.values()) * self.kv_dtype.itemsize

    def kv_bytes_per_long_token(self) -> int:
        """KV bytes a token keeps once a sequence is past its sliding windows: its full groups'."""
        full_groups = sum(window == 0 for window in self.kv_groups.windows)
        return full_groups * self.kv_bytes_per_token()

    # ---- one step -------------------------------------------------------------------------------

    def _apply_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            if self.proposer is not None:
                self.proposer.forget(req_id)
            mirror = self.requests.pop(req_id, None)
            if mirror is not None:
                self.sampler.release(mirror.sampling)
                self._release_state(mirror)
            elif self.grammars is not None:  # ended while waiting for its first step
                self.grammars.forget(req_id)
            self.failed.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            if req_id in self.requests:
                self.requests[req_id].block_table, self.requests[req_id].group_tables = [], []
                if self.proposer is not None:
                    self.proposer.reset(req_id)
                self._release_state(self.requests[req_id])  # it recomputes from its first token
        eos = self.config.eos_token_ids
        for new in plan.new_requests:
            try:
                media = self._media_state(new.prompt_ids, new.media)
                state = self.sampler.new_state(new.sampling, new.prompt_ids, eos, new.req_id)
            except Exception as err:
                self._fail(new.req_id, err)
                continue
            self.requests[new.req_id] = RequestMirror(list(new.prompt_ids), len(new.prompt_ids), [], state, [],
                                                      media=media)
        for sched in plan.scheduled:
            if sched.req_id in self.failed:
                continue
            mirror = self.requests[sched.req_id]
            # Block ids into each group's cache views (kv_groups.py: a narrower group's are scaled).
            new_ids, *group_ids = [[block * scale for block in ids] if scale > 1 else ids for scale, ids in
                                   zip(self.kv_groups.scales, [sched.new_block_ids, *sched.group_block_ids])]
            if sched.reset_blocks:
                if self.proposer is not None:
                    self.proposer.reset(sched.req_id)
                mirror.block_table = list(new_ids)
                mirror.group_tables = [list(ids) for ids in group_ids]
            else:
                mirror.block_table.extend(new_ids)
                for table, ids in zip(mirror.group_tables, group_ids):
                    table.extend(ids)
            if self.state_pool is not None:
                try:
                    self._take_state(mirror, sched.num_computed_tokens)
                except RuntimeError as err:
                    self._fail(sched.req_id, err)

    def _take_state(self, mirror: RequestMirror, start: int) -> None:
        """A state slot for a request about to compute from position `start`: emptied when it starts
        from its first token; one it went on from must be the one it holds."""
        if mirror.state_slot is None:
            if start:
                raise RuntimeError(f"a request resumes at position {start} without its recurrent state")
            mirror.state_slot = self.state_pool.acquire()
        if start == 0:
            self.state_pool.reset(mirror.state_slot)

    def _release_state(self, mirror: RequestMirror) -> None:
        if mirror.state_slot is not None:
            self.state_pool.release(mirror.state_slot)
            mirror.state_slot = None

    def _media_state(self, prompt_ids: list[int], media: list) -> Any:
        """A media model's state of a new request (None for a text model's request, or a text-only one)."""
        if getattr(self.model, "media_kind", None) is None:
            if media:
                raise ValueError(f"{self.config.arch} takes no {media[0].kind} input")
            return None
        return self.model.media_state(prompt_ids, media)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self._apply_plan(plan)
        if self.routing is not None:  # what profiling and warm-up steps routed is not served traffic
            self.routing.clear()
        scheduled = [s for s in plan.scheduled if s.req_id not in self.failed]
        result = StepResult(plan.step_id, [], [])
        if scheduled:
            # Only prompt-scoring and mean-pooling requests advance before sampling; the rest need no snapshot.
            saved = {s.req_id: mirror.progress() for s in scheduled
                     if _advances_before_sampling((mirror := self.requests[s.req_id]).sampling.params)}
            try:
                self._run(scheduled, result)
            except Exception as err:
                if self._fatal(err):
                    raise
                for req_id, progress in saved.items():  # the batch's prompt scores and sums are redone too
                    self.requests[req_id].restore(progress)
                result = self._run_one_by_one(plan.step_id, scheduled)
        result.failed_req_ids, self._newly_failed = self._newly_failed, []
        result.errors = [self.failed[req_id] for req_id in result.failed_req_ids]
        eos = self.config.eos_token_ids
        result.cut_short_req_ids = [req_id for req_id, token in zip(result.req_ids, result.token_ids)
                                    if token in eos and self.requests[req_id].sampling.cut_short]
        if self.routing is not None:
            result.expert_tokens = self.routing.totals()
        result.seconds = time.perf_counter() - started
        return result

    def _run_one_by_one(self, step_id: int, scheduled: list[ScheduledRequest]) -> StepResult:
        """The batched step raised: run each request alone; fail only the ones that raise again. A
        hybrid model's recurrent state may have taken part of the step: each request then recomputes
        from its first token (its KV rewritten as it was)."""
        result = StepResult(step_id, [], [])
        for sched in scheduled:
            if self.state_pool is not None:
                mirror = self.requests[sched.req_id]
                self.state_pool.reset(mirror.state_slot)
                sched = ScheduledRequest(sched.req_id, 0, sched.num_computed_tokens + sched.num_new_tokens, [])
            try:
                self._run([sched], result)
            except Exception as err:
                if self._fatal(err):
                    raise
                self._fail(sched.req_id, err)
        return result

    def _run(self, scheduled: list[ScheduledRequest], result: StepResult) -> None:
        """Forward and sample `scheduled`, appending to `result` (only once all of it succeeded)."""
        prompt_logprobs: list[PromptLogprobs] = []
        pooled: list[PooledOutput] = []
        drafts: list[DraftOutcome] = []
        req_ids, tokens, logprobs = self._forward_and_sample(scheduled, prompt_logprobs, pooled, drafts)
        before = len(result.req_ids)
        result.req_ids += req_ids
        result.token_ids += tokens
        # logprobs stay empty unless some request asked for them; then one entry per sampled row.
        if logprobs:
            result.logprobs += [None] * (before - len(result.logprobs)) + logprobs
        elif result.logprobs:
            result.logprobs += [None] * len(req_ids)
        result.prompt_logprobs += prompt_logprobs
        result.pooled += pooled
        result.drafts += drafts

    def _fatal(self, err: Exception) -> bool:
        """An error no request caused. With tensor parallelism (share_tokens) also running out of memory,
        which one rank may meet alone: redoing the step request by request there, while the others
        go on, would pair their collectives wrongly. Any other error is the same on every rank (the same
        code on the same inputs), which then redo the step alike."""
        out_of_memory = isinstance(err, (MemoryError, torch.OutOfMemoryError))
        return is_device_fault(err) or (self.share_tokens is not None and out_of_memory)

    def _fail(self, req_id: int, err: Exception) -> None:
        log.error("request %d failed in the worker; failing it alone", req_id, exc_info=err)
        # The client learns that it failed; what the exception said (paths, values) stays in this log.
        self.failed[req_id] = (f"internal error in the model worker ({type(err).__name__}); the server log has "
                               "the details")
        self._newly_failed.append(req_id)

    def _forward_and_sample(
        self, scheduled: list[ScheduledRequest], prompt_logprobs: list[PromptLogprobs], pooled: list[PooledOutput],
        outcomes: list[DraftOutcome],
    ) -> tuple[list[int], list[int], list[TokenLogprobs | None]]:
        """One forward over the scheduled spans; samples the requests whose span reached their end (an
        embedding request gets its pooled vector and a placeholder token instead). A speculating decode
        row computes its proposals after its token too, and gains every token verification keeps."""
        drafts = self._propose(scheduled, outcomes)
        # Decode-first token layout (see attention.py); remember each request's last row for sampling.
        order = sorted(scheduled, key=lambda s: s.num_new_tokens > 1 or (
            s.req_id in drafts and not self._verifies_as_decodes(s.num_computed_tokens)))
        input_ids: list[int] = []
        positions: list[int] = []
        adapters: list[int] = []  # each row's LoRA adapter (0: none)
        decodes: list[SeqSpan] = []
        prefills: list[SeqSpan] = []
        sample_rows: dict[int, int] = {}
        score_rows: list[tuple[int, int, int]] = []  # (req_id, first row, first prompt token scored)
        sum_rows: list[tuple[int, int, int]] = []  # mean pooling: (req_id, first row, prompt positions summed)
        media: list[MediaSpan] = []
        decode_slots: list[int] = []  # each decode row's state pool slot (a hybrid model's)
        prefill_slots: list[int] = []  # each prefill span's
        decode_rows: list[tuple[int, int]] = []  # (req id, its decode rows) in row order
        first_rows: dict[int, int] = {}  # each request's first row
        for sched in order:
            mirror = self.requests[sched.req_id]
            first_rows[sched.req_id] = len(input_ids)
            start, end = sched.num_computed_tokens, sched.num_computed_tokens + sched.num_new_tokens
            if mirror.media is not None:
                media.append(MediaSpan(mirror.media, start, end, len(input_ids), mirror.block_table))
            proposed = drafts.get(sched.req_id, [])
            input_ids.extend(mirror.token_ids[start:end] + proposed)
            positions.extend(range(start, end + len(proposed)))
            adapters.extend([mirror.sampling.params.lora_id] * (end - start + len(proposed)))
            if sched.num_new_tokens == 1 and (not proposed or self._verifies_as_decodes(start)):
                # A decode row, and each proposal after it a decode of its own position: every row attends
                # its keys through the decode kernel as a step of its own would (the step writes every
                # row's keys before attending), so verification sees the logits plain decoding does.
                decodes.extend(SeqSpan(start + i, 1, mirror.block_table, mirror.group_tables)
                               for i in range(1 + len(proposed)))
                decode_slots += [mirror.state_slot] * (1 + len(proposed))
                decode_rows.append((sched.req_id, 1 + len(proposed)))
            else:  # a prompt chunk, or proposals over a long context: one span reads the keys once
                span = SeqSpan(start, sched.num_new_tokens + len(proposed), mirror.block_table, mirror.group_tables)
                (decodes if span.q_len == 1 else prefills).append(span)
                (decode_slots if span.q_len == 1 else prefill_slots).append(mirror.state_slot)
                if span.q_len == 1:
                    decode_rows.append((sched.req_id, 1))
            if end == len(mirror.token_ids):
                sample_rows[sched.req_id] = len(input_ids) - 1 - len(proposed)
            if mirror.sampling.params.prompt_logprobs is not None and mirror.num_prompt_scored < mirror.num_prompt_tokens:
                # Row of position p predicts prompt token p + 1; score the ones not reported yet.
                first = max(start, mirror.num_prompt_scored - 1)
                last = min(end, mirror.num_prompt_tokens - 1)
                if first < last:
                    score_rows.append((sched.req_id, len(input_ids) - (end - first), last - first))
            if mirror.sampling.params.pools_prompt:
                pooled_tokens = 1 if mirror.sampling.params.pooling == "cls" else mirror.num_prompt_tokens
                first, last = max(start, mirror.num_pooled), min(end, pooled_tokens)
                if first < last:
                    sum_rows.append((sched.req_id, len(input_ids) - (end - first), last - first))

        lora = lora_batch(adapters, self.device)
        states = None
        if self.decode_graphs is not None and not prefills and lora is None and self.decode_graphs.fits(len(decodes)):
            hidden = self.decode_graphs.run(decodes, input_ids, positions)
        else:
            feeds = getattr(self.proposer, "needs_hidden", False)
            needed = None if score_rows or sum_rows or media or feeds else sorted(
                row + i for req_id, row in sample_rows.items() for i in range(1 + len(drafts.get(req_id, ()))))
            if self.state_pool is not None:
                states = StateBatch(decode_slots + prefill_slots, len(decodes),
                                    device_longs(decode_slots, self.device) if decodes else None,
                                    self._waves(decode_slots))
            hidden = self.forward(decodes, prefills, input_ids, positions, lora, media, needed, states)
        for req_id, row, count in score_rows:
            prompt_logprobs.append(self._score_prompt(req_id, hidden[row : row + count]))
        for req_id, row, count in sum_rows:
            self._add_to_pool(req_id, hidden[row : row + count])

        ready = [s.req_id for s in scheduled if s.req_id in sample_rows]
        sampled_ids = [r for r in ready if self.requests[r].sampling.params.pooling is None]
        embedded_ids = [r for r in ready if self.requests[r].sampling.params.pooling is not None]
        for req_id in embedded_ids:
            pooled.append(self._pool(req_id, hidden[sample_rows[req_id]]))
        if not sampled_ids:
            return embedded_ids, [_PLACEHOLDER_TOKEN] * len(embedded_ids), []
        if self.fault_token is not None:
            self._inject_fault(sampled_ids)
        if any(req_id in drafts for req_id in sampled_ids):
            sampled_ids, tokens, logprobs = self._verify(hidden, sampled_ids, sample_rows, drafts, outcomes)
            if states is not None and states.waves is not None:
                self._commit_states(decode_rows, sampled_ids)
        else:
            tokens, logprobs = self._sample_rows(hidden, sampled_ids, sample_rows)
        if getattr(self.proposer, "needs_hidden", False):
            self._feed_proposer(scheduled, first_rows, drafts, hidden)
        if embedded_ids:
            logprobs = logprobs + [None] * len(embedded_ids) if logprobs else []
        return sampled_ids + embedded_ids, tokens + [_PLACEHOLDER_TOKEN] * len(embedded_ids), logprobs

    def _sample_rows(self, hidden: torch.Tensor, req_ids: list[int],
                     sample_rows: dict[int, int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token for each of `req_ids` from its row of `hidden`, appended to its tokens."""
        rows = device_longs([sample_rows[r] for r in req_ids], self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [N, vocab]
        states = [self.requests[r].sampling for r in req_ids]
        if any(state.params.whisper is not None for state in states):
            logits = self._whisper_rules(logits, req_ids)
        tokens, logprobs = self.sampler.sample(logits, states)
        if self.share_tokens is not None:
            tokens = self.share_tokens(tokens)
        for req_id, token in zip(req_ids, tokens):
            self.requests[req_id].token_ids.append(token)
        self.sampler.record(states, tokens)
        return tokens, logprobs

    def _propose(self, scheduled: list[ScheduledRequest], outcomes: list[DraftOutcome]) -> dict[int, list[int]]:
        """The proposals of this step's speculating decode rows (none empty: a row with nothing to propose
        decodes as any row, its outcome saying so)."""
        if self.proposer is None:
            return {}
        batch = []
        for sched in scheduled:
            mirror = self.requests[sched.req_id]
            if sched.num_lookahead and sched.num_computed_tokens + 1 == len(mirror.token_ids):
                batch.append((sched.req_id, mirror.token_ids, mirror.block_table, sched.num_lookahead))
        proposals = self.proposer.propose(batch) if batch else {}
        outcomes += [DraftOutcome(req_id, 0, 0) for req_id, tokens in proposals.items() if not tokens]
        return {req_id: tokens for req_id, tokens in proposals.items() if tokens}

    def _verifies_as_decodes(self, start: int) -> bool:
        """Whether a speculating decode row at position `start` and its proposals run as decode rows. A
        hybrid's always do: its recurrent layers then keep the state after each row (_commit_states)."""
        return start <= _PROPOSAL_DECODE_CONTEXT or bool(self.state_layers)

    def _waves(self, decode_slots: list[int]) -> list[torch.Tensor] | None:
        """StateBatch.waves: the decode rows that are their sequence's first, second, ... (None: all first)."""
        seen: dict[int, int] = {}
        depths = []
        for slot in decode_slots:
            depths.append(seen.get(slot, 0))
            seen[slot] = depths[-1] + 1
        if not depths or max(depths) == 0:
            return None
        return [device_longs([row for row, d in enumerate(depths) if d == depth], self.device)
                for depth in range(max(depths) + 1)]

    def _commit_states(self, decode_rows: list[tuple[int, int]], gained_ids: list[int]) -> None:
        """A verifying step's recurrent states advance by each sequence's decode rows whose tokens it kept
        (its decode row and the proposals accepted: one row per token gained). `decode_rows`: (req id,
        rows) of the step's decode rows, in order."""
        gained = Counter(gained_ids)
        kept = [i < gained[req_id] for req_id, rows in decode_rows for i in range(rows)]
        mask = torch.tensor(kept, dtype=torch.bool, device=self.device)
        for layer in self.state_layers:
            layer.commit(mask)

    def _feed_proposer(self, scheduled: list[ScheduledRequest], first_rows: dict[int, int],
                       drafts: dict[int, list[int]], hidden: torch.Tensor) -> None:
        """Hand a proposer that reads the target's hidden states (mtp.py) every row of the step whose next
        token is known now: each span's, and the proposals verification kept. It failing costs its
        proposals, never the step (whose tokens are sampled already): its requests are fed afresh."""
        rows = []
        for sched in scheduled:
            mirror = self.requests[sched.req_id]
            if mirror.sampling.params.pooling is not None:
                continue
            start = sched.num_computed_tokens
            known = len(mirror.token_ids) - 1 - start  # rows whose next token is known (rejected rows are not)
            count = min(known, sched.num_new_tokens + len(drafts.get(sched.req_id, ())))
            rows.append(FedRows(sched.req_id, start, first_rows[sched.req_id],
                                mirror.token_ids[start + 1 : start + 1 + count], mirror.block_table))
        try:
            self.proposer.feed(rows, hidden)
        except Exception as err:
            if self._fatal(err):
                raise
            log.exception("the proposer failed to take a step's hidden states; its requests' proposals start afresh")
            for fed in rows:
                self.proposer.reset(fed.req_id)

    def _verify(self, hidden: torch.Tensor, req_ids: list[int], sample_rows: dict[int, int],
                drafts: dict[int, list[int]], outcomes: list[DraftOutcome],
                ) -> tuple[list[int], list[int], list[TokenLogprobs | None]]:
        """Sample each request's rows in order, as if each were its own step, while the token sampled
        equals the one proposed there: every token comes from the model's own (processed) distribution
        given the tokens before it, so greedy and seeded requests gain exactly the tokens they gain
        without speculation, and the rest the same distribution (a proposal made with certainty, which
        both proposers make, is accepted with the probability the model gives it, as rejection
        sampling would). Returns (req id, token, logprobs) per token, each request's consecutive."""
        counts = [1 + len(drafts.get(r, ())) for r in req_ids]
        rows = [sample_rows[r] + i for r, count in zip(req_ids, counts) for i in range(count)]
        logits = self.model.compute_logits(hidden.index_select(0, device_longs(rows, self.device)))
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        known = [len(self.requests[r].token_ids) for r in req_ids]
        gained: list[list[tuple[int, TokenLogprobs | None]]] = [[] for _ in req_ids]
        eos = self.config.eos_token_ids
        # Plain greedy rows take their argmax at every depth: one pass over all rows serves them.
        argmaxes = (self.platform.argmax_rows(logits.float()).tolist() if self.share_tokens is None and all(
            self.sampler.plain_greedy(self.requests[r].sampling) for r in req_ids) else None)
        active, depth = list(range(len(req_ids))), 0
        while active:
            states = [self.requests[req_ids[i]].sampling for i in active]
            if argmaxes is not None:
                tokens, logprobs = [argmaxes[firsts[i] + depth] for i in active], []
            else:
                picked = logits.index_select(0, device_longs([firsts[i] + depth for i in active], self.device))
                tokens, logprobs = self.sampler.sample(picked, states)
                if self.share_tokens is not None:
                    tokens = self.share_tokens(tokens)
            self.sampler.record(states, tokens)
            going = []
            for j, (i, token) in enumerate(zip(active, tokens)):
                mirror = self.requests[req_ids[i]]
                mirror.token_ids.append(token)
                gained[i].append((token, logprobs[j] if logprobs else None))
                proposal = drafts.get(req_ids[i], ())
                # A stop token ends the run: what follows it belongs to no answer.
                stops = token in eos or token in mirror.sampling.params.stop_token_ids
                if depth < len(proposal) and token == proposal[depth] and not stops:
                    going.append(i)
            active, depth = going, depth + 1
        for i, req_id in enumerate(req_ids):
            proposal = drafts.get(req_id)
            if proposal:
                outcomes.append(DraftOutcome(req_id, len(proposal), len(gained[i]) - 1))
                self.proposer.accepted(req_id, known[i], len(proposal), len(gained[i]) - 1)
        out_ids = [req_id for req_id, run in zip(req_ids, gained) for _ in run]
        out_tokens = [token for run in gained for token, _ in run]
        out_logprobs = [lp for run in gained for _, lp in run]
        return out_ids, out_tokens, out_logprobs if any(lp is not None for lp in out_logprobs) else []

    def forward(self, decodes: list[SeqSpan], prefills: list[SeqSpan], input_ids: list[int], positions: list[int],
                lora: LoraBatch | None = None, media: list[MediaSpan] | None = None,
                needed_rows: list[int] | None = None, states: StateBatch | None = None) -> torch.Tensor:
        """Eager forward of one step's tokens (decode-first layout); returns hidden states [T, hidden].
        `media`: a media model's requests of the step (every one of them); `needed_rows`: the only rows
        read afterwards (ForwardContext.needed_rows; the others may hold anything); `states`: where a
        hybrid model's sequences keep their recurrent state (None: each starts empty and keeps nothing,
        as profiling steps do)."""
        meta = build_metadata(decodes, prefills, self.block_size, self.device, self.dtype, self.attention_backend,
                              self.prompt_dtype, self.prompt_kernel)
        group_meta = [build_metadata(group_spans(decodes, group), group_spans(prefills, group), self.block_size,
                                     self.device, self.dtype, self.attention_backend, self.prompt_dtype,
                                     self.prompt_kernel)
                      for group in range(1, len(self.kv_groups.windows))]
        ids_and_positions = device_longs(input_ids + positions, self.device)
        ids, pos = ids_and_positions[: len(input_ids)], ids_and_positions[len(input_ids) :]
        step = self.model.prepare_media(media, pos) if media else None
        if step is not None and step.bidirectional:
            both_ways = _by_prefill(decodes, prefills, step.bidirectional)
            for metadata in (meta, *group_meta):
                metadata.bidirectional = both_ways
        if step is not None and step.rope_positions is not None:
            cos, sin = mrope_cos_sin(self.cos, self.sin, step.rope_positions, self.mrope_columns)
        else:
            cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        ctx = ForwardContext(meta, cos, sin, lora, decodes + prefills, pos, media,
                             step.embeds if step is not None else None, step.deepstack if step is not None else None,
                             self.sliding_rope_rows(pos), group_meta, needed_rows, states)
        with forward_context(ctx):
            return self.model(ids)  # [T, hidden]

    def sliding_rope_rows(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.sliding_rope is None:
            return None
        cos, sin = self.sliding_rope
        return cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)

    def _whisper_rules(self, logits: torch.Tensor, req_ids: list[int]) -> torch.Tensor:
        """Whisper windows' rows of `logits` after their timestamp and suppression rules (float32, as
        transformers applies them)."""
        logits = logits.float()
        for row, req_id in enumerate(req_ids):
            mirror = self.requests[req_id]
            rules = mirror.sampling.params.whisper
            if rules is not None:
                logits[row] = apply_whisper_rules(logits[row], mirror.token_ids[mirror.num_prompt_tokens:], rules)
        return logits

    def _add_to_pool(self, req_id: int, hidden: torch.Tensor) -> None:
        mirror = self.requests[req_id]
        rows = self.model.model.norm(hidden).float().sum(dim=0)
        mirror.pool_sum = rows if mirror.pool_sum is None else mirror.pool_sum + rows
        mirror.num_pooled += hidden.shape[0]

    def _pool(self, req_id: int, last_hidden: torch.Tensor) -> PooledOutput:
        """The embedding of a request whose prompt is complete: the final hidden state (after the
        model's last norm) of its last token, the mean over all its tokens, or its first token's (CLS:
        the sum of one)."""
        mirror = self.requests[req_id]
        if mirror.sampling.params.pools_prompt:
            vector = mirror.pool_sum / mirror.num_pooled
        else:
            vector = self.model.model.norm(last_hidden[None]).float()[0]
        return PooledOutput(req_id, vector.cpu().numpy().tobytes())

    def _inject_fault(self, req_ids: list[int]) -> None:
        """Test hook (CRANE_MP_FAULT_TOKEN): a request whose prompt holds that token id raises here."""
        for req_id in req_ids:
            mirror = self.requests[req_id]
            if self.fault_token in mirror.token_ids[: mirror.num_prompt_tokens]:
                raise RuntimeError(f"fault injected for a prompt holding token {self.fault_token}")

    def _score_prompt(self, req_id: int, hidden: torch.Tensor) -> PromptLogprobs:
        """Logprobs of the prompt tokens that follow `hidden`'s rows (raw model distribution)."""
        mirror = self.requests[req_id]
        top_n = mirror.sampling.params.prompt_logprobs
        start = mirror.num_prompt_scored
        count = hidden.shape[0]
        targets = device_longs(mirror.token_ids[start : start + count], self.device)
        chosen, top_ids, top_values = [], [], []
        step = self._score_rows()
        for lo in range(0, count, step):
            scores, ids = self._score_chunk(hidden[lo : lo + step], targets[lo : lo + step], top_n)
            for row_scores, row_ids in zip(scores.tolist(), ids.tolist()):
                chosen.append(row_scores[0])
                top_values.append(row_scores[1:])
                top_ids.append(row_ids)
        mirror.num_prompt_scored = start + count
        return PromptLogprobs(req_id, start, chosen, top_ids, top_values)

    def _score_rows(self) -> int:
        """Prompt tokens scored per pass: [rows, vocabulary] logits, their float32 copy and log-softmax
        (10 bytes per logit) under _SCORE_BYTES: 77 rows at a 152k vocabulary."""
        return max(16, min(256, _SCORE_BYTES // (10 * self.config.vocab_size)))

    def _score_chunk(self, hidden: torch.Tensor, targets: torch.Tensor, top_n: int) -> tuple[torch.Tensor, ...]:
        """[rows, 1 + top_n] float32 logprobs (each row's target first, then its top_n), [rows, top_n] ids."""
        logprobs = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)
        values, ids = logprobs.topk(top_n, dim=-1)
        return torch.cat([logprobs.gather(1, targets[:, None]), values], dim=1), ids

    @contextmanager
    def _scratch_kv_cache(self, num_blocks: int) -> Iterator[None]:
        """A throw-away KV cache of `num_blocks` for a profiling step; the real one is put back after.
        Its bytes (scratch_kv_bytes) are not activations: the profiles return them to be left out."""
        saved = [(a.k_cache, a.v_cache) for a in self.model.attention_layers()]
        saved_blocks = self.num_blocks
        self.allocate_kv_cache(num_blocks)
        try:
            yield
        finally:
            for attn, (k, v) in zip(self.model.attention_layers(), saved):
                attn.k_cache, attn.v_cache = k, v
            self.num_blocks = saved_blocks

    def _profile_media(self, spans: list[tuple[int, int]]) -> list[MediaSpan] | None:
        """A profiling step's media: what the model's largest request reads (a window to cross-attend)."""
        make = getattr(self.model, "profile_media_state", None)
        state = make() if make is not None else None
        if state is None:
            return None
        rows = [0]
        for start, end in spans:
            rows.append(rows[-1] + end - start)
        return [MediaSpan(state, start, end, row, list(range(-(-end // self.block_size))))
                for (start, end), row in zip(spans, rows)]

    def scratch_kv_bytes(self, num_blocks: int) -> int:
        return (num_blocks + 1) * self.block_size * self.kv_bytes_per_token()

    @torch.inference_mode()
    def profile_decode(self, num_seqs: int) -> int:
        """An eager decode step of `num_seqs` one-key sequences: what a captured decode graph allocates
        in its pool. Returns the scratch KV cache's bytes."""
        with self._scratch_kv_cache(num_seqs):
            self.forward([SeqSpan(0, 1, [seq]) for seq in range(num_seqs)], [], [0] * num_seqs, [0] * num_seqs,
                         media=self._profile_media([(0, 1)] * num_seqs))
        return self.scratch_kv_bytes(num_seqs)

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, num_seqs: int, image_grid: tuple[int, int, int] | None = None) -> int:
        """The largest step, to measure peak memory: the vision tower over the largest image (with
        `image_grid`), a forward over `num_tokens` fresh prompt tokens (a scratch KV cache), then
        sampling `num_seqs` rows with every sampling processor on. Returns the scratch KV cache's bytes."""
        if image_grid is not None:
            self.model.profile_image(image_grid)
        num_blocks = -(-num_tokens // self.block_size)
        top = min(20, self.sampler.vocab_size)  # an encoder's stub head has one "token"
        worst = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                frequency_penalty=0.1, presence_penalty=0.1, logprobs=top, logit_bias={0: 1.0},
                                seed=row if row % 2 else None) for row in range(num_seqs)]
        # Sampling inside: the scratch cache stays live through every peak, so leaving it out is exact.
        with self._scratch_kv_cache(num_blocks):
            # Penalty rows first: when serving, the sampler's table is live through every forward.
            states = [self.sampler.new_state(p, [0], self.config.eos_token_ids) for p in worst]
            span = SeqSpan(0, num_tokens, list(range(num_blocks)))
            hidden = self.forward([], [span], [0] * num_tokens, list(range(num_tokens)),
                                  media=self._profile_media([(0, num_tokens)]))
            logits = self.model.compute_logits(hidden[:num_seqs])
            self.sampler.profile(logits, states)
            for state in states:
                self.sampler.release(state)
            del logits
            rows = min(num_tokens, self._score_rows())  # prompt logprobs: one pass of scoring
            self._score_chunk(hidden[:rows], torch.zeros(rows, dtype=torch.long, device=self.device), top)
        return self.scratch_kv_bytes(num_blocks)


# Bytes of one prompt-scoring pass's [rows, vocabulary] buffers: bounded whatever the prompt's length.
_SCORE_BYTES = 112 << 20
# The token an embedding request "samples": it only ends the request (its max_tokens is 1).
_PLACEHOLDER_TOKEN = 0
# Longest context whose proposals are verified as decode rows: each row reads the sequence's keys again,
# which past this costs more than the exactness at near ties is worth (one span reads them once).
_PROPOSAL_DECODE_CONTEXT = 2048


def _advances_before_sampling(params) -> bool:
    return params.prompt_logprobs is not None or params.pools_prompt


def _by_prefill(decodes: list[SeqSpan], prefills: list[SeqSpan],
                spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """MediaStep.bidirectional's (step row of a request's first token, first, end) as (prefill index,
    first, end); a span of a one-row request (nothing to see both ways) is left out."""
    index, row = {}, len(decodes)
    for p, span in enumerate(prefills):
        index[row] = p
        row += span.q_len
    return [(index[row], first, end) for row, first, end in spans if row in index]
