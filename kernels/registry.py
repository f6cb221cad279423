"""One router: which implementation runs each op.

An op is a name and a key function. The key is the call's shape, dtype and device as a hashable tuple: all that
the choice depends on. An implementation registers under an op with its backend ("reference" or "triton"), a
predicate `supports(key, tuning) -> reason | None` and a cost `cost(key, tuning) -> float`, tuning being the
active kernels.tuning.KernelTuning. `choose` takes the cheapest implementation that supports the key among the
active backend's, then the reference's. The choice is made once per (backend, tuning, key) and cached, so a call
of a shape seen before costs its key and one dict lookup. `use(backend, tuning)` sets both for a block: an A/B
runs two tunings in one process.

Each kernel module registers its entries (kernels.routes imports them all); fa4 registers its forwards
(fa4.routes); model.ops registers the reference compositions and asks `run` for every op. This module imports
neither fa4 nor model.
"""
import functools
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kernels import environment
from kernels.environment import INTERPRET
from kernels.tuning import KernelTuning

BACKENDS = ("reference", "triton")
# QWEN_CHECK_OPS=1 (a test may set this instead): the op path runs each implementation's checked entry, which
# validates the arguments the engine built as the public kernel functions validate a user's
CHECK_OPS = environment.CHECK_OPS
_CACHE_LIMIT = 4096  # distinct keys kept per backend; long prefills over growing contexts make new keys


@dataclass(frozen=True)
class DeviceInfo:
    """What routing needs of a device: its type, compute capability, SM count, and whether Triton interprets."""
    type: str
    capability: tuple[int, int] = (0, 0)
    num_sms: int = 0
    interpret: bool = False

    @property
    def sm90(self) -> bool:
        return self.type == "cuda" and self.capability == (9, 0)


@functools.cache
def device_info(device: torch.device) -> DeviceInfo:
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceInfo(device.type, interpret=INTERPRET)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo("cuda", (props.major, props.minor), props.multi_processor_count, INTERPRET)


H200 = DeviceInfo("cuda", (9, 0), 132)  # the routing tests' card (an H100 SXM has 132 SMs too)


def _always(key, tuning) -> None:
    return None


def triton_unsupported(key, tuning=None) -> str | None:
    """Why Triton kernels cannot run a call keyed with a `device` field, or None: CUDA, or the CPU interpreter."""
    if key.device.type != "cuda" and not key.device.interpret:
        return f"a {key.device.type} tensor, not CUDA (and TRITON_INTERPRET=1 is not set)"
    return None


def all_of(*predicates):
    """A supports predicate: the first reason of predicates, or None."""
    def supports(key, tuning):
        return next((r for r in (p(key, tuning) for p in predicates) if r is not None), None)
    return supports


@dataclass(frozen=True)
class Impl:
    """One implementation of an op. run takes the op's arguments and launches without checking them (the engine
    built them); checked, where given, is the same call through the public kernel's argument checks (CHECK_OPS).
    supports and cost take its key and the tuning. captures: it launches from device metadata alone, so a CUDA
    graph captured at a key replays it for every step of that key (paged attention: given the step's kv_splits)."""
    name: str
    backend: str
    run: Callable
    supports: Callable[[tuple, KernelTuning], str | None] = _always
    cost: Callable[[tuple, KernelTuning], float] | float = 0.0
    checked: Callable | None = None
    captures: bool = False

    def cost_of(self, key, tuning: KernelTuning) -> float:
        return self.cost(key, tuning) if callable(self.cost) else self.cost


@dataclass
class Op:
    name: str
    key: Callable[..., tuple] | None  # the op's arguments -> its key; None: one implementation a backend
    impls: list[Impl] = field(default_factory=list)


_OPS: dict[str, Op] = {}
_choices: dict[tuple, Impl] = {}  # (backend, tuning, op, key) -> Impl
_active = "reference"
_tuning = KernelTuning(pdl=environment.PDL)


