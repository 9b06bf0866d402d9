"""Fixtures of the custom-op library tests: the optimized built-in ViT with its library, and a small LN+Softmax model
(built once per module; the ORT headers and the libraries come from the per-user caches after the first run)."""

from __future__ import annotations

import pytest
from pins import CONV_KERNELS, pinned_calibration
from plugin_helpers import Built, _need_cxx, build_model, ln_softmax_model  # noqa: F401 (_need_cxx: autouse)

from onnx_gtco import GtcoConfig
from onnx_gtco.models import build


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The built-in ViT with its patch embedding kept a conv on our conv kernel (the planner would make it a copy
    and a GEMM; pinned: patchify off, CONV_KERNELS), so the library holds every family."""
    with pinned_calibration(tmp_path_factory.mktemp("calibration"), "sm_90", **CONV_KERNELS):
        return build_model(build("vit-tiny", seed=0), tmp_path_factory.mktemp("vit"),
                           config=GtcoConfig(patchify=False))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_model(ln_softmax_model(), tmp_path_factory.mktemp("small"))
