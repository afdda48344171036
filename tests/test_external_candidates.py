"""External candidates (another library's kernel for a dzc op, e.g. MATE on MUSA): the wiring from provider to
tuner to launch, and MATE's adapters.

MATE cannot be installed here (it needs a Moore Threads MP31 card), so the wiring is exercised with a provider
of our own plugged into the same hook (targets/external_kernels.PROVIDERS): the add_rms_norm op's reference
implementation, a real alternative that on CPU tensors is far faster than a Triton-interpreted kernel. The MATE
adapters are tested without MATE: where each applies (profile, versions, spec), and their argument mapping,
checked by feeding the mapped arguments to a plain-torch statement of the MATE function's documented contract
(written below from MATE's docstrings and tests; it is not MATE) and comparing with the dzc op's reference. The
last test runs the real MATE calls; it runs only where MATE and a MUSA device are present.
"""

import json
import logging

import pytest
import torch
from conftest import compile_tuned_and_check

from dzc.autotune import ExternalCandidate
from dzc.models.decoder import AddRMSNorm
from dzc.ops.add_rms_norm import add_rms_norm_reference
from dzc.ops.dsa import dsa_indexer_reference, sparse_attention_reference
from dzc.ops.varlen_attention import varlen_attention_reference
from dzc.targets import dsa_cases, external_kernels, mate_kernels, varlen_attention
from dzc.targets.dsa_indexer import DsaIndexerSpec
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90
from dzc.targets.sparse_attention import SparseAttentionSpec

# DeepSeek-V3.2's selection width and cache page size (the sparse attention specs' static sizes).
DSA_V32 = dict(topk=2048, page_size=64)

REFERENCE_NAME = "test.add_rms_norm_reference"


class CountingReference:
    """An external add_rms_norm: the op's plain-torch reference, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *op_args):
        self.calls += 1
        return add_rms_norm_reference(*op_args)


def _provide(monkeypatch, name: str, fn) -> None:
    """Plug a provider offering `fn` for add_rms_norm into the hook, next to MATE's."""
    def provider(op, spec, profile):
        return [ExternalCandidate(name, fn)] if op == "add_rms_norm" else []
    monkeypatch.setattr(external_kernels, "PROVIDERS", [*external_kernels.PROVIDERS, provider])


def _compile_and_run(cache_dir, tokens_list=(3, 9)):
    """AddRMSNorm compiled for cuda (Triton interpreter on CPU tensors) with tuning on; every output checked
    against eager. Returns the compiled model, the model and the last call's inputs."""
    model = AddRMSNorm().bfloat16()
    compiled, inputs = compile_tuned_and_check(model, cache_dir, tokens_list)
    return compiled, model, inputs


def _database_entries(cache_dir) -> list[dict]:
    return list(json.loads((cache_dir / "tuning.json").read_text())["entries"].values())


def test_a_faster_external_candidate_is_timed_recorded_and_launched(tmp_path, seed, monkeypatch):
    reference = CountingReference()
    _provide(monkeypatch, REFERENCE_NAME, reference)
    cache = tmp_path / "cache"
    compiled, model, (x, residual) = _compile_and_run(cache)

    [kernel] = compiled.report.kernels
    assert kernel.external_candidates == [REFERENCE_NAME]
    assert sorted(kernel.tuned) == [4, 16]
    for bucket, entry in kernel.tuned.items():
        assert entry["from_cache"] is False and entry["external"] == REFERENCE_NAME, (bucket, entry)
        assert entry["external_failures"] == {}
    entries = _database_entries(cache)
    assert sorted(e["key"]["token_bucket"] for e in entries) == [4, 16]
    for entry in entries:  # timed like a config, faster than the fastest one, recorded by name
        assert entry["external"] == REFERENCE_NAME
        assert 0 < entry["external_seconds_per_call"] < entry["seconds_per_call"], entry

    # The launch runs the winner: one more call, one more reference call, and the reference's exact result.
    calls = reference.calls
    y, h = compiled(x, residual)
    assert reference.calls == calls + 1
    norm = model.norm
    expected = add_rms_norm_reference(x, residual, norm.weight.detach(), norm.variance_epsilon, False, True,
                                      torch.bfloat16, torch.bfloat16)
    assert torch.equal(y, expected[0]) and torch.equal(h, expected[1])
    assert f"runs external {REFERENCE_NAME}" in str(compiled.report)


