"""Reasoning models' thinking, apart from their answer. Qwen3 writes `<think> ... </think>` and then the
answer; DeepSeek-R1 and Qwen3's thinking releases get `<think>` from their chat template at the end of
the prompt and write the thinking, `</think>`, the answer; Qwen3 with `enable_thinking: false` gets an
empty `<think>\n\n</think>` in the prompt and writes the answer alone.

One rule, which a stream can follow without taking text back (vLLM's `qwen3` parser): an answer in
thinking mode is reasoning until its first `</think>`, whether or not it opened with `<think>` (a
`<think>` it opens with is dropped), and all of it when `</think>` never comes (cut off while
thinking); the rest is content. How each prompt's answer is read (reading_mode): thinking mode unless
the prompt closed a think block just before the answer (then all content) or the model's chat
template cannot think (then it thinks only inside a `<think>` it opens with).

The split is lossless: (the opening tag the response wrote) + reasoning + `</think>` + content is the
response's text, however the text arrives in pieces (a tag cut across pieces is held back until it is
whole or proves not to be one). Seed-OSS thinks between `<seed:think>` and `</seed:think>`: the tags
are per family (Markers), the rule the same. Gemma 4 opens its thinking itself, `<|channel>thought\n`
... `<channel|>` (its template's `enable_thinking` asks for it): its answers are read for a block they
open with, whatever the template (its tags are special tokens the detokenizer keeps for this reading).
gpt-oss writes harmony's channels (harmony.py): its `analysis` messages are the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from crane_mp.frontend.serving.harmony import CHANNEL, END as END_TAG, MESSAGE, HarmonySplitter


@dataclass(frozen=True, slots=True)
class Markers:
    """A family's thinking tags; `tokens`: the vocabulary tokens that tell the family (auto), the tags
    themselves where empty; `opened_by_model`: an answer thinks only inside a block it opens."""

    start: str
    end: str
    tokens: tuple[str, ...] = ()
    opened_by_model: bool = False
    harmony: bool = False  # gpt-oss's channels (harmony.py), read by their own splitter

    @property
    def vocabulary_tokens(self) -> tuple[str, ...]:
        return self.tokens or (self.start, self.end)


THINK = Markers("<think>", "</think>")  # Qwen3, DeepSeek-R1, SmolLM3, EXAONE 4, Phi-4-reasoning, GLM
SEED_THINK = Markers("<seed:think>", "</seed:think>")  # Seed-OSS
GEMMA4_THINK = Markers("<|channel>thought\n", "<channel|>", ("<|channel>", "<channel|>"), opened_by_model=True)
# gpt-oss: its analysis channel (harmony.py); the end tag is the one that closes that message.
HARMONY = Markers(CHANNEL + "analysis" + MESSAGE, END_TAG, (CHANNEL, MESSAGE), opened_by_model=True, harmony=True)
START, END = THINK.start, THINK.end
# --reasoning-parser names -> their tags; auto looks for each family's tokens in the vocabulary.
PARSER_MARKERS = {"qwen3": THINK, "deepseek_r1": THINK, "seed_oss": SEED_THINK, "gemma4": GEMMA4_THINK,
                  "gpt_oss": HARMONY, "openai_gptoss": HARMONY}

# How an answer is read for thinking (reading_mode).
THINKING = "thinking"  # reasoning from its start until the first </think>
LEADING = "leading"  # reasoning only inside a <think> ... </think> it opens with
PLAIN = "plain"  # all content


def reasoning_markers(parser: str, added_vocab: dict[str, int]) -> Markers | None:
    """The tags answers are read by, None: not read for thinking. --reasoning-parser: qwen3 and
    deepseek_r1 read the same tags (what differs, whether the prompt opens the thinking, is seen per
    request), seed_oss Seed-OSS's, gemma4 Gemma 4's; auto reads the first family whose tokens the
    vocabulary has."""
    if parser == "none":
        return None
    if parser == "auto":
        return next((m for m in (THINK, SEED_THINK, GEMMA4_THINK, HARMONY)
                     if all(token in added_vocab for token in m.vocabulary_tokens)), None)
    return PARSER_MARKERS[parser]


def template_thinks(parser: str, template_variables: frozenset[str] | None) -> bool:
    """Whether the model thinks where its prompt neither opens nor closes a think block. A parser named
    on the command line says so (as vLLM's do); `auto` asks the chat template: one that takes
    `enable_thinking` (Qwen3, GLM) thinks unless told not to, while one that does not (Qwen3's
    instruct-only releases, whose vocabulary has the tags all the same) answers plainly."""
    return parser != "auto" or template_variables is None or "enable_thinking" in template_variables


def prompt_opens_thinking(prompt: str, markers: Markers = THINK) -> bool:
    """The rendered prompt ends inside a think block (R1's template: the response starts thinking)."""
    return prompt.rfind(markers.start) > prompt.rfind(markers.end)


def reading_mode(prompt: str, continued: bool, thinks: bool, markers: Markers = THINK) -> str:
    """How the answer to a rendered chat `prompt` is read: thinking where the prompt left a think block
    open; all content where it closed one just before the answer (`enable_thinking: false`) or the answer
    continues the final message (`continued`: its text goes on as it was); otherwise thinking mode where
    the template thinks (template_thinks) and the family does not open its thinking itself. An earlier
    turn's closed block does not count: only the prompt's end does."""
    if prompt_opens_thinking(prompt, markers):
        return THINKING
    if continued or prompt.rstrip().endswith(markers.end):
        return PLAIN
    return THINKING if thinks and not markers.opened_by_model else LEADING


@dataclass(slots=True)
class ReasoningSplitter:
    """Feed a response's text piece by piece; each feed returns the (reasoning, content) it can tell
    apart so far."""

    # open: thinking, a leading <think> may still come; start: a leading <think> may come, else the
    # answer; thinking; answer
    state: str = "start"
    held: str = ""
    ended: bool = False  # the end tag was seen
    markers: Markers = THINK

    @classmethod
    def reading(cls, mode: str, markers: Markers = THINK) -> ReasoningSplitter:
        """A splitter for an answer read in `mode` (reading_mode)."""
        return cls({THINKING: "open", LEADING: "start", PLAIN: "answer"}[mode], markers=markers)

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        start, end_tag = self.markers.start, self.markers.end
        if self.state in ("open", "start"):
            if text.startswith(start):
                self.state, text = "thinking", text[len(start):]
            elif start.startswith(text):
                self.held = text  # may still become <think>
                return "", ""
            else:
                self.state = "thinking" if self.state == "open" else "answer"
        reasoning = ""
        if self.state == "thinking":
            end = text.find(end_tag)
            if end < 0:
                keep = _partial_suffix(text, end_tag)
                self.held = text[len(text) - keep:] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(end_tag):]
            self.state, self.ended = "answer", True
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What is held back at the end of the response."""
        held, self.held = self.held, ""
        return (held, "") if self.state in ("open", "thinking") else ("", held)

    @property
    def thought(self) -> bool:
        """The answer has thought so far (it is thinking, or its thinking ended)."""
        return self.state in ("open", "thinking") or self.ended


def make_splitter(mode: str, markers: Markers = THINK) -> ReasoningSplitter | HarmonySplitter:
    """A splitter for an answer read in `mode` (reading_mode) for `markers`' thinking."""
    return HarmonySplitter() if markers.harmony else ReasoningSplitter.reading(mode, markers)


def split_reasoning(mode: str, text: str, markers: Markers = THINK) -> tuple[str | None, str]:
    """A whole response's (reasoning, content), read in `mode`; reasoning None when it did not think."""
    splitter = make_splitter(mode, markers)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.thought else None), content + more_content


def reasoning_tokens(token_ids: list[int], end_token: int | None, thought: bool) -> int:
    """Output tokens spent thinking: up to and including `</think>`, all of them when it never came."""
    if not thought:
        return 0
    if end_token is not None and end_token in token_ids:
        return token_ids.index(end_token) + 1
    return len(token_ids)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
