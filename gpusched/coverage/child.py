"""In a file's pytest process under a measuring run: measure as pytest-cov does, report nothing.

pytest-cov started measuring before this runs (its ``pytest_load_initial_conftests``)
into ``COVERAGE_FILE``, which the runner set inside the file's own directory, so
no two processes ever share a data file. Here the process:

- writes the manifest: the options pytest-cov resolved (reports, fail-under,
  config file, sources...), which the run's end uses to report once for all;
- turns the file's own report and fail-under check off (one report per run, by
  gpusched, and the file's outcome is its tests' alone);
- saves what it measured when the runner TERMs it (a timeout, Ctrl-C): the
  runner's KILL comes only after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from gpusched.atomic import atomic_write
from gpusched.coverage import COVERAGE_DIR_VARIABLE, MANIFEST


def adopt(config: pytest.Config) -> None:
    """Take over pytest-cov's reporting in this process, if the run measures and it is on."""
    directory = os.environ.get(COVERAGE_DIR_VARIABLE)
    plugin = config.pluginmanager.get_plugin("_cov")
    if not directory or plugin is None:
        return
    controller = getattr(plugin, "cov_controller", None)
    cov = getattr(controller, "cov", None)
    if cov is None:
        return  # --no-cov
    options = plugin.options
    atomic_write(str(Path(directory) / MANIFEST), json.dumps(manifest(config, options, cov)))
    options.cov_report = {}
    options.cov_fail_under = None
    _save_on_term(cov)


def manifest(config: pytest.Config, options: Any, cov: Any) -> dict[str, Any]:
    """What the run's end needs to combine and report as pytest-cov would have."""
    import coverage

    args = [str(arg) for arg in config.invocation_params.args]
    return {
        "coverage": coverage.__version__,
        "file": args[0] if args else "",
        "cwd": os.getcwd(),
        "source": options.cov_source,
        "report": options.cov_report,
        "config": options.cov_config,
        "branch": options.cov_branch,
        "fail_under": options.cov_fail_under,
        "precision": options.cov_precision,
        "append": options.cov_append,
        "no_cov_on_fail": options.no_cov_on_fail,
        "data_file": cov.config.data_file,
    }


def _save_on_term(cov: Any) -> None:
    """On SIGTERM: stop and save the measurement, then do what SIGTERM did before."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        # The runner TERMs the job again while it waits: a second save would cut the first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            cov.stop()
            cov.save()
        except Exception as exc:  # noqa: BLE001 - dying anyway; say why the data is missing
            print(f"gpusched: coverage data not saved: {exc}", file=sys.stderr)
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