def test_without_the_provider_the_recorded_winner_falls_back_to_the_best_config(tmp_path, seed, monkeypatch):
    """A compile (as in another process) where the recorded external is not offered reads the same database
    records and runs the best config, which the record kept."""
    cache = tmp_path / "cache"
    with monkeypatch.context() as patch:
        _provide(patch, REFERENCE_NAME, CountingReference())
        first, _, _ = _compile_and_run(cache)
    recorded = {bucket: entry["config"] for bucket, entry in first.report.kernels[0].tuned.items()}
    assert all(e["external"] == REFERENCE_NAME for e in _database_entries(cache))

    assert external_kernels.PROVIDERS == [mate_kernels.candidates]
    again, _, _ = _compile_and_run(cache)  # outputs checked against eager: the generated kernel ran
    [kernel] = again.report.kernels
    assert kernel.external_candidates == []
    for bucket, entry in kernel.tuned.items():
        assert entry["from_cache"] is True and entry["how"] == "tuning database", entry
        assert entry["config"] == recorded[bucket]
        assert "external" not in entry
    assert "runs external" not in str(again.report)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_failing_external_candidate_is_skipped_and_logged(tmp_path, seed, monkeypatch):
    def unavailable(*op_args):
        raise RuntimeError("vendor kernel has no build for this shape")

    _provide(monkeypatch, "test.unavailable", unavailable)
    logger, log = logging.getLogger("dzc.autotune"), _Messages()
    # setLevel, not the attribute: it also clears the logger's cached isEnabledFor(INFO), which an earlier test's
    # tuning in the same worker process may have left False (CI, loadfile order).
    previous = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(log)
    try:
        compiled, _, _ = _compile_and_run(tmp_path / "cache")  # outputs checked: the generated kernel ran
    finally:
        logger.removeHandler(log)
        logger.setLevel(previous)
    [kernel] = compiled.report.kernels
    for entry in kernel.tuned.values():
        assert entry["external"] is None
        assert entry["external_failures"] == {
            "external test.unavailable": "RuntimeError: vendor kernel has no build for this shape"}
        assert entry["failed_configs"] == 0
    assert any("test.unavailable" in m and "no build for this shape" in m for m in log.messages), log.messages
    assert all(e["external"] is None for e in _database_entries(tmp_path / "cache"))


def test_selftest_checks_and_times_external_candidates_next_to_dzc(tmp_path, monkeypatch):
    """dzc-selftest on a device checks every external candidate against the op reference and times it; a wrong
    one (here the norm without its weight, a plausible adapter mistake) fails the case, since the tuner picks
    candidates by speed alone."""
    from dzc.selftest import run_selftest
    from dzc.targets import INTERPRETER

    def unweighted(x, residual, weight, *rest):
        return add_rms_norm_reference(x, residual, torch.ones_like(weight), *rest)

    _provide(monkeypatch, REFERENCE_NAME, CountingReference())
    _provide(monkeypatch, "test.unweighted", unweighted)
    report = run_selftest("cuda", dry_run=False, runtime=INTERPRETER, device=torch.device("cpu"),
                          families=["add_rms_norm"], codegens=["triton"], quick=True, tune=False, seed=3,
                          cache_dir=str(tmp_path))
    entry = report["results"][0]
    assert entry["numerics"]["ok"] and entry["timing"]["dzc_us"] > 0, entry
    externals = entry["externals"]
    assert externals[REFERENCE_NAME]["ok"] and externals[REFERENCE_NAME]["us"] > 0
    assert not externals["test.unweighted"]["ok"] and "beyond" in externals["test.unweighted"]["why"]
    assert entry["status"] == "failed" and not report["ok"]


# ---------------------------------------------------------------------------------------------------------
# MATE: where it applies

VARLEN_SPEC = varlen_attention.make_spec(80, torch.bfloat16, torch.float32)
SPARSE_SPEC = SparseAttentionSpec(heads=16, kv_heads=1, d_qk=576, d_v=512, dtype=torch.bfloat16, separate_v=False,
                                 **DSA_V32)
INDEXER_SPEC = DsaIndexerSpec(heads=64, head_dim=128, q_dtype=torch.float8_e4m3fn, fp8=True)
IN_RANGE = {"varlen_attention": VARLEN_SPEC, "sparse_attention": SPARSE_SPEC, "dsa_indexer": INDEXER_SPEC}


