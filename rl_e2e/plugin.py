"""The opt-in pytest plugin: Ray with your runtime env, N-rank groups, reports that explain.

Turn it on with one line in the root ``conftest.py``::

    pytest_plugins = ["rl_e2e.plugin"]

(or ``-p rl_e2e.plugin`` in ``addopts``). A repository that does not sees no
fixture, option or header line of it, and nothing of Ray or torch is imported
because of it: those are imported when a fixture runs.

At start-up it applies the NCCL loopback guard (before any test module can
start Ray), resolves its ini options (``rl_e2e.settings``) and builds the
runtime env once, so a bad builder or value is one usage error naming the
option; the header says which runtime env the clusters get and what the guard
decided.

Fixtures (scope in brackets), all prefixed ``e2e_``:

- ``e2e_runtime_env`` [session]: the :class:`~rl_e2e.source.RuntimeEnvSource`
  the clusters are started with. Override it to configure in code: return a
  source, a function of no arguments giving a runtime env dict, or a dict.
- ``e2e_ray_options`` [like ``e2e_ray``]: overrides for every cluster of a
  module (``num_cpus``, ``ray.init`` keywords; default none); override it in a module.
- ``e2e_ray_host_env`` [like ``e2e_ray``]: host variables added while every
  cluster's runtime env is built (default none); override it in a module.
- ``e2e_ray`` [module, or session with ``rl_e2e_ray_scope = session``]: a local
  cluster sealed off from the machine (:func:`rl_e2e.ray_local.local_cluster`).
  Indirect parametrization overrides ``num_cpus``, ``num_gpus``, ``host_env``
  and any ``ray.init`` keyword. Between the tests that share it, the actors and
  placement groups a test left behind are removed; a failing test's report
  carries what the workers logged during it.
- ``e2e_ray_gpu1`` / ``e2e_ray_gpu2``: the same with 1 / 2 GPUs, marked ``gpu1``
  / ``gpu2`` for gpusched, skipped with the reason where the cards are missing.
- ``e2e_ray_job`` [module]: a ``ray start --head`` cluster with token auth
  and ``submit(entrypoint, runtime_env=...)`` for ``ray job submit``.
- ``e2e_distributed`` [function]: ``e2e_distributed(fn, world_size, *args)``
  runs ``fn(rank, world_size, *args)`` on fresh ranks in a gloo group
  (:func:`rl_e2e.distributed.run_distributed`); each rank's output, and on a hang
  each rank's stack, go into the test's report.
- ``e2e_distributed_gpu1`` / ``e2e_distributed_gpu2``: the same over NCCL.

While coverage measures the session (``pytest --cov``, ``coverage run -m
pytest``), what runs in the clusters' workers, the ranks and the submitted jobs
is measured too and merged into the session's data (:mod:`rl_e2e.coverage`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rl_e2e.coverage import check_start_variable, session_coverage
from rl_e2e.distributed import RankLogs, set_rank_preload
from rl_e2e.netguard import GuardDecision, loopback_guard
from rl_e2e.ray_job import JobCluster, JobClusterError, head_cluster
from rl_e2e.ray_local import Leftovers, RayCluster, WorkerLogs, local_cluster
from rl_e2e.runtime_env import describe_runtime_env
from rl_e2e.settings import OPTIONS, Settings, SettingsError, read_settings
from rl_e2e.source import RuntimeEnvSource, source_from_settings
from rl_e2e.untraced_imports import install as install_untraced_imports

__all__ = ["DistributedRunner"]

_SETTINGS = pytest.StashKey[Settings]()
_SOURCE = pytest.StashKey[RuntimeEnvSource]()
_GUARD = pytest.StashKey[GuardDecision]()
_HEADER = pytest.StashKey[list[str]]()
_RANK_LOGS = pytest.StashKey[list[RankLogs]]()
_TEST_CLUSTER = pytest.StashKey["_TestInCluster"]()
_REPORTED = pytest.StashKey[int]()

_CLUSTER_FIXTURES = ("e2e_ray", "e2e_ray_gpu1", "e2e_ray_gpu2")
_CLUSTER_KEYS = ("num_cpus", "num_gpus", "host_env")


# --- start-up: options, guard, runtime env, header --------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    for option in OPTIONS:
        parser.addini(option.name, option.help, type=option.type, default=option.default)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Guard first (Ray may start in any test module), then settle the runtime env."""
    config.stash[_GUARD] = loopback_guard()
    if session_coverage() is not None:
        install_untraced_imports()
    try:
        check_start_variable(os.environ)
        settings = read_settings(config.getini)
        source = source_from_settings(settings)
        runtime_env = source.build()
    except (SettingsError, TypeError, ValueError) as err:
        raise pytest.UsageError(f"rl_e2e: {err}") from None
    config.stash[_SETTINGS] = settings
    config.stash[_SOURCE] = source
    if settings.rank_preload:
        set_rank_preload(settings.rank_preload)
    config.stash[_HEADER] = [
        f"rl_e2e: runtime env from {source.name}: {describe_runtime_env(runtime_env)}",
        f"rl_e2e: loopback guard: {config.stash[_GUARD].describe()}",
    ]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return config.stash.get(_HEADER, [])


