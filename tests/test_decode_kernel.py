"""The grouped decode step's fused CPU kernel (eval/decode_kernel.py, .c): SDPA's output for any group size,
head size, cache length and mask, in float32 and bfloat16; built once into its own directory, and a machine
without a compiler falls back to PyTorch's kernels."""

import os

import pytest
import torch
import torch.nn.functional as F

from mha2gqa.eval import decode_kernel, decode_path

pytestmark = pytest.mark.skipif(decode_kernel._compiler() is None, reason="no C compiler on this machine")


def sdpa_in_float32(query, key, value, attn_mask, scale):
    """The reference: SDPA on the same values in float32 (the kernel's arithmetic), one row per query head."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.float()
    return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=attn_mask, scale=scale)


def masks(batch: int, kv_heads: int, group: int, tokens: int, gen) -> dict:
    filled = torch.arange(tokens).view(1, 1, 1, tokens) < torch.tensor([tokens - 7, tokens]).view(2, 1, 1, 1)
    padded = torch.arange(tokens).view(1, 1, 1, tokens) >= torch.tensor([0, 5]).view(2, 1, 1, 1)
    per_row = torch.rand((batch, kv_heads, group, tokens), generator=gen) > 0.4
    per_row[..., -1] = True  # every row attends somewhere
    return {
        "none": None,
        "static room": filled[:batch],  # a static cache's slots not yet written
        "left padding": padded[:batch],
        "additive": torch.randn((batch, 1, 1, tokens), generator=gen),
        "per row": per_row,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "head_dim"),
    [(1, 64), (2, 64), (4, 64), (8, 128), (3, 64), (7, 128), (3, 40), (4, 16), (16, 32), (20, 32)],
)
def test_the_kernel_gives_sdpas_output(dtype, group, head_dim):
    """Group sizes that divide 16, that do not (3, 7: blocks with unused lanes) and one over 16 (one row at a
    time), head sizes that are multiples of 16 (the vector passes) and one that is not (40: plain loops); 37
    tokens leave an uneven tail after the blocks."""
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    batch, kv_heads, tokens = 2, 3, 37
    query = torch.randn((batch, kv_heads, group, head_dim), generator=gen).to(dtype)
    key, value = (torch.randn((batch, kv_heads, tokens, head_dim), generator=gen).to(dtype) for _ in range(2))
    for name, mask in masks(batch, kv_heads, group, tokens, gen).items():
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        found = decode_kernel.fused_attention(query, key, value, attn_mask=mask, scale=0.3)
        expected = sdpa_in_float32(query, key, value, mask, 0.3)
        assert found.shape == expected.shape and found.dtype == dtype, name
        # bfloat16: the float32 result rounded to it, within half its spacing (2 ** -9 of the value)
        rtol = 0 if dtype == torch.float32 else 2**-8
        assert torch.allclose(found.float(), expected, atol=1e-5, rtol=rtol), name


def test_the_default_scale_is_one_over_the_root_of_the_head_size():
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(shape, generator=gen) for shape in ((1, 2, 4, 64), (1, 2, 50, 64), (1, 2, 50, 64)))
    found = decode_kernel.fused_attention(query, key, value)
    assert torch.allclose(found, F.scaled_dot_product_attention(query, key, value), atol=1e-5)


def test_a_row_with_every_position_masked_gives_zeros_and_the_others_are_unchanged():
    gen = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(shape, generator=gen) for shape in ((1, 1, 4, 32), (1, 1, 20, 32), (1, 1, 20, 32)))
    mask = torch.ones((1, 1, 4, 20), dtype=torch.bool)
    mask[0, 0, 2] = False
    found = decode_kernel.fused_attention(query, key, value, attn_mask=mask)
    assert torch.equal(found[0, 0, 2], torch.zeros(32))
    rows = [0, 1, 3]
    expected = F.scaled_dot_product_attention(query[:, :, rows], key, value)
    assert torch.allclose(found[:, :, rows], expected, atol=1e-5)


def test_threads_split_the_heads_and_give_one_threads_output():
    gen = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(s, generator=gen) for s in ((3, 5, 4, 64), (3, 5, 100, 64), (3, 5, 100, 64)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_kernel.fused_attention(query, key, value)
        torch.set_num_threads(4)  # 15 items over 4 workers: uneven shares
        four = decode_kernel.fused_attention(query, key, value)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)


def test_a_cache_view_with_strided_heads_is_read_in_place():
    """A static cache's K/V are views whose batch and head strides are the cache's: the kernel takes the strides."""
    gen = torch.Generator().manual_seed(6)
    whole = torch.randn((2, 4, 60, 64), generator=gen)
    key, value = whole[:, ::2, :40], whole[:, 1::2, 10:50]  # every other head, a window of the tokens
    query = torch.randn((2, 2, 4, 64), generator=gen)
    assert decode_kernel.takes(query, key, value)
    found = decode_kernel.fused_attention(query, key, value, scale=0.2)
    assert torch.allclose(found, F.scaled_dot_product_attention(query, key, value, scale=0.2), atol=1e-5)


def test_what_the_kernel_does_not_take_goes_to_pytorchs_kernels():
    query, key = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 30, 64)
    assert decode_kernel.takes(query, key, key)
    assert not decode_kernel.takes(query.half(), key.half(), key.half())  # float16: not built for it
    assert not decode_kernel.takes(torch.randn(1, 2, 4, 320), *[torch.randn(1, 2, 30, 320)] * 2)  # head size
    columns = torch.randn(1, 2, 64, 30).transpose(-1, -2)  # rows not contiguous
    assert not decode_kernel.takes(query, columns, columns)
    assert decode_path.kernel_for(query, columns, columns) == "sdpa"
    assert decode_path.kernel_for(query.bfloat16(), columns.bfloat16(), columns.bfloat16()) == "matmul"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as a new process finds it, building into tmp_path."""
    monkeypatch.setattr(decode_kernel, "_STATE", {})
    monkeypatch.setenv("MHA2GQA_KERNEL_DIR", str(tmp_path))
    return tmp_path


