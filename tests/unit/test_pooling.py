"""Embedding pooling: which pooling a sentence-transformers checkpoint declares, and the worker's pooled
vectors against transformers' final hidden states, also when a prompt is prefilled in chunks and
recomputed after a preemption."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

from crane_mp.models.config import load_model_config
from crane_mp.models.pooling import Pooling, sentence_transformers_pooling
from crane_mp.protocol import NewRequest, SamplingParams, ScheduledRequest, StepPlan
from crane_mp.testing.make_model import make_model
from crane_mp.worker.step.runner import ModelRunner
from tests.model_helpers import CPU, load_checkpoint

PROMPT = list(range(3, 43))  # 40 tokens: three KV blocks of 16


def write_modules(path, pooling: dict | None, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))


def test_the_declared_pooling_is_read(tmp_path):
    assert sentence_transformers_pooling(tmp_path) is None
    write_modules(tmp_path, {"pooling_mode_lasttoken": True}, True)
    assert sentence_transformers_pooling(tmp_path) == Pooling("last", True)
    write_modules(tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, False)
    assert sentence_transformers_pooling(tmp_path) == Pooling("mean", False)
    write_modules(tmp_path, {"pooling_mode_cls_token": True}, True)
    assert sentence_transformers_pooling(tmp_path) == Pooling("cls", True)
    # sentence-transformers 6 writes one string instead of the booleans.
    for mode, method in (("lasttoken", "last"), ("mean", "mean"), ("cls", "cls")):
        write_modules(tmp_path, {"embedding_dimension": 64, "pooling_mode": mode, "include_prompt": True}, False)
        assert sentence_transformers_pooling(tmp_path) == Pooling(method, False)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"modality_config": {
        "text": {"method": "forward"}, "message": {"method": "forward", "format": "structured"}}}))
    assert sentence_transformers_pooling(tmp_path) == Pooling("cls", False, chat_template=True)
    for config, named in (({"pooling_mode": "max"}, "pooling max"),
                          ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "pooling_mode_max_tokens")):
        write_modules(tmp_path, config, True)
        with pytest.raises(ValueError, match=named):
            sentence_transformers_pooling(tmp_path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "q", seed=9)
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(str(path), dtype=torch.float32)(torch.tensor([PROMPT])).last_hidden_state[0]
    return load_checkpoint(load_model_config(path), path, torch.float32), hidden.numpy()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunked_and_preempted_prompts_pool_like_one_pass(checkpoint, pooling):
    model, hidden = checkpoint
    runner = ModelRunner(model, 16, 128, CPU)
    runner.allocate_kv_cache(8)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    first = runner.execute(StepPlan(1, [NewRequest(7, PROMPT, params)], [ScheduledRequest(7, 0, 32, [0, 1])], [], []))
    assert first.pooled == [] and first.req_ids == []
    # Preempted after two chunks: the prompt is recomputed from the start into new blocks.
    runner.execute(StepPlan(2, [], [], [7], []))
    again = runner.execute(StepPlan(3, [], [ScheduledRequest(7, 0, 16, [4], reset_blocks=True)], [], []))
    assert again.pooled == []
    last = runner.execute(StepPlan(4, [], [ScheduledRequest(7, 16, 24, [5, 6])], [], []))
    [pooled] = last.pooled
    assert pooled.req_id == 7 and last.req_ids == [7]  # a placeholder token ends the request
    expected = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
    np.testing.assert_allclose(np.frombuffer(pooled.values, dtype=np.float32), expected, rtol=1e-4, atol=1e-4)


def test_an_embedding_checkpoint_without_an_lm_head_loads_with_a_stub(tmp_path):
    from safetensors.torch import load_file, save_file

    from crane_mp.models.gguf_file import ModelSource
    from crane_mp.worker.weights.loader import load_model

    path = make_model("qwen3", "tiny", tmp_path / "q", seed=4)
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tie_word_embeddings": False}))
    weights = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()
               if k != "lm_head.weight"}  # saved as a bare decoder (Qwen3Model), no head
    save_file(weights, str(path / "model.safetensors"))
    config = load_model_config(path)
    with pytest.raises(ValueError, match="missing"):
        load_model(config, ModelSource("safetensors", path), torch.float32, CPU, progress=False)
    model, _ = load_model(config, ModelSource("safetensors", path), torch.float32, CPU, progress=False, embed_only=True)
    assert model.lm_head.weight.shape == (1, config.hidden_size)
    assert torch.equal(model.model.embed_tokens.weight, weights["embed_tokens.weight"])
