"""TileLang kernels built ahead in child processes (DZC_TILELANG_PREBUILD, targets/tilelang_codegen.py): the child
builds the untuned config into TileLang's kernel cache and the first call in this process reads it from there.

Runs wherever TileLang and nvcc are (TileLang compiles a kernel for a CUDA target without a GPU; nothing runs)."""

from __future__ import annotations

import shutil

import pytest
import torch

from dzc import config
from dzc.targets import add_rms_norm, tilelang_codegen
from dzc.targets.add_rms_norm import AddRmsNormSpec
from dzc.targets.profiles import SM_90

pytestmark = pytest.mark.skipif(not tilelang_codegen.installed() or shutil.which("nvcc") is None,
                                reason="needs TileLang and nvcc")

FP32 = torch.float32
# Two kernels: TileLang also keeps the kernels it loaded in memory, so the two halves of the test need their own.
SPECS = {"1": AddRmsNormSpec(64, FP32, FP32, FP32, FP32, FP32, True, False),
         "0": AddRmsNormSpec(128, FP32, FP32, FP32, FP32, FP32, True, False)}


def _first_call_builds(tmp_path, monkeypatch, prebuild: str):
    """Load the kernel as lowering does, with a fresh TileLang cache, then get its untuned config's kernel as the
    first launch does: (what this process compiled itself, how the prebuild ended per config)."""
    tmp_path.mkdir()
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang_cache"))
    path = tmp_path / "add_rms_norm_prebuild.py"
    spec = SPECS[prebuild]
    path.write_text(add_rms_norm.tilelang_source(spec, SM_90))
    from tilelang.jit.kernel import JITKernel

    # TileLang compiles a kernel in JITKernel._compile_and_create_adapter; a kernel-cache hit skips it.
    compiled_here = []
    compile_and_create = JITKernel._compile_and_create_adapter

    def counted(kernel, *args, **kwargs):
        compiled_here.append(kernel)
        return compile_and_create(kernel, *args, **kwargs)

    monkeypatch.setattr(JITKernel, "_compile_and_create_adapter", counted)
    with config.scope(DZC_TILELANG_PREBUILD=prebuild):
        kernels = tilelang_codegen.load(add_rms_norm, path, spec, SM_90)
    assert kernels.prebuilding == int(prebuild)  # what lowering's record notes
    kernels.kernel_for(add_rms_norm.tilelang_default_config(spec, SM_90))
    assert kernels.prebuilding == 0
    return compiled_here, kernels.prebuilt


def test_the_first_call_reads_the_kernel_a_child_built(tmp_path, monkeypatch):
    import tilelang

    default = add_rms_norm.tilelang_default_config(SPECS["1"], SM_90)
    compiled_here, prebuilt = _first_call_builds(tmp_path / "on", monkeypatch, "1")
    assert prebuilt == {default: "built"} and compiled_here == [], (prebuilt, compiled_here)
    assert tilelang.env.is_cache_enabled()
    # Without the prebuild the first call compiles its kernel here: what the check above would have seen.
    compiled_here, prebuilt = _first_call_builds(tmp_path / "off", monkeypatch, "0")
    assert prebuilt == {} and len(compiled_here) == 1, (prebuilt, compiled_here)


def test_a_kernel_in_the_cache_is_not_built_ahead_again(tmp_path, monkeypatch):
    """A warm start: the kernel's prim_func comes from its record (TileLang's front end does not run again) and no
    child builds it ahead (one would only load it, while the first launch waited for it)."""
    spec = AddRmsNormSpec(96, FP32, FP32, FP32, FP32, FP32, True, False)
    default = add_rms_norm.tilelang_default_config(spec, SM_90)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang_cache"))
    path = tmp_path / "add_rms_norm_warm.py"
    path.write_text(add_rms_norm.tilelang_source(spec, SM_90))
    assert not tilelang_codegen.in_kernel_cache(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    built = tilelang_codegen.compile_for_device(path, add_rms_norm.TILELANG_FACTORY_NAME, default, SM_90)
    assert tilelang_codegen.in_kernel_cache(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    # A process with another TileLang cache has not got it
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "another_cache"))
    assert not tilelang_codegen.in_kernel_cache(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang_cache"))

    def no_front_end(*args):
        raise AssertionError("the factory ran: the prim_func record was not read")

    monkeypatch.setattr(tilelang_codegen, "load_factory", no_front_end)
    with config.scope(DZC_TILELANG_PREBUILD="1"):
        kernels = tilelang_codegen.load(add_rms_norm, path, spec, SM_90)
    assert kernels.prebuilding == 0
    loaded = kernels.kernel_for(default)
    # The recorded prim_func is the factory's: the same script, so the same TileLang cache key and kernel.
    assert loaded.prim_func.script(show_meta=True) == built.prim_func.script(show_meta=True)
    assert loaded.get_kernel_source() == built.get_kernel_source()


def test_a_damaged_prim_func_record_is_built_again(tmp_path):
    spec = AddRmsNormSpec(64, FP32, FP32, FP32, FP32, FP32, True, False)
    default = add_rms_norm.tilelang_default_config(spec, SM_90)
    path = tmp_path / "add_rms_norm_record.py"
    path.write_text(add_rms_norm.tilelang_source(spec, SM_90))
    built = tilelang_codegen.build_prim_func(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    record = tilelang_codegen.prim_func_record(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    text = record.read_text()
    record.write_text(text[: len(text) // 2])
    again = tilelang_codegen.build_prim_func(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    assert again.script(show_meta=True) == built.script(show_meta=True)
    assert record.read_text() == text  # recorded again
    # Another module text is another record: an edited kernel never gets the old prim_func.
    path.write_text(path.read_text() + "\n# edited\n")
    assert tilelang_codegen.prim_func_record(path, add_rms_norm.TILELANG_FACTORY_NAME, default) != record


def test_a_prim_func_whose_json_reads_back_otherwise_is_not_recorded(tmp_path, monkeypatch):
    from tilelang import tvm

    spec = AddRmsNormSpec(64, FP32, FP32, FP32, FP32, FP32, True, False)
    default = add_rms_norm.tilelang_default_config(spec, SM_90)
    path = tmp_path / "add_rms_norm_unrecorded.py"
    path.write_text(add_rms_norm.tilelang_source(spec, SM_90))
    other = tmp_path / "add_rms_norm_other.py"
    other.write_text(add_rms_norm.tilelang_source(AddRmsNormSpec(128, FP32, FP32, FP32, FP32, FP32, True, False),
                                                  SM_90))
    other_json = tvm.ir.save_json(tilelang_codegen.build_prim_func(other, add_rms_norm.TILELANG_FACTORY_NAME, default))
    other_script = tvm.ir.load_json(other_json).script(show_meta=True)
    record = tilelang_codegen.prim_func_record(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
    for save_json in (lambda func: other_json, lambda func: (_ for _ in ()).throw(ValueError("cannot serialize"))):
        monkeypatch.setattr(tvm.ir, "save_json", save_json)
        built = tilelang_codegen.build_prim_func(path, add_rms_norm.TILELANG_FACTORY_NAME, default)
        assert built.script(show_meta=True) != other_script and not record.exists()
