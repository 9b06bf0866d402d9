"""Elementwise family (onnx_gtco/families/elementwise/kernel.py, plugins/families/elementwise/elementwise.cuh): ONNX
chains as exporters emit them, built by program_from_onnx, run through the CPU emulation and compared with an fp64 numpy
reference written here by hand (so the ONNX -> program translation is checked too, not only the kernel against
the family's own reference); broken instances the test catches; check() and program_from_onnx reasons; ptxas."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from kernel_helpers import INCLUDES, nvcc_missing, run_exe
from onnx import TensorProto, helper

from onnx_gtco.families.elementwise.kernel import (
    ARITY,
    CAST_TARGETS,
    FAMILY,
    elementwise_problem,
    iteration_shape,
    program_from_onnx,
    runtime_program_from_onnx,
    source_shape,
)
from onnx_gtco.kernels.emulate import EmulationError, build_emulated, run_emulated
from onnx_gtco.kernels.family import from_storage, np_dtype, rel_error, to_storage
from onnx_gtco.kernels.ptxas import parse_ptxas
from onnx_gtco.kernels.toolchain import cxx_build, nvcc_compile

TOL = {"f16": 2e-3, "bf16": 2e-3, "f32": 1e-5}
# bf16 outputs: rounding the exact result to bf16 alone costs up to 2^-8 (~1.5e-3..2.5e-3 in norm), so for bf16
# the 2e-3 bound is on the error beyond that rounding (against the reference rounded to bf16) and the raw bound
# is the unit roundoff (as in test_layernorm.py / test_softmax.py)
RAW_TOL = {"f16": 2e-3, "bf16": 2**-8, "f32": 1e-5}
ROUNDED_TOL = {"f16": 5e-4, "bf16": 2e-3, "f32": 1e-5}
NAN_BITS = {"f16": np.float16(np.nan), "bf16": np.uint16(0x7FC0), "f32": np.float32(np.nan)}

SQRT2, SQRT_2_PI = math.sqrt(2.0), math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def node(op, ins, out, **attrs):
    return helper.make_node(op, ins, [out], name=f"{op.lower()}_{out}", **attrs)


def scalar(v):
    return np.array(v, np.float32)


# ---------------------------------------------------------------------------------------------------------------
# the chains: (nodes, inputs, outputs, constants, fp64 reference of the ONNX semantics, value overrides)
# ---------------------------------------------------------------------------------------------------------------

def gelu_erf_bias(shape=(3, 37, 100)):
    """BERT's FFN GELU as torch.onnx emits it, with the MatMul's bias Add in front: ragged (37 rows, N=100)."""
    n = shape[-1]
    nodes = [node("Add", ["x", "b"], "h"), node("Div", ["h", "sqrt2"], "d"), node("Erf", ["d"], "e"),
             node("Add", ["e", "one"], "e1"), node("Mul", ["h", "e1"], "m"), node("Mul", ["m", "half"], "y")]
    consts = {"sqrt2": scalar(SQRT2), "one": scalar(1.0), "half": scalar(0.5)}

    def ref(v):
        h = v["x"] + v["b"]
        return {"y": 0.5 * h * (1.0 + _erf(h / SQRT2))}
    return nodes, [("x", shape), ("b", (n,))], ["y"], consts, ref, {}


def gelu_tanh_pow():
    """GPT-2's tanh GELU: Pow(x, 3), 0.044715, sqrt(2/pi), Tanh, over (5, 129) (odd, ragged tail)."""
    nodes = [node("Pow", ["x", "three"], "p"), node("Mul", ["p", "c"], "pc"), node("Add", ["x", "pc"], "s"),
             node("Mul", ["s", "k"], "sk"), node("Tanh", ["sk"], "t"), node("Add", ["t", "one"], "t1"),
             node("Mul", ["x", "t1"], "xt"), node("Mul", ["xt", "half"], "y")]
    consts = {"three": scalar(3.0), "c": scalar(0.044715), "k": scalar(SQRT_2_PI), "one": scalar(1.0),
              "half": scalar(0.5)}

    def ref(v):
        x = v["x"]
        return {"y": 0.5 * x * (1.0 + np.tanh(SQRT_2_PI * (x + 0.044715 * x**3)))}
    return nodes, [("x", (5, 129))], ["y"], consts, ref, {}


def normalize(shape=(4, 9, 33)):
    """Sub / Add eps / Sqrt / Div / Mul gamma / Add beta: a decomposed LayerNorm's tail with its row statistics
    as inputs ([.., 1]: broadcast along the innermost dim) and gamma, beta of [N]."""
    n = shape[-1]
    nodes = [node("Sub", ["x", "mean"], "c"), node("Add", ["var", "eps"], "ve"), node("Sqrt", ["ve"], "sd"),
             node("Div", ["c", "sd"], "z"), node("Mul", ["z", "gamma"], "zg"), node("Add", ["zg", "beta"], "y")]
    rows = (*shape[:-1], 1)

    def ref(v):
        return {"y": (v["x"] - v["mean"]) / np.sqrt(v["var"] + float(np.float32(1e-5))) * v["gamma"] + v["beta"]}
    return (nodes, [("x", shape), ("mean", rows), ("var", rows), ("gamma", (n,)), ("beta", (n,))], ["y"],
            {"eps": scalar(1e-5)}, ref, {"var": (0.25, 2.0)})


def bert_mask():
    """BERT's attention-mask prep: int64 [B, S] -> Unsqueeze(1, 2) -> Cast -> (1 - m) * -10000."""
    nodes = [node("Unsqueeze", ["m", "axes"], "u"), node("Cast", ["u"], "c", to=TensorProto.FLOAT16),
             node("Sub", ["one", "c"], "s"), node("Mul", ["s", "big"], "y")]
    consts = {"axes": np.array([1, 2], np.int64), "one": scalar(1.0), "big": scalar(-10000.0)}

    def ref(v):
        return {"y": (1.0 - v["m"]) * -10000.0}
    return nodes, [("m", (2, 77), "i64")], ["y"], consts, ref, {"m": (0, 2)}


def where_cast_two_outputs():
    """Where on a bool [1, W] mask with a scalar input, a Cast to fp16 inside, Neg of a negative constant, and two
    outputs (one an intermediate)."""
    nodes = [node("Mul", ["x", "s"], "xs"), node("Cast", ["xs"], "xh", to=TensorProto.FLOAT16),
             node("Neg", ["minus2"], "two"), node("Mul", ["x", "two"], "x2"),
             node("Where", ["cond", "xh", "x2"], "w"), node("Relu", ["w"], "y")]

    def ref(v):
        xh = (v["x"] * v["s"]).astype(np.float16).astype(np.float64)
        w = np.where(v["cond"] != 0, xh, 2.0 * v["x"])
        return {"w": w, "y": np.maximum(w, 0.0)}
    return (nodes, [("cond", (1, 50), "bool"), ("x", (3, 50)), ("s", ())], ["w", "y"],
            {"minus2": scalar(-2.0)}, ref, {})


