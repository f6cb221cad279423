"""The demo runs end to end on the CPU, and its turn-by-turn cache reuse is exact."""
import io

import torch

from model.generate import greedy
from model.model import Qwen35ForCausalLM
from model.tokenizer import load_tokenizer
from serving import demo


def test_demo_runs_and_prints_the_table(capsys):
    stats = demo.main(["--model", "tiny", "--device", "cpu", "--max-new-tokens", "3"])
    printed = capsys.readouterr().out
    assert "RANDOM weights" in printed
    assert "TTFT ms" in printed and "decode tok/s" in printed
    assert len(stats) == len(demo.TOOL_RESULTS) + 1
    assert all(s.generated >= 1 and s.ttft_s > 0 for s in stats)
    assert [s.cached_tokens > 0 for s in stats] == [False] + [True] * len(demo.TOOL_RESULTS)


def test_incremental_turns_equal_one_full_prefill():
    """Each turn appends only its new tokens to the cache; the replies must equal what a model that prefills
    the whole transcript at once produces."""
    model = Qwen35ForCausalLM.from_preset("tiny", seed=7)
    transcript, stats = demo.run_session(model, load_tokenizer(), 3, 2048, io.StringIO())
    # the last turn's reply, regenerated from a cold prefill of everything before it
    reply = stats[-1].generated
    prompt = torch.tensor([transcript[:-reply]])
    assert greedy(model, prompt, reply)[0].tolist() == transcript[-reply:]
