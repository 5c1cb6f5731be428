"""`vllm-lite` CLI: parsing, sampling flags, the streaming loop, the chat loop, and end to end.

The end-to-end tests run the real console entry point in a subprocess on the
bundled default model (no --model), as a user on a fresh install would.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pytest

from vllm_lite.default_model import default_model_path
from vllm_lite.entrypoints.cli import SUBCOMMANDS, build_parser, main
from vllm_lite.entrypoints.cli import generate as generate_module
from vllm_lite.entrypoints.cli.chat import ChatSession, chat_loop
from vllm_lite.entrypoints.cli.sampling_args import sampling_params_from
from vllm_lite.entrypoints.cli.streaming import RequestFailedError, stream_request
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.testing.english import english_fraction, known_words

E2E_TIMEOUT = 600  # engine start-up is slow when the machine is shared


# ---------------------------------------------------------------------------- helpers


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "vllm_lite.entrypoints.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=E2E_TIMEOUT,
        env=env,
    )


@dataclass
class FakeEngine:
    """Steps out scripted deltas for one request, recording what the CLI asked of it."""

    deltas: list[str]
    added: list[tuple[str, object, SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    interrupt_at: int | None = None
    fail_prompts_containing: str | None = None  # the engine errors out such requests
    _step: int = 0

    def add_request(self, request_id, prompt, params) -> None:
        self.added.append((request_id, prompt, params))
        self._step = 0

    def has_unfinished_requests(self) -> bool:
        return self._step < len(self.deltas)

    def abort_request(self, request_id) -> None:
        self.aborted.append(request_id)
        self._step = len(self.deltas)

    def step(self) -> list[RequestOutput]:
        if self.interrupt_at is not None and self._step == self.interrupt_at:
            raise KeyboardInterrupt
        rid = self.added[-1][0]
        i = self._step
        self._step += 1
        finished = self._step == len(self.deltas)
        params = self.added[-1][2]
        delta = params.output_kind == RequestOutputKind.DELTA
        text = self.deltas[i] if delta else "".join(self.deltas[: i + 1])
        comp = CompletionOutput(0, text, [i] if delta else list(range(i + 1)), None, None, "stop" if finished else None)
        if self.fail_prompts_containing and self.fail_prompts_containing in str(self.added[-1][1]):
            self._step = len(self.deltas)
            comp = CompletionOutput(0, "", [], None, None, "abort")
            return [RequestOutput(rid, None, [1], None, [comp], True, error="ValueError: boom")]
        if not delta and not finished:
            return []
        return [RequestOutput(rid, None, [1], None, [comp], finished)]


class RecordingStream(io.StringIO):
    """Remembers the buffer each time it is flushed: shows text left as it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())
        super().flush()


# ---------------------------------------------------------------------------- parsing
def test_console_script_entry_point_is_cli_main():
    eps = [ep for ep in entry_points(group="console_scripts") if ep.name == "vllm-lite"]
    assert eps, "the vllm-lite console script is not installed"
    assert eps[0].value == "vllm_lite.entrypoints.cli:main"
    assert eps[0].load() is main


def test_one_registry_holds_every_subcommand():
    from vllm_lite.entrypoints.cli.types import CLISubcommand

    parser, by_name = build_parser()
    assert set(by_name) == {"generate", "chat", "serve", "api-server", "worker"}
    assert all(isinstance(cmd, CLISubcommand) for cmd in SUBCOMMANDS)
    assert [cmd.name for cmd in SUBCOMMANDS] == list(by_name)
    help_text = parser.format_help()
    for name in by_name:
        assert name in help_text
    for name, cmd in by_name.items():
        args = parser.parse_args([name, "p"] if name == "generate" else [name])
        assert args.func == cmd.run


def test_no_subcommand_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "generate" in capsys.readouterr().err


def test_bad_sampling_flag_fails_fast_with_the_field_named(capsys):
    # Must fail before any engine starts (this would otherwise take seconds).
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature" in err and "-1" in err


def test_missing_model_directory_is_a_clear_error(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["generate", "hi", "--model", missing]) == 2
    assert missing in capsys.readouterr().err


