"""benchmarks/gpu_smoke.sh on a machine without a GPU: it says it needs one and exits 0, running nothing.

Its GPU branch (torchrun, NCCL, bf16, a notice mid-run, exit 75 then resume to done) needs an
accelerator and is run by hand there (docs/runtime.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.sh"


def test_without_a_gpu_the_smoke_says_so_and_exits_0_having_run_nothing(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_smoke: needs a GPU (nvidia-smi and torch.cuda.is_available()); none here, so nothing was run"
    assert not (tmp_path / "work").exists()
