"""FP8 GEMMs (`--precision fp8`): E4M3 GEMM operands with per-tensor scales, fp16 everywhere else, fp32 accumulation.

The plan, the rewrite and the half conversion are fp16's (onnx_gtco.precision; GtcoConfig.plan_precision); then
`quantize` turns each fused GEMM node whose B is a weight into a `Gemm_f8` node, the way TensorRT with NVIDIA's Model
Optimizer quantizes a transformer's linear layers and keeps its attention in fp16:

- **Scales**, one per tensor, s = amax / 448 (E4M3's largest finite value): a weight's from its values, an
  activation's (the GEMM's A) from the calibration samples, its largest |value| over them as onnxruntime's
  quantization tooling collects it (its MinMax calibrator, symmetric, on the fp32 rewritten model).
- **The node**: B stored as a FLOAT8E4M3FN initializer holding round(W / s_b), saturated, K-major ([N, K], the
  node's trans_b: what FP8 Tensor Core GEMMs read, cuBLASLt's and wgmma's alike); A is still the fp16
  tensor the node's producer writes: the node quantizes it, round(a / s_a) saturated to +-448. The scales are one
  fp32 initializer [s_a, s_b], the node's `scales` role. Its model-local function says exactly that with opset
  19's QuantizeLinear / DequantizeLinear, then runs the group's fp32 nodes on the dequantized operands: the
  E4M3 GEMM (products of E4M3 values are exact in fp32) up to the order of the fp32 sums. Opset 19 is what E4M3
  tensors need, so an fp8 run loads its model at opset 19 or newer (ir.load.load_model's `min_opset`).
- **The error budget**: each GEMM's relative error ||Q(a) Q(b) - a b|| / ||a b|| over the calibration samples (its
  A as the fp32 model computes it, so one GEMM's error is not charged to the next); a GEMM past the budget stays
  fp16, and the report names it with its error, the way TensorRT users pin sensitive layers. A calibration amax far
  below what the samples reach saturates A there and shows up as such an error.

Kernels: the CPU library's (plugins/families/gemm/gemm_ref.h) and, on the device, the GEMM family's mma kernel
(gemm.cuh FP8: B's E4M3 bytes decoded to halves, A rounded to E4M3 as it is read, the f16 mma on those exact values,
alpha = s_a s_b); CUTLASS's and cuBLASLt's FP8 GEMMs, which need A in E4M3 in memory, are not built yet.

Only `gemm` nodes whose B is an initializer held in memory take E4M3 operands: attention (Q Kᵀ, P V) and GEMMs of
two activations stay fp16, as QKV nodes (three projections of one A) do for now.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from onnx_gtco.errors import CalibrationError, RewriteError, first_line
from onnx_gtco.opspec import DOMAIN, FP8_DTYPE, decode_node, op_type
from onnx_gtco.precision import E4M3_MAX, round_e4m3, to_e4m3

FP8_OPSET = 19
"""The opset of FLOAT8E4M3FN tensors and of QuantizeLinear / DequantizeLinear with them."""
SCALES_ROLE = "scales"
"""The role of a `Gemm_f8` node's [s_a, s_b] (fp32): A's and B's per-tensor scales."""


def scale_of(amax: float) -> float:
    """The per-tensor scale mapping `amax` onto E4M3's largest value (1 for an all-zero tensor)."""
    return float(np.float32(amax / E4M3_MAX)) if amax > 0 and np.isfinite(amax) else 1.0


# --- calibration data ----------------------------------------------------------------------------------------------
FLAG = "--calibration-data"


