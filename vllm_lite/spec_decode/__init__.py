"""Speculative decoding building blocks (vLLM's `speculative_config`), unit-tested but not yet in the engine.

What exists:
- `ngram_proposer.NgramProposer`: prompt-lookup proposals (`method: "ngram"`), batched over numpy histories.
- `rejection_sampler.rejection_sample`: verifies a batch of proposals against the target's distributions in
  batched torch ops; exact greedy equality, and the target distribution kept exactly for sampled rows.
- `metrics.SpecDecodingStats`: the `vllm:spec_decode_*` counters a scheduler step will carry.

Next step (wiring, in this order):
1. Config: `speculative_config` on EngineArgs/LLM/`--speculative-config` only once the pieces below run.
2. Scheduler: reserve `num_lookahead_slots` (= num_speculative_tokens) per running request, count the draft tokens
   in the token budget, schedule `1 + len(drafts)` tokens per decode and send the drafts in SchedulerOutput
   (`scheduled_spec_decode_tokens`); in update_from_output append the accepted tokens, roll back structured-output
   matchers for rejected ones, apply stop conditions token by token, and feed SpecDecodingStats.
3. KV cache: free the slots of rejected tokens (num_computed_tokens drops back) and never cache a block holding a
   rejected token in the prefix cache.
4. Runner: one verification pass over all proposals (query length 1 + k per request through the mixed-batch
   attention), target probabilities per position from the sampler's processors and warpers, this rejection
   sampler, penalties/logprobs per emitted token, the proposer run on the updated histories; a draft model gets its
   own KV cache in the same worker. Seeded rows: the generator-skipping after preemption
   (`SamplingState._make_generator`) must count this sampler's draws (k uniforms + one [V] vector per step).
"""
