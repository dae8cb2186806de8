"""Typed configuration with defaults, ``key.sub=value`` overrides, and validation.

:func:`load_config` merges command-line overrides (OmegaConf dot-list syntax)
into the :class:`Config` defaults, converts the result back to the dataclasses,
and calls :func:`validate`, which raises :class:`ConfigError` naming the keys
involved. Defaults are tuned so ``python -m trainer`` learns the ``repeat``
task in well under a minute on two CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# One size syntax across the project ('256MiB', '40GB'); gpusched imports nothing heavy.
from gpusched.requirements import parse_memory as parse_size
from trainer.cli_help import config_keys, did_you_mean, suggest

ALGOS = ("gae", "grpo", "grpo_no_std", "rloo", "reinforce_pp")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3", "abs")
COLOCATE_CHOICES = ("process", "actor", "none")


class ConfigError(ValueError):
    """A configuration value, or a combination of values, that cannot work."""


AUTO_TIS_CAP = 2.0
"""``rollout.tis_cap``'s value when left to its default with ``rollout.staleness >= 1``
(verl's TIS default): bench/async_learning.py measured k=1 without it."""


@dataclass
class DataConfig:
    task: str = "repeat"
    """Synthetic task used when no files are given: repeat, reverse or add."""
    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files with prompts; empty means the synthetic task."""
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    """Column with the prompt: plain text or a list of chat messages."""
    ground_truth_key: str = "ground_truth"
    """Column with the answer passed to the reward function."""
    max_prompt_length: int = 32
    overlong_prompts: str = "drop"
    """What to do with prompts over max_prompt_length tokens: drop or truncate (keeps the end)."""
    train_batch_size: int = 128
    """Prompts per step (each sampled rollout.n times)."""
    num_train_examples: int = 2048
    num_val_examples: int = 128
    shuffle: bool = True


@dataclass
class ModelConfig:
    path: str = "tiny"
    """A save_pretrained directory, or 'tiny' for the built-in tiny model."""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Episodes of several turns with tool calls (see docs/trainer.md, multi-turn rollouts)."""
    max_turns: int = 4
    """Assistant turns per episode at most (the response budget may end it sooner)."""
    tools: list[str] = field(default_factory=list)
    """Tool classes: package.module:Class or /path/file.py:Class; empty means the task's tools."""
    format: str = "auto"
    """How calls are written: hermes (<tool_call>{json}</tool_call>), compact (~name:a,b), auto."""
    tool_timeout: float = 10.0
    """Seconds a tool call may take before it is abandoned and reported as a timeout."""
    max_concurrency: int = 64
    """Tool calls running at once per worker."""
    max_tool_response_length: int = 0
    """Tokens of one tool result the model sees (the rest is cut); 0 means the task's default."""
    log_trajectories: int = 4
    """Decoded episodes written to <run_dir>/trajectories.jsonl at each validation."""


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """hf (Hugging Face generate) or vllm (vLLM on CPU or CUDA; needs the vllm package)."""
    kv_cache_memory: str = "256MiB"
    """vllm: bytes of KV cache per engine (one per worker), on the card or in host memory:
    '256MiB', '4GiB', '2GB' or a plain number of bytes."""
    max_num_seqs: int = 1024
    """vllm: sequences an engine schedules at once (verl's default); a worker's rows beyond it
    wait for a second wave of decoding."""
    tis_cap: float = -1.0
    """Importance weight cap of the corrected (decoupled) PPO loss: each token's policy loss is
    weighted by min(pi_actor / pi_rollout, tis_cap), pi_rollout being the engine's log-prob of
    the token (vllm, or any engine on a rollout pool of its own). 0 turns it off; negative
    (the default) means 2.0 when batches are generated ahead (rollout.staleness >= 1), where
    the uncorrected loss learned slower and less stably, and off otherwise."""
    tis_mode: str = "truncate"
    """truncate: weight min(ratio, tis_cap); mask: tokens whose ratio exceeds tis_cap get
    weight 0, the others their ratio."""
    tis_level: str = "auto"
    """Whose ratio weighs a token: token (its own) or sequence (its response's: the product
    of its tokens' ratios, which also corrects the prefix and the continuation the reward
    came from). auto (the default) means sequence when batches are generated ahead
    (rollout.staleness >= 1), where the token ratio left k=1 a fifth slower, and token
    otherwise."""
    workers: int = 0
    """Workers on a rollout pool of their own, each with its own engine and copy of the
    policy, pushed to at every step; 0 generates in the actor's workers (colocated)."""
    staleness: int = 0
    """k: batches generated ahead while a step trains (asynchronous RL). 0 is the synchronous
    trainer; k >= 1 needs a rollout pool (rollout.workers=0 then means one worker)."""
    n: int = 8
    """Samples per prompt (a group for GRPO/RLOO)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_length: int = 0
    """New tokens per response; 0 means the task's default."""
    val_temperature: float = -1.0
    """Temperature for validation; negative means the training temperature."""
    val_n: int = 1
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many optimizer steps."""


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Policy optimizer, lr 1e-3. At 3e-3 the policy went near-deterministic
    before it had found every answer and PPO with GAE stalled at 0.7-0.85
    validation reward; at 1e-3 GAE passes 0.9 in 30-35 steps and GRPO in
    35-45 on every seed measured (docs/trainer.md)."""
    ppo_epochs: int = 2
    """Passes over each batch."""
    ppo_mini_batch_size: int = 64
    """Prompts per mini-batch (one optimizer step each)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on one worker; 0 means by micro_batch_tokens."""
    micro_batch_tokens: int = 16384
    """With micro_batch_size=0: tokens (padded rows x length) per forward/backward on one
    worker, so the number of passes follows the work (verl's ppo_max_token_len_per_gpu)."""
    share_prompt: str = "auto"
    """auto, true or false: compute each distinct prompt once for all its responses (a
    prompt pass, then a response pass over its key/value cache); auto shares when
    rollout.n > 1. Same log-probs and gradients as the full pass, fewer tokens."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    strategy: str = "auto"
    """auto (fsdp2 on CUDA, ddp on CPU), fsdp2 (sharded with fully_shard) or ddp (all-reduce)."""
    offload: bool = False
    """FSDP2 on CUDA: keep sharded parameters and optimizer state in host memory."""


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 64
    micro_batch_size: int = 0
    """Sequences per forward/backward on one worker; 0 means by micro_batch_tokens."""
    micro_batch_tokens: int = 16384
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    warmup_steps: int = 0
    """Steps during which only the critic is updated."""
    strategy: str = "auto"
    """auto (fsdp2 on CUDA, ddp on CPU), fsdp2 or ddp; see actor.strategy."""
    offload: bool = False
    """FSDP2 on CUDA: keep sharded parameters and optimizer state in host memory."""


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: str = "fixed"
    """fixed or adaptive."""
    kl_coef: float = 0.001
    target_kl: float = 0.1
    kl_horizon: int = 10000
    grpo_std_eps: float = 1e-6
    """Added to the group's std in algo=grpo's advantage (r - mean) / (std + eps);
    verl's 1e-6. TRL's GRPOTrainer uses 1e-4 (bench/vs_trl.py sets that)."""


@dataclass
class RewardConfig:
    function: str = ""
    """Dotted path or /path/file.py:function; empty means the task's own rule."""
    skip_special_tokens: bool = True
    """Drop special tokens from the response text the reward function reads, as TRL and
    verl decode; false keeps them (padding or role markers then count as text)."""
    score_unfinished: bool = True
    """Score responses cut at the length limit without EOS with the function too, as TRL
    and verl do; false scores them 0 without calling it (an answer that never stopped)."""


@dataclass
class TrainerConfig:
    total_steps: int = 70
    val_every: int = 5
    """Validate every k steps (and after the last); 0 disables."""
    val_before_train: bool = False
    save_every: int = 0
    """Checkpoint every k steps; 0 disables. Every rank writes its own shard
    (torch.distributed.checkpoint); resumable on another number of workers."""
    async_save: str = "auto"
    """auto, true or false. true writes checkpoints in the background: a save returns
    once the state is copied to host memory, the next step runs while it is written,
    and the checkpoint is committed at the next step (a failed write is an error
    there). false writes before the next step starts. auto: true on CUDA workers,
    false on CPU workers, where the background write slows the next step by more
    than it saves (bench/checkpoint_memory.py)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; 0 keeps all."""
    export_final: bool = True
    """At the end of the run, write the policy as a Hugging Face model directory
    (safetensors, config, tokenizer) to <run_dir>/final_model; false skips it
    (python -m trainer.checkpoints.export exports any checkpoint later)."""
    resume: str = "never"
    """never, auto (latest checkpoint in run_dir), or a checkpoint directory."""
    run_dir: str = ""
    """Where metrics, curves and checkpoints go; empty means runs/<timestamp>."""
    num_workers: int = 0
    """Data-parallel workers (Ray actors, one CPU each, plus one GPU each on CUDA);
    0 means auto: every GPU of the Ray cluster on CUDA, 2 on CPU."""
    nnodes: int = 1
    """Nodes each training pool spreads over: num_workers / nnodes worker processes
    on each of nnodes distinct nodes of the Ray cluster. More than 1 needs
    num_workers set to a multiple of it."""
    colocate: str = "process"
    """How the critic shares the actor's workers: process (same processes and group),
    actor (own processes on the same bundles, each with a fraction of the CPU/GPU),
    none (a pool of its own, as many workers again)."""
    ray_num_cpus: int = 0
    """CPUs for the local Ray cluster; 0 means one per worker (on a GPU node with
    auto workers: the node's cores). Unused when RAY_ADDRESS names a cluster to join."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); the CPU default uses gloo. Same as device=cuda."""
    device: str = "auto"
    """cuda, cpu, or auto: cuda when the Ray cluster offers GPUs, cpu when it offers
    none (what the driver's CUDA shows does not matter). NCCL on cuda, gloo on cpu."""
    progress: bool = True
    loggers: list[str] = field(default_factory=list)
    """Experiment trackers besides metrics.jsonl and reward_curve.png (always written):
    any of tensorboard, wandb, mlflow, e.g. [wandb,mlflow]. Each needs its extra
    (pip install 'pytest-gpusched[wandb]'); a missing one is an error at start."""
    tensorboard: bool = True
    """Also TensorBoard when the tensorboard package is installed, without naming it in
    trainer.loggers (which makes it required); false turns that off."""
    project_name: str = "trainer"
    """The W&B project and the MLflow experiment the run is logged under."""
    experiment_name: str = ""
    """The run's name in W&B and MLflow; empty means the run directory's name."""
    stop_at_val_reward: float = 0.0
    """Stop once validation reward reaches this value (0 disables)."""


@dataclass
class Config:
    algo: str = "gae"
    """gae (PPO with critic), grpo, grpo_no_std, rloo, reinforce_pp."""
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def rollout_pool_workers(self) -> int:
        """Workers of the rollout pool: 0 when generation is colocated with the actor."""
        if self.rollout.workers == 0 and self.rollout.staleness > 0:
            return 1
        return self.rollout.workers

    @property
    def importance_cap(self) -> float:
        """``rollout.tis_cap`` with its default resolved: 2.0 with staleness, else 0 (off)."""
        if self.rollout.tis_cap >= 0:
            return self.rollout.tis_cap
        return AUTO_TIS_CAP if self.rollout.staleness > 0 else 0.0

    @property
    def importance_level(self) -> str:
        """``rollout.tis_level`` with ``auto`` resolved: sequence with staleness, else token."""
        if self.rollout.tis_level != "auto":
            return self.rollout.tis_level
        return "sequence" if self.rollout.staleness > 0 else "token"

    @property
    def use_critic(self) -> bool:
        return self.algo == "gae"

    @property
    def device_request(self) -> str:
        """``trainer.device``, with the older ``trainer.use_gpu=true`` meaning ``cuda``."""
        return "cuda" if self.trainer.use_gpu else self.trainer.device

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward


def load_config(overrides: list[str] | None = None, base: dict[str, Any] | None = None) -> Config:
    """Defaults, then ``base`` (a nested dict), then ``key.sub=value`` overrides; validated."""
    schema = OmegaConf.structured(Config)
    try:
        layers = [schema]
        if base:
            layers.append(OmegaConf.create(base))
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(
                    f"override {item!r}: expected key=value (e.g. trainer.total_steps=10)"
                )
            key, value = (part.strip() for part in item.split("=", 1))
            _check_key(key)
            if key in _list_keys() and value and not value.startswith("["):
                item = f"{key}=[{value}]"  # trainer.loggers=wandb: a list of one
            layers.append(OmegaConf.from_dotlist([item]))
        merged = OmegaConf.merge(*layers)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc) from None
    validate(cfg)
    if cfg.trainer.device == "cuda":
        cfg.trainer.use_gpu = True  # GPU bundles in the placement groups
    return cfg