def read_calibration(spec: Any, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """The calibration samples `spec` names, each a feed dict of `model`'s inputs.

    `spec`: a folder (its *.npz files in name order, each one sample keyed by input name or several as
    check --save-inputs writes them), one .npz, "MODULE:NAME" or "FILE.py:NAME" (a data reader: an onnxruntime
    CalibrationDataReader, an iterable of feed dicts, or a function of no arguments returning one of those), or
    such a reader or iterable itself.

    Raises:
        CalibrationError: nothing readable, no sample, or a sample that does not fit the model's inputs.
    """
    from onnx_gtco.runtime.check import CheckError, checked_sample, load_inputs

    try:
        if isinstance(spec, (str, os.PathLike)) and not _reader_spec(spec):
            path = Path(spec)
            files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
            if path.is_dir() and not files:
                raise CalibrationError(f"{FLAG} {spec}: the folder holds no .npz files")
            return [sample for f in files for sample in load_inputs(f, model, FLAG)]
        source = _load_reader(str(spec)) if isinstance(spec, (str, os.PathLike)) else spec
        where = f"{FLAG} {spec}" if isinstance(spec, (str, os.PathLike)) else "calibration data"
        feeds = list(_drain(source, where))
        if not feeds:
            raise CalibrationError(f"{where}: the reader gave no samples")
        return [checked_sample({n: np.asarray(v) for n, v in feed.items()}, model, where, f"sample{k}/")
                for k, feed in enumerate(feeds)]
    except CheckError as e:
        raise CalibrationError(str(e)) from None


def _reader_spec(spec: Any) -> bool:
    text = os.fspath(spec)
    head, sep, name = text.rpartition(":")
    return bool(sep) and name.isidentifier() and not Path(text).exists() and len(head) > 1


def _load_reader(spec: str) -> Any:
    head, _, name = spec.rpartition(":")
    try:
        if head.endswith(".py"):
            path = Path(head)
            if not path.is_file():
                raise CalibrationError(f"{FLAG} {spec}: no such file {head}")
            module_name = f"_gtco_calibration_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
            loaded = importlib.util.spec_from_file_location(module_name, path)
            assert loaded is not None and loaded.loader is not None
            module = importlib.util.module_from_spec(loaded)
            sys.modules[module_name] = module
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(head)
    except CalibrationError:
        raise
    except Exception as e:  # the user's module: any error it raises is theirs, reported in one line
        raise CalibrationError(f"{FLAG} {spec}: cannot import {head}: {first_line(e)}") from None
    if not hasattr(module, name):
        raise CalibrationError(f"{FLAG} {spec}: {head} has no {name!r}")
    return getattr(module, name)


def _drain(source: Any, where: str) -> Iterable[Mapping[str, Any]]:
    """The feed dicts of a reader: get_next() until None (onnxruntime's CalibrationDataReader), an iterable's
    items, or what a function (or a class) of no arguments returns."""
    if isinstance(source, type) or (callable(source) and not hasattr(source, "get_next")
                                    and not isinstance(source, Iterable)):
        try:
            source = source()
        except Exception as e:
            raise CalibrationError(f"{where}: the reader failed: {first_line(e)}") from None
    if hasattr(source, "get_next"):
        while (feed := source.get_next()) is not None:
            yield feed
        return
    if not isinstance(source, Iterable) or isinstance(source, (str, bytes, Mapping)):
        raise CalibrationError(f"{where}: not a data reader (get_next()), an iterable of feed dicts, or a function "
                               f"returning one ({type(source).__name__})")
    for feed in source:
        if not isinstance(feed, Mapping):
            raise CalibrationError(f"{where}: a sample is a {type(feed).__name__}, not a dict of input arrays")
        yield feed


# --- the GEMMs, their amax and errors ------------------------------------------------------------------------------
@dataclass
class Fp8Gemm:
    """One fused GEMM node and what fp8 made of it.

    Attributes:
        node: the fused node's name.
        a, b: its A tensor and its fp32 weight (names in the fp32 rewritten model).
        a_amax, b_amax: the largest |value| of A over the calibration samples and of the weight.
        error: ||Q(a) Q(b) - a b|| / ||a b|| over the samples (None where it was not measured).
        fp8: whether it computes on E4M3 operands.
        why: why not, where it does not.
    """

    node: str
    a: str = ""
    b: str = ""
    a_amax: float = 0.0
    b_amax: float = 0.0
    error: float | None = None
    fp8: bool = False
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "fp8": self.fp8}
        if self.error is not None:
            out["error"] = float(f"{self.error:.4g}")
        if self.a:
            out |= {"a_amax": float(f"{self.a_amax:.6g}"), "b_amax": float(f"{self.b_amax:.6g}")}
        if self.why:
            out["why"] = self.why
        return out


