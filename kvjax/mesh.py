"""Scale-out with JAX's own SPMD: a ('data', 'model') device mesh, params sharded the standard
Llama (Megatron) way and the KV cache sharded over batch and kv heads; `jit` does the rest.

Params (`param_specs`), over `model`:
  wq [L, D, H, E], wk/wv [L, D, K, E]  column-parallel over heads (H and K together, so a kv
                                       head and its query group live on one device)
  wo [L, H, E, D]                      row-parallel over heads (XLA all-reduces the output)
  w_gate/w_up [L, D, F]                column-parallel over F
  w_down [L, F, D]                     row-parallel over F
  lm_head [D, V]                       column-parallel over the vocabulary
  embed [V, D], norms                  replicated (a token lookup in a vocab-sharded table is a
                                       masked gather plus an all-reduce per chunk; the table is
                                       small next to the layers; tied embeddings stay replicated)
Cache (`cache_specs`): every leaf of k, v (every format's scales, zeros, residuals), pos and the
policy's stats follows the layout [L, B, K, C, ...]: B over `data`, K over `model`; `length`
[B] over `data`; `nonfinite` [L] replicated. An axis that does not divide its mesh axis stays
replicated, and the reason is returned (`Sharding.reasons`) for the caller to show and record.
A head pool (`HeadPool`, AdaKV) keeps all heads in one slot axis: batch only. Layer groups
(pyramid) shard each group. The paged layout (a page pool shared by all rows) is refused.
Several processes (hosts) join one mesh through `init_distributed`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "model")

# param name -> (axis sharded over `model`, what that axis is)
PARAM_AXES = {
    "wq": (2, "heads"), "wk": (2, "heads"), "wv": (2, "heads"), "wo": (1, "heads"),
    "w_gate": (2, "F"), "w_up": (2, "F"), "w_down": (1, "F"), "lm_head": (1, "V"),
}
PARAM_NDIM = {"wq": 4, "wk": 4, "wv": 4, "wo": 4, "w_gate": 3, "w_up": 3, "w_down": 3,
              "lm_head": 2}


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A device mesh of data x model devices (`mesh.data=N mesh.model=M`); 1 x 1: no mesh."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for f in ("data", "model"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"mesh.{f}={v!r} must be an integer >= 1")

    @property
    def size(self) -> int:
        return self.data * self.model

    @property
    def trivial(self) -> bool:
        return self.size == 1

    def check_devices(self) -> None:
        """Raise (before any model work) when this process sees fewer devices than the mesh."""
        have = jax.device_count()
        if have < self.size:
            raise ValueError(
                f"mesh.data={self.data} mesh.model={self.model} needs {self.size} devices, this "
                f"process has {have} ({jax.default_backend()}); on CPU start it with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={self.size}, or lower the mesh"
            )


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join a multi-process JAX job (one process per host, or several on one host) before any
    other JAX work: `jax.devices()`, and with it `build_mesh`, then spans every process's
    devices, and `jit` runs the sharded program on all of them. CPU collectives go through
    gloo (GPU ones through NCCL, as JAX chooses)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def to_numpy(x) -> np.ndarray:
    """`x` as numpy in this process. An array with shards on other processes' devices (a batch
    split over hosts) is gathered first (`multihost_utils.process_allgather`, a collective:
    every process must call it), so each host reads the whole result."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@functools.cache
def build_mesh(spec: MeshSpec) -> Mesh:
    """The ('data', 'model') mesh over the first data·model devices."""
    spec.check_devices()
    devices = np.array(jax.devices()[: spec.size]).reshape(spec.data, spec.model)
    return Mesh(devices, AXES)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """PartitionSpecs for a pytree and the one-line reasons for what stayed replicated."""

    specs: Any
    reasons: tuple[str, ...] = ()

    def place(self, tree, mesh: Mesh):
        """`tree` on the mesh (a committed, sharded copy)."""
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                                 is_leaf=lambda x: isinstance(x, P))
        return jax.device_put(tree, shardings)


def _split(n: int, size: int, what: str, axis: str, reasons: list) -> str | None:
    """`axis` when `size` devices divide n entries of `what`, else None (and why)."""
    if size == 1:
        return None
    if n % size:
        reasons.append(f"{what}: {n} do not divide over mesh.{axis}={size}; replicated")
        return None
    return axis