def test_sampling_flags_override_model_defaults_and_unset_flags_keep_them():
    parser, _ = build_parser()
    args = parser.parse_args(["generate", "p", "--top-k", "5", "--max-tokens", "7", "--seed", "3", "--stop", "xx"])
    defaults = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.15)
    sp = sampling_params_from(args, defaults, RequestOutputKind.DELTA)
    assert (sp.temperature, sp.top_p, sp.repetition_penalty) == (0.7, 0.9, 1.15)
    assert (sp.top_k, sp.max_tokens, sp.seed, sp.stop) == (5, 7, 3, ["xx"])
    assert sp.output_kind == RequestOutputKind.DELTA
    args = parser.parse_args(["generate", "p", "--temperature", "0"])
    greedy = sampling_params_from(args, defaults, RequestOutputKind.FINAL_ONLY)
    assert greedy.temperature == 0.0 and greedy.repetition_penalty == 1.15


def test_engine_args_default_to_the_bundled_model_and_carry_engine_flags():
    from vllm_lite.entrypoints.cli.engine_args import engine_args_from

    parser, _ = build_parser()
    ea = engine_args_from(parser.parse_args(["chat", "--dtype", "float32", "-tp", "2", "--seed", "5"]))
    assert ea.model == default_model_path() and ea.served_model_name == "vllm-lite-default"
    assert (ea.dtype, ea.tensor_parallel_size, ea.seed) == ("float32", 2, 5)
    ea = engine_args_from(parser.parse_args(["generate", "p", "--model", "/some/dir", "--max-model-len", "128"]))
    assert ea.model == "/some/dir" and ea.served_model_name is None and ea.max_model_len == 128


def test_generate_quiets_the_engine_with_the_logger_level_not_the_environment(monkeypatch, capsys):
    seen = {}

    class Processor:
        @staticmethod
        def get_default_sampling_params():
            return None

    def fake_build_engine(args):
        seen["level"] = logging.getLogger("vllm_lite").level
        seen["env"] = dict(os.environ)
        engine = FakeEngine(["hi"])
        engine.processor = Processor()
        engine.shutdown = lambda: None
        return engine

    monkeypatch.setattr(generate_module, "build_engine", fake_build_engine)
    logger = logging.getLogger("vllm_lite")
    level_before, env_before = logger.level, dict(os.environ)
    assert main(["generate", "x"]) == 0
    assert seen == {"level": logging.WARNING, "env": env_before}
    assert main(["generate", "x", "--log-level", "debug"]) == 0 and seen["level"] == logging.DEBUG
    assert logger.level == level_before and capsys.readouterr().out == "hi\nhi\n"


# ---------------------------------------------------------------------------- streaming loop
def test_stream_request_writes_each_delta_as_it_arrives():
    engine = FakeEngine(["The", " for", " statement", " is"])
    out = RecordingStream()
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
    result = stream_request(engine, "r", "x", params, out)
    assert out.flushed == ["The", "The for", "The for statement", "The for statement is"]
    assert result.text == "The for statement is"
    assert result.num_tokens == 4 and result.finish_reason == "stop"


def test_stream_request_final_only_writes_once_at_the_end():
    engine = FakeEngine(["a", "b", "c"])
    out = RecordingStream()
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    result = stream_request(engine, "r", "x", params, out)
    assert out.flushed == ["abc"] and result.text == "abc" and result.num_tokens == 3


def test_stream_request_aborts_the_request_on_keyboard_interrupt():
    engine = FakeEngine(["a", "b", "c"], interrupt_at=1)
    with pytest.raises(KeyboardInterrupt):
        stream_request(engine, "r", "x", SamplingParams(output_kind=RequestOutputKind.DELTA), io.StringIO())
    assert engine.aborted == ["r"]


def test_stream_request_raises_request_failed_on_an_engine_error():
    engine = FakeEngine(["a"], fail_prompts_containing="x")
    with pytest.raises(RequestFailedError, match="boom"):
        stream_request(engine, "r", "x", SamplingParams(output_kind=RequestOutputKind.DELTA), io.StringIO())


# ---------------------------------------------------------------------------- chat loop
@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def test_chat_session_renders_the_template_with_history(default_tokenizer):
    s = ChatSession(default_tokenizer, max_model_len=512, max_tokens=64, system="Be brief.")
    p1 = s.prompt_for("What is a list?")
    assert p1.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>system\nBe brief.<|im_end|>" in p1 and "What is a list?" in p1
    s.record("What is a list?", " A sequence. ")
    p2 = s.prompt_for("And a tuple?")
    assert "A sequence.<|im_end|>" in p2 and p2.index("What is a list?") < p2.index("And a tuple?")


