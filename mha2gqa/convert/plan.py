"""The conversion plan: what each output tensor is made of. Pure: reads no tensor data, writes nothing,
imports no torch. `convert --dry-run` prints it; run.py (torch) or fast.py (numpy) executes it."""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.convert.roles import KV_ROLES, layer_names, validate_layer_count
from mha2gqa.files.checkpoint import FLOAT_CODES, OutputTensor, TensorInfo
from mha2gqa.runtime.errors import InputError


@dataclass(frozen=True)
class Step:
    """One unit of work: a tensor copied (or cast) alone, or one layer's attention tensors transformed
    together. `sources` maps stored roles (a copy has the single role "tensor") to source names."""

    sources: dict[str, str]
    outputs: tuple[OutputTensor, ...]
    layer: int | None = None
    transpose: bool = False  # a Conv1D weight (in, out) written as Linear (out, in) (layout.transposed)

    @property
    def is_transform(self) -> bool:
        return self.layer is not None


@dataclass(frozen=True)
class TensorPlan:
    """Every output tensor and what it is made of, at one kv-head count a layer (`counts`; uniform: one count
    repeated)."""

    shape: AttentionShape
    counts: tuple[int, ...]
    method: str
    steps: list[Step]
    bytes_in: int
    bytes_out: int

    @property
    def groups(self) -> int | None:
        """The kv heads of every layer, or None where the layers differ."""
        return self.counts[0] if len(set(self.counts)) == 1 else None

    def count(self, layer: int) -> int:
        return self.counts[layer]

    def output_tensors(self) -> list[OutputTensor]:
        return [out for step in self.steps for out in step.outputs]

    def copies(self, tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        """Output name -> source tensor of every tensor that passes through byte for byte (no cast, no
        transpose): what the executors copy file to file (ShardedWriter aligns the shards to them)."""
        return {
            step.outputs[0].name: tensors[step.sources["tensor"]]
            for step in self.steps
            if not step.is_transform
            and not step.transpose
            and step.outputs[0].dtype == tensors[step.sources["tensor"]].dtype
        }

    def describe(self, tensors: dict[str, TensorInfo]) -> list[str]:
        """One line per output tensor: name, dtype, shape, and where it comes from."""
        lines = []
        for step in self.steps:
            if not step.is_transform:
                src = tensors[step.sources["tensor"]]
                how = "copy" if src.dtype == step.outputs[0].dtype else f"cast from {src.dtype}"
                if step.transpose:
                    how = "transpose (Conv1D -> Linear)" + ("" if how == "copy" else f", {how}")
                lines.append(_line(step.outputs[0], how))
                continue
            r = self.shape.kv_heads // self.counts[step.layer]
            sources = ", ".join(
                f"{tensors[n].name.rsplit('.', 2)[-2]}.{n.rsplit('.', 1)[1]} {list(tensors[n].shape)}"
                for n in step.sources.values()
            )
            for out in step.outputs:
                lines.append(_line(out, f"{self.method} over groups of {r} kv heads of layer {step.layer} ({sources})"))
        return lines


def _line(out: OutputTensor, how: str) -> str:
    return f"{out.name}  {out.dtype} {list(out.shape)}  <- {how}"


def make_plan(
    tensors: dict[str, TensorInfo],
    layout: Layout,
    shape: AttentionShape,
    counts: int | tuple[int, ...],
    method: str,
    out_dtype: str | None = None,
    route_query_output: bool = False,
) -> TensorPlan:
    """counts: each layer's kv heads (an int: the same in every layer). out_dtype: a safetensors code (F32, F16, BF16) every floating tensor is cast to, or None.
    route_query_output: q/o pass through the layer step (a method that rewrites them, or a head
    permutation)."""
    counts = (counts,) * shape.layers if isinstance(counts, int) else tuple(counts)
    available = set(tensors)
    validate_layer_count(available, layout, shape)
    layer_steps: dict[str, Step] = {}  # every source name of a layer step -> that step
    for layer in range(shape.layers):
        stored = layer_names(layout, layer, shape.kv_heads, available)
        _validate_attention_shapes(stored, tensors, shape)
        if not route_query_output and not layout.qkv:
            stored = {role: name for role, name in stored.items() if role.split(".")[0] not in ("q", "o")}
        step = _layer_step(layer, stored, tensors, shape, counts[layer], out_dtype)
        for name in stored.values():
            layer_steps[name] = step
    transposed = {
        layout.layer_prefix.format(layer=layer) + module + ".weight"
        for layer in range(shape.layers)
        for module in layout.transposed
    }
    steps: list[Step] = []
    placed_layers: set[int] = set()
    for name, info in tensors.items():  # file order: the layer step goes where its first tensor was
        if name in layer_steps:
            step = layer_steps[name]
            if step.layer not in placed_layers:
                placed_layers.add(step.layer)
                steps.append(step)
            continue
        transpose = name in transposed
        shape_out = tuple(reversed(info.shape)) if transpose else info.shape
        steps.append(
            Step(
                {"tensor": name},
                (OutputTensor(name, _out_code(info.dtype, out_dtype), shape_out),),
                transpose=transpose,
            )
        )
    bytes_in = sum(info.nbytes for info in tensors.values())
    bytes_out = sum(out.nbytes for step in steps for out in step.outputs)
    return TensorPlan(shape, counts, method, steps, bytes_in, bytes_out)


_FLOAT_CODES = ("F16", "BF16", "F32", "F64")


def _validate_attention_shapes(stored: dict[str, str], tensors: dict[str, TensorInfo], shape: AttentionShape) -> None:
    """Every attention tensor of a layer against config.json's heads, kv heads and head_dim: a k_proj of
    a wrong but divisible shape would otherwise convert into a DST that transformers refuses."""
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    rows = {"q": q_rows, "k": kv_rows, "v": kv_rows, "qkv": q_rows + 2 * kv_rows, "k_norm": kv_rows}
    width = None  # q, k and v read the same input: the first projection's columns (q's, in layer_names order)
    for role, name in stored.items():
        if tensors[name].dtype not in _FLOAT_CODES:  # fp8 / int8 / 4-bit packed: pooling them ignores their scales
            raise InputError(
                f"{name} is stored as {tensors[name].dtype}: mha2gqa merges unquantized weights "
                f"({', '.join(_FLOAT_CODES)}); dequantize the checkpoint first (e.g. load it with "
                "transformers and save_pretrained in bfloat16)"
            )
        part, kind = role.rsplit(".", 1)
        got = list(tensors[name].shape)
        if part == "o":  # (d, H*hd): what it reads is the heads' output
            expected = [got[0] if got else 0, q_rows] if kind == "weight" else got[:1]
        elif part.startswith("k_norm"):  # olmo2: (n_kv*hd,); stablelm's k_norm.{j}: (hd,)
            expected = [rows["k_norm"] if part == "k_norm" else shape.head_dim]
        elif part not in rows:  # a role this check does not know: its layout's own concern
            continue
        elif kind == "weight":
            width = width or (got[1] if len(got) == 2 else 0)
            expected = [rows[part], width]
        else:
            expected = [rows[part]]
        if got != expected:
            raise InputError(
                f"{name} has shape {got} but config.json (num_attention_heads={shape.heads}, num_key_value_heads="
                f"{shape.kv_heads}, head_dim={shape.head_dim}) needs {expected}: the checkpoint does not match its "
                "config; fix config.json or use the weights it describes"
            )


def _layer_step(layer, stored, tensors, shape, groups, out_dtype) -> Step:
    outputs = tuple(
        OutputTensor(stored[role], _out_code(tensors[stored[role]].dtype, out_dtype), out_shape)
        for role, out_shape in output_shapes(stored, tensors, shape, groups).items()
    )
    return Step(dict(stored), outputs, layer)


def output_shapes(
    stored: dict[str, str], tensors: dict[str, TensorInfo], shape: AttentionShape, groups: int
) -> dict[str, tuple[int, ...]]:
    """The shape of every stored role after roles.pack(method(roles.unpack(...))), from the source shapes
    alone: kv rows scale by groups / kv_heads, fused q/k/v keep q's rows, per-head key norms past the new
    count are dropped, a Conv1D qkv_t is written as Linear rows. ShardedWriter checks every tensor's
    byte count against these, so a shape that disagreed with pack() would stop the conversion."""
    q_rows, kv_out = shape.heads * shape.head_dim, groups * shape.head_dim
    shapes = {}
    for role, name in stored.items():
        got, (part, kind) = tensors[name].shape, role.rsplit(".", 1)
        if part == "qkv_t" and kind == "weight":  # (d, rows) -> rows as Linear (rows, d)
            shapes[role] = (q_rows + 2 * kv_out, got[0])
        elif part in ("qkv", "qkv_t"):  # rows [q | k | v]
            shapes[role] = (q_rows + 2 * kv_out, *got[1:])
        elif part.startswith("k_norm."):  # stablelm: one (hd,) norm per kv head
            if int(part.split(".")[1]) < groups:
                shapes[role] = got
        elif role in KV_ROLES:  # (n_kv*hd, *rest) -> (G*hd, *rest)
            shapes[role] = (got[0] * groups // shape.kv_heads, *got[1:])
        else:
            shapes[role] = got
    return shapes


def _out_code(source_code: str, out_dtype: str | None) -> str:
    return source_code if out_dtype is None or source_code not in FLOAT_CODES else out_dtype
