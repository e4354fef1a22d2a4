"""LoRA adapters in the worker: what an adapter this server cannot apply is refused with, how rows are
grouped per adapter, and that a layer adds each adapter's update only to its own rows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from crane_mp.cli import build_parser
from crane_mp.models.config import load_model_config
from crane_mp.scheduler.adapters import AdapterError, AdapterTable
from crane_mp.settings import SettingsError, read_config_file, settable_actions
from crane_mp.testing.make_model import make_model
from crane_mp.worker.step.forward_context import LoraBatch, lora_batch
from crane_mp.worker.weights.lora import LoraError, build_adapter, read_adapter
from tests.model_helpers import load_checkpoint

PREFIX = "base_model.model.model.layers.0."


def write_adapter(path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "q", seed=2)
    return load_checkpoint(load_model_config(path), path, torch.float32)


def test_lora_batch_groups_rows_by_adapter():
    assert lora_batch([0, 0, 0], torch.device("cpu")) is None
    assert lora_batch([2, 2], torch.device("cpu")).groups == [(2, None)]
    batch = lora_batch([1, 0, 2, 1], torch.device("cpu"))
    assert [(i, rows.tolist()) for i, rows in batch.groups] == [(1, [0, 3]), (2, [2])]


def test_each_adapter_updates_only_its_rows():
    x, out = torch.randn(4, 3, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.bfloat16)
    a1, b1, a2, b2 = torch.randn(3, 1), torch.randn(1, 2), torch.randn(3, 1), torch.randn(1, 2)  # A^T, B^T
    result = lora_batch([1, 0, 2, 1], torch.device("cpu")).apply(x, out, {1: (a1, b1), 2: (a2, b2)})
    assert result is out and result.dtype == torch.bfloat16  # in place, in the model's dtype
    expected = (x.float() @ a1) @ b1
    assert torch.allclose(result[[0, 3]].float(), expected[[0, 3]], atol=0.05)
    assert torch.equal(result[1], torch.zeros(2, dtype=torch.bfloat16))
    assert torch.allclose(result[2].float(), (x[2].float() @ a2) @ b2, atol=0.05)
    before = out.clone()
    assert torch.equal(LoraBatch([(3, None)]).apply(x, out, {1: (a1, b1)}), before)  # not this adapter's projection


def test_q_and_v_parts_land_in_their_rows_of_the_fused_projection(model, tmp_path):
    cfg = model.config
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.kv_size
    tensors = {PREFIX + "self_attn.q_proj.lora_A.weight": torch.randn(4, cfg.hidden_size),
               PREFIX + "self_attn.q_proj.lora_B.weight": torch.randn(q_out, 4),
               PREFIX + "self_attn.v_proj.lora_A.weight": torch.randn(4, cfg.hidden_size),
               PREFIX + "self_attn.v_proj.lora_B.weight": torch.randn(kv_out, 4)}
    write_adapter(tmp_path / "qv", {}, tensors)
    config, loaded = read_adapter(tmp_path / "qv", "qv", 64, 1 << 30)
    built = build_adapter(model, config, loaded, "qv", torch.float32, torch.device("cpu"))
    a_t, b_t = built[(0, "qkv_proj")]
    x = torch.randn(2, cfg.hidden_size)
    delta = (x @ a_t) @ b_t
    scaling = 8 / 4

    def part(name: str) -> torch.Tensor:
        a, b = (tensors[f"{PREFIX}self_attn.{name}.lora_{m}.weight"] for m in "AB")
        return (x @ a.t()) @ b.t()

    q_part, v_part = part("q_proj"), part("v_proj")
    assert torch.allclose(delta[:, :q_out], q_part * scaling, atol=1e-4)
    assert torch.equal(delta[:, q_out : q_out + kv_out], torch.zeros(2, kv_out))  # k is not adapted
    assert torch.allclose(delta[:, q_out + kv_out :], v_part * scaling, atol=1e-4)


@pytest.mark.parametrize("config,tensors,message", [
    ({"r": 128}, {}, "rank 128 is above --max-lora-rank 64"),
    ({"use_dora": True}, {}, "use_dora is not supported"),
    ({"peft_type": "IA3"}, {}, "its peft_type is not LORA"),
    ({"r": "8"}, {}, "needs a positive integer r"),
    ({"bias": "all"}, {}, "bias='none'"),
    ({}, {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 8),
          "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(8, 4)}, "not a supported target"),
    ({}, {PREFIX + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 7),
          PREFIX + "self_attn.q_proj.lora_B.weight": torch.zeros(7, 4)}, "an adapter for another model?"),
    ({}, {PREFIX + "mlp.down_proj.lora_A.weight": torch.zeros(4, 8)}, "no lora_B"),
])
def test_an_adapter_that_cannot_be_applied_is_refused_by_name(model, tmp_path, config, tensors, message):
    write_adapter(tmp_path / "bad", config, tensors or {"x.lora_A.weight": torch.zeros(1)})
    with pytest.raises(LoraError, match=message) as info:
        config_read, loaded = read_adapter(tmp_path / "bad", "bad", 64, 1 << 30)
        build_adapter(model, config_read, loaded, "bad", torch.float32, torch.device("cpu"))
    assert "'bad'" in str(info.value)


def test_a_missing_adapter_directory_is_named(tmp_path):
    with pytest.raises(LoraError, match="needs adapter_config.json"):
        read_adapter(tmp_path / "none", "none", 64, 1 << 30)


def test_what_is_read_is_capped_and_never_quoted(tmp_path):
    write_adapter(tmp_path / "big", {"r": 4}, {PREFIX + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 1000)})
    with pytest.raises(LoraError, match="take 16000 bytes, more than an adapter of rank --max-lora-rank"):
        read_adapter(tmp_path / "big", "big", 64, 15999)
    assert read_adapter(tmp_path / "big", "big", 64, 16000)[1][PREFIX + "self_attn.q_proj.lora_A.weight"].shape == (4, 1000)
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    (leaky / "adapter_model.safetensors").write_bytes(b"SECRET-BYTES" * 10)
    for config in ('{"peft_type": "SECRET-TYPE", "r": 4}', "SECRET-NOT-JSON", '["SECRET-LIST"]', '{"r": 4}'):
        (leaky / "adapter_config.json").write_text(config)
        with pytest.raises(LoraError) as info:
            read_adapter(leaky, "leaky", 64, 1 << 30)
        assert "SECRET" not in str(info.value) and "'leaky'" in str(info.value)


def test_lora_modules_from_a_config_file(tmp_path):
    actions = settable_actions(build_parser())
    good = tmp_path / "good.toml"
    good.write_text('lora-modules = ["sql=/adapters/sql", "/adapters/chat"]\n')
    modules = read_config_file(str(good), actions)["lora_modules"]
    assert modules == [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
    bad = tmp_path / "bad.toml"
    bad.write_text('lora-modules = ["=/x"]\n')
    with pytest.raises(SettingsError, match="--lora-modules"):
        read_config_file(str(bad), actions)


def test_the_scheduler_hands_out_fresh_ids_and_guards_unloads():
    table = AdapterTable((("a", "/a"),), max_loras=2)
    assert table.ids == {1} and [x.name for x in table.registry().adapters] == ["a"]
    b = table.reserve("b", "/b")
    with pytest.raises(AdapterError, match="already loaded"):
        table.reserve("b", "/b")  # a load of the same name is still on its way
    with pytest.raises(AdapterError, match="--max-loras"):
        table.reserve("c", "/c")
    table.finish_load(b, ok=True)
    with pytest.raises(AdapterError, match="in use by 3 requests"):
        table.remove("b", users=3)
    assert table.remove("b", users=0) == b
    with pytest.raises(AdapterError) as missing:
        table.remove("b", users=0)
    assert missing.value.status == 404
    again = table.reserve("b", "/b")
    assert again.lora_id == 3  # never the id of the adapter it replaces: no stale prefix-cache hits
    table.finish_load(again, ok=False)
    assert table.ids == {1} and table.pending == {}


def full_adapter(cfg, rank: int) -> dict[str, torch.Tensor]:
    """Every projection of every layer adapted at `rank`."""
    q_size = cfg.num_attention_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (cfg.hidden_size, q_size), "self_attn.k_proj": (cfg.hidden_size, cfg.kv_size),
              "self_attn.v_proj": (cfg.hidden_size, cfg.kv_size), "self_attn.o_proj": (q_size, cfg.hidden_size),
              "mlp.gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "mlp.up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "mlp.down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank)
    return tensors


def test_the_memory_plan_holds_room_for_every_adapter_that_may_still_be_loaded(tmp_path):
    from crane_mp.config import EngineConfig
    from crane_mp.engine import LLMEngine
    from crane_mp.worker.weights.lora import adapter_bytes, load_adapter

    path = make_model("qwen3", "tiny", tmp_path / "m", seed=2)
    write_adapter(tmp_path / "full", {"r": 8}, full_adapter(load_model_config(path), 8))
    base = LLMEngine(EngineConfig(model_path=str(path), max_num_seqs=4, dtype="float32"))
    cfg = base.worker.model_config
    taken = load_adapter(base.worker.runner.model, 1, "full", str(tmp_path / "full"), 8, torch.float32,
                         base.worker.platform)
    assert taken == adapter_bytes(cfg, 8, torch.float32)  # the estimate is what the largest adapter takes
    modules = (("full", str(tmp_path / "full")),)
    lora = LLMEngine(EngineConfig(model_path=str(path), max_num_seqs=4, dtype="float32", max_loras=3,
                                  max_lora_rank=8, lora_modules=modules, runtime_lora=True, lora_root=str(tmp_path)))
    # One adapter loaded at start, two more may come: their bytes are set aside.
    extra = lora.worker.kv_plan.reserved_bytes - base.worker.kv_plan.reserved_bytes
    assert extra == 2 * adapter_bytes(cfg, 8, torch.float32)
    # Without run-time loading no more can come: nothing is set aside.
    fixed = LLMEngine(EngineConfig(model_path=str(path), max_num_seqs=4, dtype="float32", max_loras=3,
                                   max_lora_rank=8, lora_modules=modules))
    assert fixed.worker.kv_plan.reserved_bytes == base.worker.kv_plan.reserved_bytes


def test_an_adapter_some_tensor_parallel_rank_could_not_load_is_kept_by_none(model, tmp_path):
    from crane_mp.protocol import LoadLora, LoraAdapter
    from crane_mp.worker.step.background import load_lora
    from tests.model_helpers import CPU

    write_adapter(tmp_path / "full", {}, full_adapter(model.config, 4))
    message = LoadLora(token=1, frontend_id=0, adapter=LoraAdapter(lora_id=5, name="full", path=str(tmp_path / "full")))
    votes = []

    def another_rank_failed(loaded: bool) -> bool:
        votes.append(loaded)
        return False

    answer = load_lora(model, message, 64, torch.float32, CPU, another_rank_failed)
    assert votes == [True] and "every tensor-parallel rank" in answer.error
    assert all(5 not in layer.self_attn.lora_qkv_proj for layer in model.model.layers)
    answer = load_lora(model, message, 64, torch.float32, CPU, lambda loaded: loaded)
    assert not answer.error and all(5 in layer.self_attn.lora_qkv_proj for layer in model.model.layers)