# --- the runtime env ----------------------------------------------------------------


def _as_source(value: object) -> RuntimeEnvSource:
    """Accept what an overriding ``e2e_runtime_env`` fixture may return."""
    name = "the e2e_runtime_env fixture"
    if isinstance(value, RuntimeEnvSource):
        return value
    if isinstance(value, Mapping):
        return RuntimeEnvSource.fixed(value, name)
    if callable(value):
        return RuntimeEnvSource(name, value)
    raise TypeError(
        f"{name} must return a RuntimeEnvSource, a function giving a runtime env dict, "
        f"or a dict; got {type(value).__name__}"
    )


@pytest.fixture(scope="session")
def e2e_runtime_env(pytestconfig: pytest.Config) -> RuntimeEnvSource:
    """The runtime env source the ini options configure; override it to configure in code."""
    return pytestconfig.stash[_SOURCE]


# --- Ray clusters -------------------------------------------------------------------


def _ray_scope(fixture_name: str, config: pytest.Config) -> str:
    return config.stash[_SETTINGS].ray_scope if _SETTINGS in config.stash else "module"


@pytest.fixture(scope=_ray_scope)
def e2e_ray_options() -> dict[str, Any]:
    """Overrides for every cluster of a module (none); override it in a module.

    The same keys as an indirect parameter, which wins over these.
    """
    return {}


@pytest.fixture(scope=_ray_scope)
def e2e_ray_host_env() -> dict[str, str]:
    """Host variables set while each cluster's runtime env is built (none); override per module."""
    return {}


def _checked(where: str, param: object) -> dict[str, Any]:
    """A copy of a dict of cluster overrides, or a one-line setup failure naming ``where``."""
    if not isinstance(param, Mapping):
        pytest.fail(
            f"{where}: overrides must be a dict ({', '.join(_CLUSTER_KEYS)} or ray.init "
            f"keywords), got {type(param).__name__}: {param!r}",
            pytrace=False,
        )
    import ray

    accepted = set(_CLUSTER_KEYS) | set(inspect.signature(ray.init).parameters)
    unknown = sorted(str(key) for key in param if key not in accepted)
    if unknown:
        pytest.fail(
            f"{where}: unknown override {', '.join(map(repr, unknown))}: "
            f"use {', '.join(_CLUSTER_KEYS)} or a ray.init keyword",
            pytrace=False,
        )
    return dict(param)


def _overrides(request: pytest.FixtureRequest, host_env: Mapping[str, str]) -> dict[str, Any]:
    """The module's ``e2e_ray_options`` under the indirect parameter (both copied, never
    mutated), with the module's host env under the parameter's."""
    param = getattr(request, "param", None)
    own_gpu_param = request.fixturename != "e2e_ray" and isinstance(param, int)
    if param is None or own_gpu_param:  # the GPU variants' own parameter
        param = {}
    module = _checked("e2e_ray_options", request.getfixturevalue("e2e_ray_options"))
    given = _checked(f"{request.fixturename} (indirect parameter)", param)
    overrides = {**module, **given}
    overrides["host_env"] = {
        **host_env,
        **dict(module.get("host_env") or {}),
        **dict(given.get("host_env") or {}),
    }
    return overrides


