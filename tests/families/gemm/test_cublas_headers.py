"""Where the cuBLASLt header comes from (onnx_gtco.families.gemm.cublas_headers): the override is validated, the
installed package is used as is, and a downloaded wheel leaves only its headers in the cache, complete or not at all."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from onnx_gtco.errors import HeaderError
from onnx_gtco.families.gemm import cublas_headers


def _wheel(path: Path, names: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for n, data in names.items():
            z.writestr(n, data)
    return path


def test_override_must_hold_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cublas_headers.ENV, str(tmp_path))
    with pytest.raises(HeaderError, match=r"has no cublasLt\.h"):
        cublas_headers.cublaslt_include_dir()
    (tmp_path / "cublasLt.h").write_text("// header\n")
    assert cublas_headers.cublaslt_include_dir() == tmp_path


def test_unpack_keeps_only_the_include_headers(tmp_path: Path) -> None:
    inner = "nvidia/cu13/include/"
    wheel = _wheel(tmp_path / "w.whl", {inner + "cublasLt.h": b"lt", inner + "cublas_api.h": b"api",
                                        inner + "sub/x.h": b"no", "nvidia/cu13/lib/libcublasLt.so.13": b"\0" * 64})
    target = cublas_headers.unpack_headers(wheel, tmp_path / "cache" / "v1")
    assert sorted(p.name for p in target.iterdir()) == ["cublasLt.h", "cublas_api.h"]
    assert (target / "cublasLt.h").read_bytes() == b"lt"
    assert [p.name for p in target.parent.iterdir()] == ["v1"]  # no temporary folder left


def test_a_wheel_without_the_header_leaves_no_cache(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl", {"nvidia/cu13/include/cublas_api.h": b"api"})
    with pytest.raises(HeaderError, match=r"has no nvidia/cu13/include/cublasLt\.h"):
        cublas_headers.unpack_headers(wheel, tmp_path / "cache" / "v1")
    assert list((tmp_path / "cache").iterdir()) == []
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(HeaderError, match="not a readable wheel"):
        cublas_headers.unpack_headers(tmp_path / "bad.whl", tmp_path / "cache" / "v2")


def test_installed_package_header_is_found_or_reported_absent() -> None:
    d = cublas_headers.installed_include_dir()
    try:
        import importlib.metadata
        importlib.metadata.distribution(cublas_headers.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        assert d is None
        return
    assert d is not None and (d / "cublasLt.h").is_file()
