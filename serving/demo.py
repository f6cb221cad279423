"""A scripted agent session through the serving engine: `python -m serving.demo [--model PRESET|PATH] [--device ...]`.

A system prompt with tool schemas, a user task, then tool results turn after turn, as an agent harness sends
them: each request carries the whole conversation so far, and the engine's prefix cache (KV pages and GDN state
snapshots) serves what it has seen, so each turn computes only its new tokens. Per turn it prints new (uncached)
prompt tokens, cached tokens, generated tokens, TTFT and decode speed. Defaults: `tiny` on the CPU,
`qwen3.5-0.8b` on the GPU. A preset name builds RANDOM weights at that model's real shapes: the text is noise,
the timings are real.
"""
import sys
import time
from dataclasses import dataclass

from model import load, ops
from model.model import Qwen35ForCausalLM
from model.tokenizer import StreamDecoder, load_tokenizer
from serving import cli
from serving.config import EngineConfig
from serving.device import pick_device
from serving.engine import LLMEngine
from serving.sequence import SamplingParams

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


def run_turn(engine: LLMEngine, tokenizer, prompt: list[int], max_new_tokens: int, out) -> tuple[list[int], TurnStats]:
    """Send the whole conversation as one request, stream the reply to `out`, time the first token and the rest."""
    decoder, generated = StreamDecoder(tokenizer), []
    start = time.perf_counter()
    seq_id = engine.add_request(prompt, SamplingParams(max_tokens=max_new_tokens))
    first = None
    while engine.has_unfinished:
        for o in engine.step():
            if o.seq_id == seq_id:
                first = first or time.perf_counter()
                generated.append(o.token)
                out.write(decoder.push(o.token))
                out.flush()
    out.write(decoder.flush() + "\n")
    end = time.perf_counter()
    result = engine.pop_output(seq_id)
    cached = result.cached_tokens
    return generated, TurnStats(len(prompt) - cached, cached, len(generated), first - start, end - first)


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


GPU_MEMORY_UTILIZATION = 0.95  # one process on the card: 35B-A3B's 65 GiB of weights leave an H100 80GB little else


def make_engine(model: Qwen35ForCausalLM, tokenizer, max_context: int, cuda_graphs: bool = True,
                state_cache_fraction: float = EngineConfig.state_cache_fraction,
                state_cache_gb: float | None = None, speculative_tokens: int = 0,
                draft_vocab_size: int = 0, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> LLMEngine:
    """An engine for one session: a pool of max_context tokens and 8 snapshot slots on the CPU; on the GPU both
    sized from gpu_memory_utilization of the card (the snapshots by state_cache_gb, else state_cache_fraction)."""
    common = dict(eos_token_ids=tokenizer.eos_token_ids, max_num_seqs=1, max_model_len=max_context,
                  cuda_graphs=cuda_graphs, snapshot_slots=8, state_cache_fraction=state_cache_fraction,
                  state_cache_gb=state_cache_gb, speculative_tokens=speculative_tokens,
                  draft_vocab_size=draft_vocab_size)
    if model.lm_head.weight.device.type == "cuda":
        return LLMEngine(model, EngineConfig.for_gpu_memory(gpu_memory_utilization, **common))
    return LLMEngine(model, EngineConfig.for_token_budget(max_context, **common))


def run_session(model, tokenizer, max_new_tokens: int, max_context: int, out, engine: LLMEngine | None = None
                ) -> tuple[list[int], list[TurnStats]]:
    """The scripted session. Returns every token the model saw or produced, in order, and per-turn stats."""
    engine = engine or make_engine(model, tokenizer, max_context)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS)
    stats = []
    for turn in range(len(TOOL_RESULTS) + 1):
        out.write(f"\n--- turn {turn + 1}: {len(prompt)} prompt tokens ---\n")
        generated, s = run_turn(engine, tokenizer, prompt, max_new_tokens, out)
        stats.append(s)
        if turn == len(TOOL_RESULTS):
            return prompt + generated, stats
        # the client sends the conversation back unchanged, with the tool's result appended
        closed = generated[-1] == tokenizer.im_end_id
        prompt = prompt + generated + tokenizer.continue_chat([{"role": "tool", "content": TOOL_RESULTS[turn]}],
                                                              closed=closed)
    return prompt, stats


def main(argv=None) -> list[TurnStats]:
    summary = "A scripted agent session through the serving engine.\n\n"
    ap = cli.Parser(prog=cli.prog("serving.demo"), description=summary + __doc__.split("\n", 1)[1].strip())
    ap.add_argument("--model", default=None, type=cli.model_spec,
                    help="a preset name (random weights) or an HF checkpoint folder (default: tiny on the CPU, "
                         "qwen3.5-0.8b on the GPU)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the model runs; auto: cuda when a GPU is visible, else cpu")
    ap.add_argument("--max-new-tokens", type=cli.positive_int, default=32,
                    help="tokens the model generates per turn at most")
    ap.add_argument("--max-context", type=cli.positive_int, default=8192,
                    help="longest conversation (prompt + generated tokens) the engine takes")
    ap.add_argument("--ops", default="auto", choices=["auto", "reference", "triton"],
                    help="kernel backend of model.ops; auto: triton on the GPU, reference on the CPU")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--gpu-memory-utilization", type=cli.fraction, default=GPU_MEMORY_UTILIZATION,
                    help="fraction of the card for weights, activations and the KV pool (CUDA), in (0, 1]")
    cli.add_state_cache_args(ap)
    cli.add_speculative_args(ap)
    args = ap.parse_args(argv)
    cli.check_speculative(ap, args)
    out = sys.stdout
    device = pick_device(args.device)
    ops.set_backend(args.ops if args.ops != "auto" else ("triton" if device.type == "cuda" else "reference"))
    spec = args.model or ("qwen3.5-0.8b" if device.type == "cuda" else "tiny")
    model, what = load.load_model(spec, device), load.describe_model(spec)
    tokenizer = load_tokenizer()
    engine = make_engine(model, tokenizer, args.max_context, cuda_graphs=not args.eager,
                         state_cache_fraction=args.state_cache_fraction, state_cache_gb=args.state_cache_gb,
                         gpu_memory_utilization=args.gpu_memory_utilization, **cli.speculative_fields(args))
    out.write(f"model: {what} | device: {device} | dtype: {model.lm_head.weight.dtype} | ops: {ops.get_backend()}\n"
              f"engine: {engine.pool_summary}\n")
    _, stats = run_session(model, tokenizer, args.max_new_tokens, args.max_context, out, engine)
    print_table(stats, out)
    return stats


if __name__ == "__main__":
    main()
