"""Scores over the vocabulary on XLA:CPU: the head matmul alone, and with what the tasks compute
from its logits, as `jax.nn.log_softmax` + indexing / a summed KL (before) and as
`kvjax.model.token_nll` / `kl_divergence` (now), interleaved in one process.

    python -m experiments.bench_vocab_scores [--tokens 1 16 128] [--rounds 9] [--out FILE.md]

SmolLM2-135M's head shape (d_model 576, vocabulary 49152, the embedding a jit argument as in
the model), random values, f32. Each variant is one jitted program per token count T (the
perplexity task's chunk is T = 128); the table gives the median milliseconds of `--rounds`
interleaved rounds and each variant's time over the head matmul's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax.model import kl_divergence, log_probs, token_nll

D, V = 576, 49152


def head(x, emb):
    return jnp.einsum("BTD,VD->BTV", x, emb)


def old_nll(x, emb, tg):
    lp = jax.nn.log_softmax(head(x, emb), axis=-1)
    return -jnp.take_along_axis(lp, tg[..., None], axis=-1)[..., 0]


def new_nll(x, emb, tg):
    return token_nll(head(x, emb), tg)


def old_agreement(x, x2, emb, tg):
    lg, rg = head(x, emb), head(x2, emb)
    lp, lr = jax.nn.log_softmax(lg, axis=-1), jax.nn.log_softmax(rg, axis=-1)
    kl = jnp.sum(jnp.exp(lr) * (lr - lp), axis=-1)
    take = lambda a: -jnp.take_along_axis(a, tg[..., None], axis=-1)[..., 0]
    return kl, jnp.argmax(lg, -1) == jnp.argmax(rg, -1), take(lp), take(lr)


def new_agreement(x, x2, emb, tg):
    lg, rg = head(x, emb), head(x2, emb)
    lp, lr = log_probs(lg), log_probs(rg)
    take = lambda a: -jnp.take_along_axis(a, tg[..., None], axis=-1)[..., 0]
    return kl_divergence(lr, lp), jnp.argmax(lg, -1) == jnp.argmax(rg, -1), take(lp), take(lr)


def two_heads(x, x2, emb, tg):
    return head(x, emb), head(x2, emb)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    if min(a.tokens) < 1 or a.rounds < 1:
        ap.error(f"--tokens and --rounds must be >= 1, got --tokens "
                 f"{' '.join(map(str, a.tokens))} --rounds {a.rounds}")
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    emb = jax.random.normal(k[0], (V, D)) * 0.05
    rows = []
    for T in a.tokens:
        x = jax.random.normal(k[1], (1, T, D))
        x2 = x + 0.01 * jax.random.normal(k[2], x.shape)
        tg = jax.random.randint(k[3], (1, T), 0, V)
        one = {"head matmul": (head, (x, emb)),
               "head + log_softmax, target entry (before)": (old_nll, (x, emb, tg)),
               "head + token_nll (now)": (new_nll, (x, emb, tg))}
        two = {"two head matmuls": (two_heads, (x, x2, emb, tg)),
               "agreement: KL summed, log_softmax (before)": (old_agreement, (x, x2, emb, tg)),
               "agreement: log_probs, kl_divergence (now)": (new_agreement, (x, x2, emb, tg))}
        for group in (one, two):
            fns = {n: (jax.jit(f), args) for n, (f, args) in group.items()}
            outs = {n: f(*args) for n, (f, args) in fns.items()}  # compile
            jax.block_until_ready(outs)
            times = {n: [] for n in fns}
            for _ in range(a.rounds):
                for n, (f, args) in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    times[n].append(time.perf_counter() - t)
            base = statistics.median(times[next(iter(fns))])
            for n, ts in times.items():
                med = statistics.median(ts)
                rows.append(f"| {T} | {n} | {med * 1e3:.1f} | {med / base:.2f}x |")
    table = "\n".join(["| T | program | ms | / the matmul(s) alone |", "|---:|---|---:|---:|",
                       *rows])
    head_line = (f"jax {jax.__version__}, {jax.devices()[0].platform}, [1, T, {D}] x "
                 f"[{V}, {D}], medians of {a.rounds} interleaved rounds")
    print(head_line)
    print(table)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(f"`python -m experiments.bench_vocab_scores`: {head_line}\n\n{table}\n")


if __name__ == "__main__":
    main()
