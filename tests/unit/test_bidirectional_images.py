"""Gemma 3's images attended both ways: the attention masks let an image's placeholders see each other
(and nothing else past the causal edge), in fresh and chunked prefills and sliding windows alike; the
scheduler never splits an image over steps nor ends a prefix-cache hit inside one."""

from __future__ import annotations

import pytest
import torch

from crane_mp.protocol import MediaInput
from crane_mp.scheduler.scheduler import RequestRejected
from crane_mp.worker.cache.attention import SeqSpan, build_metadata, paged_attention
from tests.factories import FakeWorker, make_requests, make_scheduler, run_to_completion

BLOCK = 4


def _reference(q, k, v, first: int, end: int, window: int | None, offset: int) -> torch.Tensor:
    """Per query position p (offset + row): keys j <= p, or j in [first, end) when p is; within the window."""
    rows = []
    for row in range(q.shape[0]):
        p = offset + row
        allowed = [j for j in range(k.shape[0]) if (j <= p or first <= p < end and first <= j < end)
                   and (window is None or j > p - window)]
        scores = (q[row] @ k[allowed].T) * 0.5
        rows.append(torch.softmax(scores, -1) @ v[allowed])
    return torch.stack(rows)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("ctx_before", [0, 4])  # a fresh prompt, or a chunk after cached context
def test_an_images_placeholders_see_each_other(window, ctx_before):
    length, first, end = 14, 5, 10
    q, k, v = (torch.randn(length, 1, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    k_cache = torch.zeros(8, BLOCK, 1, 4)
    v_cache = torch.zeros(8, BLOCK, 1, 4)
    table = [3, 1, 6, 0]
    if ctx_before:  # the context's keys already in the cache
        earlier = SeqSpan(0, ctx_before, table)
        meta = build_metadata([], [earlier], BLOCK, torch.device("cpu"), torch.float32)
        paged_attention(q[:ctx_before], k[:ctx_before], v[:ctx_before], k_cache, v_cache, meta, 0.5)
    # A second, text-only prompt in the same step keeps plain causal attention.
    other = SeqSpan(0, 3, [7])
    chunk = SeqSpan(ctx_before, length - ctx_before, table)
    meta = build_metadata([], [chunk, other] if ctx_before else [chunk], BLOCK, torch.device("cpu"), torch.float32)
    meta.bidirectional = [(0, first, end)]
    rows = slice(ctx_before, length)
    q_in, k_in, v_in = q[rows], k[rows], v[rows]
    if ctx_before:
        q_in, k_in, v_in = (torch.cat([t, t[:3]]) for t in (q_in, k_in, v_in))
    out = paged_attention(q_in, k_in, v_in, k_cache, v_cache, meta, 0.5, window=window)
    expected = _reference(q[ctx_before:, 0], k[:, 0], v[:, 0], first, end, window, ctx_before)
    assert torch.allclose(out[: length - ctx_before], expected, atol=1e-6)
    if ctx_before:
        second = slice(ctx_before, ctx_before + 3)  # the other prompt's rows: the chunk's first three again
        plain = _reference(q[second, 0], k[second, 0], v[second, 0], 0, 0, window, 0)
        assert torch.allclose(out[length - ctx_before :], plain, atol=1e-6)


def _image(offset: int, count: int) -> MediaInput:
    return MediaInput("image", f"img{offset}", [1, 3, 8, 8], b"", offset, count, [1, 8, 8])


def test_a_step_computes_an_image_whole_or_not_at_all():
    sched, worker = make_scheduler(whole_images=True, max_num_batched_tokens=12), FakeWorker()
    [req] = make_requests(1, prompt_len=30, max_tokens=2)
    req.media = [_image(5, 10), _image(18, 12)]  # placeholders [5, 15) and [18, 30)
    sched.add_request(req)
    run_to_completion(sched, worker)
    chunks = [(s.num_computed_tokens, s.num_new_tokens) for plan in worker.plans for s in plan.scheduled]
    # Cut before the first image; the image whole (and text after it); the rest up to the second image;
    # the second whole (12 = the budget).
    assert chunks[:4] == [(0, 5), (5, 12), (17, 1), (18, 12)]
    for start, count in chunks:
        assert not any(item.offset < edge < item.offset + item.num_tokens for item in req.media
                       for edge in (start, start + count))


def test_a_prefix_cache_hit_ends_before_an_image_it_would_split():
    sched, worker = make_scheduler(whole_images=True), FakeWorker()
    first, second = make_requests(2, prompt_len=30, max_tokens=2)
    second.prompt_ids = list(first.prompt_ids)
    for req in (first, second):
        req.media = [_image(6, 12)]  # placeholders [6, 18): blocks of 4 end at 8, 12 and 16 inside it
        sched.add_request(req)
        run_to_completion(sched, worker)
    # The same prompt and image: 28 of its 30 tokens are cached, whole blocks past the image.
    assert second.num_cached_tokens == 28
    third = make_requests(1, prompt_len=30, max_tokens=2)[0]
    third.prompt_ids = list(first.prompt_ids)[:17] + [99] * 13  # differs inside the image's placeholders
    third.media = [_image(6, 12)]
    sched.add_request(third)
    run_to_completion(sched, worker)
    assert third.num_cached_tokens == 4  # the block before the image, not the ones among its placeholders


def test_an_image_longer_than_a_step_is_refused():
    sched = make_scheduler(whole_images=True, max_num_batched_tokens=8)
    [req] = make_requests(1, prompt_len=20, max_tokens=2)
    req.media = [_image(2, 16)]
    with pytest.raises(RequestRejected, match="16 tokens is longer than a step's token budget"):
        sched.add_request(req)
