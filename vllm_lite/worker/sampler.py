"""The batched sampler: logits processors, then greedy or random sampling, plus logprobs.

Order follows vLLM V1: the structured-output grammar bitmask, allowed-token mask, bans (bad words, min_tokens stop
ids), logit bias -> repetition/frequency/presence penalties -> (greedy rows:
argmax here) -> temperature -> min-p -> top-k -> top-p -> sample with the
exponential race (argmax of probs / Exponential(1)), which equals drawing from
the categorical distribution but needs no cumulative sum and lets seeded rows
draw their noise from their own generator. Every step works on the whole batch
at once; features no row uses are skipped.

Cost: penalties touch only each row's seen tokens ([N, L], not [N, V]); the
truncating warpers run on each row's top candidates (a partial topk) and fall
back to exact full-vocabulary masks/sorts only for rows whose survivors might
lie outside them, so results equal HF's warpers either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.step import LogprobsTensors

_NEG_INF = float("-inf")
# CPU tensors take numpy paths where those are cheaper; tests that count the device path's ops turn this off.
HOST_FAST_PATHS = True


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    # [N, max_k+1], column 0 = sampled token; None if no row asked for logprobs.
    logprobs_tensors: Optional[LogprobsTensors]


# ---------------------------------------------------------------------- processors
def apply_allowed_and_bans(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Confine rows with allowed_token_ids, then ban bad words / held-back stop ids (in place)."""
    if md.allowed_rows is not None and md.allowed_index is not None:
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[md.allowed_index] = True
        logits.masked_fill_(md.allowed_rows.unsqueeze(1) & ~allowed, _NEG_INF)
    if md.banned_index is not None:
        logits[md.banned_index] = _NEG_INF
    return logits


_BYTE_BITS: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _byte_bits(device: torch.device, value: bool) -> torch.Tensor:
    """[256, 8] bool: bit j of byte b equals `value` (one table per device, built once)."""
    key = (device, value)
    table = _BYTE_BITS.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BYTE_BITS[key] = (bits == int(value)).to(device)
    return table


def _unpack_bits(bitmask: torch.Tensor, vocab_size: int, value: bool) -> torch.Tensor:
    """bool [N, vocab_size], True where token t's bit equals `value`; tokens past the bitmask count as 0 bits.

    Bytes of the little-endian int32 words (CPUs and GPUs alike) are looked up in a 256-entry table: one
    gather of N*V/8 entries instead of N*V shifts.
    """
    n = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).flatten().to(torch.int32)
    bits = _byte_bits(bitmask.device, value).index_select(0, as_bytes).view(n, -1)
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=not value)
    return bits[:, :vocab_size]