def known_keys() -> list[str]:
    """Every settable dotted key of :class:`Config` (``trainer.total_steps``), in order."""
    return [key.name for key in config_keys(Config())]


def _list_keys() -> frozenset[str]:
    """The keys whose values are lists (``data.train_files``, ``trainer.loggers``)."""
    return frozenset(key.name for key in config_keys(Config()) if key.type.startswith("list"))


def _check_key(key: str) -> None:
    """Raise :class:`ConfigError` naming the nearest keys unless ``key`` is a key or a section."""
    names = known_keys()
    if key in names or any(name.startswith(key + ".") for name in names):
        return
    hint = did_you_mean(suggest(key, names)) or "; python -m trainer --help lists every key"
    raise ConfigError(f"unknown key {key!r}{hint}")


def _omegaconf_error(exc: OmegaConfBaseException) -> ConfigError:
    """OmegaConf's error as one line naming the key (keys given in ``base`` are checked here)."""
    full_key = getattr(exc, "full_key", None)
    message = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if full_key:
        try:
            _check_key(full_key)
        except ConfigError as unknown:
            return unknown
        return ConfigError(f"{full_key}: {message}")
    return ConfigError(f"bad configuration: {message}")


def to_dict(cfg: Config) -> dict[str, Any]:
    """The configuration as plain nested dicts (for logs and checkpoints)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` on any value or combination that cannot work.

    A batch the data-parallel size does not divide is fine: the driver pads it.
    """
    _need(cfg.algo in ALGOS, f"algo={cfg.algo!r}: choose one of {ALGOS}")
    _need(
        cfg.trainer.colocate in COLOCATE_CHOICES,
        f"trainer.colocate={cfg.trainer.colocate!r}: choose one of {COLOCATE_CHOICES}",
    )
    d, r, a, c, t = cfg.data, cfg.rollout, cfg.actor, cfg.critic, cfg.trainer
    _need(d.train_batch_size >= 1, f"data.train_batch_size={d.train_batch_size}: must be >= 1")
    _need(d.max_prompt_length >= 1, f"data.max_prompt_length={d.max_prompt_length}: must be >= 1")
    _need(
        d.overlong_prompts in ("drop", "truncate"),
        f"data.overlong_prompts={d.overlong_prompts!r}: choose 'drop' or 'truncate'",
    )
    _need(
        bool(d.val_files) <= bool(d.train_files),
        "data.val_files is set but data.train_files is empty: give train files too",
    )
    _need(r.n >= 1, f"rollout.n={r.n}: must be >= 1")
    _need(t.keep_checkpoints >= 0, f"trainer.keep_checkpoints={t.keep_checkpoints}: must be >= 0")
    _need(
        str(t.async_save).lower() in ("auto", "true", "false"),
        f"trainer.async_save={t.async_save!r}: choose 'auto', 'true' or 'false'",
    )
    _need(r.val_n >= 1, f"rollout.val_n={r.val_n}: must be >= 1")
    _need(r.temperature >= 0, f"rollout.temperature={r.temperature}: must be >= 0")
    _need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    _need(
        r.max_response_length >= 0,
        f"rollout.max_response_length={r.max_response_length}: must be >= 0",
    )
    _need(r.engine in ("hf", "vllm"), f"rollout.engine={r.engine!r}: choose 'hf' or 'vllm'")
    try:
        parse_size(r.kv_cache_memory)
    except ValueError as e:
        raise ConfigError(f"rollout.kv_cache_memory={r.kv_cache_memory!r}: {e}") from None
    _need(r.max_num_seqs >= 1, f"rollout.max_num_seqs={r.max_num_seqs}: must be >= 1")
    _need(
        cfg.importance_cap == 0 or r.engine == "vllm" or cfg.rollout_pool_workers > 0,
        f"rollout.tis_cap={r.tis_cap} needs the engine's own log-probs: set rollout.engine=vllm, "
        "or rollout.workers >= 1 (a rollout pool)",
    )
    _need(
        r.tis_mode in ("truncate", "mask"),
        f"rollout.tis_mode={r.tis_mode!r}: choose 'truncate' or 'mask'",
    )
    _need(
        r.tis_level in ("auto", "token", "sequence"),
        f"rollout.tis_level={r.tis_level!r}: choose 'auto', 'token' or 'sequence'",
    )
    _need(r.workers >= 0, f"rollout.workers={r.workers}: must be >= 0 (0: colocated)")
    _need(r.staleness >= 0, f"rollout.staleness={r.staleness}: must be >= 0 (0: synchronous)")
    if cfg.algo in ("grpo", "grpo_no_std", "rloo"):
        _need(
            r.n >= 2,
            f"algo={cfg.algo} with rollout.n={r.n}: group baselines need at least 2 samples per prompt",
        )
    # Settings of a role that does not exist are not validated: no critic without algo=gae.
    roles = (("actor", a), ("critic", c)) if cfg.use_critic else (("actor", a),)
    for name, sec in roles:
        _need(sec.ppo_epochs >= 1, f"{name}.ppo_epochs={sec.ppo_epochs}: must be >= 1")
        _need(
            sec.micro_batch_size >= 0,
            f"{name}.micro_batch_size={sec.micro_batch_size}: must be >= 0 (0: by tokens)",
        )
        _need(
            sec.micro_batch_size > 0 or sec.micro_batch_tokens >= 1,
            f"{name}.micro_batch_tokens={sec.micro_batch_tokens} with {name}.micro_batch_size=0: "
            "the token budget must be >= 1",
        )
        _need(sec.optim.lr > 0, f"{name}.optim.lr={sec.optim.lr}: must be > 0")
        _need(
            sec.loss_agg_mode in AGG_MODES,
            f"{name}.loss_agg_mode={sec.loss_agg_mode!r}: choose one of {AGG_MODES}",
        )
        _need(
            1 <= sec.ppo_mini_batch_size <= d.train_batch_size,
            f"{name}.ppo_mini_batch_size={sec.ppo_mini_batch_size} and data.train_batch_size="
            f"{d.train_batch_size}: the mini-batch must be between 1 and the batch size",
        )
        _need(
            d.train_batch_size % sec.ppo_mini_batch_size == 0,
            f"{name}.ppo_mini_batch_size={sec.ppo_mini_batch_size} does not divide "
            f"data.train_batch_size={d.train_batch_size}",
        )
    _need(
        a.kl_loss_type in KL_TYPES,
        f"actor.kl_loss_type={a.kl_loss_type!r}: choose one of {KL_TYPES}",
    )
    _need(
        cfg.algorithm.kl_penalty in KL_TYPES,
        f"algorithm.kl_penalty={cfg.algorithm.kl_penalty!r}: choose one of {KL_TYPES}",
    )
    _need(
        cfg.algorithm.grpo_std_eps > 0,
        f"algorithm.grpo_std_eps={cfg.algorithm.grpo_std_eps}: must be > 0 "
        "(a group whose rewards are all equal has std 0)",
    )
    _need(
        cfg.algorithm.kl_ctrl in ("fixed", "adaptive"),
        f"algorithm.kl_ctrl={cfg.algorithm.kl_ctrl!r}: choose 'fixed' or 'adaptive'",
    )
    _need(
        not (a.use_kl_loss and cfg.algorithm.use_kl_in_reward),
        "actor.use_kl_loss=true and algorithm.use_kl_in_reward=true: choose one way to apply the KL",
    )
    _need(
        cfg.use_critic or c.warmup_steps == 0,
        f"critic.warmup_steps={c.warmup_steps} with algo={cfg.algo}: only algo=gae has a critic",
    )
    _need(
        t.device in ("auto", "cuda", "cpu"),
        f"trainer.device={t.device!r}: choose 'auto', 'cuda' or 'cpu'",
    )
    _need(
        not (t.use_gpu and t.device == "cpu"),
        "trainer.use_gpu=true and trainer.device=cpu: choose one (use_gpu means device=cuda)",
    )
    for name, sec in roles:
        _need(
            sec.strategy in ("auto", "fsdp2", "ddp"),
            f"{name}.strategy={sec.strategy!r}: choose 'auto', 'fsdp2' or 'ddp'",
        )
        _need(
            not sec.offload or sec.strategy != "ddp",
            f"{name}.offload=true with {name}.strategy=ddp: offload needs fsdp2 (or auto on CUDA)",
        )
    _need(
        str(a.share_prompt).lower() in ("auto", "true", "false"),
        f"actor.share_prompt={a.share_prompt!r}: choose 'auto', 'true' or 'false'",
    )
    _validate_multi_turn(cfg)
    _need(t.total_steps >= 1, f"trainer.total_steps={t.total_steps}: must be >= 1")
    _need(t.num_workers >= 0, f"trainer.num_workers={t.num_workers}: must be >= 0 (0 means auto)")
    _need(t.nnodes >= 1, f"trainer.nnodes={t.nnodes}: must be >= 1")
    _need(
        t.nnodes == 1 or (t.num_workers > 0 and t.num_workers % t.nnodes == 0),
        f"trainer.nnodes={t.nnodes}: trainer.num_workers={t.num_workers} must be a multiple "
        "of it (the same number of workers on each node)",
    )
    _need(
        t.ray_num_cpus == 0 or t.ray_num_cpus >= t.num_workers,
        f"trainer.ray_num_cpus={t.ray_num_cpus} < trainer.num_workers={t.num_workers}: "
        "each worker needs one CPU",
    )
    _need(
        t.val_every >= 0 and t.save_every >= 0,
        "trainer.val_every and trainer.save_every must be >= 0",
    )
    _need(
        t.resume in ("never", "auto") or bool(t.resume),
        f"trainer.resume={t.resume!r}: never, auto, or a checkpoint directory",
    )
    _need(
        t.resume == "never" or bool(t.run_dir) or t.resume != "auto",
        "trainer.resume=auto needs trainer.run_dir: set the run directory to resume from",
    )
    _validate_loggers(t)