def activations_rank6():
    """Rank-6 broadcasting with broadcast axes in the middle on both sides (2,3,1,5,1,7) x (3,4,1,6,1), and
    Sigmoid / SiLU / LeakyRelu / Max / Min / Abs / Exp / Log / Reciprocal / Sum of three / Gelu (opset 20)."""
    a, b = (2, 3, 1, 5, 1, 7), (3, 4, 1, 6, 1)
    nodes = [node("Add", ["a", "b"], "s"), node("Sigmoid", ["s"], "sg"), node("Mul", ["s", "sg"], "silu"),
             node("LeakyRelu", ["s"], "lr", alpha=0.2), node("Max", ["silu", "lr"], "mx"),
             node("Min", ["mx", "b"], "mn"), node("Abs", ["a"], "ab"), node("Add", ["ab", "one"], "ab1"),
             node("Log", ["ab1"], "lg"), node("Exp", ["b"], "ex"), node("Reciprocal", ["ex"], "rc"),
             node("Gelu", ["a"], "ge", approximate="tanh"), node("Sum", ["mn", "lg", "rc"], "sm"),
             node("Sub", ["sm", "ge"], "y")]

    def ref(v):
        s = v["a"] + v["b"]
        silu = s / (1.0 + np.exp(-s))
        mn = np.minimum(np.maximum(silu, np.where(s >= 0, s, float(np.float32(0.2)) * s)), v["b"])
        ge = 0.5 * v["a"] * (1 + np.tanh(SQRT_2_PI * (v["a"] + 0.044715 * v["a"] ** 3)))
        return {"y": mn + np.log(np.abs(v["a"]) + 1.0) + np.exp(-v["b"]) - ge}
    return nodes, [("a", a), ("b", b)], ["y"], {"one": scalar(1.0)}, ref, {}


def conv_activations():
    """NCHW activations with a per-channel PRelu slope [C, 1, 1]: Clip (opset 11 min / max inputs, and max only),
    HardSwish, HardSigmoid, Elu, Softplus, Softsign, Mean of three."""
    nodes = [node("Clip", ["x", "zero", "six"], "r6"), node("Clip", ["x", "", "one"], "c1"),
             node("HardSwish", ["x"], "hs"), node("HardSigmoid", ["x"], "hg", alpha=0.25, beta=0.4),
             node("PRelu", ["x", "slope"], "pr"), node("Elu", ["x"], "el", alpha=0.7),
             node("Softplus", ["x"], "sp"), node("Softsign", ["x"], "ss"), node("Mean", ["r6", "hs", "pr"], "mn"),
             node("Mul", ["el", "hg"], "eh"), node("Add", ["mn", "eh"], "a1"), node("Add", ["a1", "sp"], "a2"),
             node("Sub", ["a2", "ss"], "a3"), node("Add", ["a3", "c1"], "y")]
    consts = {"zero": scalar(0.0), "six": scalar(6.0), "one": scalar(1.0)}

    def ref(v):
        x, f = v["x"], lambda a: float(np.float32(a))
        mean = (np.clip(x, 0, 6) + x * np.clip(x / 6 + 0.5, 0, 1) + np.where(x >= 0, x, v["slope"] * x)) / 3
        elu = np.where(x >= 0, x, f(0.7) * np.expm1(x))
        return {"y": mean + elu * np.clip(f(0.25) * x + f(0.4), 0, 1) + np.logaddexp(0, x) - x / (1 + np.abs(x))
                + np.minimum(x, 1.0)}
    return nodes, [("x", (2, 8, 5, 7)), ("slope", (8, 1, 1))], ["y"], consts, ref, {"x": (-8.0, 8.0)}


def mask_logic():
    """Comparisons and logic as 0/1 values feeding Where and Cast: Equal on an int64 mask, Greater against a scalar
    input, Not / And / Or / Xor, Cast to BOOL and back, Sign, Floor / Ceil / Round of exact multiples, Sin, Cos, and
    the NaN guard exporters write (Where(IsNaN(v), 0, v), here of Sqrt of negative values)."""
    nodes = [node("Equal", ["m", "zero"], "eq"), node("Greater", ["x", "thr"], "gt"), node("Not", ["eq"], "ne"),
             node("And", ["ne", "gt"], "an"), node("Or", ["eq", "an"], "o"), node("Xor", ["o", "gt"], "xr"),
             node("Where", ["o", "x", "big"], "w"), node("LessOrEqual", ["x", "thr"], "le"),
             node("Cast", ["x", ], "xb", to=TensorProto.BOOL), node("Cast", ["xr"], "xrf", to=TensorProto.FLOAT16),
             node("Mul", ["x", "four"], "x4"), node("Floor", ["x4"], "fl"), node("Ceil", ["x4"], "ce"),
             node("Round", ["x4"], "ro"), node("Sign", ["x"], "sg"), node("Sin", ["x"], "si"),
             node("Cos", ["x"], "co"), node("Sum", ["xrf", "le", "xb", "fl", "ce", "ro"], "s1"),
             node("Mul", ["sg", "si"], "s2"), node("Add", ["s1", "s2"], "s3"), node("Add", ["s3", "co"], "s4"),
             node("Sqrt", ["x"], "sq"), node("IsNaN", ["sq"], "nan"), node("Where", ["nan", "zf", "sq"], "guard"),
             node("Add", ["s4", "guard"], "y")]
    consts = {"zero": np.array(0, np.int64), "big": scalar(-100.0), "four": scalar(4.0), "zf": scalar(0.0)}

    def ref(v):
        x, m, thr = v["x"], v["m"], v["thr"]
        eq, gt = m == 0, x > thr
        o = eq | (~eq & gt)
        xr = o ^ gt
        x4 = 4 * x
        y = (1.0 * xr + 1.0 * (x <= thr) + 1.0 * (x != 0) + np.floor(x4) + np.ceil(x4) + np.round(x4)
             + np.sign(x) * np.sin(x) + np.cos(x) + np.sqrt(np.maximum(x, 0.0)))
        return {"w": np.where(o, x, -100.0), "y": y}
    return (nodes, [("m", (2, 1, 16), "i64"), ("x", (2, 3, 16)), ("thr", ())], ["w", "y"], consts, ref,
            {"m": (0, 1), "x": (-2.0, 2.0), "thr": (-0.5, 0.5)})


def ints(*values):
    return np.array(values, np.int64)


def window_partition():
    """Swin's window partition, layout ops alone: Pad of zeros -> Reshape -> Transpose -> Reshape [windows, 49, C]
    (the last Reshape is no view of the transposed input: the kernel iterates the 6-d shape and writes densely)."""
    nodes = [node("Pad", ["x", "pads"], "p"), node("Reshape", ["p", "split"], "r"),
             node("Transpose", ["r"], "t", perm=[0, 1, 3, 2, 4, 5]), node("Reshape", ["t", "merge"], "y")]
    consts = {"pads": ints(*[0] * 8), "split": ints(1, 2, 7, 2, 7, 24), "merge": ints(4, 49, 24)}

    def ref(v):
        return {"y": v["x"].reshape(1, 2, 7, 2, 7, 24).transpose(0, 1, 3, 2, 4, 5).reshape(4, 49, 24)}
    return nodes, [("x", (1, 14, 14, 24))], ["y"], consts, ref, {}


