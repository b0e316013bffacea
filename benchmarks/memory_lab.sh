#!/usr/bin/env bash
# The measurements behind docs/memory.md: prefix caching on a shared 1,024-token system prompt, and
# KV waste / throughput for block sizes 8, 16, 32 on a chat-like long-tail mix. One torch thread each.
set -euo pipefail
out=${1:-docs/memory}
mkdir -p "$out"
common=(--in-process --threads 1 --kv-cache-memory 1 --max-model-len 4096 --seed 0 --no-progress)
for caching in on off; do
  flag=(); [ "$caching" = off ] && flag=(--no-enable-prefix-caching)
  conveyor bench run "${common[@]}" "${flag[@]}" --workload shared-prefix --prefix-len 1024 --input-len 32 \
    --output-len 32 --range-ratio 0 --num-prompts 16 --concurrency 4 --out "$out/shared_prefix_caching_$caching.json"
done
for bs in 8 16 32; do
  conveyor bench run "${common[@]}" --block-size "$bs" --workload longtail --num-prompts 24 --long-fraction 0.2 \
    --short-input 64-256 --short-output 32-128 --long-input 512-1024 --long-output 64-128 --request-rate inf \
    --out "$out/longtail_bs$bs.json"
done
