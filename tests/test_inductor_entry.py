"""A warm start loads Inductor's compile of the leftover ops by the key the compile cache entry kept
(dzc/inductor_entry.py), and only where that is still the compile Inductor would find: not under another Inductor
config, and not when the entry is gone from Inductor's cache (then the fallback compiles as before, with the right
outputs). The positive case with the outlining, bit for bit: tests/test_outline_regions.py's warm test."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from dzc import inductor_entry


def test_the_fingerprint_follows_inductors_config():
    """Everything Inductor's key hashes but the graph: the same twice, another under another config."""
    first = inductor_entry.fingerprint()
    assert first is not None and first == inductor_entry.fingerprint()
    with torch._inductor.config.patch(fallback_random=not torch._inductor.config.fallback_random):
        assert inductor_entry.fingerprint() not in (None, first)
    assert inductor_entry.fingerprint() == first


def test_a_warm_start_loads_by_key_only_where_inductor_would_find_the_same(seed, tmp_path, monkeypatch):
    import dzc
    from dzc import capture, compile_cache
    from dzc.models import build_model

    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(seed)
    model, inputs = build_model("llama_decoder", layers=2)
    # fp32: Inductor's C++ kernels against eager at fp32 tolerances
    model, inputs = model.float(), [i.float() if i.is_floating_point() else i for i in inputs]
    with torch.no_grad():
        expected = model(*inputs)
    options = dzc.CompileOptions(cache_dir=str(tmp_path / "dzc"), autotune=False, fallback="inductor")

    def compile_once(context=None, serial=1000):
        # The kernel ids in the graph Inductor hashes name the compiled model's serial: as in a fresh process.
        monkeypatch.setattr(capture, "_BACKEND_SERIAL", itertools.count(serial))
        with context or torch._inductor.config.patch({}):
            compiled = dzc.compile(model, "cuda", options)
            with torch.no_grad():
                out = compiled(*inputs)
        report = compiled.report
        del compiled
        gc.collect()
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        assert report.frame_cache.startswith("hit (1 graph") or not report.graphs[0].inductor_by_key
        return report

    cold = compile_once()
    assert not cold.graphs[0].inductor_by_key
    # Another Inductor config: another fingerprint, so Inductor compiles for it, not what the cold compile made.
    changed = compile_once(torch._inductor.config.patch(fallback_random=not torch._inductor.config.fallback_random))
    assert changed.frame_cache.startswith("hit (1 graph") and not changed.graphs[0].inductor_by_key
    assert changed.graphs[0].inductor_key_unused == "Inductor's configuration or system differs from the cold compile's"
    # The entry gone from Inductor's cache (a cleared cache, the artifacts not loaded): compiled again.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-empty"))
    with monkeypatch.context() as patched:
        patched.setattr(compile_cache, "load_torch_artifacts", lambda artifacts: None)
        gone = compile_once()
    assert gone.frame_cache.startswith("hit (1 graph") and not gone.graphs[0].inductor_by_key
    assert gone.graphs[0].inductor_key_unused.startswith("Inductor's cache has no entry under the key")
    # As it was: by the key (the artifacts put the entry back into the empty cache directory).
    warm = compile_once()
    assert warm.graphs[0].inductor_by_key and not warm.graphs[0].inductor_key_unused
    assert "loaded by the key" in str(warm)
    # A model compiled after others in its process gets other kernel ids than the cold compile's, which Inductor's
    # stored code calls (in another process, ids not loaded there: session 53's CI): compiled for its own ids.
    later = compile_once(serial=2000)
    assert later.frame_cache.startswith("hit (1 graph") and not later.graphs[0].inductor_by_key
    assert all(".m2000" in kernel.kernel_id for kernel in later.kernels)
    assert "not by the key the compile cache entry kept: the graph calls other kernel ids" in str(later)


@pytest.mark.parametrize("cache_on", [True, False])
def test_a_key_is_kept_where_inductors_cache_is_on(seed, tmp_path, monkeypatch, cache_on):
    """A cold compile keeps Inductor's key with the compile cache entry; none where Inductor's FX graph cache is
    off (nothing to load it by)."""
    import dzc
    from dzc import compile_cache
    from dzc.models import build_model

    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    torch.manual_seed(seed)
    model, inputs = build_model("llama_decoder", layers=1)
    stored = []
    real_store = compile_cache.CompileCache.store
    monkeypatch.setattr(compile_cache.CompileCache, "store",
                        lambda self, *args: stored.append(args[-1]) or real_store(self, *args))
    with torch._inductor.config.patch(fx_graph_cache=cache_on):
        compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False,
                                                                 fallback="inductor"))
        with torch.no_grad():
            compiled(*inputs)
        fingerprint = inductor_entry.fingerprint()
    [record] = stored
    assert (record is not None) == cache_on
    if cache_on:
        assert record.fingerprint == fingerprint and record.key
