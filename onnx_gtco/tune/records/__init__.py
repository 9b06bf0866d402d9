"""Measured tuning records shipped with the package: per arch, the fastest configuration a GPU measured for each
kernel problem, so that `optimize` on any machine builds it without tuning.

The files: `<arch>.json` beside this module (sm_80.json, sm_90.json), or in the folder $GTCO_TUNE_RECORDS_DIR or a
`directory` argument names:

    {"format": 1, "arch": "sm_90", "records": [RECORD, ...]}

one RECORD per kernel problem, filed under its problem key (tasks.Task.problem_key: the task's key without the
template version, so that a record outlives a change of the kernel headers; whether its configuration still fits
is checked when it is used), with the arch, the configuration, the measured median and spread in microseconds,
the GPU, driver and toolchain that measured it, the date, the template version of its kernels and the command that
ran the measurement.

How records are made: a GPU run tunes into a storage (on the GPU machine, `onnx-gtco optimize MODEL --tune-trials N
--storage journal:/x/trials.log`), then `onnx-gtco tune-records merge --storage journal:/x/trials.log` merges the
storage's fastest measured trial of each task into these files (`merge`), keeping the faster record per (arch,
problem) and saying what it added and replaced; the files are then committed. Only trials a GPU measured become
records, never the analytical model's predictions. The files ship empty until a GPU run fills them.

How optimize uses them (tune.apply): per task, a configuration tuned on a GPU in the user's own storage first; else
the record of its problem, where its configuration still fits (`fits`: an implementation offered here, exactly the
family's parameters, the family's check); else the analytical model's pick from the storage, else the family's
default. The report names the source of each task's configuration and why a record was not used.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna

from onnx_gtco.config import TARGETS, TUNE_RECORDS_ENV, tune_records_env
from onnx_gtco.errors import GtcoError
from onnx_gtco.ir.export import write_text_atomic
from onnx_gtco.kernels.select import FAMILIES
from onnx_gtco.tune.search import IMPL_SPACES, check, impls, offered, open_storage, search_space, to_config
from onnx_gtco.tune.tasks import Task, task_from_attrs

FORMAT = 1
SHIPPED_DIR = Path(__file__).resolve().parent
ANALYTICAL = "analytical"  # search.AnalyticalMeasurer.name: its trials are predictions, never records


@dataclass(frozen=True)
class Record:
    """One measured configuration of one kernel problem (see the module docstring)."""

    problem: str
    arch: str
    describe: str
    config: dict[str, Any]
    median_us: float
    spread_us: float = 0.0
    gpu: str = ""
    driver: str = ""
    toolchain: str = ""
    date: str = ""
    template_version: str = ""
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def label(self) -> str:
        """How the report names a configuration taken from this record."""
        return f"shipped record ({self.gpu or 'unknown GPU'}, {self.date or 'undated'})"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> Record:
        """A record as a file holds it; GtcoError naming `where` when it is not one."""
        required = ("problem", "arch", "config", "median_us")
        if not isinstance(data, dict) or any(k not in data for k in required):
            raise GtcoError(f"{where}: a record needs {', '.join(required)}")
        if not isinstance(data["config"], dict):
            raise GtcoError(f"{where}: its config is not an object")
        try:
            median = float(data["median_us"])
        except (TypeError, ValueError):
            raise GtcoError(f"{where}: median_us {data['median_us']!r} is not a number") from None
        if not math.isfinite(median) or median <= 0:
            raise GtcoError(f"{where}: median_us {median} is not a positive time")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(**{k: v for k, v in data.items() if k in known and k != "median_us"}, median_us=median,
                   extra={k: v for k, v in data.items() if k not in known})


def records_dir(directory: str | Path | None = None) -> Path:
    """The folder of record files: `directory`, else $GTCO_TUNE_RECORDS_DIR, else the shipped one."""
    if directory is not None:
        return Path(directory)
    from_env = tune_records_env()
    return Path(from_env) if from_env else SHIPPED_DIR


def path_for(arch: str, directory: str | Path | None = None) -> Path:
    """The record file of `arch`."""
    return records_dir(directory) / f"{arch}.json"


def load(arch: str, directory: str | Path | None = None) -> dict[str, Record]:
    """Problem key -> record, from the file of `arch` ({} when there is none).

    Raises:
        GtcoError: the file is not a records file of this format and arch, or a record is malformed.
    """
    path = path_for(arch, directory)
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GtcoError(f"tuning records {path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("records"), list):
        raise GtcoError(f"tuning records {path}: expected {{\"format\": {FORMAT}, \"arch\": ..., \"records\": "
                        "[...]}")
    if doc.get("arch") != arch:
        raise GtcoError(f"tuning records {path}: its arch is {doc.get('arch')!r}, not {arch!r}")
    out: dict[str, Record] = {}
    for i, data in enumerate(doc["records"]):
        r = Record.from_json(data, f"tuning records {path}, record {i}")
        if r.arch != arch:
            raise GtcoError(f"tuning records {path}, record {i}: arch {r.arch!r} in the file of {arch}")
        if r.problem in out:
            raise GtcoError(f"tuning records {path}: two records of problem {r.problem}")
        out[r.problem] = r
    return out


def save(arch: str, records: Iterable[Record], directory: str | Path | None = None) -> Path:
    """Write the file of `arch` with `records` (sorted by problem), atomically."""
    doc = {"format": FORMAT, "arch": arch,
           "records": [r.to_json() for r in sorted(records, key=lambda r: (r.problem, r.describe))]}
    return write_text_atomic(json.dumps(doc, indent=1) + "\n", path_for(arch, directory))


def fits(task: Task, config: Mapping[str, Any]) -> str | None:
    """Why a record's configuration cannot build `task` now, or None: its implementation must be offered here (a
    CUTLASS record needs the headers and a problem CUTLASS maps), its parameters must be exactly the ones that
    implementation has now (a template that renamed or added one makes the record stale) and pass the family's
    check."""
    choices = impls(task)
    impl = str(config.get("impl", "mma"))
    if impl not in choices:
        why = offered(task).get(impl, "not an implementation of this family")
        return f"its implementation {impl!r} is not offered here: {why}"
    if "impl" in config and not getattr(FAMILIES[task.problem.family], "impls", ()):
        return f"it names an implementation ({impl!r}), which this family's configurations do not have"
    want = set(search_space(task)) if impl == "mma" else set(IMPL_SPACES[impl])
    have = set(config) - {"impl"}
    if have != want:
        parts = [f"lacks {', '.join(sorted(want - have))}" if want - have else "",
                 f"has unknown {', '.join(sorted(have - want))}" if have - want else ""]
        return f"its parameters do not match the kernel's: it {' and '.join(p for p in parts if p)}"
    try:
        why = check(task, config)
    except (KeyError, TypeError, ValueError) as e:
        return f"the family's check cannot read it ({type(e).__name__}: {e})"
    return None if why is None else f"the family's check rejects it: {why}"


def from_storage(url: str) -> list[Record]:
    """The fastest trial a GPU measured of each (arch, problem) in the storage at `url`: one record each. Studies
    of the analytical model, and the shape-generic tuner's micro-kernel studies, give none."""
    _must_exist(url)
    store = open_storage(url)
    best: dict[tuple[str, str], Record] = {}
    for summary in optuna.get_all_study_summaries(store, include_best_trial=False):
        attrs = summary.user_attrs
        if not isinstance(attrs.get("task"), dict):
            continue  # a micro-kernel study (tune.shape_generic), or not ours
        task = task_from_attrs(attrs)
        study = optuna.load_study(study_name=summary.study_name, storage=store)
        measured = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.value is not None and math.isfinite(t.value) and t.user_attrs.get("gpu")
                    and t.user_attrs.get("measurer", ANALYTICAL) != ANALYTICAL]
        if not measured:
            continue
        t = min(measured, key=lambda t: (t.value, t.number))
        done = t.datetime_complete or datetime.datetime.now()
        r = Record(problem=task.problem_key, arch=task.arch, describe=task.describe().rsplit(" (x", 1)[0],
                   config=to_config(t.params), median_us=float(t.value), spread_us=float(t.user_attrs.get(
                       "spread_us", 0.0)), gpu=str(t.user_attrs.get("gpu", "")),
                   driver=str(t.user_attrs.get("driver", "")), toolchain=str(t.user_attrs.get("toolchain", "")),
                   date=done.date().isoformat(), template_version=task.version,
                   command=str(t.user_attrs.get("command", "")))
        key = (r.arch, r.problem)
        if key not in best or r.median_us < best[key].median_us:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r.arch, r.problem))


