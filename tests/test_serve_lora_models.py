"""LoRA adapters over HTTP without a model: --lora-modules parsing, adapter ids across frontends, and the
/v1/models, load/unload and `model`-selects-the-adapter rules of the OpenAI server, over a fake engine
that records what reaches it (the real engine path is tests/test_serve_lora.py)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Optional

import httpx
import pytest

from vllm_lite.entrypoints.openai.api_server import build_app, init_static_loras
from vllm_lite.entrypoints.openai.lora_modules import LoRAModulePath, parse_lora_modules
from vllm_lite.entrypoints.openai.protocol import LoadLoRAAdapterRequest
from vllm_lite.entrypoints.openai.serving_models import OpenAIServingModels, adapter_id
from vllm_lite.lora.request import LoRARequest
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

MODEL = "base-model"


class LoRAFakeEngine(FakeAsyncLLM):
    """The fake engine with AsyncLLM's adapter API: it keeps what it was given, and refuses a directory
    without adapter_config.json as the engine's validation does."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.loras: dict[int, LoRARequest] = {}
        self.removed: list[int] = []
        self.generated_with: dict[str, Optional[LoRARequest]] = {}

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        if not os.path.isfile(os.path.join(lora_request.lora_path, "adapter_config.json")):
            raise ValueError(f"lora_request.lora_path: no adapter_config.json in {lora_request.lora_path!r}.")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loras.pop(lora_id, None) is not None

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0, lora_request: Any = None):
        self.generated_with[request_id] = lora_request
        async for out in super().generate(prompt, params, request_id, priority):
            yield out


def adapter_dir(root: Any, name: str) -> str:
    path = os.path.join(str(root), name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, f)
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: adapter_dir(root, name) for name in ("sql", "poem", "late")}


def make_app(adapters: dict[str, str], runtime: bool = True) -> tuple[Any, LoRAFakeEngine]:
    engine = LoRAFakeEngine(get_checkpoint("llama"))
    modules = [LoRAModulePath("sql", adapters["sql"]), LoRAModulePath("poem", adapters["poem"], MODEL)]
    app = build_app(engine, MODEL, lora_modules=modules, allow_runtime_lora_updating=runtime)
    return app, engine


def calls(app: Any, *requests: tuple[str, str, Optional[dict]]) -> list[httpx.Response]:
    """Start the app's adapters (as serving does before it says ready), then run the requests in order."""

    async def go() -> list[httpx.Response]:
        await init_static_loras(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(method, path, json=body) for method, path, body in requests]

    return asyncio.run(go())


def complete(model: str) -> tuple[str, str, dict]:
    return ("POST", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 2})


# ---------------------------------------------------------------------------- --lora-modules


def test_lora_modules_take_both_vllm_spellings_several_at_once():
    got = parse_lora_modules(["sql=/a/sql", '{"name": "poem", "path": "/a/poem", "base_model_name": "m"}', "x=/p=q"])
    assert got == [
        LoRAModulePath("sql", "/a/sql"),
        LoRAModulePath("poem", "/a/poem", "m"),
        LoRAModulePath("x", "/p=q"),
    ]


@pytest.mark.parametrize(
    "items, message",
    [
        (["sql"], "expected name=path or a JSON object"),
        (["=/a"], "expected name=path"),
        (['{"name": "a"'], "invalid JSON"),
        (['{"name": "a"}'], "'path' must be a non-empty string"),
        (['{"name": "a", "path": "/a", "rank": 4}'], "unknown field(s) rank"),
        (["a=/x", '{"name": "a", "path": "/y"}'], "the adapter name 'a' is given twice"),
    ],
)
def test_bad_lora_modules_are_refused_naming_the_flag(items, message):
    with pytest.raises(ValueError, match="--lora-modules") as e:
        parse_lora_modules(items)
    assert message in str(e.value)


def test_serve_refuses_lora_modules_without_enable_lora(capsys):
    from vllm_lite.entrypoints.cli import main

    assert main(["serve", get_checkpoint("llama"), "--lora-modules", "sql=/a/sql"]) == 2
    err = capsys.readouterr().err
    assert "--lora-modules needs --enable-lora" in err


def test_serve_passes_lora_modules_to_its_frontends():
    import argparse

    from vllm_lite.entrypoints.cli.serve import ServeCommand, serve_config_from

    parser = argparse.ArgumentParser()
    ServeCommand().add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", get_checkpoint("llama"), "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    )
    cfg = serve_config_from(args)
    assert cfg.http_options["lora_modules"] == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y")]


