"""Place a checkpoint in a Hugging Face hub cache layout, as `huggingface_hub` would have downloaded it.

Layout: ``<cache>/models--<org>--<name>/snapshots/<commit>/<files>`` plus ``refs/<ref>`` holding
the commit, so a repo id (and a branch or tag name) resolves with the network off.
"""

from __future__ import annotations

import os
import shutil


def place_in_hf_cache(src_dir: str, cache_dir: str, repo_id: str, commit: str = "0" * 40, ref: str = "main") -> str:
    """Copy src_dir's files into the cache as repo_id at `commit`, with `ref` pointing at it; returns the snapshot."""
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo_dir, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    for name in os.listdir(src_dir):
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    with open(os.path.join(repo_dir, "refs", ref), "w") as f:
        f.write(commit)
    return snapshot