@pytest.mark.parametrize("profile", [SM_90, SM_80, MP_22, MP_31], ids=lambda p: p.name)
def test_no_mate_candidate_without_mate(profile):
    """Specs MATE covers get no candidate on profiles MATE has no kernels for (sm_90, sm_80, mp_22), nor on mp_31
    here, where MATE is not installed; the same specs are within every adapter's range."""
    for op, spec in IN_RANGE.items():
        assert mate_kernels.ADAPTERS[op].refusal(spec) is None, op
        assert mate_kernels.candidates(op, spec, profile) == []
        assert external_kernels.candidates_for(op, spec, profile) == []
    assert (profile.arch in mate_kernels.REQUIREMENTS) == (profile is MP_31)


@pytest.mark.parametrize("arch, versions, problem", [
    ("mp_31", ("0.2.2", "4.3.6", "2.7.1+gitabc"), None),
    ("mp_31", ("0.2.7", "5.2.0", "2.11.0.post2"), None),
    ("mp_31", (None, "4.3.6", "2.7.1"), "not installed"),
    ("mp_31", ("0.2.2", "4.3.5", "2.7.1"), "MUSA toolkit >= 4.3.6, found 4.3.5"),
    ("mp_31", ("0.2.2", None, "2.7.1"), "MUSA toolkit >= 4.3.6, found none"),
    ("mp_31", ("0.2.2", "4.3.6", "2.6.0"), "torch_musa >= 2.7, found 2.6.0"),
    ("mp_22", ("0.2.2", "4.3.6", "2.7.1"), "no kernels for mp_22"),
    ("sm_90", ("0.2.2", "4.3.6", "2.7.1"), "no kernels for sm_90"),
])
def test_mate_installation_requirements(arch, versions, problem):
    found = mate_kernels.installation_problem(arch, *versions)
    assert found is None if problem is None else problem in found, found


@pytest.mark.parametrize("op, spec, why", [
    ("varlen_attention", varlen_attention.make_spec(80, torch.float32, None), "bf16/fp16 only"),
    ("sparse_attention", SparseAttentionSpec(16, 1, 576, 512, torch.float16, False, **DSA_V32), "bf16 only"),
    ("sparse_attention", SparseAttentionSpec(16, 16, 576, 512, torch.bfloat16, False, **DSA_V32), "one latent KV head"),
    ("sparse_attention", SparseAttentionSpec(16, 1, 576, 512, torch.bfloat16, True, **DSA_V32), "one latent KV head"),
    ("sparse_attention", SparseAttentionSpec(16, 1, 192, 128, torch.bfloat16, False, **DSA_V32), "d_qk = 576"),
    ("sparse_attention", SparseAttentionSpec(96, 1, 576, 512, torch.bfloat16, False, **DSA_V32), "multiple of 64"),
    ("dsa_indexer", DsaIndexerSpec(64, 128, torch.bfloat16, False), "FP8"),
    ("dsa_indexer", DsaIndexerSpec(64, 64, torch.float8_e4m3fn, True), "head dim 128"),
    ("dsa_indexer", DsaIndexerSpec(8, 128, torch.float8_e4m3fn, True), "heads"),
])
def test_mate_adapters_refuse_specs_outside_mate(op, spec, why):
    refusal = mate_kernels.ADAPTERS[op].refusal(spec)
    assert refusal is not None and why in refusal, refusal
    assert mate_kernels.candidates(op, spec, MP_31) == []


def test_only_ops_mate_covers_have_adapters():
    from dzc.targets import KERNEL_FAMILIES

    assert set(mate_kernels.ADAPTERS) == {"varlen_attention", "sparse_attention", "dsa_indexer"}
    assert set(mate_kernels.ADAPTERS) <= set(KERNEL_FAMILIES)


# ---------------------------------------------------------------------------------------------------------
# MATE: argument mapping, against the MATE functions' documented contracts (plain torch, not MATE)

