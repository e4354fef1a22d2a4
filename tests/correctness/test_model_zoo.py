"""The 2026 model families against transformers: tiny checkpoints from transformers' own config classes
(both layer kinds of each attention pattern, windows the prompts cross), greedy tokens equal to
transformers' generate natively where we have the family and through the transformers backend for all,
also under preemption with the prefix cache on and with chunked prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from crane_mp.config import EngineConfig
from crane_mp.engine import LLMEngine
from crane_mp.models.config import (
    UnsupportedModelError,
    checkpoint_architecture,
    detect_arch,
    load_model_config,
)
from crane_mp.models.kv_groups import FULL
from crane_mp.models.registry import MODEL_TYPE_ALIASES
from crane_mp.protocol import SamplingParams
from crane_mp.testing.make_zoo import FAMILIES, WINDOW, build_zoo_config, make_mxfp4_experts, make_zoo_model
from tests.model_helpers import (
    ZOO_PROMPT_LENGTHS,
    load_checkpoint,
    prefill_logits,
    transformers_greedy,
    zoo_references,
)

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
NATIVE = sorted(f for f in FAMILIES if f in MODEL_TYPE_ALIASES)  # the rest: transformers backend only


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return zoo_references(tmp_path_factory.mktemp("zoo"), NUM_TOKENS)


def engine(path, impl: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("max_num_seqs", 32)
    return LLMEngine(EngineConfig(model_path=str(path), dtype="float32", force_cpu=True, kv_cache_dtype="float32",
                                  model_impl=impl, **kwargs))


def test_only_the_families_without_native_code_need_the_backend():
    assert set(FAMILIES) - set(NATIVE) == {"ernie4_5", "starcoder2"}


# Families whose attention transformers' code computes in a way our paged attention does not hold.
# Latent attention's keys and values of other shapes; linear-attention layers' recurrent state.
BACKEND_REFUSED = {"deepseek_v2": "latent attention", "deepseek_v3": "latent attention",
                   **dict.fromkeys(["qwen3_5", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"], "recurrent state")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_transformers_backend_gives_transformers_greedy_tokens(zoo, family):
    path, prompts, expected = zoo(family)
    if family in BACKEND_REFUSED:
        with pytest.raises(UnsupportedModelError, match=BACKEND_REFUSED[family]):
            engine(path, "transformers")
        return
    eng = engine(path, "transformers")
    assert eng.worker.model_config.arch == "transformers"
    assert eng.generate(prompts, GREEDY) == expected
    assert eng.scheduler.num_free_blocks == eng.worker.kv_plan.num_blocks


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_under_preemption_chunking_and_the_prefix_cache_tokens_stay_exact(zoo, family):
    path, prompts, expected = zoo(family)
    impl = "native" if family in NATIVE else "transformers"
    tight = engine(path, impl, max_num_seqs=6, max_total_tokens=96, max_num_batched_tokens=16,
                   enable_prefix_caching=True)
    shared = [prompts[2][:20] + p for p in prompts[:3]]  # a common prefix the cache serves the later ones
    assert tight.generate(prompts, GREEDY) == expected
    assert tight.scheduler.num_preemptions > 0
    with_prefix = tight.generate(shared, GREEDY)
    assert with_prefix == engine(path, impl).generate(shared, GREEDY)
    assert tight.scheduler.num_free_blocks == tight.worker.kv_plan.num_blocks


@pytest.mark.parametrize("family", NATIVE)
def test_each_2026_family_runs_natively_with_transformers_greedy_tokens(zoo, family):
    path, prompts, expected = zoo(family)
    assert checkpoint_architecture(path).name != "transformers"
    eng = engine(path, "auto")
    assert eng.worker.model_config.arch != "transformers"
    assert eng.generate(prompts, GREEDY) == expected


MOE = ["deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "granitemoe", "mixtral", "olmoe", "qwen2_moe",
       "qwen3_moe", "qwen3_5_moe_text", "qwen3_next"]


@pytest.mark.parametrize("family", MOE)
def test_experts_load_from_the_stacked_names_transformers_keeps_in_memory(zoo, family, tmp_path):
    """transformers 5 stacks a layer's experts ([experts, 2 x intermediate, hidden]); a checkpoint of
    its model's own state dict has them so, and serves the same tokens as the per-expert one."""
    from safetensors.torch import save_file

    path, prompts, expected = zoo(family)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    stacked = {name: tensor.contiguous() for name, tensor in hf.state_dict().items() if name != "lm_head.weight"
               or not hf.config.tie_word_embeddings}
    assert any(tensor.dim() == 3 for tensor in stacked.values())
    for item in path.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            (tmp_path / item.name).write_bytes(item.read_bytes())
    save_file(stacked, tmp_path / "model.safetensors", metadata={"format": "pt"})
    eng = engine(tmp_path, "native")
    assert eng.worker.model_config.layout.experts is not None
    assert eng.generate(prompts, GREEDY) == expected


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_s_kv_cache_keeps_each_token_s_latent_alone(zoo, family):
    """Latent attention's cache: one row per token and layer, the latent and the rope key part (40
    values here), in one tensor that is both the keys and the values; full heads would take 4 x 28 x 2."""
    path, prompts, expected = zoo(family)
    eng = engine(path, "auto")
    runner = eng.worker.runner
    latent = eng.worker.model_config.layout.latent
    assert runner.kv_bytes_per_token() == 4 * (latent.kv_rank + latent.rope_dim) * 4  # 4 layers, float32
    attention = runner.model.model.layers[0].self_attn
    assert attention.k_cache is attention.v_cache
    assert eng.generate(prompts, GREEDY) == expected


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_released_checkpoint_s_prediction_layer_past_the_last_is_not_served(zoo, family, tmp_path):
    """DeepSeek-V3 and GLM-4.5 checkpoints carry a next-token-prediction layer after the config's layers
    (transformers leaves it unloaded): it is skipped, the tokens unchanged."""
    from safetensors.torch import load_file, save_file

    path, prompts, expected = zoo(family)
    for item in path.iterdir():
        if item.is_file():
            (tmp_path / item.name).write_bytes(item.read_bytes())
    state = load_file(str(path / "model.safetensors"))
    state |= {name.replace("layers.3.", "layers.4."): tensor.clone() for name, tensor in state.items()
              if "layers.3." in name}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert engine(tmp_path, "auto").generate(prompts, GREEDY) == expected


