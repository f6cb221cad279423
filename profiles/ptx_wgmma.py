"""The QK^T wgmmas (both operands in shared memory) of two PTX files of the CuTe forward, compared statically.

    python -m profiles.ptx_wgmma A.ptx B.ptx      # e.g. the default config's PTX and hoisted_qk_desc's

For hoisted_qk_desc (fa4/cute/wgmma_desc.py builds QK^T's descriptors by hand), without a GPU. Each group of QK^T
wgmmas (one a k-block, up to the commit) of one file must have an equal group in the other (LLVM may lay the
loops out in another order), equal in
- the instructions (shape, types) and their scale-d, scale-a/b and transpose operands;
- the descriptor values: each descriptor register is evaluated along its definitions (adds, shifts, masks, the
  `mov.b64 {lo, hi}` packs) from the shared-memory base, the thread index and the K ring's stage (a register written
  in several places: loop-carried), at every base, thread (consumer warpgroup) and stage of SAMPLES;
- the accumulator's order: what reads the wgmma's register list (up to the next wgmma fence along the control flow:
  mask, softmax, P's conversion, the next PV) as a multiset of expression hashes with A<i> for the list's i-th
  register (accumulator_graph). A permuted accumulator struct gives the softmax other columns and changes it; so
  does a swap of two adjacent columns (checked by mutation when this was written).
"""
import argparse
import collections
import hashlib
import re
import sys

SAMPLES = dict(base=(0, 1024, 0x8000), tid=(128, 256), stage=(0, 1, 2))  # 1024-aligned bases, warpgroups 1, 2
COMMENT = re.compile(r"//.*")
INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s*(.*?);\s*$")
WGMMA_SS = re.compile(r"wgmma\.mma_async\.[\w.]+\s+\{([^}]*)\},\s*(%rd\d+),\s*(%rd\d+),\s*p,\s*(.*)$")
SETP_P = re.compile(r"setp\.ne\.b32\s+p,\s*(%r\d+|-?\d+),\s*0")
REG = re.compile(r"%[a-z]+\d+")
LABEL = re.compile(r"\$L__\w+")


