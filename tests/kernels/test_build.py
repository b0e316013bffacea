"""Without a working compiler the kernels are skipped with one clear log line, and attention falls back."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from conveyor import kernels
from conveyor.model.attention import choose_backend
print("module:", kernels.load())
print("backend:", choose_backend("auto", torch.device("cpu"), torch.bfloat16, 9, 3, 64))
"""


def run_probe(tmp_path, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, CONVEYOR_CACHE=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=full)


def test_no_compiler_falls_back_to_the_reference(tmp_path):
    proc = run_probe(tmp_path, CXX="/bin/false", CC="/bin/false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "module: None" in proc.stdout and "backend: torch" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "compiled CPU kernels unavailable" in line]
    assert len(warnings) == 1, proc.stderr[-2000:]


def test_kernels_can_be_turned_off(tmp_path):
    proc = run_probe(tmp_path, CONVEYOR_KERNELS="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "module: None" in proc.stdout and "backend: torch" in proc.stdout
    assert "CONVEYOR_KERNELS=0" in proc.stderr
