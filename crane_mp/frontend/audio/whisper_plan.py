"""The decisions transformers' WhisperForConditionalGeneration.generate makes around each 30 s window
(prompt tokens, language detection, logits rules, token budget, where the next window starts),
driving an injected `decode` that runs one window through the engine. No torch.

transformers' greedy generate, as mirrored here (condition_on_prev_tokens off, no temperature
fallback or no-speech thresholds: the defaults of every released checkpoint):

    features [n_mels, frames]; frames <= 3000 is short-form, else long-form (timestamps forced on)
    seek = 0
    language unknown and the model has language tokens -> decode([sot], only language tokens, 1 token)
    while seek < frames:
        window = features[:, seek : seek + 3000], zero-padded to 3000
        generated = decode(window, prompt_ids + init tokens, rules, budget)
        segments, advance = split_window(generated without EOS); seek += advance
    tokens = all segments' tokens, concatenated (what generate returns)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import numpy as np

from crane_mp.frontend.audio.transcript_format import Transcript, TranscriptSegment, compression_ratio
from crane_mp.frontend.audio.whisper_segments import Segment, split_window
from crane_mp.frontend.audio.whisper_settings import INPUT_STRIDE, GenerationSettings, language_name, language_token_id
from crane_mp.frontend.web.errors import ApiError
from crane_mp.protocol import WhisperDecoding

TASKS = ("transcribe", "translate")
_DEFAULT_MAX_NEW_TOKENS = 20  # GenerationMixin's when a config sets neither max_length nor max_new_tokens


@dataclass(frozen=True, slots=True)
class DecodedWindow:
    """What `decode` may return instead of a bare id list: `logprobs` of the sampled tokens (EOS's
    included), which become the segments' avg_logprob."""

    token_ids: list[int]
    logprobs: list[float] | None = None


# decode(window [n_mels, 3000] float32, prompt_ids, rules, max_new_tokens, temperature) -> the generated
# ids (after the prompt; a final EOS may be there or not). temperature 0: greedy.
Decode = Callable[[np.ndarray, list[int], WhisperDecoding, int, float], Awaitable["list[int] | DecodedWindow"]]


@dataclass(slots=True)
class WhisperResult:
    """token_ids: what transformers' generate returns for the audio (init tokens and EOS excluded);
    language_id: the language token in the prompt (given or detected), None without one."""

    token_ids: list[int]
    segments: list[Segment]
    language_id: int | None
    task: str | None
    num_windows: int


async def transcribe(features: np.ndarray, settings: GenerationSettings, decode: Decode, *,
                     language: str | None = None, task: str | None = None, timestamps: bool | None = None,
                     prompt_ids: Sequence[int] = (), temperature: float = 0.0) -> WhisperResult:
    """Transcribe (or translate) the log-mel `features` ([n_mels, frames], whisper_features.log_mel) as
    `model.generate(features, language=, task=, return_timestamps=, prompt_ids=)` does, one `decode`
    call per window, in order (each window's start depends on the previous one's timestamps).

    timestamps None: the checkpoint's default (generation_config.return_timestamps); long-form audio
    always decodes with timestamps. prompt_ids: transformers' prompt_ids (<|startofprev|> + text ids,
    prompt_token_ids), put before every window's init tokens. ApiError(400) for a language, task or
    timestamps the model cannot do."""
    language = language if language is not None else settings.language
    task = task if task is not None else settings.task
    _check_language_and_task(settings, language, task)
    if settings.is_multilingual is False:  # English, as OpenAI clients say: its prompt has no such tokens
        language = task = None
    num_frames = features.shape[-1]
    timestamps = settings.return_timestamps if timestamps is None else timestamps
    timestamps = timestamps or num_frames > settings.num_segment_frames  # long-form seeks by timestamps
    if timestamps and settings.no_timestamps_token_id is None:
        raise ApiError(400, "this model cannot predict timestamps (it has no <|notimestamps|> token)")
    init = init_tokens(settings, language, task, timestamps)
    if init.language_missing:
        init.ids.insert(1, await detect_language(features, settings, decode))
    prompt = [*prompt_ids, *init.ids]
    rules = window_rules(settings, timestamps)
    budget = WindowBudget(settings)
    segments: list[Segment] = []
    seek = num_windows = 0
    while seek < num_frames:
        window_frames = min(num_frames - seek, settings.num_segment_frames)
        window = padded_window(features, seek, window_frames, settings.num_segment_frames)
        decoded = _as_decoded(await decode(window, prompt, rules, budget.max_new_tokens(len(prompt)), temperature))
        generated = decoded.token_ids
        if generated and generated[-1] == settings.eos_token_id:
            generated = generated[:-1]
        found, advance = split_window(generated, seek, window_frames, settings.timestamp_begin, INPUT_STRIDE)
        avg_logprob = sum(decoded.logprobs) / len(decoded.logprobs) if decoded.logprobs else None
        segments += [Segment(s.seek, s.start, s.end, s.token_ids, temperature, avg_logprob) for s in found]
        # A closing pair at <|0.00|> (only possible without the timestamp rules) would never advance:
        # transformers loops forever there; we move on.
        seek += advance or window_frames
        num_windows += 1
    language_ids = set((settings.lang_to_id or {}).values())
    language_id = next((token for token in init.ids if token in language_ids), None)
    return WhisperResult([t for s in segments for t in s.token_ids], segments, language_id, task, num_windows)


