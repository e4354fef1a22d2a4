"""gpt-oss: Llama's pre-norm layer with attention sinks (layers.py), alternating sliding and global
layers, yarn rope, and a mixture of experts with biases and a clamped SwiGLU (moe.py).

Its checkpoints stack each layer's experts transposed, gate and up interleaved column by column
([experts, hidden, 2 x intermediate]); they are turned into our stacks as they load. The released
checkpoints hold the expert matrices as MXFP4 blocks (quantized/mxfp4.py), dequantized here.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from crane_mp.worker.models.llama import LlamaForCausalLM
from crane_mp.worker.quantized.mxfp4 import dequantize_mxfp4


class GptOssForCausalLM(LlamaForCausalLM):
    renamed_weights = {"mlp.router.": "mlp.gate."}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_our_experts(weights))


def _our_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, its experts' as our stacked projections and biases."""
    blocks: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".experts.")
        if not stem:
            yield name, tensor
            continue
        experts = f"{stem}.experts."
        if leaf in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            projection, _, part = leaf.rpartition("_")
            blocks[f"{experts}{projection}.{part}"] = tensor
            pair = [blocks.get(f"{experts}{projection}.{p}") for p in ("blocks", "scales")]
            if pair[0] is None or pair[1] is None:
                continue
            del blocks[f"{experts}{projection}.blocks"], blocks[f"{experts}{projection}.scales"]
            leaf, tensor = projection, dequantize_mxfp4(*pair).transpose(1, 2)  # rows as a float checkpoint's
        if leaf == "gate_up_proj":  # [experts, hidden, 2 x intermediate], gate and up alternating
            yield f"{experts}gate_proj.weight", tensor[..., 0::2].transpose(1, 2)
            yield f"{experts}up_proj.weight", tensor[..., 1::2].transpose(1, 2)
        elif leaf == "down_proj":  # [experts, intermediate, hidden]
            yield f"{experts}down_proj.weight", tensor.transpose(1, 2)
        elif leaf == "gate_up_proj_bias":
            yield f"{experts}gate_up_bias", torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
        elif leaf == "down_proj_bias":
            yield f"{experts}down_bias", tensor
        else:
            yield name, tensor
    if blocks:
        raise KeyError(f"MXFP4 expert tensors without their other half: {sorted(blocks)}")
