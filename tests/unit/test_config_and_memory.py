"""Config parsing and KV sizing rules (pure functions, no model)."""

from __future__ import annotations

import pytest

from crane_mp.config import EngineConfig, MemoryLimit, parse_memory_limit
from crane_mp.models.kv_groups import FULL, sequence_blocks
from crane_mp.worker.cache.memory import MIN_FITTED_MODEL_LEN, MemoryBudgetError, plan_kv_blocks

GIB = 1 << 30


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8G", MemoryLimit(num_bytes=8 * GIB)),
        ("5120M", MemoryLimit(num_bytes=5120 << 20)),
        ("512MiB", MemoryLimit(num_bytes=512 << 20)),
        ("1.5GB", MemoryLimit(num_bytes=int(1.5 * GIB))),
        ("0.75", MemoryLimit(fraction=0.75)),
        ("1", MemoryLimit(fraction=1.0)),
        (" 2g ", MemoryLimit(num_bytes=2 * GIB)),
    ],
)
def test_parse_memory_limit(text, expected):
    assert parse_memory_limit(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "8X", "1.5", "0", "G8"])
def test_parse_memory_limit_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_memory_limit(text)


def test_fraction_resolves_against_device_total():
    assert MemoryLimit(fraction=0.5).resolve(10 * GIB) == 5 * GIB
    assert MemoryLimit(num_bytes=123).resolve(10 * GIB) == 123


def test_engine_config_validates():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_path="m", dtype="int3")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model_path="m", max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError):
        EngineConfig(model_path="m", block_size=0)


def plan(**overrides):
    args = dict(
        limit=MemoryLimit(num_bytes=2 * GIB),
        total_bytes=16 * GIB,
        weights_bytes=GIB,
        activation_bytes=GIB // 4,
        kv_bytes_per_token=64 * 1024,
        block_size=16,
        max_model_len=4096,
        max_num_seqs=1000,
        max_total_tokens=None,
    )
    args.update(overrides)
    return plan_kv_blocks(**args)


BLOCK = 64 * 1024 * 16


