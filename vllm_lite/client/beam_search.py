"""Beam search on top of the engine, scored and stopped exactly as Hugging Face's `_beam_search`.

The engine only knows one-token requests here: every step, each live beam is sent
as prompt + beam tokens with `SamplingParams(max_tokens=1, logprobs=2W, temperature)`
and comes back with its top 2W next-token logprobs. All beams of all prompts go in
one batch. Because every beam resubmits its whole prefix, the prefix cache shares
the common full KV blocks between beams (a fork by sharing blocks); the partly
filled last block is recomputed, which costs at most block_size - 1 tokens per beam.

Selection follows transformers 5.x `GenerationMixin._beam_search` for one EOS id:
- keep the top K = 2W candidates (beam score + token logprob) over all beams;
- a candidate "hits a stop" if it ends with EOS (unless ignore_eos) or reaches max_tokens;
- the next live beams are the best W of the K that did not hit a stop;
- among the best W of the K, those that hit a stop become finished hypotheses, scored
  sum_logprobs / generated_len ** length_penalty (generated_len counts the EOS), and the
  W best hypotheses are kept;
- `early_stopping`: True stops once W hypotheses exist; False stops when the best live
  beam's current score cannot beat the worst kept hypothesis; "never" does the same with
  the best imaginable length (max_tokens) when length_penalty > 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from tqdm.auto import tqdm

from vllm_lite.outputs import Logprob, RequestOutput
from vllm_lite.sampling_params import BeamSearchParams, SamplingParams

EarlyStopping = Union[bool, str]
# Runs one batch of one-token requests to completion; outputs in input order.
GenerateFn = Callable[[list[Any], list[SamplingParams]], list[RequestOutput]]


@dataclass
class BeamSearchSequence:
    """One beam: prompt + generated tokens, the generated tokens' logprobs, and its scores."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    # Length-penalized score (HF's sequences_scores); set when the beam is finished.
    score: Optional[float] = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def validate_beam_search_params(params: Any, max_logprobs: int) -> BeamSearchParams:
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}.")
    for name in ("beam_width", "max_tokens"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}.")
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(
            f"beam_width must be at most {max_logprobs // 2} (each step asks for 2 * beam_width logprobs, "
            f"limit {max_logprobs}), got {params.beam_width!r}."
        )
    if isinstance(params.length_penalty, bool) or not isinstance(params.length_penalty, (int, float)):
        raise TypeError(f"length_penalty must be a number, got {params.length_penalty!r}.")
    if (
        isinstance(params.temperature, bool)
        or not isinstance(params.temperature, (int, float))
        or params.temperature < 0
    ):
        raise ValueError(f"temperature must be a non-negative number, got {params.temperature!r}.")
    return params


def _check_early_stopping(value: Any) -> EarlyStopping:
    if value is True or value is False or value == "never":
        return value
    raise ValueError(f"early_stopping must be True, False or 'never', got {value!r}.")


class _PromptBeams:
    """The beam state of one prompt between steps."""

    def __init__(self, prompt_ids: list[int], width: int) -> None:
        self.prompt_ids = prompt_ids
        self.width = width
        self.live: list[BeamSearchSequence] = [
            BeamSearchSequence(tokens=list(prompt_ids), logprobs=[], num_prompt_tokens=len(prompt_ids))
        ]
        self.finished: list[BeamSearchSequence] = []  # best first, at most `width`
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False
        self.num_generated = 0


