"""The custom-op library's CPU kernels under load: 2 sessions x 8 threads running the rewritten ViT at once give the
single-threaded outputs bit for bit; wrong-shaped and wrong-dtype operands are ORT errors naming the op, and the
process and its sessions carry on.

The load is counted, not clocked: every thread makes GTCO_LOAD_RUNS runs (default 20; 320 in all), all started at
once, so a slow machine makes the same number of concurrent runs as a fast one.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from pins import CONV_KERNELS, pinned_calibration
from plugin_helpers import Built, build_model

from onnx_gtco import GtcoConfig
from onnx_gtco.models import build
from onnx_gtco.runtime.check import make_inputs
from onnx_gtco.runtime.session import make_session

pytestmark = pytest.mark.slow

CPU = ["CPUExecutionProvider"]
SESSIONS, THREADS = 2, 8
LOAD_RUNS = int(os.environ.get("GTCO_LOAD_RUNS", "20"))
OP_TYPES = ["Attention_f32", "Conv_f32", "Gemm_f32", "Layernorm_f32"]
COPY = "Elementwise_f32"
"""The patch embedding's flatten + transpose, a fused copy node (4x4 patches: too small to narrow by 8 features)."""


@pytest.fixture(scope="module")
def load_vit(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """ViT-tiny's blocks (dim 192, 3 heads, MLP 768) on 64x64 images, 2 blocks, batch 2: 17 tokens, so a run takes
    tens of milliseconds and the load phase makes hundreds of them. The patch embedding stays a conv on our conv
    kernel (pinned: patchify off, CONV_KERNELS), so every family is under load."""
    model = build("vit-tiny", seed=0, image=64, patch=16, depth=2, batch=2)
    with pinned_calibration(tmp_path_factory.mktemp("calibration"), "sm_90", **CONV_KERNELS):
        return build_model(model, tmp_path_factory.mktemp("vit-load"), config=GtcoConfig(patchify=False))


def _session(path: Path) -> ort.InferenceSession:
    """A session with the library registered (its CPU kernels run) and one intra-op thread, so that every run
    computes in the same order and concurrent callers are the only parallelism."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return make_session(path, CPU, library=True, sess_options=so)


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()
               for g, w in zip(got, want, strict=True))


def test_concurrent_sessions_match_single_threaded(load_vit: Built, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_vit.lib.op_types == sorted([*OP_TYPES, COPY])  # the kernels under load are the library's
    original = onnx.load(str(load_vit.original))
    feeds = [make_inputs(original, seed) for seed in range(5)]
    single = _session(load_vit.rewritten)
    want = [single.run(None, f) for f in feeds]
    ref = ort.InferenceSession(str(load_vit.original), providers=CPU)
    for f, w in zip(feeds, want, strict=True):  # the reference itself is right (the plain ViT in ORT)
        np.testing.assert_allclose(w[0], ref.run(None, f)[0], rtol=1e-4, atol=1e-4)
    assert len({w[0].tobytes() for w in want}) == len(feeds)  # distinct inputs give distinct outputs

    sessions = [_session(load_vit.rewritten) for _ in range(SESSIONS)]
    runs = [0] * (SESSIONS * THREADS)
    wrong: list[str] = []
    start = threading.Barrier(SESSIONS * THREADS)

    def worker(k: int) -> None:
        sess = sessions[k % SESSIONS]
        start.wait()
        for i in range(k, k + LOAD_RUNS):
            j = i % len(feeds)
            if not _same(sess.run(None, feeds[j]), want[j]):
                wrong.append(f"thread {k} run {runs[k]} on input {j}")
            runs[k] += 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(SESSIONS * THREADS) as pool:
        list(pool.map(worker, range(SESSIONS * THREADS)))  # re-raises a worker's exception
    elapsed = time.monotonic() - t0
    with capsys.disabled():
        print(f"\nplugin load: {sum(runs)} runs in {elapsed:.1f} s by {SESSIONS} sessions x {THREADS} threads "
              f"(per thread {min(runs)}..{max(runs)}), {len(wrong)} differing from single-threaded")
    assert runs == [LOAD_RUNS] * (SESSIONS * THREADS)
    assert not wrong, wrong[:5]


def _one_node_model(rewritten: onnx.ModelProto, op_type: str, dtype: int) -> tuple[onnx.ModelProto, onnx.NodeProto]:
    """The first node of `op_type` alone, with its function and library metadata; its computed inputs are graph
    inputs of `dtype` with symbolic dims, so ORT lets any operand through to the kernel."""
    node = next(n for n in rewritten.graph.node if n.op_type == op_type)
    constant = {t.name for t in rewritten.graph.initializer}
    inputs = [t for t in node.input if t and t not in constant]
    sub = onnx.utils.Extractor(rewritten).extract_model(inputs, list(node.output))
    assert [n.name for n in sub.graph.node] == [node.name]
    del sub.functions[:]  # the Extractor keeps one function per name; the node's is the one with its overload
    sub.functions.extend(f for f in rewritten.functions
                         if (f.domain, f.name, f.overload) == (node.domain, node.op_type, node.overload))
    sub.metadata_props.extend(rewritten.metadata_props)
    for vi in sub.graph.input:
        vi.type.tensor_type.elem_type = dtype
    for vi in [*sub.graph.input, *sub.graph.output]:
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            d.dim_param = f"{vi.name}_{k}"
    return sub, node


def _inputs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], dtype: type, seed: int
            ) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {vi.name: rng.standard_normal(shapes[vi.name]).astype(dtype) for vi in model.graph.input}


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_bad_operands_name_the_op_and_the_process_carries_on(load_vit: Built, op_type: str, tmp_path: Path) -> None:
    rewritten = onnx.load(str(load_vit.rewritten))
    good, node = _one_node_model(rewritten, op_type, onnx.TensorProto.FLOAT)
    doubles, _ = _one_node_model(rewritten, op_type, onnx.TensorProto.DOUBLE)
    inferred = onnx.shape_inference.infer_shapes(rewritten).graph
    shapes = {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
              for vi in (*inferred.input, *inferred.value_info) if vi.name in node.input}  # the conv reads an input
    for name, model in (("good", good), ("doubles", doubles)):
        onnx.save(model, str(load_vit.rewritten.parent / f"{op_type}.{name}.onnx"))
    sess = _session(load_vit.rewritten.parent / f"{op_type}.good.onnx")
    names = rf"{op_type}\b.*{node.name}|{node.name}.*{op_type}\b"

    if op_type.startswith("Conv"):  # a conv takes any image size: its image is one channel short of the weights
        narrow = {k: (v[0], v[1] - 1, *v[2:]) for k, v in shapes.items()}
    else:  # every operand 8 features short
        narrow = {k: (*v[:-1], v[-1] - 8) for k, v in shapes.items()}
    with pytest.raises(Exception, match=names):
        sess.run(None, _inputs(good, narrow, np.float32, 0))
    with pytest.raises(Exception, match=rf"({names}).*(double|float64)|(double|float64).*({names})"):
        _session(load_vit.rewritten.parent / f"{op_type}.doubles.onnx").run(None, _inputs(doubles, shapes,
                                                                                           np.float64, 0))
    # still alive: the same session runs a correct input, equal to the node's function (library not registered)
    feeds = _inputs(good, shapes, np.float32, 1)
    got = sess.run(None, feeds)
    plain = ort.InferenceSession(str(load_vit.rewritten.parent / f"{op_type}.good.onnx"), providers=CPU)
    for g, w in zip(got, plain.run(None, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    full = _session(load_vit.rewritten)
    x = make_inputs(onnx.load(str(load_vit.original)), 0)
    assert np.isfinite(full.run(None, x)[0]).all()
