#!/usr/bin/env bash
# Download, where the package index is reachable, the wheels the GPU machine's image lacks (it has torch,
# triton, transformers, numpy, pytest, hypothesis, peft ...; not our serving, messaging and grammar
# packages), for Python 3.12 on x86-64, into .whl/ (git-ignored). scripts/gpu_check.sh installs them
# offline into a private folder. Each package is named with --no-deps, so torch and the CUDA libraries
# that xgrammar would pull are never downloaded. Run from anywhere:
#     bash scripts/gpu_wheels.sh            # -> <repo>/.whl/ ; extra package names as arguments
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${WHL_DIR:-$root/.whl}
mkdir -p "$dest"
grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$root/.git/info/exclude"
plat=(--platform manylinux2014_x86_64 --platform any)
for n in 17 24 26 27 28 31 34; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
pkgs=(
  msgspec pyzmq                                                  # the core's messages and sockets
  fastapi starlette annotated-doc typing-inspection opentelemetry-api pydantic pydantic-core annotated-types
  uvicorn h11                                                    # the HTTP server
  openai httpx2 httpcore2 truststore jiter sniffio anyio httpx httpcore  # the OpenAI client in the tests
  xgrammar apache-tvm-ffi llguidance                             # the grammar engines
  jsonschema jsonschema-specifications referencing rpds-py attrs # JSON-schema checks in the tests
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$dest" "${pkgs[@]}" "$@"
ls "$dest" | sed 's/^/  /'
du -sh "$dest"
