"""The kernel bench's conv cases: our conv family beside cuDNN (through torch) and ONNX Runtime's CUDA EP."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnx_gtco.bench.kernel_bench.candidates import case_instances
from onnx_gtco.bench.kernel_bench.measure import Runner, median_us
from onnx_gtco.bench.kernel_bench.shapes import TOL, Case, ConvShape
from onnx_gtco.families.conv.kernel import FAMILY as CONV
from onnx_gtco.kernels.family import (
    rel_error,
)

# ------------------------------------------------------------------------------------------------------ conv


def conv_reference(c: ConvShape, x: np.ndarray, w: np.ndarray, bias: np.ndarray, res: np.ndarray | None
                   ) -> np.ndarray:
    """act(conv(x, w) + bias + res) in float64 numpy (im2col)."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (c.pad, c.pad), (c.pad, c.pad)))
    win = np.lib.stride_tricks.sliding_window_view(x, (c.k, c.k), axis=(2, 3))[:, :, ::c.stride, ::c.stride]
    oh, ow = c.out_hw
    win = win[:, :, :oh, :ow]  # n, cin, oh, ow, k, k
    y = np.einsum("nchwij,ocij->nohw", win, w.astype(np.float64), optimize=True)
    y = y + bias.astype(np.float64)[None, :, None, None]
    if res is not None:
        y = y + res.astype(np.float64)
    return np.maximum(y, 0.0) if c.act == "relu" else y


def conv_inputs(c: ConvShape, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    oh, ow = c.out_hw
    out = {"x": rng.standard_normal((c.n, c.cin, c.h, c.w)).astype(np.float16),
           "w": (rng.standard_normal((c.cout, c.cin, c.k, c.k)) / math.sqrt(c.cin * c.k * c.k)).astype(np.float16),
           "bias": (0.5 * rng.standard_normal(c.cout)).astype(np.float16)}
    if c.residual:
        out["residual"] = (0.5 * rng.standard_normal((c.n, c.cout, oh, ow))).astype(np.float16)
    return out


def conv_onnx_model(c: ConvShape) -> Any:
    """The conv as ONNX Runtime sees it in the model: Conv (weights and bias as initializers) [+ Add] [+ Relu], fp16."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ins = conv_inputs(c)
    oh, ow = c.out_hw
    epilogue = [("Add", "residual")] * c.residual + [("Relu", None)] * (c.act == "relu")
    names = ["conv"] + [f"t{i}" for i in range(len(epilogue))]
    names[-1] = "y"
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], [names[0]], kernel_shape=[c.k, c.k],
                              strides=[c.stride] * 2, pads=[c.pad] * 4)]
    for i, (op, other) in enumerate(epilogue):
        nodes.append(helper.make_node(op, [names[i], *([other] if other else [])], [names[i + 1]]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [c.n, c.cin, c.h, c.w])]
    if c.residual:
        inputs.append(helper.make_tensor_value_info("residual", TensorProto.FLOAT16, [c.n, c.cout, oh, ow]))
    graph = helper.make_graph(nodes, "conv", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [c.n, c.cout, oh, ow])],
                              [numpy_helper.from_array(ins["w"], "w"), numpy_helper.from_array(ins["bias"], "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def ort_cuda_reason() -> str | None:
    """Why ONNX Runtime's CUDA EP cannot run here, or None."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        return f"onnxruntime is not importable ({e})"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    return None


def time_ort_conv(c: ConvShape, dev: Mapping[str, Any], out, reps: int, torch) -> float:
    """Median wall-clock µs of one synchronous run of the one-node Conv model on ORT's CUDA EP, inputs and output
    bound to the torch tensors (no host copy)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(conv_onnx_model(c).SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"device_id": torch.cuda.current_device(),
                                                                      "cudnn_conv_algo_search": "EXHAUSTIVE"})])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"the session fell back to {sess.get_providers()}")
    io = sess.io_binding()
    for name in ("x", "residual"):
        if name in dev:
            t = dev[name]
            io.bind_input(name, "cuda", torch.cuda.current_device(), np.float16, list(t.shape), t.data_ptr())
    io.bind_output("y", "cuda", torch.cuda.current_device(), np.float16, list(out.shape), out.data_ptr())
    torch.cuda.synchronize()
    for _ in range(5):
        sess.run_with_iobinding(io)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_conv_case(case: Case, arch: str, libs: Mapping[str, Path | str], reps: int, torch,
                  max_configs: int | None) -> dict:
    """A conv row: our conv family's configurations (each checked against its fp64 reference) beside cuDNN through
    torch and through ORT's CUDA EP, on inputs of the same shapes."""
    c = case.conv
    assert c is not None and case.problem is not None
    F = torch.nn.functional
    host = conv_inputs(c)
    dev = {k: torch.from_numpy(v).cuda() for k, v in host.items()}
    want = conv_reference(c, host["x"], host["w"], host["bias"], host.get("residual"))

    def cudnn():
        y = F.conv2d(dev["x"], dev["w"], dev["bias"], stride=c.stride, padding=c.pad)
        if c.residual:
            y = y + dev["residual"]
        return F.relu(y) if c.act == "relu" else y
    base: dict[str, dict] = {}
    y = cudnn()
    torch.cuda.synchronize()
    err = rel_error(y.double().cpu().numpy(), want)
    ok = math.isfinite(err) and err < TOL["f16"]
    base["torch cuDNN"] = {"name": "torch cuDNN", "rel_err": err, "ok": ok, "us": median_us(cudnn, reps, torch)}
    why = ort_cuda_reason()
    if why is None:
        out = torch.full_like(y, float("nan"))
        try:
            us = time_ort_conv(c, dev, out, reps, torch)
            e = rel_error(out.double().cpu().numpy(), want)
            base["ORT cuDNN"] = {"name": "ORT cuDNN", "rel_err": e, "ok": math.isfinite(e) and e < TOL["f16"],
                                 "us": us, "note": "wall-clock per synchronous run"}
        except Exception as ex:  # an ORT failure is that baseline's, not the row's
            base["ORT cuDNN"] = {"name": "ORT cuDNN", "ok": False, "us": None, "error": f"{type(ex).__name__}: {ex}"}
    else:
        base["ORT cuDNN"] = {"name": "ORT cuDNN", "ok": False, "us": None, "skipped": why}
    r = Runner(CONV, case.problem, reps, torch)
    rows = [r.time(inst, libs[inst.name]) for inst in case_instances(case, arch, max_configs, ("mma",))]
    best = min((x for x in rows if x["ok"]), key=lambda x: x["us"], default=None)
    ours: dict[str, Any] = {"instance": best["instance"], "us": best["us"]} if best else {
        "skipped": "no configuration of the conv family ran correctly (see its rows)"}

    def ratio(name: str) -> float | None:
        us = base.get(name, {}).get("us")
        return us / best["us"] if best and us else None
    return {"set": case.set, "case": case.label, "kind": "conv", "count": case.count, "where": case.where,
            "conv": vars(c), "rows": rows, "ours": ours, "baselines": base,
            "ratios": {"ours_vs_cudnn_ort": ratio("ORT cuDNN"), "ours_vs_cudnn_torch": ratio("torch cuDNN")},
            "all_ok": all(x["ok"] for x in rows) and all(b["ok"] or b.get("skipped") for b in base.values())}
