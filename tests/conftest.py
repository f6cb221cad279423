"""Test setup: without a GPU, Triton kernels run in its CPU interpreter and `gpu` tests are skipped."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

# The server tests drive a live server with the openai client, which the GPU machine lacks.
collect_ignore = [] if importlib.util.find_spec("openai") else ["test_serving_server.py", "test_serving_faults.py"]

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before any kernel module is imported
    torch.set_num_threads(1)  # the CPU tests run many tiny ops, where extra threads only add contention


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def assert_rel(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Same shape, finite, and relative error within tol (the error is in the message)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def compiled_script_output(script: str, *argv: str, timeout: int = 300) -> str:
    """stdout of `python -c script argv...` run from the repository root with Triton's compiler (the CPU tests'
    interpreter switched off): the sm_90a compile tests build PTX there. Fails the test with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", script, *argv], cwd=root, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def record_launches(monkeypatch, module, kernel: str) -> list[tuple]:
    """Wrap module.<kernel> (a Triton kernel) so that each launch appends (grid, its keyword arguments) to the
    returned list, then runs as before."""
    launches, real = [], getattr(module, kernel)

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs)) or real[grid](*args, **kwargs)

    monkeypatch.setattr(module, kernel, Recorder())
    return launches
