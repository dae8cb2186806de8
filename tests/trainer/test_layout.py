"""The trainer's folders are stages: each imports only the stages before it (docs/trainer.md, Modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import trainer

ROOT = Path(trainer.__file__).parent

# Foundations first, as docs/trainer.md lists them; the controller stands apart
# (it needs only the batch helpers) and the entry points come last.
STAGES = [
    "data",
    "algorithms",
    "logging",
    "models",
    "fsdp",
    "cli_help",
    "config",
    "placement",
    "checkpoints",
    "controller",
    "rollout",
    "workers",
    "loop",
    "launch",
    "__main__",
]


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "trainer" or len(parts) == 1:
        return None  # trainer itself: its version only
    return parts[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "trainer":
                found.update(f"trainer.{alias.name}" for alias in node.names)
    return found


def test_every_stage_imports_only_the_stages_before_it():
    rank = {name: i for i, name in enumerate(STAGES)}
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        own = _stage(module)
        if own in (None, "__init__"):
            continue
        assert own in rank, f"{path}: stage {own!r} is not in STAGES (add it where it belongs)"
        for target in _imports(path):
            other = _stage(target)
            if other in (None, own, "__version__", "DISTRIBUTION"):
                continue
            assert other in rank, f"{path} imports {target}: unknown stage {other!r}"
            if rank[other] > rank[own]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)
