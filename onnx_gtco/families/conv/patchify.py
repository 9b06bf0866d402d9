"""Patch-embedding convs (stride = kernel, no padding) rewritten as a patchify copy and a GEMM before planning.

A conv whose stride equals its kernel reads every input pixel once: each output pixel is the dot product of one
KH x KW patch (over all C channels) with a filter, so the conv is one GEMM of the patches, [N·OH·OW, C·KH·KW], and
the weight as a [C·KH·KW, OC] matrix. The conv kernel gathers its A operand pixel by pixel (implicit GEMM); the
rewrite makes the gather a layout copy that the elementwise family runs as one index map, and the product a weight
GEMM with its bias that every GEMM implementation (mma, CUTLASS, cuBLASLt) takes:

    x [N, C, H, W] --Conv W [OC, C, KH, KW], b (stride = kernel)--> y [N, OC, OH, OW]

    x --[Slice to OH·KH x OW·KW]--Reshape [N, C, OH, KH, OW, KW]--Transpose (0, 2, 4, 1, 3, 5)     (patchify copy)
      --Reshape [N, OH·OW, C·KH·KW]--MatMul W' [C·KH·KW, OC]--[Add b]--> tokens [N, OH·OW, OC]    (weight GEMM)
      --Reshape [N, OH, OW, OC]--Transpose (0, 3, 1, 2)--> y                                     (back to NCHW)

W' = W.reshape(OC, C·KH·KW)ᵀ is a new initializer; b is the conv's own. A VALID conv with stride = kernel ignores
the rows and columns past the last whole patch, so where H or W is no multiple of the kernel a Slice drops them
first. The last Transpose writes the conv's output name, so every reader is unchanged. A ViT's readers turn y back
into tokens (Reshape to [N, OC, OH·OW], Transpose (0, 2, 1)): after the NCHW restore that chain gives back the
element order of the GEMM's result, and the loader's own simplification (ir.simplify), run on the rewritten model,
drops it, so the token stream reads the GEMM's result; a reader that needs NCHW keeps the restore
(PatchConv.nchw_copy says which, for the decision's cost).

It runs on a model as load_model leaves it, which has what it needs: the conv's input shape static and known (a
graph input's or value_info), the weight folded to an initializer (a Constant node's output is taken too), opset
>= 13, and no-op layout ops already dropped, so the simplification changes nothing but the rewrite's chains. It
infers no shape again: the new tensors' shapes follow from the conv's static ones and are written as value_info, and
the value_info of the tensors the simplification removes goes with them. On a model the loader has not simplified,
the simplification also does what the loader would have done (fold constants, drop no-op layout ops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from onnx_gtco.ir.view import GraphView, Node, outer_scope_inputs, subgraphs
from onnx_gtco.patterns.base import is_op
from onnx_gtco.patterns.util import FLOAT_TYPES

MIN_OPSET = 10
"""Slice takes its bounds as inputs from opset 10 (load_model leaves opset 13 or later)."""


@dataclass(frozen=True)
class PatchConv:
    """One conv the rewrite can take, as a decision whether it pays sees it.

    Attributes:
        name: the conv node's name (as the planner names it: "Conv_<index>" where the node has none).
        batch, c, h, w: the input's [N, C, H, W].
        oc, kh, kw: output channels and the kernel (= the stride).
        dtype: the ONNX element type of input, weight and output.
        bias: whether the conv has a bias (the GEMM's epilogue then adds it).
        nchw_copy: whether the rewritten model still copies the GEMM's result back to NCHW (a reader needs the conv's
            layout); False where every reader turned it back into tokens and that chain collapsed.
    """

    name: str
    batch: int
    c: int
    h: int
    w: int
    oc: int
    kh: int
    kw: int
    dtype: int
    bias: bool
    nchw_copy: bool = True

    @property
    def oh(self) -> int:
        return self.h // self.kh

    @property
    def ow(self) -> int:
        return self.w // self.kw

    @property
    def sliced(self) -> bool:
        """Whether H or W is no multiple of the kernel (the patchify copy then reads part of the input)."""
        return self.h % self.kh != 0 or self.w % self.kw != 0

    @property
    def gemm_m(self) -> int:
        """The GEMM's rows: one per output pixel, N·OH·OW."""
        return self.batch * self.oh * self.ow

    @property
    def gemm_n(self) -> int:
        return self.oc

    @property
    def gemm_k(self) -> int:
        """The GEMM's depth: one patch, C·KH·KW."""
        return self.c * self.kh * self.kw

    @property
    def patchify_elems(self) -> int:
        """Elements the patchify copy reads and writes (M·K)."""
        return self.gemm_m * self.gemm_k

    @property
    def nchw_elems(self) -> int:
        """Elements the copy back to NCHW moves (M·N), 0 where it collapsed."""
        return self.gemm_m * self.oc if self.nchw_copy else 0


