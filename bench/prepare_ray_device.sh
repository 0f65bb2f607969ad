#!/usr/bin/env bash
# Prepares Ray Serve for the GPU machine, which has no network and takes at most 64 MiB of working tree
# per call (the tracked files included): the Ray 2.60 wheel (79 MB) without what Ray core and Serve never
# load (Java jars, the dashboard's web build, RLlib/Data/Train/Tune/LLM), xz-compressed, plus the packages
# Ray needs that the GPU image lacks (.rayship, ~23 MB), and the server's packages alone (.whl_serve, ~6 MB).
# Run here, then carry [".rayship", ".whl_serve"] and on the GPU machine:
#   mkdir -p /tmp/site && tar -xJf .rayship/ray-slim.tar.xz -C /tmp/site && \
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .rayship/*.whl .whl_serve/*.whl && \
#   export PYTHONPATH=/tmp/site:src:client/src && python3 bench/bench_ray.py --device cuda --replicas 1
# What was removed was checked against a full install on this machine: bench_ray.py ran with the same
# removals and no process imported a removed module. grpcio-reflection matches the image's grpcio (1.84).
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .rayship .whl_serve; do grep -qxs "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
rm -rf .rayship .whl_serve && mkdir -p .rayship .whl_serve
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$@"
}

work=$(mktemp -d)
download -d "$work/wheel" ray==2.60.0
# Extracted keeping each file's mode: Ray's own binaries (gcs_server, raylet) must stay executable
# (`python3 -m zipfile -e` drops the bits, and Ray then fails with a PermissionError at start).
python3 - "$work"/wheel/ray-2.60.0-*.whl "$work/tree" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        if info.external_attr >> 16:
            os.chmod(path, info.external_attr >> 16)
PY
(
  cd "$work/tree"
  rm -rf ray/jars ray/dashboard/client ray/rllib ray/data ray/train ray/tune ray/llm ray/air ray/workflow \
         ray/includes ray/_raylet.pxd ray/_raylet.pyi ray/setup-dev.py ray/serve/_private/benchmarks
  # A stub of the dashboard's web build, so a cluster started with the dashboard on still finds it.
  mkdir -p ray/dashboard/client/build/static
  echo '<!doctype html><title>Ray</title><p>The dashboard web UI is not in this slim build.' \
    > ray/dashboard/client/build/index.html
  find ray -name __pycache__ -type d -prune -exec rm -rf {} +
  tar -cf - ray ray-2.60.0.dist-info | xz -9e > "$OLDPWD/.rayship/ray-slim.tar.xz"
)
rm -rf "$work"

# Ray core and Serve's requirements that the GPU image does not have (its list: the device's KINDS.md).
download -d .rayship jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 \
  colorful==0.5.8 aiohttp-cors==0.8.1 opencensus==0.11.4 opencensus-context==0.1.3 googleapis-common-protos==1.76.0 \
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-prometheus==0.66b2 mmh3==5.3.1 grpcio-reflection==1.84.0 watchfiles==1.3.0 httptools==0.9.0
# The server's own packages (bench/prepare_device.sh has them with LeRobot's, too many bytes to carry with Ray).
download -d .whl_serve fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 annotated-doc==0.0.7 opentelemetry-api==1.45.2 uvicorn==0.54.0 websockets==17.4 \
  openpi-client==0.1.2 fastapi-offline==1.7.7 jinja2==3.1.6 markupsafe==3.0.3
du -sh .rayship .whl_serve
