"""profiles.ab_refs: each git ref's fa4/ becomes its own importable package (CPU: prepare and import only)."""
import importlib
import sys

from profiles import ab_refs


def test_prepare_renames_the_package_and_its_own_imports(tmp_path):
    ab_refs.prepare(["HEAD"], tmp_path)
    name = ab_refs.package_name("HEAD")
    assert name == "fa4_HEAD" and ab_refs.package_name("try/cute-x") == "fa4_try_cute_x"
    sources = {p.relative_to(tmp_path / name): p.read_text() for p in (tmp_path / name).rglob("*.py")}
    assert "cute/kernel.py" in {str(p) for p in sources}
    assert not any(ab_refs.IMPORT.search(text) for text in sources.values())  # no import of fa4 itself is left
    assert "from fa4_HEAD.cute import softmax as S" in sources[next(p for p in sources if str(p) == "cute/kernel.py")]
    sys.path.insert(0, str(tmp_path))
    try:
        config = importlib.import_module(f"{name}.cute.config")  # DSL-free: imports on any machine
        entry = importlib.import_module(f"{name}.cute.entry")
        assert entry.choose_config is config.choose_config  # the copy's own modules, not fa4's
        assert config.__file__.startswith(str(tmp_path))
    finally:
        sys.path.remove(str(tmp_path))
        for module in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[module]
