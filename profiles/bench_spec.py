"""What MTP speculation's steps cost on the GPU, each replayed from a CUDA graph at batch 1 over a ctx-token context:
a plain decode step, the verify step of K drafts (K+1 tokens, the GDN layers keeping every token's state), the MTP
head over n rows (the rows after acceptance: n = L + 1) with the lm_head and argmax at its last row, as the engine
runs it, and the rollback (a slot copy). Two A/Bs in one process: the head with the full vocabulary and with a
draft vocabulary of the first --draft-vocab ids (EngineConfig.draft_vocab_size); the verify step with its 2-4 rows
on the skinny GEMM (the default) and on the Triton GEMV (KernelTuning.gemv_max_rows 1 and 4). From the faster, a
projection of tokens a second at acceptance length L:
    L / (verify(K) + head(L + 1 rows) + (K - 1) head(1 row) + rollback)   against   1 / decode
labelled as a projection (the engine replays the whole step as one graph; `profiles.bench_serving
--forced-acceptance` measures it end to end). RANDOM weights (a preset).

    python -m profiles.bench_spec --model qwen3.5-2b --ctx 8192 --draft-vocab 32768
"""
import argparse
import dataclasses

import torch

from kernels import registry
from kernels.row_buckets import decode_step_rows
from model import ops
from model.cache import CachePools
from model.load import describe_model, load_model
from model.step import StepInput
from profiles.common import bench_us, environment, print_table, progress, write_result
from serving.config import MAX_SPECULATIVE_TOKENS

PUBLISHED_L = 3.78  # mean acceptance length of Qwen3-Next's MTP at 3 draft steps (SGLang PR #27353)
PAGE = 16


def step_at(ctx: int, q: int, pages: int, dev, position_slots: bool) -> StepInput:
    """One sequence's q new tokens after ctx cached ones (state slot 0; per-token states to slots 1..q-1)."""
    positions = torch.arange(ctx, ctx + q, device=dev)
    return StepInput(token_ids=torch.randint(1000, (q,), device=dev), positions=positions,
                     cu_seqlens=torch.tensor([0, q], dtype=torch.int32, device=dev), max_seqlen_q=q,
                     cu_seqlens_host=(0, q), max_seqlen_k=ctx + q,
                     seqused_k=torch.tensor([ctx + q], dtype=torch.int32, device=dev),
                     page_table=torch.arange(pages, dtype=torch.int32, device=dev)[None],
                     slot_mapping=positions.clone(),
                     state_slots=torch.zeros(1, dtype=torch.int64, device=dev),
                     position_slots=torch.tensor(list(range(1, q)) + [-1], device=dev) if position_slots else None)


def project(k: int, length: float, verify: float, heads: dict[int, float], rollback: float, decode: float) -> dict:
    """A speculative step of K drafts keeping `length` tokens on average (rounded for the head's rows: the L + 1 rows
    after acceptance, then K - 1 chained rows), and the rollback unless every draft is kept."""
    n = round(length)
    step_us = verify + heads[n + 1] + (k - 1) * heads[1] + (rollback if n < k + 1 else 0.0)
    return dict(K=k, L=length, step_us=step_us, tok_s=1e6 * length / step_us, vs_plain=length * decode / step_us)


def graph_us(fn) -> float:
    """fn's median time replayed from a CUDA graph (captured after a warm-up, which compiles its kernels)."""
    fn()
    torch.cuda.synchronize()
    return bench_us(fn, graph=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m profiles.bench_spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-2b", help="a preset (random weights) or a checkpoint with mtp.*")
    ap.add_argument("--ctx", type=int, default=8192, help="cached tokens before the step")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="the reduced draft vocabulary timed beside the "
                    "full one (the first N token ids)")
    ap.add_argument("--verify", default="skinny GEMM,GEMV", help="the verify step's row kernels timed, "
                    "comma-separated")
    ap.add_argument("--out", default=None, help="where spec.json goes (default profiles/results)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    ops.set_backend("triton")
    model = load_model(args.model, dev)
    k_max = MAX_SPECULATIVE_TOKENS
    pages = -(-(args.ctx + k_max + 3) // PAGE)
    pools = CachePools.allocate(model.cache_config, pages, PAGE, k_max + 2, model.lm_head.weight.dtype, dev,
                                model.config.mtp_num_hidden_layers)
    for t in (pools.k_pages, pools.v_pages, pools.conv_states):
        t.normal_()
    pools.recurrent_states.normal_(0, 0.05)
    hidden = torch.randn(k_max + 2, model.config.hidden_size, device=dev, dtype=model.lm_head.weight.dtype)

    def trunk(q: int, per_position: bool):
        step = step_at(args.ctx, q, pages, dev, per_position)
        def run():
            with decode_step_rows():
                return ops.argmax(model.forward_step(step, pools, all_logits=True))
        return run

    def head(rows: int, vocab: int | None):
        step = step_at(args.ctx, rows, pages, dev, False)
        last = torch.tensor([rows - 1], device=dev)
        def run():
            with decode_step_rows():
                logits, _ = model.forward_mtp(step, hidden[:rows], pools, logit_rows=last, vocab=vocab)
                return ops.argmax(logits)
        return run

    decode = graph_us(trunk(1, False))
    rows = [progress(dict(what="plain decode step", tokens=1, us=decode))]
    vocabs = {"full vocab": None, f"first {args.draft_vocab} ids": args.draft_vocab}
    heads = {name: {n: graph_us(head(n, v)) for n in range(1, k_max + 3)} for name, v in vocabs.items()}
    rows += [progress(dict(what=f"MTP head rows, {name}", tokens=n, us=t, vs_decode=t / decode))
             for name, times in heads.items() for n, t in times.items()]
    rollback = graph_us(lambda: pools.copy_slot(1, 0))
    rows.append(progress(dict(what="rollback (slot copy)", tokens=0, us=rollback)))
    projections = []
    verify_rows = {"skinny GEMM": registry.tuning(), "GEMV": dataclasses.replace(registry.tuning(), gemv_max_rows=4)}
    verify_rows = {name: verify_rows[name] for name in args.verify.split(",")}
    for k in range(1, k_max + 1):
        times = {}
        for name, tuning in verify_rows.items():
            with registry.use(tuning=tuning):
                times[name] = graph_us(trunk(k + 1, True))
            rows.append(progress(dict(what=f"verify step, K={k}, rows on the {name}", tokens=k + 1, us=times[name],
                                      vs_decode=times[name] / decode)))
        verify = min(times.values())
        for name, times in heads.items():
            for length in sorted({1.0, 2.0, 3.0, float(k + 1)} | ({PUBLISHED_L} if k == 3 else set())):
                if length <= k + 1:
                    projections.append(dict(draft=name, **project(k, length, verify, times, rollback, decode)))
    print_table(rows, ["what", "tokens", "us", "vs_decode"])
    for name, times in heads.items():
        print(f"draft row, {name}: {times[1]:.1f} us = {times[1] / decode:.1%} of a plain decode step")
    print("\nPROJECTION (the pieces' graphs added up):")
    print_table(projections, ["draft", "K", "L", "step_us", "tok_s", "vs_plain"])
    payload = dict(what="MTP speculation's step costs, batch 1, CUDA graphs; projected tok/s at acceptance length L "
                        "(a projection)", model=describe_model(args.model), ctx=args.ctx,
                   environment=environment(), steps=rows, projection=projections,
                   plain_decode_tok_s=1e6 / decode,
                   draft_row_vs_decode={name: times[1] / decode for name, times in heads.items()})
    write_result("spec", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
