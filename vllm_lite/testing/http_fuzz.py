"""An HTTP fuzzer for the OpenAI endpoints: hypothesis bodies from the schema, and the issue's cases.

Shared by ``tests/reliability/test_http_fuzz.py`` and ``benchmarks/soak.py``. Bodies mix
plausible values (small ``max_tokens`` and ``n``, so the valid ones finish fast) with hostile
ones: wrong types, huge and negative numbers, NaN, lone surrogates, deep nesting, unknown
fields, bad roles, missing content. Whatever the body, the answer must be a 200 (a JSON
completion or an SSE stream ending in ``[DONE]``) or a 4xx with an OpenAI-style JSON error
that leaks nothing of the server's insides: never a 5xx. Problems are collected, not
raised, so hypothesis runs every example instead of shrinking the first failure.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from vllm_lite.testing.fuzz_report import FuzzReport

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# What a 4xx message must never show of the server (tracebacks, paths, tokenizer internals).
LEAKS = ("Traceback", 'File "', "site-packages", "pyo3", "PanicException", "vllm_lite/", "object at 0x")

LONE_SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800", "ok \ud83d"]
HUGE = [10**30, -(10**30), 2**63, 2**64, -(2**63) - 1, 10**400]


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def hostile_json() -> st.SearchStrategy:
    """A value of any JSON type, often a nasty one."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 5),
        st.sampled_from(HUGE),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(LONE_SURROGATES),
        st.sampled_from(["", "4", "true", "null", "-1", "1e999"]),
    )
    nested = st.recursive(
        leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3)
    )
    return st.one_of(nested, st.sampled_from([_deep(64), _deep(600), {"a": _deep(200)}]))


SMALL_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cc"]), min_size=1, max_size=24)

COMMON_FIELDS: dict[str, st.SearchStrategy] = {
    "model": st.just("__MODEL__"),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 1.0),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**31),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(SMALL_TEXT, st.lists(SMALL_TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 1999), max_size=3),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, 1999).map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "priority": st.integers(-10, 10),
    "allowed_token_ids": st.lists(st.integers(0, 1999), min_size=1, max_size=4),
    "bad_words": st.lists(SMALL_TEXT, max_size=2),
    "user": SMALL_TEXT,
    "skip_special_tokens": st.booleans(),
    "truncate_prompt_tokens": st.integers(1, 8),
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy] = {
    **COMMON_FIELDS,
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "best_of": st.integers(1, 2),
}
CHAT_FIELDS: dict[str, st.SearchStrategy] = {
    **COMMON_FIELDS,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "max_completion_tokens": st.integers(1, 6),
    "add_generation_prompt": st.booleans(),
    "tools": st.just([]),
}

PROMPTS = st.one_of(
    SMALL_TEXT,
    SMALL_TEXT,
    st.lists(st.integers(0, 1999), min_size=1, max_size=8),
    st.lists(SMALL_TEXT, min_size=1, max_size=2),
    st.lists(st.integers(), min_size=1, max_size=4),  # out of vocabulary, negative, huge
    st.sampled_from(["", [], [[]], LONE_SURROGATES[0], [LONE_SURROGATES[1]], "x" * 5000]),
    hostile_json(),
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "hacker", "", "USER", None, 7])
CONTENT = st.one_of(
    SMALL_TEXT,
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SMALL_TEXT}), min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", "nope"])}), max_size=2),
    st.sampled_from(LONE_SURROGATES),
    hostile_json(),
)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": SMALL_TEXT}),
    st.fixed_dictionaries({"role": ROLES, "content": CONTENT}),
    st.fixed_dictionaries({"role": ROLES}),  # missing content
    st.fixed_dictionaries({"content": CONTENT}),  # missing role
    st.fixed_dictionaries({"role": ROLES, "content": CONTENT, "name": hostile_json(), "zzz": hostile_json()}),
    hostile_json(),
)
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), st.just([]), hostile_json())


