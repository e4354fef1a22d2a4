"""Every message that crosses a process boundary, as msgspec Structs; nothing else goes over a socket.

Grouped by receiver. Hot-path structs are `array_like` (encoded as msgpack arrays, no field names).
The in-process engine passes the same objects without encoding them.
"""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS or a stop token id
    LENGTH = 1  # max_tokens or the context window
    ABORT = 2  # client abort, stop string matched by the frontend, shutdown
    ERROR = 3  # a failure that belongs to this request only


class ErrorKind(enum.IntEnum):
    """Why a request ended with FinishReason.ERROR; frontend/web/errors.py maps each to its HTTP status."""

    INVALID = 0  # the request can never run (400)
    OVERLOADED = 1  # --max-queue requests already wait (429)
    INTERNAL = 2  # processing this request raised in the scheduler or worker (500)
    # Set by the frontend itself, never sent:
    TIMEOUT = 3  # open past --request-timeout (408)
    UNAVAILABLE = 4  # the scheduler or worker is gone (503)


class ThinkingBudget(msgspec.Struct, frozen=True, array_like=True):
    """A reasoning model may think `max_tokens` tokens (after its `<think>`, which the answer opens with
    or the prompt `opened`); past them the sampler forces `</think>`. A grammar (structured output, a
    forced tool call) constrains only what follows the think block (the frontend sends both only where
    the prompt opened it)."""

    max_tokens: int
    start_token: int
    end_token: int
    opened: bool = False