def _must_exist(url: str) -> None:
    """GtcoError when `url` names a journal or SQLite file that does not exist (opening it would create an empty
    one, which has nothing to merge: a mistyped path)."""
    from onnx_gtco.tune.search import JOURNAL_PREFIX

    path = url[len(JOURNAL_PREFIX):] if url.startswith(JOURNAL_PREFIX) else (
        url[len("sqlite:///"):] if url.startswith("sqlite:///") else None)
    if path is not None and not Path(path).expanduser().is_file():
        raise GtcoError(f"tuning storage {url!r}: {path} does not exist, so it has no trials to merge")


@dataclass
class MergeResult:
    """What merge did: records added (a problem the file had none of), replaced (old, new: the new one faster),
    kept (old, new: the file's was as fast or faster), and the files it wrote."""

    added: list[Record] = field(default_factory=list)
    replaced: list[tuple[Record, Record]] = field(default_factory=list)
    kept: list[tuple[Record, Record]] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)

    def lines(self) -> list[str]:
        """One line per record merged, then the totals, for the command's output."""
        out = [f"added     {r.arch} {r.describe}: {r.median_us:.3f} us on {r.gpu} ({r.date})" for r in self.added]
        out += [f"replaced  {n.arch} {n.describe}: {o.median_us:.3f} us ({o.gpu}, {o.date}) -> {n.median_us:.3f} us "
                f"({n.gpu}, {n.date})" for o, n in self.replaced]
        out += [f"kept      {o.arch} {o.describe}: {o.median_us:.3f} us ({o.gpu}, {o.date}); the storage's "
                f"{n.median_us:.3f} us is not faster" for o, n in self.kept]
        files = ", ".join(str(p) for p in self.written) or "no file changed"
        out.append(f"tune-records: {len(self.added)} added, {len(self.replaced)} replaced, {len(self.kept)} kept; "
                   f"{files}")
        return out