def window_reverse_residual():
    """Window reverse then the residual Add and a per-channel scale: the Add reads the transposed windows and the
    shortcut [1, H, W, C] and gamma [C] through the last Reshape, in the 6-d iteration shape."""
    nodes = [node("Reshape", ["w", "split"], "r"), node("Transpose", ["r"], "t", perm=[0, 1, 3, 2, 4, 5]),
             node("Reshape", ["t", "merge"], "m"), node("Add", ["m", "s"], "a"), node("Mul", ["a", "gamma"], "g"),
             node("Reshape", ["g", "tokens"], "y")]
    consts = {"split": ints(1, 2, 2, 7, 7, 16), "merge": ints(1, 14, 14, 16), "tokens": ints(1, 196, 16)}

    def ref(v):
        m = v["w"].reshape(1, 2, 2, 7, 7, 16).transpose(0, 1, 3, 2, 4, 5).reshape(1, 14, 14, 16)
        return {"y": ((m + v["s"]) * v["gamma"]).reshape(1, 196, 16)}
    return nodes, [("w", (4, 49, 16)), ("s", (1, 14, 14, 16)), ("gamma", (16,))], ["y"], consts, ref, {}


def head_split():
    """qkv [B, N, 3, H, D] -> Transpose -> Slice + Squeeze per part (offset views of one input) -> q * scale, k^T
    (stored transposed) and v copied as it is: three outputs."""
    nodes = [node("Transpose", ["qkv"], "t", perm=[2, 0, 3, 1, 4]),
             node("Slice", ["t", "zero", "one", "axis0"], "qs"), node("Squeeze", ["qs", "axis0"], "q"),
             node("Mul", ["q", "scale"], "yq"), node("Slice", ["t", "one", "two", "axis0"], "ks"),
             node("Squeeze", ["ks", "axis0"], "k"), node("Transpose", ["k"], "yk", perm=[0, 1, 3, 2]),
             node("Slice", ["t", "two", "three", "axis0"], "vs"), node("Squeeze", ["vs", "axis0"], "yv")]
    consts = {"zero": ints(0), "one": ints(1), "two": ints(2), "three": ints(3), "axis0": ints(0),
              "scale": scalar(0.125)}

    def ref(v):
        t = v["qkv"].transpose(2, 0, 3, 1, 4)
        return {"yq": t[0] * 0.125, "yk": t[1].transpose(0, 1, 3, 2), "yv": t[2]}
    return nodes, [("qkv", (2, 9, 3, 4, 16))], ["yq", "yk", "yv"], consts, ref, {}


def strided_slice():
    """Patch merging's x[:, 1::2, 0::2] (steps and a start, a Shifted view), + bias, Relu."""
    nodes = [node("Slice", ["x", "starts", "ends", "axes", "steps"], "s"), node("Add", ["s", "bias"], "a"),
             node("Relu", ["a"], "y")]
    consts = {"starts": ints(1, 0), "ends": ints(16, 16), "axes": ints(1, 2), "steps": ints(2, 2)}

    def ref(v):
        return {"y": np.maximum(v["x"][:, 1::2, 0::2] + v["bias"], 0.0)}
    return nodes, [("x", (2, 16, 16, 32)), ("bias", (32,))], ["y"], consts, ref, {}


def transpose_gelu():
    """A channels-first map read as tokens (Transpose) + bias, Gelu: the innermost dim of the view walks the
    input with a stride, gathered per element."""
    nodes = [node("Transpose", ["x"], "t", perm=[0, 2, 1]), node("Add", ["t", "bias"], "a"),
             node("Gelu", ["a"], "y")]

    def ref(v):
        a = v["x"].transpose(0, 2, 1) + v["bias"]
        return {"y": 0.5 * a * (1 + _erf(a / SQRT2))}
    return nodes, [("x", (2, 24, 40)), ("bias", (24,))], ["y"], {}, ref, {}


def roll(tensor, shift, axis, prefix):
    """torch.roll(tensor, shift, axis) as exporters write it: Concat(x[-shift:], x[:-shift]) along the axis."""
    nodes = [node("Slice", [tensor, f"{prefix}_k", f"{prefix}_end", f"{prefix}_axis"], f"{prefix}_hi"),
             node("Slice", [tensor, "zero", f"{prefix}_k", f"{prefix}_axis"], f"{prefix}_lo"),
             node("Concat", [f"{prefix}_hi", f"{prefix}_lo"], f"{prefix}_y", axis=axis)]
    return nodes, {f"{prefix}_k": ints(-shift), f"{prefix}_end": ints(2**62), f"{prefix}_axis": ints(axis)}


def np_roll(x, shift, axis):
    return np.concatenate([np.take(x, range(x.shape[axis] - shift, x.shape[axis]), axis),
                           np.take(x, range(x.shape[axis] - shift), axis)], axis)


def shifted_window_partition():
    """Swin's shifted window partition: roll by -3 along H then W (Slice + Slice + Concat each), Reshape ->
    Transpose -> Reshape into [windows, 49, C], times a scale: the rolls are terms of the split dims."""
    rh, ch = roll("x", -3, 1, "h")
    rw, cw = roll("h_y", -3, 2, "w")
    nodes = [*rh, *rw, node("Reshape", ["w_y", "split"], "r"), node("Transpose", ["r"], "t", perm=[0, 1, 3, 2, 4, 5]),
             node("Reshape", ["t", "merge"], "m"), node("Mul", ["m", "scale"], "y")]
    consts = {**ch, **cw, "zero": ints(0), "split": ints(1, 2, 7, 2, 7, 8), "merge": ints(4, 49, 8),
              "scale": scalar(0.5)}

    def ref(v):
        x = np_roll(np_roll(v["x"], 11, 1), 11, 2)  # a roll by -3 of 14 is one by 11
        return {"y": x.reshape(1, 2, 7, 2, 7, 8).transpose(0, 1, 3, 2, 4, 5).reshape(4, 49, 8) * 0.5}
    return nodes, [("x", (1, 14, 14, 8))], ["y"], consts, ref, {}


def window_reverse_roll_back():
    """Window reverse (the last Reshape merges dims whose strides do not: terms), the roll back by +3 along H and W,
    and the residual Add."""
    rh, ch = roll("m", 3, 1, "h")
    rw, cw = roll("h_y", 3, 2, "w")
    nodes = [node("Reshape", ["w", "split"], "r"), node("Transpose", ["r"], "t", perm=[0, 1, 3, 2, 4, 5]),
             node("Reshape", ["t", "merge"], "m"), *rh, *rw, node("Add", ["w_y", "s"], "y")]
    consts = {**ch, **cw, "zero": ints(0), "split": ints(1, 2, 2, 7, 7, 8), "merge": ints(1, 14, 14, 8)}

    def ref(v):
        m = v["w"].reshape(1, 2, 2, 7, 7, 8).transpose(0, 1, 3, 2, 4, 5).reshape(1, 14, 14, 8)
        return {"y": np_roll(np_roll(m, 3, 1), 3, 2) + v["s"]}
    return nodes, [("w", (4, 49, 8)), ("s", (1, 14, 14, 8))], ["y"], consts, ref, {}


CHAINS = {"gelu_erf_bias": gelu_erf_bias, "conv_activations": conv_activations, "mask_logic": mask_logic,
          "gelu_tanh_pow": gelu_tanh_pow, "normalize": normalize, "bert_mask": bert_mask,
          "where_cast_two_outputs": where_cast_two_outputs, "activations_rank6": activations_rank6,
          "window_partition": window_partition, "window_reverse_residual": window_reverse_residual,
          "head_split": head_split, "strided_slice": strided_slice, "transpose_gelu": transpose_gelu,
          "shifted_window_partition": shifted_window_partition, "window_reverse_roll_back": window_reverse_roll_back}


