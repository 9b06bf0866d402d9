"""What the machine is (GPU, clocks, CUDA, package versions, the checkout's commit), the GPU bundle's environment,
and the install of carried wheels (`--wheels`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from suite.common import ROOT, GtcoError, Step, probe, run_command, skipped, tool_output

BUNDLE_ENV = Path("/tmp/gpu-env.sh")
"""Where a GPU bundle's setup writes the environment of a GPU run (PYTHONPATH with its packages, ORT_INCLUDE_DIR,
GTCO_CUBLASLT_INCLUDE, PATH with onnx-gtco). A bundle is a folder carried to a machine without network beside the
checkout (.device-carry/: onnxruntime-gpu and the packages the machine lacks, the CUTLASS, ORT and cuBLASLt headers,
and a `setup` script that unpacks them and checks that ORT's CUDA EP runs)."""
BUNDLE_SETUP = ROOT / ".device-carry" / "setup"
"""The bundle's setup script, where the bundle was carried beside the checkout."""

VERSIONS_PROBE = r"""
import importlib, importlib.metadata as md, importlib.util, json, sys
out = {}
for mod in ("onnxruntime", "torch", "cupy", "onnx", "optuna", "onnx_graphsurgeon", "onnx_gtco"):
    try:
        m = importlib.import_module(mod)
    except Exception as e:
        out[mod] = None
        continue
    out[mod] = getattr(m, "__version__", "?")
    if mod == "onnxruntime":
        out["onnxruntime_providers"] = m.get_available_providers()
    if mod == "torch":
        out["torch_cuda"] = m.version.cuda
for dist in ("timm", "transformers"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        out[dist] = None
print(json.dumps(out))
"""




def gpu_info() -> dict[str, str] | None:
    """The first GPU's name, driver, compute capability and SM clocks (now and at most) from nvidia-smi, or None
    without one."""
    text = tool_output(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.max.sm",
                        "--format=csv,noheader"])
    if not text or not text.strip():
        return None
    fields = [s.strip() for s in text.strip().splitlines()[0].split(",")]
    name, driver, cap = fields[:3]
    info = {"name": name, "driver": driver, "compute_cap": cap, "arch": "sm_" + cap.replace(".", "")}
    if len(fields) >= 5:
        info["sm_clock"], info["sm_clock_max"] = fields[3], fields[4]
    return info


def nvcc_version() -> str | None:
    """The CUDA release nvcc reports, e.g. "13.0", or None without nvcc."""
    text = tool_output([os.environ.get("NVCC", "nvcc"), "--version"])
    m = re.search(r"release (\d+\.\d+)", text or "")
    return m.group(1) if m else None


ARCH_TARGETS = {"sm_80": 80, "sm_90": 90}
"""The onnx-gtco targets named after an arch, by compute capability."""


def arch_target(arch: str) -> str | None:
    """The arch target whose kernels a GPU of `arch` runs: the newest one not newer than it (sm_89 -> sm_80, sm_100
    -> sm_90), or None."""
    num = int(re.sub(r"\D", "", arch) or 0)
    fits = [t for t, n in ARCH_TARGETS.items() if n <= num]
    return max(fits, key=ARCH_TARGETS.__getitem__) if fits else None


def target_for(arch: str, name: str = "") -> str | None:
    """The onnx-gtco target of a GPU named `name` (as nvidia-smi names it) of compute capability `arch`: the GPU's
    own target where onnx-gtco knows it by name (onnx_gtco.config.target_for_gpu: "NVIDIA H200" -> "h200"), so that
    every command plans with its calibration; else the arch target (arch_target: an unknown sm_90 GPU -> "sm_90");
    None for an arch without kernels. Where onnx-gtco does not import in this process (its dependencies come with
    the install row), the arch target."""
    fallback = arch_target(arch)
    if fallback is None or not name:
        return fallback
    try:
        from onnx_gtco.config import TARGETS, target_for_gpu
    except ImportError:
        return fallback
    named = target_for_gpu(name, fallback)
    return named if named is not None and TARGETS[named].arch == fallback else fallback


def target_arch(target: str) -> str:
    """The arch of an onnx-gtco target, what the kernel bench's --arch takes ("h200" -> "sm_90")."""
    if target in ARCH_TARGETS:
        return target
    from onnx_gtco.config import TARGETS  # a GPU's own target comes from target_for, which imported it

    return TARGETS[target].arch


