"""Multi-token prediction: the checkpoint's prediction layer (models/nextn.py) proposes each
speculating request's next tokens from the target's own hidden states.

Its KV cache holds the target's first KV group's block ids, as a draft model's does. Every row the
target computes for a sequence is handed over at the end of that step (`feed`), with the token after
it, which is known by then, and runs through the layer in its next pass: before any request proposes,
or once rows pile up (a prompt chunk at once, else a few dozen decode rows): its KV keeps up with the
target's, prompts and requests that do not speculate included, for one pass of the layer per many
steps where none speculates. The pass keeps the layer's output at each sequence's last row, which
makes the first proposal; further proposals are decode rows of the layer fed its own output, whose
KV rows the next pass overwrites. Positions the prefix cache gave a sequence are not fed
again: the layer's rows there are the ones the request that computed them fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crane_mp.config import MAX_SPECULATIVE_TOKENS
from crane_mp.worker.cache.attention import SeqSpan
from crane_mp.worker.step.host_buffers import device_longs

_DECODE_ROWS = 1 + MAX_SPECULATIVE_TOKENS  # runs of at most this many fed rows are decode rows (draft.py's)
# Rows a request's feed may pile up before the layer runs over all of them: a request that does not
# speculate for a while (misses, a large batch) costs one pass of the layer per this many steps.
_PENDING_ROWS = 32


@dataclass(slots=True)
class FedRows:
    """One sequence's rows of a target step: positions [start, start + count), their rows of the step's
    hidden states from `first_row`, and the token after each."""

    req_id: int
    start: int
    first_row: int
    next_tokens: list[int]
    block_table: list[int]


@dataclass(slots=True)
class _Pending:
    """A request's rows fed since the layer's last pass: positions [start, start + len(next_tokens))."""

    start: int
    next_tokens: list[int]
    hidden: list[torch.Tensor]  # their hidden states after the target's final norm, in order
    block_table: list[int]


class MtpProposer:
    needs_hidden = True  # the runner feeds it every row of its steps (ModelRunner._feed_proposer)

    def __init__(self, runner, target_norm: torch.nn.Module) -> None:
        """`runner`: a ModelRunner of the prediction layer, its KV cache allocated with the target's
        blocks; `target_norm`: the target's final norm (the layer reads hidden states after it)."""
        self.runner = runner
        self.layer = runner.model.model
        self.target_norm = target_norm
        self.computed: dict[int, int] = {}  # req id -> positions whose layer KV holds the target's rows
        self.last: dict[int, torch.Tensor] = {}  # req id -> the layer's output at row computed - 1
        self.pending: dict[int, _Pending] = {}  # req id -> its rows fed since the layer's last pass

    @torch.inference_mode()
    def feed(self, rows: list[FedRows], hidden: torch.Tensor) -> None:
        """Take a target step's rows (`hidden`: the step's hidden states). They wait, after the target's
        final norm, for the layer's next pass: a request's next proposal, or one of them piling up
        past _PENDING_ROWS (a prompt chunk at once)."""
        rows = [fed for fed in rows if fed.next_tokens]
        if not rows:
            return
        picked = [row for fed in rows for row in range(fed.first_row, fed.first_row + len(fed.next_tokens))]
        normed = self.target_norm(hidden.index_select(0, device_longs(picked, hidden.device)))
        offset = 0
        for fed in rows:
            count = len(fed.next_tokens)
            waiting = self.pending.get(fed.req_id)
            if waiting is None or waiting.start + len(waiting.next_tokens) != fed.start:
                waiting = self.pending[fed.req_id] = _Pending(fed.start, [], [], fed.block_table)
            waiting.next_tokens += fed.next_tokens
            waiting.hidden.append(normed[offset : offset + count])
            waiting.block_table = fed.block_table
            offset += count
        if any(len(waiting.next_tokens) > _PENDING_ROWS for waiting in self.pending.values()):
            self._run_pending()

    def _run_pending(self) -> None:
        """One pass of the layer over every request's waiting rows: their KV, and its output at each
        request's last row."""
        waiting = sorted(self.pending.items(), key=lambda item: len(item[1].next_tokens) > _DECODE_ROWS)
        self.pending = {}
        if not waiting:
            return
        decodes, prefills, input_ids, positions, last_rows = [], [], [], [], []
        for _, rows in waiting:
            count = len(rows.next_tokens)
            if count <= _DECODE_ROWS:
                decodes.extend(SeqSpan(rows.start + i, 1, rows.block_table) for i in range(count))
            else:
                prefills.append(SeqSpan(rows.start, count, rows.block_table))
            input_ids.extend(rows.next_tokens)
            positions.extend(range(rows.start, rows.start + count))
            last_rows.append(len(input_ids) - 1)
        self.layer.previous_hidden = torch.cat([part for _, rows in waiting for part in rows.hidden])
        try:
            out = self.runner.forward(decodes, prefills, input_ids, positions, needed_rows=last_rows)
        finally:
            self.layer.previous_hidden = None
        for (req_id, rows), row in zip(waiting, last_rows):
            self.computed[req_id] = rows.start + len(rows.next_tokens)
            self.last[req_id] = out[row].clone()

    @torch.inference_mode()
    def propose(self, batch: list[tuple[int, list[int], list[int], int]]) -> dict[int, list[int]]:
        """batch: (req id, token ids, block table, tokens wanted) per speculating request. A request the
        layer has not caught up with (its last step not fed) proposes nothing."""
        proposals = {req_id: [] for req_id, *_ in batch}
        self._run_pending()
        going = [(req_id, len(tokens), table, wanted) for req_id, tokens, table, wanted in batch
                 if self.computed.get(req_id) == len(tokens) - 1 and req_id in self.last]
        hidden = torch.stack([self.last[req_id] for req_id, *_ in going]) if going else None
        while going:
            tokens = self._greedy(hidden)
            for (req_id, *_), token in zip(going, tokens):
                proposals[req_id].append(token)
            more = [i for i, (req_id, _, _, wanted) in enumerate(going) if len(proposals[req_id]) < wanted]
            if not more:
                break
            going = [going[i] for i in more]
            # The row after the last proposal: that token, and the layer's output at the row before it.
            spans = [SeqSpan(length + len(proposals[req_id]) - 2, 1, table) for req_id, length, table, _ in going]
            carried = hidden.index_select(0, device_longs(more, hidden.device))
            self.layer.previous_hidden = self.runner.model.carried(carried)
            try:
                hidden = self.runner.forward(spans, [], [proposals[req_id][-1] for req_id, *_ in going],
                                             [span.ctx_before for span in spans])
            finally:
                self.layer.previous_hidden = None
        return proposals

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        logits = self.runner.model.compute_logits(hidden).float()
        return self.runner.platform.argmax_rows(logits).tolist()

    def accepted(self, req_id: int, num_known: int, proposed: int, accepted: int) -> None:
        """Nothing to keep: the step's feed brings the layer up to the tokens the target kept."""

    def reset(self, req_id: int) -> None:
        """The request's blocks were replaced (preempted, resumed): it is fed again from its first row."""
        self.computed.pop(req_id, None)
        self.last.pop(req_id, None)
        self.pending.pop(req_id, None)

    def forget(self, req_id: int) -> None:
        self.reset(req_id)
