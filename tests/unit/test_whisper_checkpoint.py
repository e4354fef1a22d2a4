"""make_whisper writes a checkpoint transformers loads as a real Whisper one: processor, tokenizer with
Whisper's special and timestamp tokens where generate expects them, seeded weights; and the frontend's
Whisper modules stay free of torch and transformers at import."""

from __future__ import annotations

import json

from safetensors.torch import load_file
from transformers import AutoProcessor, AutoTokenizer, WhisperConfig, WhisperFeatureExtractor

from crane_mp.testing.make_whisper import LANGUAGES, main, make_whisper
from tests.unit.test_import_boundaries import imported_after


def test_transformers_loads_it_as_whisper(tmp_path):
    path = make_whisper(tmp_path / "w", seed=3)
    assert {"config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    config = WhisperConfig.from_pretrained(path)
    shape = (config.d_model, config.encoder_layers, config.decoder_layers, config.decoder_attention_heads)
    assert shape == (64, 2, 2, 4)
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "WhisperProcessor"
    assert isinstance(WhisperFeatureExtractor.from_pretrained(path), WhisperFeatureExtractor)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size

    generation = json.loads((path / "generation_config.json").read_text())
    ids = tokenizer.convert_tokens_to_ids
    no_timestamps = generation["no_timestamps_token_id"]
    assert ids("<|notimestamps|>") == no_timestamps
    assert ids("<|0.00|>") == no_timestamps + 1 and ids("<|30.00|>") == no_timestamps + 1501 == len(tokenizer) - 1
    assert generation["decoder_start_token_id"] == ids("<|startoftranscript|>") == config.decoder_start_token_id
    assert generation["eos_token_id"] == ids("<|endoftext|>") == tokenizer.eos_token_id
    assert generation["lang_to_id"] == {f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES}
    assert generation["task_to_id"] == {"translate": ids("<|translate|>"), "transcribe": ids("<|transcribe|>")}
    assert generation["suppress_tokens"][-2] == generation["prev_sot_token_id"] == ids("<|startofprev|>")
    # The tokenizer finds a language token by its place in transformers' table: ours follow that order.
    tokenizer.set_prefix_tokens(language="chinese", task="translate")
    assert tokenizer.prefix_tokens == [ids("<|startoftranscript|>"), ids("<|zh|>"), ids("<|translate|>"),
                                       no_timestamps]
    text = " the model server"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_seeded_and_written_by_the_command(tmp_path):
    main(["--out", str(tmp_path / "a"), "--seed", "7"])
    make_whisper(tmp_path / "b", seed=7)
    make_whisper(tmp_path / "c", seed=8)
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert a.keys() == b.keys() and "proj_out.weight" not in a  # tied to the token embeddings, as HF saves it
    assert all((a[name] == b[name]).all() for name in a)
    assert not (a["model.decoder.embed_tokens.weight"] == c["model.decoder.embed_tokens.weight"]).all()
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "c" / "tokenizer.json").read_text()


def test_frontend_whisper_modules_import_neither_torch_nor_transformers():
    code = ("import crane_mp.frontend.audio.decode, crane_mp.frontend.audio.transcript_format, crane_mp.frontend.audio.whisper_plan, "
            "crane_mp.frontend.audio.whisper_features")
    assert imported_after(code, ("torch", "transformers")) == []
