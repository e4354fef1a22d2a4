"""What each tensor-parallel rank holds (sharding.py) and how its tensors are cut: checked against the
whole model's tensors, without starting ranks (tests/integration/test_tensor_parallel.py runs them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as T

from crane_mp.config import EngineConfig
from crane_mp.models.config import ModelConfig
from crane_mp.models.layouts import DecoderLayout, ExpertLayout
from crane_mp.models.sharding import make_shard, shard_config
from crane_mp.parallel import ParallelConfig
from crane_mp.testing.kquants import quantize_q4_k
from crane_mp.worker.models.layers import shard_tensor
from crane_mp.worker.quantized.formats import dequantize
from crane_mp.worker.quantized.gguf_loader import _shard_rows
from crane_mp.worker.weights.lora import LoraError, _rank_part


def config(heads=8, kv_heads=2, head_dim=4, intermediate=48, vocab=100, arch="qwen3") -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=vocab, hidden_size=32, intermediate_size=intermediate,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-6, max_position_embeddings=64,
                       tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
                       rope_theta=10000.0)


def cut(size: int, name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    return [shard_tensor(make_shard(cfg, rank, size), name, tensor) for rank in range(size)]


@pytest.mark.parametrize("size", [2, 4])
def test_column_and_row_parallel_parts_put_together_are_the_whole(size):
    cfg = config()
    q = torch.randn(8 * 4, 32)
    assert torch.equal(torch.cat(cut(size, "model.layers.0.self_attn.q_proj.weight", q, cfg)), q)
    gate = torch.randn(48, 32)
    assert torch.equal(torch.cat(cut(size, "model.layers.1.mlp.gate_proj.weight", gate, cfg)), gate)
    o = torch.randn(32, 8 * 4)
    assert torch.equal(torch.cat(cut(size, "model.layers.0.self_attn.o_proj.weight", o, cfg), dim=1), o)
    down = torch.randn(32, 48)
    x = torch.randn(3, 48)
    # Row-parallel: each rank multiplies its columns of the input; the sum is the whole product.
    parts = cut(size, "model.layers.0.mlp.down_proj.weight", down, cfg)
    width = 48 // size
    total = sum(x[:, r * width : (r + 1) * width] @ part.T for r, part in enumerate(parts))
    torch.testing.assert_close(total, x @ down.T)
    norm = torch.randn(32)
    assert all(torch.equal(part, norm) for part in cut(size, "model.layers.0.input_layernorm.weight", norm, cfg))


def test_a_row_parallel_bias_is_added_once():
    bias = torch.randn(32)
    parts = cut(2, "model.layers.0.self_attn.o_proj.bias", bias, config())
    assert torch.equal(parts[0], bias) and torch.equal(parts[1], torch.zeros(32))
    q_bias = torch.randn(32)
    assert torch.equal(torch.cat(cut(2, "model.layers.0.self_attn.q_proj.bias", q_bias, config())), q_bias)


def test_fewer_kv_heads_than_ranks_each_rank_keeps_the_one_its_queries_read():
    cfg = config(heads=8, kv_heads=2)
    shards = [make_shard(cfg, rank, 4) for rank in range(4)]
    assert [s.heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Query head h reads KV head h // (heads / kv_heads) = h // 4.
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    k = torch.arange(2 * 4 * 32, dtype=torch.float32).view(8, 32)
    parts = cut(4, "model.layers.0.self_attn.k_proj.weight", k, cfg)
    assert torch.equal(parts[1], k[:4]) and torch.equal(parts[2], k[4:])
    local = shard_config(cfg, 3, 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 12)
    assert local.vocab_size == cfg.vocab_size and local.hidden_size == cfg.hidden_size


def test_the_vocabulary_splits_into_equal_padded_rows():
    cfg = config(vocab=100)
    shards = [make_shard(cfg, rank, 2) for rank in range(2)]
    assert [s.vocab for s in shards] == [(0, 64), (64, 100)] and {s.vocab_rows for s in shards} == {64}
    table = torch.randn(100, 32)
    first, last = cut(2, "model.embed_tokens.weight", table, cfg)
    assert torch.equal(first, table[:64])
    assert last.shape == (64, 32) and torch.equal(last[:36], table[64:]) and not last[36:].any()
    assert torch.equal(torch.cat([first, last])[:100], table)
    # More ranks than rows of the last share: it holds none and only padding.
    tiny = make_shard(config(vocab=20), 3, 4)
    assert tiny.vocab == (20, 20) and tiny.vocab_rows == 16


@pytest.mark.parametrize("kwargs, size, message", [
    ({"heads": 6}, 4, "6 attention heads"),
    ({"kv_heads": 3, "heads": 6}, 2, "3 KV heads"),
    ({"intermediate": 50}, 4, "50 MLP units"),
    ({"arch": "bert"}, 2, "decoder models"),
    ({"arch": "qwen2_5_vl"}, 2, "qwen2_5_vl .its image encoder"),
    ({"arch": "whisper"}, 2, "whisper .its audio encoder"),
    ({"arch": "olmo2"}, 2, "not validated for olmo2"),
    ({"arch": "gemma3"}, 2, "not validated for gemma3"),
])
def test_a_size_that_does_not_split_the_model_is_refused_by_name(kwargs, size, message):
    with pytest.raises(ValueError, match=message):
        make_shard(config(**kwargs), 0, size)


def test_mixtures_of_experts_are_refused_by_name_with_the_reason():
    experts = dataclasses.replace(config(arch="qwen3_moe"), layout=DecoderLayout(experts=ExpertLayout(8, 2, 16)))
    with pytest.raises(ValueError, match="does not shard qwen3_moe's mixture-of-experts layers"):
        make_shard(experts, 0, 2)


def test_gguf_rows_split_by_whole_rows_or_whole_blocks_else_become_float32():
    shard = make_shard(config(heads=8, head_dim=64, intermediate=512), 1, 2)
    q8 = torch.randint(0, 255, (512, 34), dtype=torch.uint8)  # 512 rows of one Q8_0 block
    qtype, rows = _shard_rows(shard, "blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", q8, T.Q8_0)
    assert qtype == T.Q8_0 and torch.equal(rows, q8[256:])
    q4k = torch.from_numpy(quantize_q4_k(torch.randn(32, 512).numpy()))  # [32, 2 blocks of 144 bytes]
    qtype, cols = _shard_rows(shard, "blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", q4k, T.Q4_K)
    assert qtype == T.Q4_K and torch.equal(cols, q4k[:, 144:])
    # 256 units split in two cut each Q4_K block: that rank's columns, dequantized, exactly.
    cut_shard = make_shard(config(heads=8, head_dim=32, intermediate=256), 1, 2)
    q4k = q4k[:, :144]
    qtype, cols = _shard_rows(cut_shard, "blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", q4k, T.Q4_K)
    assert qtype == T.F32
    assert torch.equal(cols.view(torch.float32), dequantize(q4k, T.Q4_K, 256)[:, 128:])


def test_lora_parts_follow_their_projection_and_refuse_another_models_shapes():
    cfg = config()
    shard = make_shard(cfg, 1, 2)
    a, b = torch.randn(4, 32), torch.randn(32, 4)
    a_q, b_q = _rank_part(shard, "q_proj", a, b, "x")
    assert a_q is a and torch.equal(b_q, b[16:])
    a_o, b_o = _rank_part(shard, "o_proj", torch.randn(4, 32), b, "x")
    assert a_o.shape == (4, 16) and b_o is b
    with pytest.raises(LoraError, match="another model"):
        _rank_part(shard, "gate_proj", a, torch.randn(40, 4), "x")


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple of --nnodes"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "needs --dist-init-addr"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank"),
    ({"tensor_parallel_size": 2, "dist_init_addr": "nohost"}, "HOST:PORT"),
    ({"tensor_parallel_size": 0}, "at least 1"),
])
def test_parallel_layouts_that_cannot_start_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_each_node_runs_its_share_of_the_ranks_and_meets_where_told(tmp_path):
    layout = ParallelConfig(4, 2, 1, "10.0.0.1:5000")
    assert list(layout.local_ranks) == [2, 3] and not layout.on_loopback()
    assert layout.init_method(str(tmp_path)) == "tcp://10.0.0.1:5000"
    assert ParallelConfig(2, 2, 0, "[::1]:7000").init_method("x") == "tcp://[::1]:7000"
    one_host = ParallelConfig(2)
    assert one_host.on_loopback() and one_host.init_method(str(tmp_path)).startswith(f"file://{tmp_path}/")
    engine = EngineConfig(model_path="m", parallel=one_host)
    assert dataclasses.replace(engine).parallel.tensor_parallel_size == 2


def test_the_cli_reads_sglang_spellings(model_dir):
    from crane_mp.cli import parse_args

    config = parse_args(["--model-path", str(model_dir), "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
                         "--dist-init-addr", "127.0.0.1:29500"], environ={})
    assert config.engine.parallel == ParallelConfig(2, 2, 1, "127.0.0.1:29500")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(model_dir), "--nnodes", "2", "--tensor-parallel-size", "2"], environ={})


def test_every_rank_keeps_the_tokens_rank_0_sampled(model_dir):
    """The runner's token agreement: what it hands back is what the request's mirror, its sampling
    state and the step's result hold, whatever the local sampler drew."""
    from crane_mp.engine import LLMEngine
    from crane_mp.protocol import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=str(model_dir), dtype="float32", force_cpu=True))
    seen = []

    def rank_0s(tokens: list[int]) -> list[int]:
        seen.append(list(tokens))
        return [7] * len(tokens)

    engine.worker.runner.share_tokens = rank_0s
    [tokens] = engine.generate([[5, 6, 8]], SamplingParams(temperature=0.8, seed=3, max_tokens=5,
                                                           repetition_penalty=1.3))
    assert tokens == [7] * 5 and len(seen) == 5