class WhisperDecoding(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Whisper's logits rules for one decoding window, as transformers' generate applies them
    (worker/sampling/whisper_logits.py). Generated tokens are those after the prompt."""

    suppress_tokens: list[int] = []  # never sampled
    begin_suppress_tokens: list[int] = []  # not as the first generated token
    only_tokens: list[int] = []  # when set, nothing else may be sampled (language detection)
    timestamps: bool = False  # the timestamp rules (WhisperTimeStampLogitsProcessor) apply
    timestamp_begin: int = 0  # the id of <|0.00|>
    no_timestamps_token_id: int = 0
    eos_token_id: int = 0
    max_initial_timestamp_index: int | None = None


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Per-request generation settings. The worker samples with them; the scheduler stops by token id.

    top_k <= 0 disables top-k; logprobs None returns no logprobs, N >= 0 the sampled token's plus top N;
    prompt_logprobs likewise for every prompt token after the first (echo, scoring). grammar: structured
    output, a grammar in llguidance's JSON form (JSON schema, regex, Lark), validated by the frontend.
    pooling: an embedding request ("last" token, "mean" of the prompt's final hidden states, or "cls":
    the first token's): the worker returns the pooled vector instead of sampling, and the request ends
    after its prompt.
    lora_id: which LoRA adapter computes the request (its KV too: the prefix cache keeps adapters apart).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    grammar: str | None = None
    pooling: str | None = None
    lora_id: int = 0  # the LoRA adapter (EngineConfig.lora_modules[lora_id - 1]); 0: the base model
    thinking: ThinkingBudget | None = None
    whisper: WhisperDecoding | None = None  # a Whisper window's logits rules

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def pools_prompt(self) -> bool:
        """The pooling reads prompt positions before the last (mean: all, CLS: the first): they must be
        computed, not found in the prefix cache."""
        return self.pooling in ("mean", "cls")


class MediaInput(msgspec.Struct, array_like=True):
    """An image or an audio window a request's prompt refers to, as float32 values the worker encodes
    once per request (and keeps through preemptions).

    image: `values` are the processor's patches [patches, patch values], `grid` its (t, h, w) patch
    grid; its embeddings fill prompt positions [offset, offset + num_tokens) (the placeholder tokens).
    audio: `values` are log-mel features [mel bins, frames], attended to by every decoder position
    (num_tokens 0). `key`: a hash of the content, which keeps prefix-cache entries of different media apart.
    """

    kind: str  # "image" or "audio"
    key: str
    shape: list[int]
    values: bytes
    offset: int = 0
    num_tokens: int = 0
    grid: list[int] = []


# ---- scheduler -> worker ------------------------------------------------------------------------


class NewRequest(msgspec.Struct, array_like=True):
    """Sent once, the first step a request runs; the worker keeps a mirror until told it finished."""

    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    media: list[MediaInput] = []


class ScheduledRequest(msgspec.Struct, array_like=True):
    """Compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of a request this step.

    `new_block_ids` extend the worker's block table; after a preemption `reset_blocks` replaces it.
    `group_block_ids` do the same for KV groups 1, 2, ... of a model whose sliding-window layers have
    their own block tables (models/kv_groups.py).
    The worker samples a token for the request when the span reaches the end of its known tokens.
    `num_lookahead`: a decode row may speculate (worker/speculative/): the worker proposes up to that many
    tokens after its input and verifies them in the same step, returning one token more than it accepted;
    the blocks for them are in the table.
    """

    req_id: int
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int]
    reset_blocks: bool = False
    group_block_ids: list[list[int]] = []
    num_lookahead: int = 0


class StepPlan(msgspec.Struct, array_like=True, tag=True):
    """One step. With overlap the plan may arrive before the previous step's result was seen by the
    scheduler: a decode's input token is then the one the worker sampled last, which it holds."""

    step_id: int
    new_requests: list[NewRequest]
    scheduled: list[ScheduledRequest]
    preempted_req_ids: list[int]  # KV freed; the worker keeps tokens and sampling state
    finished_req_ids: list[int]  # drop every trace of these


class ShutdownWorker(msgspec.Struct, array_like=True, tag=True):
    """Orderly stop: the worker exits its loop."""


class LoraAdapter(msgspec.Struct, array_like=True):
    """A LoRA adapter: the id requests use (SamplingParams.lora_id, never reused), its name, its directory."""

    lora_id: int
    name: str
    path: str


class LoadLora(msgspec.Struct, array_like=True, tag=True):
    """Load an adapter beside the step loop; answered with LoraLoaded (token: the frontend's control request)."""

    token: int
    frontend_id: int
    adapter: LoraAdapter


class DropLora(msgspec.Struct, array_like=True, tag=True):
    """Free an adapter no request uses any more."""

    lora_id: int


class PrepareGrammar(msgspec.Struct, array_like=True, tag=True):
    """Build the matcher of a constrained request's grammar beside the step loop; answered with
    GrammarReady, after which the scheduler may schedule the request (its matcher is then a copy)."""

    rid: int
    grammar: str


class Sleep(msgspec.Struct, array_like=True, tag=True):
    """Free the KV cache (level 1) and the weights too (level 2); sent only with no request on the worker.
    Answered with ResidencyDone."""

    level: int


class WakeUp(msgspec.Struct, array_like=True, tag=True):
    """Make the weights and the KV cache resident again; answered with ResidencyDone."""


class LoadWeights(msgspec.Struct, array_like=True, tag=True):
    """Read new weights from `path` beside the step loop; answered with ResidencyDone (kind "load")."""

    path: str


class SwapWeights(msgspec.Struct, array_like=True, tag=True):
    """Serve the weights LoadWeights read (no request on the worker); answered with ResidencyDone."""


WorkerInbox = (StepPlan | ShutdownWorker | LoadLora | DropLora | PrepareGrammar | Sleep | WakeUp | LoadWeights
               | SwapWeights)


# ---- worker -> scheduler ------------------------------------------------------------------------


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens [start, start + len(logprobs)) given the tokens before each."""

    req_id: int
    start: int
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


class PooledOutput(msgspec.Struct, array_like=True):
    """An embedding request's pooled hidden state: float32 values, raw (not normalised)."""

    req_id: int
    values: bytes


class DraftOutcome(msgspec.Struct, array_like=True):
    """A speculating request's step: tokens proposed, and how many of them the target model accepted."""

    req_id: int
    proposed: int
    accepted: int


class StepResult(msgspec.Struct, array_like=True, tag=True):
    """Sampled tokens for the scheduled requests whose span reached its end, in plan order.

    token_ids is parallel to req_ids; logprobs too, and empty unless some request asked for logprobs.
    A request that speculated (num_lookahead) has one entry per token it gained, consecutive and in order.
    failed_req_ids: requests whose processing raised (errors: one message each); the worker skips
    them until told they finished. cut_short_req_ids: requests whose token is an EOS that ends a grammar
    the sampler closed early to fit max_tokens: they finish with LENGTH.
    """

    step_id: int
    req_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[PromptLogprobs] = []
    failed_req_ids: list[int] = []
    errors: list[str] = []
    pooled: list[PooledOutput] = []  # embedding requests whose prompt completed (their token is a placeholder)
    cut_short_req_ids: list[int] = []
    seconds: float = 0.0  # the worker's time on this step (forward and sampling): the scheduler's pacing
    # A mixture of experts: the step's tokens routed to each expert, summed over its layers (none: no experts).
    expert_tokens: list[int] = []
    drafts: list[DraftOutcome] = []  # the speculating requests' proposals and acceptances


# ---- frontend -> scheduler ----------------------------------------------------------------------


class GenerateRequest(msgspec.Struct, array_like=True, tag=True):
    rid: int
    input_ids: list[int]
    sampling: SamplingParams
    frontend_id: int = 0
    arrival_time: float = 0.0
    names: list[str] = []  # the client's names for it, for AbortNamed
    media: list[MediaInput] = []  # images in the prompt, or the audio a Whisper window transcribes


class AbortRequest(msgspec.Struct, array_like=True, tag=True):
    rid: int


class AbortNamed(msgspec.Struct, array_like=True, tag=True):
    """Abort every request the client knows by `name` (an SGLang rid, an OpenAI response id or an
    X-Request-Id), whichever frontend it came through."""

    name: str


class ControlRequest(msgspec.Struct, array_like=True, tag=True):
    """kind: "stats", answered with EngineStats; "flush_cache", "load_lora" (name, path),
    "unload_lora" (name), "sleep" (level), "wake_up", "update_weights" (path) and "sync" (nothing: its
    reply follows every EngineState and LoraRegistry sent to that frontend before it), answered with ControlReply.
    Replies carry the same token."""

    kind: str
    token: int
    frontend_id: int = 0
    name: str = ""
    path: str = ""
    level: int = 0


class LoraLoaded(msgspec.Struct, array_like=True, tag=True):
    """The worker's answer to LoadLora: error is empty on success."""

    token: int
    frontend_id: int
    adapter: LoraAdapter
    error: str = ""


class GrammarReady(msgspec.Struct, array_like=True, tag=True):
    """The worker's answer to PrepareGrammar: error is empty when the matcher is built."""

    rid: int
    error: str = ""


class FrontendRestarted(msgspec.Struct, array_like=True, tag=True):
    """A frontend process the launcher started again after it died: the requests its last life sent
    have no client any more and are aborted. Sent before anything else the new life sends."""

    frontend_id: int


class ResidencyDone(msgspec.Struct, array_like=True, tag=True):
    """The worker's answer to Sleep, WakeUp, LoadWeights and SwapWeights: kind is "sleep", "wake",
    "load" or "swap"; error is empty on success."""

    kind: str
    error: str = ""
    weights_path: str = ""


SchedulerInbox = (GenerateRequest | AbortRequest | AbortNamed | ControlRequest | StepResult | LoraLoaded
                  | GrammarReady | FrontendRestarted | ResidencyDone)


# ---- scheduler -> frontend ----------------------------------------------------------------------


class TokenOutput(msgspec.Struct, array_like=True):
    """What one request gained in one scheduler step. finish_reason is a FinishReason value or None.
    cached_tokens: prompt tokens whose KV came from the prefix cache (decided when first scheduled)."""

    rid: int
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: int | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs | None] = []
    error: str | None = None
    prompt_logprobs: list[PromptLogprobs] = []
    queue_time: float | None = None  # on the finishing output: seconds waiting before first scheduled
    cached_tokens: int = 0
    error_kind: int = 0  # an ErrorKind, with `error`
    embedding: bytes | None = None  # an embedding request's PooledOutput values


