"""gpt-oss's tool calls, as the harmony splitter (serving/harmony.py) hands them on from the commentary
channel: CALL_OPEN `functions.NAME<|message|>` then the JSON arguments then CALL_CLOSE, one per call.
A call's name is sent once its header is whole, its arguments as they arrive."""

from __future__ import annotations

from crane_mp.frontend.serving.harmony import CALL_CLOSE, MESSAGE
from crane_mp.frontend.tools.formats import ToolFormat, new_call_id
from crane_mp.frontend.tools.json_scanner import is_json
from crane_mp.frontend.tools.parser import ParsedCall, ToolCallParser, merge_deltas

_FUNCTIONS = "functions."  # the namespace harmony's templates put the offered tools in


class HarmonyCallParser(ToolCallParser):
    """ToolCallParser's contract (content before the first call, OpenAI `delta.tool_calls` items,
    `well_formed`) for harmony's calls; text between calls is dropped."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        super().__init__(fmt, parallel)
        self.region = ""  # the text after the last call's opening (or after the last closed call)
        self.in_call = False  # the last call's header was read: its arguments are arriving
        self.between = False  # after a closed call: waiting for the next one

    @property
    def well_formed(self) -> bool:
        return self.calls_whole

    def _scan(self, text: str) -> list[dict]:
        if not self.calls:
            self.unread += text
        self.region += text
        opening = self.fmt.markers[0]
        deltas: list[dict] = []
        while self.region:
            if self.between:
                start = self.region.find(opening)
                if start < 0 or not self.parallel:  # keep only what may be an opening arriving
                    self.region = "" if not self.parallel else self.region[-(len(opening) - 1):]
                    break
                self.region, self.between = self.region[start + len(opening):], False
            if not self.in_call:
                header = self.region.find(MESSAGE)
                if header < 0:
                    break
                name = self.region[:header].strip().removeprefix(_FUNCTIONS)
                self.calls.append(ParsedCall(new_call_id(self.fmt), name=name or None))
                deltas.append({"index": len(self.calls) - 1, "id": self.calls[-1].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.region, self.in_call = self.region[header + len(MESSAGE):], True
            call = self.calls[-1]
            end = self.region.find(CALL_CLOSE)
            arrived = self.region if end < 0 else self.region[:end]
            if end < 0:  # an end of the text that may be the close arriving stays in the region
                arrived = arrived[: len(arrived) - _close_prefix_length(arrived)]
            if arrived:
                call.arguments += arrived
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": arrived}})
            if end < 0:
                self.region = self.region[len(arrived):]
                break
            call.complete = is_json(call.arguments)
            self.region, self.in_call, self.between = self.region[end + len(CALL_CLOSE):], False, True
        return merge_deltas(deltas)


def _close_prefix_length(text: str) -> int:
    for size in range(min(len(CALL_CLOSE) - 1, len(text)), 0, -1):
        if CALL_CLOSE.startswith(text[-size:]):
            return size
    return 0
