"""``python -m trainer [key=value ...]``: train on a local Ray cluster.

Defaults: the tiny built-in model, the ``repeat`` task, PPO with GAE and a
critic, two colocated CPU workers. ``algo=grpo`` trains without a critic.
Writes ``metrics.jsonl`` and ``reward_curve.png`` to the run directory and
prints where they are; ``trainer.loggers=[tensorboard,wandb,mlflow]`` (any of
them, each an extra: ``pip install 'pytest-gpusched[wandb]'``) also logs every
step to those trackers, and TensorBoard is added when its package is installed
unless ``trainer.tensorboard=false``. A chosen tracker whose package is missing
is a configuration error (exit status 2) before Ray starts. A resumed run
continues the same W&B and MLflow runs (their ids are in ``trackers.json``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_e2e import reach
from rl_e2e.reach import ClusterError
from trainer import DISTRIBUTION, __version__
from trainer.cli_help import config_keys, format_keys, section_docs
from trainer.config import Config, ConfigError, load_config, to_dict
from trainer.logging.progress import Progress as _Progress  # a bar on a terminal, else plain lines

USAGE = """usage: python -m trainer [key=value ...]
       python -m trainer --help | --version

Examples:
  python -m trainer                                  PPO (GAE + critic) on the repeat task
  python -m trainer algo=grpo                        GRPO, no critic
  python -m trainer trainer.total_steps=20 seed=1    shorter run, another seed
  python -m trainer data.train_files=[train.parquet] data.val_files=[val.parquet] \\
      reward.function=my_pkg.rewards:score model.path=/models/Qwen2.5-0.5B
  python -m trainer trainer.run_dir=runs/a trainer.save_every=10 trainer.resume=auto

Every key is a field of trainer.config.Config, listed below by section as
key: type = default, with the field's docstring (see docs/trainer.md).
Lists are written key=[a,b]; booleans key=true or key=false.
"""


def help_text() -> str:
    """What ``--help`` prints: USAGE, then every key of :class:`Config` with type, default, help."""
    defaults = Config()
    return f"{USAGE}\n{format_keys(config_keys(defaults), section_docs(defaults))}"


def version_line() -> str:
    """What ``--version`` prints: the installed distribution's version, the same as gpusched's."""
    return f"trainer {__version__} ({DISTRIBUTION})"


#: The variable that names a cluster to join (``ray job submit`` sets it for its driver).
ADDRESS_VARIABLE = "RAY_ADDRESS"

#: Where the end-of-run export (``trainer.export_final``) writes the policy, in the run directory.
FINAL_MODEL_DIR = "final_model"


@dataclass
class RunResult:
    """What a run produced."""

    run_dir: Path
    metrics_path: Path
    curve_path: Path
    history: list[dict[str, float]]
    final_val_reward: float | None
    wall_s: float
    worker_pids: dict[str, list[int]] = field(default_factory=dict)
    """Process id of each rank, per role: colocated roles list the same pids."""
    start_step: int = 0
    """The step training started from: 0, or the resumed checkpoint's step."""


def default_run_dir(cfg: Config) -> Path:
    """``runs/<time>-<algo>-seed<seed>`` under the current directory."""
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algo}-seed{cfg.seed}"


def run(cfg: Config) -> RunResult:
    """Train ``cfg`` and write the run's outputs: on the cluster ``RAY_ADDRESS`` names, else a fresh local one.

    ``ray job submit`` sets ``RAY_ADDRESS`` for its driver, so a submitted
    ``python -m trainer`` joins the cluster it was submitted to. A cluster with
    token authentication is joined with the token Ray's own clients would send
    (``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, or
    ``~/.ray/auth_token``); where there is no cluster at the address, or it wants
    a token that is missing or wrong, :class:`~rl_e2e.reach.ClusterError` says so
    in one line before anything else starts.
    """
    import ray

    # Joining a cluster: is one there, and does it want a token we have? One line if not,
    # before anything slow, instead of Ray's retries (a line a second) and a traceback.
    address = os.environ.get("RAY_ADDRESS")
    target = reach.prepare(address, label=ADDRESS_VARIABLE) if address else None
    # Torch, the tokenizer and the data load in a thread while Ray starts here; bad
    # input (a data file, the reward function) raises from preparing.result(), with
    # Ray shut down before the error reaches the user.
    preparing = _Background(_prepare, cfg, to_dict(cfg))
    try:
        _start_ray(cfg, target, address)
    except Exception:
        preparing.result()  # its error (bad input) first: the user's to fix
        raise
    try:
        return _train(preparing.result(), joined=target)
    finally:
        ray.shutdown()


