"""An HTTP fuzzer over `/v1/completions` and `/v1/chat/completions` of a real `vllm-lite serve`.

Hypothesis bodies from the OpenAI schema (plausible bodies with fields set to any JSON value,
removed, or unknown ones added: wrong types, huge and negative numbers, NaN, lone surrogates,
deep nesting, bad roles, missing content), bodies that are not JSON objects, the issue's list,
and bodies over the size limit. Never a 5xx; every 4xx an OpenAI-style JSON error that leaks
no internals; the server healthy after, no request left, every block free. Run with -s for counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from vllm_lite.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES
from vllm_lite.testing.http_fuzz import HttpFuzzer
from vllm_lite.testing.target_daemon import TargetDaemon, rss_mb

EXAMPLES_PER_ENDPOINT = 60


@pytest.fixture(scope="module")
def fuzzer(target: TargetDaemon) -> Iterator[HttpFuzzer]:
    model = httpx.get(target.base_url + "/v1/models", timeout=60).json()["data"][0]["id"]
    f = HttpFuzzer(target.base_url, model)
    yield f
    f.close()


def _after(target: TargetDaemon, fuzzer: HttpFuzzer, name: str) -> None:
    target.assert_serves()
    target.wait_clean()
    print("\n" + fuzzer.report.line(f"http {name}"))
    assert not fuzzer.report.problems, fuzzer.report.problems


def test_hypothesis_bodies_on_both_endpoints_never_get_a_5xx(target, fuzzer) -> None:
    fuzzer.fuzz(EXAMPLES_PER_ENDPOINT, seed=21)
    _after(target, fuzzer, "hypothesis")
    assert fuzzer.report.outcomes["400"] > 0 and fuzzer.report.outcomes["200"] > 0  # both sides were reached


def test_the_issue_s_bodies_and_non_json_bodies_are_4xx(target, fuzzer) -> None:
    fuzzer.issue()
    fuzzer.raw()
    _after(target, fuzzer, "issue + raw")


def test_bodies_too_large_are_refused_before_parsing(target, fuzzer) -> None:
    frontend = target.frontend_pids()[0]
    before = rss_mb(frontend)
    under = fuzzer.huge_bodies(2, 10 << 20, expect=400)  # under the body limit, longer than any prompt
    over = fuzzer.huge_bodies(2, DEFAULT_MAX_REQUEST_BODY_BYTES + 1, expect=413)
    _after(target, fuzzer, "huge bodies")
    print(
        f"  10 MB body answered in {max(under):.2f} s (400), {DEFAULT_MAX_REQUEST_BODY_BYTES + 1} B in "
        f"{max(over):.2f} s (413); frontend RSS {before:.0f} -> {rss_mb(frontend):.0f} MB"
    )
