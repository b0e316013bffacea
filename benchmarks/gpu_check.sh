#!/usr/bin/env bash
# The device-agnostic paths on a CUDA machine: the engine tests (HF parity, paged attention's torch
# path, KV cache, scheduler, sampler) with CUDA picked by device=auto, then the step benchmark on a
# random model of SmolLM2-135M's shape (no hub access needed).
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 -m pytest -q -p no:cacheprovider tests/engine tests/model tests/kv_cache tests/scheduler tests/runner \
  tests/kernels 2>&1 | tee "$OUT/pytest.log" | tail -30
python3 - "$OUT/smollm2-shaped" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, ".")
from tests.conftest import build_tiny_llama
build_tiny_llama(Path(sys.argv[1]), vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
                 initializer_range=0.02)
PY
for running in 1 64 256; do
  python3 benchmarks/step_profile.py --model "$OUT/smollm2-shaped" --running $running --context 280 --steps 20 \
    2>&1 | grep -v Warning | tail -1 | tee -a "$OUT/steps.log"
done
rm -rf "$OUT/smollm2-shaped"
