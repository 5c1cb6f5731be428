"""The cross-tenant cache probe: can one frontend of a shared core detect another's prompt?

Before, a second frontend that guessed the first's prompt got ``num_cached_tokens`` = the prompt's
full blocks when right and 0 when wrong. With ``--prefix-caching-scope client`` (the default) the
core salts the prefix cache per authenticated frontend, so the guess reads 0 either way, while each
frontend still hits its own prefixes; ``shared`` brings cross-frontend sharing back on purpose.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from vllm_lite.core.kv_cache_utils import update_request_block_hashes
from vllm_lite.core.request import Request
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.served_core import ServedCore, first_output

TOKEN = "tenant-test-token"
BLOCK = 8
SECRET_PROMPT = [(7 * i + 3) % 200 + 10 for i in range(4 * BLOCK + 3)]  # 4 full blocks
WRONG_GUESS = [t + 1 for t in SECRET_PROMPT]


@pytest.fixture(scope="module", params=["client", "shared"])
def served(request) -> Iterator[ServedCore]:
    core = ServedCore(auth_token=TOKEN, block_size=BLOCK, prefix_caching_scope=request.param)
    yield core
    core.stop()


def test_second_frontend_cannot_see_the_first_ones_prompt_unless_scope_is_shared(served):
    victim, prober = served.frontend(TOKEN), served.frontend(TOKEN)
    assert first_output(victim, SECRET_PROMPT).num_cached_tokens == 0
    # The victim's own repeat hits its cache (n>1 children and repeated prompts share prefixes).
    assert first_output(victim, SECRET_PROMPT).num_cached_tokens == 4 * BLOCK

    right = first_output(prober, SECRET_PROMPT).num_cached_tokens
    wrong = first_output(prober, WRONG_GUESS).num_cached_tokens
    # A chosen cache_salt does not reach the victim's chain either: the core's salt has its own slot.
    salted = first_output(prober, SECRET_PROMPT, cache_salt="").num_cached_tokens
    print(
        f"scope={served.proc.engine_core.config.cache_config.prefix_caching_scope}: "
        f"right guess {right}, wrong guess {wrong}, with a cache_salt {salted} cached tokens"
    )
    assert wrong == 0
    if served.proc.engine_core.config.cache_config.prefix_caching_scope == "client":
        assert right == 0 and salted == 0
    else:
        assert right == 4 * BLOCK
    # The prober's repeat of its own request hits its own cache in both scopes.
    assert first_output(prober, WRONG_GUESS).num_cached_tokens == 4 * BLOCK


def test_salts_live_in_separate_slots_of_the_first_block_hash():
    params = SamplingParams(max_tokens=1)

    def hashes(**salts) -> list[bytes]:
        req = Request("r", SECRET_PROMPT, params, None, 0.0, **salts)
        return update_request_block_hashes(req, BLOCK)

    plain = hashes()
    tenant_a, tenant_b = hashes(tenant_salt=b"a" * 16), hashes(tenant_salt=b"b" * 16)
    assert len(plain) == 4
    assert tenant_a != plain and tenant_a != tenant_b
    assert all(x != y for x, y in zip(tenant_a, tenant_b))  # no block of one tenant is another's
    assert hashes(tenant_salt=b"a" * 16, cache_salt="x") != tenant_a
    assert hashes(cache_salt="x") != hashes(tenant_salt=b"x")


def test_prefix_caching_scope_flag_defaults_to_client_and_refuses_other_values(capsys):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args([]).prefix_caching_scope == "client"
    assert parser.parse_args(["--prefix-caching-scope", "shared"]).prefix_caching_scope == "shared"
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-caching-scope", "everyone"])
    with pytest.raises(ValueError, match="prefix_caching_scope"):
        EngineArgs(model=get_checkpoint("llama"), prefix_caching_scope="everyone").create_engine_config()
