"""Paged decode-attention kernel against its jnp reference.

On CPU the kernel runs with interpret=True; on a GPU the same tests run compiled (INTERPRET is
False there). Shapes are tiny: interpret cost grows with grid steps and compile count.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import formats
from kvjax.formats import QuantPages, decode_pages, get_format
from kvjax.kernels import paged_attention as pa

INTERPRET = jax.devices()[0].platform != "gpu"
E = 16  # smallest head dim the compiled (Triton) kernel takes


def _encode(x, kind, group=8):
    """x [..., E] as `kind` pages, by the format's page codec (int4: per-token groups)."""
    options = {"group": group, "key_mode": "token"} if kind == "int4" else {}
    return get_format(kind, **options).page_codec("k").encode(x)


def _pages(rng, kind, K, P, page, group=8):
    x = jnp.asarray(rng.normal(size=(K, P, page, E)), jnp.float32)  # [K, P, page, E]
    return _encode(x, kind, group)


def _case(seed, kind, G, page, lengths, K=2, extra_pages=2, q_dtype=jnp.float32):
    """Random pages, a permuted pool and block tables covering `lengths`."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    M = max(1, max(-(-n // page) for n in lengths))
    P = B * M + extra_pages
    perm = rng.permutation(P)
    bt = np.full((B, M), pa.NO_PAGE, np.int32)
    for b, n in enumerate(lengths):
        used = -(-n // page)
        bt[b, :used] = perm[b * M : b * M + used]
    q = jnp.asarray(rng.normal(size=(B, K * G, E)), q_dtype)  # [B, H, E]
    return (
        q,
        _pages(rng, kind, K, P, page),
        _pages(rng, kind, K, P, page),
        jnp.asarray(bt),
        jnp.asarray(lengths, jnp.int32),
    )


def _tol(q_dtype):
    if q_dtype == jnp.bfloat16:
        return {"atol": 2e-2, "rtol": 2e-2}
    return {"atol": 1e-4, "rtol": 1e-4}


# (storage kind, G, page, lengths, splits, return_mass, q dtype): lengths include 1 and exact
# page boundaries; each storage kind, GQA ratio 1/3/8 and page size 8/16/64 appears.
CASES = [
    ("f32", 1, 8, [1, 8, 16, 21], 2, True, jnp.float32),
    ("bf16", 3, 16, [16, 1, 33], 2, False, jnp.bfloat16),
    ("bf16", 8, 64, [64, 1, 100], 1, True, jnp.float32),
    ("int8", 3, 8, [24, 1, 7], 3, True, jnp.float32),
    ("int8", 8, 16, [1, 32], 1, False, jnp.bfloat16),
    ("int4", 1, 16, [17, 1, 48], 2, True, jnp.float32),
    ("int4", 3, 64, [64, 1], 1, False, jnp.bfloat16),
]


@pytest.mark.parametrize("kind,G,page,lengths,splits,mass,q_dtype", CASES)
def test_matches_reference(kind, G, page, lengths, splits, mass, q_dtype):
    q, kp, vp, bt, ln = _case(0, kind, G, page, lengths, q_dtype=q_dtype)
    got = pa.paged_attention(
        q, kp, vp, bt, ln, num_splits=splits, return_mass=mass, interpret=INTERPRET
    )
    want = pa.paged_attention_reference(q.astype(jnp.float32), kp, vp, bt, ln, return_mass=mass)
    if mass:
        (got, got_mass), (want, want_mass) = got, want
        assert got_mass.shape == (
            len(lengths),
            kp.q.shape[0] if isinstance(kp, QuantPages) else kp.shape[0],
            bt.shape[1] * page,
        )
        np.testing.assert_allclose(
            got_mass, want_mass, atol=1e-4 if q_dtype == jnp.float32 else 2e-2
        )
        np.testing.assert_allclose(np.asarray(got_mass).sum(-1), G, rtol=1e-4)
        past = np.arange(bt.shape[1] * page)[None, :] >= np.asarray(ln)[:, None]
        assert np.all(np.asarray(got_mass)[np.broadcast_to(past[:, None], got_mass.shape)] == 0)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), **_tol(q_dtype))


def test_evicted_pages_garbage_and_empty_rows():
    """NO_PAGE entries (page-granular eviction) are skipped; NaN/inf in pages that are not
    attended never leaks; a row of length 0 gives zeros."""
    page = 8
    q, kp, vp, bt, ln = _case(1, "f32", 2, page, [20, 0, 24])
    bt = bt.at[0, 1].set(pa.NO_PAGE).at[2, 0].set(pa.NO_PAGE)
    used = set(np.asarray(bt)[np.asarray(bt) >= 0].tolist())
    unused = jnp.asarray([p for p in range(kp.shape[1]) if p not in used])
    kp = kp.at[:, unused].set(jnp.nan)
    vp = vp.at[:, unused].set(jnp.inf)
    # row 0's last page is half full: poison its tail too
    kp = kp.at[:, bt[0, 2], 4:].set(jnp.inf)
    vp = vp.at[:, bt[0, 2], 4:].set(jnp.nan)
    got, mass = pa.paged_attention(
        q, kp, vp, bt, ln, num_splits=2, return_mass=True, interpret=INTERPRET
    )
    want, want_mass = pa.paged_attention_reference(q, kp, vp, bt, ln, return_mass=True)
    assert np.isfinite(np.asarray(got)).all() and np.isfinite(np.asarray(mass)).all()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(mass, want_mass, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got)[1], 0.0)
    assert float(jnp.abs(mass[0, :, 8:16]).max()) == 0.0  # evicted page holds no mass


def test_layer_axis_under_jit():
    """Pools with a leading layer axis, the layer a traced index (as in the model's scan)."""
    page, L = 16, 3
    q, kp, vp, bt, ln = _case(2, "int8", 2, page, [5, 40])
    kl = jax.tree.map(lambda x: jnp.stack([x * 0, x, x * 0]), kp)  # leaves [L, K, P, page, X]
    vl = jax.tree.map(lambda x: jnp.stack([x * 0, x, x * 0]), vp)

    @jax.jit
    def run(layer, bt):
        return pa.paged_attention(q, kl, vl, bt, ln, layer=layer, interpret=INTERPRET)

    np.testing.assert_allclose(
        run(1, bt), pa.paged_attention_reference(q, kp, vp, bt, ln), atol=1e-4, rtol=1e-4
    )
    assert L == jax.tree.leaves(kl)[0].shape[0]


def test_traced_out_of_pool_entry_is_masked_not_read():
    """Under jit a table entry outside the pool cannot raise; it is masked like NO_PAGE."""
    q, kp, vp, bt, ln = _case(3, "f32", 1, 8, [16, 16])
    bad = bt.at[1, 0].set(10_000)
    got = jax.jit(lambda t: pa.paged_attention(q, kp, vp, t, ln, interpret=INTERPRET))(bad)
    want = pa.paged_attention_reference(q, kp, vp, bt.at[1, 0].set(pa.NO_PAGE), ln)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- errors (no kernel run)


def test_bad_page_size_names_valid_choices():
    q, kp, vp, bt, ln = _case(4, "f32", 1, 8, [8])
    kp, vp = kp[:, :, :6], vp[:, :, :6]
    with pytest.raises(ValueError, match=r"page size 6 .*valid page sizes: 8, 16, 32, 64"):
        pa.paged_attention(q, kp, vp, bt, ln, interpret=True)


def test_block_table_outside_pool_raises():
    q, kp, vp, bt, ln = _case(5, "f32", 1, 8, [8, 9])
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 99 points outside the pool"):
        pa.paged_attention(q, kp, vp, bt.at[1, 1].set(99), ln, interpret=True)
    with pytest.raises(ValueError, match="lengths must lie in"):
        pa.paged_attention(q, kp, vp, bt, ln.at[0].set(1000), interpret=True)


def test_shape_errors():
    q, kp, vp, bt, ln = _case(6, "f32", 3, 8, [8, 9])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        pa.paged_attention(q[:, :5], kp, vp, bt, ln, interpret=True)
    with pytest.raises(ValueError, match="pages_per_block=1 with page size 8"):
        pa.paged_attention(q, kp, vp, bt, ln, pages_per_block=1, interpret=True)
    with pytest.raises(ValueError, match="head dim"):
        pa.paged_attention(q[..., :8], kp, vp, bt, ln, interpret=True)


# --------------------------------------------------------------------------- storage layouts


def test_quantized_layouts_match_kvjax_formats():
    """Pages use kvjax.formats' per-token layouts: int8 q·scale, int4 packed nibbles."""
    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 8, 32)), jnp.float32)
    p8 = _encode(x, "int8")
    d8 = formats.quantize_int8(x)
    np.testing.assert_array_equal(p8.q, d8["q"])
    np.testing.assert_allclose(decode_pages(p8), formats.dequantize_int8(d8))
    p4 = _encode(x, "int4", group=16)
    d4 = formats.quantize_per_token(x, 4, 16)
    np.testing.assert_array_equal(p4.q, d4["q"])
    np.testing.assert_allclose(decode_pages(p4), formats.dequantize_per_token(d4, 4, 16))
    # nibble order: element 2i low, 2i+1 high
    c = np.asarray(p4.q[0, 0, 0, 0])
    codes = np.round(
        (np.asarray(x[0, 0, 0, :2]) - float(p4.zero[0, 0, 0, 0])) / float(p4.scale[0, 0, 0, 0])
    )
    assert (c & 15, c >> 4) == tuple(np.clip(codes, 0, 15).astype(int))


