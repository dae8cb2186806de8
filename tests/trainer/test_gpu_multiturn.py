"""Multi-turn rollouts on a GPU: the same episode loop over the HF engine on CUDA, and over vLLM.

Every test skips cleanly without CUDA (and the vLLM one without the ``vllm``
package), with a reason that says which. The CPU tests of the loop are in
``test_multiturn.py``; what only a GPU shows is that every tensor the loop
builds lands on the engine's device and that training sees the same
conversation there.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from trainer.config import load_config
from trainer.data.prompts import build_dataset, examples_from_task
from trainer.data.tasks import get_task
from trainer.models import ensure_tiny_model, load_causal_lm, load_tokenizer
from trainer.rollout import SamplingParams, build_engine
from trainer.rollout.episode_loop import MultiTurnRollout
from trainer.rollout.episodes import episode_records, tool_schemas
from trainer.rollout.tools import ToolExecutor, select_parser
from trainer.rollout.tools.lookup import LookupTool
from trainer.workers.compute import response_logits

pytestmark = pytest.mark.gpu1


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("cache")))


def _lookup_prompts(tok, n: int):
    cfg = load_config(["rollout.multi_turn.enable=true", "data.task=lookup"])
    examples = examples_from_task(get_task("lookup").examples(n, seed=0), "lookup")
    data = build_dataset(examples, tok, 32, "drop", "lookup", tool_schemas(cfg))
    prompts, _, extras = data.batch(range(n))
    from trainer.rollout.episodes import attach_tools_kwargs

    return attach_tools_kwargs(prompts, extras)


def test_the_episode_loop_on_cuda_with_the_hf_engine(model_dir):
    _need_cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    tok, model = load_tokenizer(model_dir), load_causal_lm(model_dir).to(device)
    tools = [LookupTool()]
    with ToolExecutor(tools, 5.0, 64) as ex:
        loop = MultiTurnRollout(
            build_engine("hf", model, tok), tok, tools, select_parser("auto", tok, tools), ex, 4, 4
        )
        torch.manual_seed(0)
        out = loop.generate(_lookup_prompts(tok, 64).to(device), SamplingParams(20))
    for key in ("responses", "response_mask", "attention_mask", "position_ids", "finished"):
        assert out[key].device == device, key
    p = out["prompts"].shape[1]
    assert (out["response_mask"].bool() <= out["attention_mask"][:, p:].bool()).all()
    records = episode_records(out)
    assert len(records) == 64 and all(r["turns"] >= 1 for r in records)
    with torch.no_grad():
        logits = response_logits(model, out, temperature=1.0)
        for i in range(4):
            keep = out["attention_mask"][i].bool()
            alone = model(input_ids=out["input_ids"][i][keep].unsqueeze(0)).logits[0].float()
            n = int(keep[p:].sum())
            torch.testing.assert_close(logits[i, :n], alone[-n - 1 : -1], rtol=1e-3, atol=1e-3)


def test_multi_turn_ppo_with_vllm_rollout(trainer_cli, tmp_path):
    _need_cuda()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs the vllm package (pip install -e '.[vllm]' on a CUDA machine)")
    run_dir = tmp_path / "run"
    proc = trainer_cli(
        "rollout.multi_turn.enable=true",
        "data.task=lookup",
        "rollout.engine=vllm",
        "rollout.kv_cache_memory=1GiB",
        "trainer.device=cuda",
        "trainer.num_workers=1",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=3",
        "trainer.val_every=3",
        "trainer.tensorboard=false",
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for key in ("rollout/multi_turn/turns_mean", "rollout/tools/lookup/calls", "actor/pg_loss"):
        assert all(r.get(key) is not None for r in rows), key
    assert (run_dir / "trajectories.jsonl").is_file()
