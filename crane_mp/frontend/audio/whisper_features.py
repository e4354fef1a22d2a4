"""Whisper's log-mel features of 16 kHz samples, from the checkpoint's own WhisperFeatureExtractor,
called as transformers' documentation calls it (so the numbers are the reference's). transformers is
imported when the extractor is loaded, not with this module."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from crane_mp.frontend.audio.decode import SAMPLING_RATE


def load_feature_extractor(model_dir: str | Path):
    """The checkpoint's WhisperFeatureExtractor (preprocessor_config.json)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(str(model_dir))


def log_mel(feature_extractor, samples: np.ndarray) -> np.ndarray:
    """[n_mels, frames] float32. Up to 30 s: padded to 30 s (3000 frames), the short-form call. Longer:
    `truncation=False, padding="longest"`, the long-form call generate needs (frames = samples // hop);
    the log-mel's floor follows the loudest frame of the whole audio, so it is computed once, not per
    window."""
    if len(samples) <= feature_extractor.n_samples:
        inputs = feature_extractor(samples, sampling_rate=SAMPLING_RATE, return_tensors="np")
    else:
        inputs = feature_extractor(samples, sampling_rate=SAMPLING_RATE, return_tensors="np", truncation=False,
                                   padding="longest", return_attention_mask=True)
    return np.ascontiguousarray(inputs["input_features"][0], dtype=np.float32)
