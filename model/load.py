"""One entry point for a model by name: `load_model("qwen3.5-2b", device)` or `load_model("/path/to/checkpoint", ...)`.

Either way every parameter is allocated once, in its dtype, on `device` (Qwen35ForCausalLM.empty), then filled
tensor by tensor: from seeded random draws for a preset, from the safetensors shards for a checkpoint.
"""
from pathlib import Path

import torch

from model.config import PRESETS
from model.loader import load_checkpoint
from model.model import Qwen35ForCausalLM
from model.parallel import ParallelContext


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (what the kernels run), fp32 elsewhere (the CPU's reference ops)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(spec: str, device="cpu", dtype: torch.dtype | None = None, *, seed: int = 0,
               tp: ParallelContext | None = None, progress: bool = True) -> Qwen35ForCausalLM:
    """An HF checkpoint folder (its safetensors weights), or a preset name: that model's real shapes with seeded
    RANDOM weights (`seed`; text from them is noise, timings are real). dtype None: default_dtype(device).
    tp (model.parallel.ParallelContext): this rank's slices only."""
    dtype = dtype or default_dtype(device)
    if Path(spec).is_dir():
        return load_checkpoint(spec, device=device, dtype=dtype, progress=progress, tp=tp)
    return Qwen35ForCausalLM.from_preset(spec, device=device, dtype=dtype, seed=seed, tp=tp)


def describe_model(spec: str) -> str:
    """What load_model(spec) builds, for logs: `checkpoint PATH` or `preset NAME (RANDOM weights)`."""
    return f"checkpoint {spec}" if Path(spec).is_dir() else f"preset {spec} (RANDOM weights)"


def check_model_spec(spec: str) -> None:
    """Raise ValueError, with one line that says what is wrong, unless load_model(spec) can start: spec is a preset
    name, or a folder with a config.json and safetensors weights (what is in them is checked while loading)."""
    path = Path(spec)
    if path.is_dir():
        missing = [what for what, found in (("config.json", (path / "config.json").is_file()),
                                             ("*.safetensors weights", any(path.glob("*.safetensors"))))
                   if not found]
        if missing:
            raise ValueError(f"{spec!r} is a folder without {' or '.join(missing)}: not a checkpoint folder")
        return
    if spec.lower() in PRESETS:
        return
    what = "a file, not a folder" if path.exists() else "no such folder"
    raise ValueError(f"{spec!r} is not a preset name ({', '.join(PRESETS)}) and not a checkpoint folder ({what})")
