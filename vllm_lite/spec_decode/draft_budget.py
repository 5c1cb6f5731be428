"""When n-gram drafts pay at batch > 1: a per-step expected-gain rule on measured step costs (the default), plus
vLLM's `disable_by_batch_size`.

Why: at batch 1 a request's k drafts ride nearly free (a verify step of 1 + k rows costs about what a plain
step does), but at batch B > 1 a verify step costs a plain step plus the verification path and the draft rows
(measured on Zen 4, bundled model, bf16: 1.25x a plain step at B=4 with ~2 drafts, 2.2-2.6x at B=8 with 20-40;
float32 1.14x at B=4), while a batch runs as long as its least predictable request. On random prompts one
request looping on a token (1 draft a step, always accepted) made half the steps verify steps: 0.70-1.07x the
throughput without speculation.

The rule, per step, over the B requests that sample (batch 1 is left alone: it always proposes up to k):

- Each request keeps a running average of its drafts' acceptance (accepted / proposed over its verified steps,
  exponential with weight EMA_WEIGHT, prior PRIOR_ACCEPTANCE); its expected gain is acceptance * drafts found.
- The engine's own step times price a verify step: the time between two proposal calls, for decode-only steps,
  kept per batch size for plain steps (running average, weight COST_WEIGHT) and verify steps (the same, except
  that a dearer verify step is believed at once: prices rise fast and fall slowly). A verify step at B costs
  ratio = verify / plain plain steps, so its drafts pay when they add B * (ratio - 1) tokens.
- The step verifies drafts only if the expected gain reaches B * ((ratio - 1) + MARGIN) (MARGIN: a batch runs
  as long as its slowest request, so tokens accepted by requests that are ahead buy less than they seem);
  before both costs are measured at B the bar is B * PRIOR_GAIN_PER_REQUEST (and once verify steps ran at a B
  whose plain steps were never timed, the next step there runs plain to time one). Otherwise it decodes plainly,
  and the verify price at B is lowered by STALE_DECAY (a price measured once, in a noisy moment or on other
  drafts, must not keep the batch plain for good: it is lowered until a verify step measures it again).
- In a verified step, requests whose acceptance fell below MIN_ACCEPTANCE propose nothing (their rows would cost
  more than they bring); their average moves RECOVERY of the way back to the prior each time, so they are tried
  again later.
- A batch whose lookup did not pay skips the lookup (~15 us a request) for the next 1, 2, 4, ... steps
  (doubling per failed lookup, up to MAX_SKIP); it looks every step again once a step verifies or the batch grows.
- `disable_by_batch_size` (vLLM's field): no drafts at all once that many requests run.

Exactness does not depend on it: any proposal, of any length, verifies to the same greedy tokens and the same
target distribution (and n-gram drafts are point masses, so a seeded row emits what it would emit without
speculation, whatever this rule decides). The step times are the driver's own; under tensor parallelism only
the driver's proposals reach the scheduler. Cost: a Python pass over the step's sampling requests.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

PRIOR_ACCEPTANCE = 0.5  # a new request's acceptance average
EMA_WEIGHT = 0.3  # weight of the newest verified step in a request's acceptance average
PRIOR_GAIN_PER_REQUEST = 0.5  # the bar (accepted tokens per request) before both step costs are known at a batch size
MARGIN = 0.5  # added to the measured break-even (tokens per request)
COST_WEIGHT = 0.2  # weight of the newest step in the step-time averages
IDLE_FACTOR = 5.0  # an interval this many times the average is an idle engine, not a step: not recorded
STALE_DECAY = 0.02  # each time a measured verify price keeps a batch plain, it is lowered this much (re-measured)
MIN_ACCEPTANCE = 0.2  # in a batch step, a request whose acceptance average is below this proposes nothing
RECOVERY = 0.1  # each time a request sits out, its acceptance average moves this share back to the prior
MAX_SKIP = 16  # a batch whose lookups keep failing looks again at least every this many steps


def _ints(counts: np.ndarray | Sequence[int]) -> list[int]:
    """Counts (an int array of any shape, or a sequence of ints) as a flat list of Python ints."""
    if isinstance(counts, np.ndarray):
        return counts.reshape(-1).tolist()
    return [int(c) for c in counts]


class DraftBudget:
    """Decides, step by step, which n-gram proposals a batch verifies; keeps per-request acceptance averages (by
    request id) and the engine's plain and verify step times (by batch size)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        disable_by_batch_size: Optional[int] = None,
        gain_rule: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """gain_rule False: no expected-gain rule, only disable_by_batch_size. clock: seconds (tests pass a fake)."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens!r}.")
        if disable_by_batch_size is not None and disable_by_batch_size < 2:
            raise ValueError(f"disable_by_batch_size must be >= 2, got {disable_by_batch_size!r}.")
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.gain_rule = gain_rule
        self.clock = clock
        self._acceptance: dict[str, float] = {}
        self._skip = 0  # batch steps left without a lookup
        self._backoff = 0  # the last skip length (doubles per failed lookup)
        self._last_batch = 0  # sampling requests in the last step
        self._plain: dict[int, float] = {}  # batch size -> average seconds of a plain decode step
        self._verify: dict[int, float] = {}  # batch size -> average seconds of a verify step
        self._last_end: Optional[float] = None  # when the last proposal call returned

    def acceptance(self, req_id: str) -> float:
        return self._acceptance.get(req_id, PRIOR_ACCEPTANCE)

    def disabled(self, num_running: int) -> bool:
        return self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size

    # ------------------------------------------------------------------ step costs
    def step_started(self, num_sampling: int, num_running: int, num_tokens: int, num_drafts: int) -> None:
        """Called as the proposal call starts, with the step that just ran: `num_sampling` of `num_running`
        requests sampled, `num_tokens` ran, `num_drafts` of them drafts. A decode-only step's time since the last
        proposal call returned is recorded for its batch size (plain or verify)."""
        now = self.clock()
        if self._last_end is None or num_sampling < 1 or num_sampling != num_running:
            return
        if num_tokens != num_sampling + num_drafts:  # a prefill chunk ran: not a decode step's cost
            return
        table = self._verify if num_drafts else self._plain
        dt = now - self._last_end
        old = table.get(num_sampling)
        if old is None or (num_drafts and old < dt < IDLE_FACTOR * old):  # a dearer verify step: believed at once
            table[num_sampling] = dt
        elif dt < IDLE_FACTOR * old:
            table[num_sampling] = old + COST_WEIGHT * (dt - old)

    def step_ended(self) -> None:
        """Called as the proposal call returns."""
        self._last_end = self.clock()

    def min_gain(self, batch_size: int) -> float:
        """Expected accepted tokens per request a verify step at this batch size must bring."""
        plain, verify = self._plain.get(batch_size), self._verify.get(batch_size)
        if plain is None or verify is None or plain <= 0:
            return PRIOR_GAIN_PER_REQUEST
        return max(0.0, verify / plain - 1.0) + MARGIN

    # ------------------------------------------------------------------ per step
    def should_search(self, num_sampling: int, num_running: Optional[int] = None) -> bool:
        """Whether to run the lookup this step for `num_sampling` sampling requests (`num_running` running)."""
        running = num_sampling if num_running is None else num_running
        grew, self._last_batch = num_sampling > self._last_batch, num_sampling
        if num_sampling == 0 or self.disabled(running):
            return False
        if num_sampling == 1 or not self.gain_rule:
            return True
        if grew:  # new requests: look at once
            self._skip = self._backoff = 0
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def trim(self, req_ids: Sequence[str], counts: np.ndarray, num_running: Optional[int] = None) -> np.ndarray:
        """New proposal lengths (int64, <= counts) for the step's sampling requests `req_ids`, whose lookups found
        `counts` tokens; `num_running` (default len(req_ids)) is what disable_by_batch_size compares against."""
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        b = len(req_ids)
        if b != len(counts):
            raise ValueError(f"need one count per request, got {b} and {len(counts)}.")
        running = b if num_running is None else num_running
        if self.disabled(running):
            return np.zeros_like(counts)
        if not self.gain_rule or b <= 1:
            return counts
        acc = np.fromiter((self._acceptance.get(r, PRIOR_ACCEPTANCE) for r in req_ids), dtype=np.float64, count=b)
        if float(acc @ counts) < self.min_gain(b) * b:  # not worth a verify step: plain, and look less often
            self._backoff = min(MAX_SKIP, max(1, 2 * self._backoff))
            self._skip = self._backoff
            verify, plain = self._verify.get(b), self._plain.get(b)
            if verify is not None and plain is not None:  # a stale dear price must not shut verification out
                self._verify[b] = max(plain, verify * (1.0 - STALE_DECAY))
            return np.zeros_like(counts)
        self._backoff = 0
        if b in self._verify and b not in self._plain:  # time one plain step at this batch size first
            return np.zeros_like(counts)
        low = np.nonzero((acc < MIN_ACCEPTANCE) & (counts > 0))[0]
        for i in low.tolist():  # sat out: drift back towards the prior, so the request is tried again later
            self._acceptance[req_ids[i]] = acc[i] + RECOVERY * (PRIOR_ACCEPTANCE - acc[i])
        return np.where(acc >= MIN_ACCEPTANCE, counts, 0)

    def observe(
        self, req_ids: Sequence[str], num_draft: np.ndarray | Sequence[int], num_accepted: np.ndarray | Sequence[int]
    ) -> None:
        """One verified step: request i ran num_draft[i] drafts and the first num_accepted[i] held."""
        drafts, accepted = _ints(num_draft), _ints(num_accepted)  # lists: a Python pass over a few rows
        if not len(req_ids) == len(drafts) == len(accepted):
            raise ValueError(f"need one count per request, got {len(req_ids)}, {len(drafts)} and {len(accepted)}.")
        w = EMA_WEIGHT
        acc = self._acceptance
        for r, d, a in zip(req_ids, drafts, accepted):
            if d > 0:
                acc[r] = (1 - w) * acc.get(r, PRIOR_ACCEPTANCE) + w * float(a) / float(d)

    def forget(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._acceptance.pop(r, None)
