"""whisper_plan drives a window decoder exactly as transformers' Whisper generate does: with a greedy
decoder made of transformers' own forward plus our logits rules, the tokens, segments and seconds equal
`model.generate(...)`'s, short- and long-form, with and without language, task, timestamps and prompt."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from crane_mp.frontend.audio.transcript_format import render
from crane_mp.frontend.audio.whisper_features import load_feature_extractor, log_mel
from crane_mp.frontend.audio.whisper_plan import (
    DecodedWindow,
    init_tokens,
    make_transcript,
    prompt_token_ids,
    transcribe,
)
from crane_mp.frontend.audio.whisper_settings import GenerationSettings
from crane_mp.frontend.web.errors import ApiError
from crane_mp.testing.make_whisper import make_whisper
from crane_mp.worker.sampling.whisper_logits import apply_whisper_rules


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from transformers import AutoProcessor, WhisperForConditionalGeneration

    path = make_whisper(tmp_path_factory.mktemp("whisper") / "tiny", seed=0)
    model = WhisperForConditionalGeneration.from_pretrained(path).eval()
    # A 64-wide model gains nothing from a second thread, and spinning threads on a busy 2-core host
    # slow each step several times over.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dataclasses.make_dataclass("Whisper", ["path", "model", "processor", "settings", "extractor"])(
        path, model, AutoProcessor.from_pretrained(path), GenerationSettings.from_pretrained(path),
        load_feature_extractor(path))
    torch.set_num_threads(threads)


def _audio(seconds: float, seed: int = 0) -> np.ndarray:
    """A gliding tone, on and off every ~1.7 s, in noise: 16 kHz float32."""
    t = np.arange(int(seconds * 16000)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (200 + 100 * np.sin(t)) * t) * (np.sin(2 * np.pi * 0.3 * t) > 0)
    return (tone + 0.05 * np.random.default_rng(seed).standard_normal(t.shape)).astype(np.float32)


def _reference_inputs(whisper, samples: np.ndarray):
    """The features as transformers' documentation has users compute them."""
    if len(samples) <= 30 * 16000:
        return whisper.processor(samples, sampling_rate=16000, return_tensors="pt")
    return whisper.processor(samples, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
                             return_attention_mask=True)


class GreedyDecoder:
    """The engine's part, done with transformers' forward (encoder once per window, then the decoder
    step by step on its KV cache, as generate runs it) and our apply_whisper_rules before each argmax."""

    def __init__(self, whisper, with_logprobs: bool = False) -> None:
        self.model, self.eos = whisper.model, whisper.settings.eos_token_id
        self.with_logprobs = with_logprobs
        self.calls: list[tuple[list[int], int]] = []

    async def __call__(self, window, prompt_ids, rules, max_new_tokens, temperature):
        assert window.shape == (80, 3000) and window.dtype == np.float32 and temperature == 0.0
        self.calls.append((list(prompt_ids), max_new_tokens))
        generated, logprobs = self._greedy(window, prompt_ids, rules, max_new_tokens)
        return DecodedWindow(generated, logprobs) if self.with_logprobs else generated

    @torch.no_grad()
    def _greedy(self, window, prompt_ids, rules, max_new_tokens):
        encoded = self.model.model.encoder(torch.from_numpy(window)[None])
        out = self.model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([prompt_ids]), use_cache=True)
        generated, logprobs = [], []
        while True:
            logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            apply_whisper_rules(logits, generated, rules)
            token = int(logits.argmax(-1))
            generated.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[0, token]))
            if token == self.eos or len(generated) == max_new_tokens:
                return generated, logprobs
            out = self.model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([[token]]), cache=out.cache,
                             use_cache=True)


