"""A decode step's kernels on the GPU's own clock, from its CUDA graph with PDL intact:
`python -m profiles.step_stamps --model qwen3.5-2b --ctx 8192`.

Every kernel of a batch-1 decode step stamps %globaltimer (kernels/stamps.py: the TMA GEMVs and chains, the Triton
GEMV, the mixers, the norms, the row gathers and the argmax) when its programs reach their PDL wait, when the wait
returns (the kernel before has completed) and, in the mixers and the TMA GEMVs, when they end. Captured into the
decode graph, every replay writes the same slots. A launch's share of the step's critical path is the next
launch's go minus its own (whatever overlapped it), so the shares add up to the step; a GEMV's weight bytes over its
share is its bandwidth in place. Per launch also `lead` = go - first arrival (how long its programs sat resident
before their wait returned: its launch and prologue hidden behind the kernel before), `spread` = last go - first go
and `busy` = a program's mean time from its own go to its end (stamped kernels only): a share far above `busy` is
a tail or a hand-off. Launches are grouped by kernel and weight size (e.g. 2B's 18 GDN in-projections of 50.6 MB).
The stamped graph's step time is printed beside an unstamped one's from the same process (the stamps' own cost:
a few atomics a program).
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

import torch

from kernels import stamps
from model import ops
from model.load import describe_model, load_model
from profiles.common import environment, print_table, write_result
from profiles.host_time import AB_KNOBS, Variant, combined, decoding_engine, knob_variants, running, time_steps


def critical_shares(rows: list[dict]) -> list[dict]:
    """One replay's stamped launches (launch order, every kernel of the step stamped) -> per launch: its share of
    the critical path (the next launch's go - its go; the last one's end - its go, None when it stamps no end),
    lead, spread and busy (us), and its bytes' TB/s over its share where it streams weights."""
    us = 1e-3
    out = []
    for i, r in enumerate(rows):
        until = rows[i + 1]["first_go"] if i + 1 < len(rows) else r["last_end"]  # 0: the last one stamps no end
        share = (until - r["first_go"]) * us if until else None
        out.append({"name": r["name"], "MB": r["bytes"] / 1e6, "share_us": share,
                    "lead_us": (r["first_go"] - r["first_arrive"]) * us,
                    "spread_us": (r["last_go"] - r["first_go"]) * us,
                    "busy_us": r["busy_sum"] / r["programs"] * us if r["programs"] else None,
                    "TBps": r["bytes"] / share / 1e6 if r["bytes"] and share and share > 0 else None})
    return out


def summarise(replays: list[list[dict]]) -> list[dict]:
    """critical_shares' rows of every replay grouped by (name, MB): count a replay, mean share (min, max), its sum a
    step, mean lead / spread / busy and the bytes' TB/s over the mean share; in the step's launch order."""
    groups: dict = defaultdict(list)
    for shares in replays:
        for r in shares:
            groups[(r["name"], round(r["MB"], 1))].append(r)
    rows = []
    for (name, mb), rs in groups.items():
        shares = [r["share_us"] for r in rs if r["share_us"] is not None]
        share = mean(shares) if shares else None
        busy = [r["busy_us"] for r in rs if r["busy_us"] is not None]
        rows.append({"name": name, "MB": mb, "count": len(rs) // len(replays), "share_us": share,
                     "min_us": min(shares, default=None), "max_us": max(shares, default=None),
                     "step_us": share * len(rs) / len(replays) if shares else None,
                     "lead_us": mean(r["lead_us"] for r in rs), "spread_us": mean(r["spread_us"] for r in rs),
                     "busy_us": mean(busy) if busy else None,
                     "TBps": mb / share if mb and share and share > 0 else None})
    return rows


def run(model, args) -> dict:
    plain = decoding_engine(model, args, True, args.page_size)
    plain_ms = time_steps(plain, 150)
    plain.close()
    with stamps.record(torch.device("cuda", torch.cuda.current_device()), capacity=65536) as buf:
        engine = decoding_engine(model, args, True, args.page_size)
    stamped_ms = time_steps(engine, 150)
    replays, spans = [], []
    for _ in range(args.steps):
        buf.reset()
        engine.step()
        torch.cuda.synchronize()
        rows = buf.read()
        if not rows:
            raise RuntimeError(f"the replay stamped no launch: the {buf.slots.shape[0]} slots ran out before the "
                               f"decode graph's capture, or its kernels were compiled without stamps")
        spans.append(1e-3 * (max(max(r["last_end"], r["last_go"]) for r in rows) - rows[0]["first_go"]))
        replays.append(critical_shares(rows))
    engine.close()
    # between replays: the stamped step's wall time beyond its kernels' span (the first go to the argmax's end): the
    # copies and graph launch between two steps, and the first kernel's own launch
    return {"graph_ms": plain_ms, "stamped_graph_ms": stamped_ms, "span_us": mean(spans),
            "between_us": 1e3 * stamped_ms - mean(spans), "launches": len(replays[-1]), "groups": summarise(replays),
            "last_replay": replays[-1]}


