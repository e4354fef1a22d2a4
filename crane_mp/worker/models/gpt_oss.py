"""gpt-oss: Llama's pre-norm layer with attention sinks (layers.py), alternating sliding and global
layers, yarn rope, and a mixture of experts with biases and a clamped SwiGLU (moe.py).

Its checkpoints stack each layer's experts transposed, gate and up interleaved column by column
([experts, hidden, 2 x intermediate]); they are turned into our stacks as they load. The released
checkpoints hold the expert matrices as MXFP4 blocks (rows [experts, 2 x intermediate, ...], gate and
up alternating): those are kept as MXFP4, as GGUF rows in the experts the loader swapped in
(weights/loader.py's mxfp4_experts).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from crane_mp.worker.models.llama import LlamaForCausalLM
from crane_mp.worker.quantized.layers import GGUFExperts
from crane_mp.worker.quantized.mxfp4 import ggml_rows

_MXFP4_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


class GptOssForCausalLM(LlamaForCausalLM):
    renamed_weights = {"mlp.router.": "mlp.gate."}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked: set[str] = set()
        loaded = super().load_weights(self._our_experts(weights, stacked))
        return loaded | stacked

    def expected_weights(self) -> set[str]:
        """Besides the parameters, each stack of an MXFP4 checkpoint's experts (a GGUF file's are the
        GGUF loader's)."""
        expected = super().expected_weights()
        if not self.config.layout.experts.mxfp4:
            return expected
        return expected | {f"{prefix}.{stack}" for prefix, module in self.named_modules()
                           if isinstance(module, GGUFExperts) for stack in ("gate_up", "down")}

    def _our_experts(self, weights: Iterable[tuple[str, torch.Tensor]],
                     stacked: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, its experts' as our stacked projections and biases; MXFP4 blocks
        go straight into their experts' stacks (their names into `stacked`)."""
        halves: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            stem, _, leaf = name.rpartition(".experts.")
            if not stem:
                yield name, tensor
                continue
            experts = f"{stem}.experts."
            if leaf in _MXFP4_PARTS:
                projection, _, part = leaf.rpartition("_")
                halves[f"{experts}{projection}.{part}"] = tensor
                pair = [halves.get(f"{experts}{projection}.{p}") for p in ("blocks", "scales")]
                if pair[0] is not None and pair[1] is not None:
                    del halves[f"{experts}{projection}.blocks"], halves[f"{experts}{projection}.scales"]
                    stacked.add(self._fill_mxfp4(experts[:-1], projection, ggml_rows(*pair)))
                continue
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
        if halves:
            raise KeyError(f"MXFP4 expert tensors without their other half: {sorted(halves)}")

    def _fill_mxfp4(self, module: str, projection: str, rows: torch.Tensor) -> str:
        """Copy a projection's MXFP4 rows into its experts' stack; returns the stack's key."""
        experts = self.get_submodule(module)
        if not isinstance(experts, GGUFExperts):
            raise ValueError(f"{module}: MXFP4 expert blocks in a checkpoint whose config names no MXFP4 "
                             "quantization (quantization_config.quant_method)")
        if projection == "gate_up_proj":  # gate and up rows alternate; our stack holds the gates first
            target = experts.qweight_0
            width = target.shape[1] // 2
            _copy(target[:, :width], rows[:, 0::2], module)
            _copy(target[:, width:], rows[:, 1::2], module)
            return f"{module}.gate_up"
        _copy(experts.qweight_1, rows, module)
        return f"{module}.down"


def _copy(target: torch.Tensor, rows: torch.Tensor, module: str) -> None:
    if target.shape != rows.shape:
        raise ValueError(f"{module}: MXFP4 expert rows {list(rows.shape)}, expected {list(target.shape)}")
    target.copy_(rows)