@dataclass
class Fp8Result:
    """What `quantize` did: the GEMMs on E4M3 operands and those kept fp16, with their errors."""

    budget: float
    samples: int
    gemms: list[Fp8Gemm] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        fp8 = [g for g in self.gemms if g.fp8]
        return {
            "budget": self.budget, "samples": self.samples,
            "calibration": "amax by onnxruntime's MinMax calibrator (symmetric) on the fp32 rewritten model",
            "gemms_fp8": len(fp8), "gemms_fp16": len(self.gemms) - len(fp8),
            "gemms": [g.to_json() for g in self.gemms],
        }


def _weight_gemms(fp32: onnx.ModelProto) -> tuple[dict[str, Fp8Gemm], dict[str, str]]:
    """The fused `gemm` nodes of the fp32 rewritten model, each with its A and weight, or why it stays fp16; and
    every other fused node that computes a GEMM with why (QKV nodes)."""
    inits = {t.name: t for t in fp32.graph.initializer}
    gemms: dict[str, Fp8Gemm] = {}
    others: dict[str, str] = {}
    for n in fp32.graph.node:
        if n.domain != DOMAIN:
            continue
        op = decode_node(n)
        if isinstance(op, str):
            continue
        if op.family == "qkv":
            others[n.name] = "a QKV node (projections of one A, one launch each): fp8 takes one-GEMM nodes"
        if op.family != "gemm":
            continue
        g = Fp8Gemm(n.name)
        gemms[n.name] = g
        if "a" not in op.inputs or "b" not in op.inputs:
            g.why = "no A or B operand"
            continue
        b = n.input[op.inputs["b"]]
        if b not in inits:
            g.why = "B is computed (a GEMM of two activations): fp8 takes weights"
        elif inits[b].data_type != TensorProto.FLOAT:
            g.why = f"its weight is {TensorProto.DataType.Name(inits[b].data_type)}, not fp32"
        elif external_data_helper.uses_external_data(inits[b]):
            g.why = "its weight is external data"
        else:
            g.a, g.b = n.input[op.inputs["a"]], b
    return gemms, others


def _amax(fp32_path: Path, op_types: Sequence[str], tensors: Sequence[str], feeds: Sequence[Mapping[str, np.ndarray]],
          scratch: Path) -> dict[str, float]:
    """max |value| of each of `tensors` over `feeds`: onnxruntime's MinMax calibrator, symmetric, on the model at
    `fp32_path`, calibrating the inputs of its nodes of `op_types`."""
    from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    calibrator = create_calibrator(fp32_path, list(op_types), augmented_model_path=str(scratch / "augmented.onnx"),
                                   calibrate_method=CalibrationMethod.MinMax, providers=["CPUExecutionProvider"],
                                   extra_options={"symmetric": True})
    calibrator.collect_data(Reader())
    ranges = calibrator.compute_data()
    out = {}
    for t in tensors:
        if t in ranges:
            lo, hi = ranges[t].range_value
            out[t] = float(max(abs(float(np.max(lo))), abs(float(np.max(hi)))))
    return out


