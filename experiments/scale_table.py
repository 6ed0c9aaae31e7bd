"""docs/scale.md: the KV cache of Llama-3-8B and -70B at 32k and 128k tokens, per device, sized
on paper with `KVCache.abstract` (shapes only, nothing allocated) and the sharding rule of
`kvjax.mesh` (kv heads over `model`, at most 8-way for 8 kv heads; the rest of the devices over
`data`, which splits the batch when it divides).

    python -m experiments.scale_table            # rewrites docs/scale.md (a few seconds)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from kvjax.cache import KVCache, closed_form_bytes
from kvjax.config import ModelConfig
from kvjax.experiment import build_format
from kvjax.mesh import MeshSpec, abstract_sharded, local_shapes, param_specs
from kvjax.model import init_params
from kvjax.policies import get_policy

DOC = Path(__file__).resolve().parent.parent / "docs" / "scale.md"
GIB = 2**30
WEIGHT_BYTES = 2  # bf16 weights
# The published configs (Meta's config.json of Meta-Llama-3-8B / -70B).
MODELS = {
    "Llama-3-8B": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, head_dim=128, d_ff=14336, rope_theta=500000.0,
                              tie_embeddings=False, max_seq_len=131072, name="llama-3-8b"),
    "Llama-3-70B": ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                               n_kv_heads=8, head_dim=128, d_ff=28672, rope_theta=500000.0,
                               tie_embeddings=False, max_seq_len=131072, name="llama-3-70b"),
}
CONTEXTS = (32768, 131072)
BATCHES = (1, 8, 64)
DEVICES = (1, 8, 64)
MEMORY_GIB = (80, 141)
# name -> (policy, options, kv format): bf16 storage is the model's own dtype
SETTINGS = {
    "full bf16": ("full", {}, "bf16"),
    "full int4": ("full", {}, "int4"),
    "h2o 10 % bf16": ("h2o", {"budget": 0.10}, "bf16"),
}


def mesh_for(cfg: ModelConfig, n_devices: int) -> MeshSpec:
    """kv heads over `model` (the largest divisor of n_devices that divides the kv heads),
    the rest over `data`."""
    model = max(m for m in range(1, n_devices + 1)
                if n_devices % m == 0 and cfg.n_kv_heads % m == 0)
    return MeshSpec(data=n_devices // model, model=model)


def abstract_cache(cfg: ModelConfig, setting: str, tokens: int, batch: int):
    name, opts, kv = SETTINGS[setting]
    opts = {k: int(v * tokens) if k == "budget" else v for k, v in opts.items()}
    return KVCache.abstract(cfg, batch, get_policy(name, **opts), build_format(kv, {}), tokens)


def weights_per_device(cfg: ModelConfig, mesh: MeshSpec) -> int:
    """bf16 weight bytes one device holds under `kvjax.mesh.param_specs`."""
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    local = local_shapes(params, param_specs(params, cfg, mesh), mesh)
    return sum(int(np.prod(x.shape)) * WEIGHT_BYTES for x in jax.tree.leaves(local))


def cell(model: str, setting: str, tokens: int, batch: int, n_devices: int) -> dict:
    """One setting on one device count: the cache's total and per-device bytes (all buffers),
    its k+v bytes, the mesh and what it leaves replicated."""
    cfg = MODELS[model]
    cache = abstract_cache(cfg, setting, tokens, batch)
    mesh = mesh_for(cfg, n_devices)
    local, reasons = abstract_sharded(cache, mesh)
    return {"total": cache.nbytes(), "kv": cache.kv_nbytes(), "per_device": local.nbytes(),
            "mesh": mesh, "reasons": reasons, "weights": weights_per_device(cfg, mesh)}


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f}" if n >= GIB / 10 else f"{n / GIB:.3f}"


def table() -> list[str]:
    head = ("| model | context | batch | cache | total GiB | "
            + " | ".join(f"per device, {n} dev ({_mesh(n)})" for n in DEVICES)
            + " | " + " | ".join(f"devices for {m} GiB" for m in MEMORY_GIB) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for model in MODELS:
        for tokens in CONTEXTS:
            for batch in BATCHES:
                for setting in SETTINGS:
                    cells = {n: cell(model, setting, tokens, batch, n) for n in DEVICES}
                    row = [model, f"{tokens // 1024}k", str(batch), setting,
                           _gib(cells[1]["total"])]
                    row += [_gib(cells[n]["per_device"]) + ("*" if cells[n]["reasons"] else "")
                            for n in DEVICES]
                    for mem in MEMORY_GIB:
                        fit = [n for n in DEVICES
                               if cells[n]["per_device"] + cells[n]["weights"] <= mem * GIB]
                        row.append(f"{fit[0]} ({_mesh(fit[0])})" if fit else f"> {DEVICES[-1]}")
                    lines.append("| " + " | ".join(row) + " |")
    return lines


def _mesh(n: int) -> str:
    m = mesh_for(next(iter(MODELS.values())), n)
    return f"{m.data}x{m.model}"


def weights_table() -> list[str]:
    lines = ["| model | " + " | ".join(f"{n} dev ({_mesh(n)})" for n in DEVICES) + " |",
             "|---|" + "---|" * len(DEVICES)]
    for model, cfg in MODELS.items():
        lines.append(f"| {model} | " + " | ".join(
            _gib(weights_per_device(cfg, mesh_for(cfg, n))) for n in DEVICES) + " |")
    return lines


def check_closed_form() -> str:
    """The full bf16 cell of Llama-3-8B at 32k, batch 1, against 2 * L * Hkv * D * T * bytes."""
    cfg = MODELS["Llama-3-8B"]
    c = cell("Llama-3-8B", "full bf16", 32768, 1, 1)
    want = closed_form_bytes(cfg, 32768, 2)
    assert c["kv"] == want, (c["kv"], want)
    return (f"Check: Llama-3-8B, 32k, batch 1, full bf16: k+v = {c['kv']:,} bytes = 2 * 32 * 8 * "
            f"128 * 32768 * 2 (the closed form, exactly); all buffers {c['total']:,} bytes "
            f"(+ int32 positions, {c['total'] - c['kv']:,} bytes).")


def write_doc(path: Path = DOC) -> str:
    d1, d8, d64 = (mesh_for(MODELS["Llama-3-8B"], n) for n in DEVICES)
    text = "\n".join([
        "# Sizing the KV cache for real scale",
        "",
        "Generated by `python -m experiments.scale_table` (no allocation: `KVCache.abstract`",
        "gives the shapes, `kvjax.mesh.abstract_sharded` each device's share under the",
        "sharding `python run.py mesh.data=N mesh.model=M` uses). Models: the published",
        "configs of Llama-3-8B (32 layers, 8 kv heads, head dim 128) and Llama-3-70B (80 layers,",
        "8 kv heads, head dim 128). How to run on a mesh: docs/scale-out.md.",
        "",
        "## Rule",
        "",
        "* kv heads (and with them the cache's head axis, the query groups, wq/wk/wv/wo and the",
        "  MLP's F axis) over `model`: at most 8-way, since both models have 8 kv heads;",
        (f"  the remaining devices over `data`: 1 device = {d1.data}x{d1.model}, 8 = "
        f"{d8.data}x{d8.model}, 64 = {d64.data}x{d64.model} (data x model)."),
        "* `data` splits the batch only when it divides it: batch 1 on 64 devices is split 8-way",
        "  (over kv heads) and replicated over the 8 data rows (marked `*`); those devices would",
        "  serve other requests, or the context would need sequence parallelism (not in kvjax).",
        "* Bytes are every buffer kvjax allocates: k and v in the format (int4: packed values,",
        "  per-group scales and zero points, the f32 residual window), int32 positions per slot",
        "  and kv head, the policy's stats (H2O: f32 accumulated attention per slot).",
        "* \"devices for X GiB\": the fewest of 1 / 8 / 64 devices on which the cache plus the",
        "  bf16 weights per device fit in X GiB (80: A100/H100; 141: H200), activations and",
        "  workspace not counted, so a real deployment needs some headroom.",
        "",
        "## Cache per device (GiB)",
        "",
        *table(),
        "",
        "`*`: the batch does not divide over `data`; those axes are replicated.",
        "",
        "## bf16 weights per device (GiB)",
        "",
        "Column-/row-parallel projections over `model`; the embedding and norms replicated.",
        "",
        *weights_table(),
        "",
        check_closed_form(),
        "",
        "## Measured here",
        "",
        "`tests/test_mesh.py` measures the same rule on 8",
        "forced host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`) with the",
        "tiny model: per-device bytes read from the shards of a real sharded cache (full f32 and",
        "h2o int4) equal total / (data x model) for k, v, positions and stats, and equal this",
        "page's arithmetic (`abstract_sharded`) to the byte. `tests/test_scale_table.py` checks a",
        "cell of the table against the closed form 2 * L * Hkv * D * T * bytes.",
        "",
    ])
    path.write_text(text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DOC, help="the Markdown file to (re)write "
                    "(default: docs/scale.md)")
    args = ap.parse_args(argv)
    if args.out.is_dir():
        ap.error(f"--out {args.out} is a directory; give the Markdown file to write")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the table is computed
    write_doc(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