def build(chain, dtype):
    nodes, inputs, outputs, consts, ref, ranges = chain() if callable(chain) else chain
    prog = program_from_onnx(nodes, inputs, outputs, consts)
    return prog, prog.problem(dtype), ref, ranges


def make_inputs(prog, prob, seed, ranges):
    """The family's seeded inputs, with the inputs named in `ranges` drawn uniformly from (lo, hi) instead (ints
    for integer inputs)."""
    ins = FAMILY.random_inputs(prob, seed)
    first = {}
    for i, (name, _, _) in enumerate(prog.inputs):  # views of one tensor read the same array, as when bound
        if name in first:
            ins[f"x{i}"] = ins[f"x{first[name]}"]
        first.setdefault(name, i)
    rng = np.random.default_rng(seed + 1000)
    for i, (name, shape, kind) in enumerate(prog.inputs):
        if name in ranges:
            lo, hi = ranges[name]
            if kind == "float":
                ins[f"x{i}"] = to_storage(rng.uniform(lo, hi, shape), prob.dtype)
            else:
                ins[f"x{i}"] = rng.integers(lo, hi + 1, shape).astype(ins[f"x{i}"].dtype)
    return ins


def run(emu, prob, cfg, ins, header_edit=None):
    """Run the instance on `ins`; outputs start as NaN, so an element the kernel never writes fails the test.

    `emu` is the emu fixture: the instances the tests below name are built together in one library (one g++ run
    instead of one per instance). `header_edit` (header, old, new) builds the instance on its own against copies of
    elementwise/elementwise.cuh and gtco/broadcast.h (the loop and the indexing every instance shares), one of them
    edited.
    """
    tmp, batch_lib, batched = emu
    inst = FAMILY.instantiate(prob, cfg, "sm_80")
    if header_edit is not None:
        header, old, new = header_edit
        edited = tmp / f"edited_{len(list(tmp.glob('edited_*')))}"
        for name in ("elementwise/elementwise.cuh", "gtco/broadcast.h"):
            text = next(d / name for d in INCLUDES if (d / name).is_file()).read_text()
            if name.endswith(header):
                assert old in text, "the edit did not apply"
                text = text.replace(old, new)
            (edited / name).parent.mkdir(parents=True, exist_ok=True)
            (edited / name).write_text(text)
        # quoted includes look in -iquote folders before -I ones: the instance includes the edited copies
        lib = build_emulated(inst, tmp, ("-O1", f"-iquote{edited}"))
    else:
        lib = batch_lib if inst.name in batched else build_emulated(inst, tmp, ("-O1",))
    arrays = dict(ins)
    outs = FAMILY.outputs(prob)
    for k, (shape, dt) in outs.items():
        arrays[k] = np.full(shape, NAN_BITS[dt], np_dtype(dt))
    got = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, list(outs))
    return {k: from_storage(v, prob.dtype).reshape(outs[k][0]) for k, v in got.items()}


def onnx_values(prog, prob, ins):
    """The (rounded) inputs in float64 by tensor name, in the program's shapes (a view's: its tensor's)."""
    return {name: (from_storage(ins[f"x{i}"], prob.dtype) if kind == "float" else
                   ins[f"x{i}"].astype(np.float64)).reshape(source_shape(prob, i))
            for i, (name, _, kind) in enumerate(prog.inputs)}


def assert_close(got, want, dtype, what):
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = rel_error(got, want)
    assert err < RAW_TOL[dtype], f"{what}: {err:.3g}"
    rounded = from_storage(to_storage(want, dtype), dtype)
    assert rel_error(got, rounded) < ROUNDED_TOL[dtype], f"{what}: {rel_error(got, rounded):.3g} beyond rounding"


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """(build dir, library of every instance in GRID, ACCESS and EVERY_OP, their names)."""
    tmp = tmp_path_factory.mktemp("ew_emu")
    probs = [(build(CHAINS[chain], dtype)[1], cfg) for chain, dtype, cfg in GRID]
    probs += [(build(normalize(shape), "f16")[1], cfg) for shape, cfg, _ in ACCESS]
    probs += [(every_op_problem(dtype), cfg) for dtype, cfg in EVERY_OP]
    insts = {i.name: i for i in (FAMILY.instantiate(p, c, "sm_80") for p, c in probs)}
    batch = dataclasses.replace(next(iter(insts.values())), name="elementwise_test_batch",
                                source="\n".join(i.source for i in insts.values()))
    return tmp, build_emulated(batch, tmp, ("-O1",)), set(insts)


GRID = [  # chain, dtype, config
    ("gelu_erf_bias", "f16", {"THREADS": 128, "VEC": 8}),
    ("gelu_erf_bias", "bf16", {"THREADS": 64, "VEC": 4}),
    ("gelu_erf_bias", "f32", {"THREADS": 256, "VEC": 2}),
    ("gelu_tanh_pow", "f16", {"THREADS": 64, "VEC": 8}),
    ("gelu_tanh_pow", "bf16", {"THREADS": 512, "VEC": 1}),
    ("normalize", "f16", {"THREADS": 64, "VEC": 2}),
    ("normalize", "f32", {"THREADS": 128, "VEC": 4}),
    ("bert_mask", "f16", {"THREADS": 64, "VEC": 8}),
    ("where_cast_two_outputs", "f16", {"THREADS": 64, "VEC": 4}),
    ("where_cast_two_outputs", "bf16", {"THREADS": 128, "VEC": 8}),
    ("activations_rank6", "f16", {"THREADS": 256, "VEC": 8}),
    ("activations_rank6", "f32", {"THREADS": 64, "VEC": 1}),
    ("conv_activations", "f16", {"THREADS": 128, "VEC": 4}),
    ("conv_activations", "bf16", {"THREADS": 64, "VEC": 8}),
    ("mask_logic", "f16", {"THREADS": 64, "VEC": 8}),
    ("mask_logic", "f32", {"THREADS": 128, "VEC": 2}),
    ("window_partition", "f16", {"THREADS": 64, "VEC": 8}),
    ("window_partition", "f32", {"THREADS": 128, "VEC": 1}),
    ("window_reverse_residual", "f16", {"THREADS": 128, "VEC": 8}),
    ("window_reverse_residual", "bf16", {"THREADS": 64, "VEC": 2}),
    ("head_split", "f16", {"THREADS": 64, "VEC": 8}),
    ("head_split", "f32", {"THREADS": 256, "VEC": 4}),
    ("strided_slice", "f16", {"THREADS": 128, "VEC": 8}),
    ("strided_slice", "bf16", {"THREADS": 64, "VEC": 4}),
    ("transpose_gelu", "f16", {"THREADS": 64, "VEC": 8}),
    ("transpose_gelu", "f32", {"THREADS": 128, "VEC": 2}),
    ("shifted_window_partition", "f16", {"THREADS": 64, "VEC": 8}),
    ("shifted_window_partition", "f32", {"THREADS": 128, "VEC": 1}),
    ("window_reverse_roll_back", "f16", {"THREADS": 128, "VEC": 8}),
    ("window_reverse_roll_back", "bf16", {"THREADS": 64, "VEC": 4}),
]


