"""Speculative decoding (vLLM's `speculative_config`): n-gram or draft-model proposals verified in one forward pass.

The pieces, each unit-tested on its own:
- `ngram_proposer.NgramProposer`: prompt-lookup proposals (`method: "ngram"`), batched over numpy histories.
- `rejection_sampler.rejection_sample`: verifies a batch of proposals against the target's distributions in
  batched torch ops; exact greedy equality, and the target distribution kept exactly for sampled rows.
- `draft_budget.DraftBudget`: at batch > 1, whether a step's n-gram drafts pay for a verify step (expected accepted
  tokens against the engine's measured plain/verify step times), and vLLM's `disable_by_batch_size`.
- `uniform_drafts.UniformDrafts`: where the runner captures verify CUDA graphs, pads a batch step's n-gram drafts to
  one length (fillers are point-mass drafts: verified, kept only when they are the target's own token), so the
  step replays a graph instead of running eager.
- `metrics.SpecDecodingStats`: the `vllm:spec_decode_*` counters a scheduler step carries, and the log line.

How the engine uses them:
- Config: `SpeculativeConfig` (config.py) on EngineArgs / `LLM(speculative_config=...)` / `--speculative-config`.
- Scheduler (`core/sched/spec_decode.py`): a decoding request with drafts runs its last token plus the drafts
  (budget and KV slots count them; `SchedulerOutput.scheduled_spec_decode_tokens`); after the step
  `num_computed_tokens` drops back over the rejected drafts, so their slots are rewritten and the prefix cache
  (full blocks of computed tokens only) never holds one; accepted tokens are appended one by one through the
  usual stop checks. Grammar requests get one bitmask row per verified position (matcher advanced through the
  drafts, then rolled back); requests with unmet min_tokens or multi-token bad words get no drafts.
- Runner (`worker/spec_decode_step.py`): writes the drafts into its token buffer, verifies every sampling row's
  1 + k positions with the sampler's processors and warpers (penalties counting the drafts before each
  position) and this rejection sampler, records the emitted tokens, and proposes the next drafts: n-gram from
  the same buffer (the history lives there), or the draft model (`worker/draft_model.py`: its own paged KV
  cache on the target's block ids, a catch-up pass then k - 1 one-token passes; greedy/seeded rows propose its
  argmax, other random rows sample it and keep q for the min(1, p/q) rule).
"""
