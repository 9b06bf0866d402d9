"""Errors, one class per stage, and every other exception class of the package (tests/test_layers.py checks that
none is defined elsewhere). Messages name the problem and, where there is one, the fix."""

from __future__ import annotations


class GtcoError(Exception):
    """Base of every error onnx-gtco raises on purpose; the CLI prints it as one line and exits 2."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (onnx's and ORT's run over many lines), or its type's name when the
    message is empty: what a one-line error quotes of a library's exception."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class MissingPackageError(GtcoError):
    """An optional package that a feature needs is not installed."""


EXTRAS = {"cupy": "gpu", "torch": "torch", "onnx2torch": "torch", "tensorrt": "tensorrt", "psycopg2": "postgres"}
"""Importable name -> the onnx-gtco extra that installs it (pyproject.toml's optional-dependencies)."""


def install_hint(module: str) -> str:
    """How to install what provides `module`: the extra that brings it, else the package itself."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    return f"pip install 'onnx-gtco[{extra}]'" if extra else f"pip install {top}"


def missing_package(module: str, needed_for: str) -> MissingPackageError:
    """The one-line error for a missing optional package: what needs it, and the extra that installs it."""
    return MissingPackageError(f"{needed_for} needs the Python package {module.split('.')[0]}, which is not "
                               f"installed: {install_hint(module)}")


class ModelError(GtcoError):
    """The input model cannot be read, is not valid ONNX, or uses an opset we cannot handle."""


class UnsupportedError(GtcoError):
    """The model is valid but uses something onnx-gtco does not support."""


class OpsetNotConvertedError(UnsupportedError):
    """A valid model of an opset below 13 that onnx's version converter cannot bring forward faithfully (it fails,
    or changes the graph's inputs or outputs). `model` is the checked model at its own opset: optimize passes it
    through unfused, since the fusion rules read opset >= 13 semantics."""

    def __init__(self, message: str, model: object) -> None:
        super().__init__(message)
        self.model = model


class PlanError(GtcoError):
    """Fusion planning failed (no candidate set covers the graph, or the search was too large)."""


class RewriteError(GtcoError):
    """Writing the fused model failed."""


class OutputError(GtcoError):
    """An output path cannot be written."""


class ReportError(GtcoError):
    """A file given as an onnx-gtco report is missing, not JSON, or not such a report."""


class CudaProviderError(GtcoError):
    """A session asked for onnxruntime's CUDA EP and did not get it (ORT fell back to the CPU)."""


class CheckError(GtcoError):
    """Comparing two models could not run (not: the models differ)."""


class CalibrationError(GtcoError):
    """Calibration data (fp8's --calibration-data) that cannot be read or does not fit the model."""


class BuildError(GtcoError):
    """A compiler is missing, failed, or timed out."""


class KernelResourceError(BuildError):
    """ptxas reports a spill, a stack frame or no kernel for an instance: the configuration must not be used (the
    library build moves on to the family's next configuration)."""

    def __init__(self, message: str, instance: str = "", arch: str = "") -> None:
        super().__init__(message)
        self.instance = instance
        self.arch = arch


class EmulationError(BuildError):
    """The emulated kernel faulted (a gtco-emu error), returned a GTCO_E* code, or timed out."""


class HeaderError(GtcoError):
    """The ONNX Runtime headers could not be found or fetched."""


class LibraryError(GtcoError):
    """The model's custom-op library is missing or cannot be loaded."""


# Signals that one module raises and catches itself: they never reach a caller, so they are no GtcoError.

class FoldError(Exception):
    """onnx-graphsurgeon failed folding a model's constants (ir.load keeps the model unfolded)."""


class SearchBudgetError(Exception):
    """The fusion search of one segment passed its state budget (plan.dp searches it again with forced moves, else
    leaves it unfused)."""


class VariantSkipped(Exception):
    """A benchmark variant cannot run here for a reason that is not a failure (not installed, wrong provider):
    bench.variants reports it as skipped."""