def flash_attn_varlen_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal):
    """mate.flash_attn_varlen_func (FA3 varlen): segment b's queries q[cu_q[b]:cu_q[b+1]] attend to its keys
    k[cu_k[b]:cu_k[b+1]], scores scaled by softmax_scale; out [total_q, heads, head_dim_v] in q's dtype."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        qs = q[bounds_q[b]:bounds_q[b + 1]].float().transpose(0, 1)
        ks, vs = (t[bounds_k[b]:bounds_k[b + 1]].float().transpose(0, 1) for t in (k, v))
        assert qs.shape[1] <= max_seqlen_q and ks.shape[1] <= max_seqlen_k
        scores = qs @ ks.transpose(1, 2) * softmax_scale
        if causal:  # FA's bottom-right aligned causal mask
            scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(
                ks.shape[1] - qs.shape[1] + 1), float("-inf"))
        out[bounds_q[b]:bounds_q[b + 1]] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("rope", [False, True])
def test_varlen_attention_mapping(rope, seed):
    generator = torch.Generator().manual_seed(seed)
    args = varlen_attention.random_pack((5, 33, 1, 17), 3, 80, torch.bfloat16, rope, "cpu", generator)
    arguments = mate_kernels.varlen_attention_arguments(*args)
    assert arguments["cu_seqlens_q"] is args[3] and arguments["cu_seqlens_k"] is args[3]
    assert arguments["max_seqlen_q"] == arguments["max_seqlen_k"] == 33 and arguments["causal"] is False
    out = mate_kernels.varlen_attention_result(flash_attn_varlen_contract(**arguments), *args)
    # The reference rounds the rotary output to bf16 before attention, as the adapter does.
    torch.testing.assert_close(out, varlen_attention_reference(*args), atol=1e-2, rtol=2**-7)
    assert mate_kernels.candidate_name("varlen_attention", varlen_attention.make_spec(
        80, torch.bfloat16, torch.float32 if rope else None)).endswith("(rotary applied by torch first)") == rope


def flash_mla_sparse_contract(q, kv, indices, sm_scale, d_v):
    """mate.flashmla.flash_mla_sparse_fwd: q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk] rows of
    kv, valid iff 0 <= index < s_kv; out = softmax over the valid ones of (q . kv) * sm_scale, times
    kv[..., :d_v]; a row without a valid index is 0. Returns (out bf16, max_logits, lse) like MATE."""
    rows = indices[:, 0].long()
    valid = (rows >= 0) & (rows < kv.shape[0])
    keys = kv[:, 0][torch.where(valid, rows, 0)].float()  # [s_q, topk, d_qk]
    # An invalid index reads no row (row 0 stood in to gather): zero it, or a poisoned row would turn 0 * NaN.
    keys = torch.where(valid[..., None], keys, 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", probs, keys[..., :d_v]).to(torch.bfloat16)
    return out, scores.amax(-1), scores.logsumexp(-1)


def test_sparse_attention_mapping(seed):
    generator = torch.Generator().manual_seed(seed)
    args = dsa_cases.sparse_attention_args([37, 90, 5], [3, 4, 2], heads=4, kv_heads=1, d_qk=576, d_v=512,
                                           separate_v=False, topk=20, page_size=16, device="cpu",
                                           generator=generator)
    q, k_cache, _, block_table, seq_lens, query_seq, indices, _, _ = args
    arguments = mate_kernels.sparse_attention_arguments(*args)
    assert arguments["indices"].shape == (q.shape[0], 1, 64) and arguments["indices"].dtype == torch.int32
    assert (arguments["indices"][:, 0, 20:] == -1).all(), "padding to MATE's 64-row block must be invalid"
    assert arguments["d_v"] == 512 and arguments["kv"].shape == (k_cache.shape[0] * 16, 1, 576)
    # Each valid position lands on its own token's cache row; invalid ones are -1.
    rows = arguments["indices"][:, 0, :20]
    for t in range(q.shape[0]):
        b = int(query_seq[t])
        for j, position in enumerate(indices[t].tolist()):
            if 0 <= position < int(seq_lens[b]):
                page = int(block_table[b, position // 16])
                assert torch.equal(arguments["kv"][int(rows[t, j]), 0], k_cache[page, position % 16, 0])
            else:
                assert rows[t, j] == -1
    out = mate_kernels.sparse_attention_result(flash_mla_sparse_contract(**arguments), *args)
    expected = sparse_attention_reference(*args)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=2**-7)
    assert (expected[3::7] == 0).all() and (out[3::7] == 0).all(), "rows with no valid index are 0"


def fp8_paged_mqa_logits_contract(q, fused_kv_cache, weights, context_lens, block_table, max_context_len,
                                  clean_logits):
    """mate.deep_gemm.fp8_paged_mqa_logits, 1-D context_lens, next_n = 1 (MATE tests/test_deep_gemm.py): row i
    scores keys 0 .. context_lens[i] - 1 of its block-table row, sum_h weights[i, h] * relu(q[i, h] . k), keys
    dequantized from the fused cache (per page: e4m3 values of all tokens, then their fp32 scales). Positions past
    the context are not written with clean_logits=False: NaN here, so that a translation that keeps them shows."""
    pages, page_size = fused_kv_cache.shape[:2]
    head_dim = q.shape[-1]
    flat = fused_kv_cache.reshape(pages, -1)
    values = flat[:, :page_size * head_dim].view(torch.float8_e4m3fn).view(pages, page_size, head_dim).float()
    scales = flat[:, page_size * head_dim:].contiguous().view(torch.float32)
    keys = (values * scales[..., None])[block_table.long().clamp(min=0)].flatten(1, 2)  # [rows, capacity, D]
    keys = torch.nn.functional.pad(keys, (0, 0, 0, max(0, max_context_len - keys.shape[1])))[:, :max_context_len]
    scores = torch.einsum("rhd,rsd->rhs", q[:, 0].float(), keys).relu()
    logits = torch.einsum("rh,rhs->rs", weights, scores)
    assert not clean_logits
    hidden = torch.arange(max_context_len) >= context_lens[:, None]
    return logits.masked_fill(hidden, float("nan"))


def test_dsa_indexer_mapping(seed):
    generator = torch.Generator().manual_seed(seed)
    args = dsa_cases.indexer_args([70, 200, 3], [2, 5, 1], heads=32, head_dim=128, fp8=True, page_size=64,
                                  device="cpu", generator=generator, max_context=230)
    q, _, cache, _, _, query_seq, query_pos, _ = args
    arguments = mate_kernels.dsa_indexer_arguments(*args)
    assert arguments["q"].shape == (q.shape[0], 1, 32, 128)
    assert arguments["fused_kv_cache"].shape == (cache.shape[0], 64, 1, 132)
    assert arguments["fused_kv_cache"].data_ptr() == cache.data_ptr(), "the cache's bytes are MATE's layout as is"
    assert arguments["max_context_len"] == 230 and arguments["clean_logits"] is False
    assert torch.equal(arguments["context_lens"], (query_pos + 1).int())  # queries sit inside their sequences
    logits = mate_kernels.dsa_indexer_result(fp8_paged_mqa_logits_contract(**arguments), *args)
    expected = dsa_indexer_reference(*args)
    assert torch.equal(torch.isinf(logits), torch.isinf(expected)), "the -inf mask must be the op's"
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)


def test_dsa_indexer_needs_mates_page_size(seed):
    generator = torch.Generator().manual_seed(seed)
    args = dsa_cases.indexer_args([40], [1], heads=32, head_dim=128, fp8=True, page_size=16, device="cpu",
                                  generator=generator)
    with pytest.raises(ValueError, match="pages of 64 tokens"):
        mate_kernels.dsa_indexer_arguments(*args)


# ---------------------------------------------------------------------------------------------------------
# MATE itself: only on a MUSA card with MATE installed


def _mate_device() -> bool:
    try:
        import mate  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch, "musa") and torch.musa.is_available()


@pytest.mark.skipif(not _mate_device(), reason="needs MATE and a MUSA device (MP31)")
def test_mate_adapters_match_the_op_references_on_a_musa_card(seed):
    device = torch.device("musa")
    generator = torch.Generator().manual_seed(seed)
    cases = {
        "varlen_attention": (VARLEN_SPEC, varlen_attention.random_pack(
            (100, 157, 7), 4, 80, torch.bfloat16, True, device, generator)),
        "sparse_attention": (SparseAttentionSpec(64, 1, 576, 512, torch.bfloat16, False, **DSA_V32),
                             dsa_cases.sparse_attention_args([300, 900], [40, 24], 64, 1, 576, 512, False, 256, 64,
                                                             device, generator)),
        "dsa_indexer": (INDEXER_SPEC, dsa_cases.indexer_args([300, 2000, 64], [2, 17, 1], 64, 128, True, 64, device,
                                                             generator)),
    }
    for op, (spec, args) in cases.items():
        [candidate] = mate_kernels.candidates(op, spec, MP_31)
        out = candidate.fn(*args)
        reference = {"varlen_attention": varlen_attention_reference, "sparse_attention": sparse_attention_reference,
                     "dsa_indexer": dsa_indexer_reference}[op](*args)
        if op == "dsa_indexer":
            assert torch.equal(torch.isinf(out), torch.isinf(reference))
            torch.testing.assert_close(out, reference, atol=5e-2, rtol=1e-3)
        else:
            torch.testing.assert_close(out, reference, atol=4e-2, rtol=2**-6)
