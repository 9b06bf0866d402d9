"""The GEMM family's fused ops: gemm (one GEMM with its epilogue, or with the LayerNorm over its rows) and qkv (the
projections of one input, one launch each on a shared A)."""

from __future__ import annotations

from onnx_gtco.opspec import BOOL, DIM, DIMS, EPILOGUE, FLOAT, FLOAT_DTYPES, FP8_DTYPE, Attr, OpSpec

QKV_PROJECTIONS = 3  # the projections a qkv op names roles for (C++ gtco::Qkv::kMaxProj)

SPECS = (
    # y_p = a @ w_p (+ bias_p), p < len(ns) <= QKV_PROJECTIONS
    OpSpec("qkv", ("a", *(f"w{p}" for p in range(QKV_PROJECTIONS)), *(f"bias{p}" for p in range(QKV_PROJECTIONS))),
           tuple(f"y{p}" for p in range(QKV_PROJECTIONS)),
           (Attr("m", DIM), Attr("k", DIM), Attr("ns", DIMS), Attr("n_out", DIM), Attr("bias", BOOL, False)),
           launches=lambda a: max(1, len(a.get("ns") or ()))),  # the C++ op launches its GEMM once per projection
    # y = act(alpha * a @ op(b) + beta * bias) * layer_scale + residual (layer_scale: one factor per column of y);
    # layernorm: norm = LayerNorm(y) * gamma + beta over each row of N (y then an output only when read outside);
    # gated: b interleaves a gated MLP's gate and up columns, y = act(gate) * up has N / 2 columns
    # fp8 (`Gemm_f8`, onnx_gtco.fp8): a and b are E4M3 with per-tensor scales, scales = [s_a, s_b] (fp32): a is read
    # in fp16 and quantized by the node, b is stored E4M3; y and the other operands fp16
    OpSpec("gemm", ("a", "b", "bias", "residual", "layer_scale", "gamma", "beta", "scales"), ("y", "norm"),
           (Attr("m", DIM), Attr("n", DIM), Attr("k", DIM), Attr("batch", DIMS, ()), Attr("trans_a", BOOL, False),
            Attr("trans_b", BOOL, False), Attr("alpha", FLOAT, 1.0), Attr("beta", FLOAT, 1.0), *EPILOGUE,
            Attr("layer_scale", BOOL, False), Attr("layernorm", BOOL, False), Attr("epsilon", FLOAT, 1e-5),
            Attr("gated", BOOL, False)),
           # the epilogue casts to fp32 (kernels.select.with_out_dtype); with a residual it would read an fp32 one
           dtypes=(*FLOAT_DTYPES, FP8_DTYPE),
           fp32_output=lambda a: not a.get("residual"),
           parts=lambda a: ("gemm", "layernorm") if a.get("layernorm") else None),
)
