"""What a Whisper checkpoint's generation_config.json (and config.json) tell transformers' generate, read
as plain JSON, and the language names and codes of its language tokens. No torch; transformers only
inside functions (its language table)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crane_mp.frontend.web.errors import ApiError

INPUT_STRIDE = 2  # mel frames per encoder position (the encoder's convolutions have strides 1 and 2)


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """The generation-config fields Whisper's generate reads. Token lists are empty and optional ids
    None where the checkpoint has none (an English-only model has no language or task tokens)."""

    decoder_start_token_id: int
    eos_token_id: int
    vocab_size: int
    max_target_positions: int  # decoder positions: prompt + generated tokens of one window
    num_segment_frames: int  # mel frames of one window (3000: 30 s)
    no_timestamps_token_id: int | None = None
    lang_to_id: dict[str, int] | None = None  # "<|en|>" -> id
    task_to_id: dict[str, int] | None = None  # "transcribe" / "translate" -> id
    is_multilingual: bool | None = None
    forced_decoder_ids: list[list[int | None]] | None = None  # the legacy prompt layout, e.g. [[1, None], [2, 50359]]
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    max_initial_timestamp_index: int | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None
    return_timestamps: bool = False
    language: str | None = None  # defaults a checkpoint may carry
    task: str | None = None

    @property
    def timestamp_begin(self) -> int:
        """The id of <|0.00|> (the token after <|notimestamps|>); without one, no id is a timestamp."""
        return self.no_timestamps_token_id + 1 if self.no_timestamps_token_id is not None else self.vocab_size + 1

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> GenerationSettings:
        """Read `model_dir`'s generation_config.json as transformers loads it: a field it lacks is unset
        (only forced_decoder_ids and the start/end ids are then looked up in config.json, as generate
        does); without the file, the generation fields of config.json."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        path = model_dir / "generation_config.json"
        generation = json.loads(path.read_text()) if path.is_file() else config

        def field(name: str, default: Any = None, from_config: bool = False) -> Any:
            value = generation.get(name)
            if value is None and from_config:
                value = config.get(name)
            return default if value is None else value

        eos = field("eos_token_id", from_config=True)
        return cls(
            decoder_start_token_id=field("decoder_start_token_id", from_config=True),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            vocab_size=config["vocab_size"],
            max_target_positions=config.get("max_target_positions", 448),
            num_segment_frames=INPUT_STRIDE * config.get("max_source_positions", 1500),
            no_timestamps_token_id=field("no_timestamps_token_id"),
            lang_to_id=field("lang_to_id"),
            task_to_id=field("task_to_id"),
            is_multilingual=field("is_multilingual"),
            forced_decoder_ids=field("forced_decoder_ids", from_config=True),
            suppress_tokens=tuple(field("suppress_tokens", ())),
            begin_suppress_tokens=tuple(field("begin_suppress_tokens", ())),
            max_initial_timestamp_index=field("max_initial_timestamp_index"),
            max_length=field("max_length"),
            max_new_tokens=field("max_new_tokens"),
            return_timestamps=bool(field("return_timestamps", False)),
            language=field("language"),
            task=field("task"),
        )

def language_token_id(settings: GenerationSettings, language: str) -> int:
    """The id of `language`'s token, given as transformers accepts it ("en", "english" or "<|en|>");
    ApiError(400, param "language") when the model has no such token."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    lang_to_id = settings.lang_to_id or {}
    name = language.lower()
    if name in lang_to_id:
        token = name
    elif name in TO_LANGUAGE_CODE:
        token = f"<|{TO_LANGUAGE_CODE[name]}|>"
    elif name in TO_LANGUAGE_CODE.values():
        token = f"<|{name}|>"
    else:
        raise ApiError(400, f"unsupported language {language!r}: give an ISO-639-1 code such as 'en'", "language")
    if token not in lang_to_id:
        raise ApiError(400, f"this model has no {token} language token", "language")
    return lang_to_id[token]


def language_name(settings: GenerationSettings, token_id: int | None) -> str:
    """OpenAI's name for the language of `token_id` ("english"); an English-only model's is English."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    code = next((token[2:-2] for token, id_ in (settings.lang_to_id or {}).items() if id_ == token_id), "en")
    return LANGUAGES.get(code, code)
