"""Load HF Qwen3.5 checkpoints (safetensors) into Qwen35ForCausalLM.

Handles the text-only layout (`model.layers.*`, flat config), the VLM layout (`model.language_model.*`,
config nested under `text_config`), sharded folders (`model.safetensors.index.json`), tied embeddings, and
MoE experts either per expert on disk (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), and the multi-token-prediction head `mtp.*` (its MoE experts
in either layout) when the checkpoint has one: without `mtp.*` tensors the model is built without the head.
`model.visual.*` is skipped and counted.

Tensor parallel (`tp=`): the model holds one rank's slices (model.parallel.ShardPlan) and each tensor is sliced as
it is read: from the safetensors file only the rows or columns of the rank (get_slice), and experts of other ranks
are not read at all.
"""
import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from model.config import Qwen35Config
from model.layers import FusedLinear
from model.model import Qwen35ForCausalLM
from model.parallel import ParallelContext

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIXES = ("mtp.", "model.mtp.")
_BACKBONE_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_STACKED = {"gate_proj": 0, "up_proj": 1}  # halves of the fused experts' gate_up_proj
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_TIED = {"lm_head.weight": "model.embed_tokens.weight", "model.embed_tokens.weight": "lm_head.weight"}
FLOAT_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


def canonical_name(name: str) -> str | None:
    """An HF tensor name in our naming (`model.*` backbone, `lm_head.*`), or None when it is to be skipped."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(MTP_PREFIXES):
        return name[name.index("mtp."):]
    for prefix in _BACKBONE_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


def fused_parts(model: Qwen35ForCausalLM) -> dict[str, tuple[str, slice, str]]:
    """HF name of every part of a FusedLinear -> (our fused weight, its rows, the part's name), e.g.
    `model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, rows, "k_proj")."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, FusedLinear):
            parent, start = path.rsplit(".", 1)[0], 0
            for part, rows in module.parts.items():
                out[f"{parent}.{part}.weight"] = (f"{path}.weight", slice(start, start + rows), part)
                start += rows
    return out


class WeightLoader:
    """Copies HF tensors into a model's parameters and keeps count of what was filled, so that missing,
    unexpected or misshapen tensors become one clear error."""

    def __init__(self, model: Qwen35ForCausalLM):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.fused_parts = fused_parts(model)
        self.pieces_needed = {n: self._pieces(n, p) for n, p in self.params.items()}
        self.filled: dict[str, set] = {n: set() for n in self.params}
        self.unexpected: list[str] = []
        self.skipped = 0
        self.plan = model.plan
        self.other_ranks = 0  # tensors (experts) that only other tensor-parallel ranks hold
        self.sources: dict[tuple, str] = {}  # (parameter, piece) -> the checkpoint name that filled it
        self.whole = None  # tensor parallel: a world-size-1 loader on the meta device, for the full shapes
        if self.plan.sharded:
            with torch.device("meta"):
                self.whole = WeightLoader(Qwen35ForCausalLM(model.config))

    def _pieces(self, name: str, p: torch.Tensor) -> int:
        if name.endswith("mlp.experts.gate_up_proj"):
            return 2 * p.shape[0]
        if name.endswith("mlp.experts.down_proj"):
            return p.shape[0]
        return sum(target == name for target, _, _ in self.fused_parts.values()) or 1

    @torch.no_grad()
    def load(self, hf_name: str, tensor) -> None:
        """tensor: the full HF tensor, or (tensor parallel) a safetensors slice to read this rank's part from."""
        name = canonical_name(hf_name)
        if name is None or (name.startswith("mtp.") and not self.model.has_mtp):
            self.skipped += 1
            return
        _check_dtype(hf_name, tensor)
        if self.whole is not None:  # the whole tensor's shape, before this rank's slice is cut from it
            full = tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape())
            expected = self.whole.expected_shape(name)
            if expected is not None and full != expected:
                raise ValueError(f"checkpoint tensor {hf_name} has shape {full}, expected {expected}")
        if self.plan.sharded:
            name = self._local_expert_name(name)
            if name is None:
                self.other_ranks += 1
                return
        tensor = self.plan.take(name, tensor)  # the tensor itself at world size 1
        target, index, piece = self._route(name)
        if target not in self.params:
            self.unexpected.append(hf_name)
            return
        dest = self.params[target] if index is None else self.params[target][index]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)} for {target}")
        tied_to = _TIED.get(target) if self.model.config.tie_word_embeddings else None
        if tied_to and self.filled[tied_to] and not torch.equal(dest, tensor.to(dest.dtype)):
            raise ValueError(f"checkpoint tensor {hf_name} differs from {tied_to}, but the config ties them "
                             "(tie_word_embeddings); the checkpoint's config does not match its weights")
        if piece in self.filled[target]:
            raise ValueError(f"checkpoint tensors {self.sources[target, piece]} and {hf_name} both fill {target}"
                             f"{'' if piece == 'all' else f' (part {piece})'}")
        dest.copy_(tensor.to(dest.dtype))
        self.filled[target].add(piece)
        self.sources[target, piece] = hf_name

    def expected_shape(self, name: str) -> tuple | None:
        """The shape the checkpoint tensor `name` (our naming) must have, or None when it fills no parameter."""
        target, index, _ = self._route(name)
        if target not in self.params:
            return None
        return tuple((self.params[target] if index is None else self.params[target][index]).shape)

    def held_elsewhere(self, hf_name: str) -> bool:
        """Whether only other tensor-parallel ranks hold this tensor (an expert of theirs): then it is not read."""
        name = canonical_name(hf_name)
        if name is None or not self.plan.sharded or self._local_expert_name(name) is not None:
            return False
        self.other_ranks += 1
        return True

    def _local_expert_name(self, name: str) -> str | None:
        """A per-expert name renumbered to this rank's experts; None for another rank's expert."""
        m = _EXPERT.match(name)
        if m is None:
            return name
        local = self.plan.local_expert(int(m.group(2)))
        return None if local is None else f"{m.group(1)}.{local}.{m.group(3)}.weight"

    def _route(self, name: str):
        # -> (our parameter name, index into it or None, piece id)
        m = _EXPERT.match(name)
        if m:
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            if e >= self.params.get(f"{base}.down_proj", torch.empty(0)).shape[0]:
                return name, None, "all"  # no such expert (or no experts): not a parameter, so unexpected
            if proj == "down_proj":
                return f"{base}.down_proj", e, e
            inter = self.params.get(f"{base}.gate_up_proj", torch.empty(0, 0)).shape[1] // 2
            half = _STACKED[proj]
            return f"{base}.gate_up_proj", (e, slice(half * inter, (half + 1) * inter)), (e, half)
        return self.fused_parts.get(name, (name, None, "all"))

    def _missing_names(self, name: str, got: set) -> list[str]:
        """What parameter `name` still lacks, named as on disk (per expert, gate/up halves) where it is part-filled."""
        if name.endswith("mlp.experts.gate_up_proj") and got:
            base = name[:-len(".gate_up_proj")]
            return [f"{base}.{e}.{proj}.weight" for e in range(self.params[name].shape[0])
                    for proj, half in _STACKED.items() if (e, half) not in got]
        if name.endswith("mlp.experts.down_proj") and got:
            base = name[:-len(".down_proj")]
            return [f"{base}.{e}.down_proj.weight" for e in range(self.params[name].shape[0]) if e not in got]
        parts = [hf for hf, (target, _, part) in self.fused_parts.items() if target == name and part not in got]
        return parts or [name]

    def finish(self) -> None:
        """Raise ValueError naming missing or unexpected tensors; log the skipped count."""
        filled = dict(self.filled)
        if self.model.config.tie_word_embeddings:  # one tensor under two names: either name fills it
            both = filled["lm_head.weight"] | filled["model.embed_tokens.weight"]
            filled["lm_head.weight"] = filled["model.embed_tokens.weight"] = both
        missing = [hf for n, got in filled.items() if "all" not in got and len(got) < self.pieces_needed[n]
                   for hf in self._missing_names(n, got)]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected tensors: {self.unexpected[:8]}"
                            f"{' ...' if len(self.unexpected) > 8 else ''}")
        if problems:
            raise ValueError("checkpoint does not match the model: " + "; ".join(problems))
        if self.skipped:
            log.info("skipped %d tensors (model.visual.*, or mtp.* of a model built without its head)", self.skipped)


def _check_dtype(hf_name: str, tensor) -> None:
    """Float tensors only: integer, boolean and fp8 ones would be cast into wrong weights (quantized checkpoints
    are not supported)."""
    dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else tensor.get_dtype()
    if dtype not in FLOAT_DTYPES and dtype not in FLOAT_DTYPES.values():
        raise ValueError(f"checkpoint tensor {hf_name} has dtype {dtype}; the loader takes fp16, bf16, fp32 or fp64 "
                         "(quantized checkpoints are not supported)")


def has_mtp_tensors(names) -> bool:
    return any(name.startswith(MTP_PREFIXES) for name in names)


def load_state_dict(model: Qwen35ForCausalLM, state_dict: dict[str, torch.Tensor]) -> Qwen35ForCausalLM:
    """Load an in-memory HF state dict (e.g. a transformers model's, which has no `mtp.*`: the model's MTP head is
    then dropped) through the checkpoint mapping."""
    if model.has_mtp and not has_mtp_tensors(state_dict):
        model.drop_mtp()
    loader = WeightLoader(model)
    for name, tensor in state_dict.items():
        loader.load(name, tensor)
    loader.finish()
    return model


def checkpoint_files(path: Path) -> dict[Path, set[str] | None]:
    """Each shard to read, with the tensor names the index assigns to it (None: every tensor in the file)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
                raise TypeError("weight_map must map tensor names to shard file names")
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a safetensors index: {error!r}"[:300]) from None
        shards: dict[Path, set[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(path / shard, set()).add(name)
        absent = sorted(f.name for f in shards if not f.is_file())
        if absent:
            raise ValueError(f"{index} names shard files that are not in {path}: {absent}")
        return dict(sorted(shards.items()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors files in {path}")
    return dict.fromkeys(files)


def _tensor_names(files: dict[Path, set[str] | None]):
    """Every tensor name of the checkpoint (an unindexed file's from its header)."""
    for f, names in files.items():
        if names is None:
            with _open_safetensors(f) as sf:
                yield from sf.keys()
        else:
            yield from names


def _open_safetensors(f: Path):
    """safe_open, with a file that is not safetensors (truncated, corrupt, a git-lfs pointer, a folder) named in a
    ValueError."""
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError, or OSError
        raise ValueError(f"{f} is not a readable safetensors file: {error}") from None


def load_checkpoint(path, *, device="cpu", dtype=torch.bfloat16, progress: bool = True,
                    tp: ParallelContext | None = None) -> Qwen35ForCausalLM:
    """Build the model from `path/config.json`, its parameters allocated once in `dtype` on `device`, and copy in
    every tensor of the safetensors shards in `path`, one at a time (under tp: this rank's slices, reading only
    those)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype!r}")
    try:
        cfg = Qwen35Config.from_json(path / "config.json")
    except json.JSONDecodeError as error:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {error}") from None
    files = checkpoint_files(path)
    if cfg.mtp_num_hidden_layers and not has_mtp_tensors(_tensor_names(files)):
        log.info("%s has no mtp.* tensors: built without the MTP head (no speculative decoding)", path)
        cfg = replace(cfg, mtp_num_hidden_layers=0)
    model = Qwen35ForCausalLM.empty(cfg, device=device, dtype=dtype, tp=tp)
    loader = WeightLoader(model)
    lazy = model.plan.sharded
    with tqdm(total=len(files), desc=f"loading {path.name}", unit="shard", disable=not progress) as bar:
        for f, names in files.items():
            with _open_safetensors(f) as sf:
                if names is not None and not names <= set(sf.keys()):
                    raise ValueError(f"the index assigns tensors to {f.name} that it does not hold: "
                                     f"{sorted(names - set(sf.keys()))[:8]}")
                for name in sf.keys() if names is None else sorted(names):
                    if lazy and loader.held_elsewhere(name):
                        continue
                    loader.load(name, sf.get_slice(name) if lazy else sf.get_tensor(name))
            bar.update(1)
    loader.finish()
    return model.eval()
