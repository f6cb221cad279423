"""A decode step's phases on the GPU's own clock, from its CUDA graph with PDL intact:
`python -m profiles.step_stamps --model qwen3.5-2b --ctx 8192`.

The mixer kernels stamp %globaltimer (kernels/stamps.py) when their programs start, when their PDL wait returns
(the kernel before them has completed) and when they end. Captured into the decode graph at batch 1, every replay
writes the same slots, so the phases of each layer are read straight off the timer:
  attention  prep     the split's go - prep's go         (prep's work, and the split's hand-off)
             split    the combine's go - the split's go  (the KV stream)
             combine  the combine's end - its go
  gdn        kernel   its end - its go
  either     after    the next mixer's go - this one's end: the output projection + MLP chain, and the next layer's
                      normed in-projection (their weights' bytes over that time is the GEMVs' bandwidth in place)
and, per kernel, `lead` = go - first arrival (how long it sat resident before its wait returned: a launch hidden
behind the kernel before), `spread` = last go - first go, `first_end` = when its first program finished (from the
first go) and `busy` = a program's mean time from its own go to its end: a phase far above `busy` is a tail.
The stamped graph's step time is printed beside an unstamped one's from the same process (the stamps' own cost:
a few atomics a program).
"""
import argparse
from collections import defaultdict
from statistics import mean

import torch

from kernels import stamps
from model import ops
from model.layers import GatedAttention
from profiles.common import environment, print_table, write_result
from profiles.host_time import AB_KNOBS, decoding_engine, knob_setters, time_steps
from serving.demo import load_model

KERNELS = {"attention": ("attention_prep", "attention_split", "attention_combine"), "gdn": ("gdn_decode",)}


def layer_kinds(model) -> list[str]:
    return ["attention" if isinstance(layer.mixer, GatedAttention) else "gdn" for layer in model.model.layers]


def bytes_after(model, i: int) -> int:
    """Weight bytes the GEMVs between layer i's mixer and layer i + 1's stream: i's output projection and MLP, then
    i + 1's in-projection (0 for the last layer: its 'after' runs into the next step)."""
    layers = model.model.layers
    if i + 1 >= len(layers):
        return 0
    layer, nxt = layers[i], layers[i + 1]
    elt = layer.mixer.out_weight.element_size()
    mlp = sum(p.numel() for p in layer.mlp.parameters())
    return elt * (layer.mixer.out_weight.numel() + mlp + nxt.mixer.widths[0] * model.config.hidden_size)


def layer_phases(rows: list[dict], kinds: list[str]) -> list[dict]:
    """One replay's stamped rows (launch order) -> per layer {'layer', 'kind', phase: us}; kernel rows carry
    lead_us and spread_us under '<kernel>.lead' / '.spread'."""
    expected = [name for kind in kinds for name in KERNELS[kind]]
    names = [r["name"] for r in rows]
    if names != expected:
        raise ValueError(f"the replay stamped {names[:8]}... ({len(names)}), expected the layers' {len(expected)}")
    us = 1e-3
    out, k = [], 0
    for i, kind in enumerate(kinds):
        own = rows[k:k + len(KERNELS[kind])]
        k += len(own)
        nxt = rows[k] if k < len(rows) else None
        phase = {"layer": i, "kind": kind}
        if kind == "attention":
            prep, split, combine = own
            phase |= {"prep": (split["first_go"] - prep["first_go"]) * us,
                      "split": (combine["first_go"] - split["first_go"]) * us,
                      "combine": (combine["last_end"] - combine["first_go"]) * us}
        else:
            phase["kernel"] = (own[0]["last_end"] - own[0]["first_go"]) * us
        if nxt is not None:
            phase["after"] = (nxt["first_go"] - own[-1]["last_end"]) * us
        for r in own:
            phase[f"{r['name']}.lead"] = (r["first_go"] - r["first_arrive"]) * us
            phase[f"{r['name']}.spread"] = (r["last_go"] - r["first_go"]) * us
            phase[f"{r['name']}.first_end"] = (r["first_end"] - r["first_go"]) * us
            phase[f"{r['name']}.busy"] = r["busy_sum"] / max(r["programs"], 1) * us
        out.append(phase)
    return out


