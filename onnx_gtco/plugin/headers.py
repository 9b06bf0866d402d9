"""The ONNX Runtime C/C++ API headers the custom-op library compiles against (never committed to the repo).

`ort_include_dir()` returns a directory holding `onnxruntime_cxx_api.h`:

1. `$ORT_INCLUDE_DIR` when set (validated: an error when the header is not there);
2. else a per-user cache, `$XDG_CACHE_HOME/onnx-gtco/ort-headers/<version>/` (default `~/.cache/...`), filled once
   from Debian trixie's `libonnxruntime-dev` package (MIT-licensed headers, ORT_API_VERSION 21, which every
   onnxruntime >= 1.21 accepts): the pinned .deb is fetched from deb.debian.org and checked against its SHA-256;
   if that file is gone from the archive, `apt-get download` with a private sources list and private state
   directories (the system's apt state is not touched) fetches the current one. The .deb is unpacked with
   `dpkg -x` (or `ar` + `tar`) into a temporary directory that is renamed into place, so the cache is either
   complete or absent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from onnx_gtco.config import ORT_INCLUDE_ENV, ort_include_override
from onnx_gtco.errors import HeaderError
from onnx_gtco.kernels.toolchain import cache_root

ENV = ORT_INCLUDE_ENV
HEADER = "onnxruntime_cxx_api.h"
PACKAGE = "libonnxruntime-dev"
VERSION = "1.21.0+dfsg-1"
ORT_API_VERSION = 21
_DEB_URL = f"http://deb.debian.org/debian/pool/main/o/onnxruntime/{PACKAGE}_{VERSION}_amd64.deb"
_DEB_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
_SOURCES = "deb http://deb.debian.org/debian trixie main\n"
_TIMEOUT_S = 120.0
_INNER = Path("usr/include/onnxruntime")


def ort_include_dir(download: bool = True) -> Path:
    """A directory with onnxruntime_cxx_api.h (see the module docstring); with download=False only what is here
    already ($ORT_INCLUDE_DIR or the cache): what a machine without network can check before it compiles anything.

    Raises:
        HeaderError: $ORT_INCLUDE_DIR lacks the header, the download / unpacking failed (the message names the
            step and how to work around it), or, with download=False, the cache is empty.
    """
    override = ort_include_override()
    if override:
        d = Path(override)
        if not (d / HEADER).is_file():
            raise HeaderError(f"{ENV}={override!r} has no {HEADER} (point it at the folder holding the ONNX Runtime "
                              "C/C++ API headers, or unset it to download them)")
        return d
    target = cache_root() / "ort-headers" / VERSION
    if (target / _INNER / HEADER).is_file():
        return target / _INNER
    if not download:
        raise HeaderError(f"the ONNX Runtime headers are not here ({ENV} is unset and {target} is empty) and would "
                          f"be downloaded: set {ENV} to a folder with {HEADER}")
    return _fill(target) / _INNER


def _fill(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        deb = _download(tmp / "dl")
        root = tmp / "root"
        _extract(deb, root)
        if not (root / _INNER / HEADER).is_file():
            raise HeaderError(f"{deb.name} has no {_INNER / HEADER}")
        try:
            os.replace(root, target)
        except OSError:
            if not (target / _INNER / HEADER).is_file():  # another process filled it first: fine
                raise
        return target
    except OSError as e:
        raise HeaderError(f"cannot write the ONNX Runtime header cache {target}: {e} (set {ENV} to a folder "
                          f"with {HEADER})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download(dest: Path) -> Path:
    dest.mkdir(parents=True)
    deb = dest / f"{PACKAGE}.deb"
    try:
        with urllib.request.urlopen(_DEB_URL, timeout=_TIMEOUT_S) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() != _DEB_SHA256:
            raise HeaderError(f"{_DEB_URL}: SHA-256 mismatch (corrupted download?)")
        deb.write_bytes(data)
        return deb
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise HeaderError(f"downloading the ONNX Runtime headers failed: {_DEB_URL}: HTTP {e.code} "
                              f"(set {ENV} to a folder with {HEADER})") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise HeaderError(f"downloading the ONNX Runtime headers failed: {_DEB_URL}: {reason} (needs network "
                          f"access to deb.debian.org, or set {ENV} to a folder with {HEADER})") from None
    return _apt_download(dest)


def _apt_download(dest: Path) -> Path:
    """The pinned .deb left the archive: let apt fetch trixie's current one, with private state."""
    apt = shutil.which("apt-get")
    if apt is None:
        raise HeaderError(f"{_DEB_URL} is gone from the archive and apt-get is not available to find the current "
                          f"{PACKAGE} (set {ENV} to a folder with {HEADER})")
    state = dest / "apt"
    (state / "lists" / "partial").mkdir(parents=True)
    (state / "cache" / "archives" / "partial").mkdir(parents=True)
    (state / "sources.list").write_text(_SOURCES)
    opts = [f"-oDir::Etc::SourceList={state / 'sources.list'}", "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={state / 'lists'}", f"-oDir::Cache={state / 'cache'}",
            "-oAPT::Sandbox::User=root", "-qq"]
    for args in (["update"], ["download", PACKAGE]):
        try:
            proc = subprocess.run([apt, *opts, *args], cwd=dest, capture_output=True, text=True,
                                  timeout=_TIMEOUT_S * 3, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise HeaderError(f"apt-get {args[0]} failed: {e} (set {ENV} to a folder with {HEADER})") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise HeaderError(f"apt-get {' '.join(args)} failed (exit {proc.returncode}): {' / '.join(tail)} "
                              f"(set {ENV} to a folder with {HEADER})")
    debs = sorted(dest.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise HeaderError(f"apt-get download {PACKAGE} produced no .deb (set {ENV} to a folder with {HEADER})")
    return debs[0]


def _extract(deb: Path, root: Path) -> None:
    root.mkdir()
    dpkg = shutil.which("dpkg-deb") or shutil.which("dpkg")
    if dpkg is not None:
        cmd = [[dpkg, "-x", str(deb), str(root)]]
    else:
        ar, tar = shutil.which("ar"), shutil.which("tar")
        if ar is None or tar is None:
            raise HeaderError(f"cannot unpack {deb.name}: neither dpkg nor ar+tar is installed "
                              f"(set {ENV} to a folder with {HEADER})")
        cmd = [[ar, "x", str(deb), "data.tar.xz"], [tar, "-xJf", "data.tar.xz", "-C", str(root)]]
    for c in cmd:
        proc = subprocess.run(c, cwd=deb.parent, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise HeaderError(f"unpacking {deb.name} failed ({Path(c[0]).name} exit {proc.returncode}): "
                              f"{proc.stderr.strip()[:300]}")
