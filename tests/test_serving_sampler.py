"""sample(): greedy rows, top-k, top-p and per-request seeds."""
import os
import subprocess
import sys

import torch

from serving.sampler import sample
from serving.sequence import SamplingParams

V = 50


def random_logits(batch: int, seed: int = 0):
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * 3


def gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = random_logits(4)
    greedy = [SamplingParams()] * 4
    assert torch.equal(sample(logits, greedy, gens(0, 1, 2, 3)), logits.argmax(-1))
    top1 = [SamplingParams(temperature=1.5, top_k=1)] * 4
    assert torch.equal(sample(logits, top1, gens(0, 1, 2, 3)), logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(3)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()]
    out = sample(logits, params, gens(0, 1, 2))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = random_logits(1).expand(64, V)
    params = [SamplingParams(temperature=2.0)] * 64
    assert torch.equal(sample(logits, params, gens(*[7] * 64)), sample(logits, params, gens(*[7] * 64)))
    assert len(set(sample(logits, params, gens(*range(64))).tolist())) > 5


def test_top_k_and_top_p_only_draw_from_their_sets():
    logits = random_logits(1, seed=4)[0]
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.6].tolist())
    top5 = set(order[:5].tolist())
    n = 400
    by_p = sample(logits.expand(n, V), [SamplingParams(temperature=1.0, top_p=0.6)] * n, gens(*range(n)))
    by_k = sample(logits.expand(n, V), [SamplingParams(temperature=1.0, top_k=5)] * n, gens(*range(n)))
    assert set(by_p.tolist()) == nucleus
    assert set(by_k.tolist()) <= top5 and len(set(by_k.tolist())) > 1


def test_draws_follow_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    n = 4000
    out = sample(logits.expand(n, 4), [SamplingParams(temperature=1.0)] * n, gens(*range(n)))
    freq = torch.bincount(out, minlength=4).float() / n
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.03


def test_rows_without_params_are_argmax_and_draw_nothing():
    logits = random_logits(3, seed=5)
    g = gens(0, 1, 2)
    before = [x.get_state() for x in g]
    out = sample(logits, [None, SamplingParams(temperature=1.0), None], [None, g[1], None])
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert torch.equal(g[0].get_state(), before[0]) and not torch.equal(g[1].get_state(), before[1])


def test_a_seeded_row_draws_the_same_alone_or_batched():
    logits = random_logits(4, seed=6)
    p = SamplingParams(temperature=1.3, top_k=20, top_p=0.95)
    alone = [sample(logits[i:i + 1], [p], gens(100 + i)).item() for i in range(4)]
    batched = sample(logits, [p, SamplingParams(), p, p], gens(100, 101, 102, 103)).tolist()
    assert [batched[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert batched[1] == logits[1].argmax()


def test_the_engine_imports_without_triton():
    # a CPU install (`pip install -e .`) has no Triton: the engine imports it only where a Triton kernel runs
    script = ("import sys, importlib.abc\n"
              "class NoTriton(importlib.abc.MetaPathFinder):\n"
              "    def find_spec(self, name, path, target=None):\n"
              "        if name == 'triton' or name.startswith('triton.'):\n"
              "            raise ImportError('no triton here')\n"
              "sys.meta_path.insert(0, NoTriton())\n"
              "import serving.engine, serving.sampler\n"
              "print('imported')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # what the CPU tests set
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("imported"), run.stderr[-2000:]
