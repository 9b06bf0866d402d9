"""Property: encoders in the forms other people's exporters write are optimized without a refusal and compute what
they did.

Each example is a one-layer BERT-style encoder (onnx_gtco.models.bert) drawn over what varies between real exports:
the head dim (the attention kernels' 32, 64, 80, 128, the 96 and 256 of some models, small odd ones such as 26),
a padding mask or none, opsets 13 to 21, LayerNormalization as the op (at opsets 13-16 onnxruntime's contrib op) or
decomposed, the default domain imported under its alias `ai.onnx`, and attention scores and P·V written as MatMuls
or as the batched-MatMul Einsums tf2onnx writes. Every example must load, optimize and pass onnx.checker, then run
in onnxruntime's CPU EP equal to the original through its functions; a few also through the library's CPU kernels.
Counts (examples, fused attention nodes, head dims, opsets, forms) are printed at the end of the run (conftest.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import assert_close

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.models.bert import bert
from onnx_gtco.opspec import DOMAIN
from onnx_gtco.plugin.library import build_library
from onnx_gtco.runtime.session import METADATA_KEY, make_session

HEAD_DIMS = (26, 32, 64, 80, 96, 128, 256)
EXAMPLES = max(8, settings.get_profile("gtco-ci").max_examples // 6)  # conftest.py's profile
KERNEL_EXAMPLES = 3  # of those, the ones that also build the library (one g++ build each)
FUNCTION_TOL = (1e-4, 1e-5)
KERNEL_TOL = (1e-3, 1e-4)


@st.composite
def encoders(draw: st.DrawFn) -> dict[str, object]:
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    heads = draw(st.integers(1, 3))
    opset = draw(st.integers(13, 21))
    return {"head_dim": head_dim, "heads": heads, "opset": opset, "seq": draw(st.sampled_from((7, 16, 33))),
            "mask": draw(st.booleans()), "ln": draw(st.sampled_from(("op", "decomposed"))),
            "qkv": draw(st.sampled_from(("split", "fused"))), "alias": draw(st.booleans()),
            "einsum": draw(st.booleans()), "symbolic": draw(st.booleans())}


def make_encoder(p: dict[str, object]) -> onnx.ModelProto:
    """The drawn encoder: built at a supported opset, then given the drawn one and forms."""
    opset = int(p["opset"])  # type: ignore[arg-type]
    build_opset = 17 if p["ln"] == "op" and opset < 17 else opset  # LayerNormalization is an op from 17 on
    dim = int(p["heads"]) * int(p["head_dim"])  # type: ignore[arg-type]
    model = bert(batch="batch" if p["symbolic"] else 2, seq="seq" if p["symbolic"] else int(p["seq"]),  # type: ignore[arg-type]
                 dim=dim, heads=int(p["heads"]), mlp=2 * dim, depth=1, vocab=64, max_positions=64,  # type: ignore[arg-type]
                 ln=str(p["ln"]), qkv=str(p["qkv"]), opset=build_opset, seed=opset)
    if build_opset != opset:  # LayerNormalization below 17: onnxruntime's contrib op, as tf2onnx writes it
        for imp in model.opset_import:
            if imp.domain == "":
                imp.version = opset
    if not p["mask"]:
        drop_mask(model)
    if p["einsum"]:
        for n in model.graph.node:
            if n.op_type == "MatMul" and n.name.endswith((".qk", ".pv")):
                n.op_type = "Einsum"
                n.attribute.append(onnx.helper.make_attribute(
                    "equation", "bhqd,bhdk->bhqk" if n.name.endswith(".qk") else "bhqk,bhkd->bhqd"))
    if p["alias"]:
        for imp in model.opset_import:
            if imp.domain == "":
                imp.domain = "ai.onnx"
        for n in model.graph.node:
            if n.domain == "":
                n.domain = "ai.onnx"
    return model


def drop_mask(model: onnx.ModelProto) -> None:
    """The encoder without its padding mask: the scores' mask Add reads zeros (an initializer) and the
    attention_mask input goes, with the nodes that only it fed."""
    zero = onnx.numpy_helper.from_array(np.zeros((1,), np.float32), "no_mask")
    model.graph.initializer.append(zero)
    for n in model.graph.node:
        if n.op_type == "Add" and n.name.endswith(".mask"):
            n.input[1] = "no_mask"
    live = {o.name for o in model.graph.output}
    keep = []
    for n in reversed(list(model.graph.node)):
        if any(o in live for o in n.output):
            keep.append(n)
            live.update(n.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    inputs = [i for i in model.graph.input if i.name in live]
    del model.graph.input[:]
    model.graph.input.extend(inputs)


def feeds(model: onnx.ModelProto, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else (2 if d.dim_param == "batch" else seq)
                for d in i.type.tensor_type.shape.dim]
        if i.name == "attention_mask":
            mask = np.ones(dims, np.int64)
            mask[0, dims[1] // 2:] = 0  # the first sequence padded past its middle
            out[i.name] = mask
        else:
            out[i.name] = rng.integers(0, 64, size=dims, dtype=np.int64)
    return out


def run(model: onnx.ModelProto, x: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, x)


def test_encoders_in_other_exporters_forms_optimize_and_compute_what_they_did(
        tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    stats: Counter = Counter()

    @settings(settings.get_profile("gtco-ci"), max_examples=EXAMPLES)
    @given(p=encoders())
    def prop(p: dict[str, object]) -> None:
        model = make_encoder(p)
        x = feeds(model, int(p["seq"]), seed=1)  # type: ignore[arg-type]
        want = run(model, x)
        new = optimize(model, GtcoConfig()).model
        onnx.checker.check_model(new, full_check=True)
        assert not any(imp.domain == "ai.onnx" for imp in new.opset_import)
        names = [o.name for o in model.graph.output]
        assert_close(names, want, run(new, x), FUNCTION_TOL, f"functions of {p}")
        fused = Counter(n.op_type for n in new.graph.node if n.domain == DOMAIN)
        stats["examples"] += 1
        stats["attention fused"] += fused.get("Attention_f32", 0) + fused.get("BmmSoftmax_f32", 0)
        stats.update([f"head_dim {p['head_dim']}", f"opset {p['opset']}", f"ln {p['ln']}"])
        stats.update(k for k in ("mask", "alias", "einsum", "symbolic") if p[k])
        if stats["CPU kernels"] < KERNEL_EXAMPLES and not p["symbolic"]:
            out = tmp_path / f"example{stats['examples']}"
            out.mkdir()
            lib = build_library(new, out, cuda=False)
            new.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
            onnx.save(new, str(out / "model.gtco.onnx"))
            sess = make_session(out / "model.gtco.onnx", ["CPUExecutionProvider"], library=True)
            assert_close(names, want, sess.run(None, x), KERNEL_TOL, f"CPU kernels of {p} ({lib.op_types})")
            stats["CPU kernels"] += 1

    prop()
    record_property("gtco_counts", {"property/encoders": dict(stats)})
    assert stats["attention fused"] >= stats["examples"] // 2, f"too few attentions fused: {dict(stats)}"
