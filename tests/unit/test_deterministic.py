"""--deterministic: the worker switches torch to deterministic kernels before its first CUDA call."""

from __future__ import annotations

import os
import subprocess
import sys

from distrain.config import RunConfig


def test_deterministic_is_off_by_default_and_a_run_setting():
    assert RunConfig().deterministic is False
    assert RunConfig(deterministic=True).deterministic is True


def test_use_deterministic_kernels_sets_torch_and_cublas_in_a_fresh_process():
    # A fresh interpreter: the switch is process-wide, and torch reads CUBLAS_WORKSPACE_CONFIG when CUDA starts.
    code = (
        "import os, torch\n"
        "from distrain.trainers.models import use_deterministic_kernels\n"
        "assert not torch.are_deterministic_algorithms_enabled()\n"
        "use_deterministic_kernels()\n"
        "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),"
        " torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, os.environ['CUBLAS_WORKSPACE_CONFIG'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["True", "True", "True", "False", ":4096:8"]