def merge(url: str, directory: str | Path | None = None) -> MergeResult:
    """Merge the storage's measured bests (from_storage) into the record files of `directory` (records_dir),
    keeping the faster record per (arch, problem); writes only the files that change.

    Raises:
        GtcoError: an arch the kernels have no target for, a malformed records file, the storage's errors.
    """
    result = MergeResult()
    by_arch: dict[str, list[Record]] = {}
    for r in from_storage(url):
        by_arch.setdefault(r.arch, []).append(r)
    for arch, new in sorted(by_arch.items()):
        if arch not in TARGETS:
            raise GtcoError(f"the storage has records for {arch}, which is no target ({', '.join(sorted(TARGETS))})")
        have = load(arch, directory)
        changed = False
        for r in new:
            old = have.get(r.problem)
            if old is None:
                result.added.append(r)
            elif r.median_us < old.median_us:
                result.replaced.append((old, r))
            else:
                result.kept.append((old, r))
                continue
            have[r.problem] = r
            changed = True
        if changed:
            result.written.append(save(arch, have.values(), directory))
    return result


__all__ = ["FORMAT", "SHIPPED_DIR", "TUNE_RECORDS_ENV", "MergeResult", "Record", "fits", "from_storage", "load",
           "merge", "path_for", "records_dir", "save"]