def _body(main_key: str, main: st.SearchStrategy, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A plausible body, then 0-3 mutations: a field set to any value, removed, or an unknown one added."""
    plausible = st.tuples(st.fixed_dictionaries({main_key: main}), st.fixed_dictionaries({}, optional=fields))
    names = st.sampled_from([main_key, *fields, "foo", "__proto__", "prompt_embeds", "x" * 300])
    mutation = st.tuples(st.sampled_from(["set", "set", "drop"]), names, hostile_json())

    def build(parts: tuple[tuple[dict, dict], list[tuple[str, str, Any]]]) -> dict[str, Any]:
        (required, optional), mutations = parts
        body = {**optional, **required}
        for op, name, value in mutations:
            if op == "set":
                body[name] = value
            else:
                body.pop(name, None)
        return body

    return st.tuples(plausible, st.lists(mutation, max_size=3)).map(build)


# Raw bodies that are not JSON objects, or not JSON at all.
RAW_CASES: list[tuple[str, bytes, str]] = [
    ("empty body", b"", "application/json"),
    ("invalid JSON", b'{"prompt": "x", ', "application/json"),
    ("JSON array", b'[{"prompt": "x"}]', "application/json"),
    ("JSON string", b'"prompt"', "application/json"),
    ("NaN literal", b'{"prompt": "x", "temperature": NaN}', "application/json"),
    ("Infinity", b'{"prompt": "x", "max_tokens": Infinity}', "application/json"),
    ("duplicate keys", b'{"prompt": "x", "max_tokens": 2, "max_tokens": "2"}', "application/json"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "application/json"),
    ("raw lone surrogate escape", b'{"prompt": "\\ud800"}', "application/json"),
    ("deep nesting 100k", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json"),
    ("huge number literal", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json"),
    ("text/plain", b'{"prompt": "x", "max_tokens": 2}', "text/plain"),
    ("form body", b"prompt=x&max_tokens=2", "application/x-www-form-urlencoded"),
]


def issue_cases(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """The bodies the issue lists: (name, endpoint, body); each must be a 4xx, never a 500."""
    hi = {"model": model, "prompt": "Hello", "max_tokens": 2}
    user = [{"role": "user", "content": "Hi"}]
    return [
        ("n=10000", COMPLETIONS, {**hi, "n": 10000}),
        ("best_of=10000", COMPLETIONS, {**hi, "best_of": 10000}),
        ("priority=10**30", COMPLETIONS, {**hi, "priority": 10**30}),
        ('max_tokens:"4"', COMPLETIONS, {**hi, "max_tokens": "4"}),
        ('n:"2"', COMPLETIONS, {**hi, "n": "2"}),
        ('stream:"yes"', COMPLETIONS, {**hi, "stream": "yes"}),
        ("lone surrogate prompt", COMPLETIONS, {**hi, "prompt": "a\ud800b"}),
        ("n=10000 chat", CHAT, {"model": model, "messages": user, "n": 10000}),
        ("priority=10**30 chat", CHAT, {"model": model, "messages": user, "priority": 10**30}),
        ("message without content", CHAT, {"model": model, "messages": [{"role": "user"}]}),
        ("role hacker", CHAT, {"model": model, "messages": [{"role": "hacker", "content": "x"}]}),
        ("lone surrogate content", CHAT, {"model": model, "messages": [{"role": "user", "content": "\udfff"}]}),
        ('max_tokens:"4" chat', CHAT, {"model": model, "messages": user, "max_tokens": "4"}),
        ("logit_bias out of vocab", COMPLETIONS, {**hi, "logit_bias": {"99999999": 5}}),
        ("allowed_token_ids out of vocab", COMPLETIONS, {**hi, "allowed_token_ids": [2**40]}),
        ("prompt ids out of vocab", COMPLETIONS, {**hi, "prompt": [1, 2, 10**9]}),
    ]


def encode(body: Any) -> bytes:
    """JSON as a hostile client writes it: lone surrogates as \\u escapes, NaN as the bare literal."""
    return json.dumps(body, ensure_ascii=True).encode()


def judge(resp: httpx.Response, stream: bool) -> tuple[str, Optional[str]]:
    """(outcome, problem or None) for one answer."""
    status = resp.status_code
    if status >= 500:
        return f"{status}", f"HTTP {status}: {resp.text[:300]}"
    if status == 200:
        if not stream:
            try:
                data = resp.json()
            except ValueError:
                return "200", f"200 with a body that is not JSON: {resp.text[:200]}"
            return "200", None if isinstance(data.get("choices"), list) else f"200 without choices: {resp.text[:200]}"
        events = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "200-stream", f"stream without a final [DONE]: {resp.text[-300:]}"
        for ev in events[:-1]:
            err = json.loads(ev).get("error")
            if err is not None:
                code = err.get("code")
                problem = f"stream error event {code}: {err}" if not isinstance(code, int) or code >= 500 else None
                return f"200-stream-error-{code}", problem
        return "200-stream", None
    try:
        err = resp.json()["error"]
        ok = isinstance(err["message"], str) and isinstance(err["type"], str) and err["code"] == status
    except (ValueError, KeyError, TypeError):
        return f"{status}", f"{status} without an OpenAI-style error: {resp.text[:300]}"
    if not ok:
        return f"{status}", f"{status} with a malformed error: {err}"
    leaked = [word for word in LEAKS if word in err["message"]]
    if leaked:
        return f"{status}", f"{status} leaks {leaked}: {err['message'][:300]}"
    return f"{status}", None


class HttpFuzzer:
    """Sends bodies to one server and records what came back."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 120.0) -> None:
        self.base_url = base_url
        self.model = model
        self.client = httpx.Client(timeout=timeout_s)
        self.report = FuzzReport()

    def close(self) -> None:
        self.client.close()

    def send(self, name: str, endpoint: str, content: bytes, content_type: str = "application/json") -> int:
        stream = b'"stream": true' in content
        resp = self.client.post(self.base_url + endpoint, content=content, headers={"content-type": content_type})
        outcome, problem = judge(resp, stream)
        self.report.tried[name] += 1
        self.report.outcomes[outcome] += 1
        if problem is not None:
            self.report.problems.append(f"{name} {endpoint} {content[:200]!r}: {problem}")
        return resp.status_code

    def fuzz(self, examples: int, seed: int = 0) -> None:
        """``examples`` hypothesis bodies per endpoint (the same ones for the same ``seed``)."""
        for endpoint, strategy in (
            (COMPLETIONS, _body("prompt", PROMPTS, COMPLETION_FIELDS)),
            (CHAT, _body("messages", MESSAGES, CHAT_FIELDS)),
        ):

            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @hypothesis_seed(seed)
            @given(body=strategy, endpoint=st.just(endpoint))
            def one(body: dict[str, Any], endpoint: str) -> None:
                if body.get("model") == "__MODEL__":
                    body["model"] = self.model
                self.send("hypothesis " + endpoint.rsplit("/", 1)[1], endpoint, encode(body))

            one()

    def issue(self) -> None:
        """The issue's cases: each a 4xx."""
        for name, endpoint, body in issue_cases(self.model):
            status = self.send(name, endpoint, encode(body))
            if not 400 <= status < 500:
                self.report.problems.append(f"{name}: expected a 4xx, got {status}")

    def raw(self) -> None:
        """Bodies that are not JSON objects (both endpoints): each a 4xx."""
        for endpoint in (COMPLETIONS, CHAT):
            for name, content, ctype in RAW_CASES:
                status = self.send("raw: " + name, endpoint, content, ctype)
                if not 400 <= status < 500:
                    self.report.problems.append(f"raw {name} {endpoint}: expected a 4xx, got {status}")

    def huge_bodies(self, count: int, size: int, expect: int = 413) -> list[float]:
        """``count`` bodies of ``size`` bytes (a prompt string), each answered ``expect``; seconds per answer.

        Over --max-request-body-bytes: 413 before parsing. Under it but longer than any prompt the
        model takes: 400 before tokenizing."""
        content = b'{"prompt": "' + b"a" * size + b'", "max_tokens": 2}'
        took = []
        for _ in range(count):
            start = time.monotonic()
            status = self.send("huge body", COMPLETIONS, content)
            took.append(time.monotonic() - start)
            if status != expect:
                self.report.problems.append(f"a {size}-byte body: expected {expect}, got {status}")
        return took
