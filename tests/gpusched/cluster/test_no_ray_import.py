"""Single-node runs are unchanged: without ``--ray`` nothing imports Ray."""

from __future__ import annotations

import subprocess
import sys

from deadlines import hang_guard

from conftest import clean_env, write_suite

PROBE = """
import sys
from gpusched.cli import main
code = main(["run", ".", "--simulate-gpus", "1"])
print("ray imported:", sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
sys.exit(code)
"""


def test_run_without_ray_never_imports_ray(tmp_path):
    write_suite(
        tmp_path,
        {
            "test_a.py": "def test_a():\n    pass\n",
            "test_b.py": "import pytest\n\n@pytest.mark.gpu(1)\ndef test_b():\n    pass\n",
        },
    )
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpusched: 2 passed, 0 failed, 0 skipped" in result.stdout
    assert result.stdout.splitlines()[-1] == "ray imported: []"