def _fake_host(root, nodes: list[str], siblings: dict[int, str] | None = None) -> str:
    """A sysfs tree: NUMA nodes' cpulists, and hyperthread siblings where given."""
    for index, text in enumerate(nodes):
        (root / "node" / f"node{index}").mkdir(parents=True)
        (root / "node" / f"node{index}" / "cpulist").write_text(text + "\n")
    for cpu, text in (siblings or {}).items():
        (root / "cpu" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return str(root)


def test_ranks_on_one_host_split_its_cores_by_numa_node_and_physical_core(tmp_path, monkeypatch):
    from crane_mp.worker.parallel import tensor_parallel

    monkeypatch.setattr(tensor_parallel.os, "sched_getaffinity", lambda pid: set(range(8)))

    def split(ranks: int, root) -> list:
        return [tensor_parallel.split_cores(r, ranks, root) for r in range(ranks)]

    # Two sockets numbered alternately: each rank gets one socket's cores, not a contiguous half.
    assert split(2, _fake_host(tmp_path / "a", ["0,2,4,6", "1,3,5,7"])) == [{0, 2, 4, 6}, {1, 3, 5, 7}]
    # Four ranks on two nodes: each node's cores halved.
    assert split(4, _fake_host(tmp_path / "b", ["0-3", "4-7"])) == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    # One node whose CPUs 4-7 are the hyperthreads of 0-3: each rank takes whole physical cores.
    siblings = {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)}
    assert split(2, _fake_host(tmp_path / "c", ["0-7"], siblings)) == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    # Nothing known: an even contiguous share; fewer cores than ranks: all shared.
    assert split(2, str(tmp_path / "missing")) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert tensor_parallel.split_cores(2, 3, str(tmp_path / "missing")) == {4, 5}
    assert tensor_parallel.split_cores(0, 9, str(tmp_path / "missing")) is None
