"""eval's decode path (issue 56): the grouped path reads each cached kv head as it is, copying nothing per step;
its greedy tokens are the old path's; the result, the terminal and a report say which path was timed; asking
for a path that gives GQA's speed-up away warns in one line."""

import warnings

import pytest
import torch
from tiny_models import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from mha2gqa.architecture.hfcache import cache_kwargs, cache_of
from mha2gqa.eval import decode_kernel, decode_path, speed
from mha2gqa.eval.decode_path import CPU_KERNEL, decode_attention, kernel_on, matmul_attention, new_cache
from mha2gqa.eval.measurements import validate_all
from mha2gqa.eval.options import DecodePath, EvalOptions
from mha2gqa.runtime.errors import InputError, WeightWarning

HEADS, KV_HEADS, BATCH, CONTEXT, HEAD_DIM = 8, 2, 4, 256, 32  # a cache large beside the activations


class NewBytes(TorchDispatchMode):
    """Every aten op's outputs that own fresh storage (no input's): the bytes a step allocates. The attention
    kernel's K/V operands are kept too, to see what it was given: SDPA's key and value, or each batched matrix
    product's second operand (K transposed, then V: matmul_attention)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.keys = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "scaled_dot_product" in func.__name__:
            self.keys += [args[1], args[2]]
        elif func.__name__.split(".")[0] == "bmm":
            self.keys.append(args[1])
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


@torch.no_grad()
def one_step(model, path):
    """(NewBytes of one decode step after a CONTEXT-token prefill on `path`, the cache it read)."""
    ids = torch.randint(0, model.config.vocab_size, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(0))
    with decode_attention([model], path):
        cache = new_cache(model, path, CONTEXT + 1)
        kwargs = {} if cache is None else cache_kwargs(model, cache)
        out = model(ids, use_cache=True, logits_to_keep=1, **kwargs)
        with NewBytes() as seen:
            model(out.logits[:, -1].argmax(-1, keepdim=True), use_cache=True, **cache_kwargs(model, cache_of(out)))
    return seen, cache_of(out)


def layer_k_bytes(heads: int) -> int:
    """One layer's cached K (float32) at `heads` heads: KV_HEADS as cached, HEADS once copied to MHA's size."""
    return BATCH * heads * (CONTEXT + 1) * HEAD_DIM * 4


@pytest.fixture(scope="module")
def gqa():
    return make_tiny_model("llama", num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)


@pytest.mark.parametrize("kernel", ["auto", "fused", "matmul", "sdpa"])
def test_the_grouped_path_hands_the_attention_the_cache_itself_and_copies_nothing(gqa, kernel, monkeypatch):
    monkeypatch.setitem(CPU_KERNEL, "name", kernel)  # float32: auto is the fused kernel where it builds
    fused_operands = []  # the fused kernel runs in C, out of the dispatcher's sight: its K/V recorded here

    def fused(query, key, value, **kwargs):
        fused_operands.extend([key, value])
        return decode_kernel.fused_attention(query, key, value, **kwargs)

    monkeypatch.setitem(decode_path.KERNELS, "fused", fused)
    seen, cache = one_step(gqa, DecodePath.GROUPED)
    layers = gqa.config.num_hidden_layers
    # each kernel got K and V at the kv heads (a view of the cache, not 8 heads' copy): one layer's K is
    # BATCH x KV_HEADS x (CONTEXT + 1) x HEAD_DIM
    kernel_ran = decode_path.kernel_on(gqa.device, gqa.dtype)
    assert bool(fused_operands) == (kernel_ran == "fused")
    assert [k.numel() for k in seen.keys + fused_operands] == [layer_k_bytes(KV_HEADS) // 4] * 2 * layers
    cached = {t.untyped_storage().data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)}
    used = {k.untyped_storage().data_ptr() for k in seen.keys + fused_operands}
    assert used == cached  # the cache's own storage: no copy
    assert seen.bytes < layer_k_bytes(KV_HEADS)  # activations only: not one layer's K copied, even as cached


@pytest.mark.parametrize("path", [DecodePath.REPEAT, DecodePath.DYNAMIC])
def test_the_same_count_catches_the_paths_that_copy(gqa, path):
    """The measure above can fail: the old paths allocate at least the whole cache per step, repeat its
    query-head-sized copy in every layer."""
    seen, _ = one_step(gqa, path)
    layers = gqa.config.num_hidden_layers
    whole_cache = 2 * layers * layer_k_bytes(KV_HEADS)
    assert seen.bytes >= whole_cache
    if path == DecodePath.REPEAT:  # eager attention: matmuls on K/V copied out to every query head
        assert seen.bytes >= whole_cache + 2 * layers * layer_k_bytes(HEADS)


@pytest.mark.parametrize(
    ("model_type", "kv_heads", "extra"),
    [("llama", 2, {}), ("llama", 1, {}), ("llama", 8, {}), ("qwen3", 4, {}), ("mistral", 2, {"sliding_window": 16})],
)
def test_greedy_tokens_on_the_grouped_path_are_the_old_paths(model_type, kv_heads, extra):
    model = make_tiny_model(model_type, num_key_value_heads=kv_heads, **extra)
    tokens = greedy_on_every_path(model)
    assert torch.equal(tokens[DecodePath.GROUPED][0], tokens[DecodePath.DYNAMIC][0])
    assert torch.equal(tokens[DecodePath.REPEAT][0], tokens[DecodePath.DYNAMIC][0])
    routed = "folded" if kv_heads < HEADS else "as_is"
    assert tokens[DecodePath.GROUPED][1]["steps"] == {routed: 12 * model.config.num_hidden_layers}
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("mask", ["none", "bool", "float", "per-row"])
def test_the_cpu_kernel_is_sdpa(dtype, rows, mask):
    """matmul_attention (the grouped path's CPU kernel) gives SDPA's output: one or four query rows per kv head,
    a boolean mask (a static cache's empty slots), an additive one, one that differs per row."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(shape, generator=gen).to(dtype) for shape in ((2, 3, rows, 16), *[(2, 3, 40, 16)] * 2)
    )
    attn_mask = {
        "none": None,
        "bool": torch.arange(40).expand(2, 1, 1, 40) < torch.tensor([25, 40]).view(2, 1, 1, 1),
        "float": torch.randn((2, 1, 1, 40), generator=gen).to(dtype),
        "per-row": torch.rand((2, 3, rows, 40), generator=gen) > 0.3,
    }[mask]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask[..., 0] = True  # every row attends somewhere
    found = matmul_attention(query, key, value, attn_mask=attn_mask, scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=0.3)
    assert found.shape == expected.shape and found.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the scores are rounded before the softmax
    assert torch.allclose(found.float(), expected.float(), atol=tolerance, rtol=0)


def test_the_cpu_kernel_is_chosen_by_dtype_and_named_in_the_result(monkeypatch):
    """On CPU: the fused kernel in bfloat16 and float32 where it builds, matmul_attention in float16 (SDPA's CPU
    kernel is 4x slower there with one query row); without the fused kernel matmul_attention in bfloat16 and SDPA
    in float32 (docs/benchmarks.md); on a GPU SDPA."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    assert decode_kernel.available(), decode_kernel.why_not()  # a C compiler is on every machine the suite runs on
    assert [kernel_on(cpu, d) for d in dtypes] == ["fused", "matmul", "fused"]
    assert kernel_on(gpu, torch.bfloat16) == "sdpa"
    for dtype, kernel in ((torch.float32, "fused"), (torch.bfloat16, "fused"), (torch.float16, "matmul")):
        model = make_tiny_model("llama", num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM).to(dtype)
        with decode_attention([model], DecodePath.GROUPED) as used:
            pass
        assert used["kernel"] == kernel
    monkeypatch.setitem(decode_kernel._STATE, "error", "no C compiler")  # as on a machine where it does not build
    monkeypatch.delitem(decode_kernel._STATE, "lib")
    assert [kernel_on(cpu, d) for d in dtypes] == ["matmul", "matmul", "sdpa"]


def test_a_model_loaded_without_sdpa_keeps_its_attention_and_the_result_says_so():
    """gemma2's logit softcap loads it with eager attention, which GROUPED does not hand on to."""
    model = make_tiny_model("gemma2", num_key_value_heads=2)
    tokens = greedy_on_every_path(model)
    assert torch.equal(tokens[DecodePath.GROUPED][0], tokens[DecodePath.DYNAMIC][0])
    assert tokens[DecodePath.GROUPED][1]["attention"] == "eager" and tokens[DecodePath.GROUPED][1]["steps"] == {}


def greedy_on_every_path(model) -> dict:
    """{path: (12 greedy tokens of 3 prompts, the path's description)}."""
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    found = {}
    for path in DecodePath:
        steps = []
        with decode_attention([model], path) as used:
            speed.greedy_decode(model, ids, 12, path, steps)
        found[path] = (torch.cat(steps, dim=1), used)
    return found


def test_the_speed_section_names_its_path(gqa):
    grid = speed.make_grid("cpu", (1,), (8,), 2, 1)
    found = speed.decode_speed(gqa, grid)
    assert found["decode_path"]["name"] == "grouped" and found["decode_path"]["cache"] == "static"
    assert found["decode_path"]["attention"] == "mha2gqa_grouped" and found["decode_path"]["copied_per_step"] is None
    old = speed.decode_speed(gqa, grid, path="dynamic")["decode_path"]
    assert (old["name"], old["cache"], old["attention"]) == ("dynamic", "dynamic", "sdpa")
    assert "torch.cat" in old["copied_per_step"]


@pytest.mark.parametrize("path", ["dynamic", "repeat"])
def test_asking_for_a_path_that_gives_the_speed_up_away_warns_once(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_all(EvalOptions(speed_preset="cpu", decode_path=path))
    (warned,) = [w for w in caught if issubclass(w.category, WeightWarning)]
    text = str(warned.message)
    assert (
        text.startswith(f"--decode-path {path} ")
        and "\n" not in text
        and "leave the flag out to time 'grouped'" in text
    )


def test_the_default_path_and_speed_off_warn_of_nothing():
    for options in (EvalOptions(speed_preset="cpu"), EvalOptions(speed_preset="off", decode_path="repeat")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", WeightWarning)
            validate_all(options)


def test_an_unknown_path_is_refused_naming_the_paths():
    with pytest.raises(InputError, match=r"--decode-path 'fast' is not a path \(use grouped, dynamic, repeat\)"):
        validate_all(EvalOptions(decode_path="fast"))


def test_a_report_and_a_card_name_the_path_each_speed_was_timed_on(tmp_path):
    import json

    from test_report import fake_result, write_results

    from mha2gqa.eval.card_table import measured_cells
    from mha2gqa.report import write_report

    results = [
        fake_result("parent", "parent", 8, 10.0, 1024, {4: 80.0}),
        fake_result("gqa", "converted", 2, 11.0, 256, {4: 90.0}),
    ]
    results[0]["speed"]["decode_path"] = {"name": "dynamic"}
    results[1]["speed"]["decode_path"] = {"name": "grouped"}
    written = write_report(write_results(tmp_path, results), tmp_path / "rep")
    rows = json.loads(written["json"].read_text())["rows"]
    assert [r["decode_path"] for r in rows] == ["dynamic", "grouped"]
    header = next(line for line in written["markdown"].read_text().splitlines() if line.startswith("| model"))
    assert "| decode path |" in header
    card_dir = tmp_path / "model"
    card_dir.mkdir()
    (card_dir / "eval.json").write_text(json.dumps(results[1]))
    assert ("decode path", "grouped") in measured_cells(card_dir)["eval.json"]
