"""Test-wide settings: offline, single-threaded torch."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402

torch.set_num_threads(1)