def _errors(fp32: onnx.ModelProto, gemms: Sequence[Fp8Gemm], feeds: Sequence[Mapping[str, np.ndarray]],
            weights: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Each GEMM's ||Q(a) Q(b) - a b|| / ||a b|| over `feeds`, A as the fp32 model computes it."""
    import onnxruntime as ort

    model = onnx.ModelProto()
    model.CopyFrom(fp32)
    outputs = {o.name for o in model.graph.output}
    for a in dict.fromkeys(g.a for g in gemms):
        if a not in outputs:
            model.graph.output.append(helper.make_tensor_value_info(a, TensorProto.FLOAT, None))
    if model.ByteSize() > 2**31 - 1:
        raise RewriteError("fp8: the model is over 2 GiB: its GEMM errors cannot be measured in one session")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    err2 = {g.node: 0.0 for g in gemms}
    ref2 = {g.node: 0.0 for g in gemms}
    ops = {n.name: decode_node(n) for n in fp32.graph.node if n.name in err2}
    quantized = {g.node: round_e4m3(weights[g.b] / np.float32(scale_of(g.b_amax))) * np.float32(scale_of(g.b_amax))
                 for g in gemms}
    for feed in feeds:
        values = dict(zip(names, session.run(names, dict(feed)), strict=True))
        for g in gemms:
            op = ops[g.node]
            assert not isinstance(op, str)
            a, w = values[g.a].astype(np.float32), weights[g.b]
            qa = round_e4m3(a / np.float32(scale_of(g.a_amax))) * np.float32(scale_of(g.a_amax))
            ref, got = _product(a, w, op.attrs), _product(qa, quantized[g.node], op.attrs)
            err2[g.node] += float(np.sum(np.square(got.astype(np.float64) - ref)))
            ref2[g.node] += float(np.sum(np.square(ref.astype(np.float64))))
    return {k: (err2[k] / ref2[k]) ** 0.5 if ref2[k] > 0 else (0.0 if err2[k] == 0 else float("inf")) for k in err2}


def _product(a: np.ndarray, b: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    """a @ op(b) as the GEMM node computes it (trans_a, trans_b, broadcast batch dims), in fp32."""
    if attrs.get("trans_a"):
        a = np.swapaxes(a, -1, -2)
    if attrs.get("trans_b"):
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b)


# --- the rewrite ---------------------------------------------------------------------------------------------------
def quantize(model: onnx.ModelProto, fp32: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
             budget: float, known: Fp8Result | None = None) -> tuple[onnx.ModelProto, Fp8Result]:
    """`model` (the fp16 conversion of the rewritten model `fp32`, fused node names shared) with its weight GEMMs
    on E4M3 operands where their error over the calibration `feeds` is within `budget` (module docstring). `known`:
    an earlier result over the same feeds (a plan made again with measured times): a GEMM of the same A and weight
    keeps its amax and error instead of being calibrated again.

    Raises:
        RewriteError: the model is below opset 19, or a fused node lacks its function.
    """
    from onnx_gtco.ir.load import default_opset

    opset = default_opset(model) or 0
    if opset < FP8_OPSET:
        raise RewriteError(f"fp8: the model is at opset {opset}; E4M3 tensors need opset {FP8_OPSET}")
    result = Fp8Result(budget, len(feeds))
    gemms, others = _weight_gemms(fp32)
    candidates = [g for g in gemms.values() if g.why is None]
    inits = {t.name: t for t in fp32.graph.initializer}
    weights = {g.b: numpy_helper.to_array(inits[g.b]) for g in candidates}
    seen = {(g.a, g.b): g for g in (known.gemms if known is not None else ()) if g.a and g.error is not None}
    fresh = [g for g in candidates if (g.a, g.b) not in seen]
    for g in candidates:
        g.b_amax = float(np.max(np.abs(weights[g.b]))) if weights[g.b].size else 0.0
        if (g.a, g.b) in seen:
            g.a_amax, g.error = seen[g.a, g.b].a_amax, seen[g.a, g.b].error
    if fresh:
        with tempfile.TemporaryDirectory(prefix="gtco-fp8-") as tmp:
            path = Path(tmp) / "fp32.onnx"
            onnx.save(fp32, str(path))
            op_types = sorted({n.op_type for n in fp32.graph.node if n.name in {g.node for g in fresh}})
            amax = _amax(path, op_types, [g.a for g in fresh], feeds, Path(tmp))
        for g in fresh:
            if g.a not in amax:
                g.why = "the calibrator collected no range for its A"
            else:
                g.a_amax = amax[g.a]
        measured = [g for g in fresh if g.why is None]
        errors = _errors(fp32, measured, feeds, weights)
        for g in measured:
            g.error = errors[g.node]
    for g in candidates:
        if g.why is not None or g.error is None:
            continue
        if not np.isfinite(g.error) or g.error > budget:
            g.why = f"error {g.error:.3g} over the budget {budget:g}"
        else:
            g.fp8 = True
    result.gemms = [*gemms.values(), *(Fp8Gemm(name, why=why) for name, why in others.items())]
    chosen = {g.node: g for g in gemms.values() if g.fp8}
    return (_rewrite(model, chosen, weights) if chosen else model), result


def _rewrite(model: onnx.ModelProto, chosen: Mapping[str, Fp8Gemm], weights: Mapping[str, np.ndarray]
             ) -> onnx.ModelProto:
    """`model` with the `chosen` GEMM nodes on E4M3 operands: their weights and scales new initializers, the fp16
    weights no other node reads dropped, each node's function the fp8 one."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    functions = {(f.domain, f.name, f.overload): f for f in out.functions}
    new_inits: dict[str, onnx.TensorProto] = {}
    new_functions: dict[tuple[str, str], onnx.FunctionProto] = {}
    replaced: set[str] = set()
    for n in graph.node:
        g = chosen.get(n.name)
        if g is None:
            continue
        op = decode_node(n)
        assert not isinstance(op, str)
        key = (n.domain, n.op_type, n.overload)
        if key not in functions:
            raise RewriteError(f"fused node {n.name!r} ({n.op_type}) has no model-local function")
        b_in = op.inputs["b"]
        replaced.add(n.input[b_in])
        w = weights[g.b]
        k_major = w.ndim == 2 and not op["trans_b"]  # stored [N, K]: the layout FP8 Tensor Core GEMMs read
        b8, scales = f"{g.b}.e4m3" + ("t" if k_major else ""), f"{n.name}.e4m3_scales"
        sa, sb = scale_of(g.a_amax), scale_of(g.b_amax)
        if b8 not in new_inits:
            new_inits[b8] = numpy_helper.from_array(to_e4m3((w.T if k_major else w) / np.float32(sb)), b8)
        new_inits[scales] = numpy_helper.from_array(np.array([sa, sb], np.float32), scales)
        roles = [r.decode() if isinstance(r, bytes) else r
                 for r in helper.get_attribute_value(next(a for a in n.attribute if a.name == "roles"))]
        at = len(roles)  # the scales are the last role: after the present ones, before the other inputs
        fn = _fp8_function(functions[key], op.inputs["a"], b_in, at, k_major)
        new_functions.setdefault((fn.name, fn.overload), fn)
        inputs = list(n.input)
        inputs[b_in] = b8
        inputs.insert(at, scales)
        del n.input[:]
        n.input.extend(inputs)
        for a in n.attribute:
            if a.name == "roles":
                a.strings.append(SCALES_ROLE.encode())
            if a.name == "precision":
                a.s = b"fp8"
        if k_major:
            attrs = [a for a in n.attribute if a.name != "trans_b"] + [helper.make_attribute("trans_b", 1)]
            del n.attribute[:]
            n.attribute.extend(sorted(attrs, key=lambda a: a.name))
        n.op_type, n.overload = fn.name, fn.overload
    read = {t for n in graph.node for t in n.input}
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend([*kept, *new_inits.values()])
    used = {(n.domain, n.op_type, n.overload) for n in graph.node if n.domain == DOMAIN}
    kept_fns = [f for f in out.functions if f.domain != DOMAIN or (f.domain, f.name, f.overload) in used]
    del out.functions[:]
    out.functions.extend([*kept_fns, *(new_functions[k] for k in sorted(new_functions))])
    return out


def _fp8_function(fn: onnx.FunctionProto, a_in: int, b_in: int, at: int, k_major: bool) -> onnx.FunctionProto:
    """The function of a `Gemm_f16` node on E4M3 operands: its inputs with the scales [s_a, s_b] inserted at `at`;
    A's cast to fp32 quantized and dequantized with s_a, B (now E4M3, `k_major`: stored transposed, [N, K])
    dequantized with s_b (and transposed back) where the half function cast it; the fp32 body as it was. Each
    QuantizeLinear / DequantizeLinear names its E4M3 zero point: where A's DequantizeLinear has none, onnxruntime
    1.32's CPU graph optimizations (its QDQ propagation, then constant folding) compute A's round trip as a uint8
    one, which clips A's negative values to 0."""
    a, b = fn.input[a_in], fn.input[b_in]
    scales, a_scale, b_scale = "gtco_scales", "gtco_a_scale", "gtco_b_scale"
    zero = "gtco_e4m3_zero"
    body: list[onnx.NodeProto] = [
        helper.make_node("Constant", [], [zero], name="e4m3_zero",
                         value=helper.make_tensor(zero, TensorProto.FLOAT8E4M3FN, [], [0])),
        *(helper.make_node("Constant", [], [f"gtco_index{i}"], name=f"index{i}",
                           value=helper.make_tensor(f"gtco_index{i}", TensorProto.INT64, [], [i])) for i in (0, 1)),
        helper.make_node("Gather", [scales, "gtco_index0"], [a_scale], name="scale_a"),
        helper.make_node("Gather", [scales, "gtco_index1"], [b_scale], name="scale_b")]
    renamed: dict[str, str] = {}
    seen_a = seen_b = False
    for node in fn.node:
        if node.op_type == "Cast" and list(node.input) == [b] and not seen_b:
            wide = "gtco_b_kn" if k_major else node.output[0]
            body.append(helper.make_node("DequantizeLinear", [b, b_scale, zero], [wide], name="dequantize_b"))
            if k_major:
                body.append(helper.make_node("Transpose", [wide], list(node.output), name="b_kn", perm=[1, 0]))
            seen_b = True
            continue
        n = onnx.NodeProto()
        n.CopyFrom(node)
        for i, t in enumerate(n.input):
            n.input[i] = renamed.get(t, t)
        body.append(n)
        if node.op_type == "Cast" and list(node.input) == [a] and not seen_a:
            cast = node.output[0]
            body += [helper.make_node("QuantizeLinear", [cast, a_scale, zero], ["gtco_a_e4m3"], name="quantize_a",
                                      saturate=1),
                     helper.make_node("DequantizeLinear", ["gtco_a_e4m3", a_scale, zero], ["gtco_a_fp8"],
                                      name="dequantize_a")]
            renamed[cast] = "gtco_a_fp8"
            seen_a = True
    if not (seen_a and seen_b):
        raise RewriteError(f"fp8: the function {fn.name} does not cast its {'A' if not seen_a else 'B'} to fp32")
    inputs = list(fn.input)
    inputs.insert(at, scales)
    new = helper.make_function(DOMAIN, op_type("gemm", FP8_DTYPE), inputs, list(fn.output), body,
                               opset_imports=list(fn.opset_import), attributes=list(fn.attribute))
    new.overload = "v" + hashlib.sha256(new.SerializeToString(deterministic=True)).hexdigest()[:12]
    return new


__all__ = ["E4M3_MAX", "FP8_OPSET", "CalibrationError", "Fp8Gemm", "Fp8Result", "quantize", "read_calibration",
           "round_e4m3", "scale_of", "to_e4m3"]