def make_transcript(result: WhisperResult, settings: GenerationSettings, detokenize: Callable[[list[int]], str],
                    duration: float) -> Transcript:
    """The response-ready transcript. `detokenize(ids)` must be the Whisper tokenizer's
    `decode(ids, skip_special_tokens=True)` (it drops the timestamp tokens), so `text` is exactly
    `batch_decode(generate(...), skip_special_tokens=True)[0]`, unstripped (OpenAI strips it).
    A translation's language is English. no_speech_prob is not computed (0.0); avg_logprob is 0.0 when
    `decode` gave no logprobs; compression_ratio is over each segment's own text."""
    segments = []
    for i, segment in enumerate(result.segments):
        text = detokenize(segment.token_ids)
        segments.append(TranscriptSegment(
            id=i, seek=segment.seek, start=segment.start, end=segment.end, text=text, tokens=segment.token_ids,
            temperature=segment.temperature, avg_logprob=segment.avg_logprob or 0.0,
            compression_ratio=compression_ratio(text), no_speech_prob=0.0))
    language = "english" if result.task == "translate" else language_name(settings, result.language_id)
    return Transcript(result.task or "transcribe", language, duration, detokenize(result.token_ids), segments)


def _as_decoded(decoded: list[int] | DecodedWindow) -> DecodedWindow:
    return decoded if isinstance(decoded, DecodedWindow) else DecodedWindow(list(decoded))


@dataclass(slots=True)
class InitTokens:
    """The decoder's start: <|startoftranscript|>, language, task, <|notimestamps|>. language_missing:
    the language token is to be detected and inserted at index 1."""

    ids: list[int]
    language_missing: bool


def init_tokens(settings: GenerationSettings, language: str | None, task: str | None,
                timestamps: bool) -> InitTokens:
    """transformers' `_retrieve_init_tokens` for one audio: the legacy forced_decoder_ids give the layout
    only when neither language nor task is given."""
    ids: list[int | None] = [settings.decoder_start_token_id]
    if task is None and language is None and settings.forced_decoder_ids:
        forced = list(settings.forced_decoder_ids)
        position = 1
        while forced and forced[0][0] == position:
            ids.append(forced.pop(0)[1])
            position += 1
    if language is not None:
        ids.append(language_token_id(settings, language))  # ids is [sot]: forced ids are ignored
        language_missing = False
    else:
        language_missing = settings.lang_to_id is not None and (len(ids) <= 1 or ids[1] is None)
        if language_missing and len(ids) > 1:
            ids.pop(1)  # the detected language goes here
    task_to_id = settings.task_to_id or {}
    if task is not None:
        # transformers appends the task after any forced one (its replace step discards its result).
        ids.append(task_to_id[task])
    elif language is not None and task_to_id and not any(i in ids for i in task_to_id.values()):
        ids.append(task_to_id["transcribe"])
    if settings.no_timestamps_token_id is not None:
        if not timestamps and ids[-1] != settings.no_timestamps_token_id:
            ids.append(settings.no_timestamps_token_id)
        elif timestamps and ids[-1] == settings.no_timestamps_token_id:
            ids.pop()
    return InitTokens([i for i in ids if i is not None], language_missing)


