"""What a fuzzer tried and what it found: counts for the printout, problems that fail the run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class FuzzReport:
    """Cases tried and outcomes by kind; ``problems`` lists every misbehaviour (must stay empty)."""

    tried: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return sum(self.tried.values())

    def line(self, name: str) -> str:
        """One line for -s output: totals, then the counts by kind."""
        return (
            f"[{name}] cases={self.cases} problems={len(self.problems)}\n"
            f"  tried={dict(sorted(self.tried.items()))}\n"
            f"  outcomes={dict(sorted(self.outcomes.items()))}"
            + "".join(f"\n  PROBLEM: {p}" for p in self.problems[:20])
        )
