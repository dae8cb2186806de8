"""The vLLM engine's pure parts, tested without vLLM: names, sampling, grouping, selection."""

from __future__ import annotations

import importlib.util
import runpy
import sys

import pytest
import torch

from trainer.rollout import SamplingParams, build_engine
from trainer.rollout.vllm import (
    group_repeated_prompts,
    hf_weight_name,
    require_vllm,
    vllm_sampling_kwargs,
    weights_for_vllm,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("_orig_mod.model.norm.weight", "model.norm.weight"),
        ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("_orig_mod.module.lm_head.weight", "lm_head.weight"),
        (
            "model.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ),
        # "module" inside a model is a real attribute, not a wrapper: kept.
        ("model.vision.module.proj.weight", "model.vision.module.proj.weight"),
    ],
)
def test_wrapper_prefixes_are_stripped_to_hf_names(raw, want):
    assert hf_weight_name(raw) == want


def test_a_name_of_only_wrappers_is_an_error():
    with pytest.raises(ValueError, match="only wrapper prefixes"):
        hf_weight_name("_orig_mod.module")


def test_tied_embeddings_send_the_matrix_once():
    w = torch.zeros(2)
    named = [("_orig_mod.model.embed_tokens.weight", w), ("_orig_mod.lm_head.weight", w)]
    assert [n for n, _ in weights_for_vllm(named, tie_word_embeddings=True)] == [
        "model.embed_tokens.weight"
    ]
    assert [n for n, _ in weights_for_vllm(named, tie_word_embeddings=False)] == [
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]


def test_two_parameters_with_one_hf_name_are_refused():
    named = [("module.lm_head.weight", torch.zeros(1)), ("lm_head.weight", torch.zeros(1))]
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        list(weights_for_vllm(named, tie_word_embeddings=False))


def test_weights_are_yielded_lazily_without_copies():
    w = torch.ones(3)
    gen = weights_for_vllm(iter([("module.a.weight", w)]), False)
    name, t = next(gen)
    assert name == "a.weight" and t is w


def test_sampling_parameters_map_to_vllm():
    got = vllm_sampling_kwargs(SamplingParams(16, temperature=0.7, top_p=0.9, top_k=5), 4, 2)
    assert got == {
        "n": 4,
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "detokenize": False,
        "logprobs": 0,
    }
    off = vllm_sampling_kwargs(SamplingParams(8, temperature=1.0, top_k=0), 1, 2)
    assert off["top_k"] == -1 and off["top_p"] == 1.0 and off["temperature"] == 1.0


def test_greedy_maps_to_temperature_zero_without_truncation():
    got = vllm_sampling_kwargs(SamplingParams(8, temperature=0.0, top_p=0.5, top_k=3), 1, 2)
    assert (got["temperature"], got["top_p"], got["top_k"]) == (0.0, 1.0, -1)
    with pytest.raises(ValueError, match="n .* must be >= 1"):
        vllm_sampling_kwargs(SamplingParams(8), 0, 2)


def test_repeated_prompts_become_n_sample_requests_in_order():
    a, b, c = [5, 6], [7], [5, 6]
    assert group_repeated_prompts([a, a, a, b, b, c]) == [(a, 3), (b, 2), (c, 1)]
    assert group_repeated_prompts([]) == []


@pytest.mark.skipif(HAVE_VLLM, reason="checks the error when vllm is missing; vllm is installed")
def test_selecting_vllm_without_the_package_names_both():
    with pytest.raises(ImportError, match=r"rollout.engine=vllm needs the 'vllm' package"):
        require_vllm()
    with pytest.raises(ImportError, match=r"rollout.engine=vllm needs the 'vllm' package"):
        build_engine("vllm", torch.nn.Linear(1, 1), tokenizer=None, model_path="unused")


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match=r"rollout.engine='sglang'"):
        build_engine("sglang", torch.nn.Linear(1, 1), tokenizer=None)


class _RefuseVllm:
    """A meta-path finder that fails any import of vllm, installed or not."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise AssertionError(f"{name} imported at module level")
        return None


def test_the_trainer_never_imports_vllm_unless_selected(monkeypatch):
    import trainer.rollout.base
    import trainer.rollout.factory
    import trainer.rollout.hf
    import trainer.rollout.vllm
    import trainer.workers.actor

    monkeypatch.setattr(sys, "meta_path", [_RefuseVllm(), *sys.meta_path])
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    # Re-running each module's top level (in a scratch namespace) must not touch vllm.
    for mod in (
        trainer.rollout.base,
        trainer.rollout.factory,
        trainer.rollout.hf,
        trainer.rollout.vllm,
        trainer.workers.actor,
    ):
        runpy.run_path(mod.__file__, run_name="_vllm_import_probe")
    with pytest.raises(AssertionError, match="vllm imported"):
        importlib.import_module("vllm")  # the guard itself works
