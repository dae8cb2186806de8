"""The GitHub Actions workflow in ci/: valid YAML whose commands are real gpusched commands."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deadlines import hang_guard

from gpusched import cli
from gpusched.history import main as history_main
from gpusched.options import resolve
from gpusched.scheduling.shard import MatrixEntry, RunnerClass

WORKFLOW = Path(__file__).resolve().parents[2] / "ci" / "github" / "tests.yml"
SAMPLE = MatrixEntry(RunnerClass(8, 3), 1, 2, ("t.py",), 3.0).to_json((0, 1, 2, 8))


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))


def matrix_fields() -> set[str]:
    """The ``matrix.X`` fields the workflow reads (not ``steps.matrix.outputs``)."""
    return set(re.findall(r"(?<![.\w])matrix\.(\w+)", WORKFLOW.read_text(encoding="utf-8")))


def steps(workflow: dict, job: str) -> list[dict]:
    return workflow["jobs"][job]["steps"]


def gpusched_commands(workflow: dict, job: str) -> list[list[str]]:
    """The gpusched command lines of a job's ``run`` steps, with ${{ matrix.* }} and $VARS filled in."""
    commands = []
    for step in steps(workflow, job):
        text = step.get("run", "")
        text = re.sub(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", lambda m: str(SAMPLE[m.group(1)]), text)
        for name, value in workflow["env"].items():
            text = text.replace(f'"${name}"', value).replace(f"${name}", value)
        for line in text.replace("$(", "\n").replace(")", "\n").splitlines():
            words = shlex.split(line)
            if words and words[0].endswith("gpusched") and "=" not in words[0]:
                commands.append(words[1:])
    return commands


def test_workflow_runs_plan_then_tests_then_report(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    jobs = workflow["jobs"]
    assert list(jobs) == ["plan", "tests", "report"]
    assert jobs["tests"]["needs"] == "plan" and jobs["report"]["needs"] == "tests"
    assert jobs["report"]["if"] == "always()"
    for job in jobs.values():
        for step in job["steps"]:
            if "uses" in step:
                assert re.fullmatch(r"[\w-]+/[\w/-]+@v\d+", step["uses"]), step["uses"]


def test_the_matrix_expression_points_at_the_output_of_gpusched_matrix(workflow):
    jobs = workflow["jobs"]
    assert jobs["tests"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert jobs["plan"]["outputs"]["matrix"] == "${{ steps.matrix.outputs.matrix }}"
    (step,) = [s for s in steps(workflow, "plan") if s.get("id") == "matrix"]
    assert (
        "gpusched matrix" in step["run"]
        and 'echo "matrix=$matrix" >> "$GITHUB_OUTPUT"' in step["run"]
    )
    # Every matrix field the workflow reads is one that `gpusched matrix` writes.
    used = matrix_fields()
    assert used and used <= set(SAMPLE), used - set(SAMPLE)


def test_the_commands_are_accepted_by_gpusched(workflow):
    plan = gpusched_commands(workflow, "plan")
    tests = gpusched_commands(workflow, "tests")
    assert [command[0] for command in plan] == ["matrix"]
    assert [command[0] for command in tests] == ["shard"]
    parser = cli.build_parser()
    for command in plan + tests:
        namespace = parser.parse_args(command)  # raises UsageError on anything unknown
        resolve(vars(namespace), {}, {})  # and every option value is well-formed
    shard = parser.parse_args(tests[0])
    assert shard.run and shard.gpus_per_runner == SAMPLE["gpus"]
    assert (shard.shards, shard.index, shard.runner_sizes) == (2, 1, "0,1,2,8")
    assert shard.junitxml.startswith("reports/") and shard.timeline.startswith("reports/")
    (upload,) = [
        s for s in steps(workflow, "tests") if s.get("name") == "Upload JUnit XML and timeline"
    ]
    assert upload["with"]["path"] == "reports/" and upload["if"] == "always()"
    (publish,) = [s for s in steps(workflow, "report") if "junit" in s.get("uses", "")]
    assert publish["with"]["report_paths"] == "reports/**/junit-*.xml"


def test_the_history_merge_step_is_a_real_command(workflow, tmp_path, capsys):
    (step,) = [s for s in steps(workflow, "report") if "gpusched.history" in s.get("run", "")]
    words = shlex.split(step["run"])
    assert words[:4] == ["python", "-m", "gpusched.history", "merge"]
    out = tmp_path / "merged.json"
    args = ["merge", "-o", str(out), str(tmp_path / "no-such-shard" / "durations.json")]
    assert history_main(args) == 0  # a shard that uploaded nothing is skipped
    assert json.loads(out.read_text(encoding="utf-8")) == {"version": 1, "files": {}}


def test_gpusched_matrix_with_the_workflow_arguments_gives_the_fields_it_reads(workflow, tmp_path):
    (tmp_path / "tests").mkdir()
    for name, gpus in (("test_cpu.py", 0), ("test_one.py", 1), ("test_four.py", 4)):
        marker = f"pytestmark = pytest.mark.gpu({gpus})\n" if gpus else ""
        (tmp_path / "tests" / name).write_text(
            f"import pytest\n{marker}def test_x():\n    pass\n", encoding="utf-8"
        )
    (command,) = gpusched_commands(workflow, "plan")
    done = subprocess.run(
        [sys.executable, "-m", "gpusched", *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=hang_guard(120),
    )
    assert done.returncode == 0, done.stderr
    include = json.loads(done.stdout)["include"]
    assert [(e["name"], e["gpus"]) for e in include] == [
        ("cpu-1of1", 0),
        ("gpu1-1of1", 1),
        ("gpu8-1of1", 8),  # the 4-GPU file runs on the 8-card runner
    ]
    used = matrix_fields()
    assert all(used <= set(entry) for entry in include)


def test_each_shard_job_keeps_the_collection_cache_between_runs(workflow):
    caches = [s for s in steps(workflow, "tests") if s.get("uses", "").startswith("actions/cache@")]
    assert len(caches) == 1
    step = caches[0]["with"]
    assert step["path"] == ".gpusched/collection.json"
    # A fresh key per run (so the newest is saved), restored by its prefix.
    assert step["key"].endswith("${{ github.run_id }}")
    prefix = step["key"].removesuffix("${{ github.run_id }}")
    assert step["restore-keys"].splitlines()[0] == prefix
    for read in ("pyproject.toml", "**/conftest.py"):  # what gpusched's own key reads
        assert read in step["key"]
