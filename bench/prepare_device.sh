#!/usr/bin/env bash
# Prepares what the GPU benches need on a machine with no network: run here, then carry the wheels
# to the GPU host (with the checkout; the golden fixtures are in tests/data) and run there
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src:client/src
#   python3 bench/bench_gpu.py --lerobot   # or bench_pi0_gpu.py --lerobot, bf16_error.py, bench_serve.py, bench_fleet.py
# .whl: LeRobot 0.6.1 with the versions it needs (transformers 5.4-5.5, not the GPU image's newer one),
# the server's packages (fastapi, uvicorn, websockets, openpi-client) that the GPU image lacks, and
# runai-model-streamer (the optional parallel weight loader, measured against safetensors).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxs '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  lerobot==0.6.1 transformers==5.5.4 tokenizers==0.22.2 draccus==0.11.6 termcolor==3.3.0 gymnasium==1.4.0 \
  farama-notifications==0.0.6 mergedeep==1.3.4 toml==0.10.2 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 annotated-doc==0.0.7 opentelemetry-api==1.45.2 uvicorn==0.54.0 websockets==17.4 \
  openpi-client==0.1.2 runai-model-streamer==0.17.1 humanize==4.17.0 fastapi-offline==1.7.7 jinja2==3.1.6 \
  markupsafe==3.0.3
du -sh .whl
