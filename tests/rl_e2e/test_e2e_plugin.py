"""The rl_e2e plugin as a repository meets it: opt-in, its header, its errors, its scopes.

Each test writes a small repository with pytester and runs pytest on it. What
the fixtures do inside Ray and the ranks is proved in ``tests/e2e/`` (this
repository's own use) and ``tests/rl_e2e/test_downstream.py`` (another
repository's, with tests meant to fail and hang).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from deadlines import hang_guard

from rl_e2e.plugin import DistributedRunner
from rl_e2e.settings import OPTIONS, SettingsError, read_settings

pytest_plugins = ["pytester"]

ENABLE = 'pytest_plugins = ["rl_e2e.plugin"]\n'
TRIVIAL = "def test_nothing():\n    assert 1 + 1 == 2\n"


def _ini(pytester: pytest.Pytester, **options: str) -> None:
    lines = "".join(f"{name} = {value}\n" for name, value in options.items())
    pytester.makeini(f"[pytest]\n{lines}")


def _imported(pytester: pytest.Pytester, *args: str) -> set[str]:
    """Top-level modules loaded when a pytest run ends (``sys.modules``; bench/e2e_fixtures.py
    reads the same from ``python -X importtime``)."""
    code = (
        "import sys, pytest\n"
        "rc = pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]])\n"
        "print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
        "sys.exit(rc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=hang_guard(60),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("MODULES ")]
    return set(line.split()[1:])


# --- opt-in ------------------------------------------------------------------------


def test_a_repository_that_does_not_enable_it_sees_nothing_of_it(pytester):
    pytester.makepyfile(test_plain=TRIVIAL)
    result = pytester.runpytest_subprocess("--fixtures", "-v")
    assert "e2e_ray" not in result.stdout.str()
    assert "rl_e2e" not in result.stdout.str()
    result = pytester.runpytest_subprocess("-v")
    result.assert_outcomes(passed=1)
    assert "rl_e2e:" not in result.stdout.str()
    assert not {"ray", "torch", "rl_e2e"} & _imported(pytester)


def test_enabled_it_imports_neither_ray_nor_torch_until_a_fixture_runs(pytester):
    pytester.makeconftest(ENABLE)
    pytester.makepyfile(test_plain=TRIVIAL)
    imported = _imported(pytester)
    assert "rl_e2e" in imported
    assert not {"ray", "torch"} & imported


def test_the_header_names_the_runtime_env_and_the_guards_decision(pytester, monkeypatch):
    monkeypatch.setenv("MYRL_TOKEN", "do-not-print-me")
    monkeypatch.setenv("MYRL_LEVEL", "debug")
    pytester.makeconftest(ENABLE)
    _ini(
        pytester,
        rl_e2e_env_defaults="\n    MYRL_MODE=test\n    TOKENIZERS_PARALLELISM=false",
        rl_e2e_env_forward="MYRL_",
        rl_e2e_env_exclude="MYRL_LEVEL",
    )
    pytester.makepyfile(test_plain=TRIVIAL)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    header = result.stdout.str()
    assert re.search(
        r"rl_e2e: runtime env from the layered runtime env of the rl_e2e_env_\* options: "
        r"env_vars: MYRL_MODE=test MYRL_TOKEN=<redacted> TOKENIZERS_PARALLELISM=false;",
        header,
    ), header
    assert "do-not-print-me" not in header and "MYRL_LEVEL" not in header
    assert re.search(r"rl_e2e: loopback guard: (this host|nothing to do)", header)


def test_the_guard_names_an_interface_that_does_not_exist(pytester, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif0")
    pytester.makeconftest(ENABLE)
    pytester.makepyfile(test_plain=TRIVIAL)
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        ["rl_e2e: loopback guard: *PROBLEM: NCCL_SOCKET_IFNAME=nosuchif0 matches no interface*"]
    )


# --- bad input: one usage error naming the option -------------------------------------

_BUILDERS = """
def a_list():
    return ["not", "a", "dict"]

def a_typo():
    return {"env_var": {"A": "1"}}

def not_strings():
    return {"env_vars": {"A": 1}}
