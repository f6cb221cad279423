"""profiles.ab_refs: each git ref's fa4/ becomes its own importable package (CPU: prepare and import only)."""
import os
import subprocess
import sys

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


def test_timed_rounds_rotates_the_calls(monkeypatch):
    from profiles import common
    seen = []
    monkeypatch.setattr(common, "bench_us", lambda call: seen.append(call()) or 10.0 * len(seen))
    times = common.timed_rounds({n: (lambda n=n: n) for n in ("a", "b", "c")}, rounds=2)
    assert seen == ["a", "b", "c", "b", "c", "a"]
    assert times == {"a": [10.0, 60.0], "b": [20.0, 40.0], "c": [30.0, 50.0]}
