"""Long context on the TileLang path: the sparse attention kernels index global memory with 64-bit offsets.

A bf16 MLA latent pool passes 2^31 elements at about 3.7M tokens of 576 values; a 32-bit element offset would read
another row there (a wrong answer) or fault. The Triton kernels and the op references widen such offsets
themselves (tests/test_dsa_kernels.py runs them at 1M tokens over sparse-file pools). The TileLang template
indexes its buffers by (page, slot, head, dim) and TileLang 0.1.15 chooses the offsets' width: its index type
promotion (the ConfigIndexBitwidth pass) computes in int64 every global index it cannot bound within int32, which
includes every index through a page read from the block table. TileLang has no CPU interpreter, so on the CPU the
kernels are lowered to CUDA for sm_90a and every access to a global buffer is checked to compute its offset from
64-bit operands only; nvcc compiles the source. The GPU test runs both codegens on a pool just past 2^31
elements, reading rows from pages beyond that mark. (dsa_indexer and dsa_topk have no TileLang kernels.)
"""

import re
import shutil

import pytest
import torch

from dzc.lowering import Execution
from dzc.ops.dsa import sparse_attention_reference
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import TARGETS, sparse_attention, tilelang_codegen
from dzc.targets.profiles import SM_90

# DeepSeek-V3.2's selection width and cache page size (the sparse attention specs' static sizes).
DSA_V32 = dict(topk=2048, page_size=64)

requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

# DeepSeek-V3.2's latent (one KV head, V = K[..., :512]) in the decode split kernel, and MHA with a separate
# v_cache in the prefill kernel: both kernels, both ways of reading values.
MLA = sparse_attention.SparseAttentionSpec(128, 1, 576, 512, torch.bfloat16, False, **DSA_V32)
MHA = sparse_attention.SparseAttentionSpec(4, 4, 64, 64, torch.bfloat16, True, **DSA_V32)
LOWERED = {"mla-decode": (MLA, 64), "mha-prefill": (MHA, 4096)}  # name -> (spec, query rows of the call)


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """name -> CUDA source of the kernel that serves LOWERED[name]'s call, in its untuned config."""
    sources = {}
    for name, (spec, rows) in LOWERED.items():
        path = tmp_path_factory.mktemp("tilelang") / f"sparse_attention_{name.replace('-', '_')}.py"
        path.write_text(sparse_attention.tilelang_source(spec, SM_90))
        configs = sparse_attention.tilelang_configs(spec, SM_90)
        default = sparse_attention.tilelang_default_config(spec, SM_90)
        config = sparse_attention.configs_for_bucket(spec, SM_90, sparse_attention.token_bucket(rows), configs,
                                                     default)[1]
        sources[name] = tilelang_codegen.lower_to_device_source(path, sparse_attention.TILELANG_FACTORY_NAME,
                                                                config, SM_90)
    return sources


def _bracketed(text: str, start: int) -> str:
    """text[start:] from its opening ( or [ through the matching close."""
    depth = 0
    for end in range(start, len(text)):
        depth += text[end] in "(["
        depth -= text[end] in ")]"
        if depth == 0:
            return text[start:end + 1]
    raise ValueError(f"unbalanced: {text[start:start + 80]}")


def global_offsets(cuda: str) -> list[tuple[str, str]]:
    """(buffer, offset expression) of every access to a pointer parameter of the source's kernel: `name[offset]`
    or `name + offset`. Any other use of a pointer parameter fails: this check would not see its offset."""
    signature = re.search(r'extern "C" __global__ void[^(]*\(([^)]*)\)', cuda).group(1)
    buffers = re.findall(r"\*\s*(?:__restrict__\s+)?(\w+)\s*(?:,|$)", signature)
    assert buffers, signature
    body = cuda[cuda.index("{", cuda.rindex(signature)):]
    accesses = []
    for name in buffers:
        uses = [m.start() for m in re.finditer(rf"\b{name}\b", body)]
        for start in uses:
            rest = body[start + len(name):]
            form = re.match(r"\s*(\[|\+\s*)", rest)
            assert form, f"{name} used otherwise than indexed: {body[start:start + 120]}"
            at = form.end() - 1 if form.group(1) == "[" else form.end()
            if rest[at] in "([":
                accesses.append((name, _bracketed(rest, at)))
            else:
                accesses.append((name, re.match(r"\(\w+\)-?\w+|\w+", rest[at:]).group(0)))
    return accesses


def narrow_operands(offset: str, wide_locals: set[str]) -> list[str]:
    """The operands of `offset` that are not 64-bit: anything but a value cast to int64_t or a local declared
    int64_t. A value loaded from a buffer (a page number from the block table or shared memory) counts as one
    operand: its own subscript is checked where that buffer is. All arithmetic on 64-bit operands is 64-bit."""
    text = offset
    while load := re.search(r"(\(\([\w ]+\*\)\w+\)|\b\w+)\[", text):
        subscript = _bracketed(text, load.end() - 1)
        text = text[:load.start()] + "LOADED" + text[load.end() - 1 + len(subscript):]
    text = re.sub(r"\(int64_t\)\(\(int\)(?:threadIdx|blockIdx)\.[xyz]\)", "WIDE", text)
    text = re.sub(r"\(int64_t\)-?\w+", "WIDE", text)
    text = re.sub(r"\b(?:min|max)\(", "(", text)
    return [operand for operand in re.findall(r"\b\w+(?:\.[xyz])?", text)
            if operand != "WIDE" and operand not in wide_locals]


