"""The engine config's wire form (JSON to engine-core and tensor-parallel processes) carries every setting."""

from __future__ import annotations

import dataclasses
import logging

from vllm_lite.config import decode_vllm_config, encode_vllm_config
from vllm_lite.core.engine_core import _StatsLogger
from vllm_lite.core.messages import EngineCoreOutputs, SchedulerStats
from vllm_lite.testing.fake_core import fake_config


def test_disabled_stats_logging_survives_the_wire() -> None:
    """disable_log_stats (interval None) round-trips; inf did not (JSON has no inf: the core failed to start)."""
    cfg = fake_config()
    cfg = dataclasses.replace(
        cfg, scheduler_config=dataclasses.replace(cfg.scheduler_config, log_stats_interval_s=None)
    )
    back = decode_vllm_config(encode_vllm_config(cfg))
    assert back.scheduler_config.log_stats_interval_s is None
    assert back.scheduler_config == cfg.scheduler_config


def test_stats_logger_with_no_interval_never_logs(caplog) -> None:
    stats = EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats())
    with caplog.at_level(logging.INFO, logger="vllm_lite.engine_core"):
        _StatsLogger(None).record(8, {0: stats})
        assert not [r for r in caplog.records if "engine stats" in r.getMessage()]
        _StatsLogger(0.0).record(8, {0: stats})
        assert [r for r in caplog.records if "engine stats" in r.getMessage()]