@dataclass(frozen=True)
class _Site:
    """A qualifying conv: its node, what the decision sees, and its weight's value."""

    node: Node
    conv: PatchConv
    weight: np.ndarray


def _ints(node: Node, attr: str, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(v) for v in node.attrs.get(attr, default))


def _constant(view: GraphView, inits: dict[str, onnx.TensorProto], inputs: set[str], tensor: str
              ) -> np.ndarray | None:
    """The value of a constant tensor, or None: an initializer that is no graph input (a caller could feed one that
    is), read where the loader left it on disk too, or a Constant node's output."""
    if tensor in inputs:
        return None
    t = inits.get(tensor)
    if t is None:
        return view.const_value(tensor)
    if external_data_helper.uses_external_data(t):  # read_model left it on disk, where `basepath` says
        return numpy_helper.to_array(t, base_dir={e.key: e.value for e in t.external_data}.get("basepath", ""))
    return numpy_helper.to_array(t)


def _site(view: GraphView, node: Node, inits: dict[str, onnx.TensorProto], inputs: set[str]) -> _Site | None:
    """The conv as a rewrite site, or None where it does not qualify: 2-D, group 1, dilation 1, stride = kernel, no
    padding, a constant weight (and bias), a float input of static shape."""
    if not is_op(node, "Conv") or len(node.inputs) < 2 or len(node.outputs) != 1 or not node.inputs[1]:
        return None
    info = view.info(node.inputs[0])
    if info is None or info.dtype not in FLOAT_TYPES or info.shape is None or len(info.shape) != 4 \
            or not all(isinstance(d, int) and d > 0 for d in info.shape):
        return None
    n, c, h, w = (int(d) for d in info.shape)  # type: ignore[arg-type]
    wshape = view.shape(node.inputs[1])
    if wshape is None or len(wshape) != 4 or wshape[1] != c or not all(isinstance(d, int) for d in wshape):
        return None
    oc, _, kh, kw = (int(d) for d in wshape)  # type: ignore[arg-type]
    auto_pad = node.attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    pads = (0, 0, 0, 0) if auto_pad == "VALID" else _ints(node, "pads", (0, 0, 0, 0))
    if int(node.attrs.get("group", 1)) != 1 or auto_pad not in ("NOTSET", "VALID") or any(pads) \
            or _ints(node, "kernel_shape", (kh, kw)) != (kh, kw) or _ints(node, "strides", (1, 1)) != (kh, kw) \
            or _ints(node, "dilations", (1, 1)) != (1, 1) or h < kh or w < kw:
        return None
    bias = len(node.inputs) > 2 and bool(node.inputs[2])
    if bias:
        bshape = view.shape(node.inputs[2])
        if bshape is None or tuple(bshape) != (oc,) or node.inputs[2] in inputs or not view.is_constant(node.inputs[2]):
            return None
    winfo = view.info(node.inputs[1])
    weight = _constant(view, inits, inputs, node.inputs[1]) if winfo is not None and winfo.dtype == info.dtype else None
    if weight is None or weight.shape != (oc, c, kh, kw):
        return None
    return _Site(node, PatchConv(node.name, n, c, h, w, oc, kh, kw, info.dtype, bias), weight)


