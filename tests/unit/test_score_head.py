"""A causal reranker's yes/no head: the difference of two LM-head rows, read from safetensors (tied or
untied) or dequantized from a GGUF file, so that its dot product with the final hidden state is the
yes/no logit difference transformers computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.gguf_file import resolve_model_source
from crane_mp.score_head import answer_head
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
