"""A causal reranker's yes/no head: the difference of two LM-head rows, read from safetensors (tied or
untied) or dequantized from a GGUF file, so that its dot product with the final hidden state is the
yes/no logit difference transformers computes; and a sequence-classification head read as
sentence-transformers' CrossEncoder reads it (pair format, activation, prompt, the token it pools)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.models.gguf_file import resolve_model_source
from crane_mp.models.score_head import answer_head, load_score_head
from crane_mp.testing.make_gguf import make_gguf
from crane_mp.testing.make_model import make_model

YES, NO = 40, 77


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request, tmp_path_factory):
    return make_model(request.param, "tiny", tmp_path_factory.mktemp("m") / request.param, seed=2)


def test_the_head_scores_as_the_yes_no_softmax_of_transformers(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][0, -1].numpy()  # after the final norm, as the engine pools it
    want = torch.softmax(out.logits[0, -1, [NO, YES]], dim=0)[1].item()
    head = answer_head(resolve_model_source(model_dir), YES, NO)
    assert head.score(hidden.astype(np.float32).tobytes()) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_gguf_file_gives_the_same_head(model_dir, tmp_path, qtype):
    from_checkpoint = answer_head(resolve_model_source(model_dir), YES, NO).weight
    gguf_path = make_gguf(model_dir, tmp_path / f"reranker-{qtype}.gguf", qtype)
    from_gguf = answer_head(resolve_model_source(gguf_path), YES, NO).weight
    tolerance = 0 if qtype == "F32" else 0.02 * float(np.abs(from_checkpoint).max())
    np.testing.assert_allclose(from_gguf, from_checkpoint, atol=tolerance)


def _seq_cls_dir(path: Path, **files: dict) -> Path:
    """A decoder sequence-classification checkpoint's head and config, with sentence-transformers' files."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"score.weight": torch.ones(1, 4)}, str(path / "model.safetensors"))
    files = {"config.json": {"architectures": ["Qwen3ForSequenceClassification"], "model_type": "qwen3",
                             "pad_token_id": 9}, **files}
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    return path


TYPED = ("{% for m in messages %}{% for p in m['content'] if p['type'] == 'text' %}{{ p['text'] }}{% endfor %}"
         "{% endfor %}")
FLAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize(("template", "files", "want"), [
    (TYPED, {}, "structured"),  # none saved: a tokenizer with a template renders pairs as messages
    (FLAT, {}, "flat"),
    (None, {}, None),  # nor template: the text-pair encoding
    (TYPED, {"sentence_bert_config.json": {"modality_config": {"text": {}}}}, None),
    (TYPED, {"sentence_bert_config.json": {"modality_config": {"message": {"format": "flat"}}}}, "flat"),
    (FLAT, {"sentence_bert_config.json": {"modality_config": {"message": {"format": "auto"}}}}, "flat"),
])
def test_a_pair_is_formatted_as_cross_encoder_infers(tmp_path, template, files, want):
    assert load_score_head(_seq_cls_dir(tmp_path / "m", **files), template).pair_format == want


@pytest.mark.parametrize(("files", "sigmoid"), [
    ({}, True),
    ({"config_sentence_transformers.json": {"activation_fn": "torch.nn.modules.linear.Identity"}}, False),
    ({"config_sentence_transformers.json": {"activation_fn": "mine.Identity"}}, True),  # untrusted: the default
    ({"config.json": {"architectures": ["Qwen3ForSequenceClassification"],
                      "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}}, False),
])
def test_the_activation_is_the_one_cross_encoder_trusts(tmp_path, files, sigmoid):
    assert load_score_head(_seq_cls_dir(tmp_path / "m", **files)).sigmoid is sigmoid


def test_an_unsupported_activation_is_refused(tmp_path):
    files = {"config_sentence_transformers.json": {"activation_fn": "torch.nn.modules.activation.Tanh"}}
    with pytest.raises(ValueError, match="Tanh"):
        load_score_head(_seq_cls_dir(tmp_path / "m", **files))


def test_the_decoder_head_reads_the_last_token_that_is_not_padding(tmp_path):
    files = {"config_sentence_transformers.json": {"prompts": {"rank": "Judge: "}, "default_prompt_name": "rank"}}
    head = load_score_head(_seq_cls_dir(tmp_path / "m", **files))
    assert head.pooled_ids([4, 5, 9, 9]) == [4, 5] and head.pooled_ids([9, 9]) == [9]
    assert head.pooled_ids([9, 4]) == [9, 4] and head.prompt == "Judge: "
