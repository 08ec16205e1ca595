"""Bad input to the public API gets a clear error before anything runs: prompts of the wrong type, sampling settings
that cannot work, trees a drafter cannot fill, drafter files whose layer cannot be built."""

import json
import math

import pytest
import torch

from medusa_like import FormatError, InvalidTreeError, MedusaLikeModel, load_drafter, save_drafter
from medusa_like.drafters.eagle3 import EAGLE3
from medusa_like.drafters.registry import all_kinds, kind_named

from .conftest import random_heads, random_prompts, stock_greedy, tiny_target, untouched_target


@pytest.fixture(scope="module")
def model():
    """Shared by this file's tests, which only decode or are refused: their references come from an untouched copy
    (`untouched_target("llama")`), never from this model's target, whose layers it swapped."""
    return MedusaLikeModel(tiny_target("llama"), None, random_heads(num_heads=2), backend="sdpa")


def test_a_prompt_given_as_a_list_is_the_same_prompt(model):
    prompt = random_prompts(1, seed=1)[0]
    as_list = model.generate(prompt[0].tolist(), max_new_tokens=8, eos_token_id=[])
    assert as_list.new_tokens.tolist() == stock_greedy(untouched_target("llama"), [prompt], 8)[0]


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
    reference = stock_greedy(untouched_target("qwen2"), [prompt], 12)[0]
    for name in sorted(all_kinds()):
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
    reference = stock_greedy(untouched_target("llama"), [prompt], 12)[0]
    assert model.generate(prompt, max_new_tokens=12, eos_token_id=[]).new_tokens.tolist() == reference
    with pytest.raises(ValueError, match="learned='lookup'.*eagle3.*medusa"):
        MedusaLikeModel.from_pretrained(target, drafter="combined", learned="lookup")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MedusaLikeModel.from_pretrained(target, drafter="combined", learned=tmp_path / "missing")


def test_an_empty_prompt_is_called_empty_whatever_its_form(model):
    for empty in ([[]], [], torch.zeros(1, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="the prompt is empty"):
            model.generate(empty, max_new_tokens=4)


@pytest.mark.parametrize("dtype", ["float99", "nn", "int8", 5])
def test_a_target_dtype_that_is_not_a_floating_dtype_is_refused_by_name(dtype):
    with pytest.raises(ValueError, match=f"dtype {dtype!r}: expected a floating torch dtype"):
        MedusaLikeModel.from_pretrained("no/such-target", dtype=dtype)


def test_dtype_or_device_for_a_loaded_model_are_refused_unless_it_already_has_them():
    """A loaded model is used as it is: asking for another dtype or device is an error, not ignored; asking for the
    ones it has, or "auto", is accepted."""
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 for a model already loaded in torch.float32"):
        MedusaLikeModel.from_pretrained(target, dtype=torch.bfloat16, tuned_layers=False)
    with pytest.raises(ValueError, match="device='meta' for a model already on cpu"):
        MedusaLikeModel.from_pretrained(target, device="meta", tuned_layers=False)
    for dtype, device in (("float32", "cpu"), ("auto", None), (torch.float32, torch.device("cpu"))):
        model = MedusaLikeModel.from_pretrained(target, dtype=dtype, device=device, tuned_layers=False)
        assert model.target is target and model.target.dtype == torch.float32


@pytest.mark.parametrize("drafter", [5, object(), 1.5])
def test_a_drafter_that_is_no_drafter_is_refused_by_what_is_expected(drafter):
    with pytest.raises(TypeError, match="expected a drafter kind's name"):
        MedusaLikeModel.from_pretrained(tiny_target("llama"), drafter=drafter, tuned_layers=False)


@pytest.mark.parametrize("depth", [0, -3, 2.5, True])
def test_a_lookup_depth_that_is_not_a_positive_integer_is_refused(depth):
    with pytest.raises(ValueError, match="lookup_depth: expected a positive integer"):
        MedusaLikeModel.from_pretrained(tiny_target("llama"), drafter="lookup", lookup_depth=depth, tuned_layers=False)


def test_chat_ids_without_a_tokenizer_says_to_pass_one(model):
    with pytest.raises(ValueError, match="chat_ids needs the target's tokenizer"):
        model.chat_ids([{"role": "user", "content": "hello"}])


@pytest.mark.parametrize(
    "family, fields, lacks",
    [
        ("phi3", {}, "layers\\[0\\].self_attn.q_proj"),  # fused qkv_proj
        ("olmo2", {}, "layers\\[0\\].input_layernorm"),  # norms after attention and MLP only
        ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}, "layers, norm, rotary_emb"),
    ],
)
def test_an_eagle3_drafter_for_a_family_without_llamas_layout_says_what_it_lacks(family, fields, lacks):
    """Refused at construction with the parts the family lacks, and what to use instead (before: an AttributeError
    from inside the layer's construction); lookup on the same target stays lossless."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from medusa_like.targets import freeze

    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)  # fmt: skip
    config = AutoConfig.for_model(family, **(base if not fields else {"vocab_size": 97, **fields}))

    def build():  # the same weights each time: the second build is the untouched reference
        torch.manual_seed(0)
        return freeze(AutoModelForCausalLM.from_config(config, dtype=torch.float32))

    target = build()
    for kind in ("eagle3", "combined"):
        with pytest.raises(ValueError, match=f"the {family} model lacks {lacks}.*use drafter='lookup' or 'medusa'"):
            MedusaLikeModel.from_pretrained(target, drafter=kind, tuned_layers=False)
    prompt = random_prompts(1, seed=3)[0]
    lookup = MedusaLikeModel.from_pretrained(target, drafter="lookup", tuned_layers=False)
    out = lookup.generate(prompt, max_new_tokens=8, eos_token_id=[])
    assert out.new_tokens.tolist() == stock_greedy(build(), [prompt], 8)[0]


def test_the_loop_given_a_tree_name_says_where_names_are_resolved(model):
    from medusa_like import speculative_generate

    prompt = random_prompts(1, seed=2)[0]
    for tree in ("dynamic", {"depth": 2, "top_k": 2, "num_nodes": 3}, [[0]]):
        with pytest.raises(TypeError, match="the loop takes a tree spec.*resolve_tree"):
            speculative_generate(model.target, model.proposer(), prompt, tree, 4)
    spec = model.resolve_tree([[0], [0, 0]])
    out = speculative_generate(model.target, model.proposer(), prompt, spec, 8)
    assert out.new_tokens.tolist() == stock_greedy(untouched_target("llama"), [prompt], 8)[0]


def test_numpy_integer_ranks_are_ranks(model):
    import numpy as np

    prompt = random_prompts(1, seed=4)[0]
    as_numpy = model.generate(
        prompt, max_new_tokens=8, tree=[[np.int64(0)], [np.int32(0), np.int64(1)]], eos_token_id=[]
    )
    resolved = model.resolve_tree([[np.int64(0)], [0, np.int64(1)]])
    assert resolved.paths == [(0,), (0, 1)] and all(type(r) is int for path in resolved.paths for r in path)
    assert as_numpy.new_tokens.tolist() == stock_greedy(untouched_target("llama"), [prompt], 8)[0]