async def detect_language(features: np.ndarray, settings: GenerationSettings, decode: Decode) -> int:
    """transformers' `detect_language`: one greedy step from <|startoftranscript|> over the first 30 s,
    restricted to the language tokens."""
    window_frames = min(features.shape[-1], settings.num_segment_frames)
    window = padded_window(features, 0, window_frames, settings.num_segment_frames)
    rules = WhisperDecoding(only_tokens=sorted(set((settings.lang_to_id or {}).values())))
    decoded = _as_decoded(await decode(window, [settings.decoder_start_token_id], rules, 1, 0.0))
    return decoded.token_ids[0]


def window_rules(settings: GenerationSettings, timestamps: bool) -> WhisperDecoding:
    """The logits processors generate builds (`_retrieve_logit_processors`), as data for the worker."""
    return WhisperDecoding(
        suppress_tokens=list(settings.suppress_tokens),
        begin_suppress_tokens=list(settings.begin_suppress_tokens),
        timestamps=timestamps,
        timestamp_begin=settings.timestamp_begin if timestamps else 0,
        no_timestamps_token_id=settings.no_timestamps_token_id or 0,
        eos_token_id=settings.eos_token_id,
        max_initial_timestamp_index=settings.max_initial_timestamp_index if timestamps else None,
    )


class WindowBudget:
    """New tokens each window may generate (`_set_max_new_tokens_and_length`). Generate grows its
    max_length by each window's initial tokens, cumulatively across windows, capped at the decoder's
    positions; hence one object per audio."""

    def __init__(self, settings: GenerationSettings) -> None:
        self.settings = settings
        self.max_length = settings.max_length

    def max_new_tokens(self, prompt_len: int) -> int:
        settings = self.settings
        limit = settings.max_target_positions
        if settings.max_new_tokens is not None:
            if settings.max_new_tokens + prompt_len > limit:
                raise ApiError(400, f"the prompt ({prompt_len} tokens with the start tokens) leaves no room for "
                                    f"max_new_tokens={settings.max_new_tokens} in {limit} positions", "prompt")
            return settings.max_new_tokens
        if self.max_length is None:
            return _DEFAULT_MAX_NEW_TOKENS
        self.max_length = min(self.max_length + min(limit // 2 - 1, prompt_len), limit)
        return max(1, self.max_length - prompt_len)


def padded_window(features: np.ndarray, seek: int, num_frames: int, window_frames: int) -> np.ndarray:
    """features[:, seek : seek + num_frames], zero-padded on the right to `window_frames` (as
    `_get_input_segment` pads: zeros, not the log-mel of silence)."""
    window = np.zeros((features.shape[0], window_frames), dtype=np.float32)
    window[:, :num_frames] = features[:, seek:seek + num_frames]
    return window


def prompt_token_ids(tokenizer, text: str, settings: GenerationSettings) -> list[int]:
    """OpenAI's `prompt` as transformers' prompt_ids: <|startofprev|> + the ids of " " + text.strip()
    (WhisperTokenizer.get_prompt_ids), keeping, as OpenAI's Whisper does, only the last text tokens
    that fit half the decoder's positions. ApiError(400, param "prompt") when it spells special tokens."""
    try:
        ids = [int(i) for i in tokenizer.get_prompt_ids(text, return_tensors="np")]
    except ValueError as err:
        raise ApiError(400, str(err), "prompt") from err
    max_text_tokens = settings.max_target_positions // 2 - 1
    return ids[:1] + ids[1:][-max_text_tokens:]


def _check_language_and_task(settings: GenerationSettings, language: str | None, task: str | None) -> None:
    if settings.is_multilingual is False:
        if language is not None and not _names_english(language):
            raise ApiError(400, f"this model is English-only: it cannot transcribe language {language!r}", "language")
        if task not in (None, "transcribe"):
            raise ApiError(400, f"this model is English-only: it only transcribes, it cannot {task}")
        return
    if task is not None and (task not in TASKS or task not in (settings.task_to_id or {})):
        raise ApiError(400, f"this model cannot {task}")
    if language is not None and settings.lang_to_id is None:
        raise ApiError(400, "this model has no language tokens", "language")


def _names_english(language: str) -> bool:
    """`language` as transformers accepts it ("en", "english", "<|en|>"), in any case, names English."""
    return language.lower() in ("en", "english", "<|en|>")