def test_blocks_fill_what_is_left_after_weights_activations_reserve_and_the_spare_block():
    result = plan(reserved_bytes=GIB // 8)
    budget = 2 * GIB - GIB - GIB // 4 - GIB // 8
    assert result.num_blocks == budget // BLOCK - 1  # one block past the plan's is allocated as a spare
    assert result.kv_budget_bytes + BLOCK <= budget
    assert (result.limit_bytes, result.bound) == (2 * GIB, "limit")


def test_free_device_memory_below_the_limit_shrinks_the_cache():
    free = GIB  # other processes hold the rest of a 16 GiB device
    result = plan(limit=MemoryLimit(num_bytes=8 * GIB), free_bytes=free, reserved_bytes=GIB // 16)
    assert result.bound == "free memory"
    assert result.kv_budget_bytes + BLOCK + GIB // 4 + GIB // 16 <= free
    assert result.num_blocks == (free - GIB // 4 - GIB // 16) // BLOCK - 1
    with pytest.raises(MemoryBudgetError, match="free device memory .* other processes hold the rest"):
        plan(free_bytes=GIB // 4 + 1000)
    assert plan(free_bytes=64 * GIB).bound == "limit"  # plenty free: the limit decides


def test_resident_tensors_count_against_the_limit_but_are_already_out_of_free_memory():
    resident = GIB // 8  # rope tables, sampler and grammar tensors, allocated before planning
    by_limit = plan(resident_bytes=resident)
    assert by_limit.num_blocks == plan(reserved_bytes=resident).num_blocks
    assert by_limit.reserved_bytes == resident
    free = GIB  # measured with the resident tensors already allocated: not subtracted twice
    by_free = plan(limit=MemoryLimit(num_bytes=8 * GIB), free_bytes=free, resident_bytes=resident)
    assert by_free.num_blocks == plan(limit=MemoryLimit(num_bytes=8 * GIB), free_bytes=free).num_blocks


def test_the_cuda_runtime_counts_against_the_limit_and_is_named_in_the_plan():
    runtime = GIB // 4  # CUDA context, cuBLAS and Triton modules, allocator rounding: what nvidia-smi adds
    result = plan(runtime_bytes=runtime)
    assert result.num_blocks == plan(reserved_bytes=runtime).num_blocks
    assert result.runtime_bytes == runtime and result.reserved_bytes == 0
    assert "CUDA runtime and allocator slack 256.00 MiB" in result.describe()
    assert "CUDA runtime" not in plan().describe()
    with pytest.raises(MemoryBudgetError, match="reserved memory \\(256.00 MiB\\)"):
        plan(runtime_bytes=runtime, limit=MemoryLimit(num_bytes=GIB + GIB // 2 + GIB // 4 + 1000))


def test_blocks_capped_by_what_sequences_could_use_and_by_max_total_tokens():
    assert (plan(max_num_seqs=2).num_blocks, plan(max_num_seqs=2).bound) == (2 * 256 + 1, "max_num_seqs")
    assert (plan(max_total_tokens=8192).num_blocks, plan(max_total_tokens=8192).bound) == (512, "max_total_tokens")


def test_limit_too_small_for_one_sequence_fails_clearly():
    with pytest.raises(MemoryBudgetError, match="one 4096-token sequence"):
        plan(limit=MemoryLimit(num_bytes=GIB + GIB // 4 + 1000))


def test_a_model_length_the_operator_did_not_choose_is_lowered_to_what_fits():
    # 2 GiB limit: 3/4 GiB of KV after weights and activations, 767 blocks of 16 beside the spare one.
    fitted = plan(max_model_len=40960, fit_model_len=True)
    assert fitted.max_model_len == fitted.num_blocks * 16 == (3 * GIB // 4 // BLOCK - 1) * 16
    assert fitted.kv_budget_bytes + BLOCK <= 2 * GIB - GIB - GIB // 4
    assert plan(fit_model_len=True).max_model_len == 4096  # fits as it is: unchanged
    with pytest.raises(MemoryBudgetError, match="one 40960-token sequence"):  # the operator's own choice
        plan(max_model_len=40960)
    # 2,048 tokens and the spare block: the least a lowered length may be
    def kv_room(tokens: int) -> MemoryLimit:
        return MemoryLimit(num_bytes=GIB + GIB // 4 + tokens * 64 * 1024)

    with pytest.raises(MemoryBudgetError, match="one 40960-token sequence"):
        plan(max_model_len=40960, fit_model_len=True, limit=kv_room(2048 + 15))
    assert plan(max_model_len=40960, fit_model_len=True, limit=kv_room(2048 + 16)).max_model_len == MIN_FITTED_MODEL_LEN


def test_sliding_groups_fit_a_longer_sequence_in_the_same_blocks():
    # One full KV group and two of 1024-token windows: a sequence holds its full blocks and about
    # (1024 + 2048) / 16 per sliding group, so 767 blocks hold far more than 767 * 16 / 3 tokens.
    windows = (FULL, 1024, 1024)
    fitted = plan(max_model_len=40960, fit_model_len=True,
                  sequence_blocks=lambda n: sequence_blocks(windows, n, 16, 2048))
    assert fitted.num_blocks == 3 * GIB // 4 // BLOCK - 1
    assert fitted.max_model_len == (fitted.num_blocks - 2 * 193) * 16
    assert sequence_blocks(windows, fitted.max_model_len, 16, 2048) == fitted.num_blocks
    held = plan(max_model_len=4096, max_num_seqs=1, sequence_blocks=lambda n: sequence_blocks(windows, n, 16, 2048))
    assert (held.num_blocks, held.bound) == (256 + 2 * 193 + 1, "max_num_seqs")


def test_default_concurrency_follows_a_lowered_step_budget(tmp_path):
    from crane_mp.cli import parse_args
    from crane_mp.testing.make_model import make_model

    model = str(make_model("qwen3", "tiny", tmp_path / "m"))
    assert parse_args(["--model-path", model]).engine.max_num_seqs == 256
    lowered = parse_args(["--model-path", model, "--max-num-batched-tokens", "128"]).engine
    assert (lowered.max_num_seqs, lowered.max_num_batched_tokens) == (128, 128)
    with pytest.raises(SystemExit):  # an explicit ceiling above the budget is still a mistake
        parse_args(["--model-path", model, "--max-num-batched-tokens", "128", "--max-concurrent", "200"])


def test_cpu_moe_layers_from_either_spelling(tmp_path):
    from crane_mp.cli import parse_args
    from crane_mp.testing.make_model import make_model

    model = str(make_model("qwen3", "tiny", tmp_path / "m"))
    assert parse_args(["--model-path", model]).engine.cpu_moe_layers is None  # as the memory limit needs
    assert parse_args(["--model-path", model, "--cpu-moe-layers", "12"]).engine.cpu_moe_layers == 12
    assert parse_args(["--model-path", model, "--n-cpu-moe", "0"]).engine.cpu_moe_layers == 0
    with pytest.raises(SystemExit):
        parse_args(["--model-path", model, "--cpu-moe-layers", "-1"])


@pytest.mark.parametrize("max_window_layers, expected", [(0, 64), (4, None), (2, 64)])
def test_qwen2_windows_only_the_layers_from_max_window_layers_on(max_window_layers, expected):
    from transformers import Qwen2Config

    from crane_mp.models.config import model_config_from_hf

    hf = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=max_window_layers,
                     num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
    config = model_config_from_hf(hf)
    assert config.sliding_window == expected
    windows = [config.layout.window(layer, config.sliding_window) for layer in range(4)]
    assert windows == [None if layer < max_window_layers else expected for layer in range(4)]
    hf.use_sliding_window = False
    assert model_config_from_hf(hf).sliding_window is None


def test_an_engine_serves_at_the_model_length_its_memory_limit_holds(tmp_path):
    from crane_mp.engine import LLMEngine
    from crane_mp.protocol import SamplingParams
    from crane_mp.testing.make_model import make_model

    model = str(make_model("qwen3", "tiny", tmp_path / "m", overrides={"max_position_embeddings": 16384}))
    roomy = LLMEngine(EngineConfig(model_path=model, max_num_seqs=4))
    plan = roomy.worker.kv_plan
    assert roomy.worker.max_model_len == plan.max_model_len == 16384
    # Room for 4,000 tokens of KV beside the spare block: the model's 16,384 are lowered to 3,984.
    limit = plan.weights_bytes + plan.activation_bytes + plan.reserved_bytes + 4000 * plan.kv_bytes_per_token
    tight = LLMEngine(EngineConfig(model_path=model, max_num_seqs=4, memory_limit=MemoryLimit(num_bytes=limit)))
    assert tight.worker.max_model_len == tight.worker.kv_plan.max_model_len == 3984
    assert tight.scheduler.config.max_model_len == 3984
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert tight.generate([[5] * 3900], params) == roomy.generate([[5] * 3900], params)
    with pytest.raises(MemoryBudgetError, match="one 16384-token sequence"):  # chosen by the operator: kept
        LLMEngine(EngineConfig(model_path=model, max_num_seqs=4, max_model_len=16384,
                               memory_limit=MemoryLimit(num_bytes=limit)))


def test_the_profiled_step_holds_every_penalty_row_through_its_forward(tmp_path):
    """Serving keeps the sampler's penalty table (8 bytes per logit per request) allocated through
    every prefill, so the measured peak must include it beside the forward's temporaries."""
    from crane_mp.engine import LLMEngine
    from crane_mp.testing.make_model import make_model
    from crane_mp.worker.sampling.penalties import PenaltyTable

    model = str(make_model("qwen3", "tiny", tmp_path / "m"))
    runner = LLMEngine(EngineConfig(model_path=model, max_num_seqs=16, max_num_batched_tokens=64)).worker.runner
    runner.sampler.penalties = PenaltyTable(runner.config.vocab_size, runner.device)
    rows_at_forward = []
    forward = runner.forward

    def recording_forward(*args, **kwargs):
        rows_at_forward.append(runner.sampler.penalties.counts.shape[0])
        return forward(*args, **kwargs)

    runner.forward = recording_forward
    runner.profile_step(64, 16)
    assert rows_at_forward and rows_at_forward[0] >= 16


def test_a_hybrid_model_s_state_pool_takes_a_slot_per_sequence_from_the_kv_budget():
    state = 8 << 20  # a sequence's recurrent state over every linear-attention layer
    few = plan(max_num_seqs=8, state_bytes_per_seq=state)
    assert (few.state_slots, few.state_bytes_per_seq) == (8, state)
    assert few.num_blocks == plan().num_blocks - 8 * state // BLOCK  # the pool's bytes come out of the KV cache
    assert "state pool 64.00 MiB (8 sequences of 8.00 MiB)" in few.describe()
    # Many sequences allowed: three quarters of what one full-length sequence's KV leaves.
    room = 2 * GIB - GIB - GIB // 4 - BLOCK - 256 * BLOCK
    many = plan(state_bytes_per_seq=state)
    assert many.state_slots == room * 3 // 4 // state
    assert many.num_blocks == (room + 256 * BLOCK - many.state_slots * state) // BLOCK
    # Sixteen where they fit, though that is more than three quarters.
    assert plan(state_bytes_per_seq=24 << 20).state_slots == 16 > room * 3 // 4 // (24 << 20)
    assert plan().state_slots == 0 and "state pool" not in plan().describe()
    with pytest.raises(MemoryBudgetError, match="recurrent state"):
        plan(state_bytes_per_seq=GIB // 2)


def test_a_hybrid_model_s_context_is_lowered_for_sequences_to_run_together_when_the_user_chose_none():
    state = 8 << 20
    fitted = plan(max_model_len=65536, fit_model_len=True, state_bytes_per_seq=state)  # 4 GiB of KV a sequence
    room = 2 * GIB - GIB - GIB // 4 - BLOCK - 128 * BLOCK  # one 2048-token sequence's KV kept
    assert fitted.state_slots == room * 3 // 4 // state
    assert 2048 <= fitted.max_model_len == fitted.num_blocks * 16 < 65536


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_the_largest_step_a_gpu_profiles_fits_an_encoder_s_positions(tmp_path, monkeypatch, arch):
    """A GPU measures its activations on the full-budget step (the CPU only warms up on a small one): an
    encoder's longest prompt is its positions, one fewer than its max_model_len (the placeholder token);
    one more read past its position table (a device-side assert on an H200)."""
    from crane_mp.engine import LLMEngine
    from crane_mp.testing.make_encoder import make_encoder
    from crane_mp.worker.platforms.cpu import CpuPlatform

    def full_step_then_estimate(self, profile, estimate):
        profile(True)
        return estimate

    monkeypatch.setattr(CpuPlatform, "measure_activation_bytes", full_step_then_estimate)
    model = str(make_encoder(arch, tmp_path / arch, "embed"))
    engine = LLMEngine(EngineConfig(model_path=model, max_num_seqs=4))
    positions = engine.worker.model_config.max_position_embeddings
    assert engine.worker.max_model_len == positions + 1
