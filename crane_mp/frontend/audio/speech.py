"""What the frontend of a speech-to-text server holds (--task transcribe, a Whisper checkpoint): the
generation settings generate reads, and the feature extractor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crane_mp.frontend.audio.whisper_features import load_feature_extractor
from crane_mp.frontend.audio.whisper_settings import GenerationSettings


@dataclass(slots=True)
class SpeechModel:
    settings: GenerationSettings
    feature_extractor: Any  # transformers' WhisperFeatureExtractor


def load_speech_model(model_dir: Path) -> SpeechModel:
    return SpeechModel(GenerationSettings.from_pretrained(model_dir), load_feature_extractor(model_dir))