def split_operands(text: str) -> list[str]:
    """Top-level operands: `{%r1, %r2}` stays one operand."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()] if cur.strip() else parts


def parse(ptx: str) -> list[tuple[int, str, list[str], str]]:
    """(line number, opcode, operands, text) of each instruction; a block label as opcode "label"."""
    out = []
    for n, line in enumerate(ptx.splitlines()):
        text = COMMENT.sub("", line).strip()
        m = INSTR.match(text)
        if m:
            out.append((n, m.group(1), split_operands(m.group(2)), text))
        elif re.fullmatch(r"\$L__\w+:", text):
            out.append((n, "label", [text[:-1]], text))
    return out


def reachable(instrs, start: int) -> list[int]:
    """The instructions reachable from `start` along the control flow up to a wgmma fence, each once: depth first,
    a conditional branch's fall-through before its target (the inline-asm waits' own local branches fall through)."""
    labels = {ops[0]: k for k, (_, op, ops, _) in enumerate(instrs) if op == "label"}
    order, seen, stack = [], set(), [start]
    while stack:
        k = stack.pop()
        while k < len(instrs) and k not in seen:
            _, op, ops, text = instrs[k]
            if op.startswith("wgmma.fence") or op in ("ret", "exit"):
                break
            seen.add(k)
            order.append(k)
            if op.startswith("bra") and ops[0] in labels:
                if not text.startswith("@"):
                    k = labels[ops[0]]
                    continue
                stack.append(labels[ops[0]])
            k += 1
    return order


class Evaluator:
    """Integer values of registers along their definitions (straight-line: adds, shifts, masks, moves, packs)."""

    def __init__(self, instrs):
        self.defs = {}
        for instr in instrs:
            _, op, ops, _ = instr
            if not ops or op.startswith(("st.", "wgmma", "bar", "mbarrier", "setp", "bra", "cp.", "fence")):
                continue
            for reg in REG.findall(ops[0]):
                self.defs.setdefault(reg, []).append(instr)

    def value(self, token: str, env: dict, reached: set) -> int:
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        if re.fullmatch(r"0[xX][0-9a-fA-F]+", token):
            return int(token, 16)
        if token == "%tid.x":
            return env["tid"]
        if token.startswith("__dynamic_shmem"):
            return env["base"]
        defs = self.defs.get(token)
        if not defs:
            raise ValueError(f"no definition of {token}")
        if len(defs) > 1:  # written in several places: the loop-carried stage
            reached.add(token)
            return env["stage"]
        return self.evaluate(defs[0], token, env, reached)

    def evaluate(self, instr, reg: str, env: dict, reached: set) -> int:
        _, op, ops, text = instr
        width = 64 if re.search(r"\.[bsu]64\b", op) and not op.startswith("cvt.u32") else 32
        mask = (1 << width) - 1

        def v(i):
            return self.value(ops[i], env, reached)
        kind = op.split(".")[0]
        if kind == "mov" and ops[1].startswith("{"):  # pack {lo, hi}
            lo, hi = (self.value(t.strip(), env, reached) for t in ops[1].strip("{}").split(","))
            return (lo & 0xFFFFFFFF) | (hi & 0xFFFFFFFF) << 32
        if kind == "mov" and ops[0].startswith("{"):  # unpack
            regs = [t.strip() for t in ops[0].strip("{}").split(",")]
            return (v(1) >> (32 * regs.index(reg))) & 0xFFFFFFFF
        results = {
            "mov": lambda: v(1), "shfl": lambda: v(1), "cvt": lambda: v(1) & 0xFFFFFFFF,
            "add": lambda: v(1) + v(2), "sub": lambda: v(1) - v(2), "shl": lambda: v(1) << v(2),
            "shr": lambda: (v(1) & mask) >> v(2), "and": lambda: v(1) & v(2), "or": lambda: v(1) | v(2),
            "xor": lambda: v(1) ^ v(2), "mul": lambda: v(1) * v(2), "mad": lambda: v(1) * v(2) + v(3),
        }
        if kind not in results:
            raise ValueError(f"cannot evaluate {text!r}")
        return results[kind]() & mask


def qk_groups(instrs) -> list[dict]:
    """The QK^T wgmma groups: per group its wgmmas (shape, descriptor registers, scale-d token, other operands,
    accumulator registers) and the index of its first and last instruction."""
    groups, cur, setp = [], [], None
    for k, (_, op, _, text) in enumerate(instrs):
        m = SETP_P.search(text)
        if m:
            setp = m.group(1)
        m = WGMMA_SS.search(text)
        if m:
            acc = [r.strip() for r in m.group(1).split(",")]
            cur.append(dict(k=k, shape=op, a=m.group(2), b=m.group(3), scale_d=setp, rest=m.group(4).replace(" ", ""),
                            acc=acc))
        elif op.startswith("wgmma.commit_group") and cur:
            groups.append(cur)
            cur = []
    return groups


def same_bits(op: str, operand: str) -> tuple[str, str]:
    """One spelling of a 32-bit move or select: `selp.b32 ..., -8388608` as `selp.f32 ..., 0fFF800000` (LLVM types
    the select by the accumulator's struct, i32, or by the fragment, f32)."""
    if not re.fullmatch(r"(selp|mov)\.[bf]32", op):
        return op, operand
    if re.fullmatch(r"-?\d+", operand):
        operand = f"0f{int(operand) & 0xFFFFFFFF:08X}"
    return op[:-3] + "f32", operand


def accumulator_graph(instrs, start: int, acc: list[str]) -> collections.Counter:
    """What reads the accumulator registers `acc` from instruction `start` up to the next wgmma fence along the
    control flow: every value computed from them as a hash of its expression (A<i> for acc[i], X for a register not
    computed from them, immediates as spelled), counted. Independent of the instructions' order and of register
    numbers."""
    values = {r: f"A{i}" for i, r in enumerate(acc)}
    graph = collections.Counter()
    for k in reachable(instrs, start):
        _, op, ops, text = instrs[k]
        regs = REG.findall(text)
        if not any(r in values for r in regs):
            for r in REG.findall(ops[0]) if ops else ():
                values.pop(r, None)  # overwritten by a value not computed from the accumulator
            continue
        written = REG.findall(ops[0]) if ops and not op.startswith("st.") else []
        read = [same_bits(op, o) for o in ops[len(written) > 0:]]
        key = (read[0][0] if read else op) + "(" + ",".join(
            REG.sub(lambda m: values.get(m.group(0), "X"), o) for _, o in read) + ")"
        if op.startswith("wgmma"):  # in-out accumulator list: its registers are read too
            key += "[" + ",".join(values.get(r, "X") for r in written) + "]"
        digest = hashlib.sha1(LABEL.sub("L", key).encode()).hexdigest()[:16]
        graph[digest] += 1
        for i, r in enumerate(written):
            values[r] = f"{digest}.{i}"
    return graph


def samples() -> list[dict]:
    return [dict(base=b, tid=t, stage=s) for b in SAMPLES["base"] for t in SAMPLES["tid"] for s in SAMPLES["stage"]]


def group_record(ev: Evaluator, instrs, group: list[dict]) -> dict:
    """What is compared of one QK^T group: per wgmma its instruction, other operands, scale-d, both descriptors'
    values at every sample and how many loop-carried registers they read; the accumulator list's constancy and what
    reads it (accumulator_graph)."""
    wgmmas = []
    for w in group:
        row = dict(shape=w["shape"], rest=w["rest"], scale_d=int(w["scale_d"]) if w["scale_d"].lstrip("-").isdigit()
                   else ev.value(w["scale_d"], {}, set()), acc_size=len(w["acc"]))
        for operand in "ab":
            carried = set()
            row[operand] = tuple(ev.value(w[operand], env, carried) for env in samples())
            row[operand + "_carried"] = len(carried)
        wgmmas.append(row)
    return dict(wgmmas=wgmmas, same_acc=all(w["acc"] == group[0]["acc"] for w in group),
                graph=accumulator_graph(instrs, group[-1]["k"] + 1, group[0]["acc"]))


def compare(ptx_a: str, ptx_b: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Differences between the QK^T wgmma groups of two PTX files ([] when every group of each has an equal one in
    the other: LLVM may lay the loops out in another order) and the matched pairs (index in a, index in b)."""
    records = []
    for ptx in (ptx_a, ptx_b):
        instrs = parse(ptx)
        ev = Evaluator(instrs)
        records.append([group_record(ev, instrs, g) for g in qk_groups(instrs)])
    problems, pairs, free = [], [], list(range(len(records[1])))
    if len(records[0]) != len(records[1]):
        problems.append(f"{len(records[0])} QK^T groups against {len(records[1])}")
    for i, rec in enumerate(records[0]):
        if not rec["same_acc"] or any(w["b_carried"] > 1 or w["a_carried"] > 1 for w in rec["wgmmas"]):
            problems.append(f"a's group {i}: accumulator list changes inside it, or a descriptor reads several "
                            "loop-carried registers")
        match = next((j for j in free if records[1][j] == rec), None)
        if match is None:
            j = i if i < len(records[1]) else free[0] if free else None
            problems.append(f"a's group {i} has no equal in b" + ("" if j is None else f"; b's group {j} differs in "
                            + ", ".join(explain(rec, records[1][j]))))
            continue
        free.remove(match)
        pairs.append((i, match))
    return problems, pairs


def explain(a: dict, b: dict) -> list[str]:
    """Which parts of two group records differ."""
    out = [f"k-block {k} {key}" for k, (wa, wb) in enumerate(zip(a["wgmmas"], b["wgmmas"])) for key in wa
           if wa[key] != wb.get(key)]
    if len(a["wgmmas"]) != len(b["wgmmas"]):
        out.append(f"wgmmas {len(a['wgmmas'])} against {len(b['wgmmas'])}")
    if a["graph"] != b["graph"]:
        out.append(f"what reads the accumulator ({sum(a['graph'].values())} against {sum(b['graph'].values())} "
                   f"values, {len(a['graph'] - b['graph'])} of a's not in b)")
    return out or ["nothing?"]


def summary(ptx: str) -> list[dict]:
    """Per QK^T group: its wgmmas and each descriptor's value at stage 0 and 1 (base 0, warpgroup 1)."""
    instrs = parse(ptx)
    ev = Evaluator(instrs)
    rows = []
    for gi, group in enumerate(qk_groups(instrs)):
        for j, w in enumerate(group):
            values = {f"{op}{s}": ev.value(w[op], dict(base=0, tid=128, stage=s), set()) for op in "ab"
                      for s in (0, 1)}
            rows.append(dict(group=gi, k=j, acc=f"{w['acc'][0]}..{w['acc'][-1]} ({len(w['acc'])})", **values))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ptx", nargs=2)
    args = ap.parse_args(argv)
    texts = [open(p).read() for p in args.ptx]
    for path, text in zip(args.ptx, texts):
        print(path)
        for row in summary(text):
            print("  ", " ".join(f"{k}={v:#x}" if isinstance(v, int) and k[0] in "ab" else f"{k}={v}"
                                 for k, v in row.items()))
    problems, pairs = compare(*texts)
    print("groups matched (a, b):", pairs)
    print("\n".join(problems) if problems else "the QK^T wgmmas agree (descriptors, operands, accumulator order)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
