"""GQA (Ainslie et al., EMNLP 2023) and MQA (Shazeer 2019) on one real model: SmolLM2-135M
has 9 query heads and 3 kv heads (GQA-3).

Measured: (a) the model expanded to MHA-9 (each kv head repeated for its group: the same
logits at 3x the KV bytes); (b) the model reduced to MQA-1 by mean-pooling the key and value
projections, by keeping the first head of the group, and by random init
(`kvjax.convert.convert_kv_heads`); (c) each MQA-1 conversion uptrained with optax (AdamW,
linear warm-up + cosine decay, global-norm clipping; `kvjax.train`) through the same
`forward` on a part of the shipped text disjoint from the evaluation text, checkpointed with
orbax and reloaded for the evaluation. Held-out perplexity and KV bytes per token for every
variant, before and after uptraining, and the training curves.

The harness point is the original model's perplexity (the results store); the converted and
uptrained models are evaluated in `extra` (NAME-extra.json beside the store) with the same
`Perplexity` task code on the same text, because the harness loads models by name or path and
has no way yet to point at params made in-process. The original model is evaluated both ways,
and `body` checks that the two agree.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

from experiments.reproduce.common import Reproduction, spec
from kvjax.convert import convert_kv_heads
from kvjax.experiment import ModelSpec, load
from kvjax.formats import get_format
from kvjax.policies import get_policy
from kvjax.results import atomic_write_text
from kvjax.tasks.base import TaskContext
from kvjax.tasks.perplexity import Perplexity
from kvjax.tasks.text import default_text
from kvjax.train import TrainConfig, restore_params, save_params, train

METHODS = ("mean", "first", "random")
SMOLLM2_PRETRAIN_TOKENS = 2e12  # SmolLM2-135M's pretraining tokens (its model card: 2T)


def train_text() -> str:
    """The uptraining text: the second half of the shipped text (the evaluation reads the
    first `length` tokens, a few thousand characters at most)."""
    text = default_text()
    return text[len(text) // 2:]


def perplexity(params, cfg, tokenizer, length: int, chunk: int) -> dict:
    """The harness's perplexity task (full f32 cache) on the first `length` tokens of the
    shipped text: (per-token NLL [length - 1], {perplexity, mean nll, tokens scored, the final
    cache's measured bytes})."""
    ctx = TaskContext(params, cfg, tokenizer, get_policy("full"), get_format("f32"), length,
                      default_text())
    res = Perplexity(length=length, chunk=chunk).run(ctx)
    n = res.metrics["n_tokens"]
    return res.arrays["nll"], {"perplexity": res.metrics["perplexity"], "nll": res.metrics["nll"],
            "n_tokens": n, "scored": n - 1, "kv_bytes": res.cache.kv_nbytes(),
            "cache_bytes": res.cache.nbytes(), "kv_bytes_per_token": res.cache.kv_nbytes() / n}


class GQA(Reproduction):
    name = "gqa"
    paper = ("Joshua Ainslie, James Lee-Thorp, Michiel de Jong, Yury Zemlyanskiy, Federico "
             "Lebrón, Sumit Sanghai. *GQA: Training Generalized Multi-Query Transformer Models "
             "from Multi-Head Checkpoints.* EMNLP 2023 ([arXiv:2305.13245]"
             "(https://arxiv.org/abs/2305.13245)); Noam Shazeer. *Fast Transformer Decoding: "
             "One Write-Head is All You Need.* 2019 ([arXiv:1911.02150]"
             "(https://arxiv.org/abs/1911.02150)).")
    claim = (
        "Abstract: \"a recipe for uptraining existing multi-head language model checkpoints "
        "into models with MQA using 5% of original pre-training compute\"; \"uptrained GQA "
        "achieves quality close to multi-head attention with comparable speed to MQA\". "
        "Section 3.3 / Figure 4 (T5-Large uptrained to MQA at α = 0.05): mean-pooling the key"
        " and value heads works best, then selecting the first head, then random "
        "initialization; Figure 5: MQA without uptraining is poor and recovers with a few % "
        "of uptraining. Table 1 (T5, 5 % uptraining; inference seconds per sample, average "
        "dev-set score): MHA-Large 0.37 s, 46.0; MHA-XXL 1.51 s, 47.2; MQA-XXL 0.24 s, 46.6; "
        "GQA-8-XXL 0.28 s, 47.1 (arXiv v3 PDF). Figures 4 and 5 print no values, so none of "
        "theirs are quoted.")
    short_claim = ("MHA→MQA: mean-pool > first head > random at conversion; ~5 % uptraining "
                   "recovers most of the gap (Fig. 4, 5)")

    def add_arguments(self, parser):
        parser.add_argument("--model", default="smollm2-135m", help="registered name or path")
        parser.add_argument("--length", type=int, default=1024, help="evaluation tokens")
        parser.add_argument("--chunk", type=int, default=256, help="evaluation tokens per forward")
        parser.add_argument("--steps", type=int, default=12, help="uptraining steps per model")
        parser.add_argument("--batch", type=int, default=4, help="sequences per step")
        parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
        parser.add_argument("--lr", type=float, default=1e-4, help="AdamW peak learning rate")
        parser.add_argument("--warmup", type=int, default=2, help="linear warm-up steps")

    def quick_defaults(self):
        return {"model": "tiny", "length": 128, "chunk": 64, "steps": 12, "batch": 8,
                "seq_len": 32, "lr": 3e-3, "warmup": 2}

    def points(self, args):
        if args.steps <= args.warmup:
            raise SystemExit(f"gqa: --steps={args.steps} must exceed --warmup={args.warmup}")
        task = Perplexity(length=args.length, chunk=args.chunk)
        return [("perplexity/original", spec(task, model=ModelSpec(args.model), name=self.name,
                                             args=args))]

    def extra(self, args, done):
        t0 = time.perf_counter()
        m = load(ModelSpec(args.model))
        cfg, tok = m.cfg, m.tokenizer
        ids = np.asarray(tok.encode(train_text()), np.int32)
        ev = lambda p, c: perplexity(p, c, tok, args.length, args.chunk)
        tc = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                         warmup=args.warmup)
        out = {"model": {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                         "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim},
               "train_text": f"default text, characters {len(default_text()) // 2} on",
               "train_tokens_available": len(ids), "train": vars(tc) | {"tokens": tc.tokens}}
        params = m.params
        K, H = cfg.n_kv_heads, cfg.n_heads
        variants = {f"MHA-{H}": convert_kv_heads(params, cfg, H), f"GQA-{K}": (params, cfg)}
        for meth in METHODS:
            variants[f"MQA-1 {meth}"] = convert_kv_heads(params, cfg, 1, meth,
                                                         key=jax.random.PRNGKey(0))
        out["before"], nll = {}, {}
        for name, (p, c) in variants.items():
            nll[name], out["before"][name] = ev(p, c)
            out["before"][name]["n_kv_heads"] = c.n_kv_heads
            print(f"  {name:<14} perplexity {out['before'][name]['perplexity']:.3f}")
        out["mha_max_nll_diff"] = float(np.max(np.abs(nll[f"MHA-{H}"] - nll[f"GQA-{K}"])))
        out["after"], out["curves"], out["roundtrip_exact"] = {}, {}, {}
        ckpt_root = Path(args.results).parent / "gqa-ckpt"
        settings = {"model": args.model, "length": args.length, "chunk": args.chunk,
                    "train": vars(tc)}
        resumed_s = 0.0
        for meth in METHODS:
            name, tag = f"MQA-1 {meth}", f"{'quick-' if args.quick else ''}mqa1-{meth}"
            saved = ckpt_root / f"{tag}.json"  # one uptraining's results: a killed run resumes
            if saved.is_file() and not args.force:
                entry = json.loads(saved.read_text())
                if entry["settings"] == json.loads(json.dumps(settings)):
                    for k in ("after", "curves", "roundtrip_exact"):
                        out[k][name] = entry[k]
                    resumed_s += entry["after"]["seconds"]
                    print(f"  {name:<14} uptrained: read back from {saved}")
                    continue
            t = time.perf_counter()
            p, c = variants[name]
            trained, curve = train(p, c, ids, tc, echo=print)
            path = save_params(ckpt_root / tag, trained)
            restored = restore_params(path, trained)
            out["roundtrip_exact"][name] = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(restored)))
            del trained
            out["after"][name] = ev(restored, c)[1] | {"n_kv_heads": 1,
                                                        "seconds": time.perf_counter() - t}
            del restored
            out["curves"][name] = curve
            atomic_write_text(saved, json.dumps({"settings": settings} | {
                k: out[k][name] for k in ("after", "curves", "roundtrip_exact")}))
            print(f"  {name:<14} uptrained: perplexity {out['after'][name]['perplexity']:.3f}")
        out["seconds"] = time.perf_counter() - t0 + resumed_s
        return out

    def check(self, done, extra):
        """MHA expansion: same logits, K-fold KV bytes; every uptraining lowers its training
        loss and its checkpoint round-trips. (The conversions' order is not asserted: `--quick`
        runs the random-init tiny model, whose kv heads carry nothing to lose.)"""
        before = extra["before"]
        mha, gqa = (next(n for n in before if n.startswith(p)) for p in ("MHA", "GQA"))
        diff = extra["mha_max_nll_diff"]
        assert diff < 1e-4, f"MHA expansion changed a token's NLL by {diff}"
        ratio = before[mha]["kv_bytes"] / before[gqa]["kv_bytes"]
        want = before[mha]["n_kv_heads"] / before[gqa]["n_kv_heads"]
        assert ratio == want, f"MHA/GQA KV bytes {ratio} != {want}"
        for name, curve in extra["curves"].items():
            loss = curve["loss"]
            assert np.mean(loss[-3:]) < loss[0], f"{name}: loss {loss[0]:.3f} -> {loss[-3:]}"
            assert extra["roundtrip_exact"][name], f"{name}: orbax round trip changed params"

    def body(self, args, done, extra, img_dir):
        before, after = extra["before"], extra["after"]
        names = list(before)
        gqa = next(n for n in names if n.startswith("GQA"))
        harness = done["perplexity/original"].metrics["perplexity"]
        tc, mc = extra["train"], extra["model"]
        fraction = tc["tokens"] / SMOLLM2_PRETRAIN_TOKENS
        setting = "\n".join([
            "## Setting and what differs",
            "",
            f"* Model: `{args.model}` ({mc['n_layers']} layers, {mc['n_heads']} query heads, "
            f"{mc['n_kv_heads']} kv heads of dim {mc['head_dim']}; f32 on CPU), a decoder-only "
            f"{gqa} model, not a T5 MHA checkpoint"
            + (" (the random-init tiny model of `--quick`: nothing to lose at conversion)"
               if args.model == "tiny" else "") + ". It is converted both ways: up to "
            f"{names[0]} (each kv head repeated for the query heads of its group) and down to "
            f"MQA-1 (the {mc['n_kv_heads']} kv heads merged: mean of the key/value projections, "
            "the first head's, or random N(0, s²) with s = the std of that layer's original "
            "projection). Only `wk`/`wv` change (`kvjax/convert.py`).",
            (f"* Evaluation: perplexity of the first {args.length} tokens of the shipped text "
            f"(`kvjax/data/python_docs.txt`), {args.length - 1} tokens scored, full f32 cache, "
            f"chunks of {args.chunk}. KV bytes are the measured `nbytes` of the k/v arrays of "
            "the cache after the text (`kv_nbytes`), divided by the tokens it holds."),
            (f"* Uptraining: {extra['train_text']} ({extra['train_tokens_available']} tokens; "
            "disjoint from the evaluation text, same domain), random windows; AdamW (weight decay "
            f"{tc['weight_decay']}), peak lr {tc['lr']:g} after {tc['warmup']} linear warm-up "
            f"steps, cosine decay to {tc['final_fraction']:g}× at step {tc['steps']}, global-"
            f"norm clipping at {tc['clip']:g}; {tc['steps']} steps × {tc['batch']} sequences × "
            f"{tc['seq_len']} tokens = {tc['tokens']} tokens per model, f32, all parameters "
            "trained, the loss through `kvjax.model.forward` on an empty full cache "
            "(`kvjax/train.py`). Each run is saved with orbax and the evaluation reads the "
            "checkpoint back (the round trip is exact: "
            f"{all(extra['roundtrip_exact'].values())})."),
            (f"* Budget: the paper uptrains with α = 5 % of the pretraining compute. SmolLM2-135M "
            f"was pretrained on ~2T tokens, so ours is {tc['tokens']} / 2e12 ≈ {fraction:.1e} "
            f"of it ({fraction / 0.05:.1e} of the paper's α): the conversions, the three "
            f"uptraining runs and every evaluation took {extra['seconds'] / 60:.1f} min on "
            "the shared 2-core machine (sized for ~12 min idle). The learning rate and "
            "schedule were set before the run, not tuned. There is "
            f"no {gqa} control uptrained on the same tokens (no time left in the budget), so "
            "part of any recovery may be adaptation to the text rather than repair of the "
            "merged heads."),
            (f"* The original model's perplexity through the harness (results store): "
            f"{harness:.4f}; the same model evaluated beside the conversions: "
            f"{before[gqa]['perplexity']:.4f}."),
            (f"* {names[0]} vs {gqa}: the largest per-token NLL "
            f"difference over the {args.length - 1} scored tokens is "
            f"{extra['mha_max_nll_diff']:.1e} nats (the attention einsums group the heads "
            "differently, so equality is guaranteed only up to float rounding; "
            "`tests/test_train.py` compares the logits)."),
        ])
        head = ("| model | kv heads | KV bytes / token (closed form 2·L·K·E·4) | KV bytes at "
                f"{before[gqa]['n_tokens']} tokens | perplexity at conversion | after "
                "uptraining | gap recovered |")
        rows = [head, "|" + "---|" * 7]
        g = before[gqa]["nll"]
        recovered = {}
        for n in names:
            b = before[n]
            closed = 2 * mc["n_layers"] * b["n_kv_heads"] * mc["head_dim"] * 4
            cells = [n, str(b["n_kv_heads"]), f"{b['kv_bytes_per_token']:.0f} ({closed})",
                     f"{b['kv_bytes']:,}", f"{b['perplexity']:.3f}"]
            if n in after:
                a = after[n]
                gap = b["nll"] - g
                recovered[n] = (b["nll"] - a["nll"]) / gap if gap > 0.01 else None
                cells += [f"{a['perplexity']:.3f}", "no gap (< 0.01 nats)"
                          if recovered[n] is None else f"{100 * recovered[n]:.0f} %"]
            else:
                cells += ["—", "—"]
            rows.append("| " + " | ".join(cells) + " |")
        rows.append("")
        rows.append("Gap recovered = (NLL at conversion − NLL after) / (NLL at conversion − NLL "
                    f"of {gqa}), NLL in nats per token. Uptraining seconds per model: "
                    + ", ".join(f"{n} {after[n]['seconds']:.1f}" for n in after) + ".")
        fig = self.figure(extra, before[gqa]["nll"])
        path = img_dir / f"{self.name}_uptraining.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        kvr = lambda n: before[n]["kv_bytes"] / before[gqa]["kv_bytes"]
        ppl = {m: before[f"MQA-1 {m}"]["perplexity"] for m in METHODS}
        order = sorted(METHODS, key=ppl.get)
        order_ok = order == list(METHODS)
        mean_best = order[0] == "mean"
        ppl_after = {m: after[f"MQA-1 {m}"]["perplexity"] for m in METHODS}
        order_after = sorted(METHODS, key=ppl_after.get)
        mean_rec = recovered["MQA-1 mean"] or 0.0
        most = mean_rec > 0.5
        word = "reproduced" if order_ok and most else "partly" if mean_best or most else (
            "not reproduced")
        ours = (f"at conversion {' < '.join(f'{m} {ppl[m]:.1f}' for m in order)} ({gqa} "
                f"{before[gqa]['perplexity']:.1f}); {tc['tokens']} tokens of uptraining recover "
                f"{100 * mean_rec:.0f} % of mean-pooling's gap")
        verdict = "\n".join([
            "## Verdict",
            "",
            f"**{word.capitalize()}.** At conversion the MQA-1 perplexities order "
            + " < ".join(f"{m} ({ppl[m]:.2f})" for m in order)
            + f" — the paper's order mean < first < random "
            f"{'holds' if order_ok else 'does not hold'} here (mean pooling is "
            f"{'the best' if mean_best else 'not the best'} of the three; first head "
            f"{'beats' if ppl['first'] < ppl['random'] else 'does not beat'} random init). "
            "After uptraining with the same budget each (the paper's Figure 4 compares the "
            "methods after uptraining): "
            + " < ".join(f"{m} ({ppl_after[m]:.2f})" for m in order_after)
            + f". After {tc['tokens']} tokens of "
            f"uptraining ({fraction:.1e} of pretraining, against the paper's 5 %), the mean-"
            f"pooled model recovers {100 * mean_rec:.0f} % of its NLL gap to {gqa} "
            f"({'most' if most else 'not most'} of it; the claim is about 5 % of pretraining "
            f"compute, {np.log10(0.05 / fraction):.0f} orders of magnitude more than this "
            f"budget). {names[0]} has the {gqa} model's per-token NLL (max difference "
            f"{extra['mha_max_nll_diff']:.1e} nats) at {kvr(names[0]):g}× its KV bytes; MQA-1 "
            f"holds {kvr('MQA-1 mean'):.3g}× {gqa}'s.",
        ])
        body = "\n\n".join([setting, "## Results\n\n" + "\n".join(rows),
                            f"![training curves]({img_dir.name}/{path.name})", verdict])
        return body, ours, word

    def figure(self, extra, gqa_nll):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, curve in extra["curves"].items():
            ax.plot(np.arange(1, len(curve["loss"]) + 1), curve["loss"], "-", label=name)
        ax.axhline(gqa_nll, ls=":", c="k", label="original model's held-out NLL")
        ax.set_xlabel("uptraining step")
        ax.set_ylabel("training loss (nats / token)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig


REPRODUCTION = GQA()
