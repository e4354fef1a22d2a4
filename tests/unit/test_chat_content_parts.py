"""Chat content given as a list of text parts renders as the checkpoint's template renders it: a template
that reads parts gets them (as transformers' apply_chat_template hands them over: Qwen2.5-VL's
concatenates them), one that reads strings only gets them joined by newlines (as vLLM does)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from crane_mp.frontend.serving.tokenizer import TokenizerService
from crane_mp.testing.make_model import make_model
from crane_mp.testing.make_vl import CHAT_TEMPLATE as VL_TEMPLATE

# Qwen3's own rule: content that is not a string renders as nothing.
STRING_ONLY = (
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Prints the content whatever it is: a list would show as its repr.
PRINTS_ANYTHING = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{{- message.content }}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PARTS = [{"type": "text", "text": "Describe"}, {"type": "text", "text": " the weather."}]


def _service(tmp_path, template: str) -> TokenizerService:
    make_model("qwen3", "tiny", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return TokenizerService(str(tmp_path))


def _render(service: TokenizerService, messages: list) -> str:
    return service.render_chat(messages, True, False, None)


def test_a_template_reading_parts_gets_them_as_transformers_gives_them(tmp_path):
    service = _service(tmp_path, VL_TEMPLATE)
    assert service.template_reads_parts
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": PARTS}]
    reference = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert _render(service, messages) == reference
    assert "Describe the weather." in reference


@pytest.mark.parametrize("template", [STRING_ONLY, PRINTS_ANYTHING], ids=["string-only", "prints-anything"])
def test_a_template_reading_strings_gets_the_parts_joined_by_newlines(tmp_path, template):
    service = _service(tmp_path, template)
    assert not service.template_reads_parts
    as_parts = _render(service, [{"role": "user", "content": PARTS}])
    assert as_parts == _render(service, [{"role": "user", "content": "Describe\n the weather."}])