def expand_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, W] packed bits (bit t%32 of word t//32 = token t) -> bool [N, vocab_size] allowed."""
    return _unpack_bits(bitmask, vocab_size, True)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs: tokens the row's grammar forbids -> -inf (in place), one batched op on the device."""
    forbidden = _unpack_bits(bitmask.to(logits.device, non_blocking=True), logits.shape[1], False)
    return logits.masked_fill_(forbidden, _NEG_INF)


def keep_grammar_over_bans(grammar_only: torch.Tensor, banned: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`banned` (grammar mask, then allowed_token_ids / bad words / min_tokens bans), except on constrained rows
    the bans left with no token at all: those keep the grammar's mask alone.

    A grammar that is complete allows only its stop token; min_tokens bans exactly that token, and every logit
    is then -inf, so any "sample" (argmax of all -inf is token 0) is a token outside the grammar and fails the
    request. The grammar is the constraint a row always keeps: it stops there on EOS, as with ignore_eos.
    No host sync: a where over the batch.
    """
    constrained = (bitmask.to(banned.device, non_blocking=True) != -1).any(dim=1)
    emptied = torch.isneginf(banned).all(dim=1) & constrained
    return torch.where(emptied.unsqueeze(1), grammar_only, banned)


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.logit_bias_index is not None and md.logit_bias_values is not None:
        logits.index_put_(md.logit_bias_index, md.logit_bias_values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF: over prompt+output, divide positive / multiply negative), then OpenAI frequency/presence.

    Only each row's distinct prompt+output tokens can change, so work on those [N, L] entries alone.
    """
    if md.penalty_token_ids is None:
        return logits
    assert md.penalty_output_counts is not None and md.repetition_penalties is not None
    assert md.frequency_penalties is not None and md.presence_penalties is not None
    ids, counts = md.penalty_token_ids, md.penalty_output_counts
    vals = logits.gather(1, ids)
    rep = md.repetition_penalties.unsqueeze(1)
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals -= md.frequency_penalties.unsqueeze(1) * counts + md.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits.scatter_(1, ids, vals)


# ---------------------------------------------------------------------- warpers, exact over the vocabulary
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: Optional[int] = None) -> torch.Tensor:
    """Keep the k best per row, ties with the k-th kept (HF); k >= vocab disables. `max_top_k`: a host-side bound
    on the enabled k (SamplingMetadata.max_top_k), which spares reading top_k's max back from the device (the
    k-th value is the same whatever the bound, and rows with k >= vocab are disabled either way)."""
    vocab = logits.shape[-1]
    if max_top_k is not None and max_top_k >= 1:
        max_k = min(int(max_top_k), vocab)
    else:
        max_k = int(top_k.clamp(max=vocab).max())
    kth = torch.topk(logits, max_k, dim=-1).values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth.masked_fill_((top_k >= vocab).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest best-first set whose mass reaches p (HF: ascending cumsum <= 1 - p is dropped)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = (cum <= (1.0 - top_p).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)  # p = 1 drops nothing
    drop[:, -1] = False  # always keep the best token
    return logits.scatter_(1, order, sorted_logits.masked_fill_(drop, _NEG_INF))


def warp_dense(
    logits: torch.Tensor,
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    min_p: Optional[torch.Tensor],
    max_top_k: Optional[int] = None,
) -> torch.Tensor:
    """min-p -> top-k -> top-p over the whole vocabulary, in place (the slow, always-exact path)."""
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    if top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


# ---------------------------------------------------------------------- warpers among top candidates
# Truncating warpers usually keep few tokens. Rows whose survivors provably all lie among their
# top candidates are warped and sampled on [rows, candidates] only; full-vocabulary masks and
# sorts (each ~10x a topk on CPU) run only for rows that need them.
_MIN_CANDIDATES = 64


@dataclass
class WarpedLogits:
    """Warped logits of one batch, split into rows settled among candidates and rows kept dense."""

    num_rows: int
    vocab_size: int
    dense_rows: Optional[torch.Tensor]  # int64 [D] batch rows of `dense`; None = every row
    dense: Optional[torch.Tensor]  # float32 [D, V]
    narrow_rows: Optional[torch.Tensor]  # int64 [M]
    narrow_logits: Optional[torch.Tensor]  # float32 [M, K], -inf where dropped
    narrow_ids: Optional[torch.Tensor]  # int64 [M, K] token ids of the candidates
    dense_rows_host: Optional[np.ndarray] = None  # dense_rows on the host when known without a device read

    def to_dense(self) -> torch.Tensor:
        """Every row over the full vocabulary (for tests and inspection; the sampler never needs it)."""
        ref = self.dense if self.dense is not None else self.narrow_logits
        assert ref is not None
        out = torch.full((self.num_rows, self.vocab_size), _NEG_INF, dtype=ref.dtype, device=ref.device)
        if self.dense is not None:
            if self.dense_rows is None:
                out.copy_(self.dense)
            else:
                out[self.dense_rows] = self.dense
        if self.narrow_rows is not None:
            assert self.narrow_logits is not None and self.narrow_ids is not None
            out[self.narrow_rows] = out[self.narrow_rows].scatter_(1, self.narrow_ids, self.narrow_logits)
        return out


def warp(
    logits: torch.Tensor,
    md: SamplingMetadata,
    rows: Optional[torch.Tensor],
    rows_host: Optional[np.ndarray] = None,
) -> WarpedLogits:
    """Temperature -> min-p -> top-k -> top-p for the batch rows `rows` (None = all), as HF's warpers chained.

    Temperature is applied to candidates only (positive scaling keeps the order) and to the full
    rows only where they are needed. Returns new tensors; `logits` is not modified. `rows_host`: `rows` on the
    host, when the caller has them (temperature-only batches then need no device read at all).

    Host syncs left (CUDA): with top-k / top-p / min-p, which rows the candidates cover is read back (nonzero),
    and top-p checks whether any uncovered row needs the full normaliser.
    """
    n, vocab = logits.shape
    temp = md.temperature if md.temperature is not None else logits.new_ones(n)
    top_k, top_p, min_p = md.top_k, md.top_p, md.min_p
    if rows is not None and rows.numel() < n:  # skip greedy rows from here on
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        logits, temp, top_k, top_p, min_p = logits[rows], temp[rows], pick(top_k), pick(top_p), pick(min_p)
    else:
        rows, rows_host = None, None
    m = logits.shape[0]
    temp_col = temp.unsqueeze(1)

    def to_batch(local: torch.Tensor) -> Optional[torch.Tensor]:
        if rows is not None:
            return rows[local]
        return None if local.numel() == n else local

    if top_k is None and top_p is None and min_p is None:
        return WarpedLogits(n, vocab, rows, logits / temp_col, None, None, None, dense_rows_host=rows_host)

    # Candidates: one more than the largest k, so a tie with the k-th cannot hide outside them.
    num_cand = min(vocab, max(md.max_top_k + 1, _MIN_CANDIDATES))
    vals, ids = torch.topk(logits, num_cand, dim=-1)  # best first
    vals = vals.div_(temp_col)
    smallest = vals[:, -1]
    whole_vocab = num_cand == vocab
    covered = torch.zeros(m, dtype=torch.bool, device=logits.device)
    if min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
        threshold = vals[:, 0] + torch.log(min_p)  # -inf where min_p == 0
        vals.masked_fill_(vals < threshold.unsqueeze(1), _NEG_INF)
        covered |= smallest < threshold
    if top_k is not None:
        kth = vals.gather(1, (top_k.clamp(max=num_cand) - 1).unsqueeze(1)).squeeze(1)
        kth.masked_fill_(top_k >= vocab, _NEG_INF)
        vals.masked_fill_(vals < kth.unsqueeze(1), _NEG_INF)
        covered |= smallest < kth
    if top_p is not None:
        uses_p = top_p < 1.0
        # Normalizer: over the candidates when earlier warpers already dropped everything else,
        # else over the whole (unfiltered) row.
        lse = vals.logsumexp(dim=-1)
        if not whole_vocab and bool((uses_p & ~covered).any()):
            lse = torch.where(covered, lse, (logits / temp_col).logsumexp(dim=-1))
        # A row min-p filtered only partly among the candidates has an unknown normalizer: keep it dense.
        trusted = covered if min_p is None else covered | (min_p <= 0.0)
        probs = (vals - lse.unsqueeze(1)).exp_()
        cum = probs.cumsum(dim=-1)
        # Token j survives iff the mass ranked above it is < p.
        keep = ((cum - probs) < top_p.unsqueeze(1)) | ~uses_p.unsqueeze(1)  # p = 1: no rounding losses
        keep[:, 0] = True
        vals.masked_fill_(~keep, _NEG_INF)
        covered |= uses_p & trusted & (cum[:, -1] > top_p + 1e-5)
    if whole_vocab:
        covered.fill_(True)

    out = WarpedLogits(n, vocab, None, None, None, None, None)
    narrow = covered.nonzero().squeeze(1)
    if narrow.numel():
        narrow_batch = to_batch(narrow)
        out.narrow_rows = narrow_batch if narrow_batch is not None else narrow
        out.narrow_logits, out.narrow_ids = vals[narrow], ids[narrow]
    dense = (~covered).nonzero().squeeze(1)
    if dense.numel():
        sub = lambda t: None if t is None else t[dense]  # noqa: E731
        out.dense_rows = to_batch(dense)
        out.dense = warp_dense(logits[dense] / temp_col[dense], sub(top_k), sub(top_p), sub(min_p), md.max_top_k)
    return out


# ---------------------------------------------------------------------- sampling
def exponential_noise(
    shape: torch.Size, device: torch.device, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Exp(1) samples as -log(U), U in [0, 1): never 0 (so p/E is never 0/0), and ~3x faster than exponential_ on CPU."""
    return torch.rand(shape, device=device, generator=generator).log_().neg_()


def inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [N, K] from one uniform each: the first index whose cumulative mass exceeds u * total.

    Sums in float64; a zero-probability index is never returned (an empty interval, and u * total rounding up to
    the total is clamped to the last index with mass)."""
    cum = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cum[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device).mul_(total)
    choice = torch.searchsorted(cum, u, right=True).squeeze(1)
    return torch.minimum(choice, cum.argmax(dim=-1))  # argmax: the first index reaching the total


def _race(
    logits: torch.Tensor,
    batch_rows: Optional[torch.Tensor],
    ids: Optional[torch.Tensor],
    generators: dict[int, torch.Generator],
    vocab: int,
    batch_rows_host: Optional[np.ndarray] = None,
) -> torch.Tensor:
    """Exponential race argmax(p / E) on some rows, E ~ Exp(1) i.i.d. per token, which draws token i with prob. p_i.

    A seeded row always draws one full [vocab] noise vector from its own generator (gathered at its
    candidate ids when narrowed), so its tokens do not depend on the batch around it.

    On CPU the unseeded rows draw by inverse CDF instead (same distribution, one uniform a row): torch's CPU
    generator makes the [rows, vocab] noise serially, ~0.1 ms a 32K-token row, 4-5x the rest of the draw.
    """
    probs = logits.softmax(dim=-1)
    seeded = _seeded_noise(probs.shape[0], batch_rows, ids, generators, vocab, probs.device, batch_rows_host)
    if probs.device.type == "cpu":
        choice = inverse_cdf_sample(probs)
        for local, noise_row in seeded:
            choice[local] = probs[local].div(noise_row).argmax()
    else:
        noise = exponential_noise(probs.shape, probs.device)
        for local, noise_row in seeded:
            noise[local] = noise_row
        choice = probs.div_(noise).argmax(dim=-1)
    return choice if ids is None else ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def _seeded_noise(
    num_rows: int,
    batch_rows: Optional[torch.Tensor],
    ids: Optional[torch.Tensor],
    generators: dict[int, torch.Generator],
    vocab: int,
    device: torch.device,
    batch_rows_host: Optional[np.ndarray] = None,
) -> list[tuple[int, torch.Tensor]]:
    """(local row, its noise at the row's candidates) for each seeded row: one full [vocab] draw from the row's own
    generator, gathered at its candidate ids when narrowed. Only seeded rows do Python work; `batch_rows_host`
    (batch_rows on the host) spares reading them back from the device."""
    if not generators:
        return []
    if batch_rows is None:
        positions: list[int] = list(range(num_rows))
    elif batch_rows_host is not None:
        positions = batch_rows_host.tolist()
    else:
        positions = batch_rows.tolist()
    out = []
    for local, row in enumerate(positions):
        gen = generators.get(row)
        if gen is not None:
            full = exponential_noise(torch.Size([vocab]), device, gen)
            out.append((local, full if ids is None else full[ids[local]]))
    return out


def random_sample(warped: WarpedLogits, generators: dict[int, torch.Generator], out: torch.Tensor) -> torch.Tensor:
    """Fill `out` at the warped rows with randomly sampled tokens."""
    if warped.narrow_rows is not None:
        assert warped.narrow_logits is not None
        out[warped.narrow_rows] = _race(
            warped.narrow_logits, warped.narrow_rows, warped.narrow_ids, generators, warped.vocab_size
        )
    if warped.dense is not None:
        tokens = _race(warped.dense, warped.dense_rows, None, generators, warped.vocab_size, warped.dense_rows_host)
        if warped.dense_rows is None:
            out.copy_(tokens)
        else:
            out[warped.dense_rows] = tokens
    return out


# ---------------------------------------------------------------------- logprobs
def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Top-`num_logprobs` plus the given token in column 0, with that token's rank (1 = best)."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_vals, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        vals = torch.cat([chosen, top_vals], dim=1)
    else:
        ids, vals = token_ids, chosen
    return LogprobsTensors(ids, vals.to(torch.float32), ranks.to(torch.int64))


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of known next tokens (prompt_logprobs): logits [M, V], targets [M]."""
    if logits.dim() != 2 or target_token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [M, V] and target_token_ids [M], got {tuple(logits.shape)} and "
            f"{tuple(target_token_ids.shape)}."
        )
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs!r}.")
    k = min(num_logprobs, logits.shape[1])
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_token_ids, k)


# ---------------------------------------------------------------------- sampler
# bfloat16 bit patterns (as int16): the smallest positive normal number and +inf. NaNs lie above +inf (positive
# NaNs) and above -inf among the negative patterns (0xFF81-0xFFFF as uint16).
_BF16_MIN_NORMAL = 0x0080
_BF16_INF = 0x7F80
# The int16 path pays off from about this many logits (~8 rows of a 32K vocabulary): below it the float32 copy is
# small, and its few operations cost less than the int16 path's checks (each numpy call after a decode step's
# forward runs with cold caches, ~10-30 us on 2 Zen 4 cores). The runner hands over bfloat16 logits only from here.
BF16_ARGMAX_MIN_NUMEL = 1 << 18


def _argmax_bf16_cpu(logits: torch.Tensor) -> torch.Tensor:
    """`logits.float().argmax(-1)` of a 2-D bfloat16 CPU tensor without the float32 copy.

    A bfloat16 bit pattern read as int16 orders the non-negative numbers as their values do (sign and magnitude,
    magnitude rising with the pattern), and every negative value, -0 included, reads as a negative int16. So in a
    row whose largest int16 is a positive normal number or +inf and that holds no NaN, numpy's int16 argmax (first
    maximum, vectorised) is the float argmax: the maximum value has exactly one pattern, so both pick its first
    occurrence, and no subnormal or zero can tie with it (even with denormals flushed). Every other row (its maximum
    +0, -0, subnormal or negative, or a NaN anywhere in it) takes the float32 path: np.argmax of its exact float32
    conversion, which is what `greedy_argmax` does for float32 logits."""
    bits = logits.view(torch.int16).numpy()
    idx = np.argmax(bits, axis=1)
    best = bits[_row_index(len(idx)), idx].tolist()  # each row's largest pattern, as Python ints (int16)
    whole = bits.view(np.uint16)
    neg_nan = int(whole.max()) > 0xFF80  # a negative NaN (0xFF81-0xFFFF) somewhere: one pass over the batch
    if neg_nan or min(best) < _BF16_MIN_NORMAL or max(best) > _BF16_INF:
        slow = np.array(best) < _BF16_MIN_NORMAL  # +-0, subnormal or negative at the top
        slow |= np.array(best) > _BF16_INF  # a positive NaN
        if neg_nan:
            slow |= whole.max(axis=1) > 0xFF80
        rows = np.flatnonzero(slow)
        idx[rows] = np.argmax(logits[torch.from_numpy(rows)].float().numpy(), axis=1)
    return torch.from_numpy(idx if idx.dtype == np.int64 else idx.astype(np.int64))


_ROW_INDEX = np.arange(0)


def _row_index(n: int) -> np.ndarray:
    """0..n-1 (int64), a view of one array kept and grown (no arange a step)."""
    global _ROW_INDEX
    if len(_ROW_INDEX) < n:
        _ROW_INDEX = np.arange(max(n, 256), dtype=np.int64)
    return _ROW_INDEX[:n]


# Dtypes whose values float32 holds exactly: their argmax is the argmax of the float32 copy.
_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [N]: each row's first index of its largest logit (NaN counts as largest), as `logits.argmax(-1)` over
    the logits' float32 values.

    A float32 CPU batch goes through numpy's argmax, which is vectorised along the row: [32, 32000] takes ~90 us
    on 2 Zen 4 cores against ~800 us for torch's (which reduces (value, index) pairs element by element). Both
    return the first position of the maximum and treat NaN as the maximum, so the tokens are the same. A bfloat16
    CPU batch (the LM head's own output: Sampler.forward's all-greedy path) takes numpy's int16 argmax over its
    bit patterns (`_argmax_bf16_cpu`: ~50 us at [32, 32000], against ~160 us for the float32 copy and its argmax,
    and torch's own bfloat16 argmax ~1.9 ms); float16 is converted to float32 first (exactly); float64 keeps torch's argmax. Other
    devices, and 1-D or empty rows, stay on torch (another dtype converted to float32, as the sampler did before)."""
    if HOST_FAST_PATHS and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0:
        if logits.dtype == torch.bfloat16 and logits.numel() >= BF16_ARGMAX_MIN_NUMEL:
            return _argmax_bf16_cpu(logits)
        if logits.dtype in _EXACT_IN_FLOAT32:  # float64 would round first: it stays on torch's argmax
            values = logits.to(torch.float32).numpy()
            return torch.from_numpy(np.argmax(values, axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def has_logits_processors(md: SamplingMetadata, grammar_bitmask: Optional[torch.Tensor] = None) -> bool:
    """Whether any processor that changes the argmax applies to the batch (grammar, masks, bias, penalties)."""
    return not (
        grammar_bitmask is None
        and md.allowed_index is None
        and md.banned_index is None
        and md.logit_bias_index is None
        and md.penalty_token_ids is None
    )


class Sampler(torch.nn.Module):
    """Turns a batch of logits into one token per row, honouring each row's SamplingParams."""

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata, grammar_bitmask: Optional[torch.Tensor] = None
    ) -> SamplerOutput:
        """`grammar_bitmask`: int32 [N, ceil(V/32)] (all ones on unconstrained rows), or None.

        Logprobs stay those of the raw distribution (before the grammar mask, as before any processor).
        """
        md = metadata
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"logits must be [{md.num_rows}, V], got {tuple(logits.shape)}.")
        if logits.dtype != torch.float32:
            if (
                logits.device.type == "cpu"
                and md.all_greedy
                and md.max_num_logprobs is None
                and not has_logits_processors(md, grammar_bitmask)
            ):
                # CPU (the runner hands over bfloat16 logits only there): every row is an argmax of the logits as
                # they are, and the argmax of their exact float32 conversion is the same token (greedy_argmax).
                return SamplerOutput(sampled_token_ids=greedy_argmax(logits), logprobs_tensors=None)
            logits = logits.to(torch.float32)  # once, for the logprobs, the processors and the draws
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        logits = self.apply_logits_processors(logits, md, grammar_bitmask)
        if md.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            if md.all_random:
                sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
                random_rows = None
            else:
                assert md.greedy_mask is not None
                sampled = greedy_argmax(logits)
                random_rows = md.random_rows  # from the host's metadata: no read of greedy_mask back
                if random_rows is None:
                    random_rows = (~md.greedy_mask).nonzero().squeeze(1)
            random_sample(warp(logits, md, random_rows, md.random_rows_host), md.generators, sampled)

        lp = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            lp = gather_logprobs(raw_logprobs, sampled, min(md.max_num_logprobs, logits.shape[1]))
        if sampled.dtype != torch.int64:  # argmax gives int64 already: no dispatch for a no-op
            sampled = sampled.to(torch.int64)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=lp)

    @staticmethod
    def apply_logits_processors(
        logits: torch.Tensor, md: SamplingMetadata, grammar_bitmask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Processors that change the argmax: grammar mask, masks, bias, penalties. Never modifies the caller's
        tensor."""
        if not has_logits_processors(md, grammar_bitmask):
            return logits if logits.dtype == torch.float32 else logits.to(torch.float32)  # nothing to do: no copy
        logits = logits.to(torch.float32, copy=True)
        if grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, grammar_bitmask)
            if md.allowed_index is not None or md.banned_index is not None:
                logits = keep_grammar_over_bans(logits, apply_allowed_and_bans(logits.clone(), md), grammar_bitmask)
        else:
            logits = apply_allowed_and_bans(logits, md)
        logits = apply_logit_bias(logits, md)
        return apply_penalties(logits, md)

    def processed_logits(
        self, logits: torch.Tensor, md: SamplingMetadata, grammar_bitmask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The final logits every row's random draw uses (softmax gives the distribution); for tests and tools."""
        return warp(self.apply_logits_processors(logits, md, grammar_bitmask), md, None).to_dense()