# ---------------------------------------------------------------------------- ids across frontends


def test_adapter_ids_agree_across_frontends_and_differ_between_adapters(adapters):
    """Two frontends on one core: the same adapter gets the same id in both (shared slot and prefix cache),
    different adapters different ids, with no coordination between the frontends."""

    async def load_into_two_frontends() -> tuple[dict[str, int], dict[str, int]]:
        a = OpenAIServingModels(LoRAFakeEngine(get_checkpoint("llama")), [MODEL])
        b = OpenAIServingModels(LoRAFakeEngine(get_checkpoint("llama")), [MODEL])
        await a.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="sql", lora_path=adapters["sql"]))
        await a.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="poem", lora_path=adapters["poem"]))
        # Frontend b loads its own adapters in another order, and the same name at another path.
        await b.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="late", lora_path=adapters["late"]))
        await b.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="sql", lora_path=adapters["sql"]))
        await b.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="poem", lora_path=adapters["late"]))
        return (
            {n: r.lora_int_id for n, r in a.lora_requests.items()},
            {n: r.lora_int_id for n, r in b.lora_requests.items()},
        )

    ids_a, ids_b = asyncio.run(load_into_two_frontends())
    assert ids_a["sql"] == ids_b["sql"] == adapter_id("sql", adapters["sql"])
    assert ids_a["poem"] != ids_b["poem"]  # same name, other weights: never the same id
    every = [ids_a["sql"], ids_a["poem"], ids_b["late"], ids_b["poem"]]
    assert len(set(every)) == 4
    assert all(1 <= i <= 2**52 for i in every)


# ---------------------------------------------------------------------------- the HTTP rules


def test_models_lists_the_base_model_and_each_adapter_with_its_parent(adapters):
    app, _ = make_app(adapters)
    (resp,) = calls(app, ("GET", "/v1/models", None))
    cards = {c["id"]: c for c in resp.json()["data"]}
    assert list(cards) == [MODEL, "sql", "poem"]
    assert cards[MODEL]["parent"] is None and cards[MODEL]["max_model_len"] == 128
    assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == adapters["sql"]
    assert cards["poem"]["parent"] == MODEL and cards["poem"]["root"] == adapters["poem"]


def test_model_field_picks_the_adapter_for_completions_and_chat_streaming_too(adapters):
    app, engine = make_app(adapters)
    chat = {"model": "poem", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    base, sql, streamed = calls(app, complete(MODEL), complete("sql"), ("POST", "/v1/chat/completions", chat))
    assert base.status_code == sql.status_code == streamed.status_code == 200, (base.text, sql.text)
    assert base.json()["model"] == MODEL and sql.json()["model"] == "sql"
    assert '"model":"poem"' in streamed.text.replace(" ", "")
    used = list(engine.generated_with.values())
    assert used[0] is None
    assert used[1] == LoRARequest("sql", adapter_id("sql", adapters["sql"]), adapters["sql"])
    assert used[2] is not None and used[2].lora_name == "poem" and used[2].base_model_name == MODEL


def test_unknown_model_is_a_404_as_vllm_gives_it(adapters):
    app, engine = make_app(adapters)
    (resp,) = calls(app, complete("nope"))
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["type"] == "NotFoundError" and err["message"] == "The model `nope` does not exist."
    assert not engine.generated_with


def test_load_then_unload_round_trip_frees_the_engine_copy_and_the_name_is_404_after(adapters):
    app, engine = make_app(adapters)
    load = {"lora_name": "late", "lora_path": adapters["late"]}
    loaded, used, models, unloaded, gone, listed = calls(
        app,
        ("POST", "/v1/load_lora_adapter", load),
        complete("late"),
        ("GET", "/v1/models", None),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "late"}),
        complete("late"),
        ("GET", "/v1/models", None),
    )
    late_id = adapter_id("late", adapters["late"])
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert used.status_code == 200 and used.json()["model"] == "late"
    assert "late" in [c["id"] for c in models.json()["data"]]
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    assert engine.removed == [late_id] and late_id not in engine.loras
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The model `late` does not exist."
    assert "late" not in [c["id"] for c in listed.json()["data"]]


def test_unload_by_lora_int_id(adapters):
    app, engine = make_app(adapters)
    sql_id = adapter_id("sql", adapters["sql"])
    resp, gone = calls(app, ("POST", "/v1/unload_lora_adapter", {"lora_int_id": sql_id}), complete("sql"))
    assert resp.status_code == 200 and engine.removed == [sql_id]
    assert gone.status_code == 404


