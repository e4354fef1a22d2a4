"""Multi-token prediction: the checkpoint's prediction layer (models/nextn.py) proposes each
speculating request's next tokens from the target's own hidden states.

Its KV cache holds the target's first KV group's block ids, as a draft model's does. Every row the
target computes for a sequence is fed to the layer at the end of that step (`feed`), with the token
after it, which is known by then: its KV keeps up with the target's, prompts and requests that do not
speculate included (one layer's work a row), and it keeps its output at each sequence's last row,
which makes the first proposal. Further proposals are decode rows of the layer fed its own output;
their KV rows are overwritten by the next feed. Positions the prefix cache gave a sequence are not fed
again: the layer's rows there are the ones the request that computed them fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crane_mp.config import MAX_SPECULATIVE_TOKENS
from crane_mp.worker.cache.attention import SeqSpan
from crane_mp.worker.step.host_buffers import device_longs

_DECODE_ROWS = 1 + MAX_SPECULATIVE_TOKENS  # runs of at most this many fed rows are decode rows (draft.py's)


@dataclass(slots=True)
class FedRows:
    """One sequence's rows of a target step: positions [start, start + count), their rows of the step's
    hidden states from `first_row`, and the token after each."""

    req_id: int
    start: int
    first_row: int
    next_tokens: list[int]
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

    @torch.inference_mode()
    def feed(self, rows: list[FedRows], hidden: torch.Tensor) -> None:
        """The layer's KV for a target step's rows (`hidden`: the step's hidden states)."""
        rows = sorted((r for r in rows if r.next_tokens), key=lambda r: len(r.next_tokens) > _DECODE_ROWS)
        if not rows:
            return
        decodes, prefills, input_ids, positions, picked, last_rows = [], [], [], [], [], []
        for fed in rows:
            count = len(fed.next_tokens)
            if count <= _DECODE_ROWS:
                decodes.extend(SeqSpan(fed.start + i, 1, fed.block_table) for i in range(count))
            else:
                prefills.append(SeqSpan(fed.start, count, fed.block_table))
            input_ids.extend(fed.next_tokens)
            positions.extend(range(fed.start, fed.start + count))
            picked.extend(range(fed.first_row, fed.first_row + count))
            last_rows.append(len(input_ids) - 1)
        self.layer.previous_hidden = self.target_norm(hidden.index_select(0, device_longs(picked, hidden.device)))
        try:
            out = self.runner.forward(decodes, prefills, input_ids, positions, needed_rows=last_rows)
        finally:
            self.layer.previous_hidden = None
        for fed, row in zip(rows, last_rows):
            self.computed[fed.req_id] = fed.start + len(fed.next_tokens)
            self.last[fed.req_id] = out[row].clone()

    @torch.inference_mode()
    def propose(self, batch: list[tuple[int, list[int], list[int], int]]) -> dict[int, list[int]]:
        """batch: (req id, token ids, block table, tokens wanted) per speculating request. A request the
        layer has not caught up with (its last step not fed) proposes nothing."""
        proposals = {req_id: [] for req_id, *_ in batch}
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

    def forget(self, req_id: int) -> None:
        self.reset(req_id)