@pytest.mark.parametrize(("chain", "dtype", "cfg"), GRID,
                         ids=[f"{c}-{d}-t{g['THREADS']}v{g['VEC']}" for c, d, g in GRID])
def test_matches_fp64_reference(emu, chain, dtype, cfg):
    prog, prob, ref, ranges = build(CHAINS[chain], dtype)
    assert FAMILY.check(prob, cfg, "sm_80") is None
    ins = make_inputs(prog, prob, 7, ranges)
    got = run(emu, prob, cfg, ins)
    want = ref(onnx_values(prog, prob, ins))
    family_ref = FAMILY.reference(prob, ins)
    assert len(got) == len(prog.outputs)
    for k, (name, _) in enumerate(prog.outputs):
        w = np.asarray(want[name])  # a reshape of the group's own output (its last Reshape) is the dense layout
        w = w.reshape(got[f"y{k}"].shape) if w.size == got[f"y{k}"].size else np.broadcast_to(w, got[f"y{k}"].shape)
        assert_close(got[f"y{k}"], w, dtype, f"{name} vs the ONNX reference")
        assert_close(got[f"y{k}"], family_ref[f"y{k}"], dtype, f"{name} vs FAMILY.reference")


ACCESS = [
    ((6, 64), {"THREADS": 64, "VEC": 8}, "vec"),     # innermost dim a multiple of VEC: gamma/beta vector loads,
    ((2, 3, 48), {"THREADS": 128, "VEC": 4}, "vec"),  # mean/var one load per VEC elements
    ((5, 36), {"THREADS": 64, "VEC": 8}, "gather"),   # 36 % 8: gathered per element
]


@pytest.mark.parametrize(("shape", "cfg", "access"), ACCESS)
def test_broadcast_access_paths(emu, shape, cfg, access):
    """Per-row statistics and [N] parameters read through the vector path's three access kinds."""
    prog, prob, ref, ranges = build(normalize(shape), "f16")
    # how the instance reads gamma (x3) and mean (x1) is decided at compile time (gtco::ew::access): check it there
    inst = FAMILY.instantiate(prob, cfg, "sm_80")
    kernel = f"{inst.name}_impl::Kernel"
    src = emu[0] / f"{inst.name}.access.cc"
    src.write_text(inst.source + (
        f"static_assert(({kernel}::access_of<3> == gtco::ew::Access::vec) == {str(access == 'vec').lower()});\n"
        f"static_assert(({kernel}::access_of<1> == gtco::ew::Access::one) == {str(access == 'vec').lower()});\n"))
    cxx_build(src, src.with_suffix(".o"), include_dirs=INCLUDES, defines=["GTCO_EMULATE"], extra=("-c",))
    ins = make_inputs(prog, prob, 11, ranges)
    got = run(emu, prob, cfg, ins)["y0"]
    assert_close(got, ref(onnx_values(prog, prob, ins))["y"], "f16", str(shape))


def every_op_problem(dtype):
    """Every op of the family once, on x0 (normal), x1 (positive: Sqrt, Log, Reciprocal, the divisor, Pow's base),
    x2 ([N], broadcast), x3 (bool [rows, 1]), summed into y0; y1 = the last instruction (a Cast to bool)."""
    x0, x1, x2, x3 = ("x", 0), ("x", 1), ("x", 2), ("x", 3)
    positive = {"Sqrt", "Log", "Reciprocal"}
    instrs = []
    for op, arity in ARITY.items():
        if op in ("Cast", "Where", "Pow", "Div"):
            continue
        instrs.append((op, (x1,) if op in positive else (x0,) if arity == 1 else (x0, x2), None))
    instrs += [("Div", (x0, x1), None), ("Pow", (x1, x0), None), ("Where", (x3, x0, x2), None),
               ("LeakyRelu", (x0,), 0.3), ("Elu", (x0,), 0.5), ("HardSigmoid", (x0,), (0.3, 0.6)),
               ("Gelu", (x0,), "tanh"), ("Gelu", (x0,), "none")]
    instrs = [(op, refs, "none" if op == "Gelu" and a is None else a) for op, refs, a in instrs]
    instrs += [("Cast", (x0,), t) for t in CAST_TARGETS]
    n = len(instrs)
    total = ("t", 0)
    for j in range(1, n):
        instrs.append(("Add", (total, ("t", j)), None))
        total = ("t", len(instrs) - 1)
    return elementwise_problem(dtype, (3, 40), instrs, [((3, 40), "float"), ((3, 40), "float"), ((40,), "float"),
                                                        ((3, 1), "bool")], [total, ("t", n - 1)])


EVERY_OP = [("f32", {"THREADS": 64, "VEC": 4}), ("f16", {"THREADS": 128, "VEC": 8})]


@pytest.mark.parametrize(("dtype", "cfg"), EVERY_OP)
def test_every_op(emu, dtype, cfg):
    prob = every_op_problem(dtype)
    assert {op for op, _, _ in prob.flag("program")} == set(ARITY)
    ins = FAMILY.random_inputs(prob, 5)
    got = run(emu, prob, cfg, ins)
    ref = FAMILY.reference(prob, ins)
    for k in ("y0", "y1"):
        assert_close(got[k], ref[k], dtype, k)


def test_broken_instances_are_caught(emu):
    """An off-by-one bias index, a dropped last element (left NaN) and a wrong reference all fail the comparison."""
    prog, prob, ref, ranges = build(gelu_erf_bias(), "f16")
    cfg = {"THREADS": 128, "VEC": 8}
    ins = make_inputs(prog, prob, 3, ranges)
    want = ref(onnx_values(prog, prob, ins))["y"]
    good = run(emu, prob, cfg, ins)["y0"]
    assert rel_error(good, want) < TOL["f16"]
    # the bias [100] is the one operand indexed with a modulus ((e % 100) * 1): one element off
    shifted = run(emu, prob, cfg, ins, header_edit=("broadcast.h", "t = t % static_cast<I>(Dim);",
                                                     "t = t % static_cast<I>(Dim) + 1;"))["y0"]
    assert rel_error(shifted, want) > 10 * TOL["f16"]
    short = run(emu, prob, cfg, ins, header_edit=("elementwise.cuh", "e < N &&", "e + 1 < N &&"))["y0"]
    assert np.isnan(short).sum() == 1 and rel_error(short, want) == float("inf")  # the unwritten element
    v = onnx_values(prog, prob, ins)
    no_bias = ref({"x": v["x"], "b": np.zeros_like(v["b"])})["y"]  # a reference that forgot the bias
    assert rel_error(good, no_bias) > 10 * TOL["f16"]
    # the tanh form is within 3e-4 of the erf GELU: below the tolerance, so the chains above test both forms


def test_wrong_size_is_refused(emu):
    prog, prob, _, ranges = build(gelu_tanh_pow(), "f16")
    cfg = {"THREADS": 64, "VEC": 8}
    inst = FAMILY.instantiate(prob, cfg, "sm_80")
    _, lib, batched = emu
    assert inst.name in batched
    arrays = {**make_inputs(prog, prob, 0, ranges), "y0": np.zeros((5, 129), np.float16)}
    fields = [f if f.name != "n" else dataclasses.replace(f, value=5 * 128) for f in FAMILY.args_fields(prob, arrays)]
    with pytest.raises(EmulationError, match="error code 1"):
        run_emulated(lib, inst.symbol, fields, arrays, ["y0"])


