"""LoRA adapters through `vllm-lite serve` (one real daemon for the module, tiny float32 Llama): the official
`openai` client picks adapters by `model`, tokens equal `LLM.generate` with the same LoRARequest, /v1/models
lists them, and adapters load and unload at runtime ($VLLM_ALLOW_RUNTIME_LORA_UPDATING, set only in the
daemon's environment)."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.openai.serving_models import adapter_id
from vllm_lite.lora.request import LoRARequest
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.lora_checkpoints import ATTN, MLP, AdapterSpec, build_lora_adapter
from vllm_lite.testing.serve_process import ServeProcess

PROMPT = "The for statement"
MAX_TOKENS = 6
SPECS = {
    "sql": AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=11),
    "poem": AdapterSpec(r=8, lora_alpha=16, target_modules=ATTN + MLP, seed=12),
    "late": AdapterSpec(r=4, lora_alpha=4, target_modules=MLP, seed=13),
}
ENGINE = ["--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("serve-lora")
    base = get_checkpoint("llama")
    return {name: build_lora_adapter(base, str(root / name), spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def daemon(adapters):
    """The daemon with two adapters from --lora-modules (both spellings) and runtime loading allowed."""
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    args = [get_checkpoint("llama"), "--port", "0", "--core-port", "0", *ENGINE]
    args += ["--lora-modules", f"sql={adapters['sql']}", f'{{"name": "poem", "path": "{adapters["poem"]}"}}']
    proc = ServeProcess(args, env)
    try:
        # (core address, API base URL), from the start-up lines in the order they are printed.
        yield proc.core_address(), proc.api_base()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(daemon) -> str:
    return daemon[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(daemon, adapters) -> dict[str, list[int]]:
    """Greedy tokens of LLM.generate with the same LoRARequests, from a Python frontend attached to the daemon's
    core beside the HTTP one (it learns the core's LoRA limits from READY; the ids agree by construction)."""
    llm = LLM(engine_address=daemon[0])
    try:
        # The HTTP frontend loaded its --lora-modules into the core under the ids this frontend derives too.
        static = {adapter_id(name, adapters[name]) for name in ("sql", "poem")}
        assert set(llm.llm_engine.list_loras()) == static
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = {"base": list(llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids)}
        for name, path in adapters.items():
            lora = LoRARequest(name, adapter_id(name, path), path)
            out[name] = list(llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids)
    finally:
        llm.shutdown()
    assert len({tuple(v) for v in out.values()}) == len(out), "each adapter must change the greedy tokens"
    return out


def completion_tokens(client: openai.OpenAI, model: str) -> list[int]:
    resp = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert resp.model == model
    return list(resp.choices[0].token_ids)  # type: ignore[attr-defined]


def test_openai_client_completes_with_each_adapter_and_the_base_model_as_llm_generate_does(client, reference):
    model = client.models.list().data[0].id
    assert completion_tokens(client, model) == reference["base"]
    assert completion_tokens(client, "sql") == reference["sql"]
    assert completion_tokens(client, "poem") == reference["poem"]


def test_streaming_completion_and_chat_run_the_adapter(client, reference):
    stream = client.completions.create(
        model="poem",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    streamed: list[int] = []
    for chunk in stream:
        assert chunk.model == "poem"
        streamed += list(getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else []
    assert streamed == reference["poem"]
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="sql", messages=messages, max_tokens=4, temperature=0)
    chunks = list(
        client.chat.completions.create(model="sql", messages=messages, max_tokens=4, temperature=0, stream=True)
    )
    assert plain.model == "sql" and {c.model for c in chunks} == {"sql"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    base = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=4, temperature=0
    )
    assert base.choices[0].message.content != plain.choices[0].message.content


def test_models_lists_the_base_model_and_the_adapters_with_parent_and_root(client, adapters):
    cards = client.models.list().data
    base = cards[0]
    assert base.parent is None  # type: ignore[attr-defined]
    assert [(c.id, c.parent, c.root) for c in cards[1:]] == [  # type: ignore[attr-defined]
        ("sql", base.id, adapters["sql"]),
        ("poem", base.id, adapters["poem"]),
    ]


def test_load_run_unload_round_trip_then_the_name_is_a_404(server, client, adapters, reference):
    with pytest.raises(openai.NotFoundError, match="The model `late` does not exist."):
        completion_tokens(client, "late")
    body = {"lora_name": "late", "lora_path": adapters["late"]}
    r = httpx.post(server + "/v1/load_lora_adapter", json=body, timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert completion_tokens(client, "late") == reference["late"]
    assert "late" in [c.id for c in client.models.list().data]
    # Three adapters over two device slots: all still right.
    assert completion_tokens(client, "sql") == reference["sql"]
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError, match="The model `late` does not exist."):
        completion_tokens(client, "late")
    assert "late" not in [c.id for c in client.models.list().data]


def test_load_refuses_a_duplicate_name_a_missing_directory_and_a_directory_that_is_no_adapter(
    server, adapters, tmp_path
):
    cases = [
        ({"lora_name": "sql", "lora_path": adapters["late"]}, 400, "The lora adapter 'sql' has already been loaded."),
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 404, "No adapter found for 'x'"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "is not a PEFT adapter directory"),
    ]
    for body, status, message in cases:
        r = httpx.post(server + "/v1/load_lora_adapter", json=body, timeout=120)
        assert r.status_code == status, r.text
        assert message in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=120)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'x' cannot be found."
