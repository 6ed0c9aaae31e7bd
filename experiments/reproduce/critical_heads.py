"""Critical heads in full precision: quantize the KV cache everywhere (int8 / int4 / int2) but
keep the (layer, kv head) units that matter in bf16 (`kv_keep` with `keep_units`), chosen by a
measured criterion on a calibration text (`kvjax.sensitivity`), against random choice.

Points: for the main base (int2), kept units chosen by "kl" (quantize only that unit) and
"kv_error" (the unit's stored k/v error) and at random (several seeds), over a sweep of kept
counts; for the other bases, "kl" and one random draw; streaming perplexity token by token and
the measured bytes per token of every cache.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from experiments.reproduce.common import Reproduction, int_list, kv_bytes_per_token, name_list, spec
from kvjax.results import atomic_write_text
from kvjax.tasks.perplexity import Perplexity

UNITS = 90  # 30 layers x 3 kv heads of the default model
CRITERIA = {"kl": "KL when only that unit is quantized",
            "kv_error": "relative error of the unit's stored k and v",
            "random": "random (seeded)"}


class CriticalHeads(Reproduction):
    name = "critical_heads"
    paper = ("The project's seed documents' recommendation (\"int8 everywhere, keep the heads "
             "that matter in FP16\"), in the line of mixed-precision KV caches that keep "
             "sensitive heads or layers at higher precision, e.g. KVTuner (Li et al., ICML "
             "2025, [KexuanZhang/KVTuner](https://github.com/KexuanZhang/KVTuner): layer-wise "
             "mixed precision chosen by measured sensitivity).")
    claim = ("A few kept heads recover most of the quantization loss for a small byte cost "
             "(issue #13). No paper number is attached to this claim in the issue; none is "
             "quoted.")
    short_claim = "a few full-precision kv heads recover most of the quantization loss cheaply"

    def add_arguments(self, parser):
        parser.add_argument("--length", type=int, default=256, help="perplexity tokens")
        parser.add_argument("--chunk", type=int, default=4,
                            help="tokens per forward (1: token by token)")
        parser.add_argument("--main", default="int2", help="base compared across criteria")
        parser.add_argument("--counts", type=int_list, default=(1, 2, 4, 8, 16),
                            help="kept units chosen by kl at the main base")
        parser.add_argument("--kv-error-counts", type=int_list, default=(4, 8, 16),
                            help="kept units chosen by kv_error at the main base")
        parser.add_argument("--random-counts", type=int_list, default=(4, 8, 16),
                            help="kept units drawn at random at the main base")
        parser.add_argument("--seeds", type=int_list, default=(0, 1, 2), help="random draws")
        parser.add_argument("--others", type=name_list, default=("int4", "int8"),
                            help="other bases: units ranked by the main base's kl, kept at "
                                 "--other-counts")
        parser.add_argument("--other-counts", type=int_list, default=(16,))
        parser.add_argument("--calib-prefix", type=int, default=256,
                            help="calibration tokens written into the cache")
        parser.add_argument("--calib-tokens", type=int, default=64,
                            help="calibration tokens scored after them (kl)")

    def quick_defaults(self):
        return {"length": 64, "chunk": 1, "counts": (), "kv_error_counts": (), "random_counts": (UNITS,),
                "seeds": (0,), "others": ()}

    # ------------------------------------------------------------------ selections

    def selections(self, args) -> list[tuple[str, str, str, int, int]]:
        """(label, base, criterion, seed, n kept) of every quantized point."""
        out = []
        for base in (args.main, *args.others):
            out.append((f"{base}/0", base, "none", 0, 0))
            main = base == args.main
            plan = ([("kl", 0, args.counts), ("kv_error", 0, args.kv_error_counts)]
                    + [("random", s, args.random_counts) for s in args.seeds] if main else
                    [("kl", 0, args.other_counts)])
            for crit, seed, counts in plan:
                for n in counts:
                    tag = f"random{seed}" if crit == "random" else crit
                    out.append((f"{base}/{tag}/{n}", base, crit, seed, n))
        return out

    def scores(self, args) -> dict:
        """Unit scores per (criterion, seed) at the main base on the calibration text (they
        rank the units for every base), computed once and kept beside the results store
        (critical_heads-scores.json) under their settings."""
        from kvjax.experiment import ModelSpec, load, model_config, model_identity
        from kvjax.formats import get_format
        from kvjax.sensitivity import unit_scores
        from kvjax.tasks.text import default_text, encode_prefix

        need = sorted({(args.main, c, s) for _, _, c, s, n in self.selections(args) if n})
        path = Path(args.results).parent / f"{self.name}-scores.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        calib = {"prefix": args.calib_prefix, "tokens": args.calib_tokens,
                 "model": model_identity(ModelSpec())["name"]}
        out, seconds = {}, 0.0
        for base, crit, seed in need:
            key = json.dumps({**calib, "base": base, "criterion": crit, "seed": seed},
                             sort_keys=True)
            if key not in saved or args.force:
                t = time.perf_counter()
                n_ids = args.calib_prefix + args.calib_tokens
                if crit == "random":  # no model or text needed
                    s = unit_scores(None, model_config(ModelSpec()), np.zeros(n_ids),
                                    get_format(base), crit, prefix=args.calib_prefix, seed=seed)
                else:
                    m = load(ModelSpec())
                    text = default_text()
                    ids = encode_prefix(m.tokenizer, text[len(text) // 2:], n_ids)
                    s = unit_scores(m.params, m.cfg, ids, get_format(base), crit,
                                    prefix=args.calib_prefix, seed=seed)
                saved[key] = {"scores": s.tolist(), "seconds": time.perf_counter() - t}
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, json.dumps(saved, indent=1))
                print(f"  scores {base}/{crit}/{seed}: {saved[key]['seconds']:.0f} s")
            out[(crit, seed)] = np.asarray(saved[key]["scores"])
            seconds += saved[key]["seconds"]
        self._seconds = seconds
        return out

    def points(self, args):
        from kvjax.sensitivity import top_units

        bases = (args.main, *args.others)
        bad = [b for b in bases if b not in ("int2", "int4", "int8")]
        n_max = max((*args.counts, *args.kv_error_counts, *args.random_counts,
                     *args.other_counts, 0))
        if bad or n_max > UNITS or not args.seeds:
            raise SystemExit(f"critical_heads: bases {bad} not among int2,int4,int8" if bad else
                             f"critical_heads: counts must be <= {UNITS} and --seeds non-empty")
        scores = self.scores(args)
        self._units = {}
        kw = {"name": self.name, "args": args}
        ppl = Perplexity(length=args.length, chunk=args.chunk)
        pts = [("f32", spec(ppl, **kw))]
        for label, base, crit, seed, n in self.selections(args):
            opts = ()
            if n:
                units = top_units(scores[(crit, seed)], n)
                self._units[label] = units
                opts = (("keep_units", units),)
            pts.append((label, spec(ppl, kv_dtype=base, kv_options=opts, **kw)))
        return pts

    def extra(self, args, done):
        return {"seconds": getattr(self, "_seconds", 0.0),
                "units": {k: [list(u) for u in v] for k, v in getattr(self, "_units", {}).items()}}

    # ------------------------------------------------------------------ shape and doc

    def check(self, done, extra):
        """The robust ends of the curve: int2 with nothing kept loses over 5 % against f32;
        keeping every unit in bf16 costs more bytes and gives f32's perplexity back (within
        1 %). (Whether a *few* units help is the measured claim, not a robust shape: on 64
        tokens keeping 16 units or half the layers of int2 was worse than keeping none.)"""
        f32 = done["f32"].metrics["perplexity"]
        every = f"int2/random0/{UNITS}"
        b0, b1 = (kv_bytes_per_token(done[k]) for k in ("int2/0", every))
        p0, p1 = (done[k].metrics["perplexity"] for k in ("int2/0", every))
        assert p0 > 1.05 * f32, f"int2 {p0:.3f} does not lose against f32 {f32:.3f}"
        assert b1 > b0, f"kept units cost no bytes: {b1} vs {b0}"
        assert abs(p1 / f32 - 1) < 0.01, f"every unit kept: {p1:.3f}, f32 {f32:.3f}"

    def curve(self, done, base, tag):
        """[(n, bytes per token, perplexity)] of one base and criterion tag, n = 0 first."""
        pts = [(0, done[f"{base}/0"])] + sorted(
            (int(k.split("/")[2]), d) for k, d in done.items()
            if k.startswith(f"{base}/{tag}/"))
        return [(n, kv_bytes_per_token(d), d.metrics["perplexity"]) for n, d in pts]

    def body(self, args, done, extra, img_dir):
        f32 = done["f32"].metrics["perplexity"]
        bases = (args.main, *args.others)
        setting = "\n".join([
            "## Setting",
            "",
            ("* Model: SmolLM2-135M-Instruct, 30 layers × 3 kv heads = 90 (layer, kv head) "
             "units. `kv_keep` granularity: `keep_layers` (all heads of a layer), `keep_heads` "
             "(a head in every layer) and, added for this sweep, `keep_units` ((layer, head) "
             "pairs, `kvjax.formats.MixedUnits`): each kept unit is stored in bf16 and has no "
             "quantized buffer, so the bytes are real."),
            (f"* Evaluation: streaming perplexity of the first {args.length} tokens of the "
             f"shipped CPython docs in chunks of {args.chunk} tokens (a token reads the "
             "quantized cache for everything before its chunk and exact keys/values inside it; "
             "token by token would cost about 4x the time on this shared machine, and the "
             "quantization losses below are those of this protocol); "
             f"{done['f32'].metrics['n_tokens'] - 1} tokens scored per row. Bases: the "
             "formats' defaults (int8 per token; int4 KIVI keys g 64, residual 64, values "
             "g 64; int2 KIVI keys g 32, residual 32, values g 32)."),
            (f"* Calibration: {args.calib_prefix} + {args.calib_tokens} tokens from the second "
             "half of the same shipped text (from character len/2 on), disjoint from the "
             "evaluation's first tokens. Criteria (`kvjax.sensitivity.unit_scores`): **kl** = "
             f"the mean KL(full ‖ quantized) over the {args.calib_tokens} continuation tokens "
             f"when only that unit's keys and values of the {args.calib_prefix}-token prefix "
             f"are stored in {args.main}; **kv_error** = ‖x̂ − x‖²/‖x‖² of the unit's "
             "stored keys plus values (no model call); **random** = seeded uniform scores "
             f"(seeds {', '.join(map(str, args.seeds))}). Units with the highest scores are "
             f"kept. The scores are computed at {args.main} and rank the units for every base "
             "(a kl pass per base costs 15 min on this loaded machine: 90 forwards of the "
             f"continuation). Computing them took {extra.get('seconds', 0):.0f} s."),
            (f"* Size: {len(done)} points (f32, each base with nothing kept, the counts "
             "above per criterion; not the full product), sized for about 12 min on an idle "
             "2-core machine; the run below shared the 2 cores with four other jobs."),
            ("* Bytes per token: measured from each record's k + v stores (codes, scales, "
             "residual, kept bf16 units) over the capacity; bf16 everywhere is 23040, f32 "
             "46080."),
        ])
        rows = ["## Results", "",
                ("| base | criterion | kept units | perplexity | loss recovered | bytes / token "
                "| + bytes vs none |"), "|---|---|---|---|---|---|---|",
                f"| f32 | — | all | {f32:.3f} | — | {kv_bytes_per_token(done['f32']):.0f} | — |"]
        verdicts = []
        for base in bases:
            p0 = done[f"{base}/0"].metrics["perplexity"]
            b0 = kv_bytes_per_token(done[f"{base}/0"])
            rows.append(f"| {base} | — | 0 | {p0:.3f} | 0 % | {b0:.0f} | 0 % |")
            for k, d in done.items():
                if not k.startswith(f"{base}/") or k == f"{base}/0":
                    continue
                _, tag, n = k.split("/")
                p, b = d.metrics["perplexity"], kv_bytes_per_token(d)
                rec = f"{100 * (p0 - p) / (p0 - f32):.0f} %" if p0 > f32 else "— (no loss)"
                rows.append(f"| {base} | {tag} | {n} | {p:.3f} | {rec} | {b:.0f} | "
                            f"{100 * (b / b0 - 1):+.0f} % |")
            verdicts.append(self.base_verdict(args, done, base, f32))
        rows += ["", ("Loss recovered = (perplexity with none kept − with n kept) / (with none "
                 "kept − f32). Kept units per row are in the W&B record (`kv_options`) and "
                 "listed below for the main base's kl choice.")]
        units = extra.get("units", {})
        kl_main = [k for k in units if k.startswith(f"{args.main}/kl/")]
        if kl_main:
            last = max(kl_main, key=lambda k: int(k.split("/")[2]))
            rows.append("")
            rows.append(f"`{last}` keeps (layer, kv head): "
                        + ", ".join(f"({a}, {b})" for a, b in units[last]) + ".")
        path = img_dir / f"{self.name}_bytes.png"
        fig = self.figure(args, done, f32)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        meaningful = [v for v in verdicts if v[0] is not None]
        ok = [v[0] for v in meaningful]
        word = ("reproduced" if ok and all(ok) else "partly" if any(ok) else "not reproduced")
        text = (f"**{word.capitalize()}.** Criterion: for a base whose quantization loss is "
                "above 0.5 % of f32's perplexity, a measured criterion (kl or kv_error) keeping "
                "at most 8 of the 90 units (≤ 9 %) recovers at least half of the loss for at "
                "most 25 % more bytes. " + " ".join(v[1] for v in verdicts))
        ours = "; ".join(v[2] for v in verdicts)
        return ("\n\n".join([setting, "\n".join(rows),
                             f"![perplexity vs bytes]({img_dir.name}/{path.name})",
                             "## Verdict\n\n" + text]), ours, word)

    def base_verdict(self, args, done, base, f32):
        """(claim holds? None when the base loses too little, sentence, one-line summary)."""
        p0 = done[f"{base}/0"].metrics["perplexity"]
        b0 = kv_bytes_per_token(done[f"{base}/0"])
        loss = p0 / f32 - 1
        if loss < 0.005:
            return (None, (f"{base}: its perplexity is {100 * loss:+.2f} % from f32 (no loss "
                           "above 0.5 % to recover in this protocol)."),
                    f"{base} {100 * loss:+.2f} % from f32")
        best = None
        for tag in ("kl", "kv_error"):
            for n, b, p in self.curve(done, base, tag)[1:]:
                rec, cost = (p0 - p) / (p0 - f32), b / b0 - 1
                if n <= 8 and cost <= 0.25 and (best is None or rec > best[2]):
                    best = (tag, n, rec, cost, p)
        rnd = {}
        for k, d in done.items():
            if k.startswith(f"{base}/random"):
                rnd.setdefault(int(k.split("/")[2]), []).append(d.metrics["perplexity"])
        cmp = []
        for n, ps in sorted(rnd.items()):
            got = [f"{tag} {done[f'{base}/{tag}/{n}'].metrics['perplexity']:.3f}"
                   for tag in ("kl", "kv_error") if f"{base}/{tag}/{n}" in done]
            if got:
                cmp.append(f"at {n} kept, {', '.join(got)} against random {np.mean(ps):.3f} "
                           f"(mean of {len(ps)}, range {min(ps):.3f}–{max(ps):.3f})")
        holds = best is not None and best[2] >= 0.5
        head = f"{base} (loss {100 * loss:.1f} %): "
        if best is None:
            sent = head + "no kept count within ≤ 8 units and ≤ 25 % bytes was measured."
        else:
            sent = (head + f"best {best[0]} with {best[1]} kept recovers {100 * best[2]:.0f} % "
                    f"of the loss for {100 * best[3]:+.0f} % bytes"
                    + (" — holds." if holds else " — does not reach half."))
        top = self.curve(done, base, "kl")[-1]
        if top[0] and (best is None or top[0] != best[1]):
            sent += (f" With {top[0]} kept ({100 * top[0] / UNITS:.0f} % of the units) kl "
                     f"recovers {100 * (p0 - top[2]) / (p0 - f32):.0f} % for "
                     f"{100 * (top[1] / b0 - 1):+.0f} % bytes.")
        if cmp:
            sent += " Against random: " + "; ".join(cmp) + "."
            for tag in ("kl", "kv_error"):
                wins = [n for n, ps in rnd.items() if f"{base}/{tag}/{n}" in done
                        and done[f"{base}/{tag}/{n}"].metrics["perplexity"] < min(ps)]
                tried = [n for n in rnd if f"{base}/{tag}/{n}" in done]
                if tried:
                    sent += (f" {tag} beats every random draw at {len(wins)} of {len(tried)} "
                             "counts.")
        summary = (f"{base}: {best[0]} {best[1]} kept recovers {100 * best[2]:.0f} % for "
                   f"{100 * best[3]:+.0f} % bytes" if best else f"{base}: —")
        return holds, sent, summary

    def figure(self, args, done, f32):
        bases = (args.main, *args.others)
        fig, axes = plt.subplots(1, len(bases), figsize=(4.6 * len(bases), 3.6), squeeze=False)
        styles = {"kl": ("o-", "tab:blue"), "kv_error": ("s-", "tab:green")}
        for ax, base in zip(axes[0], bases):
            for tag, (style, color) in styles.items():
                c = self.curve(done, base, tag)
                if len(c) > 1:
                    ax.plot([b for _, b, _ in c], [p for _, _, p in c], style, c=color,
                            label=CRITERIA[tag], ms=4)
            for k, d in done.items():
                if k.startswith(f"{base}/random"):
                    ax.plot([kv_bytes_per_token(d)], [d.metrics["perplexity"]], "x",
                            c="tab:red", label="random" if "random" not in
                            ax.get_legend_handles_labels()[1] else None)
            ax.axhline(f32, ls=":", c="k", label="f32")
            ax.set_title(f"{base} + kept bf16 units")
            ax.set_xlabel("measured KV bytes per token")
            ax.set_ylabel(f"perplexity (chunks of {args.chunk})")
            ax.legend(fontsize=6)
        fig.tight_layout()
        return fig


REPRODUCTION = CriticalHeads()
