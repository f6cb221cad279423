"""A batch-1 decode GDN layer's output handed to its out-proj chain by a counter, not by the grid's completion.

With programmatic dependent launch the out-proj chain (kernels/tma_gemv.py) launches while the GDN decode kernel
(kernels/gdn_decode.py) runs, and its producers fill their rings; its consumers then wait (griddepcontrol.wait) for
the whole GDN grid to complete: the output's store, then the states' 64 KiB a program, the windows' shift, the
programs' exit and the grid's memory flush. Handed off, each GDN program adds one to a counter (a release add after
a barrier) as soon as its output is stored, and the chain's consumers poll it (acquire) until it reaches the
launch's program count; CTA 0 zeroes it after the chain's first grid sync, by which every CTA has passed its poll.
The chain's producer waits for the GDN grid before it exits, so that the chain's completion still implies the GDN
kernel's (kernels after the chain wait on the chain alone).

The model arms a handoff only where the GDN op's next op is out_proj_mlp (dense layers on one rank:
StepInput.gdn_handoff), the GDN op arms it for its output (`arm`), and out_proj_mlp takes it (`take`): the chain
waits on the counter, and any other path zeroes the counter after the GDN kernel (stream order). Predicted (H100,
session 28's `--ab skip`: a GDN layer's kernel boundary 3.3 us of 2B's step, GDN -> chain about half of it): up to
1.5-2 us a GDN layer, 27-36 us a 2B step. `python -m profiles.host_time --decode 1 --ab gdn_handoff`.
"""
import torch

ENABLED = False  # until timed on a GPU

_COUNTERS: dict = {}  # device -> the int32 counter, zero between handoffs
_ARMED: dict = {}  # device -> (data_ptr of the armed output, the GDN launch's program count)


def counter(device: torch.device) -> torch.Tensor:
    """The device's handoff counter (a tensor's device), made on first use, which must not be inside a CUDA graph
    capture."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first GDN handoff on a device must run outside a CUDA graph capture")
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def arm(out: torch.Tensor, programs: int) -> None:
    """The GDN kernel writing `out` adds 1 to the counter a program, `programs` in all."""
    _ARMED[out.device] = (out.data_ptr(), programs)


def take(o: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(counter, programs) when o is the armed GDN output (the handoff is then the caller's), else None."""
    armed = _ARMED.get(o.device)
    if armed is None or armed[0] != o.data_ptr():
        return None
    del _ARMED[o.device]
    return counter(o.device), armed[1]
