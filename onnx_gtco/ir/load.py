"""Read and validate a model: parse, check, convert old opsets, fold constants, infer shapes (symbolic dims kept)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
from google.protobuf.message import DecodeError, Message
from onnx import helper

from onnx_gtco import progress
from onnx_gtco.errors import FoldError, ModelError, OpsetNotConvertedError, UnsupportedError, first_line
from onnx_gtco.ir.view import outer_scope_inputs, subgraphs

MIN_OPSET = 13
MAX_FOLD_ROUNDS = 8
"""Rounds of folding and shape inference at most: the folders run a static model's shape arithmetic to its end in
one or two; a round in which onnx-graphsurgeon folds nothing ends it sooner."""
CONVERT_TO_OPSET = 17
LAYERNORM_OPSET = 17
"""The opset ONNX defines LayerNormalization from. Below it, onnxruntime runs LayerNormalization of the default domain
as its own contrib op (tf2onnx and ORT's optimizer write it at opsets 13-16), with the same inputs, outputs,
attributes and defaults; the loader converts such a model to this opset, where the node means what it meant."""
assert CONVERT_TO_OPSET >= LAYERNORM_OPSET
ONNX_DOMAIN_ALIAS = "ai.onnx"
"""The default domain's other name (ORT's test generators import it so); the loader renames it to ""."""
_HIDDEN_DOMAIN = "ai.gtco.load.contrib"
"""Where contrib LayerNormalization nodes wait while onnx checks and converts the rest of the model (it knows no
LayerNormalization below opset 17 and would refuse them)."""


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's opset of the default ("" or "ai.onnx") domain, or None where it imports none (a model of other
    domains only, e.g. ai.onnx.ml: nothing in it is ours to fuse, and it passes through as it is). Where both
    names are imported the last import wins, as in onnxruntime."""
    versions = [int(imp.version) for imp in model.opset_import if imp.domain in ("", ONNX_DOMAIN_ALIAS)]
    return versions[-1] if versions else None


# External data past this total stays on disk while planning (the plan needs shapes, not weights): tensors of
# at least ON_DISK_MIN_BYTES keep their reference, with the directory they are in as the `basepath` entry, and
# onnx_gtco.ir.export.save_atomic copies them into the output's data file. Smaller external data is read in.
EXTERNAL_IN_MEMORY_LIMIT = 1 << 30
ON_DISK_MIN_BYTES = 1 << 20


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The model's tensors (initializers and attribute tensors, subgraphs included) whose data is external."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    return [t for t in _get_all_tensors(model) if uses_external_data(t)]


def external_entries(tensor: onnx.TensorProto) -> dict[str, str]:
    """A tensor's external_data key/value entries (location, offset, length, basepath, ...)."""
    return {e.key: e.value for e in tensor.external_data}


def _resolve_external(tensor: onnx.TensorProto, base: Path, name: Path) -> tuple[Path, int, int]:
    """The file, offset and length of an external tensor, checked to lie inside `base` and inside the file."""
    info = external_entries(tensor)
    loc = info.get("location", "")
    if not loc:
        raise ModelError(f"{name}: external data of tensor {tensor.name!r} names no file")
    file = (base / loc).resolve()
    if Path(loc).is_absolute() or not file.is_relative_to(base.resolve()):
        raise ModelError(f"{name}: external data of tensor {tensor.name!r} points outside the model's directory "
                         f"({loc})")
    if not file.is_file():
        raise ModelError(f"{name}: external data of tensor {tensor.name!r} is missing: {file} does not exist")
    size = file.stat().st_size
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else size - offset
    except ValueError:
        raise ModelError(f"{name}: external data of tensor {tensor.name!r} has a non-integer offset or length") \
            from None
    if offset < 0 or length < 0 or offset + length > size:
        raise ModelError(f"{name}: external data of tensor {tensor.name!r} is truncated: {file} has {size} bytes, "
                         f"the tensor needs bytes {offset}..{offset + length}")
    return file, offset, length


PROTOBUF_LIMIT = 2**31 - 1
"""protobuf's limit on a serialized message: a larger model keeps its weights in an external data file."""


