"""The Gated DeltaNet rule in float32: our chunked prefill against transformers' reference functions, a
prompt split anywhere (chunked prefill steps) giving what it gives whole, and the recurrent decode step
continuing either; the state pool's slots."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from crane_mp.worker.cache.state_pool import StatePool, state_bytes_per_sequence
from crane_mp.worker.models.gated_deltanet import CHUNK, chunked, l2_normalize, prefill_groups, recurrent_step

HEADS, KEY_DIM, VALUE_DIM = 3, 8, 6


def inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Raw per-token [1, length, heads, dim] queries, keys, values and [1, length, heads] decay and beta."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, length, HEADS, KEY_DIM, generator=gen) for _ in range(2))
    v = torch.randn(1, length, HEADS, VALUE_DIM, generator=gen)
    g = -torch.rand(1, length, HEADS, generator=gen) * 0.5
    beta = torch.rand(1, length, HEADS, generator=gen)
    return q, k, v, g, beta


def ours(q, k, v, g, beta, state, start: int, end: int):
    """Our chunked rule on tokens [start, end) of inputs() from `state` ([heads, key, value])."""
    q, k = l2_normalize(q[0, start:end]) * KEY_DIM**-0.5, l2_normalize(k[0, start:end])
    return chunked(q.transpose(0, 1), k.transpose(0, 1), v[0, start:end].transpose(0, 1), g[0, start:end].t(),
                   beta[0, start:end].t(), state)


@pytest.mark.parametrize("length", [1, 5, 64, 65, 200])
def test_a_prompt_s_chunked_rule_equals_transformers_reference(length):
    q, k, v, g, beta = inputs(length, length)
    initial = torch.randn(1, HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(1))
    expected, expected_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial,
                                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = ours(q, k, v, g, beta, initial[0], 0, length)
    torch.testing.assert_close(out.transpose(0, 1), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [[7], [64, 100], [1, 2, 3, 130]])
def test_a_prompt_split_into_steps_carries_its_state_to_the_same_outputs(cuts):
    length = 150
    q, k, v, g, beta = inputs(length, 9)
    whole, whole_state = ours(q, k, v, g, beta, torch.zeros(HEADS, KEY_DIM, VALUE_DIM), 0, length)
    state, parts = torch.zeros(HEADS, KEY_DIM, VALUE_DIM), []
    for start, end in zip([0, *cuts], [*cuts, length]):
        out, state = ours(q, k, v, g, beta, state, start, end)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


def test_decode_steps_continue_a_prompt_as_its_longer_prompt_would():
    length, prompt = 90, 70
    q, k, v, g, beta = inputs(length, 11)
    whole, _ = ours(q, k, v, g, beta, torch.zeros(HEADS, KEY_DIM, VALUE_DIM), 0, length)
    _, state = ours(q, k, v, g, beta, torch.zeros(HEADS, KEY_DIM, VALUE_DIM), 0, prompt)
    state = state[None]  # a batch of one sequence
    for t in range(prompt, length):
        out, state = recurrent_step(l2_normalize(q[:, t]) / KEY_DIM**0.5, l2_normalize(k[:, t]), v[:, t], g[:, t],
                                    beta[:, t], state)
        torch.testing.assert_close(out[0], whole[:, t], atol=1e-5, rtol=1e-5)


class _Layer:
    def __init__(self, conv: tuple[int, int], recurrent: tuple[int, int, int]) -> None:
        self.shapes = conv, recurrent
        self.conv_state = self.recurrent_state = None

    def state_shapes(self):
        return self.shapes


def test_the_state_pool_hands_out_each_slot_once_and_empties_a_restarted_one():
    layers = [_Layer((12, 3), (2, 4, 5)), _Layer((12, 3), (2, 4, 5))]
    pool = StatePool(layers, 3, torch.device("cpu"), torch.bfloat16, torch.float32)
    per_sequence = sum(layer.conv_state[0].nbytes + layer.recurrent_state[0].nbytes for layer in layers)
    assert pool.bytes_per_sequence == per_sequence == state_bytes_per_sequence(layers, torch.bfloat16, torch.float32)
    assert layers[0].conv_state.dtype == torch.bfloat16 and layers[1].recurrent_state.shape == (3, 2, 4, 5)
    slots = [pool.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="slots are all held"):
        pool.acquire()
    layers[1].recurrent_state[slots[1]].fill_(2.0)
    layers[1].conv_state[slots[2]].fill_(3.0)
    pool.reset(slots[1])
    assert not layers[1].recurrent_state[slots[1]].any() and layers[1].conv_state[slots[2]].eq(3.0).all()
    pool.release(slots[1])
    assert pool.acquire() == slots[1]


def test_sequences_padded_to_the_longest_run_together_as_each_alone():
    lengths = [150, 3, 64, 70]
    longest = max(lengths)
    padded = [torch.zeros(len(lengths), HEADS, longest, dim) for dim in (KEY_DIM, KEY_DIM, VALUE_DIM)]
    g, beta = torch.zeros(len(lengths), HEADS, longest), torch.zeros(len(lengths), HEADS, longest)
    states = torch.randn(len(lengths), HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(2))
    alone = []
    for p, length in enumerate(lengths):
        q, k, v, gp, bp = inputs(length, 20 + p)
        alone.append(ours(q, k, v, gp, bp, states[p], 0, length))
        qn, kn = l2_normalize(q[0]) * KEY_DIM**-0.5, l2_normalize(k[0])
        for tensor, values in zip(padded, (qn, kn, v[0])):
            tensor[p, :, :length] = values.transpose(0, 1)
        g[p, :, :length], beta[p, :, :length] = gp[0].t(), bp[0].t()
    out, after = chunked(*padded, g, beta, states)
    for p, (expected, expected_state) in enumerate(alone):
        torch.testing.assert_close(out[p, :, : lengths[p]], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(after[p], expected_state, atol=1e-5, rtol=1e-5)


def test_a_step_s_prompts_are_grouped_so_padding_stays_bounded():
    lengths = [1, 1, 48, 30, 2000, 64, 65, 5]  # two decodes first
    groups = prefill_groups(lengths, 2, torch.device("cpu"))
    assert sorted(i for group in groups for i in group.seqs) == list(range(2, len(lengths)))
    for group in groups:
        blocks = [-(-lengths[i] // CHUNK) for i in group.seqs]
        assert max(blocks) * len(blocks) * 2 <= 3 * sum(blocks)
        starts = [sum(lengths[:i]) for i in group.seqs]
        expected = sorted(row for start, i in zip(starts, group.seqs) for row in range(start, start + lengths[i]))
        assert sorted(group.rows.tolist()) == expected
    assert [2000] in [[lengths[i] for i in group.seqs] for group in groups]  # the long prompt alone