MISALIGNED_DRIVER = """
#include <cmath>
#include <cstdio>
#include <cstring>
// x [R, 100] + b [100] -> y: once from 16-byte aligned buffers (vector path), once from buffers one element off
// (the entry point must fall back to the scalar path); the two outputs must agree bit for bit
alignas(16) static __half xa[NX + 8], ba[NB + 8], ya[NX + 8], xm[NX + 8], bm[NB + 8], ym[NX + 8];
int main() {
    for (int i = 0; i < NX; ++i) xa[i] = xm[i + 1] = __float2half_rn(std::sin(0.37f * i) * 2.0f);
    for (int i = 0; i < NB; ++i) ba[i] = bm[i + 1] = __float2half_rn(std::cos(0.11f * i));
    GtcoElementwiseArgs a{}, m{};
    a.in[0] = xa; a.in[1] = ba; a.out[0] = ya; a.n = NX;
    m.in[0] = xm + 1; m.in[1] = bm + 1; m.out[0] = ym + 1; m.n = NX;
    const int ra = SYMBOL(&a, nullptr), rm = SYMBOL(&m, nullptr);
    if (ra != 0 || rm != 0) { std::fprintf(stderr, "returned %d, %d\\n", ra, rm); return 1; }
    if (std::memcmp(ya, ym + 1, sizeof(__half) * NX) != 0) { std::fprintf(stderr, "outputs differ\\n"); return 2; }
    std::printf("ok\\n");
    return 0;
}
"""


def test_misaligned_pointers_fall_back_to_scalar(tmp_path):
    """Pointers that are not VEC-aligned (a tensor that is a slice of a bigger buffer) run the scalar path instead
    of faulting or being refused."""
    _, prob, _, _ = build(gelu_erf_bias((1, 37, 100)), "f16")
    inst = FAMILY.instantiate(prob, {"THREADS": 64, "VEC": 8}, "sm_80")
    kernel = f"{inst.name}_impl::Kernel"  # x (input 0) takes the vector path when its pointer is aligned
    src = tmp_path / "misaligned.cu"
    src.write_text(inst.source + f"#define NX {37 * 100}\n#define NB 100\n#define SYMBOL {inst.symbol}\n"
                   + f"static_assert({kernel}::access_of<0> == gtco::ew::Access::vec && {kernel}::vector_path);\n"
                   + MISALIGNED_DRIVER)
    cxx_build(src, tmp_path / "misaligned", include_dirs=INCLUDES, defines=["GTCO_EMULATE"])
    assert run_exe(tmp_path / "misaligned").stdout.strip() == "ok"


GOOD = elementwise_problem("f16", (4, 8), [("Add", (("x", 0), ("x", 1)), None)], [((4, 8), "float"), ((8,), "float")],
                           [("t", 0)])


def _with(instrs=None, inputs=None, outputs=None, shape=(4, 8), dtype="f16"):
    return elementwise_problem(dtype, shape, instrs or GOOD.flag("program"), inputs or GOOD.flag("inputs"),
                               outputs or GOOD.flag("outputs"))


