"""`bench/device_check.sh` on a machine without a GPU: it says so and succeeds, so CPU CI
can run it; on a CUDA machine it runs a whole cycle (see docs/ml-engineers/gpus.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_check.sh"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_the_device_check_says_so_and_exits_0() -> None:
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout
