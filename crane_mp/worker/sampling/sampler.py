"""Batched sampling on the device, with per-request sampling state (seeds, penalty rows, grammar matchers).

Order per row, as vLLM applies it: raw logprobs -> grammar mask (structured output) -> logit_bias and
min_tokens suppression -> repetition, frequency and presence penalties -> temperature -> min_p -> top_k
-> top_p -> draw. A seeded request's
noise is a function of its seed and output position, so its tokens do not depend on what else is in the
batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from crane_mp.protocol import SamplingParams, ThinkingBudget, TokenLogprobs
from crane_mp.worker.platforms import Platform
from crane_mp.worker.sampling.grammar import GrammarEngine
from crane_mp.worker.sampling.penalties import PenaltyTable
from crane_mp.worker.sampling.seeded_noise import row_keys, uniform_from_keys
from crane_mp.worker.step.host_buffers import device_bools, device_floats, device_longs


@dataclass(slots=True)
class SamplingState:
    """Worker-side per-request state, created when the request is first seen."""

    params: SamplingParams
    penalty_row: int | None = None  # the request's row of the sampler's PenaltyTable
    num_output_tokens: int = 0
    suppress_ids: list[int] = field(default_factory=list)  # stop ids masked until min_tokens
    bias_ids: list[int] = field(default_factory=list)  # logit_bias within the vocabulary
    bias_values: list[float] = field(default_factory=list)
    matcher: object | None = None  # llguidance matcher of a constrained request (grammar.py)
    thinking: bool = False  # inside the answer's think block (params.thinking)
    thought: int = 0  # tokens written inside it
    closing: list[int] = field(default_factory=list)  # forced tokens that end the grammar within max_tokens
    closing_room: int = -1  # tokens the grammar needed to end at the last measure (-1: not measured yet)
    closing_measured: int = 0  # num_output_tokens at that measure
    cut_short: bool = False  # the grammar was ended early to fit max_tokens: the request's EOS means LENGTH


class Sampler:
    """Samples a batch with a fixed number of device ops whatever its size: every processor works on
    all rows that use it at once (one scatter for biases, one gather for penalties), and a draw inverts
    each row's CDF at one uniform per row, a seeded row's counter-based (seeded_noise.py) instead of
    stepping a generator per row."""

    def __init__(self, vocab_size: int, platform: Platform, grammars: GrammarEngine | None = None) -> None:
        self.vocab_size = vocab_size
        self.platform = platform
        self.device = device = platform.device
        self.grammars = grammars
        self.penalties = PenaltyTable(vocab_size, device)
        self._shared_generator = torch.Generator(device=device)
        self._shared_generator.manual_seed(torch.initial_seed() % (2**63))

    def new_state(self, params: SamplingParams, prompt_ids: list[int], eos_ids: tuple[int, ...],
                  req_id: int | None = None) -> SamplingState:
        """A request's sampling state; `req_id` names the request whose matcher was prepared
        (GrammarEngine.prepare), None where none was."""
        state = SamplingState(params)
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine was built without structured output")
            state.matcher = self.grammars.new_matcher(req_id, params.grammar)
        if params.logit_bias:
            biases = [(t, v) for t, v in params.logit_bias.items() if 0 <= t < self.vocab_size]
            state.bias_ids = [t for t, _ in biases]
            state.bias_values = [float(v) for _, v in biases]
        if params.thinking is not None:
            state.thinking = params.thinking.opened
        if params.min_tokens > 0:
            stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
            state.suppress_ids = [t for t in stop_ids if 0 <= t < self.vocab_size]
        if params.uses_penalties:
            state.penalty_row = self.penalties.acquire(prompt_ids)
        return state

    @staticmethod
    def plain_greedy(state: SamplingState) -> bool:
        """The row's token is its logits' argmax now and for as long as it runs: no processor, logprobs,
        grammar or thinking budget (which may start processing later)."""
        params = state.params
        return (params.greedy and params.logprobs is None and params.grammar is None and params.thinking is None
                and not _processed(state))

    def release(self, state: SamplingState) -> None:
        """The request finished: its penalty row goes back to the table."""
        if state.penalty_row is not None:
            self.penalties.release(state.penalty_row)
            state.penalty_row = None

    def record(self, states: list[SamplingState], tokens: list[int]) -> None:
        """Account tokens that became part of the requests' outputs (tokens[i] for states[i])."""
        penalised_rows, penalised_tokens = [], []
        for state, token in zip(states, tokens):
            state.num_output_tokens += 1
            thought = False
            if state.params.thinking is not None:
                thought = _follow_thinking(state, state.params.thinking, token)
            if state.matcher is not None and not thought:
                # A token the mask allowed always fits; if not, the matcher only allows EOS from now on.
                state.matcher.consume_token(token)
                if state.closing and state.closing.pop(0) != token:
                    state.closing.clear()
            if state.penalty_row is not None:
                penalised_rows.append(state.penalty_row)
                penalised_tokens.append(token)
        if penalised_rows:
            self.penalties.record(device_longs(penalised_rows, self.device), device_longs(penalised_tokens, self.device))

    def sample(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, vocab] (any float dtype; float32 rows may be processed in place); returns one token
        id per row and logprobs where asked. Rows go through in passes of at most rows_per_pass(), so
        the [rows, vocabulary] temporaries stay bounded whatever the batch; reading the sampled ids
        back once is the step's only wait on the device (and a rare second one, see _redo)."""
        params = [s.params for s in states]
        greedy_only = all(p.greedy for p in params)
        max_top = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        uniform = None if greedy_only else self._uniforms(states)
        # A plain argmax needs no [rows, vocabulary] temporaries beyond the float32 logits: one pass.
        plain = greedy_only and max_top < 0 and not any(_processed(s) for s in states)
        step = max(1, len(states)) if plain else self.rows_per_pass()
        tokens, checked_rows, checks, scores, top_ids = [], [], [], [], []
        for lo in range(0, len(states), step):
            rows = slice(lo, lo + step)
            pass_tokens, truncated, covered, pass_scores = self._sample_pass(
                logits[rows], states[rows], None if uniform is None else uniform[rows], max_top)
            tokens.append(pass_tokens)
            if covered is not None:
                checked_rows += [lo + row for row in truncated]
                checks.append(covered.long())
            if pass_scores is not None:
                scores.append(pass_scores[0])
                top_ids.append(pass_scores[1])
        values = torch.cat(tokens + checks).tolist()  # the step's wait on the device
        token_list = values[: len(states)]
        redo = [row for row, ok in zip(checked_rows, values[len(states):]) if not ok]
        redone: dict[int, tuple[int, float | None]] = {}
        for lo in range(0, len(redo), self.rows_per_pass()):
            redone.update(self._redo(logits, states, uniform, redo[lo : lo + self.rows_per_pass()], max_top >= 0))
        for row, (token, _) in redone.items():
            token_list[row] = token
        if max_top < 0:
            return token_list, []
        return token_list, self._logprobs(torch.cat(scores).tolist(), torch.cat(top_ids).tolist(), params, redone)

    def profile(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        """The sampler's largest footprint, for the memory plan: sample() these rows, then one pass of them
        redone over the whole vocabulary (what flat top_p rows cost at run time)."""
        self.sample(logits, states)
        rows = list(range(min(len(states), self.rows_per_pass())))
        self._redo(logits, states, self._uniforms(states), rows, want_logprobs=True)

    def rows_per_pass(self) -> int:
        return max(8, _PASS_BYTES // (self.vocab_size * _PASS_BYTES_PER_LOGIT))

    def peak_bytes(self, rows: int) -> int:
        """Device memory a sample() of `rows` rows with every processor on may hold at its peak: one pass's
        temporaries, the float32 logits, and a penalty-table row per row (memory plan estimate on CPU)."""
        temporaries = (min(rows, self.rows_per_pass()) * _PASS_BYTES_PER_LOGIT + rows * 4) * self.vocab_size
        return temporaries + rows * PenaltyTable.row_bytes(self.vocab_size)

    def _sample_pass(
        self, logits: torch.Tensor, states: list[SamplingState], uniform: torch.Tensor | None, max_top: int
    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Device tokens of these rows in row order; the rows drawn among candidates and whether each
        draw is final (None: all are); with logprobs wanted (max_top >= 0), [rows, 1 + max_top] float32
        scores (each row's sampled token's logprob first, then its top values) and [rows, max_top] ids."""
        params = [s.params for s in states]
        work = logits.float()
        if work.data_ptr() == logits.data_ptr() and any(not p.greedy and self._truncates(p) for p in params):
            work = work.clone()  # processors work in place, and _redo may read the caller's logits again
        raw_logprobs = torch.log_softmax(work, dim=-1) if max_top >= 0 else None
        work = self._apply_processors(work, states)
        truncated: list[int] = []
        covered = None
        if all(p.greedy for p in params):
            tokens = self.platform.argmax_rows(work)
        else:
            tokens, truncated, covered = self._draw(work, params, uniform)
        if raw_logprobs is None:
            return tokens, truncated, covered, None
        top_values, top_ids = raw_logprobs.topk(max_top, dim=-1)
        scores = torch.cat([raw_logprobs.gather(1, tokens[:, None]), top_values], dim=1)
        return tokens, truncated, covered, (scores, top_ids)

    def _apply_processors(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        # A grammar waits while its answer thinks (a prompt that opened thinking: ThinkingBudget).
        constrained = [row for row, state in enumerate(states) if state.matcher is not None and not state.thinking]
        if constrained:
            self.grammars.mask(logits, constrained, [states[row].matcher for row in constrained])
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        penalised: list[int] = []
        for row, state in enumerate(states):
            if state.bias_ids:
                rows += [row] * len(state.bias_ids)
                ids += state.bias_ids
                values += state.bias_values
            # min_tokens yields to a grammar that is complete (only EOS left): else no token would remain.
            if (state.suppress_ids and state.num_output_tokens < state.params.min_tokens
                    and not (state.matcher is not None and state.matcher.is_stopped())):
                rows += [row] * len(state.suppress_ids)
                ids += state.suppress_ids
                values += [-_SUPPRESSED] * len(state.suppress_ids)
            if state.thinking and state.thought >= state.params.thinking.max_tokens:  # the budget is spent
                rows.append(row)
                ids.append(state.params.thinking.end_token)
                values.append(_SUPPRESSED)
            elif state.matcher is not None and (closing := self._closing_token(state)) is not None:
                rows.append(row)
                ids.append(closing)
                values.append(_SUPPRESSED)
            if state.penalty_row is not None:
                penalised.append(row)
        if rows:
            logits.index_put_((device_longs(rows, self.device), device_longs(ids, self.device)),
                              device_floats(values, self.device), accumulate=True)
        if penalised:
            index = device_longs(penalised, self.device)
            table_rows = device_longs([states[r].penalty_row for r in penalised], self.device)
            picked = [states[r].params for r in penalised]
            penalised_logits = self.penalties.apply(
                logits.index_select(0, index), table_rows,
                self._column([p.repetition_penalty for p in picked], 1.0),
                self._column([p.frequency_penalty for p in picked], 0.0),
                self._column([p.presence_penalty for p in picked], 0.0),
            )
            logits.index_copy_(0, index, penalised_logits)
        return logits

    def _closing_token(self, state: SamplingState) -> int | None:
        """The token a constrained request must take now for its grammar to end within max_tokens
        (`</think>` first while it thinks), or None while there is room. A truncated JSON is no JSON:
        once the next free token could leave too little room (one that opens a property, say), the
        grammar's completion path is forced, and the request reports length."""
        if state.closing:
            return state.closing[0]
        left = state.params.max_tokens - state.num_output_tokens
        if not state.thinking and state.matcher.is_accepting():
            return self._ending_token(state, left)
        reserve = 1 if state.thinking else 0  # its </think>
        if (state.closing_room >= 0 and left > state.closing_room + reserve + _CLOSING_WINDOW
                and state.num_output_tokens - state.closing_measured < _CLOSING_REMEASURE):
            return None
        budget = left - reserve
        path = self.grammars.closing_path(state.matcher, min(budget, _CLOSING_LONGEST))
        state.closing_measured = state.num_output_tokens
        if path is None:  # longer than the budget (too late to close), or than is worth a walk yet
            state.closing_room = _UNREACHABLE if budget <= _CLOSING_LONGEST else _CLOSING_LONGEST
            return None
        room = len(path)
        if not state.thinking and budget <= room + _CLOSING_WINDOW:
            room = max(room, self.grammars.longest_after_opening(state.matcher, budget))
        state.closing_room = room
        if not path or budget > room + _CLOSING_MARGIN:
            return None
        state.cut_short = True
        if state.thinking:
            return state.params.thinking.end_token
        state.closing = path
        return path[0]

    def _ending_token(self, state: SamplingState, left: int) -> int | None:
        """Where the grammar may end but could go on (after a forced tool call, another call): its end,
        EOS, once every way on is known to need more than the `left` tokens to end again, so that
        max_tokens does not cut a second call short of its end; None otherwise. Each way on is walked
        (GrammarEngine.shortest_continuation) only at such states and in the last _CLOSING_LONGEST
        tokens of the budget."""
        eos = self.grammars.eos_token_ids
        if left > _CLOSING_LONGEST or not eos or state.params.ignore_eos or state.matcher.is_stopped():
            return None
        shortest = self.grammars.shortest_continuation(state.matcher, _CLOSING_LONGEST)
        if shortest is None or shortest <= left:
            return None
        state.cut_short = True
        return eos[0]

    def _column(self, values: list[float], neutral: float) -> torch.Tensor | None:
        """A [rows, 1] column of one penalty, or None where every row leaves it at its neutral value."""
        if all(v == neutral for v in values):
            return None
        return device_floats(values, self.device)[:, None]

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then min_p (greedy rows keep temperature 1: only their argmax is used)."""
        temperature = device_floats([1.0 if p.greedy else p.temperature for p in params], self.device)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = device_floats([p.min_p for p in params], self.device)
            probs = probs * (probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True))
        return probs

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams],
              uniform: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """One token per row, in row order: greedy rows take the argmax; the others invert their
        (truncated) distribution's CDF at the row's uniform. Rows with top_k/top_p draw among candidates:
        returns them and whether each draw is final."""
        probs = self._probs(logits, params)
        truncated = [row for row, p in enumerate(params) if not p.greedy and self._truncates(p)]
        plain = [row for row, p in enumerate(params) if not p.greedy and not self._truncates(p)]
        greedy = [row for row, p in enumerate(params) if p.greedy]
        parts, covered = [], None
        if greedy:
            parts.append((greedy, self.platform.argmax_rows(
                logits if len(greedy) == len(params) else self._rows(logits, greedy))))
        if plain:
            parts.append((plain, self._invert_cdf(self._rows(probs, plain), self._rows(uniform, plain))))
        if truncated:
            drawn, covered = self._draw_truncated(probs, uniform, truncated, params, _CANDIDATES)
            parts.append((truncated, drawn))
        if len(parts) == 1:
            return parts[0][1], truncated, covered
        tokens = torch.empty(len(params), dtype=torch.long, device=self.device)
        for rows, drawn in parts:
            tokens.index_copy_(0, device_longs(rows, self.device), drawn)
        return tokens, truncated, covered

    def _redo(self, logits: torch.Tensor, states: list[SamplingState], uniform: torch.Tensor, rows: list[int],
              want_logprobs: bool) -> dict[int, tuple[int, float | None]]:
        """Rare: a flat distribution whose top_p mass reaches past the candidates. Those rows draw again
        from their whole vocabulary (same uniform); returns row -> (token, its logprob if wanted)."""
        index = device_longs(rows, self.device)
        work = logits.index_select(0, index).float()
        raw_logprobs = torch.log_softmax(work, dim=-1) if want_logprobs else None
        picked = [states[r] for r in rows]
        params = [s.params for s in picked]
        probs = self._probs(self._apply_processors(work, picked), params)
        tokens, _ = self._draw_truncated(probs, uniform.index_select(0, index), list(range(len(rows))), params,
                                         self.vocab_size)
        chosen = [None] * len(rows)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        return dict(zip(rows, zip(tokens.tolist(), chosen)))

    def _truncates(self, p: SamplingParams) -> bool:
        return 0 < p.top_k < self.vocab_size or p.top_p < 1.0

    def _invert_cdf(self, probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """Index i per row with cdf[i - 1] <= u * total < cdf[i]: a draw from the row's (unnormalised)
        distribution that never lands on a zero-probability entry."""
        cdf = probs.cumsum(dim=-1)
        if not self.platform.ordered_cumsum:
            cdf = flat_at_zeros(probs, cdf)
        total = cdf[:, -1:]
        target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

    def _rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return x if len(rows) == x.shape[0] else x.index_select(0, device_longs(rows, self.device))

    def _uniforms(self, states: list[SamplingState]) -> torch.Tensor:
        """One uniform in [0, 1) per row: a seeded row's from its seed and output position, the others'
        from the sampler's generator."""
        seeded = [row for row, s in enumerate(states) if s.params.seed is not None]
        keys = row_keys([states[r].params.seed for r in seeded], [states[r].num_output_tokens for r in seeded],
                        self.device) if seeded else None
        if len(seeded) == len(states):
            return uniform_from_keys(keys)
        uniform = torch.rand(len(states), generator=self._shared_generator, device=self.device)
        if seeded:
            uniform.index_copy_(0, device_longs(seeded, self.device), uniform_from_keys(keys))
        return uniform

    def _draw_truncated(self, probs: torch.Tensor, uniform: torch.Tensor, rows: list[int],
                        params: list[SamplingParams], candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
        """top_k, then top_p on the renormalised mass (vLLM's order), among each row's `candidates` most
        likely tokens: a partial sort instead of a sort of the vocabulary. Returns the tokens and whether
        each row's kept set fits in the candidates (top_p rows of very flat distributions may not)."""
        picked = [params[r] for r in rows]
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in picked]
        count = min(self.vocab_size, max([candidates] + top_k))
        row_probs = self._rows(probs, rows)
        # Sorted, most likely first; a whole row sorts faster than a top-k of all of it.
        values, ids = row_probs.sort(dim=-1, descending=True) if count == self.vocab_size else row_probs.topk(count)
        k_limit = device_longs([k or count for k in top_k], self.device)
        has_top_k = device_bools([k > 0 for k in top_k], self.device)
        top_p = device_floats([p.top_p for p in picked], self.device)
        values = values * (torch.arange(count, device=self.device)[None, :] < k_limit[:, None])
        # Renormalise after top_k (without one, by the whole row's mass), keep the smallest prefix whose
        # mass reaches top_p (at least one token).
        mass = torch.where(has_top_k, values.sum(dim=-1), row_probs.sum(dim=-1))[:, None]
        normalised = values / mass
        reached = normalised.cumsum(dim=-1)
        kept = normalised * (reached - normalised < top_p[:, None])
        covered = has_top_k | (reached[:, -1] >= top_p) | (count == self.vocab_size)
        index = self._invert_cdf(kept, self._rows(uniform, rows))
        return ids.gather(1, index[:, None]).squeeze(1), covered

    @staticmethod
    def _logprobs(scores: list[list[float]], ids: list[list[int]], params: list[SamplingParams],
                  redone: dict[int, tuple[int, float | None]]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = []
        for row, (row_scores, row_ids, p) in enumerate(zip(scores, ids, params)):
            if p.logprobs is None:
                out.append(None)
                continue
            chosen = redone[row][1] if row in redone else row_scores[0]
            out.append(TokenLogprobs(chosen, row_ids[: p.logprobs], row_scores[1 : 1 + p.logprobs]))
        return out


# What min_tokens subtracts from a stop token's logit: finite, so penalties applied after it stay
# arithmetic (-inf * 0 is NaN), yet its probability is exactly 0.
_SUPPRESSED = 1e30

# A constrained request's completion path (GrammarEngine.closing_path, ~10 us a token) is measured every
# _CLOSING_REMEASURE tokens, and at every token once max_tokens is within _CLOSING_WINDOW of it (with
# what the next token could add to it); it is forced within _CLOSING_MARGIN of that, room for a token
# that opens more than one thing at once.
_CLOSING_REMEASURE = 16
_CLOSING_WINDOW = 32
_CLOSING_MARGIN = 4
_UNREACHABLE = 1 << 30  # no path within the budget: measured again after _CLOSING_REMEASURE tokens
_CLOSING_LONGEST = 1024  # a longer walk (a huge schema's required properties) waits for the budget to near it

# A sampling pass's float32 [rows, vocabulary] temporaries (raw logprobs, processed logits,
# probabilities, masks, candidates) take about _PASS_BYTES_PER_LOGIT bytes per logit; passes take as
# many rows as keep them under _PASS_BYTES (36 rows at a 152k vocabulary, all of a batch at 8k).
_PASS_BYTES = 256 << 20
_PASS_BYTES_PER_LOGIT = 48

# Candidates a top_k/top_p row draws from before falling back to its whole vocabulary. A partial sort
# of 256 over a 152k vocabulary costs ~4 % of a full sort on CPU, and holds the top_p set of all but
# very flat distributions.
_CANDIDATES = 256


def _processed(state: SamplingState) -> bool:
    """Whether a row's logits go through a processor before the draw (each makes [rows, vocabulary]
    temporaries)."""
    return bool(state.bias_ids or state.suppress_ids or state.penalty_row is not None or state.matcher is not None
                or state.thinking)


def _follow_thinking(state: SamplingState, budget: ThinkingBudget, token: int) -> bool:
    """Track the think block (opened by the answer's first token or by the prompt, closed by
    `</think>`); True when `token` belongs to it."""
    if state.thinking:
        if token == budget.end_token:
            state.thinking = False
        else:
            state.thought += 1
        return True
    if state.num_output_tokens == 1 and token == budget.start_token and not budget.opened:
        state.thinking = True
        return True
    return False


def flat_at_zeros(probs: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """The CDF made flat across zero-probability entries and never decreasing. CPU cumsum adds left to
    right, so it already is; CUDA's single-row scan (CUB) groups its sums by thread, so at a thread's
    first entry a zero can step the sum an ulp up (a drawable zero) or down (which searchsorted cannot
    take)."""
    return torch.where(probs > 0, cdf, torch.zeros_like(cdf)).cummax(dim=-1).values