def test_quantized_pages_close_to_float():
    x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 64)), jnp.float32)
    for kind, tol in (("int8", 0.02), ("int4", 0.3), ("bf16", 0.01)):
        err = np.abs(np.asarray(decode_pages(_encode(x, kind, group=32)) - x))
        assert err.max() < tol, (kind, err.max())


def test_valid_tokens_and_probs_by_hand():
    """The mask the kernel wrapper and the reference share, checked independently of both:
    a slot counts when it is below the row's length and its page is inside the pool."""
    block_tables = jnp.asarray([[0, 3, -1], [2, 5, 1]])  # pool of 4 pages: 5 is outside
    got = np.asarray(pa._valid_tokens(block_tables, jnp.asarray([5, 6]), 2, 4))  # page size 2
    want = np.array([[1, 1, 1, 1, 0, 0],  # tokens 0-3 on pages 0, 3; token 4 on page -1
                     [1, 1, 0, 0, 1, 1]], bool)  # page 5 is outside the pool
    np.testing.assert_array_equal(got, want)
    scores = jnp.log(jnp.asarray([[1.0, 2.0, 5.0]]))
    valid = jnp.asarray([[True, True, False]])
    lse = jnp.log(jnp.asarray([[3.0]]))
    np.testing.assert_allclose(pa._probs(scores, valid, lse), [[1 / 3, 2 / 3, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(pa._probs(scores, valid, jnp.full((1, 1), -jnp.inf)),
                                  [[1.0, 2.0, 0.0]])  # no attended token: lse -inf is not used


# --------------------------------------------------------------------------- CUDA lowering


def _lowering_variants():
    """Every storage kind x GQA group 1/3/8 x return_mass on/off, with split-K off (1), two
    splits and the default, page sizes 8/16/64 and q in f32 and bf16 spread over them; then
    the remaining options one at a time (layer axis, extra/returned lse, a wider block_g, more
    pages per block, mixed k/v storage, other warps/stages)."""
    out = []
    for i, (kind, G, mass) in enumerate(itertools.product(
            ["f32", "bf16", "int8", "int4"], [1, 3, 8], [True, False])):
        q_dtype = jnp.float32 if kind == "f32" or i % 4 == 1 else jnp.bfloat16
        out.append({"kind": kind, "G": G, "mass": mass, "page": (8, 16, 64)[i % 3],
                    "splits": (1, 2, None)[(i // 3) % 3], "q_dtype": q_dtype})
    base = {"kind": "int4", "G": 3, "mass": True, "page": 16, "splits": 2, "q_dtype": jnp.bfloat16}
    for extra in [{"layers": 3}, {"lse": True}, {"block_g": 32}, {"ppb": 8},
                  {"v_kind": "int8"}, {"kind": "int8", "v_kind": "f32", "q_dtype": jnp.float32},
                  {"warps": 8, "stages": 3}]:
        out.append(base | extra)
    return out


def _variant_id(v):
    return "-".join(f"{k}={getattr(x, '__name__', x)}" for k, x in v.items())


def cuda_target():
    """The GPU the lowering targets, as an abstract device: jax 0.12's Triton lowering asks the
    device for its compute capability and, on a host without a GPU, needs one named (an H200,
    the GPU this project is lent). jax 0.10-0.11 lower without it."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev))


@pytest.mark.parametrize("v", _lowering_variants(), ids=_variant_id)
def test_compiled_kernel_lowers_to_triton_for_cuda(v):
    """The compiled kernel (interpret=False) lowers for CUDA on any host, in every variant it
    has: Pallas emits the Triton IR of one custom call (no GPU needed; compiling that IR to PTX,
    and running it, needs one). Inputs are abstract (jax.eval_shape), so nothing runs.

    A length of 256 tokens is 4 blocks of 64 tokens at every page size (2 of 128 with
    ppb=8): 2 splits give a grid of (B, K, 2); the default fills the GPU, capped at one split
    per block."""
    page, G, K = v["page"], v["G"], 2
    lengths = [256, 5]

    def case():
        q, kp, vp, bt, ln = _case(9, v["kind"], G, page, lengths, K=K, q_dtype=v["q_dtype"])
        if "v_kind" in v:
            x = jnp.ones((K, jax.tree.leaves(vp)[0].shape[1], page, E), jnp.float32)
            vp = _encode(x, v["v_kind"])
        if "layers" in v:  # [L, K, P, page, X] pages, the layer a traced index
            kp, vp = jax.tree.map(lambda x: jnp.stack([x] * v["layers"]), (kp, vp))
        return q, kp, vp, bt, ln

    args = jax.eval_shape(case)

    def run(q, kp, vp, bt, ln, layer):
        extra = jnp.zeros(q.shape[:2], jnp.float32) if v.get("lse") else None
        return pa.paged_attention(
            q, kp, vp, bt, ln, layer=layer if "layers" in v else None, return_mass=v["mass"],
            num_splits=v["splits"], pages_per_block=v.get("ppb"), block_g=v.get("block_g"),
            extra_lse=extra, return_lse=v.get("lse", False), num_warps=v.get("warps", 4),
            num_stages=v.get("stages", 2), interpret=False)

    with cuda_target():
        lowered = jax.jit(run).trace(*args, jnp.int32(1)).lower(lowering_platforms=("cuda",))
    calls = [line for line in lowered.as_text().splitlines()
             if "custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1
    ppb = v.get("ppb") or pa.default_pages_per_block(page)
    n_blocks = lengths[0] // (ppb * page)
    splits = min(v["splits"] or n_blocks, n_blocks)
    assert f'name = "paged_attention_page{page}_ppb{ppb}"' in calls[0]
    assert f"grid_x = 2 : i32, grid_y = {K} : i32, grid_z = {splits} : i32" in calls[0]
    assert f"num_warps = {v.get('warps', 4)}" in calls[0]
    outs = jax.tree.leaves(lowered.out_info)
    want = [(2, K * G, E)] + [(2, K, 256 // page * page)] * v["mass"] + [(2, K * G)] * v.get(
        "lse", False)
    assert [o.shape for o in outs] == want
