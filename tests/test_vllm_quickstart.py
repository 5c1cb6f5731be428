"""vLLM's documented quickstart flows, unchanged except the model name (a repo id found in a temporary
Hugging Face cache with the network off): offline LLM.generate and LLM.chat, then `vllm-lite serve MODEL`
and the `openai` client's completions, chat, streaming and models.list, with --api-key enforced."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_lite.testing.hf_cache import place_in_hf_cache
from vllm_lite.testing.processes import process_gone
from vllm_lite.testing.serve_process import ServeProcess
from vllm_lite.testing.waiting import wait_until

REPO = "quickstart-org/tiny-llama"
API_KEY = "token-abc123"  # the key vLLM's docs use


@pytest.fixture(scope="module")
def hf_env(tmp_path_factory, tiny_checkpoint) -> dict[str, str]:
    cache = str(tmp_path_factory.mktemp("hub"))
    place_in_hf_cache(tiny_checkpoint, cache, REPO)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "VLLM_LITE_API_KEY"}
    env.update(HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_offline_quickstart_generate_and_chat(hf_env, serve_process):
    """`serve_process` (used by the tests below) starts beside this test's own process, not after it."""
    script = textwrap.dedent(f"""
        from vllm_lite import LLM, SamplingParams

        prompts = [
            "Hello, my name is",
            "The president of the United States is",
            "The capital of France is",
            "The future of AI is",
        ]
        sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
        llm = LLM(model={REPO!r})
        outputs = llm.generate(prompts, sampling_params)
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            print(f"Prompt: {{prompt!r}}, Generated text: {{generated_text!r}}")

        conversation = [
            {{"role": "system", "content": "You are a helpful assistant"}},
            {{"role": "user", "content": "Hello"}},
            {{"role": "assistant", "content": "Hello! How can I assist you today?"}},
            {{"role": "user", "content": "Write an essay about the importance of higher education."}},
        ]
        outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
        print("CHAT", len(outputs), len(outputs[0].outputs[0].token_ids) > 0)
    """)
    res = subprocess.run([sys.executable, "-c", script], env=hf_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("Prompt: ") == 4 and "Prompt: 'The capital of France is'" in res.stdout
    assert "CHAT 1 True" in res.stdout


@pytest.fixture(scope="module")
def serve_process(hf_env):
    """`vllm-lite serve` started, not yet waited for: the offline test asks for it too, so the two start-ups
    (independent processes) overlap on CI's second CPU, which the suite otherwise leaves mostly idle."""
    srv = ServeProcess(
        [
            REPO,
            "--port",
            "0",
            "--core-port",
            "0",
            "--api-key",
            API_KEY,
            "--num-threads",
            "1",
            "--max-model-len",
            "256",
            "--max-logprobs",
            "25",
        ],
        hf_env,
    )
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    wait_until(lambda: process_gone(srv.proc.pid), 30, "serve gone")


@pytest.fixture(scope="module")
def served(serve_process):
    """(the serve process, its core's address, its API base URL) once it listens."""
    return serve_process, serve_process.core_address(), serve_process.api_base()


def test_serve_quickstart_with_the_openai_client(served):
    import openai

    _, core_address, base = served
    assert core_address.startswith("tcp://127.0.0.1:")  # the core's own address, printed at start-up
    client = openai.OpenAI(api_key=API_KEY, base_url=f"{base}/v1")
    models = client.models.list()
    assert [m.id for m in models.data] == [REPO]  # served under the repo id, as vLLM does

    completion = client.completions.create(model=REPO, prompt="San Francisco is a", max_tokens=8)
    assert completion.choices[0].text and completion.usage.completion_tokens == 8

    chat = client.chat.completions.create(
        model=REPO,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a joke."},
        ],
        max_tokens=8,
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content is not None

    stream = client.chat.completions.create(
        model=REPO,
        messages=[{"role": "user", "content": "Say this is a test"}],
        max_tokens=8,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces)

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{base}/v1").models.list()


def test_serve_core_stays_attachable_beside_the_http_api(served):
    from vllm_lite import LLM, SamplingParams

    _, core_address, _ = served
    llm = LLM(engine_address=core_address)
    try:
        assert llm.llm_engine.processor.max_logprobs == 25  # the core's rules reach an attached frontend
        out = llm.generate(["The for statement"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
