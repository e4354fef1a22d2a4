"""Messages round-trip through the typed decoders; foreign or malformed frames are rejected, not run."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from crane_mp.ipc import encode, frontend_decoder, scheduler_decoder, worker_decoder
from crane_mp.protocol import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineStats,
    GenerateRequest,
    NewRequest,
    SamplingParams,
    ScheduledRequest,
    ShutdownWorker,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenLogprobs,
    TokenOutput,
)

PARAMS = SamplingParams(temperature=0.5, top_k=4, logit_bias={7: -1.5}, seed=3, stop_token_ids=[2], max_tokens=9)

CASES = [
    (scheduler_decoder, GenerateRequest(1 << 41, [1, 2, 3], PARAMS, 2, 12.5)),
    (scheduler_decoder, AbortRequest(5)),
    (scheduler_decoder, ControlRequest("stats", 9, 1)),
    (scheduler_decoder, StepResult(4, [1, 2], [7, 8], [None, TokenLogprobs(-0.1, [7], [-0.1])])),
    (worker_decoder, StepPlan(3, [NewRequest(1, [4, 5], PARAMS)], [ScheduledRequest(1, 0, 2, [0], False)], [2], [3])),
    (worker_decoder, ShutdownWorker()),
    (frontend_decoder, TokenBatch([TokenOutput(1, [5], 3, 1, 0, 5, [], None, cached_tokens=16)])),
    (frontend_decoder, EngineStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11.5, 12, 13, 14)),
    (frontend_decoder, ControlReply(3, False, "busy")),
]


@pytest.mark.parametrize("decoder, message", CASES, ids=lambda c: type(c).__name__)
def test_round_trip(decoder, message):
    assert decoder.decode(encode(message)) == message


def test_wrong_receiver_and_foreign_frames_are_rejected():
    with pytest.raises(msgspec.ValidationError):
        worker_decoder.decode(encode(AbortRequest(1)))  # a scheduler message sent to the worker
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        scheduler_decoder.decode(pickle.dumps(AbortRequest(1)))
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        frontend_decoder.decode(b"\x93\xa4evil\x01\x02")