def _start_ray(cfg: Config, target: str | None, address: str | None) -> None:
    """Join the cluster at ``target`` (checked by ``reach.prepare``), else start a local one."""
    import ray

    from rl_e2e.netguard import apply_loopback_guard
    from rl_e2e.ray_lean import lean_local_node
    from rl_e2e.ray_startup import init_local
    from trainer.launch.runtime_env import get_runtime_env
    from trainer.placement import local_cpus

    apply_loopback_guard()
    common = dict(runtime_env=get_runtime_env(), log_to_driver=False, logging_level="ERROR")
    if target is not None:
        # Submitted with `ray job submit` (or pointed at a cluster on purpose): join it.
        _join(target, address or target, common)
        return
    # Started again where Ray's 30 s deadline for the node to register was missed (a busy machine),
    # without the helper processes a one-run cluster never uses (rl_e2e.ray_lean).
    with lean_local_node(log_to_driver=False):
        init_local(
            lambda: ray.init(
                # "local": a fresh cluster, never the one a `ray start` recorded in
                # ray_current_cluster (a crashed one leaves a stale address that fails this call).
                address="local",
                num_cpus=cfg.trainer.ray_num_cpus or local_cpus(cfg),
                # None: Ray detects this node's GPUs (CUDA_VISIBLE_DEVICES and the driver), and
                # build_worker_groups then plans on them; trainer.device=cpu hides them from Ray.
                num_gpus=0 if cfg.device_request == "cpu" else None,
                include_dashboard=False,
                # No idle workers started ahead for the driver: the run's workers carry its
                # runtime env, so those could never serve them, and they cost CPU while Ray
                # starts.
                _system_config={"prestart_worker_first_driver": False},
                **common,
            )
        )


class _Background:
    """``fn(*args)`` in a thread of its own, started at once; :meth:`result` joins it.

    A daemon thread: an interrupted start (Ctrl-C while Ray starts) does not
    wait for it to finish.
    """

    def __init__(self, fn: Any, *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc

    def result(self) -> Any:
        """What ``fn`` returned, once it has; what it raised is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _join(target: str, address: str, options: dict[str, Any]) -> None:
    """``ray.init`` on the cluster ``reach.prepare`` checked; its late refusals as ClusterError."""
    import ray
    from ray.exceptions import AuthenticationError

    try:
        ray.init(address=target, **options)
    except (ConnectionError, AuthenticationError) as exc:  # it went away since the probe
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"{reach.named(ADDRESS_VARIABLE, address)}: {first}") from None


def run_on_cluster(cfg: Config, *, colocate: bool = True) -> RunResult:
    """Train ``cfg`` on the Ray cluster this process is already connected to.

    The seam for end-to-end tests and for callers that manage Ray themselves:
    nothing is started or shut down except this run's worker processes and
    placement groups, which are released before returning (also on error).
    ``colocate=False`` puts the critic on a pool of its own (see
    :func:`trainer.loop.ppo.build_worker_groups`); the cluster must then have room
    for twice ``trainer.num_workers`` processes.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "run_on_cluster needs a running Ray: call ray.init(...) first, or use run(cfg)"
        )
    return _train(_prepare(cfg), colocate=colocate)


@dataclass
class _Prepared:
    """Inputs checked and loaded before any worker starts."""

    cfg: Config
    run_dir: Path
    model_path: str
    tokenizer: Any
    train: Any
    val: Any
    reward_fn: Any
    max_new_tokens: int
    resume_from: Path | None
    t0: float


