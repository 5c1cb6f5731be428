"""Verifies draft tokens against the target model's distributions: keeps the longest acceptable prefix, then one
more token, so the emitted tokens follow the target distribution exactly (Leviathan et al. / Chen et al.).

Per request with k' <= k drafts x_1..x_k' (padded to k), draft distributions q_i (None: n-gram, a point mass on
x_i) and target distributions p_1..p_{k'+1} (after temperature/top-k/top-p, as the sampler would use them):

- greedy rows accept x_i while x_i == argmax p_i; at the first mismatch they emit argmax p_i, after all k' the
  bonus argmax p_{k'+1}: exactly the tokens non-speculative greedy decoding emits. Only the argmax of a greedy
  row's `target_probs` is read, so the caller may pass processed logits there.
- random rows accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection they draw from the
  residual norm(max(0, p_i - q_i)), after all k' the bonus from p_{k'+1}.

For point-mass drafts (n-gram: q_i = delta(x_i)) that rule is carried out by coupling: draw y_i ~ p_i with the
sampler's own race and accept x_i iff y_i == x_i. Acceptance then has probability p_i(x_i) = min(1, p_i/q_i), and
a rejected position emits y_i ~ p_i given y_i != x_i, which is exactly the residual norm(max(0, p_i - delta)). The
point: every emitted token costs one [V] noise draw, as in non-speculative sampling, so a seeded row draws from
its generator exactly once per token it emits (it stops drawing at its first mismatch) and replay after
preemption (`SamplingState._make_generator` skips one draw per kept output) stays right; with the same logits a
seeded row emits the tokens it would emit without speculation.

All rows are handled by batched tensor ops (seeded rows add a short loop over their positions). The categorical
draw is the sampler's exponential race (argmax(w / E), E ~ Exp(1)), which needs no normalisation of the residual.
With draft distributions a seeded row draws k uniforms and one [V] noise vector from its own generator every
call, so its tokens do not depend on the rows around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

PLACEHOLDER_TOKEN_ID = -1
# CPU tensors take numpy paths where those are cheaper; tests that count the device path's ops turn this off.
HOST_FAST_PATHS = True


@dataclass
class RejectionSamplerOutput:
    # int64 [B, k+1]: accepted drafts, then the recovered or bonus token, then PLACEHOLDER_TOKEN_ID.
    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor  # int64 [B], drafts accepted (the row emitted num_accepted + 1 tokens)


def _exponential(shape: tuple[int, ...], device: torch.device, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Exp(1) as -log(U), U in [0, 1): never 0, the same draw the sampler's race uses."""
    return torch.rand(shape, device=device, generator=generator).log_().neg_()