def test_chat_session_drops_oldest_turns_to_fit_the_context(default_tokenizer):
    s = ChatSession(default_tokenizer, max_model_len=120, max_tokens=40)
    for i in range(10):
        s.record(f"question number {i} about the for statement", f"answer number {i} " * 3)
    prompt = s.prompt_for("last question")
    assert len(default_tokenizer.encode(prompt)) <= 120 - 40
    assert "last question" in prompt and "question number 0 " not in prompt
    assert "answer number 9" in prompt  # the newest history survives


def test_chat_session_rejects_a_message_that_cannot_fit(default_tokenizer):
    s = ChatSession(default_tokenizer, max_model_len=64, max_tokens=32)
    with pytest.raises(ValueError, match="max_model_len=64"):
        s.prompt_for("word " * 100)


def test_chat_loop_answers_each_line_resets_and_stops_at_exit(default_tokenizer):
    engine = FakeEngine(["Hello", " there"])
    session = ChatSession(default_tokenizer, 512, 16)
    params = SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA)
    inp = io.StringIO("first\n\n/reset\nsecond\n/exit\nnever read\n")
    out = io.StringIO()
    assert chat_loop(engine, session, params, inp, out, interactive=False) == 2
    assert out.getvalue() == "Hello there\n(conversation reset)\nHello there\n"
    # After /reset the second prompt does not carry the first exchange.
    assert "first" in engine.added[0][1] and "first" not in engine.added[1][1]
    assert [r for r, _, _ in engine.added] == ["chat-0", "chat-1"]


def test_chat_loop_reports_a_failed_or_too_long_message_and_goes_on(default_tokenizer):
    engine = FakeEngine(["fine"], fail_prompts_containing="poison")
    session = ChatSession(default_tokenizer, 64, 16)
    inp = io.StringIO("poison\n" + "word " * 200 + "\nhello\n")
    out, err = io.StringIO(), io.StringIO()
    n = chat_loop(engine, session, SamplingParams(output_kind=RequestOutputKind.DELTA), inp, out, False, err)
    assert n == 1 and out.getvalue() == "fine\n"
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and "boom" in lines[0] and "max_model_len=64" in lines[1]
    # The failed exchange is not kept as history.
    assert "poison" not in engine.added[-1][1]


def test_chat_loop_ends_on_eof(default_tokenizer):
    engine = FakeEngine(["ok"])
    session = ChatSession(default_tokenizer, 512, 16)
    out = io.StringIO()
    n = chat_loop(engine, session, SamplingParams(output_kind=RequestOutputKind.DELTA), io.StringIO("hi\n"), out, False)
    assert n == 1 and out.getvalue() == "ok\n"


# ---------------------------------------------------------------------------- end to end
E2E_RUNS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "generate": (
        ("generate", "The for statement", "--max-tokens", "24", "--temperature", "0", "--num-threads", "1"),
        None,
    ),
    "chat": (
        ("chat", "--max-tokens", "32", "--temperature", "0", "--num-threads", "1"),
        "What does the function os.path.join do?\n",
    ),
}


@pytest.fixture(scope="module")
def e2e_runs() -> dict[str, subprocess.CompletedProcess]:
    """Both end-to-end CLI runs, started together: they are independent processes (each with its own
    engine core), and the suite otherwise keeps one core of a two-core CI machine idle while each starts."""
    with ThreadPoolExecutor(len(E2E_RUNS)) as pool:
        futures = {name: pool.submit(_cli, *args, stdin=stdin) for name, (args, stdin) in E2E_RUNS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
def test_generate_with_no_model_prints_english_like_text(e2e_runs):
    proc = e2e_runs["generate"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout.strip()
    words = text.split()
    assert len(words) >= 8, text
    frac = english_fraction(text, known_words())
    assert frac >= 0.7, (frac, text)
    assert len(set(words)) >= len(words) / 3, f"degenerate repetition: {text!r}"


@pytest.mark.slow
def test_chat_answers_one_line_from_stdin_and_exits_on_eof(e2e_runs):
    proc = e2e_runs["chat"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    reply = proc.stdout
    assert reply.endswith("\n") and reply.count("\n") >= 1
    assert "<|im_" not in reply  # special tokens are not printed
    assert len(reply.split()) >= 3, reply
    assert english_fraction(reply, known_words()) >= 0.6, reply