def test_the_library_is_built_once_and_reused(fresh, monkeypatch):
    assert decode_kernel.available() and decode_kernel.why_not() is None
    (built,) = fresh.glob("decode_kernel-*.so")
    stamp = built.stat().st_mtime_ns
    assert [p.name for p in fresh.iterdir()] == [built.name]  # nothing half-built left beside it
    monkeypatch.setattr(decode_kernel, "_STATE", {})
    assert decode_kernel.available()
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_a_compiler_the_kernel_is_unavailable_and_says_why(fresh, monkeypatch):
    monkeypatch.setattr(decode_kernel, "_compiler", lambda: None)
    assert not decode_kernel.available()
    assert decode_kernel.why_not() == "no C compiler (cc, gcc or clang) on PATH"
    assert decode_path.kernel_on(torch.device("cpu"), torch.float32) == "sdpa"
    assert list(fresh.iterdir()) == []


def test_a_failing_build_leaves_nothing_and_falls_back(fresh, monkeypatch, tmp_path_factory):
    broken = tmp_path_factory.mktemp("cc") / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such target' >&2\nexit 1\n")
    os.chmod(broken, 0o755)
    monkeypatch.setenv("CC", str(broken))
    assert not decode_kernel.available()
    assert decode_kernel.why_not().endswith("failed: cc: error: no such target")
    assert list(fresh.iterdir()) == []
    assert decode_path.kernel_on(torch.device("cpu"), torch.bfloat16) == "matmul"


def _decode_in_child(queue):
    query, key = torch.ones(2, 2, 4, 64), torch.ones(2, 2, 30, 64)
    torch.set_num_threads(2)
    queue.put(decode_kernel.fused_attention(query, key, key).sum().item())


def test_a_forked_child_decodes_with_threads_of_its_own():
    """A child forked after the parent's pool started inherits the pool but not its threads."""
    import multiprocessing

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        decode_kernel.fused_attention(torch.ones(2, 2, 4, 64), torch.ones(2, 2, 30, 64), torch.ones(2, 2, 30, 64))
    finally:
        torch.set_num_threads(threads)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_decode_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    assert queue.get(timeout=5) == 2 * 2 * 4 * 64  # softmax over equal scores of ones: every output is 1
