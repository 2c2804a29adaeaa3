"""serving_gpu --cold: the caches a first start fills are found from the environment and emptied (folders
kept), and a folder holding the home folder or the checkout is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import serving_gpu


def test_cold_empties_the_triton_tuning_and_flashinfer_caches(tmp_path, monkeypatch) -> None:
    triton, tuning, fi = tmp_path / "triton", tmp_path / "tuning", tmp_path / "fi"
    for folder in (triton / "ab12", tuning, fi / ".cache" / "flashinfer" / "90"):
        folder.mkdir(parents=True)
        (folder / "x.bin").write_text("x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    monkeypatch.setenv("MOEMESH_TUNING_DIR", str(tuning))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(fi))
    caches = serving_gpu.cold_caches()
    assert caches == {
        "triton_cache": triton,
        "tuning": tuning,
        "flashinfer_jit": fi / ".cache" / "flashinfer",
    }
    emptied = serving_gpu.empty_caches(caches)
    assert emptied == {k: str(v.resolve()) for k, v in caches.items()}
    assert all(v.is_dir() and not list(v.iterdir()) for v in caches.values())
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE")
    assert "flashinfer_jit" not in serving_gpu.cold_caches()
    assert serving_gpu.parse_args(["--cold"]).cold and not serving_gpu.parse_args([]).cold


def test_cold_refuses_the_home_folder_and_the_checkout(tmp_path) -> None:
    for folder in (Path.home(), Path(serving_gpu.__file__).parents[1], Path("/")):
        with pytest.raises(ValueError, match="refusing"):
            serving_gpu.empty_caches({"triton_cache": folder})