class BeamSearch:
    """Runs beam search for a batch of prompts through `generate` (one engine batch per step)."""

    def __init__(
        self,
        generate: GenerateFn,
        params: BeamSearchParams,
        eos_token_id: Optional[int],
        max_model_len: Optional[int] = None,
        early_stopping: EarlyStopping = False,
        max_logprobs: int = 20,
    ) -> None:
        self.generate = generate
        self.params = validate_beam_search_params(params, max_logprobs)
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.max_model_len = max_model_len
        self.early_stopping = _check_early_stopping(early_stopping)
        self.width = params.beam_width
        self.num_candidates = 2 * self.width  # HF: max(2, 1 + number of EOS ids) * num_beams
        self.step_params = SamplingParams(
            max_tokens=1,
            logprobs=self.num_candidates,
            temperature=float(params.temperature),
            ignore_eos=True,  # the beam logic decides what EOS means
            detokenize=False,
        )

    # ------------------------------------------------------------------ driver
    def run(
        self, prompts: Sequence[Any], on_step: Optional[Callable[[], None]] = None
    ) -> list[list[BeamSearchSequence]]:
        """Best beams per prompt, best first; prompts are what `LLM.generate` accepts (one each).

        `on_step` is called after every engine round trip (for progress bars).
        """
        if not prompts:
            raise ValueError("prompts is empty")
        # Step 0 sends the prompts as given, so the processor tokenizes them as generate() would.
        outs = self.generate(list(prompts), [self.step_params] * len(prompts))
        states = []
        for i, out in enumerate(outs):
            st = _PromptBeams(list(out.prompt_token_ids), self.width)
            self._check_length(i, len(st.prompt_ids))
            states.append(st)
        self._advance(states, [[out] for out in outs])
        if on_step is not None:
            on_step()
        while True:
            active = [s for s in states if not s.done]
            if not active:
                break
            requests = [{"prompt_token_ids": b.tokens} for s in active for b in s.live]
            outs = self.generate(requests, [self.step_params] * len(requests))
            per_state, k = [], 0
            for s in active:
                per_state.append(outs[k : k + len(s.live)])
                k += len(s.live)
            self._advance(active, per_state)
            if on_step is not None:
                on_step()
        return [s.finished for s in states]

    def _check_length(self, index: int, prompt_len: int) -> None:
        if self.max_model_len is not None and prompt_len + self.params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt {index}: {prompt_len} prompt tokens + max_tokens={self.params.max_tokens} exceeds "
                f"max_model_len={self.max_model_len}."
            )

    def _advance(self, states: list[_PromptBeams], outputs: list[list[RequestOutput]]) -> None:
        for st, outs in zip(states, outputs):
            cands = []
            for beam_index, (beam, out) in enumerate(zip(st.live, outs)):
                top = _top_logprobs(out, self.num_candidates)
                for rank, (tok, lp) in enumerate(top):
                    cands.append((beam.cum_logprob + lp.logprob, beam_index, rank, tok, lp))
            self.step(st, cands)

    # ------------------------------------------------------------------ one HF step
    def step(self, st: _PromptBeams, cands: list[tuple[float, int, int, int, Logprob]]) -> None:
        """Apply one beam step to `st` given candidates (score, beam index, rank, token, logprob)."""
        cands = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[: self.num_candidates]
        gen_len = st.num_generated + 1
        at_limit = gen_len >= self.params.max_tokens
        hits = [at_limit or (self.eos_token_id is not None and c[3] == self.eos_token_id) for c in cands]

        def extend(c, reason: Optional[str]) -> BeamSearchSequence:
            parent = st.live[c[1]]
            return BeamSearchSequence(
                tokens=parent.tokens + [c[3]],
                logprobs=parent.logprobs + [{c[3]: c[4]}],
                cum_logprob=c[0],
                finish_reason=reason,
                num_prompt_tokens=parent.num_prompt_tokens,
            )

        # Finished hypotheses: only from the best W candidates, and only while they can still matter.
        full = len(st.finished) == self.width
        accepting = st.improvable and not (full and self.early_stopping is True)
        if accepting:
            new = []
            for c, hit in zip(cands[: self.width], hits[: self.width]):
                if hit:
                    is_eos = self.eos_token_id is not None and c[3] == self.eos_token_id
                    seq = extend(c, "stop" if is_eos else "length")
                    if is_eos:
                        seq.stop_reason = None  # EOS, as vLLM reports it
                    seq.score = c[0] / (gen_len**self.params.length_penalty)
                    new.append(seq)
            if new:
                merged = st.finished + new  # stable: earlier hypotheses win ties
                merged.sort(key=lambda s: -s.score)  # type: ignore[operator]
                st.finished = merged[: self.width]

        st.live = [extend(c, None) for c, hit in zip(cands, hits) if not hit][: self.width]
        st.num_generated = gen_len

        # Can a live beam still beat the worst kept hypothesis?
        if len(st.finished) == self.width and st.live:
            lp = self.params.length_penalty
            best_len = self.params.max_tokens if (self.early_stopping == "never" and lp > 0) else gen_len
            best_possible = st.live[0].cum_logprob / (best_len**lp)
            st.improvable = st.improvable and best_possible > st.finished[-1].score  # type: ignore[operator]
        full = len(st.finished) == self.width
        st.done = not st.improvable or (full and self.early_stopping is True) or all(hits) or not st.live


def _top_logprobs(out: RequestOutput, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely next tokens of a one-token request, best first."""
    if out.error:
        raise RuntimeError(f"beam search step failed for request {out.request_id}: {out.error}")
    comp = out.outputs[0]
    if not comp.logprobs:
        raise RuntimeError(f"request {out.request_id} returned no logprobs")
    entries = sorted(comp.logprobs[0].items(), key=lambda kv: (-kv[1].logprob, kv[0]))
    return entries[:k]


def beam_search(
    generate: GenerateFn,
    tokenizer: Any,
    prompts: Sequence[Any],
    params: BeamSearchParams,
    eos_token_id: Optional[int],
    max_model_len: Optional[int] = None,
    early_stopping: EarlyStopping = False,
    max_logprobs: int = 20,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """Beam search for each prompt; each output's sequences are the best `beam_width` beams, best first."""
    searcher = BeamSearch(generate, params, eos_token_id, max_model_len, early_stopping, max_logprobs)
    bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm)
    try:
        results = searcher.run(prompts, on_step=lambda: bar.update(1))
    finally:
        bar.close()
    outputs = []
    for beams in results:
        for b in beams:
            if tokenizer is not None:
                b.text = tokenizer.decode(b.tokens)  # prompt + beam, as vLLM's beam search reports it
        outputs.append(BeamSearchOutput(sequences=beams))
    return outputs
