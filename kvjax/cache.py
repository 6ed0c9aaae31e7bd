"""The KV cache: an immutable pytree with a leading layer axis, and exact byte accounting.

Storage of k and v belongs to the cache's format (`kvjax.formats`), so the model never knows
whether slots hold f32 or packed int4; what each slot holds belongs to the policy. Writes go
through `write`, which scatters only the written slots of one layer (the cache rides in the
layer scan's carry, so a decode step never copies the whole cache).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.config import ModelConfig
from kvjax.policies.base import LayerView


def _bytes(tree) -> int:
    """Real bytes of every leaf (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def closed_form_bytes(cfg: ModelConfig, tokens: int, bytes_per_value: float, batch: int = 1):
    """2 · L · Hkv · D · T · bytes (· B): the textbook size of a KV cache."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * bytes_per_value * batch


@struct.dataclass
class KVCache:
    """k, v: format stores (leaves [L, B, K, C, ...]); pos: [L, B, K, C] int32 (-1 = empty);
    stats: the policy's pytree (leaves [L, B, K, C, ...]); length: [B] tokens seen per row;
    nonfinite: [L] bool, set when NaN/inf reached a layer's write (checked on the host).
    """

    k: Any
    v: Any
    pos: jax.Array
    stats: Any
    length: jax.Array
    nonfinite: jax.Array
    fmt: Any = struct.field(pytree_node=False)
    policy: Any = struct.field(pytree_node=False)

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        """An empty cache for `batch` rows; capacity comes from the policy's budget."""
        max_len = cfg.max_seq_len if max_len is None else max_len
        policy.validate(max_len)
        L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        C = policy.capacity(max_len)
        stats = policy.init_stats(batch, K, C)
        return cls(
            k=fmt.init((L, batch, K, C, E), "k"),
            v=fmt.init((L, batch, K, C, E), "v"),
            pos=jnp.full((L, batch, K, C), -1, jnp.int32),
            stats=jax.tree.map(lambda s: jnp.broadcast_to(s, (L,) + s.shape), stats),
            length=jnp.zeros((batch,), jnp.int32),
            nonfinite=jnp.zeros((L,), bool),
            fmt=fmt,
            policy=policy,
        )

    @classmethod
    def abstract(cls, cfg: ModelConfig, batch: int, policy, fmt, max_len: int | None = None):
        """The cache's shapes and dtypes without allocating (size a 70B cache on a laptop)."""
        return jax.eval_shape(lambda: cls.init(cfg, batch, policy, fmt, max_len))

    @property
    def capacity(self) -> int:
        return self.pos.shape[-1]

    def nbytes(self) -> int:
        """Real bytes of every buffer: stored k/v, scales, positions, policy stats, lengths."""
        return _bytes((self.k, self.v, self.pos, self.stats, self.length, self.nonfinite))

    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values alone (format metadata included)."""
        return _bytes((self.k, self.v))

    def layer_view(self, layer) -> LayerView:
        """One layer as the policy and attention see it (k/v dequantized, one layer only)."""
        with jax.named_scope("kv_read"):
            return LayerView(
                k=self.fmt.read(self.k, layer, "k"),  # [B, K, C, E]
                v=self.fmt.read(self.v, layer, "v"),  # [B, K, C, E]
                pos=self.pos[layer],  # [B, K, C]
                stats=jax.tree.map(lambda s: s[layer], self.stats),
                length=self.length,
            )

    def write(self, layer, slots, k_new, v_new, pos_new, stats) -> KVCache:
        """Store a chunk in one layer at the policy's slots (slot C = not stored).

        slots: [B, K, T]; k_new, v_new: [B, T, K, E]; pos_new: [B, T]; stats: the layer's stats.
        """
        with jax.named_scope("cache_update"):
            B, K, _ = slots.shape
            kt = jnp.swapaxes(k_new, 1, 2).astype(jnp.float32)  # [B, K, T, E]
            vt = jnp.swapaxes(v_new, 1, 2).astype(jnp.float32)  # [B, K, T, E]
            valid = (pos_new >= 0)[:, None, :, None]  # [B, 1, T, 1]
            bad = ~jnp.all(jnp.where(valid, jnp.isfinite(kt) & jnp.isfinite(vt), True))
            b = jnp.arange(B)[:, None, None]
            h = jnp.arange(K)[None, :, None]
            pos_b = jnp.broadcast_to(pos_new[:, None, :], slots.shape)  # [B, K, T]
            return self.replace(
                k=self.fmt.write(self.k, layer, slots, kt, "k"),
                v=self.fmt.write(self.v, layer, slots, vt, "v"),
                pos=self.pos.at[layer, b, h, slots].set(pos_b, mode="drop"),
                stats=jax.tree.map(lambda s, n: s.at[layer].set(n), self.stats, stats),
                nonfinite=self.nonfinite.at[layer].set(self.nonfinite[layer] | bad),
            )

    def check_finite(self) -> None:
        """Raise (on the host) naming the layers whose keys/values held NaN or inf."""
        bad = np.flatnonzero(np.asarray(self.nonfinite))
        if bad.size:
            raise FloatingPointError(
                f"NaN or inf keys/values reached the KV cache in layer(s) {bad.tolist()}; "
                "they were not silently stored as valid data (check the model inputs/weights)"
            )
