"""bench/ablation_probe.py without a GPU: every variant's text edits still match this tree's kernel sources exactly once
(the probe stops on a stale edit; this catches it when the kernel changes, not on the next device call)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import ablation_probe  # noqa: E402


@pytest.mark.parametrize("name", sorted(ablation_probe.VARIANTS) + sorted(ablation_probe.MOE_VARIANTS))
def test_variant_edits_apply_to_this_tree(name, tmp_path):
    edits = {**ablation_probe.VARIANTS, **ablation_probe.MOE_VARIANTS}[name]
    kdir = ablation_probe.write_variant_dir(name, edits, tmp_path / name)
    for fname, old, new in edits:
        text = (kdir / fname).read_text()
        assert old not in text or old in new, f"{name}: {fname} still holds the text the edit replaces"
        assert new in text