def copy_fields(src: Message, dst: Message, skip: tuple[str, ...] = ()) -> None:
    """Copy the set fields of protobuf message `src` into `dst` except those named in `skip` (so a model can be
    copied without its weights)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model without its graph's initializers (copying no weight)."""
    out = onnx.ModelProto()
    copy_fields(model, out, skip=("graph",))
    copy_fields(model.graph, out.graph, skip=("initializer",))
    return out


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """What onnx.checker can take: the model itself, or, when weights are on disk (or it is over 2 GB), a copy whose
    external and >= ON_DISK_MIN_BYTES initializers are graph inputs of their type and shape instead (the checker
    cannot follow a `basepath` and cannot serialise 2 GB)."""
    if not external_tensors(model) and model.ByteSize() < PROTOBUF_LIMIT:
        return model
    from onnx.external_data_helper import uses_external_data

    out = without_initializers(model)
    g = model.graph
    declared = {v.name for v in g.input}
    for t in g.initializer:
        if uses_external_data(t) or len(t.raw_data) >= ON_DISK_MIN_BYTES:
            if t.name not in declared:
                out.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            out.graph.initializer.append(t)
    return out


def read_model(source: str | os.PathLike[str] | onnx.ModelProto) -> onnx.ModelProto:
    """Parse a path (external data resolved beside it) or take a ModelProto as it is.

    External data is read into memory unless it totals more than EXTERNAL_IN_MEMORY_LIMIT; then its large tensors
    stay on disk, each with a `basepath` entry naming the directory its `location` is relative to (see
    onnx_gtco.ir.export.save_atomic, which copies their bytes into the output's data file).

    Raises:
        ModelError: missing, empty, truncated or non-ONNX file; missing or truncated external data.
    """
    if isinstance(source, onnx.ModelProto):
        return source
    path = Path(source)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected an .onnx file")
    if path.stat().st_size == 0:
        raise ModelError(f"{path}: file is empty")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: not a valid ONNX protobuf ({type(e).__name__}: {e})") from None
    if not model.HasField("graph") or (len(model.graph.node) == 0 and len(model.graph.output) == 0):
        raise ModelError(f"{path}: parses as protobuf but holds no ONNX graph (truncated or not a model?)")
    base = path.parent.resolve()
    external = [(t, *_resolve_external(t, base, path)) for t in external_tensors(model)]
    keep_on_disk = sum(length for *_, length in external) > EXTERNAL_IN_MEMORY_LIMIT
    for tensor, file, offset, length in external:
        if keep_on_disk and length >= ON_DISK_MIN_BYTES:
            entries = [(k, v) for k, v in external_entries(tensor).items() if k != "basepath"]
            del tensor.external_data[:]
            for k, v in [*entries, ("basepath", str(base))]:
                tensor.external_data.add(key=k, value=v)
            continue
        with open(file, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return model


def load_model(source: str | os.PathLike[str] | onnx.ModelProto, min_opset: int = MIN_OPSET) -> onnx.ModelProto:
    """Read, validate and normalise a model for planning.

    Returns a new ModelProto: checked, opset >= 13 (older opsets converted), constants folded, shapes inferred.
    A `min_opset` above 13 is what the run needs (fp8's E4M3 tensors: 19): a model below it is converted to it.

    Raises:
        ModelError: unreadable or invalid model, or an opset we cannot convert.
        UnsupportedError: a model below `min_opset` that onnx's version converter cannot convert.
    """
    model = read_model(source)
    progress.step("check")
    name = str(source) if not isinstance(source, onnx.ModelProto) else "model"
    model = _domains_normalized(model)
    model = _simplified_layernorms_expanded(model, name)
    _refuse_unknown_ops(model, name)
    _refuse_dangling_inputs(model, name)
    contrib = _has_contrib_layernorm(model)
    if contrib:
        model = _with_layernorm_domain(model, "", _HIDDEN_DOMAIN)
    try:
        try:
            onnx.checker.check_model(weightless(model))
        except onnx.checker.ValidationError as e:
            if "topologically sorted" not in str(e):
                raise
            # valid but out of order (onnxruntime's fp16 converter writes such graphs): sort it, then check again
            model = _toposorted(model, name)
            onnx.checker.check_model(weightless(model))
    except onnx.checker.ValidationError as e:
        raise ModelError(f"{name}: invalid ONNX model: {checker_line(e)}") from None
    progress.step("opset")
    if default_opset(model) is None:  # no ONNX op to fold or fuse
        return infer_shapes(model, name)
    model = _convert_opset(model, name, contrib, min_opset)
    if contrib:
        model = _with_layernorm_domain(_mixed_layernorms_cast(model, name), _HIDDEN_DOMAIN, "")
    progress.step("fold constants, infer shapes")
    model = _folded(model, name)
    progress.step("order")
    _order_depth_first(model)
    return model


def _folded(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with its constants folded and shapes inferred, or, where folding cannot be done safely, only with
    its shapes inferred.

    Shapes first, so folding sees static extents (TorchScript exports compute reshape targets from Shape nodes);
    then rounds of folding (onnxscript's node-by-node folder, which infers shapes as it goes and drops the layout
    ops static shapes show to be no-ops, to its fixpoint, then onnx-graphsurgeon's, which folds constants of any
    size) and shape inference until onnx-graphsurgeon finds nothing more to fold, and infer the final graph.
    Folding is an optimization: when a folder fails on the model, or the folded model fails onnx.checker or strict
    shape inference (which the rewritten model's check applies), or lost a graph output, the unfolded model is kept.
    A model that onnx cannot infer strictly to begin with (a few standard ops' function bodies) keeps its folding
    where the unfolded model fails the same way.
    """
    folded = model
    try:
        for _ in range(MAX_FOLD_ROUNDS):
            simplified = _simplified(infer_shapes(folded, name))
            folded = _fold_constants(simplified)
            if _computing_nodes(folded) == _computing_nodes(simplified):
                break  # onnxscript's folder ran to its fixpoint, and onnx-graphsurgeon found nothing more
    except (ModelError, FoldError):
        return infer_shapes(model, name)
    if [o.name for o in folded.graph.output] != [o.name for o in model.graph.output]:
        return infer_shapes(model, name)
    try:
        return infer_shapes(folded, name, strict=True)
    except ModelError as e:
        folded_error = str(e)
    try:
        infer_shapes(model, name, strict=True)
    except ModelError as e:
        if str(e) == folded_error:
            return infer_shapes(folded, name)
    return infer_shapes(model, name)


def _computing_nodes(model: onnx.ModelProto) -> int:
    """The main graph's nodes other than Constant (onnx-graphsurgeon turns those into initializers)."""
    return sum(n.op_type != "Constant" for n in model.graph.node)


def _toposorted(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with its main graph's nodes in topological order (onnx-graphsurgeon's sort)."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    try:
        with gs.logger.G_LOGGER.suppress(gs.logger.G_LOGGER.CRITICAL + 1):  # it prints the error it then raises
            graph.toposort()
    except Exception as e:  # graphsurgeon raises a plain exception on a cycle
        raise ModelError(f"{name}: invalid ONNX model: the graph cannot be sorted topologically ({e})") from None
    out = gs.export_onnx(graph)
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    return out


# Initializers with more elements than this are hidden from shape inference: their shapes are all it needs, and
# serialising the weights of a large model for each inference pass cost more than the rest of loading together.
_INFER_VALUE_LIMIT = 4096


def _weights_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of the model whose initializers of more than _INFER_VALUE_LIMIT elements (or external data) are graph
    inputs of their type and shape instead, and those initializers (shapes are what inference and folding need of
    them; their bytes are not copied)."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                                      functions=model.functions))
    graph = skeleton.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    declared = {v.name for v in model.graph.input}
    hidden = []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims, dtype=np.int64)) <= _INFER_VALUE_LIMIT:
            graph.initializer.append(t)
        elif t.name not in declared:
            graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
            hidden.append(t)
    return skeleton, hidden


def infer_shapes(model: onnx.ModelProto, name: str, strict: bool = False) -> onnx.ModelProto:
    """Shape inference (symbolic dims kept, data propagation on) on a weightless copy; returns a new model.

    `strict`: the model is checked (onnx.checker, weights aside) and an error inferring any node fails (onnx
    otherwise skips the node and goes on).

    Raises:
        ModelError: the check or shape inference failed.
    """
    skeleton, _ = _weights_as_inputs(model)
    try:
        if strict:
            onnx.checker.check_model(skeleton)
        inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=True, strict_mode=strict, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, RuntimeError) as e:
        first = first_line(e)
        raise ModelError(f"{name}: shape inference failed: {first}") from None
    if any(d.dim_param for v in model.graph.input for d in v.type.tensor_type.shape.dim):
        inferred = _keep_dim_names(inferred)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    out.graph.value_info.extend(inferred.graph.value_info)
    del out.graph.output[:]
    out.graph.output.extend(inferred.graph.output)
    return out


"""Deprecated name of infer_shapes, kept while plugin.nodes still imports it."""


def _keep_dim_names(inferred: onnx.ModelProto) -> onnx.ModelProto:
    """Symbolic shapes through Shape/Slice/Reshape(-1): onnxruntime's symbolic shape inference carries the input's
    dim names (`batch`, `seq`) where onnx's gives fresh `unk__N` names; onnx's result stands where it cannot run."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        # a rewritten model's fused nodes are opaque to the tool: it reads them inlined (their inputs and outputs
        # keep their names), and only the graph's own tensors are kept
        flat = onnx.inliner.inline_local_functions(inferred) if inferred.functions else inferred
        symbolic = SymbolicShapeInference.infer_shapes(flat, auto_merge=True)
    except Exception:  # the tool raises plain Exceptions on the ops and graphs it does not cover
        return inferred
    if not inferred.functions:
        return symbolic
    names = {t for n in inferred.graph.node for t in n.output}
    out = onnx.ModelProto()
    out.CopyFrom(inferred)
    del out.graph.value_info[:]
    out.graph.value_info.extend(v for v in symbolic.graph.value_info if v.name in names)
    return out


def _order_depth_first(model: onnx.ModelProto) -> None:
    """Re-sort nodes in place: a depth-first post-order from the graph outputs.

    Every node then comes right after the producers it needs and before anything unrelated, so a layer's nodes are
    contiguous (MatMul next to its bias Add, the attention chain unbroken). The fusion DP's states are the frontiers
    of this order, so a local order keeps them few; exporters' orders (dynamo's especially) interleave layers.
    """
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    # a node's subgraphs (If, Loop, Scan bodies) may read the graph's tensors by name: those are its inputs too
    reads = [[*n.input, *outer_scope_inputs(n)] for n in nodes]
    done = [False] * len(nodes)
    order: list[int] = []

    def visit(root: int) -> None:
        stack = [(root, 0)]
        while stack:
            i, k = stack.pop()
            if done[i]:
                continue
            inputs = reads[i]
            while k < len(inputs) and (inputs[k] not in producer or done[producer[inputs[k]]]):
                k += 1
            if k == len(inputs):
                done[i] = True
                order.append(i)
            else:
                stack.append((i, k + 1))
                stack.append((producer[inputs[k]], 0))

    for out in model.graph.output:
        if out.name in producer:
            visit(producer[out.name])
    for i in range(len(nodes)):  # nodes no output needs (kept by the caller's choice) keep their place after
        visit(i)
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)


def _refuse_dangling_inputs(model: onnx.ModelProto, name: str) -> None:
    """A node input that nothing defines (onnx.checker reports it as an ordering problem) is refused naming it."""
    g = model.graph
    defined = {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    defined |= {s.values.name for s in g.sparse_initializer}
    for n in g.node:
        missing = next((t for t in n.input if t and t not in defined), None)
        if missing is not None:
            raise ModelError(f"{name}: invalid ONNX model: input {missing!r} of node {n.name or n.op_type!r} "
                             f"({n.op_type}) is no graph input, initializer or node output")


def checker_line(e: BaseException) -> str:
    """The first line of an onnx.checker error. onnx names the default domain by its name, the empty string, so its
    "No Opset registered for domain " reads as a message cut short; the domain is named '' here."""
    return re.sub(r"(for domain) ?$", r"\1 '' (the default ONNX domain)", first_line(e))


def _graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every subgraph in it (If branches, Loop and Scan bodies, nested ones too)."""
    todo = [model.graph]
    while todo:
        g = todo.pop()
        yield g
        todo.extend(sub for n in g.node for sub in subgraphs(n))