def define(op: str, key: Callable[..., tuple] | None = None) -> None:
    """Declare an op, and how its calls are keyed where its implementations differ by call (model.ops declares
    the model's ops with their reference implementations; the kernels give keys to those they split)."""
    entry = _OPS.setdefault(op, Op(op, key))
    if key is not None and entry.key not in (None, key):
        raise ValueError(f"op {op!r} is already keyed by {entry.key}")
    if key is not None:
        entry.key = key
        _choices.clear()


def register(op: str, impl: Impl) -> None:
    """Add an implementation of op (replacing one of the same name and backend)."""
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; defined: {sorted(_OPS)}")
    if impl.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {impl.backend!r}")
    impls = _OPS[op].impls
    impls[:] = [i for i in impls if (i.name, i.backend) != (impl.name, impl.backend)] + [impl]
    _choices.clear()


def ops() -> tuple[str, ...]:
    return tuple(_OPS)


def impls(op: str, backend: str | None = None) -> list[Impl]:
    return [i for i in _OPS[op].impls if backend is None or i.backend == backend]


def why_not(op: str, key, tuning: KernelTuning | None = None) -> dict[str, str | None]:
    """Each implementation's answer for key: None where it runs it, else why not."""
    return {i.name: i.supports(key, tuning or _tuning) for i in _OPS[op].impls}


def choose(op: str, key, backend: str | None = None, tuning: KernelTuning | None = None) -> Impl:
    """The implementation that runs op's calls of this key on backend and tuning (default: the active ones)."""
    at = (backend or _active, tuning or _tuning, op, key)
    impl = _choices.get(at)
    if impl is None:
        impl = _choose(op, key, at[0], at[1])
        if len(_choices) >= _CACHE_LIMIT:
            _choices.clear()
        _choices[at] = impl
    return impl


def _choose(op: str, key, backend: str, tuning: KernelTuning) -> Impl:
    for wanted in dict.fromkeys((backend, "reference")):
        fits = [i for i in _OPS[op].impls if i.backend == wanted and i.supports(key, tuning) is None]
        if fits:
            return min(fits, key=lambda i: i.cost_of(key, tuning))
    raise ValueError(f"no implementation of {op!r} runs {key}: {why_not(op, key, tuning)}")


def named(op: str, name: str, key) -> Impl:
    """The implementation called name, if it runs key; else ValueError saying why."""
    for impl in _OPS[op].impls:
        if impl.name == name:
            reason = impl.supports(key, _tuning)
            if reason is not None:
                raise ValueError(f"{name!r} cannot run this {op} call: {reason}")
            return impl
    raise ValueError(f"{op!r} has no implementation {name!r}; registered: {[i.name for i in _OPS[op].impls]}")


def chosen(op: str, *args) -> Impl:
    """The implementation that run(op, *args) runs."""
    entry = _OPS[op]
    return choose(op, entry.key(*args) if entry.key is not None else ())


def run(op: str, *args):
    """Run op on the implementation chosen for its arguments' key."""
    entry = _OPS[op]
    impl = choose(op, entry.key(*args) if entry.key is not None else ())
    return (impl.checked or impl.run)(*args) if CHECK_OPS else impl.run(*args)


def set_backend(name: str) -> None:
    global _active
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; one of {BACKENDS}")
    _active = name


def get_backend() -> str:
    return _active


def tuning() -> KernelTuning:
    """The active kernel tuning: what the kernels' launch plans read."""
    return _tuning


def set_tuning(value: KernelTuning) -> None:
    global _tuning
    if not isinstance(value, KernelTuning):
        raise ValueError(f"tuning must be a KernelTuning, got {type(value).__name__}")
    _tuning = value


@contextmanager
def use(backend: str | None = None, tuning: KernelTuning | None = None):
    """Run a block on backend and tuning (None: keep the active one)."""
    before = _active, _tuning
    try:
        if backend is not None:
            set_backend(backend)
        if tuning is not None:
            set_tuning(tuning)
        yield
    finally:
        set_backend(before[0])
        set_tuning(before[1])


def use_backend(name: str):
    return use(backend=name)
