"""The device of the command-line entry points' `--device auto|cpu|cuda`."""
import torch


def pick_device(name: str) -> torch.device:
    """auto: the GPU when one is visible, else the CPU; cuda without a visible GPU exits with a message."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but no CUDA GPU is visible")
    return torch.device(name)
