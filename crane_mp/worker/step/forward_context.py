"""The per-step forward context: attention metadata and rope rows, set by the runner around one forward pass.

Model code keeps `forward(input_ids, positions)`; attention layers read the context instead of threading
metadata through every call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from crane_mp.worker.cache.attention import AttentionMetadata, SeqSpan
from crane_mp.worker.step.host_buffers import device_longs


@dataclass(slots=True)
class LoraBatch:
    """Which token rows of this step use which LoRA adapter (worker/weights/lora.py): (adapter id, row indices,
    or None when every row uses it)."""

    groups: list[tuple[int, torch.Tensor | None]]

    def apply(self, x: torch.Tensor, out: torch.Tensor, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        """Add each adapter's low-rank update to its rows of `out` (a projection's fresh output, updated
        in place and returned); `weights`: adapter id -> (A^T, B^T) of that projection, scaling folded
        in, in the dtype the update is computed in (float32 on CPU: small bf16 GEMMs are slow there)."""
        for lora_id, rows in self.groups:
            pair = weights.get(lora_id)
            if pair is None:
                continue
            a_t, b_t = pair
            if rows is None:
                out.add_((x.to(a_t.dtype) @ a_t) @ b_t)
            else:
                update = (x.index_select(0, rows).to(a_t.dtype) @ a_t) @ b_t
                out.index_add_(0, rows, update.to(out.dtype))
        return out


def lora_batch(row_ids: list[int], device: torch.device) -> LoraBatch | None:
    """The LoraBatch of a step whose token row i uses adapter row_ids[i] (0: the base model)."""
    used = set(row_ids) - {0}
    if not used:
        return None
    if len(used) == 1 and 0 not in row_ids:
        return LoraBatch([(used.pop(), None)])
    groups = []
    for lora_id in sorted(used):
        rows = [i for i, r in enumerate(row_ids) if r == lora_id]
        groups.append((lora_id, device_longs(rows, device)))
    return LoraBatch(groups)


@dataclass(slots=True)
class MediaSpan:
    """One request's rows of a step, for a model that reads media: `state` is what the model made of the
    request's media (media_state), positions [start, end) run on rows [row, row + end - start), its KV
    in `blocks` (the block table)."""

    state: Any
    start: int
    end: int
    row: int
    blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class MediaStep:
    """What a media model's prepare_media made of a step: rows whose input embedding is replaced (an
    image's placeholders: row indices and embeddings), multimodal rope positions [3, num_tokens], what
    the same rows add to the outputs of the first decoder layers (Qwen3-VL's deepstack), and the
    images whose placeholders attend to each other both ways (Gemma 3): (the step row of their
    request's first token, first position, end position)."""

    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    rope_positions: torch.Tensor | None = None
    deepstack: list[torch.Tensor] | None = None
    bidirectional: list[tuple[int, int, int]] | None = None


@dataclass(slots=True)
class StateBatch:
    """Where a hybrid model's linear-attention layers keep each sequence's state this step: `slots[i]` is
    the state pool slot of the step's i-th sequence (the order of ForwardContext.spans, decodes first);
    the first `num_decodes` are one row each (their slots also as `decode_slots`), several of one
    sequence where it verifies proposals."""

    slots: list[int]
    num_decodes: int
    decode_slots: torch.Tensor | None
    # Speculative verification: a sequence's decode row and the proposals after it are decode rows of the
    # same slot. waves[w]: the decode rows that are their sequence's w-th; None when each has one.
    waves: list[torch.Tensor] | None = None


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor  # [num_tokens, 1, head_dim]
    lora: LoraBatch | None = None
    spans: list[SeqSpan] | None = None  # the step's sequences in token order (decodes first), for encoders
    positions: torch.Tensor | None = None  # [num_tokens], each row's position in its sequence
    media: list[MediaSpan] | None = None  # a media model's requests of the step, in row order
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # MediaStep.embeds
    deepstack: list[torch.Tensor] | None = None  # MediaStep.deepstack, for embeds' rows
    sliding_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) rows of the sliding layers' rope
    group_attn: list[AttentionMetadata] = field(default_factory=list)  # KV groups 1, 2, ...' metadata
    # The rows whose hidden states the step reads (the sampled ones), None: every row (prompt logprobs,
    # pooling, media). Layers that write no KV cache may then compute only these (Gemma 4's shared ones).
    needed_rows: list[int] | None = None
    states: StateBatch | None = None  # the state pool's slots of the step's sequences (hybrid models)
    # How a hybrid's linear-attention layers group the step's prompts (gated_deltanet.prefill_groups),
    # worked out by the first of them.
    prefill_groups: Any = None

    def attn_of(self, layer) -> AttentionMetadata:
        """The attention metadata of `layer`'s KV group (its block tables and slots)."""
        group = getattr(layer, "kv_group", 0)
        return self.group_attn[group - 1] if group else self.attn


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _current
    outer, _current = _current, ctx
    try:
        yield
    finally:
        _current = outer


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("model forward called outside forward_context()")
    return _current
