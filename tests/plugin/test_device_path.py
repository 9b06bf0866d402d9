"""The custom-op library's device path without a GPU.

An emulated build (build_library(emulated=True)) links the same generated instances a CUDA build links, compiled
for the CPU emulation (plugins/emu), and registers the device kernels for the CPU EP in place of the reference
ones. A CPU session then runs, for every bound node, what a CUDA session runs: the glue's shape checks, the
argument struct filled from the tensors (sizes, layout and addend strides, batch strides), the arch dispatch and the
instance's own checks and kernel. The models are fp16 (the device kernels read and write their own dtype): the
built-in ViT and BERT made fp16 by onnxruntime's converter, and small attention / LayerNorm models; each is compared
with its fp32 original, the higher-precision reference, on seeded inputs. The fp32 ViT and BERT optimized with
precision fp32 run their GEMM, QKV, attention and conv nodes as TF32 device kernels against the same originals
(the fp16 ViT's patch-embedding Conv stays fp32 and runs the TF32 conv instance too).

The CUDA build is checked too where nvcc is: the same op types get device kernels, for sm_80 and sm_90 with zero
spills, and the library still runs on the CPU EP of a CPU-only onnxruntime (its CUDA-EP kernels unused there).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from cpu_session import run
from onnx import TensorProto
from onnxruntime.transformers.float16 import convert_float_to_float16
from plugin_helpers import ln_softmax_model

from onnx_gtco import optimize
from onnx_gtco.config import GtcoConfig
from onnx_gtco.kernels.family import rel_error
from onnx_gtco.models import build
from onnx_gtco.plugin.library import LibraryResult, build_library, library_info
from onnx_gtco.runtime.session import METADATA_KEY, make_session

sys.path[:0] = [str(Path(__file__).parents[1] / "families" / f) for f in ("attention", "gemm")]
from test_attention_glue import small_model, swin_model  # noqa: E402 (the attention family's test models)
from test_gemm_glue import layer_scale_model  # noqa: E402

MODELS = {  # name -> (fp32 original, fp16 op types that must get device kernels)
    # the patch-embedding Conv stays fp32 (fp16() blocks it) and runs, as the estimate predicts it faster, as a
    # patchify copy and a TF32 GEMM (families/conv/patchify.py; the conv kernel's device path:
    # tests/families/conv/test_conv_glue)
    "vit": (lambda: build("vit-tiny", depth=1, image=64, seed=0),
            {"Layernorm_f16", "Gemm_f16", "Attention_f16", "Gemm_f32", "Elementwise_f32"}),
    # BERT's Q, K and V as one GEMM read packed by the attention (families/gemm/pack.py); "bert_qkv": planned without
    # that packing, its QKV node (gtco::Qkv) and the attention's three bshd_merged inputs
    "bert": (lambda: build("bert-tiny", depth=1, seq=24, batch="N", seed=0),
             {"Layernorm_f16", "Gemm_f16", "Attention_f16"}),
    "bert_qkv": (lambda: build("bert-tiny", depth=1, seq=24, batch="N", seed=0),
                 {"Layernorm_f16", "Qkv_f16", "Gemm_f16", "Attention_f16"}),
    "ln_softmax": (lambda: ln_softmax_model(hidden=16), {"Layernorm_f16", "Softmax_f16"}),
    "bmm_softmax": (lambda: small_model(probs_out=True, mask=True, bias=True, seq=40, head_dim=64),
                    {"BmmSoftmax_f16"}),
    "attention_kt": (lambda: small_model(k_transposed=False, mask=True, seq=37, head_dim=32), {"Attention_f16"}),
    "swin_window": (swin_model, {"Attention_f16"}),  # the shift mask read at batch row b % nW
    # attention as other exporters write it: Einsum products (tf2onnx), the scale after the mask and bias Adds (which
    # scales them too), a head dim of 26 (padded to 32 inside the kernel)
    "attention_forms": (lambda: small_model(einsum=True, scale_after=True, mask=True, bias=True, seq=37,
                                            head_dim=26), {"Attention_f16"}),
    "layer_scale": (layer_scale_model, {"Gemm_f16"}),  # LayerScale in the GEMM epilogue (DINOv2, CaiT)
}


def fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with fp16 tensors inside and its fp32 inputs and outputs kept (Conv stays fp32: ORT's CPU EP has
    no fp16 Conv); the converter leaves its input casts out of order, so the graph is sorted again."""
    converted = convert_float_to_float16(model, keep_io_types=True, op_block_list=["Conv"])
    graph = gs.import_onnx(converted)
    graph.toposort()
    return gs.export_onnx(graph)


