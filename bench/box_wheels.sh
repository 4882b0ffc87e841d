#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels the GPU box lacks, for Python 3.12 on x86-64 Linux: the server's stack
# (fastapi, starlette, uvicorn, pydantic and their needs), strata's small dependencies, and kvikio for CUDA 13.
# pydantic and pydantic-core are pinned as a pair (pydantic needs its exact core), at the versions the GPU tests passed
# with (twenty-ninth session). Carry them to the box (`carry: [".whl"]`); bench/h200_session.sh installs them into /tmp/site there.
#   bash bench/box_wheels.sh          # ~8 MB; run on a machine with internet access, from any directory
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl  # two versions of one package stop the box's whole install: start from none
PKGS=(fastapi starlette uvicorn h11 annotated-doc opentelemetry-api pydantic==2.13.4 pydantic-core==2.46.4 annotated-types
      typing-inspection anyio prometheus-client aiofiles msgpack xxhash kvikio-cu13 libkvikio-cu13 rapids-logger)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$p" 2>&1 | grep -v '^WARNING' || true
done
ls .whl | wc -l | xargs echo "box_wheels: wheels in .whl/:"
