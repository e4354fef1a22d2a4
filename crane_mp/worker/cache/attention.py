"""Paged attention, portable torch backend (CPU and CUDA): metadata built once per step, used by every layer.

A step's tokens are laid out decode-first:

    token index  0 ........ D-1 | D ............................ T-1
                 one token per   | prefill chunks, one sequence after another
                 decode sequence |   seq p: tokens [q_start_p, q_start_p + q_len_p)

Each sequence's keys live in KV blocks; key position j of a sequence sits in
slot block_table[j // block_size] * block_size + j % block_size. A prefill chunk of
q_len tokens after ctx_before cached tokens attends to keys [0, ctx_before + i] for its
query i.

Three backends read the same metadata layout:
- "triton" (CUDA): kernels read block tables, context lengths and chunk offsets directly
  (kernels/triton_attention.py); no gathered copy of the cache, no mask.
- "native" (CPU): the C++ decode kernel reads block tables and context lengths; prefill chunks as "torch".
- "torch": decodes in one SDPA call over a gathered, masked copy of their keys, prefill chunks in a
  second one padded to the longest chunk.
Every integer of a step's metadata goes to the device in one copy (host_buffers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from crane_mp.worker.platforms.device import num_sms
from crane_mp.worker.step.host_buffers import device_longs


@dataclass(slots=True)
class SeqSpan:
    """One scheduled sequence in a step: `q_len` new tokens after `ctx_before` cached ones. `group_tables`:
    the block tables of KV groups 1, 2, ... (models/kv_groups.py); none: every group reads `block_table`."""

    ctx_before: int
    q_len: int
    block_table: list[int]
    group_tables: list[list[int]] = field(default_factory=list)


def group_spans(spans: list[SeqSpan], group: int) -> list[SeqSpan]:
    """`spans` as KV group `group` (1, 2, ...) sees them: its own block tables."""
    return [SeqSpan(s.ctx_before, s.q_len, s.group_tables[group - 1] if s.group_tables else s.block_table)
            for s in spans]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot each new token's K/V is written to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_ctx_lens: torch.Tensor | None  # [num_decodes] int64 keys per decode
    prefill_token_index: torch.Tensor | None  # [num_prefills * max_q] index into the prefill tokens
    prefill_valid_index: torch.Tensor | None  # [num_prefills * max_q] rows of the padded output to keep
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks]
    num_prefills: int
    max_prefill_q: int
    prefill_is_fresh_single: bool  # one prefill with no cached context: plain causal attention
    backend: str = "torch"
    prefill_q_start: torch.Tensor | None = None  # [num_prefills] first row of each chunk in q (Triton only)
    prefill_q_len: torch.Tensor | None = None  # [num_prefills] (Triton only)
    prefill_ctx_before: torch.Tensor | None = None  # [num_prefills]
    prefill_ctx_lens: torch.Tensor | None = None  # [num_prefills] keys of each chunk's last query
    dtype: torch.dtype = torch.float32  # the additive masks'
    # What prompts' plain attention over _LOW_PRECISION_KEYS keys or more runs in when not the queries'
    # dtype (Platform.prompt_attention_dtype); None: the queries'.
    prompt_dtype: torch.dtype | None = None
    # Such prompts' bf16 attention runs in our AVX512-BF16 kernel (Platform.prompt_attention_kernel).
    prompt_kernel: bool = False
    block_width: int = 1  # tokens per KV block (the tables' unit)
    # Additive masks by (kind, sliding window), built on first use in a step: every layer of one
    # attention kind shares its mask, and a model with two kinds (sliding and global layers) builds two.
    masks: dict = field(default_factory=dict)
    # (prefill index, first position, end position) of the images whose placeholders attend to each other
    # both ways (Gemma 3): the torch path's masks and the Triton prefill kernel's key limits let them.
    bidirectional: list[tuple[int, int, int]] | None = None

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_keys] additive mask of the decodes' keys (torch path)."""
        key = ("decode", window)
        if key not in self.masks:
            ctx_len = self.decode_ctx_lens
            width = self.decode_block_tables.shape[1] * self.block_width
            self.masks[key] = _key_mask((ctx_len - 1)[:, None], ctx_len, width, window, self.dtype)
        return self.masks[key]

    def prefill_mask(self, window: int | None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[num_prefills, 1, max_q, max_keys] additive mask of the padded prefill chunks (torch path), in
        `dtype` (default: the metadata's)."""
        dtype = dtype or self.dtype
        key = ("prefill", window, dtype)
        if key not in self.masks:
            device = self.prefill_ctx_before.device
            q_pos = self.prefill_ctx_before[:, None] + torch.arange(self.max_prefill_q, device=device)[None, :]
            width = self.prefill_block_tables.shape[1] * self.block_width
            self.masks[key] = _key_mask(q_pos, self.prefill_ctx_lens, width, window, dtype, self.bidirectional)
        return self.masks[key]


def _padded_tables(spans: list[SeqSpan], num_blocks_needed: list[int]) -> np.ndarray:
    """Block tables of `spans`, each cut to the blocks it needs and padded to the longest. Written row by
    row into numpy: built from nested lists, a step of 255 decodes at 2k tokens took 3x longer to stage
    (benchmarks/step_metadata.py)."""
    tables = np.zeros((len(spans), max(num_blocks_needed)), dtype=np.int64)
    for row, span, n in zip(tables, spans, num_blocks_needed):
        row[:n] = span.block_table[:n]
    return tables


def _slots(span: SeqSpan, block_size: int) -> np.ndarray:
    """Flat KV slots of a span's new tokens."""
    first = span.ctx_before // block_size
    last = -(-(span.ctx_before + span.q_len) // block_size)
    positions = np.arange(span.ctx_before, span.ctx_before + span.q_len)
    blocks = np.asarray(span.block_table[first:last], dtype=np.int64)
    return blocks[positions // block_size - first] * block_size + positions % block_size


class _Packer:
    """Collects a step's integer arrays and hands out device views of one copied buffer."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def add(self, values: list[int] | np.ndarray) -> int:
        self.arrays.append(np.asarray(values, dtype=np.int64))
        return len(self.arrays) - 1

    def unpack(self, device: torch.device) -> list[torch.Tensor]:
        flat = device_longs(np.concatenate([a.reshape(-1) for a in self.arrays]), device)
        ends = np.cumsum([a.size for a in self.arrays]).tolist()
        return [flat[end - a.size : end].view(a.shape) for a, end in zip(self.arrays, ends)]


def _key_mask(
    q_pos: torch.Tensor, ctx_len: torch.Tensor, num_keys: int, sliding_window: int | None, dtype: torch.dtype,
    both_ways: list[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """q_pos: [B, Q] absolute query positions; ctx_len: [B]. Returns an additive mask [B, 1, Q, num_keys].
    `both_ways`: (batch row, first, end) position spans whose queries also see the span's later keys.

    Additive (0 / -inf) in the model dtype, built once per step: a boolean mask would be converted by
    every layer's attention call.
    """
    keys = torch.arange(num_keys, device=q_pos.device)
    allowed = keys[None, None, :] <= q_pos[:, :, None]
    for row, first, end in both_ways or ():
        inside = (q_pos[row] >= first) & (q_pos[row] < end)
        allowed[row] |= inside[:, None] & ((keys >= first) & (keys < end))[None, :]
    allowed &= keys[None, None, :] < ctx_len[:, None, None]
    if sliding_window is not None:
        allowed &= keys[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill_(~allowed, float("-inf"))
    return mask[:, None]


def build_metadata(
    decodes: list[SeqSpan],
    prefills: list[SeqSpan],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: str = "torch",
    prompt_dtype: torch.dtype | None = None,
    prompt_kernel: bool = False,
) -> AttentionMetadata:
    """Called by the runner once per step; `decodes` each have q_len == 1 and come first."""
    pack = _Packer()
    slots = [span.block_table[span.ctx_before // block_size] * block_size + span.ctx_before % block_size
             for span in decodes]
    parts = {"slots": pack.add(np.concatenate([np.asarray(slots, dtype=np.int64)]
                                              + [_slots(span, block_size) for span in prefills]))}

    if decodes:
        ctx = [s.ctx_before + 1 for s in decodes]
        parts["decode_tables"] = pack.add(_padded_tables(decodes, [-(-c // block_size) for c in ctx]))
        parts["decode_ctx"] = pack.add(ctx)

    max_q = max((s.q_len for s in prefills), default=0)
    fresh_single = len(prefills) == 1 and prefills[0].ctx_before == 0
    triton_prefill = backend == "triton" and bool(prefills)
    if prefills and (triton_prefill or not fresh_single):
        ctx = [s.ctx_before + s.q_len for s in prefills]
        parts["prefill_tables"] = pack.add(_padded_tables(prefills, [-(-c // block_size) for c in ctx]))
        parts["prefill_ctx_before"] = pack.add([s.ctx_before for s in prefills])
        parts["prefill_ctx"] = pack.add(ctx)
        if triton_prefill:
            starts = [len(decodes) + sum(s.q_len for s in prefills[:p]) for p in range(len(prefills))]
            parts["prefill_q_start"] = pack.add(starts)
            parts["prefill_q_len"] = pack.add([s.q_len for s in prefills])
        else:
            index, valid, start = [], [], 0
            for p, span in enumerate(prefills):
                index += list(range(start, start + span.q_len)) + [start] * (max_q - span.q_len)
                valid += range(p * max_q, p * max_q + span.q_len)
                start += span.q_len
            parts["prefill_index"] = pack.add(index)
            parts["prefill_valid"] = pack.add(valid)
    tensors = pack.unpack(device)
    get = {name: tensors[i] for name, i in parts.items()}.get

    return AttentionMetadata(
        slot_mapping=get("slots"),
        num_decode_tokens=len(decodes),
        decode_block_tables=get("decode_tables"),
        decode_ctx_lens=get("decode_ctx"),
        prefill_token_index=get("prefill_index"),
        prefill_valid_index=get("prefill_valid"),
        prefill_block_tables=get("prefill_tables"),
        num_prefills=len(prefills),
        max_prefill_q=max_q,
        prefill_is_fresh_single=fresh_single and not triton_prefill,
        backend=backend,
        prefill_q_start=get("prefill_q_start"),
        prefill_q_len=get("prefill_q_len"),
        prefill_ctx_before=get("prefill_ctx_before"),
        prefill_ctx_lens=get("prefill_ctx"),
        dtype=dtype,
        prompt_dtype=prompt_dtype,
        prompt_kernel=prompt_kernel,
        block_width=block_size,
    )


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, head_dim] -> [B, kv_heads, num_keys, head_dim]."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    batch, width = tables.shape
    rows = cache.view(num_blocks, -1).index_select(0, tables.view(-1))
    return rows.view(batch, width * block_size, kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KH, D], written into the cache here, or None when the caller already
    wrote them (the fused CPU kernel). Returns [T, H * D]. `window`: this layer's sliding window (a
    query sees the keys less than `window` positions back); `softcap`: its attention logits go
    through softcap * tanh(logits / softcap) (Gemma 2), in the Triton kernels or the torch math path;
    `sinks` [H]: a logit per head that joins the softmax with no value (gpt-oss), in the native decode
    kernel or the torch math path (the Triton kernels do not take them: the runner picks "torch")."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k is not None:
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if meta.backend == "triton":
        if sinks is not None:
            raise NotImplementedError("attention sinks need the torch attention backend on CUDA")
        return _triton_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    outputs = []

    num_decodes = meta.num_decode_tokens
    if num_decodes and meta.backend == "native" and softcap is None:
        out = torch.ops.crane_mp.paged_decode_attention(
            q[:num_decodes].contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens,
            scale, window or 0, None if sinks is None else sinks.float(),
        )  # [num_decodes, H, D]
        outputs.append(out.view(num_decodes, num_heads * head_dim))
    elif num_decodes:
        # Each KV head serves its group of query heads as a small batch of queries: no K/V repeat.
        qd = q[:num_decodes].view(num_decodes, kv_heads, num_heads // kv_heads, head_dim)
        kd = _gather(k_cache, meta.decode_block_tables).to(q.dtype)
        vd = _gather(v_cache, meta.decode_block_tables).to(q.dtype)
        decode_sinks = None if sinks is None else sinks.view(1, kv_heads, num_heads // kv_heads, 1)
        out = _attend(qd, kd, vd, meta.decode_mask(window), scale, softcap, decode_sinks)
        outputs.append(out.reshape(num_decodes, num_heads * head_dim))

    if meta.num_prefills:
        qp = q[num_decodes:]
        prefill_sinks = None if sinks is None else sinks.view(1, num_heads, 1, 1)
        if meta.prefill_is_fresh_single:
            if k is None:  # already in the cache: read this prefill's rows back
                slots = meta.slot_mapping[num_decodes:]
                kp = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
                vp = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
            else:
                kp, vp = k[num_decodes:], v[num_decodes:]
            # 4-D inputs: with 3-D ones SDPA falls back to its math backend (5-10x slower on CPU).
            qp, kp, vp = qp.transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None]
            if (window is None or window >= qp.shape[2]) and softcap is None and sinks is None \
                    and not meta.bidirectional:
                out = _prompt_attention(qp, kp, vp, scale, meta, None)
            else:
                mask = _fresh_mask(meta, qp.shape[2], window)
                out = _attend(qp, kp.to(q.dtype), vp.to(q.dtype), mask, scale, softcap, prefill_sinks)
            outputs.append(out[0].transpose(0, 1).reshape(-1, num_heads * head_dim))  # out: [1, H, T, D]
        else:
            batch, max_q = meta.num_prefills, meta.max_prefill_q
            qs = qp.index_select(0, meta.prefill_token_index).view(batch, max_q, num_heads, head_dim)
            # Gathered in the cache's dtype (half the bytes of a float copy when it is 16-bit), then widened
            # where attention runs in the queries' dtype.
            kp = _gather(k_cache, meta.prefill_block_tables)
            vp = _gather(v_cache, meta.prefill_block_tables)
            if softcap is None and sinks is None:
                out = _prompt_attention(qs.transpose(1, 2), kp, vp, scale, meta, window)  # [B, H, max_q, D]
            else:
                out = _attend(qs.transpose(1, 2), kp.to(q.dtype), vp.to(q.dtype), meta.prefill_mask(window), scale,
                              softcap, prefill_sinks)
            out = out.transpose(1, 2).reshape(batch * max_q, num_heads * head_dim)
            outputs.append(out.index_select(0, meta.prefill_valid_index))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


# Keys from which prompts' plain attention runs in the metadata's prompt_dtype: below, attention is a small
# share of a step's time, and short prompts keep the compute precision.
_LOW_PRECISION_KEYS = 512


def _prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, meta: AttentionMetadata,
                      window: int | None) -> torch.Tensor:
    """Attention of prompt queries q [B, H, Q, D] over k, v [B, KH, K, D] of any dtype: causal (a lone fresh
    prompt: `window` None) or under the padded chunks' mask for `window`; in meta.prompt_dtype from
    _LOW_PRECISION_KEYS keys on (in our kernel for one prompt with no window, where meta.prompt_kernel).
    Returns q's dtype."""
    dtype = q.dtype
    if meta.prompt_dtype is not None and k.shape[2] >= _LOW_PRECISION_KEYS:
        dtype = meta.prompt_dtype
    causal = meta.prefill_is_fresh_single
    if (dtype == torch.bfloat16 and meta.prompt_kernel and q.shape[0] == 1 and window is None
            and not meta.bidirectional and q.shape[-1] % 64 == 0):
        # One prompt (or a chunk of one over its cached keys), causal: the kernel takes its keys as they are.
        keys = q.shape[2] if causal else int(meta.prefill_ctx_lens[0])
        out = torch.ops.crane_mp.prompt_attention_bf16(q[0].transpose(0, 1), k[0, :, :keys].transpose(0, 1),
                                                       v[0, :, :keys].transpose(0, 1), scale, keys - q.shape[2])
        return out.transpose(0, 1)[None]
    mask = None if causal else meta.prefill_mask(window, dtype)
    out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, is_causal=causal,
                                         scale=scale, enable_gqa=True)
    return out.to(q.dtype)


def _fresh_mask(meta: AttentionMetadata, length: int, window: int | None) -> torch.Tensor:
    """The additive causal (and windowed) mask of a lone fresh prefill of `length` tokens."""
    key = ("fresh", window)
    if key not in meta.masks:
        positions = torch.arange(length, device=meta.slot_mapping.device)
        meta.masks[key] = _key_mask(positions[None], positions[-1:] + 1, length, window, meta.dtype,
                                    meta.bidirectional)
    return meta.masks[key]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, H, Q, D] over k, v [B, KH, K, D] (H a multiple of KH) under an additive mask.
    With `softcap`, the logits are capped as transformers' eager attention does (scaled, capped, masked,
    softmax), all in float32: tanh flattens 16-bit logits into ties. `sinks` (broadcast to [B, H, Q, 1]):
    one more logit per query, softmaxed with the keys' and dropped before the values."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q, k.transpose(2, 3)).float() * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + mask
    if sinks is not None:
        logits = torch.cat([logits, sinks.float().expand(*logits.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    from crane_mp.worker.kernels import triton_attention as kernels

    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    window = window or 0
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        splits = kernels.decode_splits(num_decodes, k_cache.shape[2], num_sms(q.device))
        workspace = kernels.decode_workspace(num_decodes, num_heads, head_dim, splits, q.device)
        kernels.paged_decode(q[:num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens,
                             out[:num_decodes], scale, window, splits, workspace, softcap=softcap or 0.0)
    if meta.num_prefills:
        kernels.paged_prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_q_start,
                              meta.prefill_q_len, meta.prefill_ctx_before, meta.max_prefill_q, out, scale, window,
                              softcap or 0.0, _key_limits(meta, num_tokens) if meta.bidirectional else None)
    return out.view(num_tokens, num_heads * head_dim)


def _key_limits(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """Per query row of the step, the position its keys end before: its own position + 1, or the end of
    the image it lies in where the image is attended both ways (which a step never splits). Built once
    per step; such a step is never replayed from a graph, so reading the spans on the host is free."""
    if "limits" not in meta.masks:
        starts, lens, before = (t.tolist() for t in (meta.prefill_q_start, meta.prefill_q_len,
                                                     meta.prefill_ctx_before))
        limits = torch.zeros(num_tokens, dtype=torch.int32)
        for start, length, ctx in zip(starts, lens, before):
            limits[start : start + length] = torch.arange(ctx + 1, ctx + length + 1, dtype=torch.int32)
        for prefill, first, end in meta.bidirectional:
            start, ctx, length = starts[prefill], before[prefill], lens[prefill]
            first, end = max(first, ctx), min(end, ctx + length)
            limits[start + first - ctx : start + end - ctx] = end
        meta.masks["limits"] = limits.to(meta.prefill_q_len.device)
    return meta.masks["limits"]