def _taken(model: onnx.ModelProto) -> set[str]:
    """Every node and tensor name of the model, its subgraphs' too (a new name must shadow none)."""
    names: set[str] = set()
    todo = [model.graph]
    while todo:
        g = todo.pop()
        names |= {v.name for v in (*g.input, *g.output, *g.value_info)} | {t.name for t in g.initializer}
        for n in g.node:
            names |= {n.name, *n.input, *n.output}
            todo += subgraphs(n)
    return names


class _Names:
    """Fresh names: a wanted name where the model has none such, else the name with the first free suffix."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.taken = _taken(model)

    def __call__(self, name: str) -> str:
        k, new = 0, name
        while new in self.taken:
            k += 1
            new = f"{name}_{k}"
        self.taken.add(new)
        return new


def _replacement(site: _Site, fresh: _Names
                 ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.ValueInfoProto]]:
    """The nodes that replace the site's conv (its output name kept), their new initializers, and the value_info of
    the tensors they make (the conv's output keeps its own)."""
    pc, conv = site.conv, site.node
    p = f"{pc.name}.patchify"
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    infos: list[onnx.ValueInfoProto] = []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, fresh(name)))
        return inits[-1].name

    def op(op_type: str, step: str, inputs: list[str], shape: list[int], **attrs: object) -> str:
        name = fresh(f"{p}.{step}")  # the node's output is named after it, as the conv's is
        out = conv.outputs[0] if step == "nchw" else name
        nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        if step != "nchw":
            infos.append(helper.make_tensor_value_info(out, pc.dtype, shape))
        return out

    def reshape(x: str, step: str, dims: list[int]) -> str:
        return op("Reshape", step, [x, const(f"{p}.{step}.shape", np.array(dims, dtype=np.int64))], dims)

    x = conv.inputs[0]
    if pc.sliced:  # a VALID conv with stride = kernel ignores what is left past the last whole patch
        h, w = pc.oh * pc.kh, pc.ow * pc.kw
        bounds = [const(f"{p}.slice.{k}", np.array(v, dtype=np.int64))
                  for k, v in (("starts", [0, 0]), ("ends", [h, w]), ("axes", [2, 3]))]
        x = op("Slice", "slice", [x, *bounds], [pc.batch, pc.c, h, w])
    x = reshape(x, "split", [pc.batch, pc.c, pc.oh, pc.kh, pc.ow, pc.kw])
    x = op("Transpose", "permute", [x], [pc.batch, pc.oh, pc.ow, pc.c, pc.kh, pc.kw], perm=[0, 2, 4, 1, 3, 5])
    rows = [pc.batch, pc.oh * pc.ow]
    x = reshape(x, "patches", [*rows, pc.gemm_k])
    weight = const(f"{p}.weight", np.ascontiguousarray(site.weight.reshape(pc.oc, pc.gemm_k).T))
    x = op("MatMul", "matmul", [x, weight], [*rows, pc.oc])
    if pc.bias:
        x = op("Add", "add", [x, conv.inputs[2]], [*rows, pc.oc])
    x = reshape(x, "unflatten", [pc.batch, pc.oh, pc.ow, pc.oc])
    op("Transpose", "nchw", [x], [pc.batch, pc.oc, pc.oh, pc.ow], perm=[0, 3, 1, 2])
    return nodes, inits, infos