def narrow_accesses(cuda: str) -> list[tuple[str, str, list[str]]]:
    wide_locals = set(re.findall(r"\bint64_t (\w+) =", cuda))
    return [(name, offset, narrow) for name, offset in global_offsets(cuda)
            if (narrow := narrow_operands(offset, wide_locals))]


def _locals_read_from(cuda: str, load: str) -> set[str]:
    """The local variables whose value comes from `load` (directly or through other such locals)."""
    definitions = re.findall(r"\b(\w+)(?:\[\w+\])? = ([^;]*);", cuda)  # scalars and local-array elements
    found: set[str] = set()
    while True:
        more = {name for name, value in definitions if name not in found
                and (load in value or any(re.search(rf"\b{local}\b", value) for local in found))}
        if not more:
            return found
        found |= more


def test_lowered_sparse_attention_offsets_are_64_bit(lowered):
    """Every global access of the lowered kernels (the latent pool, v_cache, the block table, the indices, q and
    the outputs) computes its offset from 64-bit operands; the page number is widened before it is scaled by the
    page's element count, so a pool past 2^31 elements is read at the right rows."""
    for name, cuda in lowered.items():
        accesses = global_offsets(cuda)
        pool_reads = [offset for buffer, offset in accesses if buffer in ("k_cache", "v_cache")]
        # The gathers read the pool through the page each position maps to: its block-table entry, in the offset
        # or in a local computed from it (the warp-specialized kernel's producer).
        from_table = _locals_read_from(cuda, "block_table[")
        assert pool_reads and all("block_table[" in offset or any(re.search(rf"\b{local}\b", offset)
                                                                  for local in from_table)
                                  for offset in pool_reads), name
        # q is read by a TMA descriptor where the kernel loads it that way (no offset of dzc's to check).
        read_q = set() if "CUtensorMap q_desc" in cuda else {"q"}
        assert {buffer for buffer, _ in accesses} >= {"k_cache", "block_table", "indices", "out"} | read_q, name
        assert not narrow_accesses(cuda), (name, narrow_accesses(cuda))
        # The check sees 32-bit arithmetic: the same pool offsets computed in int32 are caught.
        as_int32 = cuda.replace("(int64_t)", "").replace("int64_t ", "int ")
        narrow = {buffer for buffer, _, _ in narrow_accesses(as_int32)}
        assert {"k_cache", "block_table"} <= narrow, (name, narrow)


@requires_nvcc
def test_lowered_sparse_attention_compiles_with_nvcc(lowered, tmp_path):
    """The MHA prefill kernel (~10 s of nvcc; the MLA decode kernel is test_dsa_kernels' slow nvcc test)."""
    assert tilelang_codegen.nvcc_compile(lowered["mha-prefill"], SM_90, tmp_path).stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------
# GPU: a bf16 latent pool just past 2^31 elements (4.3 GB), the sequence's pages on both sides of that mark


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["tilelang", "triton"])
@pytest.mark.parametrize("rows", [2, 300], ids=["decode", "prefill"])
def test_sparse_attention_over_a_pool_past_2_31_elements_on_gpu(codegen, rows, seed, tmp_path):
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(seed)
    heads, d_qk, d_v, page_size, topk = 128, 576, 512, 64, 2048
    page_elements = page_size * d_qk
    first_past = -(-2**31 // page_elements)  # the first page whose elements all lie past 2^31
    pool_pages = first_past + 48
    pool = torch.empty(pool_pages, page_size, 1, d_qk, dtype=torch.bfloat16, device=device)
    assert pool.numel() > 2**31
    seq_len = 45 * page_size + 37  # 46 pages: 41 or more of them past the mark
    pages = -(-seq_len // page_size)
    table = (first_past - 5 + torch.randperm(53, device=device, generator=generator)[:pages]).int()[None]
    assert int((table >= first_past).sum()) >= pages - 5
    pool[table[0].long()] = torch.randn(pages, page_size, 1, d_qk, device=device, generator=generator).bfloat16()
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    query_seq = torch.zeros(rows, dtype=torch.int32, device=device)
    indices = torch.stack([torch.randperm(seq_len, device=device, generator=generator)[:topk]
                           for _ in range(rows)]).int()
    indices[:, :2] = torch.tensor([-1, seq_len], dtype=torch.int32, device=device)  # invalid: skipped
    q = torch.randn(rows, heads, d_qk, device=device, generator=generator).bfloat16()
    args = (q, pool, None, table, seq_lens, query_seq, indices, d_qk ** -0.5, d_v)
    target = TARGETS["cuda:sm_90"]
    options = CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False, codegen=codegen)
    record, _ = lower_op("sparse_attention", args, target, options, Execution(target.runtime))
    assert record.codegen == codegen
    out = torch.ops.dzc.sparse_attention(*args, kernel_id=record.kernel_id)
    torch.cuda.synchronize()
    [(_, tuned)] = record.tuned.items()
    assert ("decode" if rows <= sparse_attention.DECODE_MAX_ROWS else "prefill") in tuned["path"]
    for start in range(0, rows, 8):  # the reference broadcasts K over the 128 heads in fp32: a few rows at a time
        part = slice(start, start + 8)
        expected = sparse_attention_reference(q[part], *args[1:5], query_seq[part], indices[part], *args[7:])
        torch.testing.assert_close(out[part].float(), expected.float(), atol=2**-6, rtol=2**-6,
                                   msg=lambda m: f"rows {part}: {m}")