def feeds(model: onnx.ModelProto, seed: int, batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in vi.type.tensor_type.shape.dim]
        elem = vi.type.tensor_type.elem_type
        if vi.name == "input_ids":
            out[vi.name] = rng.integers(0, 1000, shape).astype(np.int64)
        elif vi.name == "attention_mask":
            m = np.ones(shape, np.int64)
            m[0, shape[1] // 2:] = 0  # padding in the first sequence
            out[vi.name] = m
        elif vi.name == "mask":
            out[vi.name] = np.where(rng.standard_normal(shape) < -0.8, -10000.0, 0.0).astype(np.float32)
        else:
            assert elem == TensorProto.FLOAT, vi.name
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def build_emulated(name: str, out: Path) -> tuple[onnx.ModelProto, Path, LibraryResult]:
    """MODELS[name]'s fp32 original, its fp16 rewrite saved in out, and the rewrite's emulated library."""
    original = MODELS[name][0]()
    rewritten = optimize(fp16(original), GtcoConfig(pack_qkv=not name.endswith("_qkv"))).model
    lib = build_library(rewritten, out, cuda=False, emulated=True)
    path = out / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    return original, path, lib


@pytest.fixture(scope="module", params=list(MODELS))
def emulated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, onnx.ModelProto, Path, LibraryResult]:
    return request.param, *build_emulated(request.param, tmp_path_factory.mktemp(f"emu_{request.param}"))


def executed_ops(model: Path, x: dict[str, np.ndarray], lib: Path, tmp: Path) -> set[str]:
    """Op types of the nodes a profiled CPU session ran."""
    so = ort.SessionOptions()
    so.add_session_config_entry("gtco.register", "all")
    so.register_custom_ops_library(str(lib))
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "profile")
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    sess.run(None, x)
    events = json.loads(Path(sess.end_profiling()).read_text())
    return {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}


def test_emulated_device_kernels_match_fp32_original(emulated) -> None:
    name, original, path, lib = emulated
    want_types = MODELS[name][1]
    assert want_types <= set(lib.cuda_op_types), (lib.cuda_op_types, lib.kernel_skips)
    info = library_info(lib.path)
    assert info["emulated"] is True and set(info["cuda_op_types"]) == set(lib.cuda_op_types)
    assert all(len(v) == 1 and "_sm80_" in v[0] for v in info["instances"].values())  # the sm_80 instances
    for seed in (0, 1):
        x = feeds(original, seed)
        want = run(original, x)
        got = run(path, x, lib.path)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape and np.isfinite(g).all()
            err = rel_error(g, w)
            assert err < 5e-3, f"{name} seed {seed}: ‖err‖/‖ref‖ = {err:.2e}"
    # the fused nodes ran as custom-op kernels (a registered op type hides the node's function), and in an
    # emulated build the only kernel registered for them is the device one
    assert want_types <= executed_ops(path, feeds(original, 0), lib.path, path.parent)


def test_emulated_library_errors_name_the_op(tmp_path: Path) -> None:
    """A wrong input shape reaches the device kernel's checks and comes back as an ORT error naming the op."""
    original, path, lib = build_emulated("ln_softmax", tmp_path)
    model = onnx.load(str(path))
    for vi in [*model.graph.input, *model.graph.output]:  # let a wrong hidden size through to the kernels
        vi.type.tensor_type.shape.dim[1].dim_param = "H"
    x = {k: v[:, :12].copy() for k, v in feeds(original, 0).items()}
    with pytest.raises(Exception, match=r"Layernorm_f16 node '[^']+': input x \[2,12\] normalises 12 elements per "
                                        r"row; the kernel was built for hidden=16"):
        run(model, x, lib.path)


def test_fp32_model_with_fp16_precision_is_converted_for_its_kernels(tmp_path: Path) -> None:
    """--precision fp16 converts an fp32 model (onnx_gtco.precision), so its fused nodes get their f16 device
    kernels; a fused node computing in f16 on f32 tensors (no conversion: the node's precision attribute set by hand)
    gets none, and the reason says so."""
    from onnx_gtco.config import GtcoConfig

    converted = optimize(ln_softmax_model(hidden=16), GtcoConfig(precision="fp16")).model
    (tmp_path / "converted").mkdir()
    lib = build_library(converted, tmp_path / "converted", cuda=False, emulated=True)
    assert sorted(lib.cuda_op_types) == ["Layernorm_f16", "Softmax_f16"]
    assert not lib.kernel_skips
    plain = optimize(ln_softmax_model(hidden=16)).model
    for node in plain.graph.node:
        for a in node.attribute:
            if a.name == "precision":
                a.s = b"fp16"
    lib = build_library(plain, tmp_path, cuda=False, emulated=True)
    assert lib.cuda_op_types == []
    assert lib.kernel_skips and all("on f32 tensors" in why for why in lib.kernel_skips.values()), lib.kernel_skips