def _prepare(cfg: Config, settings: dict[str, Any] | None = None) -> _Prepared:
    """Load tokenizer, data, reward function and resume point; write config.yaml.

    ``settings``: what config.yaml records (``to_dict(cfg)`` taken before Ray
    settles the device and worker count, by default now).
    """
    import torch

    from trainer.checkpoints import store as ckpt
    from trainer.data.prompts import build_datasets
    from trainer.loop.ppo import resolve_reward_fn, response_length
    from trainer.models import load_tokenizer, resolve_model_path
    from trainer.rollout.episodes import tool_schemas

    t0 = time.perf_counter()
    run_dir = Path(cfg.trainer.run_dir) if cfg.trainer.run_dir else default_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    train, val = build_datasets(cfg, tokenizer, tool_schemas(cfg))
    prepared = _Prepared(
        cfg,
        run_dir,
        model_path,
        tokenizer,
        train,
        val,
        resolve_reward_fn(cfg),
        response_length(cfg),
        ckpt.resolve_resume(cfg.trainer.resume, run_dir),
        t0,
    )
    (run_dir / "config.yaml").write_text(_yaml(settings or to_dict(cfg)))
    return prepared


def _train(p: _Prepared, *, colocate: bool = True, joined: str | None = None) -> RunResult:
    """Start the worker groups on the running Ray, fit, write outputs, stop the groups.

    ``joined``: the address of the cluster this run joined; a line then says
    how many workers run on how many of its nodes.
    """
    import ray

    from trainer.checkpoints import store as ckpt
    from trainer.logging.metrics import CURVE_FILE, MetricsLogger, plot_reward_curve, read_metrics
    from trainer.logging.trackers import chosen, open_trackers
    from trainer.loop.ppo import PPOTrainer, build_worker_groups, shutdown_worker_groups
    from trainer.rollout.episodes import TrajectoryLog

    cfg, run_dir, t0 = p.cfg, p.run_dir, p.t0
    logger = None
    progress = None
    groups: dict[str, Any] = {}
    try:
        groups = build_worker_groups(cfg, p.model_path, p.max_new_tokens, colocate=colocate)
        actor, critic = groups["actor"], groups.get("critic")
        infos = {role: ray.get([h.info.remote() for h in g.hosts]) for role, g in groups.items()}
        worker_pids = {role: [info["pid"] for info in found] for role, found in infos.items()}
        if joined is not None:
            nodes = {info["node_id"] for found in infos.values() for info in found}
            pids = {pid for found in worker_pids.values() for pid in found}
            print(
                f"trainer: joined the Ray cluster at {joined}: {len(pids)} worker process(es) "
                f"on {len(nodes)} node(s)",
                flush=True,
            )
        rollout = groups.get("rollout")
        actor.init_model()
        if critic is not None:
            critic.init_model()
        if rollout is not None:
            rollout.init_model()
        trainer = PPOTrainer(
            cfg,
            actor,
            critic,
            p.tokenizer,
            p.train,
            p.val,
            p.reward_fn,
            p.max_new_tokens,
            cfg.trainer.num_workers,
            rollout,
        )
        if cfg.rollout.multi_turn.enable:
            trainer.trajectory_log = TrajectoryLog(run_dir, cfg.rollout.multi_turn.log_trajectories)
        if p.resume_from is not None:
            actor.load_checkpoint(str(p.resume_from))
            if critic is not None:
                critic.load_checkpoint(str(p.resume_from))
            trainer.load_state_dict(ckpt.load_driver_state(p.resume_from))
            print(f"trainer: resumed from {p.resume_from} at step {trainer.step}", flush=True)
        start_step = trainer.step
        trackers = open_trackers(
            chosen(cfg.trainer.loggers, cfg.trainer.tensorboard),
            run_dir,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name or run_dir.resolve().name,
            resume_step=trainer.step,
            config=to_dict(cfg),
        )
        logger = MetricsLogger(run_dir, trackers, resume_step=trainer.step)
        progress = _Progress(
            cfg.trainer.progress and sys.stdout.isatty(), cfg.trainer.total_steps, trainer.step
        )

        def on_step(step: int, metrics: dict[str, float]) -> None:
            metrics["timing/wall"] = time.perf_counter() - t0
            if not logged:  # this process's first row: how long it took to get here
                metrics["timing/startup"] = ready - _process_start()
                logged.append(step)
            logger.log(metrics, step)
            progress.update(step, metrics)
            writer.wait()  # the previous step's background save: committed, or an error here
            every = cfg.trainer.save_every
            if every and step and step % every == 0:
                writer.save(step, trainer.state_dict(), cfg.trainer.async_save)

        writer = _checkpoint_writer(run_dir, actor, critic, cfg.trainer.keep_checkpoints)
        logged: list[int] = []
        ready = time.time()  # the first step starts now
        history = trainer.fit(on_step)
        writer.wait()
        if cfg.trainer.export_final:
            actor.save_model(str(run_dir / FINAL_MODEL_DIR))
    finally:
        if progress is not None:
            progress.close()
        if logger is not None:
            logger.close()
        if groups:
            shutdown_worker_groups(groups)
    if not logger.path.exists():  # resumed into a new run_dir with no step left: no row
        logger.path.write_text("")
    rows = read_metrics(logger.path)
    curve = plot_reward_curve(rows, run_dir / CURVE_FILE, title=f"{cfg.algo}, seed {cfg.seed}")
    vals = [r["val/reward_mean"] for r in rows if r.get("val/reward_mean") is not None]
    return RunResult(
        run_dir,
        logger.path,
        curve,
        history,
        vals[-1] if vals else None,
        time.perf_counter() - t0,
        worker_pids,
        start_step,
    )


