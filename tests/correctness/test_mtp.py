"""Multi-token prediction (--speculative-method mtp) on the prediction layer of DeepSeek-V3, GLM-4.5, Qwen3.5
and Qwen3-Next (a hybrid: its linear-attention layers verify too): every
proposal is the one the layer makes when computed from scratch with transformers' own decoder layer of
the family and the target's final hidden states (as vLLM and SGLang feed it), and the tokens are those
without speculation, under preemption too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llguidance import LLMatcher
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_zoo import NEXTN_FAMILIES, make_zoo_model
from tests.llama_cpp import CONVERTER, Converter

FAMILIES = ["deepseek_v3", "glm4_moe", "qwen3_5_text", "qwen3_next"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class _Checkpoints(dict):
    """family -> its tiny checkpoint with a prediction layer, each written on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        self[family] = make_zoo_model(family, self.root / family, seed=4, prediction_layer=True)
        return self[family]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("mtp"))


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
    row, each row i reading token i + 1's embedding (none at position 0: DeepSeek's reference inference)
    and hidden state i; a further guess reads the layer's output (Qwen's after its last norm)."""

    def __init__(self, path: Path, family: str, tmp_path: Path) -> None:
        self.nextn = family in NEXTN_FAMILIES
        self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = self.target.config
        self.index = config.num_hidden_layers
        longer = AutoModelForCausalLM.from_pretrained(self._longer(path, tmp_path), dtype=torch.float32,
                                                      attn_implementation="eager").eval()
        self.layer, self.rotary = longer.model.layers[self.index], longer.model.rotary_emb
        prefix, names = ((f"model.layers.{self.index}.", ("enorm", "hnorm", "eh_proj", "shared_head.norm"))
                         if self.nextn else ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")))
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            enorm, hnorm, self.eh_proj, head_norm = (f.get_tensor(f"{prefix}{name}.weight") for name in names)
        self.enorm, self.hnorm, self.head_norm = (type(self.target.model.norm)(config.hidden_size, config.rms_norm_eps)
                                                  for _ in range(3))
        for norm, weight in ((self.enorm, enorm), (self.hnorm, hnorm), (self.head_norm, head_norm)):
            norm.weight.data = weight

    def _longer(self, path: Path, tmp_path: Path) -> Path:
        """The checkpoint with its prediction layer as one more decoder layer, full attention."""
        out = tmp_path / "longer"
        out.mkdir()
        for item in path.iterdir():
            if item.is_file() and item.suffix != ".safetensors":
                (out / item.name).write_bytes(item.read_bytes())
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = self.index + 1
        if config.get("layer_types"):
            config["layer_types"] = [*config["layer_types"], "full_attention"]
        (out / "config.json").write_text(json.dumps(config))
        layer = f"model.layers.{self.index}."
        state = {(layer + name[len("mtp.layers.0."):] if name.startswith("mtp.layers.0.") else name): tensor
                 for name, tensor in load_file(str(path / "model.safetensors")).items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    @torch.inference_mode()
    def proposals(self, tokens: list[int], proposed: list[int]) -> list[int]:
        """The layer's greedy guesses after `tokens`, each further one after the proposal before it."""
        ids = torch.tensor(tokens)
        hidden = self.target.model(ids[None]).last_hidden_state[0, :-1]  # after the final norm
        embed = self.target.model.embed_tokens
        embeds = embed(ids[1:])
        if self.nextn:
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
            hidden = torch.cat([hidden, (last if self.nextn else self.head_norm(last))[None]])
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
def test_each_proposal_is_the_prediction_layer_s_from_scratch(checkpoints, family, tmp_path):
    path = checkpoints[family]
    want = engine(path).generate(prompts(), GREEDY)
    eng = engine(path, speculative_method="mtp", speculative_num_tokens=3, speculative_disable_batch_size=32)
    calls = recorded(eng)
    assert eng.generate(prompts(), GREEDY) == want
    assert len(calls) > 5 and any(len(proposed) == 3 for _, proposed in calls)
    reference = Reference(path, family, tmp_path)
    for tokens, proposed in calls:
        assert reference.proposals(tokens, proposed) == proposed, len(tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_under_preemption_the_tokens_and_proposals_stay_the_layer_s(checkpoints, family, tmp_path):
    """160 KV tokens hold few of the requests at once: preempted requests recompute their prompt, which
    feeds the layer again."""
    path = checkpoints[family]
    want = engine(path).generate(prompts(), GREEDY)
    eng = engine(path, total_tokens=160, speculative_method="mtp", speculative_num_tokens=2,
                 speculative_disable_batch_size=32)
    calls = recorded(eng)
    assert eng.generate(prompts(), GREEDY) == want
    assert eng.scheduler.num_preemptions > 0
    reference = Reference(path, family, tmp_path)
    for tokens, proposed in calls[::3]:
        assert reference.proposals(tokens, proposed) == proposed, len(tokens)


def test_mixed_requests_under_preemption_gain_the_tokens_they_gain_without_it(checkpoints):
    """Greedy with min_tokens, stop tokens, seeded sampling with a repetition penalty and logprobs, and a
    regex grammar, 16 at once in a KV cache that holds a few: the tokens and logprobs without speculation."""
    path = checkpoints["qwen3_next"]
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(4, 40, (16,), generator=gen).tolist()
    batch = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    free = engine(path).generate(batch, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    regex = LLMatcher.grammar_from_regex(r"(yes|no)-[0-9]{2,3}")
    params = [[SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4),
               SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[free[i][5]], ignore_eos=True),
               SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20, repetition_penalty=1.2, logprobs=3,
                              ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=20, grammar=regex)][i % 4] for i in range(len(batch))]

    def run(eng: LLMEngine):
        ids = [eng.add_request(prompt, p) for prompt, p in zip(batch, params)]
        tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
        while eng.has_work:
            for out in eng.step():
                tokens[out.rid] += out.new_token_ids
                logprobs[out.rid] += out.logprobs
        return [tokens[i] for i in ids], [logprobs[i] for i in ids]

    want, want_logprobs = run(engine(path, total_tokens=96))
    eng = engine(path, total_tokens=96, speculative_method="mtp", speculative_num_tokens=4,
                 speculative_disable_batch_size=32)
    got, got_logprobs = run(eng)
    assert got == want
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.spec.counters.draft_tokens > 0
    for row, p in enumerate(params):
        if p.logprobs is not None:
            torch.testing.assert_close([lp.logprob for lp in got_logprobs[row]],
                                       [lp.logprob for lp in want_logprobs[row]], atol=1e-4, rtol=0)
        if p.stop_token_ids:
            assert got[row][-1] == p.stop_token_ids[0]


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not installed (../shared/peers)")
@pytest.mark.parametrize("family", ["qwen3_5_moe_text"])
def test_llama_cpp_s_conversion_keeps_the_prediction_layer_and_it_proposes_as_the_checkpoint_s(
        checkpoints, family, tmp_path):
    """llama.cpp's converter writes the layer as the block past the last (`blk.{n}.*`, its own parts as
    `blk.{n}.nextn.*`): the GGUF target leaves it alone, and --speculative-method mtp proposes from it
    what the checkpoint's layer does, on the same tokens."""
    path = checkpoints[family]
    converter = Converter()
    try:
        gguf = converter(path, "f32", tmp_path / f"{family}.gguf")
    finally:
        converter.close()
    want = engine(path).generate(prompts(), GREEDY)
    assert engine(gguf).generate(prompts(), GREEDY) == want
    eng = engine(gguf, speculative_method="mtp", speculative_num_tokens=3, speculative_disable_batch_size=32)
    calls = recorded(eng)
    assert eng.generate(prompts(), GREEDY) == want
    assert len(calls) > 5
    reference = Reference(path, family, tmp_path)
    for tokens, proposed in calls:
        assert reference.proposals(tokens, proposed) == proposed, len(tokens)