def test_glm4_5_s_optional_query_key_norms_give_transformers_tokens(tmp_path):
    path = make_zoo_model("glm4_moe", tmp_path / "glm4_moe", overrides={"use_qk_norm": True})
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in ZOO_PROMPT_LENGTHS[:3]]
    eng = engine(path, "native")
    assert eng.worker.model_config.layout.qk_norm
    assert eng.generate(prompts, GREEDY) == transformers_greedy(path, prompts, NUM_TOKENS)


def test_gpt_oss_mxfp4_experts_stay_mxfp4_and_give_the_dequantized_checkpoint_s_tokens(tmp_path):
    """The released gpt-oss form: experts as MXFP4 blocks, kept as GGUF MXFP4 rows (17 bytes a block of
    32). With float activations the kernels multiply the blocks' exact values: transformers' tokens on
    the dequantized checkpoint; with 8-bit ones, the prompts' first tokens."""
    from crane_mp.worker.quantized.layers import GGUFExperts

    reference = make_zoo_model("gpt_oss", tmp_path / "reference")
    released = make_mxfp4_experts(reference, tmp_path / "mxfp4")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in ZOO_PROMPT_LENGTHS]
    expected = transformers_greedy(reference, prompts, NUM_TOKENS)
    exact = engine(released, "auto", quantized_activations="float")
    experts = exact.worker.runner.model.model.layers[0].mlp.experts
    config = exact.worker.model_config
    hidden, width = config.hidden_size, config.layout.experts.intermediate_size
    assert isinstance(experts, GGUFExperts) and experts.gate_up_types == [39] and experts.down_type == 39
    assert experts.qweight_0.numel() + experts.qweight_1.numel() == 8 * 3 * hidden * width // 32 * 17
    assert exact.generate(prompts, GREEDY) == expected
    int8 = engine(released, "auto").generate(prompts, GREEDY)
    assert [tokens[0] for tokens in int8] == [tokens[0] for tokens in expected]


def test_each_step_reports_the_tokens_it_routed_to_each_expert(zoo):
    """/metrics' load balance: a step's tokens per expert (StepResult.expert_tokens) add up to every
    token the step computed, top_k times in each layer with experts (qwen3_moe's zoo: 3 of 4)."""
    path, prompts, expected = zoo("qwen3_moe")
    eng = engine(path, "auto", max_num_seqs=8, max_num_batched_tokens=16)
    runner = eng.worker.runner
    results = []
    execute = runner.execute
    runner.execute = lambda plan: results.append(execute(plan)) or results[-1]
    assert eng.generate(prompts, GREEDY) == expected
    routed = [sum(result.expert_tokens) for result in results]
    computed = sum(len(prompt) + NUM_TOKENS - 1 for prompt in prompts)
    layout = eng.worker.model_config.layout
    sparse = sum(layout.sparse(layer) for layer in range(eng.worker.model_config.num_hidden_layers))
    assert sparse == 3 and sum(routed) == computed * layout.experts.top_k * sparse
    assert all(len(result.expert_tokens) == layout.experts.num_experts for result in results if result.expert_tokens)


def test_lora_adapters_on_experts_are_refused_by_name(zoo):
    path, _, _ = zoo("qwen3_moe")
    with pytest.raises(ValueError, match=r"LoRA adapters for qwen3_moe \(mixture-of-experts layers\)"):
        engine(path, "auto", enable_lora=True)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"task": "embed"}, "--task embed needs a native implementation"),
    ({"enable_lora": True}, "LoRA adapters need a native implementation"),
])
def test_what_the_transformers_backend_does_not_serve_is_refused_at_start(zoo, kwargs, message):
    path, _, _ = zoo("ernie4_5")
    with pytest.raises(ValueError, match=message):
        engine(path, "auto", **kwargs)


