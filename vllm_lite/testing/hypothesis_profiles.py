"""Hypothesis profiles, loaded as a pytest plugin (`-p vllm_lite.testing.hypothesis_profiles`).

"mutation": few examples per property, for mutmut runs (docs/MUTATION.md), where every surviving mutant re-runs
each covering test; the properties' own example counts stay the ceiling (see `max_examples`).
"""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("mutation", max_examples=8)


def max_examples(default: int) -> int:
    """A property's example count: its own `default`, lowered by the loaded profile (never raised by it)."""
    return min(default, settings().max_examples)
