"""BERT-family checkpoints as sentence-transformers saves them, served through the three processes:
CrossEncoder rerankers (`--task score`, chosen on their own) score as `CrossEncoder.predict` does, and
SentenceTransformer embedding models (mean and CLS pooling) embed as `encode` does, for BERT and
XLM-RoBERTa, with pairs of many lengths in one step (each prompt attends only to itself, whole)."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from crane_mp.testing.make_encoder import make_encoder
from tests.integration.server import Server

QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris, France.",
             "rain", "Which city? " * 12, "The river in the spring, the sun and the rain over the city of Paris."]
LONG = "The weather in Paris in the spring: rain, then sun over the river. " * 20  # past the 128 positions


@pytest.mark.parametrize("arch", ["bert", "roberta", "xlm-roberta"])
def test_a_cross_encoder_scores_as_sentence_transformers_does(arch, tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_encoder(arch, tmp_path / arch, "score", seed=3)
    documents = DOCUMENTS + [LONG]  # cut to the positions, the longer text first, as CrossEncoder cuts it
    want = CrossEncoder(str(path), device="cpu").predict([(QUERY, d) for d in documents]).tolist()
    assert max(want) - min(want) > 0.01  # the random head tells the pairs apart
    srv = Server(path, "--dtype", "float32", log_path=tmp_path / "server.log")
    try:
        scored = requests.post(f"{srv.url}/score", json={"text_1": QUERY, "text_2": documents}, timeout=60).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-4)
        assert scored["usage"]["prompt_tokens"] <= len(documents) * 128
        ranked = requests.post(f"{srv.url}/v1/rerank", json={"query": QUERY, "documents": documents}, timeout=60)
        assert [r["index"] for r in ranked.json()["results"]] == sorted(range(len(want)), key=lambda i: -want[i])
        assert srv.stats()["prefix_cache_hits"] == 0  # an encoder's prompt is computed whole, every time
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("arch,pooling", [("bert", "mean"), ("bert", "cls"), ("roberta", "cls"),
                                          ("xlm-roberta", "mean")])
def test_an_embedding_model_embeds_as_sentence_transformers_does(arch, pooling, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = make_encoder(arch, tmp_path / arch, "embed", pooling, seed=5)
    want = SentenceTransformer(str(path), device="cpu").encode(DOCUMENTS)
    srv = Server(path, "--dtype", "float32", log_path=tmp_path / "server.log")
    try:
        body = requests.post(f"{srv.url}/v1/embeddings", json={"input": DOCUMENTS}, timeout=60).json()
        got = np.array([item["embedding"] for item in body["data"]])
        np.testing.assert_allclose(got, want, atol=1e-5)
        chat = requests.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=60)
        assert chat.status_code == 400
    finally:
        assert srv.stop() == 0


def test_an_encoder_is_served_for_pooling_only(tmp_path, capsys):
    from crane_mp.cli import parse_args

    path = make_encoder("bert", tmp_path / "bert", "embed", "mean", seed=1)
    config = parse_args(["--model-path", str(path)])
    assert config.engine.task == "embed" and config.pooling.method == "mean"
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(path), "--task", "generate"])
    assert "an encoder (BERT family)" in capsys.readouterr().err
