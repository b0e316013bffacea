#!/usr/bin/env bash
# Prefix caching on vs off on a shared 1,024-token system prompt with 32 clients, in-process engine,
# default dtype and threads: 64 requests, each the common prefix plus a 32-token question, 64 output tokens.
#   bash benchmarks/prefix_caching.sh [OUT_DIR]
set -euo pipefail
out=${1:-docs/performance}
mkdir -p "$out"
for caching in on off; do
  flag=(); [ "$caching" = off ] && flag=(--no-enable-prefix-caching)
  conveyor bench run --in-process --kv-cache-memory 2 --seed 0 --no-progress "${flag[@]}" --workload shared-prefix \
    --prefix-len 1024 --input-len 32 --output-len 64 --range-ratio 0 --num-prompts 64 --concurrency 32 \
    --out "$out/prefix_caching_$caching.json" | grep -E "Output token throughput|TTFT|Prefix" || true
done
python3 - "$out" <<'PY'
import json, sys
on, off = (json.load(open(f"{sys.argv[1]}/prefix_caching_{c}.json")) for c in ("on", "off"))
print(f"output tok/s: caching on {on['output_throughput']:.1f}, off {off['output_throughput']:.1f} "
      f"({on['output_throughput'] / off['output_throughput']:.2f}x); TTFT p50 {1000 * on['ttft_s']['p50']:.0f} vs "
      f"{1000 * off['ttft_s']['p50']:.0f} ms")
PY