class TokenBatch(msgspec.Struct, array_like=True, tag=True):
    """Every request of one frontend that advanced in one scheduler step: never one message per token."""

    outputs: list[TokenOutput]


class EngineStats(msgspec.Struct, array_like=True, tag=True):
    token: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    total_requests: int
    completed_requests: int
    prompt_tokens_total: int
    generation_tokens_total: int
    avg_decode_tokens_per_sec: float
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_cached_blocks: int = 0
    step_age: float = 0.0  # seconds the oldest step in flight has run (0: none); the watchdog's probe
    expert_tokens: list[int] = []  # tokens routed to each expert so far, summed over the layers (/metrics)
    # Speculative decoding so far: steps that proposed tokens, tokens proposed, tokens accepted, and
    # acceptances by position in the proposal (vLLM's spec_decode counters).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []


class ControlReply(msgspec.Struct, array_like=True, tag=True):
    token: int
    ok: bool
    message: str = ""
    status: int = 0  # the HTTP status a refusal fits (400, 404)


class LoraRegistry(msgspec.Struct, array_like=True, tag=True):
    """Every adapter loaded now, sent to every frontend after a load or unload."""

    adapters: list[LoraAdapter]


class EngineState(msgspec.Struct, array_like=True, tag=True):
    """Sent to every frontend when the model falls asleep, wakes or changes weights."""

    sleep_level: int  # 0: awake
    weights_path: str


