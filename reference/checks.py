"""Argument checks shared by the references and kernels: each failure is a ValueError naming the argument."""
import math

import torch


def check_tensor(name: str, t, *, ndim=None, dtype=None, device=None, contiguous: bool = False) -> None:
    """Raise ValueError unless `t` is a tensor with the given rank, dtype(s) and device (and contiguous: kernels
    read index tensors such as slots and cu_seqlens at ptr + i)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides {t.stride()}")
    if ndim is not None and t.ndim not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in ((dtype,) if isinstance(dtype, torch.dtype) else dtype):
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def is_int(value) -> bool:
    """A host int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite host int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_real(name: str, value, *, positive: bool = False, high: float = math.inf) -> float:
    """A finite real number (not a bool), >= 0 (> 0 when positive) and at most high: an eps, a scale, a factor.
    Returns it as a float."""
    if not is_real(value) or value < 0 or (positive and value == 0) or value > high:
        raise ValueError(f"{name} must be a finite {'positive' if positive else 'non-negative'} number"
                         f"{'' if high == math.inf else f' at most {high}'}, got {value!r}"[:300])
    return float(value)


def check_no_self_overlap(name: str, t: torch.Tensor) -> None:
    """A tensor a kernel writes: no two of its elements may share memory (an expand or as_strided view would
    take several results in one place)."""
    extent = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= extent:
            raise ValueError(f"{name} is written and must not overlap itself, got shape {tuple(t.shape)} with "
                             f"strides {t.stride()}")
        extent += stride * (size - 1)


def check_same_device(**tensors) -> None:
    """Raise ValueError when the given tensors are not all on one device."""
    devices = [t.device for t in tensors.values() if t is not None]
    if any(d != devices[0] for d in devices[1:]):
        named = {n: t.device for n, t in tensors.items() if t is not None}
        raise ValueError(f"tensors must share one device, got {named}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, host=None) -> list[int]:
    """cu: (B+1,) int32/int64, starting at 0, non-decreasing, ending at `total`. Returns its values: `host`, the
    caller's host copy of them, checked in place of cu's (no device read; compared with cu when cu is on the
    CPU), or cu read once (a host sync for a GPU tensor, which callers can reuse)."""
    check_tensor(name, cu, ndim=1, dtype=(torch.int32, torch.int64))
    if cu.numel() < 2:
        raise ValueError(f"{name} needs at least 2 entries, got {cu.numel()}")
    if host is not None and (len(host) != cu.numel() or not all(isinstance(x, int) for x in host)):
        raise ValueError(f"{name}_host must be {cu.numel()} host ints (a copy of {name}), got {host!r}"[:300])
    c = cu.tolist() if host is None else list(host)
    if host is not None and cu.device.type == "cpu" and cu.tolist() != c:  # a free comparison off the GPU
        raise ValueError(f"{name}_host {c} is not a copy of {name} {cu.tolist()}"[:300])
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"{name if host is None else name + '_host'} must rise from 0 to {total}, got {c}")
    return c


def check_page_table(page_table: torch.Tensor, seqused_k: torch.Tensor, page_size: int, num_pages: int) -> list[int]:
    """The pages each sequence reads (its first ceil(seqused_k[b] / page_size) entries) lie in the pool, and no
    sequence holds more tokens than its row of the table (one host read of each). Returns seqused_k's values."""
    lens = seqused_k.tolist()
    capacity = page_table.shape[1] * page_size
    if any(n < 0 or n > capacity for n in lens):
        raise ValueError(f"seqused_k {lens} exceeds the page_table's capacity of {capacity} tokens"[:300])
    used = [page_table[b, :(n + page_size - 1) // page_size] for b, n in enumerate(lens)]
    used = torch.cat(used) if used else page_table.new_zeros(0)
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise ValueError(f"page_table names pages outside the pool of {num_pages}")
    return lens


def check_snapshots(cu: list[int], offsets, slots, state_slots) -> tuple[int, ...] | None:
    """A varlen call's snapshot arguments (model.step snapshot_offsets / snapshot_slots), checked against its
    cu_seqlens values cu: the absolute token position of each sequence's snapshot (0: none), or None when there
    is none."""
    if offsets is None or not any(offsets):
        return None
    n = len(cu) - 1
    if len(offsets) != n or not all(isinstance(o, int) for o in offsets):
        raise ValueError(f"snapshot_offsets must be {n} host ints, one per sequence, got {offsets!r}"[:300])
    for i, o in enumerate(offsets):
        if not 0 <= o < cu[i + 1] - cu[i]:
            raise ValueError(f"snapshot_offsets[{i}] = {o} must lie in [0, {cu[i + 1] - cu[i]}) (its tokens)")
    if not isinstance(slots, torch.Tensor) or slots.ndim != 1 or slots.numel() != n or not slots.is_contiguous() \
            or slots.dtype not in (torch.int32, torch.int64) or slots.device != state_slots.device:
        raise ValueError(f"snapshot_slots must be a contiguous ({n},) int32/int64 tensor on {state_slots.device}, got "
                         f"{slots.shape if isinstance(slots, torch.Tensor) else slots!r}")
    return snapshot_cuts(cu, offsets)


def snapshot_cuts(cu, offsets) -> tuple[int, ...]:
    """Each sequence's snapshot as an absolute token position (cu: cu_seqlens' values; offset 0: none, 0)."""
    return tuple(cu[i] + o if o else 0 for i, o in enumerate(offsets))
