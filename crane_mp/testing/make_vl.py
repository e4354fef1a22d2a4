"""Tiny seeded random-weight vision-language checkpoints (tests, demos): Qwen2.5-VL, Qwen3-VL, Qwen3.5
(hybrid language model) and Gemma 3 with images. Config, weights as transformers' save_pretrained
writes them, a locally trained tokenizer with the family's special tokens, the image processor config
and a chat template that places images as the family's does.

    python -m crane_mp.testing.make_vl --out DIR [--family qwen3_vl] [--seed N]
"""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken
from transformers import Qwen2_5_VLConfig, Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLConfig, Qwen3VLMoeConfig

from crane_mp.testing.make_model import BIAS_STD, LOGIT_SCALE, NORM_NOISE, OUT_GAIN
from crane_mp.testing.tokenizer import train_tokenizer, write_json

VOCAB_SIZE = 512
# After Qwen2's <|endoftext|>, <|im_start|>, <|im_end|>, in the order of the real vocabulary.
_VL_SPECIALS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                "<|video_pad|>")
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# Images are resized to between 2x2 and 12x12 merged patches (28 px each): small prompts, yet wider than
# one attention window (112 px), so window and full attention differ.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 144
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3")
# Qwen3-VL's and Qwen3.5's towers: 16-pixel patches, their learned position grid 4 x 4 (smaller than
# most images: resampled up and down).
_PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen3_5_moe": 16}
_MEAN_STD = {"qwen2_5_vl": (_CLIP_MEAN, _CLIP_STD),
             **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), ([0.5] * 3, [0.5] * 3))}
# An image's placeholders outnumber the text around it. The merger's output gain lets the image move the
# continuation; token embeddings of norm 4 (make_model draws unit norm) let the last token still steer
# the next one, where greedy decoding would otherwise settle into a loop over the image.
VISION_OUT_GAIN = 4.0
EMBED_NORM = 4.0

# Behaves as Qwen2.5-VL's template: a default system turn, each image part (type "image", or a part
# holding "image" / "image_url") as <|vision_start|><|image_pad|><|vision_end|>, numbered "Picture N: "
# with add_vision_id, text parts verbatim.
CHAT_TEMPLATE = r"""
{%- set image_count = namespace(value=0) %}
{%- for message in messages %}
{%- if loop.first and message['role'] != 'system' %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\n' }}
{%- if message['content'] is string %}
{{- message['content'] }}
{%- else %}
{%- for part in message['content'] %}
{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}
{%- set image_count.value = image_count.value + 1 %}
{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part['type'] == 'video' or 'video' in part %}
{{- '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif 'text' in part %}
{{- part['text'] }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}"""


# Gemma 3's specials (each image's placeholder <start_of_image>, expanded by the processor into soft tokens
# between it and <end_of_image>); its template as the released one places images and turns.
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                   "<end_of_image>", "<image_soft_token>")
GEMMA_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
{%- if message['content'] is string %}
{{- message['content'] | trim }}
{%- else %}
{%- for item in message['content'] %}
{%- if item['type'] == 'image' %}{{- '<start_of_image>' }}
{%- elif item['type'] == 'text' %}{{- item['text'] | trim }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"""
GEMMA_IMAGE_SIZE = 64  # 8 x 8 patches of 8 pixels, pooled to 4 x 4 = 16 tokens per image or crop
GEMMA_TOKENS_PER_IMAGE = 16


def _write_gemma_tokenizer(out: Path) -> dict[str, int]:
    tok = train_tokenizer("qwen2", VOCAB_SIZE - len(_GEMMA_SPECIALS))
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in _GEMMA_SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in _GEMMA_SPECIALS}
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
        "added_tokens_decoder": {str(ids[name]): {"content": name, "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": True}
                                 for name in _GEMMA_SPECIALS},
    })
    return ids


def _gemma_config(ids: dict[str, int]) -> Any:
    """Gemma 3's language model at 64 wide, a sliding layer (window 128: longer than the tests' prompts, as
    real windows are) then a global one; a 2-layer
    SigLIP tower 32 wide."""
    from transformers import Gemma3Config

    config = Gemma3Config(
        text_config={"vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "sliding_window": 128,
                     "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 32,
                     "max_position_embeddings": 4096, "bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"],
                     "pad_token_id": ids["<pad>"]},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": GEMMA_IMAGE_SIZE, "patch_size": 8, "vision_use_head": False},
        mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE, image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"], tie_word_embeddings=True)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


def _write_gemma_processor(out: Path, pan_and_scan: bool) -> None:
    write_json(out / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"height": GEMMA_IMAGE_SIZE, "width": GEMMA_IMAGE_SIZE},
        "resample": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": None, "do_pan_and_scan": pan_and_scan or None, "pan_and_scan_min_crop_size": 32,
        "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2,
    })
    write_json(out / "processor_config.json", {"image_seq_length": GEMMA_TOKENS_PER_IMAGE,
                                               "processor_class": "Gemma3Processor"})
    (out / "chat_template.jinja").write_text(GEMMA_TEMPLATE, encoding="utf-8")


def _write_tokenizer(out: Path) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json (the template goes beside them); returns the specials' ids."""
    tok = train_tokenizer("qwen2", VOCAB_SIZE - len(_VL_SPECIALS))
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in _VL_SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    names = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *_VL_SPECIALS)
    ids = {name: tok.token_to_id(name) for name in names}
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(ids[name]): {"content": name, "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": True}
                                 for name in names},
    })
    return ids


