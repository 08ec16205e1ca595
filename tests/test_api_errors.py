"""Bad input to the public API gets a clear error before anything runs: prompts of the wrong type, sampling settings
that cannot work, trees a drafter cannot fill, drafter files whose layer cannot be built."""

import json
import math

import pytest
import torch

from medusa_like import FormatError, InvalidTreeError, MedusaLikeModel, load_drafter, save_drafter
from medusa_like.formats.registry import EAGLE3, KINDS, kind_named

from .conftest import greedy_reference, random_heads, random_prompts, tiny_target


@pytest.fixture(scope="module")
def model():
    return MedusaLikeModel(tiny_target("llama"), None, random_heads(num_heads=2), backend="sdpa")


def test_a_prompt_given_as_a_list_is_the_same_prompt(model):
    prompt = random_prompts(1, seed=1)[0]
    as_list = model.generate(prompt[0].tolist(), max_new_tokens=8, eos_token_id=[])
    assert as_list.new_tokens.tolist() == greedy_reference(model.target, prompt, 8).tolist()


def test_float_token_ids_are_refused_by_name(model):
    with pytest.raises(TypeError, match="integer token ids.*float32"):
        model.generate(torch.tensor([[1.0, 2.0]]), max_new_tokens=4)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0])
def test_temperature_that_is_not_a_finite_non_negative_number_is_refused(model, temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=4, temperature=temperature)


@pytest.mark.parametrize("tree", [[[100000]], [[0], [0, 0], [0, 0, 0]], {"depth": 2, "top_k": 200, "num_nodes": 3}])
def test_a_tree_the_drafter_cannot_fill_is_refused_before_the_prefill(model, tree):
    """A rank beyond the drafter's vocabulary, or a depth beyond its 2 heads: `InvalidTreeError` from the one check,
    before the target runs (a target that counts its forwards shows none)."""
    calls = []
    handle = model.target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(InvalidTreeError):
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, tree=tree)
    finally:
        handle.remove()
    assert calls == []


def test_an_eagle3_config_whose_layer_cannot_be_built_names_the_file(tmp_path):
    target = tiny_target("llama")
    out = save_drafter(EAGLE3.fresh(target), tmp_path / "drafter", target, "tiny")
    config = json.loads((out / "config.json").read_text())
    config["medusa_like"]["config"]["layer"]["num_attention_heads"] = 5  # 32 is not divisible by 5
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="config.json.*cannot be built"):
        load_drafter(out, target)


@pytest.mark.slow
def test_every_registered_kind_builds_a_lossless_drafter_from_its_name():
    """`from_pretrained(drafter=<kind name>)` for every kind of the registry decodes the target's greedy output."""
    target = tiny_target("qwen2")
    prompt = random_prompts(1, seed=9, min_len=6, max_len=6)[0]
    reference = greedy_reference(target, prompt, 12).tolist()
    for name in sorted(KINDS):
        model = MedusaLikeModel.from_pretrained(target, drafter=name, tokenizer=None, backend="sdpa")
        assert model.drafter.kind == name == kind_named(name).name
        assert model.generate(prompt, max_new_tokens=12, eos_token_id=[]).new_tokens.tolist() == reference, name


def test_a_combined_drafter_loads_its_learned_drafter_from_a_directory(tmp_path):
    """`from_pretrained(drafter="combined", learned=<directory>)` merges the saved drafter itself, not a fresh one, and
    decodes the target's greedy output; a learned drafter of a kind that cannot be merged is refused by name."""
    target = tiny_target("llama")
    saved = EAGLE3.fresh(target)
    out = save_drafter(saved, tmp_path / "drafter", target, "tiny")
    model = MedusaLikeModel.from_pretrained(target, drafter="combined", learned=out, backend="sdpa")
    assert model.drafter.kind == "combined" and model.drafter.learned.kind == "eagle3"
    loaded = model.drafter.learned.state_dict()
    # the saved weights, in the dtype the model drafts in (`drafter_dtype`: bf16 on some CPUs)
    assert all(torch.equal(loaded[name], weight.to(loaded[name].dtype)) for name, weight in saved.state_dict().items())
    prompt = random_prompts(1, seed=4, min_len=6, max_len=6)[0]
    reference = greedy_reference(target, prompt, 12).tolist()
    assert model.generate(prompt, max_new_tokens=12, eos_token_id=[]).new_tokens.tolist() == reference
    with pytest.raises(ValueError, match="learned='lookup'.*eagle3.*medusa"):
        MedusaLikeModel.from_pretrained(target, drafter="combined", learned="lookup")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MedusaLikeModel.from_pretrained(target, drafter="combined", learned=tmp_path / "missing")