def _all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the model: its graphs' (subgraphs included) and its local functions' (their subgraphs too)."""
    for g in _graphs(model):
        yield from g.node
    for f in model.functions:
        todo = list(f.node)
        while todo:
            n = todo.pop()
            yield n
            todo.extend(m for sub in subgraphs(n) for m in sub.node)


@functools.lru_cache(maxsize=1)
def _ort_schemas() -> dict[tuple[str, str], tuple[int, ...]]:
    """onnxruntime's op schemas, ONNX's and its own contrib ops: (domain, op) -> the versions it was defined at."""
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    out: dict[tuple[str, str], list[int]] = {}
    for schema in get_all_operator_schema():
        out.setdefault((schema.domain, schema.name), []).append(int(schema.since_version))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _ort_opset(domain: str) -> int:
    """The opset onnxruntime reads a domain the model does not import at: its newest op version there (it imports
    every domain it knows at its latest), 1 for a domain it does not know."""
    return max((v for (d, _), versions in _ort_schemas().items() if d == domain for v in versions), default=1)


def _imports_normalized(imports: Iterable[onnx.OperatorSetIdProto]) -> list[onnx.OperatorSetIdProto]:
    """Opset imports with the alias `ai.onnx` as "", one import per domain, the last one winning (onnxruntime's
    rule where a model imports a domain twice), in the order of their first import."""
    versions: dict[str, int] = {}
    for imp in imports:
        domain = "" if imp.domain == ONNX_DOMAIN_ALIAS else imp.domain
        versions[domain] = int(imp.version)
    return [helper.make_opsetid(d, v) for d, v in versions.items()]


def _domains_normalized(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as onnxruntime reads it, which onnx's checker and the rewrite's functions need spelt out: the
    default domain's alias `ai.onnx` renamed "" (in imports, nodes and functions), and an import for each domain
    a node uses but the model does not import (at the opset onnxruntime gives it, e.g. com.microsoft 1). `model`
    itself when it needs neither; else a copy."""
    def irregular(imports: Iterable[onnx.OperatorSetIdProto]) -> bool:  # the alias, or a domain imported twice
        domains = [imp.domain for imp in imports]
        return ONNX_DOMAIN_ALIAS in domains or len(set(domains)) < len(domains)

    imported = {"" if imp.domain == ONNX_DOMAIN_ALIAS else imp.domain for imp in model.opset_import}
    used = {n.domain for g in _graphs(model) for n in g.node}
    missing = sorted(d for d in used - imported if d not in ("", ONNX_DOMAIN_ALIAS))
    if not (missing or irregular(model.opset_import) or any(irregular(f.opset_import) for f in model.functions)
            or any(n.domain == ONNX_DOMAIN_ALIAS for n in _all_nodes(model))):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    imports = _imports_normalized(out.opset_import)
    imports += [helper.make_opsetid(d, _ort_opset(d)) for d in missing]
    del out.opset_import[:]
    out.opset_import.extend(imports)
    for f in out.functions:
        imports = _imports_normalized(f.opset_import)
        del f.opset_import[:]
        f.opset_import.extend(imports)
    for n in _all_nodes(out):
        if n.domain == ONNX_DOMAIN_ALIAS:
            n.domain = ""
    return out