def param_specs(params, cfg, spec: MeshSpec) -> Sharding:
    """Megatron-style specs for `kvjax.model.init_params`' layout (module docstring) or its
    `split_layers` form (per-layer [in, out] matrices: the heads or F axis flattened into
    columns or rows, whole heads per device when kv heads divide); anything else, and an axis
    that does not divide mesh.model, replicated (with the reason)."""
    reasons: list[str] = []
    sizes = {"heads": cfg.n_kv_heads, "F": cfg.d_ff, "V": cfg.vocab_size}
    names = {"heads": "kv heads (wq/wk/wv/wo)", "F": "MLP width F (w_gate/w_up/w_down)",
             "V": "vocabulary (lm_head)"}
    split = {k: _split(n, spec.model, names[k], "model", reasons) for k, n in sizes.items()}

    def one(path, x):
        per_layer = isinstance(path[-1], jax.tree_util.SequenceKey)  # split_layers: [in, out]
        name = getattr(path[-2 if per_layer else -1], "key", None)
        if name not in PARAM_AXES or split[PARAM_AXES[name][1]] is None:
            return P()
        axis, _ = PARAM_AXES[name]
        axis, ndim = (axis - 1, 2) if per_layer else (axis, PARAM_NDIM[name])
        if x.ndim != ndim:
            reasons.append(f"{name}: shape {x.shape} is not the stacked or split layout; "
                           "replicated")
            return P()
        dims = [None] * x.ndim
        dims[axis] = "model"
        return P(*dims)

    return Sharding(jax.tree_util.tree_map_with_path(one, params), tuple(reasons))


def cache_specs(cache, spec: MeshSpec) -> Sharding:
    """Specs for a dense cache (`KVCache`, `HeadPool`, `LayerGroups`), leaves [L, B, K, ...]."""
    from kvjax.cache import HeadPool, KVCache, LayerGroups

    if isinstance(cache, LayerGroups):
        parts = [cache_specs(g, spec) for g in cache.groups]
        reasons = tuple(dict.fromkeys(r for p in parts for r in p.reasons))
        return Sharding(cache.replace(groups=tuple(p.specs for p in parts)), reasons)
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"a mesh shards the dense cache layout (KVCache, HeadPool, LayerGroups), not "
            f"{type(cache).__name__}: its page pool is shared by every row; use cache.layout=dense "
            "or mesh.data=1 mesh.model=1"
        )
    reasons: list[str] = []
    B, K = cache.pos.shape[1:3]  # [L, B, K, C]
    data = _split(B, spec.data, "batch rows", "data", reasons)
    if isinstance(cache, HeadPool):
        model = None
        if spec.model > 1:
            reasons.append("head pool: its kv heads share one slot axis; replicated over model")
    else:
        model = _split(K, spec.model, "kv heads (cache)", "model", reasons)

    def leaf(x):  # [L, B, K, ...]
        return P(None, data, model, *[None] * (x.ndim - 3))

    specs = cache.replace(
        k=jax.tree.map(leaf, cache.k), v=jax.tree.map(leaf, cache.v), pos=leaf(cache.pos),
        stats=jax.tree.map(leaf, cache.stats), length=P(data), nonfinite=P(),
        **({"owner": leaf(cache.owner)} if isinstance(cache, HeadPool) else {}),
    )
    return Sharding(specs, tuple(reasons))


def shard_params(params, cfg, spec: MeshSpec):
    """(params on the mesh, reasons)."""
    s = param_specs(params, cfg, spec)
    return s.place(params, build_mesh(spec)), s.reasons


def shard_cache(cache, spec: MeshSpec):
    """(cache on the mesh, reasons)."""
    s = cache_specs(cache, spec)
    return s.place(cache, build_mesh(spec)), s.reasons


def local_shapes(abstract, sharding: Sharding, spec: MeshSpec):
    """Each leaf's per-device ShapeDtypeStruct under `sharding`, from the mesh sizes alone (no
    devices needed: size a 64-way mesh on a laptop)."""
    sizes = {"data": spec.data, "model": spec.model}

    def local(x, p):
        shape = list(x.shape)
        for i, ax in enumerate(p):
            if ax is not None:
                shape[i] //= sizes[ax]
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    return jax.tree.map(local, abstract, sharding.specs)


def abstract_sharded(abstract, spec: MeshSpec):
    """An abstract cache (`KVCache.abstract`) as one device holds it under `cache_specs`:
    (per-device ShapeDtypeStructs, reasons)."""
    s = cache_specs(abstract, spec)
    return local_shapes(abstract, s, spec), s.reasons