def build_config(ids: dict[str, int], family: str = "qwen2_5_vl") -> Any:
    """Text: 64 wide. Qwen2.5-VL: Qwen2 (head_dim 16, rope sections 2+3+3 of its 8 frequencies); vision
    32 wide, 4 blocks, full attention in blocks 1 and 3, windowed elsewhere. Qwen3-VL: Qwen3 with
    32-wide heads, sections 6+5+5 interleaved; 3 blocks, deepstack after blocks 0 and 1 into the first
    two of 3 layers (Qwen3-VL-MoE: the same with experts). Qwen3.5: the hybrid (Gated DeltaNet, gated
    attention, twice), rope on half of each 32-wide head, sections 3+3+2 interleaved; 2 blocks, no
    deepstack; Qwen3.5-MoE: the same with 4 experts (2 per token) and a shared one."""
    specials = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                "tie_word_embeddings": False}
    text = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
              "patch_size": _PATCH[family], "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config={**text, "use_sliding_window": False, "rope_parameters": {
                "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}},
            vision_config={**vision, "depth": 4, "fullatt_block_indexes": [1, 3], "window_size": 112,
                           "hidden_act": "silu"}, **specials)
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    elif family in ("qwen3_vl", "qwen3_vl_moe"):
        # The MoE variant: 4 experts of 48 (2 per token) in every layer, its expert tensors fused.
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48} \
            if family == "qwen3_vl_moe" else {}
        config = (Qwen3VLMoeConfig if experts else Qwen3VLConfig)(
            text_config={**text, "num_hidden_layers": 3, "head_dim": 32, "rope_parameters": {
                "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5],
                "mrope_interleaved": True}, **experts},
            vision_config={**vision, "depth": 3, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
            **specials)
        config.architectures = ["Qwen3VLMoeForConditionalGeneration" if experts else
                                "Qwen3VLForConditionalGeneration"]
    elif family in ("qwen3_5", "qwen3_5_moe"):
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48} if family == "qwen3_5_moe" else {}
        config = (Qwen3_5MoeConfig if experts else Qwen3_5Config)(
            text_config={**text, "num_hidden_layers": 4, "head_dim": 32,
                         "layer_types": ["linear_attention", "full_attention"] * 2,
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                         "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rope_parameters": {
                             "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True}, **experts},
            vision_config={**vision, "depth": 2, "num_position_embeddings": 16}, **specials)
        config.architectures = ["Qwen3_5MoeForConditionalGeneration" if experts else
                                "Qwen3_5ForConditionalGeneration"]
    else:
        raise ValueError(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")
    return config


def _init_tensor(name: str, shape: torch.Size, gen: torch.Generator, embed_norm: float = EMBED_NORM) -> torch.Tensor:
    """As make_model draws a language model (peaked logits), plus rules for the vision tower's tensors."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf == "embed_tokens":
        return embed_norm * noise / math.sqrt(fan_in)
    if leaf == "lm_head":
        return noise / math.sqrt(fan_in)
    if name == "model.language_model.norm.weight":
        return LOGIT_SCALE * (1.0 + NORM_NOISE * noise)
    if "norm" in leaf or leaf == "ln_q":
        return 1.0 + NORM_NOISE * noise
    if kind == "bias":
        return BIAS_STD * noise
    if name in ("model.visual.merger.mlp.2.weight", "model.visual.merger.linear_fc2.weight",
                "model.multi_modal_projector.mm_input_projection_weight"):
        return VISION_OUT_GAIN * noise / math.sqrt(fan_in)
    if leaf in ("o_proj", "down_proj") or name.endswith("attn.proj.weight"):
        return OUT_GAIN * noise / math.sqrt(fan_in)
    return noise / math.sqrt(fan_in)


def make_vl(out: str | Path, seed: int = 0, family: str = "qwen2_5_vl", pan_and_scan: bool = False) -> Path:
    """Write the checkpoint to `out`; the same seed writes the same weights. `pan_and_scan`: Gemma 3's
    processor crops wide and tall images besides the whole one."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gemma = family == "gemma3"
    ids = _write_gemma_tokenizer(out) if gemma else _write_tokenizer(out)
    config = _gemma_config(ids) if gemma else build_config(ids, family)
    model = getattr(transformers, config.architectures[0])(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            # Gemma scales its (tied) embeddings by sqrt(hidden) on the way in: half a unit is enough.
            tensor.copy_(_init_tensor(name, tensor.shape, gen, 0.5 if gemma else EMBED_NORM))
    bos, eos, pad = ((ids["<bos>"], [ids["<eos>"], ids["<end_of_turn>"]], ids["<pad>"]) if gemma else
                     (ids["<|endoftext|>"], [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"]))
    model.generation_config = transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                                                            do_sample=False)
    model.save_pretrained(out)
    if gemma:
        _write_gemma_processor(out, pan_and_scan)
        return out
    patch = _PATCH[family]
    mean, std = _MEAN_STD[family]
    processor_class = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen3VLProcessor"
    write_json(out / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor_class,
        "min_pixels": MIN_PIXELS * patch**2 // 14**2, "max_pixels": MAX_PIXELS * patch**2 // 14**2,
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2, "image_mean": mean, "image_std": std,
    })
    if family != "qwen2_5_vl":  # Qwen3VLProcessor's video settings, a few small frames per video
        write_json(out / "video_preprocessor_config.json", {
            "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4, "max_frames": 32,
            "size": {"shortest_edge": 4096, "longest_edge": 6 * 128 * 128}, "patch_size": patch,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": mean, "image_std": std})
    # Where transformers 5 saves a template, and where both the tokenizer and the processor read it.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE.lstrip("\n"), encoding="utf-8")
    return out


def make_video(frames: int, fps: int, height: int, width: int, seed: int = 0) -> bytes:
    """An MP4 (MPEG-4 part 2: in every PyAV wheel) of smooth random frames that move: `frames` at `fps`."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (height // 8 + 2, width // 8 + 2, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            shifted = np.roll(base, index, axis=1)[: height // 8, : width // 8]
            picture = np.asarray(Image.fromarray(shifted).resize((width, height), Image.BILINEAR))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def reference_processor(model_dir: str | Path) -> Any:
    """transformers' processor of the checkpoint, the reference our image path must equal: AutoProcessor's.
    Without torchvision AutoProcessor fails on the video processor (every one needs it), which image
    prompts never use; the same processor is then built without one."""
    from unittest import mock

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import is_torchvision_available

    settings = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    if is_torchvision_available() or settings["processor_class"] == "Gemma3Processor":  # Gemma's has no video
        return AutoProcessor.from_pretrained(str(model_dir))
    check = ProcessorMixin.check_argument_for_proper_class

    def check_all_but_video(self, name: str, value: Any) -> Any:
        return None if name == "video_processor" else check(self, name, value)

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = Qwen3VLProcessor if settings["processor_class"] == "Qwen3VLProcessor" else Qwen2_5_VLProcessor
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check_all_but_video):
        return processor(image_processor=AutoImageProcessor.from_pretrained(str(model_dir)), tokenizer=tokenizer,
                         video_processor=None, chat_template=tokenizer.chat_template)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    args = parser.parse_args(argv)
    print(make_vl(args.out, args.seed, args.family))


if __name__ == "__main__":
    main()
