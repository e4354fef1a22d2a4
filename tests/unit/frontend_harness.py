"""The real frontend app (routes, validation, tokenizer, streams) in-process, over a fake scheduler.

The fake answers every GenerateRequest at once with `tokens_per_request` tokens and a finish (or only
admits it, as the real scheduler acknowledges), records every message it is sent, aborts by name as
the scheduler does, and answers stats requests; nothing runs a model. Tests see exactly what
the frontend would send the scheduler and which requests it still has registered.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from tokenizers import AddedToken, Tokenizer

from crane_mp.config import EngineConfig, ServerConfig
from crane_mp.frontend.app import create_app
from crane_mp.frontend.responses.store import ResponseStore
from crane_mp.frontend.serving.engine_client import EngineClient
from crane_mp.frontend.serving.tokenizer import TokenizerService
from crane_mp.frontend.state import FrontendState
from crane_mp.ipc import Addresses, scheduler_decoder
from crane_mp.protocol import (
    AbortNamed,
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineState,
    EngineStats,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    LoraRegistry,
    TokenOutput,
    WorkerReady,
)

HIDDEN_SIZE = 16  # the width of the fake engine's embeddings: 1, 2, ..., 16


class FakeScheduler:
    """Stands in for the frontend's socket to the scheduler."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.requests: list[GenerateRequest] = []
        self.aborts: list[int] = []
        self.tokens_per_request = 2
        self.answer = True  # False: requests are admitted and stay in flight until the test pushes to them
        self.reject_with: str | None = None  # finish every request with this error (a scheduler refusal)
        self.reject_kind = ErrorKind.INVALID
        self.output_ids: list[int] | None = None  # answer with these tokens and a stop instead
        # An announcement on its way to this frontend: applied ahead of the next "sync" reply, as the
        # scheduler's socket orders them.
        self.announced: EngineState | LoraRegistry | None = None

    def send(self, frame: bytes, flags: int = 0) -> None:
        message = scheduler_decoder.decode(frame)
        if isinstance(message, GenerateRequest):
            self.requests.append(message)
            asyncio.get_running_loop().call_soon(self._finish if self.answer else self._admit, message)
        elif isinstance(message, AbortRequest):
            self.aborts.append(message.rid)
        elif isinstance(message, AbortNamed):
            for req in self.requests:
                stream = self.client.streams.get(req.rid)
                if message.name in req.names and stream is not None:
                    self.aborts.append(req.rid)
                    stream.push(TokenOutput(req.rid, [], len(req.input_ids), 0, FinishReason.ABORT))
        elif isinstance(message, ControlRequest):
            future = self.client.replies.get(message.token)
            if message.kind == "sync" and isinstance(self.announced, EngineState):
                self.client.on_state(self.announced)
            elif message.kind == "sync" and isinstance(self.announced, LoraRegistry):
                self.client.on_adapters(self.announced.adapters)
            if message.kind == "sync":
                self.announced = None
            if future is not None and message.kind == "stats":
                future.set_result(EngineStats(message.token, 0, 0, 10, 10, 0, 0, 0, 0, 0, 0.0))
            elif future is not None:  # what the scheduler answers an idle engine's other control requests
                future.set_result(ControlReply(message.token, True))

    def _admit(self, req: GenerateRequest) -> None:
        stream = self.client.streams.get(req.rid)
        if stream is not None:
            stream.push(TokenOutput(req.rid, [], len(req.input_ids), 0))

    def _finish(self, req: GenerateRequest) -> None:
        stream = self.client.streams.get(req.rid)
        if stream is None:
            return
        if self.reject_with is not None:
            stream.push(TokenOutput(req.rid, [], len(req.input_ids), 0, FinishReason.ERROR, error=self.reject_with,
                                    error_kind=self.reject_kind))
            return
        if req.sampling.pooling is not None:  # an embedding request: its vector and a placeholder token
            vector = struct.pack(f"<{HIDDEN_SIZE}f", *range(1, HIDDEN_SIZE + 1))
            stream.push(TokenOutput(req.rid, [0], len(req.input_ids), 1, FinishReason.LENGTH, embedding=vector))
            return
        if self.output_ids is not None:
            ids = self.output_ids
            stream.push(TokenOutput(req.rid, ids, len(req.input_ids), len(ids), FinishReason.STOP))
            return
        count = min(self.tokens_per_request, req.sampling.max_tokens)
        stream.push(TokenOutput(req.rid, [5] * count, len(req.input_ids), count, FinishReason.LENGTH))


def engine_facts(vocab_size: int, max_model_len: int) -> WorkerReady:
    return WorkerReady(num_blocks=64, block_size=16, kv_bytes_per_token=64, kv_budget_bytes=1 << 20,
                       weights_bytes=1 << 20, max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=[2],
                       arch="qwen3", device="Cpu", dtype="float32", isa="avx2", kernel_isa="avx2",
                       hidden_size=HIDDEN_SIZE)


async def start_frontend(model_dir: Path, run_dir: Path, max_model_len: int = 256,
                         **server_args) -> tuple[TestClient, FrontendState, FakeScheduler]:
    server_args.setdefault("engine", EngineConfig(model_path=str(model_dir)))
    config = ServerConfig(model_name="tiny", **server_args)
    state = FrontendState(config, TokenizerService(str(model_dir)))
    state.client = EngineClient(Addresses(str(run_dir)), 0, config.request_timeout)
    state.responses = ResponseStore(Path(run_dir) / "responses")
    fake = FakeScheduler(state.client)
    state.client.to_scheduler = fake
    state.client.on_state = state.set_engine_state  # as the frontend process wires them
    state.client.on_adapters = state.set_adapters
    state.engine_info = engine_facts(len(state.tokenizer.tokenizer), max_model_len)
    # As the frontend process runs it: a client that goes away cancels its handler.
    client = TestClient(TestServer(create_app(state), handler_cancellation=True))
    await client.start_server()
    state.connections.attach(client.server.runner.server)
    return client, state, fake


async def stop_frontend(client: TestClient, state: FrontendState) -> None:
    await client.close()
    await state.client.close()
    state.grammars.close()
    state.tokenizer.close()


def add_special_tokens(model_dir: Path, texts: list[str]) -> None:
    """Give the checkpoint's tokenizer these texts as special tokens (a family's marks the test vocabulary
    lacks), each one token."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in texts])
    tokenizer.save(str(model_dir / "tokenizer.json"))


def token_ids(state: FrontendState, text: str) -> list[int]:
    """`text` as the served tokenizer encodes it, its marks as their tokens (a scripted answer)."""
    return state.tokenizer.tokenizer.encode(text, add_special_tokens=False)
