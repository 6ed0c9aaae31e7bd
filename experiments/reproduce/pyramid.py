"""PyramidKV (Cai et al., 2024) and Ada-KV (Feng et al., 2024): at equal total cache bytes,
moving budget across layers (pyramid) or across the kv heads of a layer (Ada-KV) improves
retrieval at small budgets over one budget for every head of every layer.

Points: the full cache, then for each budget (mean slots per kv head and layer) in compress
mode with the question inside the prompt: SnapKV with one budget (`snapkv`), PyramidKV (a
`pyramid` of SnapKV layer groups), Ada-SnapKV (`adasnapkv`, SnapKV's scores with per-head
shares of a slot pool), and the same pair for H2O's accumulated attention (`h2o` against
`adakv`), on passkey and a needle grid. Every point's record carries the measured bytes of its
cache, so "equal bytes" is read from the records, not assumed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from experiments.reproduce.common import Done, Reproduction, float_list, int_list, spec, wilson
from kvjax.tasks.needle import Needle
from kvjax.tasks.passkey import Passkey

# label -> (description, policy, its options given the observation / recent window W, the
# label of the uniform policy it reallocates, or None for a uniform one)
POLICIES = {
    "snapkv": ("SnapKV, one budget", "snapkv", lambda w: (("window", w),), None),
    "pyramid": ("PyramidKV (SnapKV per layer group)", "pyramid",
                lambda w: (("mode", "compress"), ("inner", "snapkv"), ("window", w)), "snapkv"),
    "adasnapkv": ("Ada-SnapKV (per-head shares)", "adasnapkv", lambda w: (("window", w),),
                  "snapkv"),
    "snapkv-mean": ("SnapKV, one budget, heads averaged", "snapkv",
                    lambda w: (("window", w), ("per_head", False)), None),
    "h2o": ("H2O, one budget", "h2o",
            lambda w: (("mode", "compress"), ("window", w), ("n_sink", 0)), None),
    "adakv": ("Ada-KV on H2O's scores (per-head shares)", "adakv",
              lambda w: (("mode", "compress"), ("window", w)), "h2o"),
}


def correct(d: Done) -> list[dict]:
    """Per-sample rows (correct, depth, ...) of a retrieval point, from its run directory."""
    return json.loads((Path(d.record["run_dir"]) / "samples.json").read_text())


def tally(d: Done) -> tuple[int, int]:
    """(correct, samples) of a retrieval point, from its metrics (passkey: n_correct; needle:
    the grid's cells times the samples per cell)."""
    m = d.metrics
    if "n_correct" in m:
        return int(m["n_correct"]), int(m["n_samples"])
    cells = np.asarray(m["grid"]["accuracy"]) * m["n_samples"]
    return round(float(cells.sum())), int(cells.size * m["n_samples"])


def lost_digits(row: dict) -> bool:
    """A wrong answer whose first number is the key with digits missing (a proper
    subsequence of it, e.g. 865 for 86556): the selection kept only some digit tokens."""
    m = re.search(r"\d+", row["answer"])
    key = str(row["key"])
    if row["correct"] or m is None or m.group() == key:
        return False
    it = iter(key)
    return all(c in it for c in m.group())


def fmt_acc(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def compare(done: dict[str, Done], tasks, budgets, policies) -> list[dict]:
    """Each reallocating policy against its uniform one at each task and budget: the counts
    and whether the 95 % Wilson intervals separate (win / loss) or overlap (tie)."""
    out = []
    for t in tasks:
        for b in budgets:
            for lab in policies:
                uni = POLICIES[lab][3]
                if uni is None or uni not in policies:
                    continue
                (km, n), (ku, _) = tally(done[f"{t}/{b}/{lab}"]), tally(done[f"{t}/{b}/{uni}"])
                (lm, hm), (lu, hu) = wilson(km, n), wilson(ku, n)
                out.append({"task": t, "budget": b, "policy": lab, "uniform": uni, "k": km,
                            "k_uniform": ku, "n": n,
                            "result": "win" if lm > hu else "loss" if hm < lu else "tie"})
    return out


class Pyramid(Reproduction):
    name = "pyramid"
    paper = (
        "Zefan Cai, Yichi Zhang, Bofei Gao, Yuliang Liu, Tianyu Liu, Keming Lu, Wayne Xiong, Yue "
        "Dong, Baobao Chang, Junjie Hu, Wen Xiao. *PyramidKV: Dynamic KV Cache Compression "
        "based on Pyramidal Information Funneling.* 2024 ([arXiv:2406.02069](https://arxiv.org/"
        "abs/2406.02069)); Yuan Feng, Junlin Lv, Yukun Cao, Xike Xie, S. Kevin Zhou. *Ada-KV: "
        "Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM "
        "Inference.* NeurIPS 2025 ([arXiv:2407.11550](https://arxiv.org/abs/2407.11550), code "
        "[FFY0/AdaKV](https://github.com/FFY0/AdaKV)).")
    claim = (
        "PyramidKV (abstract): \"allocating more cache in lower layers and less in higher "
        "ones\"; on LongBench it \"matches the performance of models with a full KV cache while"
        " retaining only 12% of the KV cache\", \"where only 0.7% of the KV cache is "
        "maintained, PyramidKV surpasses other KV cache compression techniques, achieving up "
        "to a 20.5 absolute accuracy improvement on TREC\"; in Needle-in-a-Haystack \"retaining"
        " just 128 KV cache entries enables the LLAMA-3-70B model to achieve 100.0 Acc.\". "
        "Ada-KV (abstract): uniform per-head budgets ignore \"the unique attention patterns of"
        " each head\"; head-wise adaptive allocation, plugged into SnapKV and Pyramid, shows "
        "\"substantial quality improvements\" on 13 Ruler and 16 LongBench datasets, "
        "question-aware and question-agnostic. PyramidKV's Table 1 (LongBench average; full "
        "cache / SnapKV / H2O / StreamingLLM / PyramidKV): LLaMA-3-8B-Instruct at KV size 64 "
        "41.46 / 33.05 / 33.89 / 30.43 / 34.76, at 2048 41.46 / 41.35 / 39.35 / 37.82 / "
        "41.49; Mistral-7B-Instruct at 64 42.71 / 30.72 / 30.88 / 25.60 / 32.19. Its Figure 4"
        " (needle-in-a-haystack, LLaMA-3-70B-Instruct, 8k context, KV size 128): full cache "
        "100.0, PyramidKV 100.0, SnapKV 98.6, H2O 82.3 (read in a text extraction of the "
        "paper). Ada-KV's tables could not be read here (its repository shows them as "
        "images), so none of its numbers are quoted.")
    short_claim = ("at equal bytes, per-layer (PyramidKV) or per-head (Ada-KV) budgets beat "
                   "one uniform budget at small budgets (needle, LongBench, Ruler)")

    def add_arguments(self, parser):
        parser.add_argument("--budgets", type=int_list, default=(48, 96),
                            help="mean slots per kv head and layer (the uniform budget)")
        parser.add_argument("--window", type=int, default=16,
                            help="SnapKV's observation window / H2O's recent window")
        parser.add_argument("--passkey-length", type=int, default=512)
        parser.add_argument("--passkey-samples", type=int, default=20)
        parser.add_argument("--needle-lengths", type=int_list, default=(256,),
                            help="needle grid lengths (empty: no needle task)")
        parser.add_argument("--needle-depths", type=float_list, default=(0.25, 0.75))
        parser.add_argument("--needle-samples", type=int, default=20, help="samples per cell")
        parser.add_argument("--policies", type=lambda v: tuple(v.split(",")),
                            default=("snapkv", "pyramid", "adasnapkv", "snapkv-mean"),
                            help=f"among {','.join(POLICIES)}")

    def quick_defaults(self):
        return {"budgets": (48,), "passkey_length": 128, "passkey_samples": 2,
                "needle_lengths": (), "policies": ("snapkv", "pyramid", "adasnapkv")}

    def tasks(self, args):
        ts = [("passkey", Passkey(length=args.passkey_length, n_samples=args.passkey_samples))]
        if args.needle_lengths:
            ts.append(("needle", Needle(lengths=args.needle_lengths, depths=args.needle_depths,
                                        n_samples=args.needle_samples)))
        return ts

    def points(self, args):
        bad = [p for p in args.policies if p not in POLICIES]
        if bad or "snapkv" not in args.policies:
            raise SystemExit(f"pyramid: --policies {','.join(bad)} not among "
                             f"{','.join(POLICIES)}" if bad else
                             "pyramid: --policies must include snapkv (the uniform reference)")
        kw = {"name": self.name, "args": args}
        pts = []
        for tname, task in self.tasks(args):
            pts.append((f"{tname}/full", spec(task, **kw)))
            # uniform and per-head policies first: they share one prefill per task
            for lab in sorted(args.policies, key=lambda p: p == "pyramid"):
                _, pol, opts, _ = POLICIES[lab]
                for b in args.budgets:
                    pts.append((f"{tname}/{b}/{lab}", spec(task, policy=pol, budget=b,
                                                           policy_options=opts(args.window),
                                                           **kw)))
        return pts

    def check(self, done, extra):
        """The comparison is at equal bytes: at each task and budget every policy's measured
        k+v bytes equal the uniform cache's (a head pool adds only its owner byte per slot, at
        most 1/256 of them); and the full cache retrieves (the task is answerable at all)."""
        groups: dict[tuple[str, str], dict[str, dict]] = {}
        for label, d in done.items():
            t, b, *rest = label.split("/")
            if rest:
                groups.setdefault((t, b), {})[rest[0]] = d.record["cache"]
            else:
                k, n = tally(d)
                assert k >= 0.6 * n, f"{t}: the full cache retrieves only {k}/{n}"
        for (t, b), caches in groups.items():
            ref = caches["snapkv"]["kv_bytes"]
            for lab, c in caches.items():
                assert c["kv_bytes"] == ref, (f"{t} budget {b}: {lab} holds {c['kv_bytes']} k+v "
                                              f"bytes, uniform snapkv {ref}: not equal bytes")
                extra_bytes = c["total_bytes"] - caches["snapkv"]["total_bytes"]
                # a pool's owner: 1 byte per slot, against 2 · D · bytes >= 256 of k+v
                assert 0 <= extra_bytes <= ref / 256, (
                    f"{t} budget {b}: {lab} uses {extra_bytes} bytes more than uniform snapkv")

    def body(self, args, done, extra, img_dir):
        tasks = self.tasks(args)
        sections = [self.setting(args, tasks)]
        for tname, task in tasks:
            sections.append(self.task_table(args, done, tname, task))
        sections.append(self.lost_table(args, done, tasks))
        sections.append(self.bytes_table(args, done, tasks))
        fig = self.figure(args, done, tasks)
        path = img_dir / f"{self.name}_accuracy.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        sections.append(f"![accuracy vs budget]({img_dir.name}/{path.name})\n\nAccuracy with "
                        "95 % Wilson intervals; dotted: the full cache.")
        verdict, ours, word = self.verdict(args, done, tasks)
        sections.append(verdict)
        return "\n\n".join(sections), ours, word

    def setting(self, args, tasks) -> str:
        lines = [
            "## Setting and what differs",
            "",
            ("* Model: SmolLM2-135M-Instruct (f32, CPU): 30 layers, 9 query heads sharing **3 "
             "kv heads** (GQA), not Mistral-7B / LLaMA-3-8B/70B with 8 kv heads of 32 layers. "
             "Ada-KV reallocates among a layer's kv heads; with 3 there is little to move."),
            ("* Compress mode, question inside the prompt (kvpress's question-aware setting): "
             "the whole chat prompt (filler or prose, the planted number, the question and "
             "\"The pass key is\" / \"The special magic number is\") is prefilled, each policy "
             "selects its budget once, then the answer is decoded greedily into the grown "
             "cache."),
            (f"* Budget b = mean slots per kv head and layer (the uniform cache's size); every "
             f"policy protects the last {args.window} prompt tokens (SnapKV's observation "
             "window, H2O's recent window). PyramidKV: `pyramid inner=snapkv`, 4 layer groups "
             "with budgets falling linearly 4:1 from the first to the last group and summing "
             "to 30 · b slots (kvjax's default; the paper tapers layer by layer). Ada-SnapKV / "
             "Ada-KV: a pool of 3 · b slots per layer, shares ranked over the heads with the "
             "paper's safeguard (each head keeps its own best 20 % first). SnapKV selects per "
             "kv head (the papers' setting); \"heads averaged\" (`snapkv per_head=false`, one "
             "set of positions per layer) is a reference that reallocates nothing."),
        ]
        for tname, task in tasks:
            if tname == "passkey":
                lines.append(f"* passkey: {task.length}-token prompts, a {task.digits}-digit key at "
                             f"depth {task.depth} of repetitive filler, n = {task.n_samples} "
                             "seeded samples per point.")
            else:
                lines.append(f"* needle: prose haystack (the shipped CPython docs), a "
                             f"{task.digits}-digit number at depths "
                             f"{', '.join(map(str, task.depths))} of "
                             f"{', '.join(map(str, task.lengths))}-token prompts, n = "
                             f"{task.n_samples} seeded samples per cell "
                             f"({task.n_samples * len(task.depths) * len(task.lengths)} per "
                             "point).")
        lines.append(f"* Size: {len(args.budgets)} budgets × {len(args.policies)} policies × "
                     f"{len(tasks)} tasks + the full cache, sized for a 2-core CPU shared with "
                     "other jobs (a prefill of 20 prompts of 512 tokens takes minutes here); the "
                     "policies but PyramidKV share one prefill per task (score once, select "
                     "many). A larger grid: `--budgets 48,64,96,128 --needle-lengths 256,512 "
                     "--needle-depths 0.1,0.5,0.9` (not run).")
        lines.append("* Accuracy: the greedy answer contains the number; intervals are 95 % "
                     "Wilson score intervals (`experiments.reproduce.common.wilson`).")
        return "\n".join(lines)

    def task_table(self, args, done, tname, task) -> str:
        names = [POLICIES[p][0] for p in args.policies]
        head = ["### " + tname, "", "| budget b | % of prompt | " + " | ".join(names) + " |",
                "|---|---|" + "---|" * len(names)]
        length = task.length if tname == "passkey" else max(task.lengths)
        for b in args.budgets:
            head.append(f"| {b} | {100 * b / length:.0f} % | " + " | ".join(
                fmt_acc(*tally(done[f"{tname}/{b}/{p}"])) for p in args.policies) + " |")
        head.append(f"| full ({length}) | 100 % | " + fmt_acc(*tally(done[f"{tname}/full"]))
                    + " |" * len(names))
        if tname == "needle":
            head += ["", "Per depth (all lengths; correct of n per cell × lengths):", "",
                     "| budget b | policy | " + " | ".join(f"depth {d}" for d in task.depths)
                     + " |", "|---|---|" + "---|" * len(task.depths)]
            for b in args.budgets:
                for p in args.policies:
                    rows = correct(done[f"{tname}/{b}/{p}"])
                    head.append(f"| {b} | {p} | " + " | ".join(
                        f"{sum(r['correct'] for r in rows if r['depth'] == d)}/"
                        f"{sum(r['depth'] == d for r in rows)}" for d in task.depths) + " |")
        return "\n".join(head)

    def lost_table(self, args, done, tasks) -> str:
        rows = ["### Wrong answers that are the number with digits missing", "",
                ("SmolLM2's digits are single tokens, so a selection can keep some of the "
                 "number's digit tokens and drop others: per kv head (a digit kept in one head, "
                 "dropped in another) or, heads averaged, in all heads at once. The answer then "
                 "comes out with digits missing (e.g. \"865\" for 86556). Count of such "
                 "answers among the wrong ones:"), "",
                "| task | budget b | " + " | ".join(args.policies) + " |",
                "|---|---|" + "---|" * len(args.policies)]
        for tname, _ in tasks:
            for b in args.budgets:
                cells = []
                for p in args.policies:
                    rs = correct(done[f"{tname}/{b}/{p}"])
                    cells.append(f"{sum(map(lost_digits, rs))} of "
                                 f"{sum(not r['correct'] for r in rs)}")
                rows.append(f"| {tname} | {b} | " + " | ".join(cells) + " |")
        return "\n".join(rows)

    def bytes_table(self, args, done, tasks) -> str:
        rows = ["### Measured cache bytes per sequence (from the records)", "",
                ("Each point's record measures its final cache (after the answer was decoded "
                 "into it, so b + new tokens slots per head on average): k+v bytes, and all "
                 "bytes (positions, a pool's owner byte per slot)."), "",
                "| task | budget b | " + " | ".join(args.policies) + " |",
                "|---|---|" + "---|" * len(args.policies)]
        for tname, _ in tasks:
            for b in args.budgets:
                cs = [done[f"{tname}/{b}/{p}"].record["cache"] for p in args.policies]
                rows.append(f"| {tname} | {b} | " + " | ".join(
                    f"{c['kv_bytes']:,} / {c['total_bytes']:,}" for c in cs) + " |")
        return "\n".join(rows)

    def verdict(self, args, done, tasks):
        cmp = compare(done, [t for t, _ in tasks], args.budgets, args.policies)
        wins = [c for c in cmp if c["result"] == "win"]
        losses = [c for c in cmp if c["result"] == "loss"]
        ahead = sum(c["k"] > c["k_uniform"] for c in cmp)
        behind = sum(c["k"] < c["k_uniform"] for c in cmp)
        small = min(args.budgets)
        realloc = sorted({c["policy"] for c in cmp})
        won = {c["policy"] for c in wins if c["budget"] == small}
        word = ("reproduced" if realloc and won == set(realloc) and not losses else
                "partly" if wins or ahead > behind else "not reproduced")

        def where(cs):
            return ", ".join(f"{c['policy']} {c['task']} b={c['budget']} ({c['k']} vs "
                             f"{c['k_uniform']} of {c['n']})" for c in cs) or "none"

        lines = ["## Verdict", "", (
            f"**{word.capitalize()}.** {len(cmp)} comparisons of a reallocating policy with its "
            f"uniform counterpart at equal k+v bytes (checked from the records above): the "
            f"95 % Wilson intervals separate in favour of reallocation in {len(wins)} "
            f"({where(wins)}) and against it in {len(losses)} ({where(losses)}); by point "
            f"estimate reallocation is ahead in {ahead}, behind in {behind}, level in "
            f"{len(cmp) - ahead - behind}. Reproduced would need every reallocating policy to "
            f"win at the smallest budget ({small}) on some task and to lose nowhere.")]
        if "snapkv-mean" in args.policies:
            pairs = [(tally(done[f"{t}/{b}/snapkv-mean"]), tally(done[f"{t}/{b}/snapkv"]), t, b)
                     for t, _ in tasks for b in args.budgets]
            lines.append("\n" + (
                "For context, one selection per layer with the heads' scores averaged (no "
                "reallocation; every head keeps the same positions) against per-head SnapKV: " + "; ".join(f"{t} b={b}: {km}/{n} vs {ku}/{n}"
                                       for (km, n), (ku, _), t, b in pairs) + "."))
        floor = [t for t, _ in tasks if all(
            tally(done[f"{t}/{b}/{p}"])[0] <= 0.1 * tally(done[f"{t}/{b}/{p}"])[1]
            for b in args.budgets for p in args.policies)]
        if floor:
            lines.append("\n" + (
                f"At these budgets {' and '.join(floor)} sits at the floor (every policy at "
                "most 10 %): there it can show neither a gain nor a loss, only that the budgets "
                "are too small for this model on that task."))
        ahead_at = [c for c in cmp if c["k"] > c["k_uniform"]]
        lines.append("\n" + (
            f"Where reallocation is ahead of its uniform counterpart by point estimate: "
            f"{where(ahead_at) if ahead_at else 'nowhere measured'}. With 3 kv heads per layer a "
            "head pool moves budget between only three heads (and the safeguard fixes 20 % of "
            "each head's share); the pyramid moves slots from the upper layers to the lower "
            "ones; whether the upper layers carry this model's retrieval was not measured."))
        ours = (f"{len(wins)} wins, {len(losses)} losses of {len(cmp)} (Wilson 95 %); "
                f"ahead {ahead}, behind {behind}")
        return "\n".join(lines), ours, word

    def figure(self, args, done, tasks):
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.6), squeeze=False)
        for ax, (tname, _) in zip(axes[0], tasks):
            for i, p in enumerate(args.policies):
                ks = [tally(done[f"{tname}/{b}/{p}"]) for b in args.budgets]
                y = np.array([k / n for k, n in ks])
                lo, hi = np.array([wilson(k, n) for k, n in ks]).T
                x = np.array(args.budgets) * (1 + 0.03 * (i - len(args.policies) / 2))
                ax.errorbar(x, y, yerr=[y - lo, hi - y], fmt="o-", capsize=2, label=p)
            k, n = tally(done[f"{tname}/full"])
            ax.axhline(k / n, ls=":", c="k", label="full cache")
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.budgets, [str(b) for b in args.budgets])
            ax.set_xlabel("budget b (mean slots per kv head and layer)")
            ax.set_ylabel("accuracy")
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(tname)
            ax.legend(fontsize=7)
        fig.tight_layout()
        return fig


REPRODUCTION = Pyramid()
