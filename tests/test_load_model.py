"""model.load.load_model allocates the weights once, in their dtype: building a preset and loading a checkpoint
never hold a float32 copy of a bf16 model. On the CPU every floating tensor that torch ops allocate is counted
(PeakFloatBytes); on a GPU the caching allocator's peak is read, up to the 35B-A3B preset on an 80 GB card."""
import weakref

import pytest
import torch
from hf_oracle import hf_text_model, small_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model.config import get_preset
from model.load import default_dtype, describe_model, load_model
from model.model import Qwen35ForCausalLM

HEADROOM = 1.05  # peak allocated bytes over the parameters' bytes


class PeakFloatBytes(TorchDispatchMode):
    """The peak bytes of live floating-point storages that torch ops allocate inside the mode (views and in-place
    results, which share an input's storage, are not new; meta tensors hold no memory)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()  # ids of the live storages counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage, inputs: set[int]) -> None:
        key = id(storage)
        if key in inputs or key in self.storages:
            return
        self.storages.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())  # the storage's Python object lives as long

    def _free(self, key: int, nbytes: int) -> None:
        self.storages.discard(key)
        self.live -= nbytes


def param_bytes(model: Qwen35ForCausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied tensor once


def test_peak_counter_sees_a_float32_copy():
    """The counter itself: building a bf16 tensor through float32 peaks at the float32 bytes plus the bf16 ones."""
    with PeakFloatBytes() as mem:
        w = torch.empty(1000, 100).to(torch.bfloat16)
    assert mem.peak == 1000 * 100 * (4 + 2) and mem.live == w.numel() * 2


def test_preset_is_built_in_bf16_without_a_float32_copy():
    with PeakFloatBytes() as mem:
        model = load_model("tiny", "cpu", torch.bfloat16, seed=5)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, allocated once
    assert mem.peak <= HEADROOM * param_bytes(model), f"peak {mem.peak} B for {param_bytes(model)} B of weights"
    again = Qwen35ForCausalLM.from_preset("tiny", dtype=torch.bfloat16, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded
    assert "RANDOM" in describe_model("tiny")


def test_checkpoint_loads_in_bf16_without_a_float32_copy(tmp_path):
    hf = hf_text_model(small_config(False), seed=1).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    with PeakFloatBytes() as mem:
        model = load_model(str(tmp_path), "cpu", torch.bfloat16, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert mem.peak <= HEADROOM * param_bytes(model), f"peak {mem.peak} B for {param_bytes(model)} B of weights"
    torch.testing.assert_close(model.model.norm.weight, hf.model.norm.weight, rtol=0, atol=0)
    assert describe_model(str(tmp_path)) == f"checkpoint {tmp_path}"


def test_default_dtype_follows_the_device():
    assert default_dtype(torch.device("cpu")) == torch.float32 and default_dtype("cuda") == torch.bfloat16
    assert load_model("tiny", "cpu").lm_head.weight.dtype == torch.float32


def cuda_build_peak(preset: str) -> tuple[int, int]:
    """(peak bytes the caching allocator held while building the preset in bf16 on cuda, the parameters' bytes)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_model(preset, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    peak, weights = torch.cuda.max_memory_allocated() - before, param_bytes(model)
    del model
    torch.cuda.empty_cache()
    return peak, weights


@pytest.mark.gpu
def test_2b_preset_builds_on_cuda_within_its_weights():
    peak, weights = cuda_build_peak("qwen3.5-2b")
    assert peak <= HEADROOM * weights, f"peak {peak / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB of weights"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 75 * 2**30,
                    reason="needs a CUDA card of >= 75 GiB")
def test_35b_a3b_preset_builds_on_one_card():
    """bf16 35B-A3B is about 65 GiB of weights: through float32 it would not fit an 80 GB card."""
    assert get_preset("qwen3.5-35b-a3b").is_moe
    peak, weights = cuda_build_peak("qwen3.5-35b-a3b")
    assert peak <= HEADROOM * weights, f"peak {peak / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB of weights"
