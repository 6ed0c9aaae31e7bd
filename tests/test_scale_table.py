"""docs/scale.md's arithmetic: a cell against the closed form, the per-device rule, the doc."""

import pytest

from experiments import scale_table as st
from kvjax.cache import closed_form_bytes
from kvjax.mesh import MeshSpec


def test_a_cell_is_the_closed_form_and_shards_over_kv_heads_then_batch():
    cfg = st.MODELS["Llama-3-70B"]
    one = st.cell("Llama-3-70B", "full bf16", 131072, 8, 1)
    assert one["kv"] == closed_form_bytes(cfg, 131072, 2, batch=8) == 2 * 80 * 8 * 128 * 131072 * 2 * 8
    pos = 80 * 8 * 8 * 131072 * 4  # int32 position per slot and kv head
    assert one["total"] == one["kv"] + pos + 8 * 4 + 80  # + lengths [B] int32, flags [L]
    eight = st.cell("Llama-3-70B", "full bf16", 131072, 8, 8)
    assert eight["mesh"] == MeshSpec(data=1, model=8) and eight["reasons"] == ()
    assert eight["per_device"] == (one["kv"] + pos) // 8 + 8 * 4 + 80
    many = st.cell("Llama-3-70B", "full bf16", 131072, 8, 64)
    assert many["mesh"] == MeshSpec(data=8, model=8)
    assert many["per_device"] == (one["kv"] + pos) // 64 + 4 + 80
    b1 = st.cell("Llama-3-70B", "full bf16", 131072, 1, 64)  # batch 1: kv heads only
    assert b1["reasons"] == ("batch rows: 1 do not divide over mesh.data=8; replicated",)


@pytest.mark.parametrize("setting, ratio", [("full int4", (0.25, 0.33)), ("h2o 10 % bf16", (0.1, 0.11))])
def test_formats_and_budgets_shrink_the_cache(setting, ratio):
    full = st.cell("Llama-3-8B", "full bf16", 32768, 1, 1)["total"]
    got = st.cell("Llama-3-8B", setting, 32768, 1, 1)["total"] / full
    assert ratio[0] < got < ratio[1]


def test_the_doc_is_written_with_every_row(tmp_path):
    text = st.write_doc(tmp_path / "scale.md")
    rows = [line for line in text.splitlines() if line.startswith("| Llama-3-")]
    n = len(st.MODELS) * len(st.CONTEXTS) * len(st.BATCHES) * len(st.SETTINGS)
    assert len(rows) == n + len(st.MODELS)  # + the weights table
    assert "| Llama-3-8B | 32k | 1 | full bf16 | 4.0 | 4.0 | 0.5 | 0.5* |" in text


def test_cli_makes_the_out_folder_first_and_rejects_a_directory(tmp_path, monkeypatch, capsys):
    written = []
    monkeypatch.setattr(st, "write_doc", lambda path: written.append(path.parent.is_dir()))
    st.main(["--out", str(tmp_path / "new" / "deeper" / "scale.md")])
    assert written == [True]
    with pytest.raises(SystemExit) as e:
        st.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "is a directory" in capsys.readouterr().err
    assert written == [True]