def _process_start() -> float:
    """When this process started (seconds since the epoch): ``timing/startup`` counts from it."""
    import psutil

    return psutil.Process().create_time()


def _checkpoint_writer(run_dir: Path, actor: Any, critic: Any, keep: int) -> Any:
    """The driver's checkpoint writer over the actor (and critic) groups: every rank saves."""
    from trainer.checkpoints import store as ckpt

    roles = [g for g in (actor, critic) if g is not None]

    def save_workers(d: str, asynchronous: bool | str) -> bool:
        # Every rank answers whether its write runs in the background (auto: by its device).
        in_flight = [any(group.save_checkpoint(d, asynchronous=asynchronous)) for group in roles]
        return any(in_flight)

    def wait_workers() -> None:
        for group in roles:
            group.wait_checkpoint()

    return ckpt.CheckpointWriter(run_dir, save_workers, wait_workers, keep=keep)


def _yaml(d: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(d))


def main(argv: list[str] | None = None) -> int:
    """Parse overrides, train, print where the outputs are. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(help_text())
        return 0
    if "--version" in args:
        print(version_line())
        return 0
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        result = run(cfg)
    except ClusterError as exc:  # RAY_ADDRESS names no cluster this process can join
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    temp = (
        cfg.rollout.val_temperature if cfg.rollout.val_temperature >= 0 else cfg.rollout.temperature
    )
    last = result.history[-1] if result.history else {}
    if result.history:
        print(
            f"trainer: done: {len(result.history)} steps in {result.wall_s:.1f} s, "
            f"final train reward {last.get('rollout/reward_mean', float('nan')):.3f}",
            flush=True,
        )
    else:
        print(
            f"trainer: done: no training step ran in {result.wall_s:.1f} s (nothing left to "
            f"train: at step {result.start_step} of trainer.total_steps="
            f"{cfg.trainer.total_steps})",
            flush=True,
        )
    if result.final_val_reward is not None:
        print(
            f"trainer: val/reward_mean {result.final_val_reward:.3f} "
            f"(sampled at temperature {temp:g}, {cfg.rollout.val_n} sample(s) per prompt)",
            flush=True,
        )
    print(f"trainer: metrics: {result.metrics_path}", flush=True)
    print(f"trainer: reward curve: {result.curve_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