def _is_contrib_layernorm(node: onnx.NodeProto, opset: int) -> bool:
    return node.op_type == "LayerNormalization" and node.domain == "" and opset < LAYERNORM_OPSET


def _has_contrib_layernorm(model: onnx.ModelProto) -> bool:
    """Whether a graph of the model holds LayerNormalization below opset 17 (onnxruntime's contrib op)."""
    opset = default_opset(model)
    return opset is not None and any(_is_contrib_layernorm(n, opset) for g in _graphs(model) for n in g.node)


def _with_layernorm_domain(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    """A copy of the model whose LayerNormalization nodes of domain `old` (in every graph) are of domain `new`, and
    whose import of _HIDDEN_DOMAIN is there exactly when a node uses it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in _graphs(out):
        for n in g.node:
            if n.op_type == "LayerNormalization" and n.domain == old:
                n.domain = new
    imports = [imp for imp in out.opset_import if imp.domain != _HIDDEN_DOMAIN]
    if new == _HIDDEN_DOMAIN:
        imports.append(helper.make_opsetid(_HIDDEN_DOMAIN, 1))
    del out.opset_import[:]
    out.opset_import.extend(imports)
    return out


def _mixed_layernorms_cast(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with a Cast of X to Scale's type before each contrib LayerNormalization (in _HIDDEN_DOMAIN, main
    graph) whose Scale is of another float type than X: onnxruntime's contrib op takes that mix and computes Y in
    Scale's type, where ONNX's LayerNormalization wants one type for X, Scale and B. `model` itself when none is."""
    inferred = infer_shapes(model, name)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    mixed = [i for i, n in enumerate(model.graph.node) if n.domain == _HIDDEN_DOMAIN and len(n.input) > 1
             and types.get(n.input[0]) and types.get(n.input[1]) and types[n.input[0]] != types[n.input[1]]]
    if not mixed:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {t for n in out.graph.node for t in (*n.input, *n.output)} | {v.name for v in out.graph.input}
    taken |= {t.name for t in out.graph.initializer}
    nodes = list(out.graph.node)
    for i in reversed(mixed):
        ln = nodes[i]
        to = types[ln.input[1]]
        cast = f"{ln.input[0]}_as_{onnx.TensorProto.DataType.Name(to).lower()}"
        while cast in taken:
            cast += "_"
        taken.add(cast)
        nodes.insert(i, helper.make_node("Cast", [ln.input[0]], [cast], name=f"{ln.name or 'LayerNormalization'}/cast",
                                         to=to))
        ln.input[0] = cast
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


SIMPLIFIED_LN = "SimplifiedLayerNormalization"
"""onnxruntime's RMSNorm op of the default domain (what its optimizer writes for LLaMA's and T5's norms), which onnx
has no definition of: the loader writes it out in standard ops (_simplified_layernorms_expanded)."""


def _simplified_layernorms_expanded(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with each SimplifiedLayerNormalization of its main graph written out as the standard ops that compute
    it, which onnx can check and infer and the RMSNorm rule fuses: Cast to fp32 (its stash type), Mul by itself,
    ReduceMean over the normalised axes, Add epsilon, Sqrt, Reciprocal (its optional inv_std_var output), Mul, Cast
    back to the scale's type, Mul by the scale. `model` itself where it holds none.

    Raises:
        UnsupportedError: a stash type other than fp32, a positive axis over an input of unknown rank, or a scale
            whose type is unknown.
    """
    found = [n for n in model.graph.node if n.op_type == SIMPLIFIED_LN and n.domain == ""]
    opset = default_opset(model)
    if not found or opset is None or onnx.defs.has(SIMPLIFIED_LN, opset, ""):
        return model
    types = {v.name: v.type.tensor_type for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)}
    types |= {t.name: onnx.TypeProto.Tensor(elem_type=t.data_type) for t in model.graph.initializer}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    expand = {id(n) for n in found}
    for node in model.graph.node:
        nodes.extend(_simplified_ln_ops(node, types, opset, name) if id(node) in expand else [node])
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _simplified_ln_ops(node: onnx.NodeProto, types: dict[str, onnx.TypeProto.Tensor], opset: int, name: str
                       ) -> list[onnx.NodeProto]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    where = f"{name}: {SIMPLIFIED_LN} {node.name!r}"
    if int(attrs.get("stash_type", 1)) != onnx.TensorProto.FLOAT:
        raise UnsupportedError(f"{where}: stash_type {attrs['stash_type']} (only fp32 statistics are taken)")
    x, scale = node.input[0], node.input[1]
    axis = int(attrs.get("axis", -1))
    rank = len(types[x].shape.dim) if x in types and types[x].HasField("shape") else None
    if axis >= 0 and rank is None:
        raise UnsupportedError(f"{where}: axis {axis} over an input of unknown rank (give the model's shapes)")
    first = axis - rank if axis >= 0 and rank is not None else axis
    axes = list(range(first, 0))
    dtype = types[scale].elem_type if scale in types else 0
    if not dtype:
        raise UnsupportedError(f"{where}: the type of its scale {scale!r} is unknown")
    p = f"{node.name or node.output[0]}/"
    eps = helper.make_tensor(f"{p}epsilon", onnx.TensorProto.FLOAT, [], [float(attrs.get("epsilon", 1e-5))])
    ops = [helper.make_node("Cast", [x], [f"{p}x"], name=f"{p}cast", to=onnx.TensorProto.FLOAT),
           helper.make_node("Mul", [f"{p}x", f"{p}x"], [f"{p}sq"], name=f"{p}square")]
    if opset >= 18:
        axes_t = helper.make_tensor(f"{p}axes", onnx.TensorProto.INT64, [len(axes)], axes)
        ops += [helper.make_node("Constant", [], [f"{p}axes"], name=f"{p}axes", value=axes_t),
                helper.make_node("ReduceMean", [f"{p}sq", f"{p}axes"], [f"{p}ms"], name=f"{p}mean", keepdims=1)]
    else:
        ops.append(helper.make_node("ReduceMean", [f"{p}sq"], [f"{p}ms"], name=f"{p}mean", axes=axes, keepdims=1))
    inv = node.output[1] if len(node.output) > 1 and node.output[1] else f"{p}inv"
    ops += [helper.make_node("Constant", [], [f"{p}epsilon"], name=f"{p}epsilon", value=eps),
            helper.make_node("Add", [f"{p}ms", f"{p}epsilon"], [f"{p}var"], name=f"{p}add_eps"),
            helper.make_node("Sqrt", [f"{p}var"], [f"{p}rms"], name=f"{p}sqrt"),
            helper.make_node("Reciprocal", [f"{p}rms"], [inv], name=f"{p}reciprocal"),
            helper.make_node("Mul", [f"{p}x", inv], [f"{p}n"], name=f"{p}normalize"),
            helper.make_node("Cast", [f"{p}n"], [f"{p}nt"], name=f"{p}cast_back", to=dtype),
            helper.make_node("Mul", [f"{p}nt", scale], [node.output[0]], name=f"{p}scale")]
    return ops


def _refuse_unknown_ops(model: onnx.ModelProto, name: str) -> None:
    """An op of the default domain without a schema at the model's opset is refused naming the ops: a misspelt op,
    or one of onnxruntime's own ops of the default domain (ImageScaler and the other experimental ops of old
    opsets, ...), which onnx cannot check, convert or infer. LayerNormalization below opset 17 is taken
    (LAYERNORM_OPSET), and SimplifiedLayerNormalization is written out before (_simplified_layernorms_expanded)."""
    opset = default_opset(model)
    if opset is None:
        return
    unknown = sorted({n.op_type for n in model.graph.node if n.domain == ""
                      and not onnx.defs.has(n.op_type, opset, "") and not _is_contrib_layernorm(n, opset)})
    strangers = [op for op in unknown if not any(v <= opset for v in _ort_schemas().get(("", op), ()))]
    if strangers:
        raise UnsupportedError(f"{name}: op {', '.join(strangers)} has no ONNX definition at opset {opset}, nor does "
                               "onnxruntime know it (a misspelt op, or a custom op without its domain); correct the "
                               "op's name, or give a custom op's node the domain its library registers")
    if unknown:
        ops = ", ".join(unknown)
        raise UnsupportedError(f"{name}: op {ops} has no ONNX definition at opset {opset}: onnxruntime runs {ops} as "
                               "its own op, which onnx cannot check or convert; export the model with standard ONNX "
                               "ops in its place (a current exporter, without onnxruntime's graph optimizations)")


def _convert_opset(model: onnx.ModelProto, name: str, contrib: bool = False, min_opset: int = MIN_OPSET
                   ) -> onnx.ModelProto:
    """The model at opset >= MIN_OPSET of the default domain (onnx's version converter, to CONVERT_TO_OPSET); with
    `contrib` (its contrib LayerNormalization nodes moved to _HIDDEN_DOMAIN, which the converter leaves as they are)
    at CONVERT_TO_OPSET also from opsets 13-16, so that LayerNormalization has its ONNX definition. Below a
    `min_opset` above MIN_OPSET, to `min_opset` (or CONVERT_TO_OPSET where that is higher).

    Raises:
        UnsupportedError: an opset newer than the onnx package knows; with `contrib` or a `min_opset`, a model the
            converter fails on or converts into another model.
        OpsetNotConvertedError: an old opset the converter fails on or converts into another model.
    """
    opset = default_opset(model)
    assert opset is not None, "the caller passes models of the default domain only"
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise UnsupportedError(f"{name}: opset {opset} is newer than this onnx package supports ({newest})")
    needed = max(MIN_OPSET, min_opset)
    if opset >= needed and not contrib:
        return model
    to_opset = max(CONVERT_TO_OPSET, needed)

    def refusal(problem: str) -> UnsupportedError:
        if min_opset > MIN_OPSET and opset < min_opset:  # the run needs the newer opset: no passing through
            return UnsupportedError(f"{name}: this run needs opset {min_opset} (the model has {opset}) and onnx's "
                                    f"version converter {problem}; re-export the model with opset >= {min_opset}")
        if contrib:  # the model cannot pass through at its own opset: onnx refuses LayerNormalization there
            return UnsupportedError(
                f"{name}: LayerNormalization at opset {opset} (onnxruntime's contrib op) needs the model at opset "
                f"{LAYERNORM_OPSET}, and onnx's version converter {problem}; re-export the model with opset >= "
                f"{LAYERNORM_OPSET}")
        return OpsetNotConvertedError(f"{name}: opset {opset} < {MIN_OPSET} and onnx's version converter {problem}; "
                                      f"re-export the model with opset >= {MIN_OPSET}", model)

    try:
        converted = onnx.version_converter.convert_version(model, to_opset)
        onnx.checker.check_model(weightless(converted))
    except Exception as e:  # the converter raises bare RuntimeErrors and more
        raise refusal(f"failed: {first_line(e)}") from None
    changed = next((b.name for a, b in zip([*model.graph.input, *model.graph.output],
                                           [*converted.graph.input, *converted.graph.output], strict=False)
                    if a.name != b.name or a.type != b.type), None)
    if changed is not None or len(converted.graph.input) != len(model.graph.input) \
            or len(converted.graph.output) != len(model.graph.output):
        # e.g. Scan-8's batch axis, which the converter drops from the graph's inputs and outputs
        raise refusal(f"changed the graph's inputs or outputs ({changed or 'their number'})")
    return converted


def _fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constant subgraphs (shape arithmetic of static shapes) with onnx-graphsurgeon, then drop dead nodes.

    Raises:
        FoldError: onnx-graphsurgeon failed on the model.
    """
    import onnx_graphsurgeon as gs

    functions = list(model.functions)
    try:
        graph = gs.import_onnx(_shape_slices_split(model))
        graph.fold_constants(error_ok=True).cleanup(remove_unused_graph_inputs=False).toposort()
        folded = gs.export_onnx(graph, do_type_check=False)
    except Exception as e:  # it raises what its passes raise (UnboundLocalError on absent optional values, ...)
        raise FoldError(f"{type(e).__name__}: {e}") from e
    folded.ir_version = model.ir_version
    del folded.functions[:]
    folded.functions.extend(functions)
    del folded.metadata_props[:]
    folded.metadata_props.extend(model.metadata_props)
    folded.producer_name, folded.producer_version = model.producer_name, model.producer_version
    return folded


def _simplified(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx_gtco.ir.simplify on the model with its large weights as graph inputs (they are not folded, and not
    serialising them keeps it fast), the weights put back after; the model's metadata kept.

    Raises:
        FoldError: onnxscript's optimizer failed on the model.
    """
    from onnx_gtco.ir.simplify import simplify

    skeleton, hidden = _weights_as_inputs(model)
    try:
        out = simplify(skeleton)
    except Exception as e:  # onnxscript raises what its passes and the reference evaluator raise
        raise FoldError(f"{type(e).__name__}: {e}") from e
    hidden_names = {t.name for t in hidden}
    read = {t for n in out.graph.node for t in (*n.input, *outer_scope_inputs(n))} | {o.name for o in out.graph.output}
    inputs = [v for v in out.graph.input if v.name not in hidden_names]
    del out.graph.input[:]
    out.graph.input.extend(inputs)
    out.graph.initializer.extend(t for t in hidden if t.name in read)
    copy_fields(model, out, skip=("graph", "opset_import", "functions", "ir_version"))
    return out


def _shape_slices_split(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each Shape node that has a start or end attribute (opset 15) split into a plain Shape and a
    Slice of its result, subgraphs included; `model` itself if it has none.

    onnx-graphsurgeon folds a Shape of a static tensor into the tensor's whole shape, ignoring start and end; its
    folds of Shape -> Slice and Shape -> Gather are right.
    """
    def has_range(n: onnx.NodeProto) -> bool:
        return n.op_type == "Shape" and n.domain in ("", "ai.onnx") and any(a.name in ("start", "end")
                                                                            for a in n.attribute)

    def graphs(g: onnx.GraphProto):
        yield g
        for n in g.node:
            for sub in subgraphs(n):
                yield from graphs(sub)

    if not any(has_range(n) for g in graphs(model.graph) for n in g.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {t for g in graphs(out.graph) for n in g.node for t in (*n.input, *n.output)}
    names |= {v.name for g in graphs(out.graph) for v in (*g.input, *g.initializer)}

    def fresh(base: str) -> str:
        k = 0
        while f"{base}_{k}" in names:
            k += 1
        names.add(f"{base}_{k}")
        return f"{base}_{k}"

    for g in list(graphs(out.graph)):
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            if not has_range(n):
                nodes.append(n)
                continue
            attrs = {a.name: a.i for a in n.attribute}
            whole, starts, ends = fresh(f"{n.output[0]}_shape"), fresh(f"{n.output[0]}_start"), \
                fresh(f"{n.output[0]}_end")
            nodes += [helper.make_node("Shape", [n.input[0]], [whole], name=n.name),
                      helper.make_node("Constant", [], [starts], value=helper.make_tensor(
                          starts, onnx.TensorProto.INT64, [1], [attrs.get("start", 0)])),
                      helper.make_node("Constant", [], [ends], value=helper.make_tensor(
                          ends, onnx.TensorProto.INT64, [1], [attrs.get("end", np.iinfo(np.int64).max)])),
                      helper.make_node("Slice", [whole, starts, ends], [n.output[0]])]
        del g.node[:]
        g.node.extend(nodes)
    return out