def _check_same_as_generate(whisper, samples, *, language=None, task=None, timestamps=None, prompt=None,
                            settings=None):
    settings = settings or whisper.settings
    inputs = _reference_inputs(whisper, samples)
    features = log_mel(whisper.extractor, samples)
    np.testing.assert_array_equal(features, inputs["input_features"][0].numpy())
    prompt_ids = prompt_token_ids(whisper.processor.tokenizer, prompt, settings) if prompt else []
    kwargs = {"language": language, "task": task, "return_timestamps": timestamps}
    if prompt:
        kwargs["prompt_ids"] = torch.tensor(prompt_ids)
    expected = whisper.model.generate(**inputs, **kwargs, return_segments=True)
    decoder = GreedyDecoder(whisper)
    result = asyncio.run(transcribe(features, settings, decoder, language=language, task=task, timestamps=timestamps,
                                    prompt_ids=prompt_ids))
    assert result.token_ids == expected["sequences"][0].tolist()
    assert [(s.start, s.end, s.token_ids) for s in result.segments] == [
        (float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in expected["segments"][0]]
    tokenizer = whisper.processor.tokenizer
    transcript = make_transcript(result, settings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                 len(samples) / 16000)
    assert transcript.text == whisper.processor.batch_decode(expected["sequences"], skip_special_tokens=True)[0]
    return result, decoder


@pytest.mark.parametrize("language, task, timestamps", [
    (None, None, None), (None, "translate", True), ("de", "transcribe", False), ("en", None, True),
    ("french", "translate", None)])
def test_short_form_equals_generate(whisper, language, task, timestamps):
    result, decoder = _check_same_as_generate(whisper, _audio(5.0), language=language, task=task,
                                              timestamps=timestamps)
    assert len(result.token_ids) > 5  # the tiny model says something before EOS
    if language is None:  # detection: one step over the language tokens from <|startoftranscript|>
        assert decoder.calls[0] == ([whisper.settings.decoder_start_token_id], 1)
        features = _reference_inputs(whisper, _audio(5.0))["input_features"]
        assert result.language_id == int(whisper.model.detect_language(features)[0])


@pytest.mark.parametrize("language, task", [(None, None), ("fr", "translate")])
def test_long_form_equals_generate(whisper, language, task):
    result, _ = _check_same_as_generate(whisper, _audio(65.0, seed=1), language=language, task=task, timestamps=True)
    assert result.num_windows > 2
    assert len({segment.seek for segment in result.segments}) > 1  # segments from more than one window
    assert any(token >= whisper.settings.timestamp_begin for token in result.token_ids)


def test_prompt_equals_generate(whisper):
    result, decoder = _check_same_as_generate(whisper, _audio(5.0), language="en", timestamps=True,
                                              prompt="hello there")
    prev = whisper.processor.tokenizer.convert_tokens_to_ids("<|startofprev|>")
    assert all(prompt[0] == prev for prompt, _ in decoder.calls)


def test_window_budget_grows_as_generate_does(whisper):
    """A small max_length: each window stops on the budget, not EOS; generate adds every window's init
    tokens to max_length again, so the budget grows window by window."""
    whisper.model.generation_config.max_length = 12
    try:
        settings = dataclasses.replace(whisper.settings, max_length=12)
        _, decoder = _check_same_as_generate(whisper, _audio(65.0, seed=2), language="en", timestamps=True,
                                             settings=settings)
    finally:
        whisper.model.generation_config.max_length = whisper.settings.max_length
    budgets = [max_new for _, max_new in decoder.calls]
    assert budgets[:3] == [12, 15, 18]


def test_transcript_carries_logprobs_and_renders(whisper):
    settings = whisper.settings
    features = log_mel(whisper.extractor, _audio(5.0))
    result = asyncio.run(transcribe(features, settings, GreedyDecoder(whisper, with_logprobs=True), language="es",
                                    timestamps=True))
    tokenizer = whisper.processor.tokenizer
    transcript = make_transcript(result, settings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), 5.0)
    assert transcript.language == "spanish" and transcript.task == "transcribe"
    assert all(segment.avg_logprob < 0 for segment in transcript.segments)
    assert all("<|" not in segment.text for segment in transcript.segments)
    content_type, body = render(transcript, "srt")
    assert body.startswith("1\n00:00:") and content_type.startswith("text/plain")


