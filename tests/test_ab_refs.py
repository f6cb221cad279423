"""profiles.ab_refs: each git ref's fa4/ becomes its own importable package (CPU: prepare and import only)."""
import os
import subprocess
import sys

import pytest

from profiles import ab_refs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the copy imported with the original package blocked: any import of fa4 left in it fails here
IMPORT_COPY = """
import importlib, importlib.abc, importlib.util, sys
class NoFa4(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fa4" or name.startswith("fa4."):
            raise ImportError("the copy imported the original fa4: " + name)
sys.meta_path.insert(0, NoFa4())
sys.path.insert(0, sys.argv[1])
name = sys.argv[2]
modules = ["cute.config", "cute.entry", "softmax"]
if importlib.util.find_spec("cutlass") is not None:  # the DSL-side modules where the DSL is installed
    modules += ["cute.softmax", "cute.kernel", "cute.compile_cache"]
for module in modules:
    assert importlib.import_module(f"{name}.{module}").__file__.startswith(sys.argv[1]), module
assert not any(m == "fa4" or m.startswith("fa4.") for m in sys.modules)
print("ok", len(modules))
"""


def test_prepare_renames_the_package_and_its_own_imports(tmp_path):
    ab_refs.prepare(["HEAD"], tmp_path)
    name = ab_refs.package_name("HEAD")
    assert name == "fa4_HEAD" and ab_refs.package_name("try/cute-x") == "fa4_try_cute_x"
    kernel = (tmp_path / name / "cute" / "kernel.py").read_text()
    assert "from fa4_HEAD.cute import softmax as S" in kernel and "from fa4.cute" not in kernel
    run = subprocess.run([sys.executable, "-c", IMPORT_COPY, str(tmp_path), name], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]


def test_the_rename_covers_every_import_form():
    source = ("import fa4\nimport fa4.cute as C\n    from fa4 import softmax\nfrom fa4.cute.config import X\n"
              "import fa4x\n")
    assert ab_refs.IMPORT.sub(r"\g<1>fa4_r", source) == (
        "import fa4_r\nimport fa4_r.cute as C\n    from fa4_r import softmax\nfrom fa4_r.cute.config import X\n"
        "import fa4x\n")


def test_each_round_starts_one_later():
    from profiles.common import round_order
    names = ["fa4_a", "fa4_b", "fa4"]
    orders = [round_order(names, r) for r in range(4)]
    assert orders == [names, ["fa4_b", "fa4", "fa4_a"], ["fa4", "fa4_a", "fa4_b"], names]
    assert {o[0] for o in orders[:3]} == set(names)  # every code leads one round of three


def fake_clock(durations: dict[str, list[float]], seen: list[str]):
    """A Clock over a fake device timeline: each call appends its name to seen and takes its next duration."""
    from profiles.common import Clock
    now = [0.0]

    def call(name):
        def run():
            seen.append(name)
            now[0] += durations[name][sum(n == name for n in seen) - 1]
        return run
    synced = []
    clock = Clock(stamp=lambda: now[0], us=lambda a, b: b - a, sync=lambda: synced.append(True))
    return clock, call, synced


def test_interleaved_us_times_each_call_between_its_stamps_in_rotated_order():
    from profiles.common import interleaved_us
    seen = []
    # the card drifts: every call is slower in the second iteration; "b" is 10% faster than "a" throughout
    durations = {"a": [1.0, 100.0, 200.0], "b": [1.0, 90.0, 180.0], "c": [1.0, 50.0, 70.0]}
    clock, call, synced = fake_clock(durations, seen)
    times = interleaved_us({n: call(n) for n in "abc"}, iters=2, warmup=1, clock=clock)
    assert seen == ["a", "b", "c", "a", "b", "c", "b", "c", "a"]  # warm-up, then iteration 0, iteration 1 rotated
    assert times == {"a": [100.0, 200.0], "b": [90.0, 180.0], "c": [50.0, 70.0]} and synced == [True]


def test_paired_ratio_cancels_the_drift_a_best_of_rounds_would_keep():
    from profiles.common import paired_ratio, quantile
    times = {"ours": [100.0, 200.0, 150.0], "fa4": [110.0, 220.0, 165.0]}
    ratio = paired_ratio(times, "ours", "fa4")
    assert ratio["median"] == pytest.approx(1.1) and ratio["p10"] == pytest.approx(1.1)
    times["fa4"] = [100.0, 300.0, 165.0]
    assert paired_ratio(times, "ours", "fa4") == {"median": pytest.approx(1.1), "p10": pytest.approx(1.02),
                                                  "p90": pytest.approx(1.42)}
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([1.0, 2.0], 0.25) == 1.25
    assert quantile([5.0], 0.9) == 5.0


@pytest.mark.gpu
def test_interleaved_us_on_cuda_events():
    import torch

    from profiles.common import interleaved_us, paired_ratio
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    times = interleaved_us({"one": lambda: a @ a, "four": lambda: [a @ a for _ in range(4)]}, iters=8)
    assert all(len(t) == 8 and min(t) > 0 for t in times.values())
    assert 3.0 < paired_ratio(times, "one", "four")["median"] < 5.0