"""


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rl_e2e_runtime_env": "nosuchpkg.mod:build"}, "cannot import 'nosuchpkg.mod'"),
        ({"rl_e2e_runtime_env": "builders:absent"}, "builders has no function 'absent'"),
        ({"rl_e2e_runtime_env": "justaname"}, "must look like package.module:function"),
        ({"rl_e2e_runtime_env": "builders:a_list"}, "must give a dict, got list"),
        ({"rl_e2e_runtime_env": "builders:a_typo"}, "Ray knows no runtime env key 'env_var'"),
        ({"rl_e2e_runtime_env": "builders:not_strings"}, "values must be strings; not so for A"),
        (
            {"rl_e2e_runtime_env": "builders:a_list", "rl_e2e_env_forward": "X_"},
            "set one or the other",
        ),
        ({"rl_e2e_ray_num_cpus": "two"}, "rl_e2e_ray_num_cpus = 'two': not an integer"),
        ({"rl_e2e_ray_num_cpus": "0"}, "rl_e2e_ray_num_cpus = '0': must be >= 1"),
        ({"rl_e2e_ray_scope": "class"}, "must be 'module' or 'session'"),
        ({"rl_e2e_rank_timeout": "-1"}, "rl_e2e_rank_timeout = '-1': must be a number"),
        ({"rl_e2e_env_defaults": "NOEQUALS"}, "'NOEQUALS' is not a NAME=VALUE line"),
        ({"rl_e2e_env_setup_hook": "nodots"}, "must be a dotted path"),
        ({"rl_e2e_env_warm_preload": "torch no-such"}, "'no-such' is not a module name"),
        (
            {"rl_e2e_rank_preload": "tensordict torch."},
            "rl_e2e_rank_preload: 'torch.' is not a module name",
        ),
        (
            {"rl_e2e_runtime_env": "builders:a_list", "rl_e2e_env_warm_preload": "torch"},
            "set one or the other",
        ),
    ],
    ids=lambda value: str(value)[:30] if isinstance(value, str) else None,
)
def test_bad_configuration_is_one_usage_error_naming_the_option(pytester, options, message):
    pytester.makeconftest(ENABLE)
    pytester.makepyfile(builders=_BUILDERS, test_plain=TRIVIAL)
    pytester.syspathinsert()
    _ini(pytester, **options)
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = result.stderr.str()
    assert f"ERROR: rl_e2e: {next(iter(options))}" in errors or "rl_e2e:" in errors, errors
    assert message in errors, errors
    assert "Traceback" not in errors


def test_settings_resolve_without_a_session():
    defaults = {option.name: option.default for option in OPTIONS}
    settings = read_settings(defaults.get)
    assert (settings.ray_scope, settings.ray_num_cpus, settings.layered) == ("module", 2, True)
    with pytest.raises(SettingsError, match="rl_e2e_log_bytes = 'lots'"):
        read_settings({**defaults, "rl_e2e_log_bytes": "lots"}.get)


_RANK_PRELOAD = """
    from rl_e2e.distributed import rank_preload

    def test_the_ini_names_what_the_ranks_fork_server_imports():
        assert rank_preload() == ("json", "xml.dom")
"""


def test_the_rank_preload_ini_option_reaches_the_ranks_fork_server(pytester):
    pytester.makeconftest(ENABLE)
    pytester.makepyfile(test_preload=textwrap.dedent(_RANK_PRELOAD))
    _ini(pytester, rl_e2e_rank_preload="json xml.dom")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


# --- configured in code, and scopes ----------------------------------------------------

_OVERRIDDEN = """
    import pytest

    @pytest.fixture(scope="session")
    def e2e_runtime_env():
        return {"env_vars": {"FROM_CODE": "1"}}

    def test_the_cluster_uses_the_overriding_fixture(e2e_ray):
        assert e2e_ray.runtime_env == {"env_vars": {"FROM_CODE": "1", "ADDED": "yes"}}
        assert e2e_ray.num_cpus == 1

    @pytest.fixture(scope="module")
    def e2e_ray_options():
        return {"num_cpus": 1}

    @pytest.fixture(scope="module")
    def e2e_ray_host_env():
        return {"ADDED": "yes"}
"""

_BAD_PARAMS = """
    import pytest

    @pytest.mark.parametrize("e2e_ray", [{"num_cpu": 4}], indirect=True)
    def test_a_typo_in_an_override(e2e_ray):
        pass

    @pytest.mark.parametrize("e2e_ray", [4], indirect=True)
    def test_an_override_that_is_not_a_dict(e2e_ray):
        pass
"""


def test_a_fixture_override_and_bad_overrides(pytester):
    pytester.makeconftest(ENABLE)
    pytester.makepyfile(
        test_overridden=textwrap.dedent(_OVERRIDDEN), test_bad=textwrap.dedent(_BAD_PARAMS)
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=hang_guard(120))
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*e2e_ray (indirect parameter): unknown override 'num_cpu': use num_cpus, "
            "num_gpus, host_env or a ray.init keyword*",
            "*e2e_ray (indirect parameter): overrides must be a dict*got int: 4*",
        ]
    )


_SESSION_A = """
    import os

    def test_a(e2e_ray):
        open(os.environ["OUT"] + "/a", "w").write(str(e2e_ray.temp_dir))
"""
_SESSION_B = """
    import os

    def test_b(e2e_ray):
        open(os.environ["OUT"] + "/b", "w").write(str(e2e_ray.temp_dir))
"""


@pytest.mark.parametrize(("scope", "same"), [("session", True), ("module", False)])
def test_one_cluster_per_session_on_request(pytester, monkeypatch, scope, same):
    pytester.makeconftest(ENABLE)
    _ini(pytester, rl_e2e_ray_scope=scope, rl_e2e_ray_num_cpus="1")
    pytester.makepyfile(test_a=textwrap.dedent(_SESSION_A), test_b=textwrap.dedent(_SESSION_B))
    monkeypatch.setenv("OUT", str(pytester.path))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=hang_guard(120))
    result.assert_outcomes(passed=2)
    a, b = (pytester.path / "a").read_text(), (pytester.path / "b").read_text()
    assert (a == b) is same


def test_a_gpu_runner_refuses_more_ranks_than_its_cards(tmp_path):
    runner = DistributedRunner("nccl", 60, tmp_path, lambda logs: None, max_world_size=1)
    with pytest.raises(ValueError, match="world_size=2 exceeds the 1 GPU"):
        runner(print, 2)


def test_the_guides_quickstart_works_when_pasted_into_a_fresh_repository(pytester):
    """The two files of docs/e2e.md's Quickstart, as written there, make a passing suite."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "e2e.md").read_text()
    quickstart = page.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", quickstart, re.S):
        name = re.match(r"# (\S+)", block).group(1).rstrip(",")
        files[name] = block
    assert set(files) == {"conftest.py", "tests/test_workers.py"}
    for name, text in files.items():
        (pytester.path / name).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / name).write_text(text)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=hang_guard(120))
    result.assert_outcomes(passed=1)
