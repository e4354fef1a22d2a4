"""A draft model: a small model of the target's tokenizer proposes each speculating request's next
tokens, greedily, one forward per token.

It runs in the worker beside the target, with a KV cache of its own that holds the same block ids as
the target's first KV group: the scheduler's block tables serve both, and the memory plan counts both
caches per token. Its KV is computed lazily: before proposing, a request's draft catches up on every
known token it has not computed (its whole prompt the first time, after a preemption, or after steps
it did not speculate in), so prompt chunks and the prefix cache are the target's business alone.
"""

from __future__ import annotations

import torch

from crane_mp.config import MAX_SPECULATIVE_TOKENS
from crane_mp.worker.cache.attention import SeqSpan
from crane_mp.worker.step.host_buffers import device_longs

# Known tokens a proposing pass computes as decode rows (the target's last step's gains at most): their
# keys then match the ones the target's decode rows computed, so an exact draft proposes what the target
# picks even at its near ties.
_DECODE_ROWS = 1 + MAX_SPECULATIVE_TOKENS


class DraftProposer:
    def __init__(self, runner, max_pass_tokens: int) -> None:
        """`runner`: a ModelRunner of the draft model, its KV cache allocated with the target's blocks;
        `max_pass_tokens`: a catch-up pass computes at most this many tokens of one request (the memory
        plan's step)."""
        self.runner = runner
        self.max_pass_tokens = max_pass_tokens
        self.computed: dict[int, int] = {}  # req id -> leading positions whose draft KV is valid

    @torch.inference_mode()
    def propose(self, batch: list[tuple[int, list[int], list[int], int]]) -> dict[int, list[int]]:
        """batch: (req id, token ids, block table, tokens wanted) per speculating request."""
        if not batch:
            return {}
        proposals = {req_id: [] for req_id, *_ in batch}
        self._catch_up(batch)
        # First pass: every known token the draft has not computed (one or two in the steady state), at
        # least the last (a step redone request by request proposes again).
        spans = [(req_id, tokens, table, min(self.computed.get(req_id, 0), len(tokens) - 1))
                 for req_id, tokens, table, _ in batch]
        spans.sort(key=lambda span: len(span[1]) - span[3] > _DECODE_ROWS)  # decode rows first
        decodes, prefills, input_ids, positions, last_rows = [], [], [], [], []
        for req_id, tokens, table, start in spans:
            end = len(tokens)
            if end - start <= _DECODE_ROWS:  # each a decode of its position, as the target attends them
                decodes.extend(SeqSpan(position, 1, table) for position in range(start, end))
            else:
                prefills.append(SeqSpan(start, end - start, table))
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            last_rows.append(len(input_ids) - 1)
            self.computed[req_id] = end
        order = [req_id for req_id, *_ in spans]
        nexts = self._greedy(decodes, prefills, input_ids, positions, last_rows)
        wanted = {req_id: count for req_id, _, _, count in batch}
        tables = {req_id: table for req_id, _, table, _ in batch}
        lengths = {req_id: len(tokens) for req_id, tokens, _, _ in batch}
        for req_id, token in zip(order, nexts):
            proposals[req_id].append(token)
        # Then one decode row per request still wanting tokens: its last proposal, one position on.
        while True:
            going = [req_id for req_id in order if len(proposals[req_id]) < wanted[req_id]]
            if not going:
                return proposals
            spans = [SeqSpan(lengths[r] + len(proposals[r]) - 1, 1, tables[r]) for r in going]
            nexts = self._greedy(spans, [], [proposals[r][-1] for r in going], [s.ctx_before for s in spans],
                                 list(range(len(going))))
            for req_id, token in zip(going, nexts):
                proposals[req_id].append(token)

    def _catch_up(self, batch: list[tuple[int, list[int], list[int], int]]) -> None:
        """Compute the draft's KV of long runs of known tokens (a prompt) one chunk per pass, each
        request's last chunk left for the proposing pass."""
        for req_id, tokens, table, _ in batch:
            start = self.computed.get(req_id, 0)
            while len(tokens) - start > self.max_pass_tokens:
                end = start + self.max_pass_tokens
                self.runner.forward([], [SeqSpan(start, end - start, table)], tokens[start:end],
                                    list(range(start, end)), needed_rows=[])
                start = self.computed[req_id] = end

    def _greedy(self, decodes: list[SeqSpan], prefills: list[SeqSpan], input_ids: list[int],
                positions: list[int], rows: list[int]) -> list[int]:
        hidden = self.runner.forward(decodes, prefills, input_ids, positions, needed_rows=sorted(rows))
        picked = hidden.index_select(0, device_longs(rows, self.runner.device))
        return self.runner.platform.argmax_rows(self.runner.model.compute_logits(picked).float()).tolist()

    def accepted(self, req_id: int, num_known: int, proposed: int, accepted: int) -> None:
        """The target kept `accepted` of `proposed` tokens after `num_known`: the draft's KV of the ones it
        fed (all but its last proposal) stays valid up to the first rejected."""
        if req_id in self.computed:
            self.computed[req_id] = num_known + min(accepted, max(0, proposed - 1))

    def reset(self, req_id: int) -> None:
        """The request's blocks were replaced (preempted, resumed): its draft KV is computed again."""
        self.computed.pop(req_id, None)

    def forget(self, req_id: int) -> None:
        self.computed.pop(req_id, None)