def _draws(
    batch: int, k: int, vocab: int, device: torch.device, generators: dict[int, torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance uniforms [B, k] and race noise [B, V]; seeded rows overwrite theirs from their own stream."""
    uniforms = torch.rand((batch, k), device=device)
    noise = _exponential((batch, vocab), device, None)
    for row, gen in generators.items():  # seeded rows only do Python work
        uniforms[row] = torch.rand((k,), device=device, generator=gen)
        noise[row] = _exponential((vocab,), device, gen)
    return uniforms, noise


def _check(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, k], got {tuple(draft_token_ids.shape)}.")
    b, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [{b}, {k + 1}, V], got {tuple(target_probs.shape)}.")
    if draft_probs is not None and draft_probs.shape != (b, k, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be [{b}, {k}, {target_probs.shape[2]}], got {tuple(draft_probs.shape)}.")
    if num_draft_tokens.shape != (b,) or is_greedy.shape != (b,):
        raise ValueError(
            f"num_draft_tokens and is_greedy must be [{b}], got {tuple(num_draft_tokens.shape)} and "
            f"{tuple(is_greedy.shape)}."
        )
    if any(not 0 <= row < b for row in generators):
        raise ValueError(f"generators must be keyed by rows in [0, {b}), got {sorted(generators)!r}.")


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: Optional[dict[int, torch.Generator]] = None,
) -> RejectionSamplerOutput:
    """Verify a batch of proposals.

    draft_token_ids: int [B, k], row i's drafts in columns [0, num_draft_tokens[i]) (padding is ignored).
    draft_probs: float [B, k, V] draft distributions, or None for point masses (n-gram).
    target_probs: float [B, k+1, V], position j = the target's distribution after the first j drafts.
    is_greedy: bool [B]. generators: batch row -> its request's generator (seeded rows only), as in
    SamplingMetadata.generators.
    """
    generators = generators or {}
    _check(draft_token_ids, num_draft_tokens, draft_probs, target_probs, is_greedy, generators)
    if draft_probs is None:
        return _match_sample(draft_token_ids, num_draft_tokens, target_probs, is_greedy, generators)
    b, k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    device = target_probs.device
    positions = torch.arange(k, device=device)
    num_draft = num_draft_tokens.to(device=device, dtype=torch.int64)
    greedy = is_greedy.to(device=device, dtype=torch.bool)
    valid = positions.unsqueeze(0) < num_draft.unsqueeze(1)  # [B, k]
    drafts = torch.where(valid, draft_token_ids.to(device=device, dtype=torch.int64), 0)
    target = target_probs.float()

    uniforms, noise = _draws(b, k, vocab, device, generators)
    p_draft = target[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, k]
    q_draft = (
        torch.ones_like(p_draft)
        if draft_probs is None
        else draft_probs.float().gather(2, drafts.unsqueeze(2)).squeeze(2)
    )
    accept_random = uniforms * q_draft < p_draft  # P(u < p/q) = min(1, p/q)
    accept_greedy = drafts == target[:, :k].argmax(dim=2)
    accepted = torch.where(greedy.unsqueeze(1), accept_greedy, accept_random) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # length of the accepted prefix

    # The extra token at position a = num_accepted: residual on a rejection, the bonus when all were accepted.
    rows = torch.arange(b, device=device)
    p_next = target[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft
    if k:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.nn.functional.one_hot(drafts[rows, at], vocab).to(p_next.dtype)
        else:
            q_next = draft_probs.float()[rows, at]
        residual = (p_next - q_next * rejected.unsqueeze(1)).clamp_(min=0.0)
        # Rounding can leave a rejected row's residual empty (p ~= q); it then draws from p, the limit case.
        empty = residual.sum(dim=1, keepdim=True) <= 0.0
        weights = torch.where(empty, p_next, residual)
    else:
        weights = p_next
    recovered = torch.where(greedy, p_next.argmax(dim=1), (weights / noise).argmax(dim=1))

    columns = torch.arange(k + 1, device=device).unsqueeze(0)
    padded_drafts = torch.nn.functional.pad(drafts, (0, 1), value=PLACEHOLDER_TOKEN_ID)
    out = torch.where(columns < num_accepted.unsqueeze(1), padded_drafts, PLACEHOLDER_TOKEN_ID)
    out[rows, num_accepted] = recovered
    return RejectionSamplerOutput(output_token_ids=out, num_accepted=num_accepted)


def rejection_sample_rows(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    has_draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: Optional[dict[int, torch.Generator]] = None,
) -> RejectionSamplerOutput:
    """`rejection_sample` where only some rows have draft distributions (bool [B] `has_draft_probs`): those rows
    use min(1, p/q) with the residual, the others are point masses (coupling path). Same output layout."""
    generators = generators or {}
    if draft_probs is None or has_draft_probs is None or not bool(has_draft_probs.any()):
        return rejection_sample(draft_token_ids, num_draft_tokens, None, target_probs, is_greedy, generators)
    if bool(has_draft_probs.all()):
        return rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs, is_greedy, generators)
    b, k = draft_token_ids.shape
    device = target_probs.device
    out = torch.full((b, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(b, dtype=torch.int64, device=device)
    for with_q in (True, False):
        picked = (has_draft_probs == with_q).nonzero().squeeze(1)  # on the host when has_draft_probs is (the runner's)
        rows = picked.to(device)
        local = {j: generators[r] for j, r in enumerate(picked.tolist()) if r in generators}
        part = rejection_sample(
            draft_token_ids[rows],
            num_draft_tokens[rows],
            draft_probs[rows] if with_q else None,
            target_probs[rows],
            is_greedy[rows],
            local,
        )
        out[rows] = part.output_token_ids
        num_accepted[rows] = part.num_accepted
    return RejectionSamplerOutput(output_token_ids=out, num_accepted=num_accepted)


def greedy_verify(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor
) -> RejectionSamplerOutput:
    """All rows greedy: the argmax of each position, drafts kept while they equal it. No probabilities, no noise
    and no float copy: the argmax of the (processed) logits is all greedy decoding reads.

    target_logits: float [B, k+1, V]. Same output as `rejection_sample` with every row greedy."""
    b, k = draft_token_ids.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [{b}, {k + 1}, V], got {tuple(target_logits.shape)}.")
    if num_draft_tokens.shape != (b,):
        raise ValueError(f"num_draft_tokens must be [{b}], got {tuple(num_draft_tokens.shape)}.")
    return _keep_matching_prefix(_argmax_last(target_logits), draft_token_ids, num_draft_tokens)


def greedy_verify_host(
    target_logits: torch.Tensor, draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray
) -> RejectionSamplerOutput:
    """`greedy_verify` with the drafts on the host (int64 numpy [B, k] and [B]) and the result on the host: one
    argmax over the logits' device, one copy of the [B, k+1] samples back (the step's only sync), the prefix match
    in numpy. On CUDA that is 1 kernel and 1 copy where the device-side match took ~15 small kernels and two
    host-to-device copies of the drafts; the runner reads the tokens on the host anyway."""
    b, k = draft_token_ids.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [{b}, {k + 1}, V], got {tuple(target_logits.shape)}.")
    if num_draft_tokens.shape != (b,):
        raise ValueError(f"num_draft_tokens must be [{b}], got {tuple(num_draft_tokens.shape)}.")
    samples = _argmax_last(target_logits).cpu().numpy()
    return _match_prefix_np(samples, np.asarray(draft_token_ids), np.asarray(num_draft_tokens))


def greedy_verify_lists(target_logits: torch.Tensor, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """`greedy_verify_host` for a few rows, with the drafts as the scheduler's lists and the result as lists: each
    row's emitted tokens (its drafts while they equal the argmax, then the argmax at the first mismatch, or the
    bonus after the last draft). One argmax on the logits' device and one read of the [B, k+1] samples back (the
    step's only sync), the prefix match over Python lists: no [B, k] draft table, no output table, no tensors
    made on the host (each a few microseconds at batch 1, where the runner wants lists anyway).

    target_logits: float [B, k+1, V] with k >= every row's draft count (positions past a row's drafts are not
    read)."""
    b = len(drafts)
    if target_logits.dim() != 3 or target_logits.shape[0] != b:
        raise ValueError(f"target_logits must be [{b}, k+1, V], got {tuple(target_logits.shape)}.")
    reps = target_logits.shape[1]
    if any(len(d) >= reps for d in drafts):
        raise ValueError(f"{reps} positions a row verify at most {reps - 1} drafts, got {[len(d) for d in drafts]}.")
    out = []
    for s, d in zip(_argmax_last(target_logits).tolist(), drafts):
        a, n = 0, len(d)
        while a < n and s[a] == d[a]:
            a += 1
        out.append(s[: a + 1])
    return out


# Up to this many rows the prefix match walks Python lists (measured on Zen 4: 2.4 us at batch 1, 6.2 at 8, against
# ~10-12 us for the numpy form's fixed cost).
MATCH_LOOP_MAX_BATCH = 16


def _match_prefix_np(samples: np.ndarray, drafts: np.ndarray, num_draft: np.ndarray) -> RejectionSamplerOutput:
    """The prefix match of `_keep_matching_prefix` in numpy: samples int64 [B, k+1], drafts [B, k], num_draft [B]."""
    b, k = drafts.shape
    if b <= MATCH_LOOP_MAX_BATCH:
        out = np.full((b, k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        num_accepted = np.zeros(b, dtype=np.int64)
        for i, (s, d, n) in enumerate(zip(samples.tolist(), drafts.tolist(), num_draft.tolist())):
            a = 0
            while a < n and s[a] == d[a]:
                a += 1
            out[i, : a + 1] = s[: a + 1]
            num_accepted[i] = a
        return RejectionSamplerOutput(
            output_token_ids=torch.from_numpy(out), num_accepted=torch.from_numpy(num_accepted)
        )
    accepted = (samples[:, :k] == drafts) & (np.arange(k)[None, :] < num_draft[:, None])
    num_accepted = accepted.cumprod(axis=1).sum(axis=1, dtype=np.int64)  # length of the accepted prefix
    out = np.where(np.arange(k + 1)[None, :] <= num_accepted[:, None], samples, PLACEHOLDER_TOKEN_ID)
    return RejectionSamplerOutput(
        output_token_ids=torch.from_numpy(out.astype(np.int64, copy=False)), num_accepted=torch.from_numpy(num_accepted)
    )


def _argmax_last(x: torch.Tensor) -> torch.Tensor:
    """int64 argmax over the last dim (the first maximum on ties, as torch's). On CPU through numpy on a float32
    view: measured 12 vs 94 us for bf16 [6, 4096] logits (torch 2.13, Zen 4), 3 vs 22 us in float32."""
    if x.device.type != "cpu" or not HOST_FAST_PATHS:
        return x.argmax(dim=-1)
    return torch.from_numpy(x.float().numpy().argmax(axis=-1).astype(np.int64, copy=False))


def _keep_matching_prefix(
    sampled: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor
) -> RejectionSamplerOutput:
    """sampled int64 [B, k+1] (one token per position): keep the drafts while they equal the samples, then the
    sample at the first mismatch (or the bonus after the last draft)."""
    if (
        sampled.device.type == "cpu" and HOST_FAST_PATHS
    ):  # a handful of numpy calls: several times cheaper than torch ops at small batch
        return _keep_matching_prefix_host(sampled, draft_token_ids, num_draft_tokens)
    return _keep_matching_prefix_torch(sampled, draft_token_ids, num_draft_tokens)


def _keep_matching_prefix_torch(
    sampled: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor
) -> RejectionSamplerOutput:
    """`_keep_matching_prefix` in torch ops, on the samples' device."""
    b, k = draft_token_ids.shape
    device = sampled.device
    num_draft = num_draft_tokens.to(device=device, dtype=torch.int64)
    valid = torch.arange(k, device=device).unsqueeze(0) < num_draft.unsqueeze(1)
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    accepted = (sampled[:, :k] == drafts) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    columns = torch.arange(k + 1, device=device).unsqueeze(0)
    out = torch.where(columns <= num_accepted.unsqueeze(1), sampled, PLACEHOLDER_TOKEN_ID)
    return RejectionSamplerOutput(output_token_ids=out, num_accepted=num_accepted)


def _keep_matching_prefix_host(
    sampled: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor
) -> RejectionSamplerOutput:
    """`_keep_matching_prefix` for CPU tensors, in numpy (the same result)."""
    return _match_prefix_np(sampled.numpy(), draft_token_ids.cpu().numpy(), num_draft_tokens.cpu().numpy())


# Seeded random rows on devices other than the CPU draw every verified position at once from their generator,
# then rewind it to the state after their emitted tokens' draws (`_seeded_samples`), so no position waits for the
# one before it on the host. The CPU draws position by position and stops at the first mismatch (no sync to save).
# Tests set this True to run the rewind path on the CPU.
SEEDED_REWIND: Optional[bool] = None


def match_sample_host(
    target_probs: torch.Tensor,
    draft_token_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    is_greedy: Optional[torch.Tensor],
    all_greedy: bool,
    all_random: bool,
    generators: Optional[dict[int, torch.Generator]] = None,
    greedy_host: Optional[np.ndarray] = None,
) -> RejectionSamplerOutput:
    """`_match_sample` (point-mass drafts) with the drafts and the result on the host: the same tokens, drawn from
    the same streams, but the device runs only the argmax / race over [B, k+1, V] and one copy of the [B, k+1]
    samples comes back (the step's one sync); the accepted prefix is kept in numpy (`_match_prefix_np`). No
    `greedy.all()` check on the device (the metadata's host flags say it), no copy of the drafts to the device,
    no prefix-match kernels (~12 small launches on CUDA).

    target_probs: [B, k+1, V] (processed logits for greedy rows, probabilities for random ones), on any device.
    draft_token_ids int64 numpy [B, k], num_draft_tokens int64 numpy [B]. is_greedy: bool [B] on the target's
    device, read only when neither all_greedy nor all_random; greedy_host: the same on the host (bool numpy [B]),
    which spares seeded rows in such a batch a read of is_greedy back. generators: row -> seeded generator."""
    generators = generators or {}
    b, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [{b}, {k + 1}, V], got {tuple(target_probs.shape)}.")
    if num_draft_tokens.shape != (b,):
        raise ValueError(f"num_draft_tokens must be [{b}], got {tuple(num_draft_tokens.shape)}.")
    if not (all_greedy or all_random) and (is_greedy is None or is_greedy.shape != (b,)):
        raise ValueError(f"a batch of greedy and random rows needs is_greedy [{b}].")
    if any(not 0 <= row < b for row in generators):
        raise ValueError(f"generators must be keyed by rows in [0, {b}), got {sorted(generators)!r}.")
    target = target_probs.float()
    if all_greedy:
        return _match_prefix_np(_argmax_last(target).cpu().numpy(), draft_token_ids, num_draft_tokens)
    vocab, device = target.shape[2], target.device
    race = (target / _exponential((b, k + 1, vocab), device, None)).argmax(dim=2)
    sampled = race if all_random else torch.where(is_greedy.unsqueeze(1), target.argmax(dim=2), race)  # type: ignore[union-attr]
    rewind: list[tuple[int, torch.Generator, list[torch.Tensor]]] = []
    if generators:
        greedy_rows = greedy_host
        if greedy_rows is None and not all_random:
            greedy_rows = is_greedy.cpu().numpy()  # type: ignore[union-attr]
        rewinds = SEEDED_REWIND if SEEDED_REWIND is not None else device.type != "cpu"
        for row, gen in generators.items():  # seeded rows: one [V] draw per emitted token, in order
            if greedy_rows is not None and greedy_rows[row]:
                continue
            states = _seeded_samples(
                sampled, target, row, gen, draft_token_ids[row], int(num_draft_tokens[row]), rewinds
            )
            if states is not None:
                rewind.append((row, gen, states))
    out = _match_prefix_np(sampled.cpu().numpy(), draft_token_ids, num_draft_tokens)
    if rewind:
        accepted = out.num_accepted.numpy()
        for row, gen, states in rewind:  # leave each generator as drawing only the emitted tokens would
            drawn = int(accepted[row]) + 1
            if drawn < len(states) - 1:
                gen.set_state(states[drawn])
    return out


def _seeded_samples(
    sampled: torch.Tensor,
    target: torch.Tensor,
    row: int,
    gen: torch.Generator,
    drafts: np.ndarray,
    n: int,
    rewind: bool,
) -> Optional[list[torch.Tensor]]:
    """Row `row`'s samples at positions 0..n from its own generator, written into `sampled`. Sequential (rewind
    False): a draw per position up to the first mismatch with the drafts, one host read each. Rewind: all n + 1
    draws without reading any, returning the generator's state before each draw and after the last (the caller
    sets the one after the emitted tokens' draws once the accepted length is known)."""
    vocab, device = target.shape[2], target.device
    if not rewind:
        for pos in range(n + 1):
            token = int((target[row, pos] / _exponential((vocab,), device, gen)).argmax())
            sampled[row, pos] = token
            if pos < n and token != int(drafts[pos]):
                break
        return None
    states = []
    for pos in range(n + 1):
        states.append(gen.get_state())
        sampled[row, pos] = (target[row, pos] / _exponential((vocab,), device, gen)).argmax()
    states.append(gen.get_state())
    return states


def _match_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> RejectionSamplerOutput:
    """Point-mass drafts: sample every position from its target, keep the drafts while they equal the samples."""
    b, k = draft_token_ids.shape
    vocab = target_probs.shape[2]
    device = target_probs.device
    num_draft = num_draft_tokens.to(device=device, dtype=torch.int64)
    greedy = is_greedy.to(device=device, dtype=torch.bool)
    target = target_probs.float()
    sampled = target.argmax(dim=2)  # [B, k+1]; greedy rows keep this
    if not bool(greedy.all()):
        drafts = draft_token_ids.to(device=device, dtype=torch.int64)
        noise = _exponential((b, k + 1, vocab), device, None)
        sampled = torch.where(greedy.unsqueeze(1), sampled, (target / noise).argmax(dim=2))
        for row, gen in generators.items():  # seeded rows: one [V] draw per emitted token, in order
            if bool(greedy[row]):
                continue
            n = int(num_draft[row])
            for pos in range(n + 1):
                token = int((target[row, pos] / _exponential((vocab,), device, gen)).argmax())
                sampled[row, pos] = token
                if pos < n and token != int(drafts[row, pos]):
                    break
    return _keep_matching_prefix(sampled, draft_token_ids, num_draft)