def _rewritten(model: onnx.ModelProto, sites: list[_Site]) -> onnx.ModelProto:
    """A copy of the model with each site's conv replaced by the patchify copy, the GEMM and the NCHW restore, then
    simplified as the loader does (which drops a restore its readers undo, and what nothing reads any more)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    fresh = _Names(model)
    inserts: dict[int, list[onnx.NodeProto]] = {}
    for site in sites:
        nodes, inits, infos = _replacement(site, fresh)
        inserts[site.node.id] = nodes
        graph.initializer.extend(inits)
        graph.value_info.extend(infos)
    kept: list[onnx.NodeProto] = []
    for i, n in enumerate(model.graph.node):
        kept.extend(inserts.get(i, [n]))
    del graph.node[:]
    graph.node.extend(kept)
    read = {t for n in graph.node for t in (*n.input, *outer_scope_inputs(n))} | {o.name for o in graph.output}
    weights = {s.node.inputs[1] for s in sites} - read - {v.name for v in graph.input}
    inits = [t for t in graph.initializer if t.name not in weights]  # the old weights nothing else reads
    del graph.initializer[:]
    graph.initializer.extend(inits)
    typed = list(graph.value_info)  # the loader's and the shapes written above
    simple = _simplified(out)
    made = {o for n in simple.graph.node for o in n.output} - {o.name for o in simple.graph.output}
    del simple.graph.value_info[:]
    simple.graph.value_info.extend(v for v in typed if v.name in made)  # of the tensors still made
    return simple


def _simplified(model: onnx.ModelProto) -> onnx.ModelProto:
    """The loader's simplification (ir.simplify, as load_model runs it) of the rewritten model: it drops a restore
    whose readers undo it, and what nothing reads any more. Its serialization drops the `basepath` of the weights
    read_model left on disk, so those initializers are put back as they were (load_model's own wrapper, which hides
    the weights from it, lives in ir.load, which the rules may not import: it imports onnxruntime). The model as it
    is where the simplification fails: the rewrite stands without the collapse."""
    from onnx_gtco.ir.simplify import simplify  # onnxscript, imported only when a conv is rewritten

    try:
        out = simplify(model)
    except Exception:  # onnxscript raises what its passes and the reference evaluator raise
        return model
    on_disk = {t.name: t for t in model.graph.initializer if external_data_helper.uses_external_data(t)}
    for t in out.graph.initializer:
        if t.name in on_disk:
            t.CopyFrom(on_disk[t.name])
    return out


def patchify_convs(model: onnx.ModelProto, decide: Callable[[PatchConv], bool] | None = None
                   ) -> tuple[onnx.ModelProto, list[PatchConv]]:
    """`model` with each qualifying conv that `decide` takes (None: every one) rewritten as a patchify copy and a
    weight GEMM (+ bias), and the PatchConv of each conv rewritten, in node order.

    A conv qualifies where it is 2-D with group 1, dilations 1, strides equal to its kernel, no padding (pads 0, or
    auto_pad VALID), a constant weight and bias, and a float input (float, float16, bfloat16) of static shape; H
    and W need not be multiples of the kernel. `decide` sees each qualifying conv once, in node order, with
    `nchw_copy` as the rewrite would leave it. The result is a new model that keeps every name its readers use
    (the conv's output name among them), with its outputs' dtypes and shapes, its nodes topologically sorted, new
    names unique and no initializer left that nothing reads; the model passed in is unchanged, and is what is
    returned when nothing is rewritten. Meant for a model as load_model leaves it (see the module's docstring).
    """
    versions = [imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
    if not versions or versions[-1] < MIN_OPSET:
        return model, []
    view = GraphView(model)
    inits = {t.name: t for t in model.graph.initializer}
    inputs = set(view.graph_inputs)
    sites = [s for node in view.nodes if (s := _site(view, node, inits, inputs)) is not None]
    if not sites:
        return model, []
    every = _rewritten(model, sites)  # what the rewrite of each leaves (a collapse depends on its own readers only)
    made = {o for n in every.graph.node for o in n.output}
    sites = [replace(s, conv=replace(s.conv, nchw_copy=s.node.outputs[0] in made)) for s in sites]
    chosen = [s for s in sites if decide is None or decide(s.conv)]
    if not chosen:
        return model, []
    out = every if len(chosen) == len(sites) else _rewritten(model, chosen)
    return out, [s.conv for s in chosen]