def visible_gpus() -> int:
    """CUDA devices this process can use (``CUDA_VISIBLE_DEVICES`` applied); 0 without torch."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _require_gpus(n_gpus: int) -> None:
    visible = visible_gpus()
    if visible < n_gpus:
        pytest.skip(f"needs {n_gpus} CUDA GPU(s), {visible} visible")


def _cluster(request: pytest.FixtureRequest, host_env: Mapping[str, str], num_gpus: int = 0):
    """Start the cluster a cluster fixture yields; bad overrides fail its setup in one line."""
    settings: Settings = request.config.stash[_SETTINGS]
    overrides = _overrides(request, host_env)
    num_gpus = int(overrides.pop("num_gpus", num_gpus) or 0)
    if num_gpus:
        _require_gpus(num_gpus)
    num_cpus = overrides.pop("num_cpus", settings.ray_num_cpus)
    source = _as_source(request.getfixturevalue("e2e_runtime_env"))
    try:
        runtime_env = source.build(overrides.pop("host_env"))
    except (TypeError, ValueError) as err:
        pytest.fail(f"{request.fixturename}: {err}", pytrace=False)
    return local_cluster(runtime_env, num_cpus, num_gpus, **overrides)


@pytest.fixture(scope=_ray_scope)
def e2e_ray(
    request: pytest.FixtureRequest, e2e_ray_host_env: dict[str, str]
) -> Iterator[RayCluster]:
    """A local Ray cluster with the repository's runtime env, sealed off and always shut down.

    An override asking for GPUs (``{"num_gpus": 2}``, with a ``gpu2`` mark on its
    ``pytest.param``) skips before Ray starts where the cards are missing.
    """
    with _cluster(request, e2e_ray_host_env) as cluster:
        yield cluster


@pytest.fixture(scope=_ray_scope, params=[pytest.param(1, marks=pytest.mark.gpu1, id="gpu1")])
def e2e_ray_gpu1(
    request: pytest.FixtureRequest, e2e_ray_host_env: dict[str, str]
) -> Iterator[RayCluster]:
    """``e2e_ray`` with one GPU; skipped without one."""
    with _cluster(request, e2e_ray_host_env, num_gpus=1) as cluster:
        yield cluster


@pytest.fixture(scope=_ray_scope, params=[pytest.param(2, marks=pytest.mark.gpu2, id="gpu2")])
def e2e_ray_gpu2(
    request: pytest.FixtureRequest, e2e_ray_host_env: dict[str, str]
) -> Iterator[RayCluster]:
    """``e2e_ray`` with two GPUs; skipped without two."""
    with _cluster(request, e2e_ray_host_env, num_gpus=2) as cluster:
        yield cluster


@dataclass
class _TestInCluster:
    """A test's view of the shared cluster it runs in: what was there, what it logged."""

    cluster: RayCluster
    before: Leftovers
    worker_logs: WorkerLogs
    removed: list[str] = field(default_factory=list)