TF32_TOL = 2e-3  # TF32 device kernels (fp32 I/O, 10-bit operand mantissas) against the fp32 original
TF32_FAMILIES = ("Gemm_", "Qkv_", "Attention_", "BmmSoftmax_", "Conv_")


@pytest.mark.parametrize("name", ["vit", "bert", "bert_qkv", "swin_window"])
def test_fp32_precision_runs_every_tensor_core_node_in_tf32(name: str, tmp_path: Path) -> None:
    """--precision fp32: every GEMM, QKV and attention node of the built-in ViT and BERT (and of Swin's shifted-window
    attention) gets a TF32 device instance
    (none keeps its function), and the emulated build matches the fp32 original within 2e-3."""
    from onnx_gtco.config import GtcoConfig

    original = MODELS[name][0]()
    rewritten = optimize(original, GtcoConfig(precision="fp32", pack_qkv=not name.endswith("_qkv"))).model
    lib = build_library(rewritten, tmp_path, cuda=False, emulated=True)
    tc = [r for r in lib.nodes if r.op_type.startswith(TF32_FAMILIES)]
    assert {r.op_type for r in tc} >= {t.replace("f16", "f32") for t in MODELS[name][1] if t.startswith(TF32_FAMILIES)}
    assert all(r.op_type.endswith("_f32") and r.binding is not None for r in tc)
    assert not [r.node for r in tc if r.node in lib.kernel_skips], lib.kernel_skips
    assert {r.op_type for r in tc} <= set(lib.cuda_op_types)
    info = library_info(lib.path)
    assert {r.node for r in tc} <= set(info["instances"])
    assert all("_sm80_f32_" in v[0] for n, v in info["instances"].items() if n in {r.node for r in tc})
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    for seed in (0, 1):
        x = feeds(original, seed)
        for w, g in zip(run(original, x), run(path, x, lib.path), strict=True):
            assert g.shape == w.shape and np.isfinite(g).all()
            err = rel_error(g, w)
            assert err < TF32_TOL, f"{name} seed {seed}: ‖err‖/‖ref‖ = {err:.2e}"
    assert {r.op_type for r in tc} <= executed_ops(path, feeds(original, 0), lib.path, tmp_path)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed for the CUDA build")
def test_cuda_build_registers_device_kernels_and_still_runs_on_cpu(tmp_path: Path) -> None:
    original = MODELS["vit"][0]()
    rewritten = optimize(fp16(original)).model
    lib = build_library(rewritten, tmp_path, cuda=True)
    assert MODELS["vit"][1] <= set(lib.cuda_op_types), lib.kernel_skips
    archs = {k["arch"] for k in lib.kernels}
    assert archs == {"sm_80", "sm_90"}
    for k in lib.kernels:
        for r in k["kernels"]:
            assert r["spill_store_bytes"] == 0 and r["stack_frame_bytes"] == 0, k
    info = library_info(lib.path)
    # sm_80, sm_90 and the sm_90a slot, which holds the sm_90 instance unless a CUTLASS one is predicted faster
    assert info["cuda"] is True and all(len(v) == 3 and (v[2] == v[1] or "_cutlass_" in v[2])
                                        for v in info["instances"].values())
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    x = feeds(original, 0)
    want = run(original, x)
    got = run(path, x, lib.path)  # a CPU-only onnxruntime: the CPU reference kernels run, the CUDA ones are unused
    assert rel_error(got[0], want[0]) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu with the CUDA EP and an NVIDIA GPU")
@pytest.mark.parametrize("name", ["vit", "bert"])
def test_cuda_session_runs_the_device_kernels(name: str, tmp_path: Path) -> None:
    original = MODELS[name][0]()
    rewritten = optimize(fp16(original)).model
    lib = build_library(rewritten, tmp_path, cuda=True)
    rewritten.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=lib.name))
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    sess = make_session(path, ["CUDAExecutionProvider", "CPUExecutionProvider"], sess_options=so)
    for seed in (0, 1):
        x = feeds(original, seed)
        for w, g in zip(run(original, x), sess.run(None, x), strict=True):
            assert rel_error(g, w) < 5e-3
    events = json.loads(Path(sess.end_profiling()).read_text())
    ran = {(e["args"].get("op_name"), e["args"].get("provider")) for e in events if e.get("cat") == "Node"}
    assert {(t, "CUDAExecutionProvider") for t in MODELS[name][1]} <= ran, ran
