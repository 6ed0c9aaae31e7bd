"""Checkpoint tensors -> kvjax params: the one mapping the GGUF and HF loaders share.

`TENSOR_NAMES` says where each kvjax param lives in either kind of checkpoint; a loader passes
its column and how to read a tensor, and `assemble_params` checks every shape against the
ModelConfig and lays the weights out as the model wants them: stacked per-layer arrays
[L, ...], projections as einsum-friendly [D, H, E] / [H, E, D], linears as [in, out].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from kvjax.config import ModelConfig

# kvjax param -> (its tensor in a llama GGUF file, in a HF Llama checkpoint); {i}: the layer
TENSOR_NAMES = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
    "attn_norm": ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    "wq": ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    "wk": ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    "wv": ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    "wo": ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    "w_gate": ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    "w_up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "w_down": ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
}
GGUF_NAMES = {k: gguf for k, (gguf, _) in TENSOR_NAMES.items()}
HF_NAMES = {k: hf for k, (_, hf) in TENSOR_NAMES.items()}


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every param `assemble_params` builds, as the same two-level dict."""
    L, D, H, K, E, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.d_ff, cfg.vocab_size)
    layers = {"attn_norm": (D,), "wq": (D, H, E), "wk": (D, K, E), "wv": (D, K, E),
              "wo": (H, E, D), "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F),
              "w_down": (F, D)}
    shapes = {"embed": (V, D), "layers": {k: (L, *s) for k, s in layers.items()},
              "final_norm": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def assemble_params(
    cfg: ModelConfig,
    names: Mapping[str, str],
    read: Callable[[str], np.ndarray],
    shape_source: str,
    fix_qk: Callable[[np.ndarray, int], np.ndarray] | None = None,
) -> dict:
    """Params of float32 numpy arrays from a checkpoint.

    read(name) returns the named tensor as float32 in torch's [out, in] layout (raising if the
    checkpoint lacks it); shapes that disagree with `cfg` are an error naming `shape_source`.
    fix_qk(w, n_heads) maps stored q/k projection rows to HF rotate_half order (GGUF permutes
    them; None: they are in that order already). Tensors are read layer by layer."""
    L, D, H, K, E, F, V = (
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
    )
    qk = fix_qk or (lambda w, n: w)

    def get(key: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray:
        name = names[key] if i is None else names[key].format(i=i)
        w = read(name)
        if w.shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {w.shape}, expected {shape} from {shape_source}"
            )
        return w

    layers = {k: np.empty(s, np.float32) for k, s in param_shapes(cfg)["layers"].items()}
    for i in range(L):
        layers["attn_norm"][i] = get("attn_norm", (D,), i)
        layers["wq"][i] = qk(get("wq", (H * E, D), i), H).T.reshape(D, H, E)
        layers["wk"][i] = qk(get("wk", (K * E, D), i), K).T.reshape(D, K, E)
        layers["wv"][i] = get("wv", (K * E, D), i).T.reshape(D, K, E)
        layers["wo"][i] = get("wo", (D, H * E), i).T.reshape(H, E, D)
        layers["mlp_norm"][i] = get("mlp_norm", (D,), i)
        layers["w_gate"][i] = get("w_gate", (F, D), i).T
        layers["w_up"][i] = get("w_up", (F, D), i).T
        layers["w_down"][i] = get("w_down", (D, F), i).T

    params = {
        "embed": get("embed", (V, D)),
        "layers": layers,
        "final_norm": get("final_norm", (D,)),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head", (V, D)).T)
    return params
