"""Training through the same decoder: the LM loss is `kvjax.model.forward` over a full cache.

There is no second model definition: `lm_loss` runs `forward` on an empty full-policy f32 cache
with room for the batch's tokens (causal attention within the chunk, exactly as prefill), and
`jax.grad` differentiates through it. `train_step` is one jitted optax update (AdamW, linear
warm-up + cosine decay, global-norm clipping: `uptrain_optimizer`); checkpoints are orbax
(`save_params` / `restore_params`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache import init_cache
from kvjax.config import ModelConfig
from kvjax.formats import get_format
from kvjax.model import forward
from kvjax.policies import get_policy


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer and schedule: AdamW at `lr` after `warmup` linear steps, cosine decay to
    `lr · final_fraction` at `steps`; gradients clipped to global norm `clip`."""

    steps: int = 100
    batch: int = 4
    seq_len: int = 128
    lr: float = 1e-4
    warmup: int = 10
    final_fraction: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for f in ("steps", "batch", "seq_len"):
            if getattr(self, f) <= 0:
                raise ValueError(f"TrainConfig.{f} must be positive, got {getattr(self, f)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"TrainConfig.warmup={self.warmup} must be in [0, steps={self.steps})")

    @property
    def tokens(self) -> int:
        """Tokens the run trains on (predicted targets): steps · batch · seq_len."""
        return self.steps * self.batch * self.seq_len


def empty_cache(cfg: ModelConfig, batch: int, seq_len: int):
    """The empty full-policy f32 cache a training forward attends over (T slots)."""
    return init_cache(cfg, batch, get_policy("full"), get_format("f32"), seq_len)


def lm_loss(params, tokens, cfg: ModelConfig, cache=None):
    """Mean next-token cross-entropy of tokens [B, T + 1] (inputs [:, :-1], targets [:, 1:]),
    through `forward` on an empty full f32 cache of T slots (`empty_cache`; passing it in
    keeps it out of the compiled program's constants)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, T]
    if cache is None:
        cache = empty_cache(cfg, *inputs.shape)
    logits, _ = forward(params, inputs, cache, cfg)  # [B, T, V]
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(lp, targets[..., None], axis=-1).mean()


def uptrain_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, tc.warmup, tc.steps, end_value=tc.lr * tc.final_fraction)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(schedule, weight_decay=tc.weight_decay))


@functools.partial(jax.jit, static_argnames=("cfg", "tc"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, tokens, cache, cfg: ModelConfig, tc: TrainConfig):
    """One optax update on tokens [B, T + 1]: (params, opt_state, loss, gradient global norm).
    Compiled once per (cfg, tc, shapes), so runs with the same settings share it."""
    loss, grads = jax.value_and_grad(lm_loss)(params, tokens, cfg, cache)
    updates, opt_state = uptrain_optimizer(tc).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)


def batches(ids: np.ndarray, tc: TrainConfig):
    """`tc.steps` batches [B, T + 1] of random windows of `ids` (seeded by tc.seed)."""
    n = len(ids) - tc.seq_len - 1
    if n <= 0:
        raise ValueError(f"{len(ids)} training tokens; seq_len={tc.seq_len} needs more than "
                         f"{tc.seq_len + 1}")
    rng = np.random.default_rng(tc.seed)
    for _ in range(tc.steps):
        starts = rng.integers(0, n + 1, tc.batch)
        yield np.stack([ids[s:s + tc.seq_len + 1] for s in starts]).astype(np.int32)


def train(params, cfg: ModelConfig, ids: np.ndarray, tc: TrainConfig, echo=None):
    """Uptrain `params` on random windows of `ids`; returns (params, {"loss": [...],
    "grad_norm": [...]} per step)."""
    params = jax.tree.map(jnp.array, params)  # own copies: the step donates them
    opt_state = uptrain_optimizer(tc).init(params)
    cache = empty_cache(cfg, tc.batch, tc.seq_len)
    curve = {"loss": [], "grad_norm": []}
    for i, batch in enumerate(batches(ids, tc)):
        params, opt_state, loss, gnorm = train_step(params, opt_state, jnp.asarray(batch), cache,
                                                     cfg, tc)
        curve["loss"].append(float(loss))
        curve["grad_norm"].append(float(gnorm))
        if echo is not None and (i % 10 == 0 or i == tc.steps - 1):
            echo(f"    step {i:4d}  loss {curve['loss'][-1]:.4f}")
    return params, curve


def save_params(path: str | Path, params) -> Path:
    """Write params to an orbax checkpoint at `path` (absolute, replaced if present)."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params, force=True)
        ckpt.wait_until_finished()
    return path


def restore_params(path: str | Path, like):
    """Read params saved by `save_params`, with the structure, shapes and dtypes of `like`."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(Path(path).resolve(), target)
