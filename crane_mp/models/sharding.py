"""Which part of the model one tensor-parallel rank holds (Megatron's split, as vLLM and SGLang make it).

Attention heads and the MLP's intermediate units are split evenly: q/k/v and gate/up are column-
parallel (each rank holds the output rows of its heads or units), o and down row-parallel (the input
columns of the same heads or units; the partial outputs are summed across ranks). KV heads split too,
or, where there are fewer KV heads than ranks, each rank holds the one its query heads read. The
vocabulary splits into equal row ranges of the embedding and the LM head, the last padded with zero
rows, so that every rank's logits are equally wide. Norms are whole on every rank.

Torch-free: index ranges over Hugging Face tensor names; the loaders (layers.py, the GGUF loader, LoRA)
cut the tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from crane_mp.models.registry import ARCHITECTURES

# Logit rows per rank round up to this, so that a quantized LM head's rows repack in whole groups.
_VOCAB_ROW_MULTIPLE = 16

# The split of each Hugging Face projection: which range of which axis a rank keeps.
_COLUMN_PARALLEL = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "gate_proj": "units",
                    "up_proj": "units"}
_ROW_PARALLEL = {"o_proj": "heads", "down_proj": "units"}
_VOCABULARY = ("model.embed_tokens", "lm_head")


@dataclass(frozen=True, slots=True)
class Split:
    """How a rank cuts one checkpoint tensor: `axis` 0 (output rows) or 1 (input columns) to
    [start, stop), then zero rows appended up to `rows` (vocabulary); `zero`: a row-parallel bias,
    which only rank 0 adds (every other rank holds zeros), since the outputs are summed."""

    axis: int
    start: int
    stop: int
    rows: int = 0
    zero: bool = False


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`: the ranges of the whole model's heads, KV heads, intermediate units and
    vocabulary it holds."""

    rank: int
    size: int
    head_dim: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    units: tuple[int, int]
    vocab: tuple[int, int]  # the vocabulary rows it holds, [start, stop)
    vocab_rows: int  # ... padded to this many (every rank's), the width of its logits
    totals: tuple[int, int, int]  # the whole model's heads, KV heads and units

    def _range(self, kind: str) -> tuple[int, int]:
        """[start, stop) of this rank's rows (elements) along an axis of heads, KV heads or units."""
        if kind == "heads":
            return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim
        if kind == "kv_heads":
            return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim
        return self.units

    def whole(self, module: str) -> int:
        """The length of the axis a projection (q_proj, ..., down_proj) is split along, in the whole model."""
        kind = _COLUMN_PARALLEL.get(module) or _ROW_PARALLEL[module]
        heads, kv_heads, units = self.totals
        return {"heads": heads * self.head_dim, "kv_heads": kv_heads * self.head_dim, "units": units}[kind]

    def split(self, name: str) -> Split | None:
        """How to cut the checkpoint tensor `name` (Hugging Face's naming); None: every rank holds it whole."""
        stem, _, kind = name.rpartition(".")
        if stem in _VOCABULARY:
            return Split(0, *self.vocab, rows=self.vocab_rows)
        module = stem.rpartition(".")[2]
        if module in _COLUMN_PARALLEL:
            return Split(0, *self._range(_COLUMN_PARALLEL[module]))
        if module in _ROW_PARALLEL:
            if kind == "bias":
                return None if self.rank == 0 else Split(0, 0, 0, zero=True)
            return Split(1, *self._range(_ROW_PARALLEL[module]))
        return None


def _even(total: int, size: int, what: str) -> None:
    if total % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's {total} {what}")


def make_shard(config, rank: int, size: int) -> Shard:
    """Rank `rank`'s share of a model of `config` (a ModelConfig) split `size` ways; ValueError naming
    what does not divide."""
    if config.encoder:
        raise ValueError("tensor parallelism serves decoder models; an encoder (--task embed or score of a "
                         "BERT-family model) runs on one rank")
    if config.media:
        raise ValueError(f"tensor parallelism serves text models; {config.arch} (its {config.media} encoder is not "
                         "split) runs on one rank")
    if config.layout.experts is not None:
        raise ValueError(f"tensor parallelism does not shard {config.arch}'s mixture-of-experts layers yet (each "
                         "rank would need every expert's rows): it runs on one rank (--tensor-parallel-size 1)")
    if not ARCHITECTURES[config.arch].tensor_parallel:
        raise ValueError(f"tensor parallelism is not validated for {config.arch} yet: it runs on one rank "
                         "(--tensor-parallel-size 1)")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    _even(heads, size, "attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} and the model's {kv_heads} KV heads: one must divide "
                         "the other")
    _even(config.intermediate_size, size, "MLP units (intermediate_size)")
    per_rank = heads // size
    if kv_heads >= size:
        kv_per_rank = kv_heads // size
        kv_range = (rank * kv_per_rank, (rank + 1) * kv_per_rank)
    else:  # fewer KV heads than ranks: each rank keeps the one its query heads share
        kv_head = rank // (size // kv_heads)
        kv_range = (kv_head, kv_head + 1)
    units = config.intermediate_size // size
    vocab_rows = -(-config.vocab_size // size)
    vocab_rows = -(-vocab_rows // _VOCAB_ROW_MULTIPLE) * _VOCAB_ROW_MULTIPLE
    vocab_start = min(rank * vocab_rows, config.vocab_size)
    return Shard(
        rank=rank, size=size, head_dim=config.head_dim, heads=(rank * per_rank, (rank + 1) * per_rank),
        kv_heads=kv_range, units=(rank * units, (rank + 1) * units),
        vocab=(vocab_start, min(vocab_start + vocab_rows, config.vocab_size)), vocab_rows=vocab_rows,
        totals=(heads, kv_heads, config.intermediate_size),
    )


def whole_config(config):
    """The whole model's ModelConfig from a rank's (itself where the model is not split)."""
    shard = config.shard
    if shard is None:
        return config
    heads, kv_heads, units = shard.totals
    return dataclasses.replace(config, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               intermediate_size=units, shard=None)


def shard_config(config, rank: int, size: int):
    """The ModelConfig of rank `rank`'s part: its heads, KV heads and units, and its Shard; the
    vocabulary and hidden size stay the whole model's."""
    shard = make_shard(config, rank, size)
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=config.intermediate_size // size, shard=shard,
    )
