"""/v1/rerank and /score through the three processes on a Qwen3-Reranker-style checkpoint (a tiny random
Qwen3 whose vocabulary has `yes` and `no`): scores equal the reference recipe run on transformers'
float32 model, and the response shapes are Cohere's/Jina's and vLLM's. Sequence-classification checkpoints
(--task score) score as sentence-transformers' CrossEncoder.predict does."""

from __future__ import annotations

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from crane_mp.frontend.scoring.routes import _PREFIX, _SUFFIX, DEFAULT_INSTRUCTION
from crane_mp.testing.make_model import make_model
from tests.integration.server import Server

QUERY = "what is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris, France."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "reranker", seed=9)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["yes", "no"])  # single tokens, as in Qwen3's own vocabulary
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, "--dtype", "float32", "--kv-cache-dtype", "float32",
                 log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0


def reference_scores(model_dir, query: str, documents: list[str], instruction: str = DEFAULT_INSTRUCTION):
    """Qwen3-Reranker's recipe: the last position's yes/no logits, softmaxed over the two."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in documents:
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
        ids = sum((tokenizer.encode(text, add_special_tokens=False) for text in (_PREFIX, body, _SUFFIX)), [])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].item())
    return scores


def test_rerank_scores_equal_the_reference_recipe(server, model_dir):
    want = reference_scores(model_dir, QUERY, DOCUMENTS)
    body = requests.post(f"{server.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-4)
        assert result["document"]["text"] == DOCUMENTS[result["index"]]
    assert body["usage"]["total_tokens"] > 0
    top = requests.post(f"{server.url}/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                                                      "top_n": 1, "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in top["results"]] == [results[0]["index"]] and "document" not in top["results"][0]


def test_score_pairs_one_against_many_and_pairwise(server, model_dir):
    want = reference_scores(model_dir, QUERY, DOCUMENTS)
    one = requests.post(f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    assert one["object"] == "list" and [d["index"] for d in one["data"]] == [0, 1, 2]
    assert [d["score"] for d in one["data"]] == pytest.approx(want, abs=1e-4)
    instruction = "Judge relevance"
    pairwise = requests.post(f"{server.url}/v1/score", timeout=60, json={
        "text_1": [QUERY, "yellow fruit"], "text_2": DOCUMENTS[:2], "instruction": instruction}).json()
    expected = reference_scores(model_dir, QUERY, DOCUMENTS[:1], instruction) + reference_scores(
        model_dir, "yellow fruit", DOCUMENTS[1:2], instruction)
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected, abs=1e-4)
    mismatched = requests.post(f"{server.url}/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
                               timeout=60)
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"


def test_a_query_reranked_again_reuses_its_cached_prompt_prefix(server, model_dir):
    """One engine request per pair, pooled: its prompt prefix (system text, instruction, query) comes from
    the prefix cache once an earlier request computed it, and the score is still the recipe's."""
    query = "which of these documents talks about the weather in Paris during the spring months?"
    first = requests.post(f"{server.url}/v1/rerank", json={"query": query, "documents": DOCUMENTS[:1]}, timeout=60)
    before = server.stats()["prefix_cache_hits"]
    again = requests.post(f"{server.url}/v1/rerank", json={"query": query, "documents": DOCUMENTS[1:]}, timeout=60)
    assert first.status_code == again.status_code == 200
    assert server.stats()["prefix_cache_hits"] - before >= 2 * 16  # both pairs, a block or more each
    want = reference_scores(model_dir, query, DOCUMENTS[1:])
    assert [r["relevance_score"] for r in sorted(again.json()["results"], key=lambda r: r["index"])] == \
        pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    """A one-label Qwen3 sequence-classification model saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoConfig, Qwen3ForSequenceClassification

    base = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "base", seed=4)
    config = AutoConfig.from_pretrained(base, num_labels=1)
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("m") / "cross"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    encoder = CrossEncoder(str(path), device="cpu")
    encoder.save(str(path))
    return path, encoder


def test_a_cross_encoder_checkpoint_scores_as_sentence_transformers_does(cross_encoder_dir, tmp_path):
    path, encoder = cross_encoder_dir
    want = encoder.predict([(QUERY, document) for document in DOCUMENTS]).tolist()
    srv = Server(path, "--dtype", "float32", "--kv-cache-dtype", "float32", log_path=tmp_path / "server.log")
    try:
        assert srv.stats() is not None  # started as --task score on its own (the checkpoint classifies)
        scored = requests.post(f"{srv.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-4)
        ranked = requests.post(f"{srv.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
        assert [r["index"] for r in ranked.json()["results"]] == sorted(range(3), key=lambda i: -want[i])
        chat = requests.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                             timeout=60)
        assert chat.status_code == 400 and "--task score" in chat.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


SEQ_CLS_DOCUMENTS = DOCUMENTS + ["Berlin is in Germany.", "x", "France exports wine and cheese.",
                                 "The moon orbits the earth.", "It ends in the pad token<|endoftext|>"]


def _spread_scores(model, encoder, pairs) -> None:
    """Set the one-label `score` row to spread the pairs' logits about 0 (std 2): the direction along
    which their final states differ most, less its part along their mean state (transformers' head has
    no bias to cancel that with)."""
    features = encoder.preprocess(pairs)  # right-padded: a row's last real token ends its mask
    with torch.no_grad():
        states = model.model(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
        last = features["attention_mask"].sum(dim=1) - 1
        hidden = states.last_hidden_state[torch.arange(len(pairs)), last]  # [pairs, hidden]
        mean = hidden.mean(dim=0)
        row = torch.linalg.svd(hidden - mean).Vh[0]
        row -= (row @ mean) / (mean @ mean) * mean
        model.score.weight.copy_(2.0 * row[None] / (hidden @ row).std())


@pytest.fixture(scope="module", params=["chat-template", "text-pair"])
def seq_cls_dir(request, tmp_path_factory):
    """A one-label Qwen3ForSequenceClassification as transformers saves it (the "seq-cls" form of a Qwen3
    reranker, no sentence-transformers files): CrossEncoder renders its pairs through the tokenizer's chat
    template when it has one, else by the tokenizer's text-pair encoding."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoConfig, Qwen3Config, Qwen3ForSequenceClassification

    base = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "base", seed=5)
    config = AutoConfig.from_pretrained(base, num_labels=1)
    assert isinstance(config, Qwen3Config) and config.pad_token_id is not None  # CrossEncoder batches pad with it
    model = Qwen3ForSequenceClassification.from_pretrained(base, config=config, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    if request.param == "text-pair":
        tokenizer.chat_template = None
    path = tmp_path_factory.mktemp("m") / f"seq-cls-{request.param}"
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    pairs = [(QUERY, document) for document in SEQ_CLS_DOCUMENTS]
    _spread_scores(model, CrossEncoder(str(path), device="cpu"), pairs)
    model.save_pretrained(path)
    return path, CrossEncoder(str(path), device="cpu")


def test_a_seq_cls_checkpoint_reranks_as_cross_encoder_predicts(seq_cls_dir, tmp_path):
    path, encoder = seq_cls_dir
    want = encoder.predict([(QUERY, document) for document in SEQ_CLS_DOCUMENTS]).tolist()
    assert max(want) - min(want) > 0.6 and min(abs(a - b) for i, a in enumerate(want) for b in want[:i]) > 1e-3
    instruction = "Judge whether the document answers the query"
    prompted = encoder.predict([(QUERY, document) for document in SEQ_CLS_DOCUMENTS[:3]], prompt=instruction).tolist()
    srv = Server(path, "--task", "score", "--dtype", "float32", "--kv-cache-dtype", "float32",
                 log_path=tmp_path / "server.log")
    try:
        ranked = requests.post(f"{srv.url}/v1/rerank", json={"query": QUERY, "documents": SEQ_CLS_DOCUMENTS},
                               timeout=60).json()["results"]
        assert [r["index"] for r in ranked] == sorted(range(len(want)), key=lambda i: -want[i])
        assert [r["relevance_score"] for r in ranked] == pytest.approx([want[r["index"]] for r in ranked], abs=1e-4)
        scored = requests.post(f"{srv.url}/v1/score", json={"text_1": QUERY, "text_2": SEQ_CLS_DOCUMENTS[:3],
                                                            "instruction": instruction}, timeout=60).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(prompted, abs=1e-4)
    finally:
        assert srv.stop() == 0