def tree_version() -> str | None:
    """The checkout's commit (with "+dirty" when it has changes), or None outside a git checkout."""
    head = tool_output(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"])
    if not head:
        return None
    dirty = tool_output(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return head.strip() + ("+dirty" if dirty else "")


def read_env_file(path: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables a shell `export NAME=VALUE` file sets, `$NAME` / `${NAME}` expanded against `env` as it grows
    (the bundle's /tmp/gpu-env.sh); other lines are ignored.

    Raises:
        GtcoError: the file cannot be read.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise GtcoError(f"{path}: cannot read it ({e.strerror})") from None
    out: dict[str, str] = {}
    for line in lines:
        m = re.fullmatch(r"\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if m:
            out[m.group(1)] = expand(m.group(2).strip().strip('"').strip("'"), {**env, **out})
    return out


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::\+([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def expand(value: str, scope: dict[str, str]) -> str:
    """`$NAME`, `${NAME}` and `${NAME:+WORD}` (WORD when NAME is set and not empty) of `value`, as a shell does."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if m.group(2) is not None:
            return expand(m.group(2), scope) if scope.get(name) else ""
        return scope.get(name, "")

    return _VAR.sub(sub, value)


def bundle_env(env: dict[str, str], dry_run: bool, setup: Path = BUNDLE_SETUP, env_file: Path = BUNDLE_ENV,
               timeout_s: float = 300.0) -> Step:
    """Take the GPU bundle's environment into `env` (changed in place): run the carried bundle's setup when it has
    not run yet on this machine (a GPU run only), then read its environment file. Skipped without a bundle: the
    machine then has what the run needs installed (or `--wheels` brings it)."""
    t0 = time.monotonic()
    if not env_file.is_file() and setup.is_file() and not dry_run:
        proc = subprocess.run(["bash", str(setup)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()
            return Step("bundle", "failed", f"{setup} exit {proc.returncode}: {tail[-1] if tail else ''}"[:400],
                        round(time.monotonic() - t0, 2))
    if not env_file.is_file():
        return skipped("bundle", f"no {env_file} (no GPU bundle set up here)")
    try:
        values = read_env_file(env_file, env)
    except GtcoError as e:
        return Step("bundle", "failed", str(e), round(time.monotonic() - t0, 2))
    env.update(values)
    return Step("bundle", "ok", "", round(time.monotonic() - t0, 2), str(env_file), {"variables": sorted(values)})


# ------------------------------------------------------------------------------------------------------ install

_IMPORTABLE = r"""
import importlib.util, json, sys
out = {}
for dist, mods in json.loads(sys.argv[1]).items():
    if dist == "onnxruntime_gpu":
        try:
            import onnxruntime
            out[dist] = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        except Exception:
            out[dist] = False
        continue
    try:
        out[dist] = bool(mods) and all(importlib.util.find_spec(m) is not None for m in mods)
    except Exception:
        out[dist] = False
print(json.dumps(out))
"""


def wheel_dist(path: Path) -> str:
    """A wheel's distribution name from its file name, normalized (onnxruntime_gpu-1.31.1-... -> onnxruntime_gpu)."""
    return re.sub(r"[-_.]+", "_", path.name.split("-")[0]).lower()


def wheel_modules(path: Path) -> list[str]:
    """The top-level import names a wheel installs: its top_level.txt, else its top-level packages and modules.

    Raises:
        GtcoError: the file is not a wheel (zip) archive.
    """
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            top = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/top_level\.txt", n)]
            if top:
                return sorted({ln.strip() for ln in z.read(top[0]).decode().splitlines() if ln.strip()})
    except zipfile.BadZipFile:
        raise GtcoError(f"{path}: not a wheel (not a zip archive)") from None
    mods = set()
    for n in names:
        head = n.split("/")[0]
        if head.endswith((".dist-info", ".data")):
            continue
        if "/" in n or head.endswith(".py"):
            mods.add(head.removesuffix(".py"))
    return sorted(m for m in mods if m.isidentifier())


def reassemble_ort_parts(parts_dir: Path, dest_dir: Path) -> Path:
    """Join the `ort-partN` files of `parts_dir` into the wheel its `install-ort-gpu` names and check its sha256.

    `../shared/device/prepare-ort-gpu` writes the parts and that script; the wheel's name, its sha256 and the number
    of parts are read from the script.

    Raises:
        GtcoError: the script is missing or unreadable, a part is missing, or the checksum differs.
    """
    script = parts_dir / "install-ort-gpu"
    try:
        text = script.read_text()
    except OSError as e:
        raise GtcoError(f"{script}: cannot read it ({e.strerror}); run ../shared/device/prepare-ort-gpu") from None
    m_sum = re.search(r'echo "([0-9a-f]{64})  (\S+\.whl)"', text)
    m_n = re.search(r"seq 1 (\d+)", text)
    if not (m_sum and m_n):
        raise GtcoError(f"{script}: no wheel name, sha256 or part count in it; is it prepare-ort-gpu's?")
    digest, name, n = m_sum.group(1), m_sum.group(2), int(m_n.group(1))
    parts = [parts_dir / f"ort-part{i}" for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GtcoError(f"{parts_dir}: missing {', '.join(missing)} of {n} parts: carry them first")
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=dest_dir)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with p.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != digest:
            raise GtcoError(f"{parts_dir}: the joined parts' sha256 is {h.hexdigest()[:12]}..., install-ort-gpu "
                            f"expects {digest[:12]}...: a part is damaged or from another download")
        final = dest_dir / name
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return final


def collect_wheels(dirs: Sequence[Path], work: Path) -> list[Path]:
    """Every wheel of the folders: their `*.whl`, and the onnxruntime-gpu wheel joined from parts where a folder
    holds prepare-ort-gpu's parts.

    Raises:
        GtcoError: a folder is missing, parts are incomplete, or two wheels are versions of one distribution.
    """
    wheels: list[Path] = []
    for d in dirs:
        if not d.is_dir():
            raise GtcoError(f"--wheels {d}: no such folder")
        if (d / "install-ort-gpu").exists() or any(d.glob("ort-part*")):
            wheels.append(reassemble_ort_parts(d, work))
        wheels += sorted(d.glob("*.whl"))
    seen: dict[str, Path] = {}
    for w in wheels:
        other = seen.setdefault(wheel_dist(w), w)
        if other != w and other.name != w.name:
            raise GtcoError(f"two wheels of {wheel_dist(w)}: {other.name} and {w.name}; carry one")
    return list({w.name: w for w in wheels}.values())


def already_importable(wheels: Sequence[Path], env: dict[str, str]) -> dict[str, bool]:
    """Per wheel (by distribution name): whether the steps' Python imports it already, so it is not installed again.

    A wheel is importable when every top-level module it installs is found; onnxruntime-gpu only when onnxruntime
    lists the CUDAExecutionProvider (a CPU-only onnxruntime imports under the same name).
    """
    query = {wheel_dist(w): wheel_modules(w) for w in wheels}
    return probe(_IMPORTABLE, query, env) if query else {}


def run_install(dirs: Sequence[Path], site: Path, out: Path, env: dict[str, str], timeout_s: float) -> Step:
    """The install step: what is not importable yet goes into `site` with pip --no-index --no-deps."""
    t0 = time.monotonic()
    if not dirs:
        return skipped("install", "no --wheels given")
    try:
        wheels = collect_wheels(dirs, out / "wheels")
        present = already_importable(wheels, env)
    except (GtcoError, RuntimeError) as e:
        return Step("install", "failed", str(e), round(time.monotonic() - t0, 2))
    todo = [w for w in wheels if not present.get(wheel_dist(w))]
    detail = {"site": str(site), "already_importable": sorted(d for d, ok in present.items() if ok),
              "installed": [w.name for w in todo]}
    if not todo:
        return Step("install", "ok", "", round(time.monotonic() - t0, 2), None, detail)
    site.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, todo)]
    step = run_command("install", cmd, env=env, timeout_s=timeout_s, log=out / "logs" / "install.log")
    step.detail = detail
    if step.status == "ok":
        now = already_importable(todo, env)
        broken = sorted(d for d, ok in now.items() if not ok)
        if broken:
            step.status, step.reason = "failed", f"installed but not importable: {', '.join(broken)}"
    step.seconds = round(time.monotonic() - t0, 2)
    return step