@pytest.mark.parametrize(("prob", "cfg", "arch", "reason"), [
    (_with(dtype="f32"), {"THREADS": 128, "VEC": 8}, "sm_80", "over 16"),
    (GOOD, {"THREADS": 96, "VEC": 4}, "sm_80", "THREADS=96 is not one of"),
    (GOOD, {"THREADS": 128, "VEC": 3}, "sm_80", "VEC=3 is not one of"),
    (GOOD, {"THREADS": 128}, "sm_80", "config lacks VEC"),
    (GOOD, {"THREADS": 128, "VEC": 4}, "sm_70", "arch 'sm_70'"),
    (_with([("Acos", (("x", 0),), None)]), {"THREADS": 128, "VEC": 4}, "sm_80", "op 'Acos' is not supported"),
    (_with([("Add", (("x", 0),), None)]), {"THREADS": 128, "VEC": 4}, "sm_80", "Add takes 2 operands"),
    (_with([("Cast", (("x", 0),), "i64")]), {"THREADS": 128, "VEC": 4}, "sm_80", "Cast to 'i64'"),
    (_with([("Gelu", (("x", 0),), "fast")]), {"THREADS": 128, "VEC": 4}, "sm_80", "Gelu approximate='fast'"),
    (_with([("Add", (("x", 0), ("t", 0)), None)]), {"THREADS": 128, "VEC": 4}, "sm_80", "names no earlier value"),
    (_with(inputs=[((4, 8), "float"), ((3,), "float")]), {"THREADS": 128, "VEC": 4}, "sm_80", "does not broadcast"),
    (_with(inputs=[((4, 8), "float"), ((8,), "u8")]), {"THREADS": 128, "VEC": 4}, "sm_80", "kind 'u8'"),
    (_with(inputs=[((4, 8), "float")] * 9), {"THREADS": 128, "VEC": 4}, "sm_80", "9 inputs"),
    (_with(outputs=[("c", 1.0)]), {"THREADS": 128, "VEC": 4}, "sm_80", "an output is a constant"),
    (_with(shape=(4, 0)), {"THREADS": 128, "VEC": 4}, "sm_80", "empty"),
    (_with(shape=(2, 4, 8)), {"THREADS": 128, "VEC": 4}, "sm_80", "broadcast to (4, 8), not (2, 4, 8)"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_check_rejects_with_reason(prob, cfg, arch, reason):
    why = FAMILY.check(prob, cfg, arch)
    assert why is not None and reason in why, why
    with pytest.raises(ValueError, match="elementwise: "):
        FAMILY.instantiate(prob, cfg, arch)


@pytest.mark.parametrize(("nodes", "consts", "reason"), [
    ([node("Asin", ["x"], "y")], {}, "unsupported op 'Asin' (node 'asin_y')"),
    ([node("Add", ["x", "x"], "a"), node("Mod", ["a", "x"], "y")], {}, "unsupported op 'Mod'"),
    ([helper.make_node("FastGelu", ["x"], ["y"], name="fg", domain="com.microsoft")], {},
     "unsupported op com.microsoft.FastGelu"),
    ([node("Cast", ["x"], "y", to=TensorProto.INT64)], {}, "Cast to INT64 is not supported"),
    ([node("Add", ["x", "w"], "y")], {"w": np.ones(8, np.float32)}, "constant 'w' read by Add"),
    ([node("Add", ["x", "nowhere"], "y")], {}, "reads 'nowhere'"),
    ([node("Relu", ["x"], "r"), node("Unsqueeze", ["r", "ax"], "u"), node("Add", ["u", "x"], "y")],
     {"ax": np.array([2])}, "do not broadcast"),
    ([node("Relu", ["x"], "r"), node("Reshape", ["r", "sh"], "u"), node("Neg", ["u"], "n"),
      node("Add", ["n", "r"], "y")], {"sh": np.array([8, 4])}, "do not broadcast"),
    ([node("Relu", ["x"], "r"), node("Transpose", ["r"], "y")], {}, "layout op is folded only into the load"),
    ([node("Slice", ["x", "s", "e", "a", "st"], "y")], {"s": np.array([3]), "e": np.array([0]),
                                                        "a": np.array([1]), "st": np.array([-1])}, "positive steps"),
    ([node("Pad", ["x", "p"], "y")], {"p": np.array([0, 1, 0, 0])}, "only a Pad of zeros"),
    ([node("Relu", ["x"], "r"), node("Reshape", ["r", "sh"], "u"), node("Reshape", ["x", "sh"], "xr"),
      node("Neg", ["xr"], "r2"), node("Add", ["u", "r2"], "y")], {"sh": np.array([32])},
     "reads the computed value 'r2'"),
    ([node("Relu", ["x"], "y")], {}, "output 'z' is not computed"),
])
def test_program_from_onnx_rejects_with_reason(nodes, consts, reason):
    outputs = ["z"] if "'z'" in reason else ["y"]
    with pytest.raises(ValueError, match="elementwise: ") as e:
        program_from_onnx(nodes, [("x", (4, 8))], outputs, consts)
    assert reason in str(e.value), str(e.value)


def test_symbolic_shape_is_rejected():
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 8])
    with pytest.raises(ValueError, match="symbolic shape"):
        program_from_onnx([node("Relu", ["x"], "y")], [vi], ["y"])


def _rotary(q=("batch", 4, "seq", 64), cos=(1, 1, "seq", 64)):
    nodes = [node("Mul", ["q", "cos"], "a"), node("Mul", ["r", "sin"], "b"), node("Add", ["a", "b"], "y")]
    return nodes, [("q", q, "float"), ("cos", cos, "float"), ("r", q, "float"), ("sin", cos, "float")], ["y"]


def test_a_program_over_symbolic_dims_collapses_by_what_each_input_walks():
    """q, r [batch, 4, seq, 64] and cos, sin [1, 1, seq, 64]: two collapsed dims (batch * 4, which cos and sin
    broadcast along, and seq * 64), both sized at run time; one instance whatever sizes a call gives."""
    rp = runtime_program_from_onnx(*_rotary())
    assert rp.symbols == ("batch", "seq") and rp.iteration == (-1, 4, -2, 64) and rp.groups == (2, 4)
    assert rp.walks == (0b11, 0b10, 0b11, 0b10)
    assert rp.dims({"batch": 3, "seq": 5}) == (12, 320)
    prob = rp.problem("f16", {"batch": 3, "seq": 5})
    assert iteration_shape(prob) == (12, 320) and FAMILY.check(prob, {"THREADS": 128, "VEC": 8}, "sm_90") is None
    names = {FAMILY.instantiate(rp.problem("f16", v), {"THREADS": 128, "VEC": 8}, "sm_90").name
             for v in ({}, {"batch": 3, "seq": 5}, {"batch": 1, "seq": 4096})}
    assert len(names) == 1 and "_dyn_" in names.pop()
    assert FAMILY.host_function(rp.problem("f32"))[0] == FAMILY.host_function(rp.problem("f32", {"seq": 9}))[0]
    # a static 1 between dims walked alike stays in one run; a symbol alone is one run
    rp = runtime_program_from_onnx([node("Relu", ["x"], "y")], [("x", ("n", 1, 8), "float")], ["y"])
    assert rp.groups == (3,) and rp.walks == (1,)
    # a head split's Transpose folds into the load: x [batch, seq, 4, 64] read as [batch, 4, seq, 64]; seq and 64
    # are no neighbours in x any more, so four runs; its innermost dim stays innermost (no gather)
    rp = runtime_program_from_onnx([node("Transpose", ["x"], "t", perm=[0, 2, 1, 3]), node("Mul", ["t", "cos"], "y")],
                                   [("x", ("batch", "seq", 4, 64), "float"), ("cos", (1, 1, "seq", 64), "float")],
                                   ["y"])
    got = {name: (src, perm, g) for (name, _, _), src, perm, g in zip(rp.inputs, rp.sources, rp.perms, rp.gathers,
                                                                       strict=True)}
    assert got == {"x": ((-1, -2, 4, 64), (0, 2, 1, 3), False), "cos": ((1, 1, -2, 64), (-1, -1, 2, 3), False)}
    assert rp.groups == (1, 2, 3, 4)


@pytest.mark.parametrize(("nodes", "inputs", "reason"), [
    ([node("Slice", ["x", "zero", "half", "last"], "t"), node("Relu", ["t"], "y")], [("x", ("n", 8), "float")],
     "reads whole tensors"),
    ([node("Flatten", ["x"], "f", axis=2), node("Relu", ["f"], "y")], [("x", ("b", "s", 8), "float")],
     "product of symbolic dims"),
    ([node("Add", ["x", "z"], "y")], [("x", ("n", 8), "float"), ("z", ("m", 8), "float")], "broadcast"),
    ([node("Relu", ["x"], "y")], [("x", (4, 8), "float")], "no symbolic dim"),
])
def test_programs_over_symbolic_dims_refuse_with_reason(nodes, inputs, reason):
    consts = {"zero": np.array([0]), "half": np.array([4]), "last": np.array([1])}
    with pytest.raises(ValueError, match="elementwise: ") as e:
        runtime_program_from_onnx(nodes, inputs, ["y"], consts)
    assert reason in str(e.value), str(e.value)


def _rotate_half(width):
    """x * cos + rotate_half(x) * sin over x [batch, 4, seq, width], rotate_half as the rotate-half rewrite leaves it:
    Concat(x[..., h:], x[..., :h]) * sign (families/elementwise/rotate.py)."""
    nodes = [node("Slice", ["x", "zero", "half", "last"], "x1"), node("Slice", ["x", "half", "end", "last"], "x2"),
             node("Concat", ["x2", "x1"], "xr", axis=-1), node("Mul", ["xr", "sign"], "xs"),
             node("Mul", ["x", "cos"], "xc"), node("Mul", ["xs", "sin"], "xss"), node("Add", ["xc", "xss"], "y")]
    consts = {"zero": np.array([0]), "half": np.array([width // 2]), "end": np.array([2**62]), "last": np.array([3])}
    inputs = [("x", ("batch", 4, "seq", width), "float"), ("sign", (width,), "float"),
              ("cos", (1, 1, "seq", width), "float"), ("sin", (1, 1, "seq", width), "float")]
    return nodes, inputs, ["y"], consts


def test_a_roll_over_symbolic_dims_is_a_run_of_its_own():
    rp = runtime_program_from_onnx(*_rotate_half(16))
    # x read twice (as it is and rolled by 8 along its last dim), which is a collapsed dim of its own
    assert rp.groups == (2, 3, 4) and rp.rolls == (None, None, None, None, (2, 8))
    assert [name for name, _, _ in rp.inputs] == ["x", "sign", "cos", "sin", "x"]
    assert rp.problem("f16").flag("rolls") == (None, None, None, None, (2, 8))


@pytest.mark.parametrize(("program", "dtype"), [("broadcast", "f32"), ("rolled6", "bf16"), ("rolled16", "f16")])
def test_a_program_over_symbolic_dims_matches_fp64_at_every_size(tmp_path, program, dtype):
    """One emulated instance of a rotary program, called at sizes whose innermost run is a multiple of the vector
    width (vector path), is not (scalar path), and of one element; rolled by 3 of 6 (a load per element) and by 8 of
    16 (vector loads)."""
    args = {"broadcast": lambda: _rotary(cos=(1, 1, "seq", 6), q=("batch", 4, "seq", 6)),
            "rolled6": lambda: _rotate_half(6), "rolled16": lambda: _rotate_half(16)}[program]()
    rp = runtime_program_from_onnx(*args)
    cfg = FAMILY.configs(rp.problem(dtype), "sm_80")[0]
    inst = FAMILY.instantiate(rp.problem(dtype), cfg, "sm_80")
    lib = build_emulated(inst, tmp_path, ("-O1",))
    for batch, seq in ((2, 32), (3, 5), (1, 1)):
        prob = rp.problem(dtype, {"batch": batch, "seq": seq})
        assert FAMILY.instantiate(prob, cfg, "sm_80").name == inst.name
        ins = FAMILY.random_inputs(prob, batch * 100 + seq)
        arrays = dict(ins)
        outs = FAMILY.outputs(prob)
        for k, (shape, dt) in outs.items():
            arrays[k] = np.full(shape, NAN_BITS[dt], np_dtype(dt))
        got = run_emulated(lib, inst.symbol, FAMILY.args_fields(prob, arrays), arrays, list(outs))
        want = FAMILY.reference(prob, ins)["y0"]
        assert_close(from_storage(got["y0"], dtype).reshape(want.shape), want, dtype, f"{batch}x{seq}")


def test_program_from_onnx_shapes_and_aliases():
    """Value infos are accepted, leading-1 views of computed values are free, a view-only input is dropped and does
    not widen the iteration shape (BERT's mask: [2, 77] viewed as [2, 1, 1, 77])."""
    prog = program_from_onnx(*bert_mask()[:4])
    assert prog.inputs == (("m", (2, 1, 1, 77), "i64"),) and prog.shape == (2, 1, 1, 77)
    nodes = [node("Relu", ["x"], "r"), node("Unsqueeze", ["r", "ax"], "u"), node("Add", ["u", "z"], "y")]
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 8])
    prog = program_from_onnx(nodes, [vi, ("z", (2, 1, 1))], ["y"], {"ax": np.array([0])})
    assert prog.shape == (2, 4, 8) and [op for op, _, _ in prog.instrs] == ["Relu", "Add"]
    # opset-6 Clip attributes, a Constant node holding a Reshape's shape, and one holding a scalar
    nodes = [helper.make_node("Constant", [], ["sh"], value_ints=[4, 8]),
             helper.make_node("Constant", [], ["half"], value_float=0.5), node("Reshape", ["x", "sh"], "xr"),
             node("Clip", ["xr"], "c", min=0.0, max=6.0), node("Mul", ["c", "half"], "y")]
    prog = program_from_onnx(nodes, [("x", (32,))], ["y"])
    assert prog.inputs == (("x", (4, 8), "float"),)
    assert prog.instrs == (("Max", (("x", 0), ("c", 0.0)), None), ("Min", (("t", 0), ("c", 6.0)), None),
                           ("Mul", (("t", 1), ("c", 0.5)), None))


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("chain", list(CHAINS))
def test_configs_are_valid_widest_vector_first(dtype, chain):
    _, prob, _, _ = build(CHAINS[chain], dtype)
    for arch in ("sm_80", "sm_90"):
        cfgs = FAMILY.configs(prob, arch)
        assert len(cfgs) >= 3 and all(FAMILY.check(prob, c, arch) is None for c in cfgs)
        assert cfgs[0]["VEC"] == (4 if dtype == "f32" else 8)


def test_instance_names_are_procedural():
    _, prob, _, _ = build(gelu_erf_bias(), "bf16")
    inst = FAMILY.instantiate(prob, {"THREADS": 128, "VEC": 8}, "sm_90")
    assert inst.name.startswith("elementwise_sm90_bf16_add_div_erf_add_mul_mul_n11100_t128_v8_")
    assert inst.symbol == "gtco_" + inst.name and inst.arch == "sm_90"
    assert inst.name == FAMILY.instantiate(prob, {"THREADS": 128, "VEC": 8}, "sm_90").name  # deterministic
    _, other, _, _ = build(gelu_erf_bias((4, 37, 100)), "bf16")
    assert FAMILY.instantiate(other, {"THREADS": 128, "VEC": 8}, "sm_90").name != inst.name


def _ptxas_instances(arch):
    """Every offered config of the GELU chain (f16, bf16, f32) and the first offered config of every chain and of
    the every-op program in every dtype: one translation unit."""
    insts = {}
    for dtype in ("f16", "bf16", "f32"):
        for chain in CHAINS:
            _, prob, _, _ = build(CHAINS[chain], dtype)
            cfgs = FAMILY.configs(prob, arch)
            for cfg in (cfgs if chain == "gelu_erf_bias" else cfgs[:1]):
                inst = FAMILY.instantiate(prob, cfg, arch)
                insts[inst.name] = inst
        prob = every_op_problem(dtype)
        inst = FAMILY.instantiate(prob, FAMILY.configs(prob, arch)[0], arch)
        insts[inst.name] = inst
        prob = runtime_program_from_onnx(*_rotary()).problem(dtype)  # run-time shapes: a 32- and a 64-bit kernel
        for cfg in FAMILY.configs(prob, arch)[:2]:
            inst = FAMILY.instantiate(prob, cfg, arch)
            insts[inst.name] = inst
    return list(insts.values())


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(nvcc_missing(), reason="nvcc not found on PATH (set NVCC or install the CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptxas_no_spills(tmp_path, arch):
    insts = _ptxas_instances(arch)
    src = tmp_path / f"elementwise_{arch}.cu"
    src.write_text("\n".join(i.source for i in insts))
    result = nvcc_compile(src, tmp_path / "ew.o", arch, include_dirs=INCLUDES, timeout_s=300)
    kernels = [k for k in parse_ptxas(result.stderr) if "_kernelE19GtcoElementwiseArgs" in k.name
               or "_kernel64E19GtcoElementwiseArgs" in k.name]
    assert len(kernels) == len(insts) + sum("_dyn_" in i.name for i in insts)
    for k in kernels:
        assert k.arch == arch and k.registers > 0, k
        assert not k.spills and k.stack_frame_bytes == 0, k


@pytest.mark.parametrize(("chain", "reads"), [
    ("window_partition", 1), ("window_reverse_residual", 3), ("head_split", 3), ("strided_slice", 2),
    ("transpose_gelu", 2), ("shifted_window_partition", 1), ("window_reverse_roll_back", 2)])
def test_layout_ops_fold_into_the_loads(chain, reads):
    """Every layout op of the chain is an index map of a kernel operand: the program reads the listed number of
    operands (head split: one view per part), each of its tensor's own size, and computes only the chain's
    elementwise ops."""
    nodes, inputs, _, _, _, _ = CHAINS[chain]()
    prog, prob, _, _ = build(CHAINS[chain], "f32")
    assert len(prog.inputs) == reads
    sizes = {name: math.prod(shape) for name, shape in inputs}
    assert all(math.prod(source_shape(prob, i)) == sizes[name] for i, (name, _, _) in enumerate(prog.inputs))
    computing = [n.op_type for n in nodes if n.op_type in ARITY]
    assert [op for op, _, _ in prog.instrs] == computing
