"""Multi-token prediction (--speculative-method mtp) on DeepSeek-V3's and GLM-4.5's prediction layer: every
proposal is the one the layer makes when computed from scratch with transformers' own decoder layer of
the family and the target's final hidden states (as vLLM and SGLang feed it), and the tokens are those
without speculation, under preemption too."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_zoo import make_zoo_model

FAMILIES = ["deepseek_v3", "glm4_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {family: make_zoo_model(family, root / family, seed=4, prediction_layer=True) for family in FAMILIES}


def engine(path, total_tokens: int = 1024, **kwargs) -> LLMEngine:
    # float32 KV: a 16-bit cache can round a prefix recomputed after preemption unlike the decoded one.
    return LLMEngine(EngineConfig(model_path=str(path), dtype="float32", kv_cache_dtype="float32", force_cpu=True,
                                  max_model_len=128, max_total_tokens=total_tokens, max_num_seqs=8, **kwargs))


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (21, 6, 37, 12, 29, 3)]


class Reference:
    """The prediction layer computed from scratch: transformers' target for the final hidden states, and
    transformers' decoder layer of the family (loaded as layer N of an (N + 1)-layer model) over every
    row, each row i reading token i + 1's embedding (none at position 0) and hidden state i."""

    def __init__(self, path) -> None:
        self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.target.config
        self.index = config.num_hidden_layers
        longer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                      num_hidden_layers=self.index + 1).eval()
        self.layer, self.rotary = longer.model.layers[self.index], longer.model.rotary_emb
        norm_class = type(self.target.model.norm)
        prefix = f"model.layers.{self.index}."
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            tensors = {name: f.get_tensor(prefix + name) for name in
                       ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")}
        self.enorm, self.hnorm, self.head_norm = (norm_class(config.hidden_size, config.rms_norm_eps)
                                                  for _ in range(3))
        self.enorm.weight.data = tensors["enorm.weight"]
        self.hnorm.weight.data = tensors["hnorm.weight"]
        self.head_norm.weight.data = tensors["shared_head.norm.weight"]
        self.eh_proj = tensors["eh_proj.weight"]

    @torch.inference_mode()
    def proposals(self, tokens: list[int], proposed: list[int]) -> list[int]:
        """The layer's greedy guesses after `tokens`, each further one after the proposal before it."""
        ids = torch.tensor(tokens)
        hidden = self.target.model(ids[None]).last_hidden_state[0, :-1]  # after the final norm
        embed = self.target.model.embed_tokens
        embeds = embed(ids[1:])
        embeds[0] = 0
        guesses = []
        for depth in range(len(proposed)):
            rows = embeds.shape[0]
            x = torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1) @ self.eh_proj.T
            positions = torch.arange(rows)[None]
            mask = torch.full((rows, rows), float("-inf")).triu(1)[None, None]
            out = self.layer(x[None], attention_mask=mask, position_ids=positions,
                             position_embeddings=self.rotary(x[None], positions))
            last = (out[0] if isinstance(out, tuple) else out)[0, -1]
            guesses.append(int(self.target.lm_head(self.head_norm(last)).argmax()))
            embeds = torch.cat([embeds, embed(torch.tensor(proposed[depth : depth + 1]))])
            hidden = torch.cat([hidden, last[None]])
        return guesses


def recorded(eng: LLMEngine) -> list[tuple[list[int], list[int]]]:
    """(known tokens, proposals) of every request each time the proposer proposes."""
    proposer = eng.worker.runner.proposer
    calls, propose = [], proposer.propose

    def record(batch):
        out = propose(batch)
        calls.extend((list(tokens), out[req_id]) for req_id, tokens, _, _ in batch if out[req_id])
        return out

    proposer.propose = record
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_each_proposal_is_the_prediction_layer_s_from_scratch(checkpoints, family):
    path = checkpoints[family]
    want = engine(path).generate(prompts(), GREEDY)
    eng = engine(path, speculative_method="mtp", speculative_num_tokens=3, speculative_disable_batch_size=32)
    calls = recorded(eng)
    assert eng.generate(prompts(), GREEDY) == want
    assert len(calls) > 5 and any(len(proposed) == 3 for _, proposed in calls)
    reference = Reference(path)
    for tokens, proposed in calls:
        assert reference.proposals(tokens, proposed) == proposed, len(tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_under_preemption_the_tokens_and_proposals_stay_the_layer_s(checkpoints, family):
    """160 KV tokens hold few of the requests at once: preempted requests recompute their prompt, which
    feeds the layer again."""
    path = checkpoints[family]
    want = engine(path).generate(prompts(), GREEDY)
    eng = engine(path, total_tokens=160, speculative_method="mtp", speculative_num_tokens=2,
                 speculative_disable_batch_size=32)
    calls = recorded(eng)
    assert eng.generate(prompts(), GREEDY) == want
    assert eng.scheduler.num_preemptions > 0
    reference = Reference(path)
    for tokens, proposed in calls[::3]:
        assert reference.proposals(tokens, proposed) == proposed, len(tokens)