FrontendInbox = TokenBatch | EngineStats | ControlReply | LoraRegistry | EngineState


# ---- worker -> launcher (once, over the start-up pipe) -------------------------------------------


class RankInfo(msgspec.Struct):
    """One tensor-parallel worker rank, for /server_info and the start-up line."""

    rank: int
    node: int  # --node-rank of the host it runs on
    device: str  # "Cuda(1)", or "Cpu" and the cores it runs on, e.g. "Cpu(cores 0-7)"
    weights_bytes: int  # the weights this rank holds


class WorkerReady(msgspec.Struct):
    """Facts the worker learned at start-up; the launcher hands them to the scheduler and frontend."""

    num_blocks: int
    block_size: int
    kv_bytes_per_token: int  # of one block id (every layer, or one KV group), per token
    kv_budget_bytes: int
    weights_bytes: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    arch: str
    device: str  # crane-oai's label, for people: "Cuda(0)" or "Cpu"
    dtype: str
    isa: str  # the CPU tier in use (worker/kernels/cpu_isa.py), e.g. "avx2"
    kernel_isa: str  # the tier our native CPU kernels run at, or "portable" (torch ops)
    model_format: str = "safetensors"  # or "gguf"
    weight_types: str = ""  # a GGUF file's tensor types, e.g. "Q4_K x 169, Q6_K x 29, F32 x 57"
    weights_file_bytes: int = 0  # bytes of tensor data in the model file(s)
    hidden_size: int = 0  # the width of an embedding
    device_type: str = "cpu"  # torch's device type ("cpu", "cuda"): what code decides on
    kv_cache_dtype: str = ""  # the KV cache's storage, e.g. "float16"
    prefill_seconds_per_token: float = 0.0  # CPU: the warm-up step's time per token (0: unknown)
    quantized_activations: str = "n/a"  # GGUF matmuls: "int8" or "float" activations; "n/a" without GGUF
    activation_bytes: int = 0  # the memory plan's reserve for a step's temporaries
    whole_prompts: bool = False  # an encoder: each prompt runs whole in one step, without the prefix cache
    whole_images: bool = False  # an image's placeholders attend both ways: computed in one step (Gemma 3)
    tensor_parallel_size: int = 1
    nnodes: int = 1
    ranks: list[RankInfo] = []  # every worker rank, by rank (weights_bytes above is rank 0's)
    # Per KV group (models/kv_groups.py): 0 (full attention) or its sliding layers' window.
    kv_windows: list[int] = msgspec.field(default_factory=lambda: [0])
    kv_bytes_per_long_token: int = 0  # what a token keeps once a sequence is past its sliding windows
    model_impl: str = "native"  # or "transformers": transformers' modeling code on our engine (slower)
    # A hybrid model's state pool (worker/cache/state_pool.py): the sequences it holds recurrent state
    # for (the scheduler runs no more at once), and one sequence's bytes; 0 without recurrent layers.
    state_slots: int = 0
    state_bytes_per_seq: int = 0
    hf_model_type: str = ""  # transformers' model_type of the checkpoint (what the transformers backend runs)
