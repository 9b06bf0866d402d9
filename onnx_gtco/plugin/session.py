"""Moved to onnx_gtco.runtime.session (opening a model in ONNX Runtime is the runtime's part, and the runtime sits
below the plugin); these names stay importable from here for the modules that still use this path."""

from __future__ import annotations

from onnx_gtco.errors import LibraryError
from onnx_gtco.runtime.session import METADATA_KEY, library_path, make_session

__all__ = ["METADATA_KEY", "LibraryError", "library_path", "make_session"]
