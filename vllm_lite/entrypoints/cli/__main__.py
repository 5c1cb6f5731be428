"""`python -m vllm_lite.entrypoints.cli ...` runs the same CLI as `vllm-lite ...`."""

import sys

from vllm_lite.entrypoints.cli import main

sys.exit(main())
