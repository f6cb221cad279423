"""A scripted agent session, end to end: `python -m serving.demo [--model PRESET|PATH] [--device auto|cpu|cuda]`.

A system prompt with tool schemas, a user task, then tool results turn after turn, as an agent harness sends
them. Each turn appends only its new tokens to the cached conversation (KV pages and GDN state), streams the
reply, and the run ends with a table of prompt tokens, generated tokens, TTFT and decode speed per turn.
A preset name builds RANDOM weights at that model's real shapes: the text is noise, the timings are real.
"""
import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from model import ops
from model.generate import stream
from model.loader import load_checkpoint
from model.model import Qwen35ForCausalLM
from model.tokenizer import StreamDecoder, load_tokenizer

SYSTEM = "You are a coding agent working in a Python repository. Use the tools to inspect and fix the code."
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, optionally one test.",
        "parameters": {"type": "object", "properties": {"select": {"type": "string"},
                                                        "verbose": {"type": "boolean"}}}}},
]
TASK = "The test tests/test_parse.py::test_empty fails with an IndexError. Find the bug and fix it."
TOOL_RESULTS = [
    "def parse(line):\n    fields = line.split(',')\n    return fields[0].strip(), fields[1].strip()\n",
    "FAILED tests/test_parse.py::test_empty - IndexError: list index out of range\n1 failed, 41 passed in 0.31s",
    "42 passed in 0.29s",
]


@dataclass
class TurnStats:
    new_tokens: int
    cached_tokens: int
    generated: int
    ttft_s: float
    decode_s: float


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but no CUDA GPU is visible")
    return torch.device(name)


def load_model(spec: str, device: torch.device) -> tuple[Qwen35ForCausalLM, str]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if Path(spec).is_dir():
        return load_checkpoint(spec, device=device, dtype=dtype), f"checkpoint {spec}"
    return Qwen35ForCausalLM.from_preset(spec, device=device, dtype=dtype), f"preset {spec} (RANDOM weights)"


def run_turn(model, cache, tokenizer, new_ids, max_new_tokens, out) -> tuple[list[int], TurnStats]:
    """Feed new_ids, stream the reply to `out`, and time the first token and the rest."""
    cached = max(cache.lengths)
    decoder, generated = StreamDecoder(tokenizer), []
    start = time.perf_counter()
    first = None
    for token in stream(model, cache, new_ids, max_new_tokens, tokenizer.eos_token_ids):
        first = first or time.perf_counter()
        generated.append(token)
        out.write(decoder.push(token))
        out.flush()
    out.write(decoder.flush() + "\n")
    end = time.perf_counter()
    return generated, TurnStats(len(new_ids), cached, len(generated), first - start, end - first)


def print_table(stats: list[TurnStats], out) -> None:
    head = f"{'turn':>4} {'new prompt tok':>14} {'cached tok':>10} {'generated':>9} {'TTFT ms':>9} {'decode tok/s':>12}"
    out.write("\n" + head + "\n" + "-" * len(head) + "\n")
    for i, s in enumerate(stats, 1):
        rate = (s.generated - 1) / s.decode_s if s.generated > 1 and s.decode_s > 0 else float("nan")
        out.write(f"{i:>4} {s.new_tokens:>14} {s.cached_tokens:>10} {s.generated:>9} {1e3 * s.ttft_s:>9.1f} "
                  f"{rate:>12.1f}\n")
    total_gen = sum(s.generated - 1 for s in stats)
    total_dec = sum(s.decode_s for s in stats)
    out.write(f"mean decode: {total_gen / total_dec:.1f} tok/s over {total_gen} tokens\n" if total_dec else "")


def run_session(model, tokenizer, max_new_tokens: int, max_context: int, out) -> tuple[list[int], list[TurnStats]]:
    """The scripted session. Returns every token the model saw or produced, in order, and per-turn stats."""
    cache = model.new_cache(1, max_context)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    new_ids = tokenizer.apply_chat_template(messages, tools=TOOLS)
    transcript, stats = [], []
    for turn in range(len(TOOL_RESULTS) + 1):
        out.write(f"\n--- turn {turn + 1}: {len(new_ids)} new prompt tokens ---\n")
        generated, s = run_turn(model, cache, tokenizer, new_ids, max_new_tokens, out)
        transcript += new_ids + generated
        stats.append(s)
        if turn == len(TOOL_RESULTS):
            break
        # The last generated token is not in the cache yet; the next turn sends it first, then the tool result.
        closed = generated[-1] == tokenizer.im_end_id
        new_ids = [generated[-1]] + tokenizer.continue_chat([{"role": "tool", "content": TOOL_RESULTS[turn]}],
                                                            closed=closed)
        transcript.pop()  # it is sent again as the first of new_ids
    return transcript, stats


def main(argv=None) -> list[TurnStats]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="a preset name (random weights) or an HF checkpoint folder")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--ops", default="auto", choices=["auto", "reference", "triton"],
                    help="kernel backend of model.ops; auto: triton on the GPU, reference on the CPU")
    args = ap.parse_args(argv)
    out = sys.stdout
    device = pick_device(args.device)
    ops.set_backend(args.ops if args.ops != "auto" else ("triton" if device.type == "cuda" else "reference"))
    model, what = load_model(args.model, device)
    tokenizer = load_tokenizer()
    out.write(f"model: {what} | device: {device} | dtype: {model.lm_head.weight.dtype} | ops: {ops.get_backend()}\n")
    _, stats = run_session(model, tokenizer, args.max_new_tokens, args.max_context, out)
    print_table(stats, out)
    return stats


if __name__ == "__main__":
    main()