def _validate_loggers(t: TrainerConfig) -> None:
    """``trainer.loggers``: known names whose packages are installed (checked before Ray starts)."""
    from trainer.logging.trackers import problem

    for name in t.loggers:
        message = problem(name)
        _need(message is None, message or "")
    _need(
        t.tensorboard or "tensorboard" not in t.loggers,
        "trainer.loggers names tensorboard and trainer.tensorboard=false: choose one",
    )
    _need(bool(t.project_name), "trainer.project_name: must not be empty")


def _validate_multi_turn(cfg: Config) -> None:
    """``rollout.multi_turn.*``: ranges, and tasks that need tools only with multi-turn on."""
    mt = cfg.rollout.multi_turn
    _need(mt.max_turns >= 1, f"rollout.multi_turn.max_turns={mt.max_turns}: must be >= 1")
    _need(mt.tool_timeout > 0, f"rollout.multi_turn.tool_timeout={mt.tool_timeout}: must be > 0")
    _need(
        mt.max_concurrency >= 1,
        f"rollout.multi_turn.max_concurrency={mt.max_concurrency}: must be >= 1",
    )
    _need(
        mt.format in ("auto", "hermes", "compact"),
        f"rollout.multi_turn.format={mt.format!r}: choose 'auto', 'hermes' or 'compact'",
    )
    _need(
        mt.max_tool_response_length >= 0,
        f"rollout.multi_turn.max_tool_response_length={mt.max_tool_response_length}: must be >= 0",
    )
    _need(
        mt.log_trajectories >= 0,
        f"rollout.multi_turn.log_trajectories={mt.log_trajectories}: must be >= 0",
    )
    _need(
        mt.enable or not mt.tools,
        "rollout.multi_turn.tools is set but rollout.multi_turn.enable=false: enable multi-turn",
    )
    from trainer.data.tasks import TASKS

    task = TASKS.get(cfg.data.task)
    _need(
        mt.enable or bool(cfg.data.train_files) or task is None or not task.tools,
        f"data.task={cfg.data.task} needs its tools: set rollout.multi_turn.enable=true",
    )
