"""The served model's tokenizer, as the frontend (text <-> ids) and the grammar engine (which token
spells which bytes) both need it: loaded the same way in every process, so token ids agree."""

from __future__ import annotations

import logging

from crane_mp.models.gguf_file import ModelSource, resolve_model_source

# Any of these beside a GGUF file is a tokenizer the user chose over the file's metadata.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
log = logging.getLogger("crane_mp")


def load_tokenizer(model_path: str, model_format: str = "auto"):
    """The tokenizer of the model at --model-path/--format (the frontend's entry: it resolves the path)."""
    return source_tokenizer(resolve_model_source(model_path, model_format))


def source_tokenizer(source: ModelSource):
    """The model's tokenizer: its files, or for a GGUF file without them, the one transformers builds
    from the file's tokenizer.ggml.* metadata (vocabulary, merges, token types, special ids, template)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source.format != "gguf" or any((source.model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(str(source.model_dir))
    # The generic fast tokenizer, not AutoTokenizer: that one first reads the file's config through the
    # gguf package's reader, 6-10 s for a 150k vocabulary, only to pick a class with the same backend
    # (and knows no config for hunyuan-dense).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source.model_dir), gguf_file=source.gguf_file.name)
    backend = tokenizer.backend_tokenizer
    model = backend.model
    if getattr(model, "unk_token", None) and model.unk_token not in backend.get_vocab(with_added_tokens=False):
        # transformers names `<unk>` for a file whose model vocabulary has none (llama.cpp's Gemma 4
        # conversion of a vocabulary without it): every encode would raise; text it cannot spell is dropped.
        log.warning("the GGUF vocabulary has no %s token: text it cannot spell is dropped", model.unk_token)
        model.unk_token = None
    return tokenizer


def grammar_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the vocabulary: `vocab_size` is the model's logits width (often padded past
    the tokenizer's last id; those rows are never allowed), widened to the tokenizer's own size where
    that is larger (transformers' GGUF conversion may add tokens past the file's table: ids the logits
    never hold). Every EOS id the model stops on ends a finished grammar (llguidance before 1.7 takes
    one: the first). Masks are `.vocab_size` bits wide."""
    from llguidance import LLTokenizer

    backend = hf_tokenizer.backend_tokenizer
    spec = backend.to_str()
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    try:
        return LLTokenizer(spec, n_vocab=n_vocab, eos_token=list(eos_token_ids) or None)
    except TypeError:
        return LLTokenizer(spec, n_vocab=n_vocab, eos_token=eos_token_ids[0] if eos_token_ids else None)
