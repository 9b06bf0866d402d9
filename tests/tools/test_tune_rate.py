"""tools/tune_rate.py: a dry run of the tuner (simulated builds, the analytical model measuring in the runner's
child) that reports the trials per minute of each --jobs value on the same tasks and budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_reports_each_jobs_value(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tune_rate.py"), "--families", "layernorm",
                           "--trials", "3", "--jobs", "1", "3", "--build", "sleep:0.2", "--measure-s", "0",
                           "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, "GTCO_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert [r["jobs"] for r in runs] == [1, 3]
    for r in runs:
        assert r["tasks"] >= 1 and r["trials"] == 3 * r["tasks"] and 0 < r["builds"] <= r["trials"]
        assert r["trials_per_min"] > 0 and r["build_s_median"] >= 0.2 and r["children_started"] == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{runs[0]['tasks']} tasks of vit-b16") and lines[1].startswith("jobs  1:")
    assert " trials/min" in lines[2]
