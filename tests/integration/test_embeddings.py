"""/v1/embeddings through the real three processes, against transformers' final hidden states: last-token
pooling (declared by a sentence-transformers config) with chunked prefill and a shared prefix, mean
pooling under a tight KV budget, float and base64 encodings, dimensions, and the refusals."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import requests
import torch
from transformers import AutoModel, AutoTokenizer

from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

TEXTS = ["hello world", "the weather is " + "very " * 40 + "nice", "the weather is " + "very " * 40 + "cold",
         "short", "embeddings of " * 12 + "text"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 dressed as a sentence-transformers model: last-token pooling, then Normalize."""
    path = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "qwen3-embed", seed=7)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0].numpy()

    return tokenizer, hidden


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_last_token_embeddings_match_transformers(model_dir, reference, tmp_path):
    tokenizer, hidden = reference
    server = Server(model_dir, "--max-num-batched-tokens", "32", "--max-concurrent", "4", log_path=tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        ids = [tokenizer.encode(t) for t in TEXTS]
        assert max(len(i) for i in ids) > 32  # chunked prefill
        # The SDK asks for base64 and decodes it; a second request gets floats; a third token ids.
        by_sdk = client.embeddings.create(model=model, input=TEXTS)
        assert by_sdk.usage.prompt_tokens == sum(len(i) for i in ids)
        floats = requests.post(server.url + "/v1/embeddings", json={"input": TEXTS}).json()
        token_input = requests.post(server.url + "/v1/embeddings", json={"input": ids[1]}).json()
        for i, text_ids in enumerate(ids):
            expected = unit(hidden(text_ids)[-1])
            np.testing.assert_allclose(by_sdk.data[i].embedding, expected, atol=2e-5)
            np.testing.assert_allclose(floats["data"][i]["embedding"], expected, atol=2e-5)
            assert floats["data"][i]["index"] == i and floats["data"][i]["object"] == "embedding"
        np.testing.assert_allclose(token_input["data"][0]["embedding"], unit(hidden(ids[1])[-1]), atol=2e-5)

        short = requests.post(server.url + "/v1/embeddings",
                              json={"input": "short", "dimensions": 8, "encoding_format": "base64"}).json()
        values = np.frombuffer(base64.b64decode(short["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(values, unit(hidden(ids[3])[-1][:8]), atol=2e-5)

        for body, words in [({"input": "x", "dimensions": 10_000}, "at most"), ({"input": []}, "input"),
                            ({"input": [""]}, "empty")]:
            r = requests.post(server.url + "/v1/embeddings", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = requests.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
        assert server.stats()["num_running"] == 0
    finally:
        assert server.stop() == 0


def test_mean_pooling_under_a_tight_kv_budget(model_dir, reference, tmp_path):
    tokenizer, hidden = reference
    server = Server(model_dir, "--pooling", "mean", "--max-total-tokens", "160", "--max-num-batched-tokens", "32",
                    "--max-concurrent", "4", log_path=tmp_path / "log")
    try:
        body = requests.post(server.url + "/v1/embeddings", json={"input": TEXTS * 2}).json()
        for i, text in enumerate(TEXTS * 2):
            expected = unit(hidden(tokenizer.encode(text)).mean(axis=0))
            np.testing.assert_allclose(body["data"][i]["embedding"], expected, atol=2e-5)
    finally:
        assert server.stop() == 0


def test_a_text_generation_server_refuses_embeddings(tmp_path):
    generator = make_model("qwen3", "tiny", tmp_path / "m", seed=5)
    server = Server(generator, log_path=tmp_path / "log")
    try:
        r = requests.post(server.url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls"])
def test_a_checkpoint_saved_by_sentence_transformers_serves_its_vectors(mode, tmp_path):
    """The installed sentence-transformers builds and saves the checkpoint (its own config spelling);
    the server detects the pooling and returns what SentenceTransformer.encode returns."""
    from sentence_transformers import SentenceTransformer, models

    base = make_model("qwen3", "tiny", tmp_path / "base", seed=11)
    transformer = models.Transformer(str(base))
    dimension = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pooling = models.Pooling(dimension(), pooling_mode=mode)
    reference = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    reference.save(str(tmp_path / "st"))
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    server = Server(tmp_path / "st", log_path=tmp_path / "log")
    try:
        body = requests.post(server.url + "/v1/embeddings", json={"input": TEXTS}).json()
        served = np.array([item["embedding"] for item in body["data"]])
        np.testing.assert_allclose(served, expected, atol=1e-4)
    finally:
        assert server.stop() == 0
