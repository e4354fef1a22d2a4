"""make_vl's tiny Qwen2.5-VL checkpoint: transformers loads it, our vision tower reads its tensors and
matches its tower, and its greedy output is varied and follows the image."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open
from transformers import Qwen2_5_VLForConditionalGeneration

from crane_mp.frontend.images.processor import load_image_processor
from crane_mp.testing.make_vl import make_vl, reference_processor
from crane_mp.worker.models.qwen2_5_vl_vision import Qwen25VisionTower


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vl(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", seed=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    circle = Image.new("RGB", (160, 120), "white")
    ImageDraw.Draw(circle).ellipse((30, 20, 120, 100), fill="green")
    ramp = np.tile(np.linspace(0, 255, 160, dtype=np.uint8)[None, :, None], (140, 1, 3))
    return {"noise": Image.fromarray(rng.integers(0, 256, (150, 200, 3), dtype=np.uint8)),
            "circle": circle, "ramp": Image.fromarray(ramp)}


def test_tensors_are_named_as_transformers_saves_them(checkpoint):
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
            "model.layers.1.self_attn.q_proj.bias", "visual.patch_embed.proj.weight",
            "visual.merger.mlp.2.weight"} <= names
    assert all(name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "visual.", "lm_head."))
               for name in names)


def test_our_tower_reads_the_checkpoint_and_matches_its_tower(checkpoint, model):
    tower = Qwen25VisionTower(model.config.vision_config).eval()
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        tower.load_weights((name.removeprefix("visual."), f.get_tensor(name))
                           for name in f.keys() if name.startswith("visual."))
    processor = load_image_processor(checkpoint)
    images = [processor.preprocess(image) for image in _images().values()]
    pixels = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
    grids = [image.grid_thw for image in images]
    with torch.no_grad():
        expected = model.model.visual(pixels, torch.tensor(grids)).pooler_output
        assert torch.equal(tower(pixels, grids), expected)


def test_greedy_output_is_varied_and_follows_the_image(checkpoint, model):
    processor = reference_processor(checkpoint)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    outputs = {}
    for name, image in _images().items():
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        generated = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        outputs[name] = generated[0, inputs["input_ids"].shape[1]:].tolist()
        assert len(outputs[name]) == 16 and len(set(outputs[name])) >= 8, outputs
    assert len({tuple(tokens) for tokens in outputs.values()}) == len(outputs), outputs