def test_init_tokens_follow_transformers(whisper):
    settings = whisper.settings
    sot, en, translate, transcribe_id, no_ts = 401, 402, 409, 410, 414
    assert init_tokens(settings, None, None, False).ids == [sot, transcribe_id, no_ts]  # forced ids; language later
    assert init_tokens(settings, None, None, False).language_missing
    # So a transcription route may pass task "transcribe" or none: generate starts the same.
    assert init_tokens(settings, None, "transcribe", False) == init_tokens(settings, None, None, False)
    assert init_tokens(settings, "en", None, True).ids == [sot, en, transcribe_id]
    assert init_tokens(settings, None, "translate", True).ids == [sot, translate]
    assert init_tokens(settings, "<|en|>", "translate", False).ids == [sot, en, translate, no_ts]
    with pytest.raises(ApiError) as err:
        init_tokens(settings, "klingon", None, False)
    assert err.value.status == 400 and err.value.param == "language"


def test_refuses_what_the_model_cannot_do(whisper):
    features = np.zeros((80, 3000), dtype=np.float32)
    english_only = dataclasses.replace(whisper.settings, is_multilingual=False)
    no_timestamps = dataclasses.replace(whisper.settings, no_timestamps_token_id=None)
    for settings, kwargs in [(english_only, {"language": "fr"}), (english_only, {"task": "translate"}),
                             (whisper.settings, {"task": "summarize"}), (no_timestamps, {"timestamps": True})]:
        with pytest.raises(ApiError) as err:
            asyncio.run(transcribe(features, settings, GreedyDecoder(whisper), **kwargs))
        assert err.value.status == 400
    with pytest.raises(ApiError, match="English-only: it cannot transcribe language 'fr'"):
        asyncio.run(transcribe(features, english_only, GreedyDecoder(whisper), language="fr"))
    with pytest.raises(ApiError) as err:
        prompt_token_ids(whisper.processor.tokenizer, "hi <|en|>", whisper.settings)
    assert err.value.param == "prompt"


def test_an_english_only_model_takes_english_as_openai_clients_name_it(whisper):
    """OpenAI clients send language=en: an English-only model transcribes as without a language."""
    features = np.zeros((80, 3000), dtype=np.float32)
    english_only = dataclasses.replace(whisper.settings, is_multilingual=False, lang_to_id=None, task_to_id=None)
    plain = asyncio.run(transcribe(features, english_only, GreedyDecoder(whisper)))
    for language in ("en", "English", "<|en|>"):
        result = asyncio.run(transcribe(features, english_only, GreedyDecoder(whisper), language=language))
        assert result == plain
    assert asyncio.run(transcribe(features, english_only, GreedyDecoder(whisper), task="transcribe")) == plain


def test_a_long_prompt_keeps_its_last_tokens(whisper):
    """As OpenAI's Whisper: <|startofprev|> and the last 223 text tokens (half the decoder's positions)."""
    tokenizer = whisper.processor.tokenizer
    text = " ".join(f"word{i}" for i in range(400))
    ids = prompt_token_ids(tokenizer, text, whisper.settings)
    full = tokenizer.get_prompt_ids(text, return_tensors="np").tolist()
    assert len(ids) == 224 and ids[0] == full[0] and ids[1:] == full[-223:]


def test_settings_are_read_as_transformers_loads_them(whisper, tmp_path):
    import json
    import shutil

    shutil.copytree(whisper.path, tmp_path / "m")
    generation = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    for key in ("suppress_tokens", "decoder_start_token_id", "forced_decoder_ids"):
        del generation[key]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(generation))
    settings = GenerationSettings.from_pretrained(tmp_path / "m")
    # A field the file lacks is unset (transformers does not merge config.json into it), but the
    # start id comes from config.json; config.json has no forced ids here.
    assert settings.suppress_tokens == () and settings.begin_suppress_tokens == whisper.settings.begin_suppress_tokens
    assert settings.decoder_start_token_id == whisper.settings.decoder_start_token_id
    assert settings.forced_decoder_ids is None
    (tmp_path / "m" / "generation_config.json").unlink()
    from_config = GenerationSettings.from_pretrained(tmp_path / "m")
    assert from_config.suppress_tokens == whisper.settings.suppress_tokens and from_config.lang_to_id is None
