"""The frontend's shared state, reached by handlers through one typed AppKey."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from crane_mp.config import ServerConfig
from crane_mp.frontend.audio.speech import SpeechModel, load_speech_model
from crane_mp.frontend.images.processor import ImageProcessor, load_image_processor
from crane_mp.frontend.openai.schemas import MAX_BATCH
from crane_mp.frontend.responses.store import ResponseStore
from crane_mp.frontend.serving.engine_client import EngineClient
from crane_mp.frontend.serving.reasoning import THINK, Markers, reasoning_markers
from crane_mp.frontend.serving.structured import GrammarCompiler
from crane_mp.frontend.serving.tokenizer import TokenizerService
from crane_mp.frontend.web.connections import ConnectionGuard
from crane_mp.frontend.web.errors import ApiError, EngineDeadError
from crane_mp.frontend.web.gate import LoadGate
from crane_mp.frontend.web.metrics import Metrics
from crane_mp.models.config import checkpoint_architecture
from crane_mp.models.registry import ARCHITECTURES
from crane_mp.models.score_head import ScoreHead, load_score_head
from crane_mp.protocol import EngineState, LoraAdapter, WorkerReady

# The body limit of a model that takes images or audio: a data-URL image or an uploaded clip is megabytes
# (65 s of 44.1 kHz stereo WAV is 11 MB); --max-request-bytes overrides it.
_MEDIA_REQUEST_BYTES = 64 << 20
# A round trip to the scheduler, which answers control requests between steps.
_CATCH_UP_SECONDS = 5.0


@dataclass(slots=True)
class FrontendState:
    config: ServerConfig
    tokenizer: TokenizerService
    client: EngineClient | None = None
    responses: ResponseStore | None = None  # stored Responses API answers, shared by the server's frontends
    engine_info: WorkerReady | None = None  # set once the engine behind us is ready
    draining: bool = False
    started: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(init=False)
    grammars: GrammarCompiler = field(init=False)
    adapters: dict[str, LoraAdapter] = field(init=False)  # LoRA adapters loaded now, by name
    gate: LoadGate = field(init=False)
    connections: ConnectionGuard = field(init=False)
    reasoning: bool = field(init=False)  # answers are read for thinking (--reasoning-parser)
    think_markers: Markers = field(init=False)  # the family's thinking tags
    think_start_token: int | None = field(init=False)
    think_end_token: int | None = field(init=False)
    score_head: ScoreHead | None = field(init=False)  # --task score: the classification head
    answer_head: ScoreHead | None = field(default=None, init=False)  # a causal reranker's yes/no head, once read
    image_processor: ImageProcessor | None = field(default=None, init=False)  # a vision-language model's
    speech: SpeechModel | None = field(default=None, init=False)  # --task transcribe: Whisper's settings
    sleep_level: int = field(default=0, init=False)  # the worker's (scheduler/residency.py); 0: awake
    weights_path: str = field(default="", init=False)  # where the weights served now were read from

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.config.model_name, self.config.replica)
        self.gate = LoadGate(self.config.engine.max_num_seqs + self.config.max_queue)
        added = self.tokenizer.added_vocab
        markers = reasoning_markers(self.config.reasoning_parser, added)
        self.reasoning, self.think_markers = markers is not None, markers or THINK
        # The tokens that open and close a think block (Gemma 4's open it before the `thought` label);
        # harmony's analysis message opens with a tag every message has: only its end is counted by.
        start, end = self.think_markers.vocabulary_tokens
        self.think_start_token, self.think_end_token = added.get(start), added.get(end)
        if self.think_markers.harmony:
            self.think_start_token, self.think_end_token = None, added.get(self.think_markers.end)
        self.connections = ConnectionGuard(self.config.max_connections, self.config.read_timeout,
                                           self.metrics.connection_refused)
        self.grammars = GrammarCompiler(self.tokenizer, self.config.grammar_timeout)
        modules = self.config.engine.lora_modules
        self.adapters = {name: LoraAdapter(i + 1, name, path) for i, (name, path) in enumerate(modules)}
        scoring = self.config.engine.task == "score"
        template = getattr(self.tokenizer.tokenizer, "chat_template", None)  # how CrossEncoder renders a pair
        self.weights_path = self.config.engine.model_path
        self.score_head = load_score_head(Path(self.config.engine.model_path), template) if scoring else None
        model_dir = Path(self.config.engine.model_path)
        arch = checkpoint_architecture(model_dir, self.config.engine.model_type,
                                       self.config.engine.model_impl) if model_dir.is_dir() else None
        # A vision-language checkpoint without its image processor's settings serves text only.
        if arch is not None and arch.media == "image" and (model_dir / "preprocessor_config.json").is_file():
            self.image_processor = load_image_processor(model_dir, self.config.engine.mm_processor_kwargs)
        if self.config.engine.task == "transcribe":
            self.speech = load_speech_model(model_dir)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def set_engine_state(self, state: EngineState) -> None:
        self.sleep_level, self.weights_path = state.sleep_level, state.weights_path

    async def catch_up(self) -> None:
        """Apply every EngineState and adapter list the scheduler sent this frontend before now. Each
        frontend hears of a sleep, a wake, new weights or an adapter on its own socket: a client that
        changed one through one frontend and asks another must see the change. Where the engine does
        not answer, what was last heard stands."""
        if self.client is None or self.client.dead or self.engine_info is None:
            return
        try:
            await self.client.control("sync", _CATCH_UP_SECONDS)
        except (asyncio.TimeoutError, EngineDeadError):
            pass

    @property
    def model_state(self) -> str:
        """/v1/models' state: "loaded", or "sleeping" while the worker has given its memory back."""
        return "sleeping" if self.sleep_level else "loaded"

    def set_adapters(self, adapters: list[LoraAdapter]) -> None:
        """The scheduler's list after a load or unload (any frontend's): what requests may name now."""
        self.adapters = {adapter.name: adapter for adapter in adapters}

    @property
    def max_request_bytes(self) -> int:
        """--max-request-bytes, else sized to the longest request the model accepts: a full batch of
        prompts that each fill the context window, as token ids of up to 8 JSON bytes (at least 1 MiB)."""
        if self.config.max_request_bytes is not None:
            return self.config.max_request_bytes
        max_model_len = self.engine_info.max_model_len if self.engine_info else 0
        media = self.engine_info is not None and ARCHITECTURES[self.engine_info.arch].media is not None
        return max(_MEDIA_REQUEST_BYTES if media else 1 << 20, MAX_BATCH * 8 * max_model_len)

    @property
    def ready(self) -> bool:
        return self.engine_info is not None and not self.draining and not (self.client and self.client.dead)

    def require_ready(self) -> None:
        if self.client is not None and self.client.dead:
            raise ApiError(503, f"the engine stopped: {self.client.dead}")
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if self.engine_info is None:
            raise ApiError(503, "the server is starting; the model is not loaded yet")

    def require_generative(self) -> None:
        """Generation routes: a 400 on a server started for embeddings or scores (its model may have no
        lm_head)."""
        self.require_ready()
        if self.config.engine.task == "embed":
            raise ApiError(400, "this server serves an embedding model (--task embed): use /v1/embeddings")
        if self.config.engine.task == "score":
            raise ApiError(400, "this server serves a sequence-classification model (--task score): use /v1/rerank "
                                "or /score")
        if self.config.engine.task == "transcribe":
            raise ApiError(400, "this server serves a speech-to-text model (--task transcribe): use "
                                "/v1/audio/transcriptions or /v1/audio/translations")

    def require_transcription(self) -> None:
        """/v1/audio/*: a 400 on a server started for anything but a Whisper checkpoint."""
        self.require_ready()
        if self.config.engine.task != "transcribe":
            raise ApiError(400, "this server does not serve a speech-to-text model: start one with a Whisper "
                                "checkpoint (--task transcribe) for /v1/audio/transcriptions")

    def require_scoring(self) -> None:
        """/v1/rerank and /score: a classification head (--task score), or a generating reranker."""
        self.require_ready()
        if self.config.engine.task == "embed":
            raise ApiError(400, "this server serves an embedding model (--task embed): use /v1/embeddings")

    def require_embedding(self) -> None:
        """/v1/embeddings: a 400 on a server started to generate text."""
        self.require_ready()
        if self.config.engine.task != "embed":
            raise ApiError(400, "this server generates text; serve an embedding model with --task embed")


STATE = web.AppKey("state", FrontendState)