def compare(base: dict, other: dict) -> list[dict]:
    """Two step_stamps results' groups side by side (matched by kernel and MB): each one's share a launch and the
    difference a step (other - base), in base's order; groups only one of them has are listed with the other's
    share empty."""
    theirs = {(g["name"], g["MB"]): g for g in other["groups"]}
    rows = []
    for g in base["groups"]:
        o = theirs.pop((g["name"], g["MB"]), None)
        rows.append({"name": g["name"], "MB": g["MB"], "count": g["count"], "base_us": g["share_us"],
                     "other_us": o and o["share_us"],
                     "step_delta_us": (o["step_us"] - g["step_us"]) if o and o["step_us"] is not None
                     and g["step_us"] is not None else None})
    rows += [{"name": o["name"], "MB": o["MB"], "count": o["count"], "base_us": None, "other_us": o["share_us"],
              "step_delta_us": None} for o in theirs.values()]
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-2b", help="preset (random weights) or checkpoint folder")
    ap.add_argument("--ctx", type=int, default=8192, help="cached tokens of the decoding sequence")
    ap.add_argument("--steps", type=int, default=50, help="stamped replays to average")
    ap.add_argument("--page-size", type=int, default=16, help="the engine's KV page size")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VARIANT",
                    help=f"set a decode knob first (profiles.host_time's AB_KNOBS: {', '.join(sorted(AB_KNOBS))})")
    ap.add_argument("--out", default=None, help="write step_stamps.json into this folder (default profiles/results)")
    ap.add_argument("--compare", nargs=2, metavar=("BASE", "OTHER"), help="only print two step_stamps.json files' "
                                                                        "groups side by side (no GPU)")
    args = ap.parse_args(argv)
    if args.compare:
        base, other = (json.loads(Path(p).read_text()) for p in args.compare)
        rows = compare(base, other)
        print(f"graph {base['graph_ms']:.3f} ms ({' '.join(base['knobs']) or 'defaults'}) against "
              f"{other['graph_ms']:.3f} ms ({' '.join(other['knobs']) or 'defaults'}); per launch and a step:")
        print_table(rows, ["name", "MB", "count", "base_us", "other_us", "step_delta_us"])
        return {"compare": rows}
    if not torch.cuda.is_available():
        raise SystemExit("step_stamps reads the GPU's timer inside a CUDA graph: it needs CUDA")
    chosen = Variant()
    for knob in args.knob:
        name, _, variant = knob.partition("=")
        variants = knob_variants(name) if name in AB_KNOBS else {}
        if variant not in variants:
            raise SystemExit(f"--knob {knob}: expected NAME=VARIANT with NAME in AB_KNOBS and one of its variants")
        chosen = combined(chosen, variants[variant])
    args.decode = 1
    ops.set_backend("triton")
    model, what = load_model(args.model, torch.device("cuda")), describe_model(args.model)
    with running(chosen):
        found = run(model, args)
    print(f"{what}: a batch-1 decode step over {args.ctx}, graph {found['graph_ms']:.3f} ms (stamped "
          f"{found['stamped_graph_ms']:.3f}); {found['launches']} stamped launches spanning {found['span_us']:.1f} us "
          f"from the first go to the argmax's end ({found['between_us']:.1f} us a step outside them: the copies and "
          f"graph launch between steps); each group's share of the critical path over {args.steps} replays:")
    print_table(found["groups"], ["name", "MB", "count", "share_us", "min_us", "max_us", "step_us", "TBps", "lead_us",
                                  "busy_us"])
    path = write_result("step_stamps", {"environment": environment(), "model": args.model, "ctx": args.ctx,
                                        "page_size": args.page_size, "knobs": args.knob, **found}, args.out)
    print(f"wrote {path}")
    return found


if __name__ == "__main__":
    main()