# Gemma 4's released sizes take its options apart: the E models per-layer inputs and shared KV, the
# large ones global layers whose values are their keys (no per-layer inputs, no sharing).
@pytest.mark.parametrize("overrides", [
    {"attention_k_eq_v": False, "num_global_key_value_heads": None, "use_double_wide_mlp": False},
    {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "final_logit_softcapping": None},
])
def test_each_gemma4_variant_gives_transformers_logits_and_caches_only_its_own_layers(tmp_path, overrides):
    path = make_zoo_model("gemma4_text", tmp_path, overrides=overrides)
    config = load_model_config(path)
    model = load_checkpoint(config, path, torch.float32)
    prompt = torch.randint(3, 500, (ZOO_PROMPT_LENGTHS[2],), generator=torch.Generator().manual_seed(1)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    ours = prefill_logits(model, prompt)
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-3)  # float32 summation order only
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    shared = overrides.get("num_kv_shared_layers", FAMILIES["gemma4_text"]["num_kv_shared_layers"])
    assert len(model.attention_layers()) == config.num_hidden_layers - shared


# Global rows wider than the sliding ones (E2B: one KV head of 512 beside 256) or narrower (31B: 4 global
# KV heads beside 16 sliding ones): either way one page size, the sliding layers keep only their window.
@pytest.mark.parametrize("global_head_dim", [64, 16])
def test_gemma4_s_sliding_layers_keep_only_their_window_whatever_its_global_rows(tmp_path, global_head_dim):
    path = make_zoo_model("gemma4_text", tmp_path, overrides={"global_head_dim": global_head_dim})
    gen = torch.Generator().manual_seed(global_head_dim)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in ZOO_PROMPT_LENGTHS]
    expected = transformers_greedy(path, prompts, NUM_TOKENS)
    tight = engine(path, "auto", max_num_seqs=6, max_total_tokens=96, max_num_batched_tokens=16,
                   enable_prefix_caching=True)
    runner = tight.worker.runner
    sliding_row, global_row = 2 * 16, global_head_dim  # the zoo's 2 KV heads of 16; one global head
    assert runner.kv_groups.windows == (FULL, WINDOW)
    assert runner.kv_groups.scales == (max(sliding_row, global_row) // global_row,
                                       max(sliding_row, global_row) // sliding_row)
    # Past the window a token keeps the global layer's page only (the wider row of the two), not both.
    assert runner.kv_bytes_per_long_token() == 2 * 4 * max(sliding_row, global_row)
    assert tight.generate(prompts, GREEDY) == expected
    assert tight.scheduler.num_preemptions > 0
    shared = [prompts[2][:20] + p for p in prompts[:3]]
    assert tight.generate(shared, GREEDY) == engine(path, "auto", enable_prefix_caching=False).generate(shared, GREEDY)
    assert tight.scheduler.num_free_blocks == tight.worker.kv_plan.num_blocks


def test_gemma4_mixture_of_experts_runs_through_the_backend_and_lora_is_refused(zoo):
    moe = build_zoo_config("gemma4_text", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                           "moe_intermediate_size": 32})
    assert detect_arch(moe) == "transformers"
    with pytest.raises(UnsupportedModelError, match="gemma4 checkpoint with Gemma 4's mixture-of-experts layers: "
                                                    "not implemented natively yet"):
        detect_arch(moe, model_impl="native")
    assert detect_arch(build_zoo_config("gemma4_text")) == "gemma4"
    path, _, _ = zoo("gemma4_text")
    with pytest.raises(ValueError, match=r"LoRA adapters for gemma4 \(layers of different shapes\) are not supported"):
        engine(path, "auto", enable_lora=True)


def test_gemma4_s_sharing_layers_compute_only_the_rows_a_step_reads(zoo):
    """The layers that read other layers' KV write none: a step runs them on the rows it samples from
    alone (a finished prompt's last row, the decodes), each as a decode over its cache, and none for a
    chunk that ends mid-prompt; the tokens stay transformers'."""
    path, prompts, expected = zoo("gemma4_text")
    eng = engine(path, "auto", max_num_seqs=8, max_num_batched_tokens=16)  # chunked: steps finishing no prompt
    model = eng.worker.runner.model.model
    assert 0 < model.first_sharing < len(model.layers)
    seen: dict[str, list[int]] = {"caching": [], "sharing": []}
    hooks = [layer.register_forward_pre_hook(lambda _, args, kind=kind: seen[kind].append(args[0].shape[0]))
             for kind, layer in (("caching", model.layers[0]), ("sharing", model.layers[model.first_sharing]))]
    try:
        assert eng.generate(prompts, GREEDY) == expected
    finally:
        for hook in hooks:
            hook.remove()
    assert max(seen["caching"]) == 16 and max(seen["sharing"]) <= len(prompts)
    assert len(seen["sharing"]) < len(seen["caching"])  # steps of prompt chunks alone skip them
