#!/usr/bin/env bash
# Re-packs the golden fixture folders found in DIR (default ../shared) into tests/data/*.tar.xz.
set -euo pipefail
src=${1:-"$(dirname "$0")/../../../shared"}
cd "$(dirname "$0")"
for name in pi05_golden pi0_golden pi05_golden_variants; do
  [ -d "$src/$name" ] || { echo "skipping $name: not in $src"; continue; }
  tar cf - -C "$src" --owner=0 --group=0 --mode='u+rw,go+r' --sort=name --mtime='2026-12-01' "$name" \
    | xz -T2 -9e > "$name.tar.xz.tmp" && mv "$name.tar.xz.tmp" "$name.tar.xz"
  echo "packed $name"
done
