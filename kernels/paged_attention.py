"""Paged decode attention: a Pallas kernel over a KV page pool, beside its pure-jnp reference.

One query token per sequence attends over that sequence's pages, found through its block table.
Each program handles all G query heads of one kv head (GQA) for one row and one split of the
row's pages (split-K); an online softmax runs over blocks of `pages_per_block` pages inside the
program and a log-sum-exp combine merges the splits.

The kernel takes ready-made pages (a format's page codec encodes them, `kvjax.formats`): float
arrays, or `QuantPages` dequantized inside the kernel by their static `bits` and zero point:

    bits 8, no zero   q=int8 [..., E], scale=[..., 1]                        x ≈ q·scale
    bits 4, zero      q=uint8 [..., E//2], scale, zero=[..., E//g]           x ≈ q·scale + zero
                      (byte i holds element 2i in the low nibble and 2i+1 in the high nibble)

with `...` = [L, K, P, page] (or [K, P, page] for a single layer) and scales in float16/bfloat16.

Token t of row b is attended iff t < lengths[b] and block_tables[b, t // page] is a page of the
pool (NO_PAGE = -1 marks a page evicted by a page-granular policy). Table entries past a row's
length are never read. The kernel is written for the Pallas Triton GPU lowering (power-of-two
tiles, >= 16 for `jnp.dot`) and runs anywhere with `interpret=True`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kvjax.formats import QuantPages, decode_pages

try:
    from jax.experimental.pallas import triton as _pltriton
except ImportError:
    _pltriton = None

NO_PAGE = -1
VALID_PAGE_SIZES = (8, 16, 32, 64, 128, 256)
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_DOT = 16  # Triton's tl.dot needs every matmul dim >= 16
KERNEL_CODES = (None, (8, False), (4, True))  # `_codes` of the page stores the kernel reads


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _codes(pages):
    """The static numbers the kernel dequantizes a page store by: None for float pages, else
    (bits, has a zero point) of `QuantPages`."""
    if isinstance(pages, QuantPages):
        return pages.bits, pages.zero is not None
    if jnp.issubdtype(pages.dtype, jnp.floating):
        return None
    raise ValueError(
        f"pages of dtype {pages.dtype}: pass float pages or kvjax.formats.QuantPages "
        "(a format's page codec encodes them)"
    )


def pages_head_dim(pages) -> int:
    """Logical head dim E of a page store (packed codes hold E * bits / 8 bytes per token)."""
    return pages.head_dim if isinstance(pages, QuantPages) else pages.shape[-1]


# --------------------------------------------------------------------------- kernel


def _load_tile(refs, codes, layer, head, ids, block_k, dtype):
    """Gather ppb pages of one kv head: (tile [block_k, E] in `dtype`, per-token scale or None).
    codes: `_codes` of the store (None: float; (8, False): int8 codes with a per-token scale,
    applied by the caller; (4, True): packed nibbles with group scale and zero)."""
    if codes is None:
        x = refs[0][layer, head, ids]  # [ppb, page, E]
        return x.reshape(block_k, x.shape[-1]).astype(dtype), None
    if codes == (8, False):
        c = refs[0][layer, head, ids]  # [ppb, page, E]
        s = refs[1][layer, head, ids]  # [ppb, page, 1]
        c = c.reshape(block_k, c.shape[-1]).astype(jnp.float32).astype(dtype)
        return c, s.reshape(1, block_k).astype(jnp.float32)
    c = refs[0][layer, head, ids].astype(jnp.int32)  # [ppb, page, E/2]
    half = c.shape[-1]
    c = c.reshape(block_k, half)  # [block_k, E/2]
    lo = (c & 15).astype(jnp.float32)  # elements 0, 2, 4, ...
    hi = (c >> 4).astype(jnp.float32)  # elements 1, 3, 5, ...
    x = jnp.stack([lo, hi], axis=-1).reshape(block_k, 2 * half)  # [block_k, E]
    n_groups = refs[1].shape[-1]
    g = 2 * half // n_groups

    def expand(r):
        v = r[layer, head, ids].reshape(block_k, n_groups).astype(jnp.float32)  # [block_k, E/g]
        v = jnp.broadcast_to(v[:, :, None], (block_k, n_groups, g))  # [block_k, E/g, g]
        return v.reshape(block_k, 2 * half)  # [block_k, E]

    return (x * expand(refs[1]) + expand(refs[2])).astype(dtype), None


def _paged_kernel(
    lengths_ref,
    layer_ref,
    bt_ref,
    q_ref,
    *refs,
    k_codes,
    v_codes,
    nk,
    nv,
    page,
    ppb,
    pps,
    sm_scale,
    return_scores,
    dtype,
):
    """One program = (row b, kv head h, split s): online softmax over the split's page blocks."""
    k_refs, v_refs = refs[:nk], refs[nk : nk + nv]
    o_ref, l_ref, m_ref = refs[nk + nv : nk + nv + 3]
    s_ref = refs[nk + nv + 3] if return_scores else None
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    layer = layer_ref[0]
    n_pool = k_refs[0].shape[2]
    block_k = ppb * page
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    q = q_ref[...].astype(dtype)  # [Gp, E]
    Gp, E = q.shape
    first = split * pps
    n_pages = (length + page - 1) // page
    n_iter = (jnp.clip(n_pages - first, 0, pps) + ppb - 1) // ppb

    def body(i, carry):
        o, m, l = carry  # [Gp, E], [Gp], [Gp]
        p0 = first + i * ppb
        ids = bt_ref[pl.ds(p0, ppb)]  # [ppb]
        ok = (ids >= 0) & (ids < n_pool)  # [ppb]
        ids = jnp.where(ok, ids, 0)
        ok_tok = jnp.broadcast_to(ok[:, None], (ppb, page)).reshape(1, block_k)  # [1, block_k]
        tok = p0 * page + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
        mask = ok_tok & (tok < length)  # [1, block_k]

        k, k_scale = _load_tile(k_refs, k_codes, layer, h, ids, block_k, dtype)  # [block_k, E]
        s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
        s = s * sm_scale  # [Gp, block_k]
        if k_scale is not None:
            s = s * k_scale
        s = jnp.where(mask, s, MASK_VALUE)
        if return_scores:
            s_ref[:, pl.ds(p0 * page, block_k)] = s
        m_new = jnp.maximum(m, s.max(axis=-1))  # [Gp]
        corr = jnp.exp(m - m_new)  # [Gp]
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [Gp, block_k]
        l_new = corr * l + p.sum(axis=-1)

        v, v_scale = _load_tile(v_refs, v_codes, layer, h, ids, block_k, dtype)  # [block_k, E]
        if v_scale is not None:
            p = jnp.where(mask, p * v_scale, 0.0)
        v = jnp.where(mask.reshape(block_k, 1), v, jnp.zeros_like(v))
        pv = jnp.dot(p.astype(dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return corr[:, None] * o + pv, m_new, l_new

    init = (
        jnp.zeros((Gp, E), jnp.float32),
        jnp.full((Gp,), MASK_VALUE, jnp.float32),
        jnp.zeros((Gp,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, n_iter, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


# --------------------------------------------------------------------------- wrapper


def _valid_tokens(block_tables, lengths, page, n_pool):
    """[B, M*page] bool: token slots below each row's length on a page inside the pool."""
    tok = jnp.arange(block_tables.shape[1] * page)
    bt_ok = jnp.repeat((block_tables >= 0) & (block_tables < n_pool), page, axis=1)  # [B, T]
    return (tok[None, :] < lengths[:, None]) & bt_ok


def _probs(scores, valid, lse):
    """Attention probabilities exp(scores - lse) [B, K, G, T], 0 on invalid slots and for rows
    with no attended token (lse = -inf). valid broadcasts to scores, lse is [B, K, G, 1]."""
    norm = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.where(valid, jnp.exp(scores - norm), 0.0)


def _outputs(q, o, mass=None, lse=None):
    """What both entry points return: o [B, K, G, E] as [B, H, E] in q's dtype, then the mass
    [B, K, T] and the lse [B, K, G] as [B, H] where given."""
    B, H, E = q.shape
    outs = [o.reshape(B, H, E).astype(q.dtype)]
    if mass is not None:
        outs.append(mass)
    if lse is not None:
        outs.append(lse.reshape(B, H))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _as_5d(pages):
    """[K, P, page, X] leaves -> [1, K, P, page, X]; [L, K, P, page, X] unchanged."""
    return jax.tree.map(lambda x: x[None] if x.ndim == 4 else x, pages)


def default_pages_per_block(page: int, block_tokens: int = 64) -> int:
    """Pages per inner block: ~`block_tokens` tokens, at least 16 (Triton dot minimum)."""
    return max(1, max(block_tokens, _MIN_DOT) // page)


def default_num_splits(batch: int, kv_heads: int, n_blocks: int, target_programs: int = 264) -> int:
    """Enough splits that B·K·S fills ~2 waves of an H200's 132 SMs, no more than blocks."""
    return int(max(1, min(n_blocks, -(-target_programs // max(1, batch * kv_heads)))))


def check_page_size(page: int) -> None:
    """Raise a ValueError naming the valid page sizes when `page` does not fit the kernel."""
    if page not in VALID_PAGE_SIZES:
        raise ValueError(
            f"page size {page} does not fit the paged-attention kernel's blocks (Triton tiles are "
            f"powers of two; a block of pages must hold >= 16 tokens for tensor-core dots); "
            f"valid page sizes: {', '.join(map(str, VALID_PAGE_SIZES))}"
        )


def _check_static(q, k_pages, v_pages, block_tables, lengths, ppb, block_g, interpret):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, E], got shape {q.shape}")
    B, H, E = q.shape
    leaves = jax.tree.leaves((k_pages, v_pages))
    nd = leaves[0].ndim
    if nd not in (4, 5) or any(x.ndim != nd for x in leaves):
        raise ValueError(
            "pages must all be [K, P, page, X] or [L, K, P, page, X], got shapes "
            f"{[x.shape for x in leaves]}"
        )
    lead = leaves[0].shape[:-1]
    if any(x.shape[:-1] != lead for x in leaves):
        raise ValueError(
            f"k/v page leaves disagree on [.., K, P, page]: {[x.shape for x in leaves]}"
        )
    K, page = lead[-3], lead[-1]
    check_page_size(page)
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        codes, e = _codes(pages), pages_head_dim(pages)
        if codes not in KERNEL_CODES:
            raise ValueError(
                f"{name}: QuantPages with bits={codes[0]} and zero point {codes[1]} cannot be read "
                "by the kernel; it dequantizes 8-bit codes with one scale per token (no zero) and "
                "4-bit packed codes with group scale and zero"
            )
        if e != E:
            raise ValueError(f"{name} hold head dim {e}, q has E={E}")
        if codes == (4, True):
            n_groups = pages.scale.shape[-1]
            if E % n_groups or pages.zero.shape != pages.scale.shape or (E // n_groups) % 2:
                raise ValueError(
                    f"{name}: 4-bit scale/zero {pages.scale.shape}/{pages.zero.shape} must hold "
                    f"E/g groups of an even size g for E={E}"
                )
        if codes == (8, False) and pages.scale.shape[-1] != 1:
            raise ValueError(f"{name}: 8-bit scale must be [..., 1], got {pages.scale.shape}")
    if H % K:
        raise ValueError(f"q heads H={H} must be a multiple of kv heads K={K}")
    if block_tables.ndim != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, max_pages], got {block_tables.shape}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B={B}], got {lengths.shape}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer) or not jnp.issubdtype(
        lengths.dtype, jnp.integer
    ):
        raise ValueError("block_tables and lengths must be integer arrays")
    if not _is_pow2(ppb) or ppb * page < _MIN_DOT:
        raise ValueError(
            f"pages_per_block={ppb} with page size {page}: need a power of two with "
            f"pages_per_block * page >= {_MIN_DOT}"
        )
    if block_g is not None and (not _is_pow2(block_g) or block_g < H // K):
        raise ValueError(f"block_g={block_g} must be a power of two >= G={H // K}")
    if not interpret:
        if _pltriton is None:
            raise RuntimeError(
                "the compiled paged-attention kernel needs the Pallas Triton GPU backend "
                "(jax.experimental.pallas.triton), which this jax does not ship; use "
                "interpret=True or the XLA paged_attention_reference"
            )
        bad = [f"E={E}"] if not _is_pow2(E) or E < _MIN_DOT else []
        for pages in (k_pages, v_pages):
            if _codes(pages) == (4, True) and not _is_pow2(pages.scale.shape[-1]):
                bad.append(f"4-bit groups per token E/g={pages.scale.shape[-1]}")
        if bad:
            raise ValueError(
                f"compiled kernel needs power-of-two tiles (E >= {_MIN_DOT}); got {', '.join(bad)}"
            )
    return B, H, E, K, page


def _check_values(block_tables, lengths, n_pool, page):
    """Eager-only value checks (skipped under jit, where bad entries are masked, never read)."""
    bt, ln = np.asarray(block_tables), np.asarray(lengths)
    if (ln < 0).any() or (ln > bt.shape[1] * page).any():
        raise ValueError(
            f"lengths must lie in [0, max_pages*page={bt.shape[1] * page}], got {ln.tolist()}"
        )
    used = np.arange(bt.shape[1])[None, :] < -(-ln[:, None] // page)  # [B, M]
    bad = used & ((bt < NO_PAGE) | (bt >= n_pool))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(bt[b, j])} points outside the pool of {n_pool} pages "
            f"(valid: 0..{n_pool - 1}, or {NO_PAGE} for an evicted page)"
        )


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    layer=None,
    sm_scale=None,
    return_mass=False,
    extra_lse=None,
    return_lse=False,
    pages_per_block=None,
    num_splits=None,
    block_g=None,
    num_warps=4,
    num_stages=2,
    interpret=False,
):
    """Decode attention over pages. q [B, H, E]; pages [K, P, page, E] (or [L, ...] with `layer`);
    block_tables [B, M] int32; lengths [B]. Returns o [B, H, E] (q.dtype), and with
    `return_mass` also the attention mass [B, K, M*page] (probabilities summed over each kv
    head's G query heads; 0 past the length and on evicted pages), and with `return_lse` the
    log-sum-exp of the scores [B, H] float32 (-inf for a row with no attended token).

    extra_lse [B, H]: log-sum-exp of the (scaled) scores of keys outside the pages that share
    this softmax (e.g. the query's own token, not yet stored). o, the mass and the returned lse
    are then normalized over pages ∪ those keys; o lacks the extra keys' share
    sum_x exp(s_x - lse) v_x, which the caller adds.
    """
    page = jax.tree.leaves(k_pages)[0].shape[-2]
    check_page_size(page)
    ppb = default_pages_per_block(page) if pages_per_block is None else pages_per_block
    _check_static(q, k_pages, v_pages, block_tables, lengths, ppb, block_g, interpret)
    if not any(isinstance(x, jax.core.Tracer) for x in (block_tables, lengths)):
        _check_values(block_tables, lengths, jax.tree.leaves(k_pages)[0].shape[-3], page)
    if extra_lse is not None and extra_lse.shape != q.shape[:2]:
        raise ValueError(f"extra_lse must be [B, H] = {q.shape[:2]}, got {extra_lse.shape}")
    nl = jax.tree.leaves(k_pages)[0].ndim
    if layer is None:
        if nl == 5 and jax.tree.leaves(k_pages)[0].shape[0] != 1:
            raise ValueError("pages with a layer axis [L, K, P, page, X] need `layer=`")
        layer = 0
    return _paged_attention(
        q,
        _as_5d(k_pages),
        _as_5d(v_pages),
        block_tables.astype(jnp.int32),
        lengths.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32).reshape(1),
        None if extra_lse is None else extra_lse.astype(jnp.float32),
        sm_scale=sm_scale,
        return_mass=return_mass,
        return_lse=return_lse,
        pages_per_block=ppb,
        num_splits=num_splits,
        block_g=block_g,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "return_mass",
        "return_lse",
        "pages_per_block",
        "num_splits",
        "block_g",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    layer,
    extra_lse,
    *,
    sm_scale,
    return_mass,
    return_lse,
    pages_per_block,
    num_splits,
    block_g,
    num_warps,
    num_stages,
    interpret,
):
    """Jitted body of `paged_attention`: pad, run the kernel over (B, K, splits), combine."""
    B, H, E = q.shape
    K, P, page = jax.tree.leaves(k_pages)[0].shape[1:4]
    G = H // K
    Gp = block_g or max(_MIN_DOT, _next_pow2(G))
    M = block_tables.shape[1]
    ppb = pages_per_block
    n_blocks = -(-M // ppb)
    S = num_splits or default_num_splits(B, K, n_blocks)
    S = max(1, min(S, n_blocks))
    pps = -(-n_blocks // S) * ppb  # pages per split
    S = -(-M // pps)
    Mp = S * pps
    scale = 1.0 / math.sqrt(E) if sm_scale is None else sm_scale
    dtype = jnp.float32 if q.dtype == jnp.float32 else q.dtype

    qg = q.reshape(B, K, G, E)  # [B, K, G, E]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))  # [B, K, Gp, E]
    bt = jnp.pad(block_tables, ((0, 0), (0, Mp - M)), constant_values=NO_PAGE)  # [B, Mp]

    k_leaves, v_leaves = jax.tree.leaves(k_pages), jax.tree.leaves(v_pages)
    kernel = functools.partial(
        _paged_kernel,
        k_codes=_codes(k_pages),
        v_codes=_codes(v_pages),
        nk=len(k_leaves),
        nv=len(v_leaves),
        page=page,
        ppb=ppb,
        pps=pps,
        sm_scale=scale,
        return_scores=return_mass,
        dtype=dtype,
    )

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, h, s, nd=x.ndim: (0,) * nd)

    out_shape = [
        jax.ShapeDtypeStruct((B, K, S, Gp, E), jnp.float32),  # o (unnormalized)
        jax.ShapeDtypeStruct((B, K, S, Gp), jnp.float32),  # l
        jax.ShapeDtypeStruct((B, K, S, Gp), jnp.float32),  # m
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, Gp, E), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, Gp), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, Gp), lambda b, h, s: (b, h, s, 0)),
    ]
    if return_mass:
        out_shape.append(jax.ShapeDtypeStruct((B, K, Gp, Mp * page), jnp.float32))  # scores
        out_specs.append(pl.BlockSpec((None, None, Gp, Mp * page), lambda b, h, s: (b, h, 0, 0)))
    params = {}
    if not interpret and _pltriton is not None:
        params["compiler_params"] = _pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages
        )
    outs = pl.pallas_call(
        kernel,
        grid=(B, K, S),
        in_specs=[
            whole(lengths),
            whole(layer),
            pl.BlockSpec((None, Mp), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, Gp, E), lambda b, h, s: (b, h, 0, 0)),
            *[whole(x) for x in k_leaves],
            *[whole(x) for x in v_leaves],
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name=f"paged_attention_page{page}_ppb{ppb}",
        **params,
    )(lengths, layer, bt, qg, *k_leaves, *v_leaves)
    o_s, l_s, m_s = outs[:3]  # [B, K, S, Gp, E], [B, K, S, Gp], [B, K, S, Gp]

    m = m_s.max(axis=2)  # [B, K, Gp]
    corr = jnp.exp(m_s - m[:, :, None])  # [B, K, S, Gp]
    l = (corr * l_s).sum(axis=2)[:, :, :G]  # [B, K, G]
    m = m[:, :, :G]
    l_safe = jnp.where(l > 0, l, 1.0)
    o = jnp.einsum("BKSG,BKSGE->BKGE", corr, o_s)[:, :, :G] / l_safe[..., None]  # [B, K, G, E]
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)  # [B, K, G] over the pages
    if extra_lse is not None:
        lse_all = jnp.logaddexp(lse, extra_lse.reshape(B, K, G))  # [B, K, G]
        o = o * jnp.where(l > 0, jnp.exp(lse - lse_all), 0.0)[..., None]
        lse = lse_all
    mass = None
    if return_mass:
        scores = outs[3][:, :, :G, : M * page]  # [B, K, G, T]
        valid = _valid_tokens(block_tables, lengths, page, P)[:, None, None, :]  # [B, 1, 1, T]
        mass = _probs(scores, valid, lse[..., None]).sum(axis=2)  # [B, K, T]
    return _outputs(q, o, mass, lse if return_lse else None)


# --------------------------------------------------------------------------- reference


def gather_pages(pages, block_tables, layer=None):
    """Dequantized k or v of every row, in token order: [B, K, M*page, E] float32."""
    pages = _as_5d(pages)
    n_pool = jax.tree.leaves(pages)[0].shape[2]
    ids = jnp.clip(block_tables, 0, n_pool - 1)  # [B, M]
    li = 0 if layer is None else layer
    sel = jax.tree.map(lambda x: x[li][:, ids], pages)  # leaves [K, B, M, page, X]
    x = decode_pages(sel)  # [K, B, M, page, E]
    K, B, M, page, E = x.shape
    return jnp.transpose(x, (1, 0, 2, 3, 4)).reshape(B, K, M * page, E)


def paged_attention_reference(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    layer=None,
    sm_scale=None,
    return_mass=False,
    extra_lse=None,
    return_lse=False,
):
    """Pure-jnp paged decode attention through gathers (same contract as `paged_attention`)."""
    B, H, E = q.shape
    page = jax.tree.leaves(k_pages)[0].shape[-2]
    n_pool = jax.tree.leaves(k_pages)[0].shape[-3]
    k = gather_pages(k_pages, block_tables, layer)  # [B, K, T, E]
    v = gather_pages(v_pages, block_tables, layer)  # [B, K, T, E]
    K = k.shape[1]
    qg = q.reshape(B, K, H // K, E).astype(jnp.float32)  # [B, K, G, E]
    scale = 1.0 / math.sqrt(E) if sm_scale is None else sm_scale
    s = jnp.einsum("BKGE,BKTE->BKGT", qg, k, precision=lax.Precision.HIGHEST) * scale
    valid = _valid_tokens(block_tables, lengths, page, n_pool)[:, None, None, :]  # [B, 1, 1, T]
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)  # [B, K, G, 1]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid, jnp.exp(s - m), 0.0)  # [B, K, G, T]
    denom = p.sum(-1, keepdims=True)  # [B, K, G, 1]
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    if extra_lse is not None:
        lse = jnp.logaddexp(lse, extra_lse.reshape(B, K, H // K, 1).astype(jnp.float32))
    p = _probs(s, valid, lse)  # [B, K, G, T]
    v = jnp.where(valid[:, :, 0, :, None], v, 0.0)
    o = jnp.einsum("BKGT,BKTE->BKGE", p, v, precision=lax.Precision.HIGHEST)  # [B, K, G, E]
    return _outputs(q, o, p.sum(axis=2) if return_mass else None, lse if return_lse else None)