def summarise(replays: list[list[dict]], model) -> list[dict]:
    """Mean / min / max over replays and layers of each (kind, phase); 'after' rows with their GEMV bytes' TB/s."""
    values, after_bytes = defaultdict(list), defaultdict(list)
    for phases in replays:
        for p in phases:
            for key, v in p.items():
                if key not in ("layer", "kind"):
                    values[(p["kind"], key)].append(v)
            if "after" in p:
                after_bytes[p["kind"]].append(bytes_after(model, p["layer"]) / (p["after"] * 1e-6) / 1e12)
    rows = []
    for (kind, phase), vs in values.items():
        row = {"kind": kind, "phase": phase, "count": len(vs), "mean_us": mean(vs), "min_us": min(vs),
               "max_us": max(vs)}
        if phase == "after":
            row["gemv_TBps"] = mean(after_bytes[kind])
        rows.append(row)
    return rows


def run(model, args) -> dict:
    plain = decoding_engine(model, args, True, args.page_size)
    plain_ms = time_steps(plain, 150)
    plain.close()
    with stamps.record(torch.device("cuda", torch.cuda.current_device())) as buf:
        engine = decoding_engine(model, args, True, args.page_size)
    stamped_ms = time_steps(engine, 150)
    kinds = layer_kinds(model)
    replays, spans = [], []
    for _ in range(args.steps):
        buf.reset()
        engine.step()
        torch.cuda.synchronize()
        rows = buf.read()
        spans.append(1e-3 * (rows[-1]["last_end"] - rows[0]["first_go"]))
        replays.append(layer_phases(rows, kinds))
    engine.close()
    return {"graph_ms": plain_ms, "stamped_graph_ms": stamped_ms, "mixer_span_us": mean(spans),
            "phases": summarise(replays, model), "per_layer_last_replay": replays[-1]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-2b", help="preset (random weights) or checkpoint folder")
    ap.add_argument("--ctx", type=int, default=8192, help="cached tokens of the decoding sequence")
    ap.add_argument("--steps", type=int, default=50, help="stamped replays to average")
    ap.add_argument("--page-size", type=int, default=16, help="the engine's KV page size")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VARIANT",
                    help=f"set a decode knob first (profiles.host_time's AB_KNOBS: {', '.join(sorted(AB_KNOBS))})")
    ap.add_argument("--out", default=None, help="write step_stamps.json into this folder (default profiles/results)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_stamps reads the GPU's timer inside a CUDA graph: it needs CUDA")
    for knob in args.knob:
        name, _, variant = knob.partition("=")
        variants = knob_setters(name)[0] if name in AB_KNOBS else {}
        if variant not in variants:
            raise SystemExit(f"--knob {knob}: expected NAME=VARIANT with NAME in AB_KNOBS and one of its variants")
        variants[variant]()
    args.decode = 1
    ops.set_backend("triton")
    model, what = load_model(args.model, torch.device("cuda"))
    found = run(model, args)
    print(f"{what}: a batch-1 decode step over {args.ctx}, graph {found['graph_ms']:.3f} ms "
          f"(stamped {found['stamped_graph_ms']:.3f}), first mixer's go to last mixer's end "
          f"{found['mixer_span_us']:.1f} us; phases over {args.steps} replays:")
    print_table(found["phases"], ["kind", "phase", "count", "mean_us", "min_us", "max_us", "gemv_TBps"])
    path = write_result("step_stamps", {"environment": environment(), "model": args.model, "ctx": args.ctx,
                                        "page_size": args.page_size, "knobs": args.knob, **found}, args.out)
    print(f"wrote {path}")
    return found


if __name__ == "__main__":
    main()
