"""README.md stays a working document: every ```python block compiles, and each runs on the CPU in a fresh
namespace (but blocks whose first line is `# needs a running server`); its test command is .ci/run's; its lines
fit 120 characters; it carries no measurement history ("session N") and names no missing file."""
import re
from pathlib import Path

import pytest

from kernels import registry

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NEEDS_SERVER = "# needs a running server"


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, source) of every ```python fenced block of README.md."""
    blocks, lines = [], README.read_text().splitlines()
    start = None
    for i, line in enumerate(lines):
        if start is None and line.strip() == "```python":
            start = i + 1
        elif start is not None and line.strip() == "```":
            blocks.append((start + 1, "\n".join(lines[start:i]) + "\n"))
            start = None
    assert start is None, f"README.md: the ```python block at line {start} is never closed"
    return blocks


BLOCKS = python_blocks()


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 5, f"README.md has {len(BLOCKS)} python blocks"
    assert any(src.startswith(NEEDS_SERVER) for _, src in BLOCKS), "the OpenAI client example is gone"


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_block_compiles(line, source):
    compile(source, f"README.md:{line}", "exec")


@pytest.fixture
def restore_router():
    """An example may set the ops backend or the tuning (model.ops.set_backend): put them back after it."""
    backend, tuning = registry.get_backend(), registry.tuning()
    yield
    registry.set_backend(backend)
    registry.set_tuning(tuning)


RUNNABLE = [(line, src) for line, src in BLOCKS if not src.startswith(NEEDS_SERVER)]


@pytest.mark.parametrize("line, source", RUNNABLE, ids=[f"line{line}" for line, _ in RUNNABLE])
def test_block_runs(line, source, restore_router, capsys):
    exec(compile(source, f"README.md:{line}", "exec"), {"__name__": f"readme_line{line}"})


def test_test_command_is_ci_run():
    """The README's test command (its bash continuation lines joined) is the one .ci/run runs."""
    ci = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv"))
    text = README.read_text()
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    assert ci.strip() in joined, f"README.md lacks .ci/run's command: {ci}"


def test_readme_is_for_users():
    text = README.read_text()
    long = [(i, len(line)) for i, line in enumerate(text.splitlines(), 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"
    history = re.findall(r".{0,40}\bsessions? [0-9]+.{0,40}", text, flags=re.IGNORECASE)
    assert not history, f"README.md cites sessions: {history}"
    assert "DESIGN.md" not in text


def test_readme_links_exist():
    """Every repository path the README links to exists."""
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which is not in the repository"
