"""Locally trained byte-level BPE tokenizers with each model family's special tokens and chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from crane_mp.testing.corpus import corpus

# Same split rule as the Llama-3 / Qwen2 tokenizers (digits stay single, so numbers never merge).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The tokenizer must not change when the model seed does, so the corpus seed is fixed.
_CORPUS_SEED = 1234

# Renders string content, or the text parts of OpenAI-style content lists.
_TEXT_MACRO = (
    r"{%- macro text(c) %}{%- if c is string %}{{- c }}{%- elif c is iterable %}{%- for p in c %}"
    r"{%- if p['type'] == 'text' %}{{- p['text'] }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
)

_LLAMA_TEMPLATE = _TEXT_MACRO + r"""
{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + text(message['content']) | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

_QWEN2_TEMPLATE = _TEXT_MACRO + r"""
{%- if not messages or messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\n' + text(message['content']) + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# Like Qwen3: reasoning is dropped from assistant turns that precede the last user query; tools are
# listed in the system turn, calls written as <tool_call> JSON, results returned in a user turn.
_QWEN3_TEMPLATE = _TEXT_MACRO + r"""
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0]['role'] == 'system' %}{{- text(messages[0]['content']) + '\n\n' }}{%- endif %}
{{- 'Functions you can call, one JSON signature per line:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nTo call one, answer with <tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = text(message['content']) %}
{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if message['role'] == 'system' and tools and loop.first %}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|im_start|>assistant\n' + content }}
{%- for call in message['tool_calls'] %}
{%- set arguments = call['function']['arguments'] %}
{{- '\n<tool_call>\n{"name": ' + (call['function']['name'] | tojson) + ', "arguments": ' }}
{{- (arguments if arguments is string else arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}"""

# Mistral v0.3 style: the system prompt is folded into the last user turn; [/INST] is the generation cue.
_MISTRAL_TEMPLATE = _TEXT_MACRO + r"""
{%- set ns = namespace(system='', last_user=-1) %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{%- set ns.system = text(message['content']) %}
{%- elif message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}
{%- if loop.index0 == ns.last_user and ns.system %}
{{- '[INST] ' + ns.system + '\n\n' + text(message['content']) + '[/INST]' }}
{%- else %}
{{- '[INST] ' + text(message['content']) + '[/INST]' }}
{%- endif %}
{%- elif message['role'] == 'assistant' %}
{{- text(message['content']) + eos_token }}
{%- elif message['role'] != 'system' %}
{{- raise_exception('Unsupported role: ' + message['role']) }}
{%- endif %}
{%- endfor %}"""

# Hunyuan style: every exchange opens with <|startoftext|>; <|extra_0|> ends the user turn and cues the reply.
_HUNYUAN_TEMPLATE = _TEXT_MACRO + r"""
{%- set ns = namespace(open=false) %}
{%- for message in messages %}
{%- if not ns.open %}{{- bos_token }}{%- set ns.open = true %}{%- endif %}
{%- if message['role'] == 'system' %}
{{- text(message['content']) + '<|extra_4|>' }}
{%- elif message['role'] == 'user' %}
{{- text(message['content']) + '<|extra_0|>' }}
{%- elif message['role'] == 'assistant' %}
{{- text(message['content']) + eos_token }}{%- set ns.open = false %}
{%- else %}
{{- raise_exception('Unsupported role: ' + message['role']) }}
{%- endif %}
{%- endfor %}"""


@dataclass(frozen=True)
class FamilySpec:
    """Special-token layout of one model family; `added` is (content, is_special) in id order."""

    added: tuple[tuple[str, bool], ...]
    added_first: bool  # Mistral keeps <unk>/<s>/</s> at ids 0-2; the others append specials after BPE
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    add_bos: bool
    config_bos: str | None  # Qwen sets config.bos_token_id although its tokenizer never adds a BOS
    config_eos: tuple[str, ...]
    generation_eos: tuple[str, ...]
    chat_template: str
    eod: str | None = None  # Hunyuan's end-of-document token (config.eod_token_id)


def _specials(*names: str) -> tuple[tuple[str, bool], ...]:
    return tuple((name, True) for name in names)


_LLAMA3_ADDED = _specials(
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)
_CHATML_ADDED = _specials("<|endoftext|>", "<|im_start|>", "<|im_end|>")

FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(
        added=_LLAMA3_ADDED, added_first=False, bos="<|begin_of_text|>", eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>", unk=None, add_bos=True, config_bos="<|begin_of_text|>",
        config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), chat_template=_LLAMA_TEMPLATE,
    ),
    "qwen2": FamilySpec(
        added=_CHATML_ADDED, added_first=False, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        add_bos=False, config_bos="<|endoftext|>", config_eos=("<|im_end|>",),
        generation_eos=("<|im_end|>", "<|endoftext|>"), chat_template=_QWEN2_TEMPLATE,
    ),
    "qwen3": FamilySpec(
        # As in Qwen3, the tool/think markers are added tokens but not special: decoding keeps them.
        added=_CHATML_ADDED + (("<tool_call>", False), ("</tool_call>", False), ("<think>", False),
                               ("</think>", False)),
        added_first=False, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False,
        config_bos="<|endoftext|>", config_eos=("<|im_end|>",), generation_eos=("<|im_end|>", "<|endoftext|>"),
        chat_template=_QWEN3_TEMPLATE,
    ),
    "mistral": FamilySpec(
        added=_specials("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), added_first=True, bos="<s>", eos="</s>",
        pad=None, unk="<unk>", add_bos=True, config_bos="<s>", config_eos=("</s>",), generation_eos=("</s>",),
        chat_template=_MISTRAL_TEMPLATE,
    ),
    "hunyuan": FamilySpec(
        added=_specials("<|endoftext|>", "<|startoftext|>", "<|eos|>", "<|pad|>", "<|extra_0|>", "<|extra_1|>",
                        "<|extra_2|>", "<|extra_3|>", "<|extra_4|>"),
        added_first=False, bos="<|startoftext|>", eos="<|eos|>", pad="<|pad|>", unk=None, add_bos=False,
        config_bos="<|startoftext|>", config_eos=("<|eos|>",), generation_eos=("<|eos|>",),
        chat_template=_HUNYUAN_TEMPLATE, eod="<|endoftext|>",
    ),
}


@dataclass(frozen=True)
class TokenIds:
    """Ids that config.json / generation_config.json must agree on; eos is a list when the family stops on several."""

    bos: int | None
    eos: int | list[int]
    pad: int | None
    generation_eos: list[int]
    eod: int | None


def train_tokenizer(family: str, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE whose vocabulary, added tokens included, is exactly `vocab_size`."""
    spec = FAMILIES[family]
    added = [AddedToken(content, special=special, normalized=False) for content, special in spec.added]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size if spec.added_first else vocab_size - len(added),
        special_tokens=added if spec.added_first else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Bigger vocabularies need more distinct merges, hence a corpus that grows with the vocab.
    tok.train_from_iterator(corpus(max(2000, 3 * vocab_size), seed=_CORPUS_SEED), trainer=trainer)
    for token in added:
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"trained vocab is {tok.get_vocab_size(with_added_tokens=True)}, wanted {vocab_size}")
    if spec.add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos}:0 $A:0", pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
            special_tokens=[(spec.bos, tok.token_to_id(spec.bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(family: str, vocab_size: int, model_max_length: int, out_dir: Path,
                    trained: int | None = None) -> TokenIds:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the ids configs need.
    `trained`: train that many tokens and fill the rest of `vocab_size` with <unusedN> vocabulary entries
    (no merge reaches them), as large vocabularies (Gemma's 262k) hold unused tokens; training that
    many merges would take long, and as added tokens they would slow every tokenizer that loads them."""
    spec = FAMILIES[family]
    tok = train_tokenizer(family, trained or vocab_size)
    if trained is not None and vocab_size > trained:
        data = json.loads(tok.to_str())
        data["model"]["vocab"].update({f"<unused{i}>": trained + i for i in range(vocab_size - trained)})
        # Added tokens keep their ids only where the vocabulary holds them too.
        data["model"]["vocab"].update({token["content"]: token["id"] for token in data["added_tokens"]})
        tok = Tokenizer.from_str(json.dumps(data))
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {content: tok.token_to_id(content) for content, _ in spec.added}
    named = {"bos_token": spec.bos, "eos_token": spec.eos, "pad_token": spec.pad, "unk_token": spec.unk}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": special}
            for content, special in spec.added
        },
        "chat_template": spec.chat_template,
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    write_json(out_dir / "special_tokens_map.json", {k: v for k, v in named.items() if v is not None})
    config_eos = [ids[t] for t in spec.config_eos]
    return TokenIds(
        bos=ids[spec.config_bos] if spec.config_bos else None,
        eos=config_eos[0] if len(config_eos) == 1 else config_eos,
        pad=ids[spec.pad] if spec.pad else None,
        generation_eos=[ids[t] for t in spec.generation_eos],
        eod=ids[spec.eod] if spec.eod else None,
    )


def write_json(path: Path, obj: object) -> None:
    """Pretty UTF-8 JSON, as Hugging Face writes its checkpoint files."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
