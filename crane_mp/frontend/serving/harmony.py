"""gpt-oss's harmony format, read apart as an answer streams. The chat template ends the prompt with
`<|start|>assistant`; the answer is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The `analysis` channel is the thinking (reasoning), `final` the answer (content), `commentary` a
preamble to the user (content) or, with a recipient (`to=functions.NAME`, in the header wherever it
sits), a tool call: passed on to the tool-call reader (tools/harmony_calls.py) in one form, CALL_OPEN
NAME `<|message|>` ARGUMENTS CALL_CLOSE. An answer that opens with no header (a constrained one) is all
content. The tags are special tokens the detokenizer keeps for this reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)  # what the detokenizer must keep
CALL_OPEN = CHANNEL + "commentary to="  # a tool call as the splitter hands it to the call reader
CALL_CLOSE = CALL
_MESSAGE_ENDS = (END, RETURN, CALL)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([\w.-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(slots=True)
class HarmonySplitter:
    """ReasoningSplitter's contract (feed text, get (reasoning, content); finish; `thought`) for harmony
    answers: bodies are routed by their channel, headers and tags dropped."""

    held: str = ""  # text not yet routed: a header being read, or a tag cut across pieces
    channel: str | None = None  # the open message's channel; None: between messages (reading a header)
    call: bool = False  # the open message is a tool call
    started: bool = False  # the answer's first text was seen
    thought: bool = False  # an analysis message was opened

    def feed(self, text: str) -> tuple[str, str]:
        buffer, self.held = self.held + text, ""
        reasoning, content = [], []
        while buffer:
            if self.channel is None:
                if not self.started and not _may_be_header(buffer):
                    self.channel = "final"  # no header: a constrained (or plain) answer, all content
                    self.started = True
                    continue
                opened = buffer.find(MESSAGE)
                if opened < 0:
                    self.held = buffer
                    break
                self._open(buffer[:opened], content)
                buffer = buffer[opened + len(MESSAGE):]
                continue
            end, tag = _first_end(buffer)
            body = buffer if end < 0 else buffer[:end]
            if end < 0:  # hold back what may be the start of an end tag
                keep = _tag_prefix_length(body)
                body, self.held = body[: len(body) - keep], body[len(body) - keep:]
            (reasoning if self.channel == "analysis" else content).append(body)
            if end < 0:
                break
            if self.call:
                content.append(CALL_CLOSE)
            self.channel, self.call = None, False
            buffer = buffer[end + len(tag):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: a body's tail goes where its channel does (a call's is closed:
        the tag that ends an answer, <|return|> or <|call|>, is its stop token, not in its text); a
        header never finished says nothing."""
        held, self.held = self.held, ""
        if self.channel is None:
            return "", ""
        if self.channel == "analysis":
            return held, ""
        return "", held + (CALL_CLOSE if self.call else "")

    def _open(self, header: str, content: list[str]) -> None:
        self.started = True
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else "final"
        self.thought = self.thought or self.channel == "analysis"
        if recipient is not None and self.channel != "analysis":
            name = recipient.group(1)
            self.call = True
            content.append(f"{CALL_OPEN}{name}{MESSAGE}")


def _may_be_header(text: str) -> bool:
    """Whether an answer's opening text is (or may still become) a message header."""
    stripped = text.lstrip()
    return any(stripped.startswith(tag) or tag.startswith(stripped) for tag in (CHANNEL, START))


def _first_end(text: str) -> tuple[int, str]:
    found = [(text.find(tag), tag) for tag in _MESSAGE_ENDS if tag in text]
    return min(found) if found else (-1, "")


def _tag_prefix_length(text: str) -> int:
    """Length of the longest end of `text` that a message-ending tag starts with."""
    for size in range(min(max(len(tag) for tag in _MESSAGE_ENDS) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in _MESSAGE_ENDS):
            return size
    return 0