@pytest.fixture(autouse=True)
def _e2e_ray_between_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a test that uses a cluster: note what lives there, remove what the test leaves."""
    names = [name for name in _CLUSTER_FIXTURES if name in request.fixturenames]
    if not names:
        yield
        return
    cluster: RayCluster = request.getfixturevalue(names[0])
    test = _TestInCluster(cluster, Leftovers.snapshot(), WorkerLogs(cluster.logs_dir))
    test.worker_logs.mark()
    request.node.stash[_TEST_CLUSTER] = test
    try:
        yield
    finally:
        test.removed = test.before.remove_new(before_kill=cluster.save_coverage)


@pytest.fixture(scope="module")
def e2e_ray_job(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JobCluster]:
    """A ``ray start --head`` cluster with token auth, for ``e2e_ray_job.submit(...)``."""
    settings = pytestconfig.stash[_SETTINGS]
    log = tmp_path_factory.mktemp("ray_job") / "head.log"
    with ExitStack() as stack:
        try:
            cluster = stack.enter_context(head_cluster(log, num_cpus=settings.ray_num_cpus))
        except JobClusterError as err:
            pytest.fail(f"e2e_ray_job: {err}", pytrace=False)
        yield cluster


# --- N-rank process groups ------------------------------------------------------------


@dataclass
class DistributedRunner:
    """What the ``e2e_distributed`` fixtures give: call it to run ``fn`` on N ranks."""

    backend: str
    timeout_s: float
    log_root: Path
    record: Callable[[RankLogs], None] = field(repr=False)
    max_world_size: int | None = None
    runs: int = 0

    def __call__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout_s: float | None = None,
        startup_timeout_s: float | None = None,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

        ``timeout_s`` (default ``rl_e2e_rank_timeout``) counts from the moment
        every rank has joined the group; ``startup_timeout_s`` bounds the
        start-up before it (default
        :data:`rl_e2e.distributed.STARTUP_TIMEOUT_S`). Raises what
        :func:`rl_e2e.distributed.run_distributed` raises; a ``world_size``
        above the cards of a GPU variant is a ``ValueError``.
        """
        __tracebackhide__ = True
        from rl_e2e.distributed import run_distributed

        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ValueError(
                f"world_size={world_size} exceeds the {self.max_world_size} GPU(s) "
                f"this fixture was marked for"
            )
        self.runs += 1
        return run_distributed(
            fn,
            world_size,
            *args,
            backend=self.backend,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            log_dir=self.log_root / f"ranks{self.runs}",
            on_logs=self.record,
            **({} if startup_timeout_s is None else {"startup_timeout_s": startup_timeout_s}),
        )


def _runner(request: pytest.FixtureRequest, tmp_path: Path, backend: str, cards: int | None):
    settings: Settings = request.config.stash[_SETTINGS]
    runs = request.node.stash.setdefault(_RANK_LOGS, [])
    return DistributedRunner(backend, settings.rank_timeout, tmp_path, runs.append, cards)


@pytest.fixture
def e2e_distributed(request: pytest.FixtureRequest, tmp_path: Path) -> DistributedRunner:
    """Run a function on N CPU processes joined in a gloo group."""
    return _runner(request, tmp_path, "gloo", None)


@pytest.fixture(params=[pytest.param(1, marks=pytest.mark.gpu1, id="gpu1")])
def e2e_distributed_gpu1(request: pytest.FixtureRequest, tmp_path: Path) -> DistributedRunner:
    """``e2e_distributed`` over NCCL on one GPU; skipped without one."""
    _require_gpus(1)
    return _runner(request, tmp_path, "nccl", 1)


@pytest.fixture(params=[pytest.param(2, marks=pytest.mark.gpu2, id="gpu2")])
def e2e_distributed_gpu2(request: pytest.FixtureRequest, tmp_path: Path) -> DistributedRunner:
    """``e2e_distributed`` over NCCL on two GPUs; skipped without two."""
    _require_gpus(2)
    return _runner(request, tmp_path, "nccl", 2)


# --- reports ------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Attach the ranks' output, and on failure the Ray workers' logs, to the test's report.

    As report sections of the item (``Captured stdout rank 0 call``, ...), added
    before pytest builds the report: every later report of the test carries
    them too, and pytest's JUnit writer, which reads the teardown report, files
    them under ``system-out`` / ``system-err`` as ``junit_logging`` says.
    """
    settings = item.config.stash.get(_SETTINGS, None)
    if settings is not None:
        runs = item.stash.get(_RANK_LOGS, [])
        for logs in runs[item.stash.get(_REPORTED, 0) :]:
            for key, text in logs.sections(settings.log_bytes):
                item.add_report_section(call.when, key, text)
        item.stash[_REPORTED] = len(runs)
        test = item.stash.get(_TEST_CLUSTER, None)
        failed = call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception)
        if test is not None and failed and call.when in ("setup", "call"):
            logged = test.worker_logs.since_mark(settings.log_bytes)
            if logged:
                item.add_report_section(call.when, "stderr ray worker logs", logged)
        if test is not None and call.when == "teardown" and test.removed:
            item.add_report_section(
                "teardown",
                "stderr e2e leftovers removed from the shared cluster",
                "\n".join(test.removed),
            )
    return (yield)