@pytest.mark.parametrize(
    "path, body, status, err_type, message",
    [
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "ADAPTER"}, 400, "InvalidUserInput",
         "The lora adapter 'sql' has already been loaded."),
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "ADAPTER"}, 400, "InvalidUserInput",
         "Both 'lora_name' and 'lora_path' must be provided."),
        ("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "ADAPTER"}, 400, "InvalidUserInput",
         f"The lora adapter name '{MODEL}' is the base model's name."),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 404, "NotFoundError",
         "No adapter found for 'x' at '/no/such/dir': no such directory."),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "NOT_AN_ADAPTER"}, 400, "BadRequestError",
         "no adapter_config.json"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "NotFoundError",
         "The lora adapter 'nope' cannot be found."),
        ("/v1/unload_lora_adapter", {}, 400, "InvalidUserInput",
         "either 'lora_name' and 'lora_int_id' needs to be provided."),
    ],
)  # fmt: skip
def test_adapter_route_errors_as_vllm_gives_them(adapters, tmp_path, path, body, status, err_type, message):
    app, engine = make_app(adapters)
    body = dict(body)
    if body.get("lora_path") == "ADAPTER":
        body["lora_path"] = adapters["late"]
    elif body.get("lora_path") == "NOT_AN_ADAPTER":
        body["lora_path"] = str(tmp_path)
    (resp,) = calls(app, ("POST", path, body))
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == err_type and message in err["message"]
    assert sorted(r.lora_name for r in engine.loras.values()) == ["poem", "sql"]  # nothing else changed


def test_adapter_routes_are_absent_unless_runtime_updating_is_allowed(adapters):
    app, engine = make_app(adapters, runtime=False)
    resp, models = calls(
        app,
        ("POST", "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}),
        ("GET", "/v1/models", None),
    )
    assert resp.status_code == 404
    assert [c["id"] for c in models.json()["data"]] == [MODEL, "sql", "poem"]  # --lora-modules still served
    assert sorted(r.lora_name for r in engine.loras.values()) == ["poem", "sql"]


def test_a_static_adapter_that_fails_to_load_stops_start_up_naming_it(adapters, tmp_path):
    engine = LoRAFakeEngine(get_checkpoint("llama"))
    app = build_app(engine, MODEL, lora_modules=[LoRAModulePath("bad", str(tmp_path))])
    with pytest.raises(ValueError, match=r"--lora-modules bad=.*no adapter_config.json"):
        asyncio.run(init_static_loras(app))


_ROUTES_CHILD = """
import json, os
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

def routes():
    return sorted(r.path for r in build_app(FakeAsyncLLM(get_checkpoint("llama"))).routes if "lora" in r.path)

unset = routes()
os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
print(json.dumps({"unset": unset, "true": routes()}))
"""


def test_runtime_adapter_routes_follow_vllms_environment_variable():
    """Read through envs.py by default: off unless $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (set in a child
    process only; this process's environment is not touched)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
    out = subprocess.run([sys.executable, "-c", _ROUTES_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"unset": [], "true": ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]}


def test_unload_frees_the_engine_copy_only_after_the_adapters_running_requests_end(adapters):
    """The core cannot run a request whose adapter it dropped: unload stops new requests at once (404) and
    calls remove_lora when this frontend's last request with the adapter is over."""
    from vllm_lite.entrypoints.openai.errors import ModelNotFoundError
    from vllm_lite.entrypoints.openai.protocol import UnloadLoRAAdapterRequest
    from vllm_lite.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from vllm_lite.sampling_params import SamplingParams
    from vllm_lite.testing.waiting import async_wait_until

    engine = LoRAFakeEngine(get_checkpoint("llama"))
    late_id = adapter_id("late", adapters["late"])

    async def scenario() -> None:
        models = OpenAIServingModels(engine, [MODEL])
        await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="late", lora_path=adapters["late"]))
        serving = OpenAIServingCompletion(engine, [MODEL], models=models)
        engine.hang = True  # the request runs until aborted
        gen = serving.generate(
            {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3), "r1", 0, models.lora_request("late")
        )
        first = asyncio.ensure_future(gen.__anext__())
        await async_wait_until(lambda: "r1" in engine.running, 30, "the request running")
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="late"))
        with pytest.raises(ModelNotFoundError):
            models.lora_request("late")
        assert engine.removed == [] and late_id in engine.loras  # still in use
        await engine.abort("r1")
        assert (await first).finished
        async for _ in gen:
            pass
        assert engine.removed == [late_id] and late_id not in engine.loras

    asyncio.run(scenario())
