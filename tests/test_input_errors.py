"""Inputs a user can get wrong, refused with one clear line before any work: `generate`'s numeric arguments, eos ids,
prompts (one on the meta device too), empty stop strings, tree sizes nothing could hold, and output store files; and
the context rule, which counts only the positions a step can really reach."""

import json

import pytest
import torch

from medusa_like import InvalidTreeError, MedusaLikeModel, OutputStore
from medusa_like.decoding.checks import check_context
from medusa_like.decoding.tree import MAX_DRAFTED_NODES, MAX_TREE_NODES, BudgetedTreeSpec, DynamicTreeSpec, TokenTree
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.lookup_sources import DEFAULT_STORE_TOKENS
from medusa_like.evaluation.prompt_loop import context_overflow
from medusa_like.targets import weights_fingerprint

from .conftest import VOCAB, random_heads, random_prompts, stock_greedy, tiny_target, untouched_target
from .test_lookup import flat_cost


@pytest.fixture(scope="module")
def model():
    """A lookup model with no cost model yet: a call that got past its checks would measure one (target forwards).
    Shared by the tests here, whose one reference comes from an untouched copy of its target, not from it."""
    return MedusaLikeModel(tiny_target("llama"), None, LookupDrafter(), backend="sdpa")


def refused_before_any_work(model, error, match, **kwargs) -> str:
    """Call `generate` with `kwargs` (a 3-token prompt unless given), expect `error` matching `match` in one line,
    with no target forward run (not even a cost model's measurement); return the message."""
    kwargs.setdefault("input_ids", torch.tensor([[1, 2, 3]]))
    calls = []
    handle = model.target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(error, match=match) as caught:
            model.generate(**kwargs)
    finally:
        handle.remove()
    assert calls == [] and model.drafter.state.cost_model is None
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("max_new_tokens", 1.5, TypeError),
        ("max_new_tokens", None, TypeError),
        ("max_new_tokens", "8", TypeError),
        ("max_new_tokens", True, TypeError),
        ("max_new_tokens", 0, ValueError),
        ("temperature", "0.5", TypeError),
        ("temperature", None, TypeError),
        ("temperature", True, TypeError),
        ("temperature", -0.5, ValueError),
        ("top_k", 1.5, TypeError),
        ("top_k", "5", TypeError),
        ("top_k", -1, ValueError),
        ("top_p", "0.9", TypeError),
        ("top_p", 0, ValueError),
        ("top_p", 1.5, ValueError),
        ("seed", 1.5, TypeError),
        ("seed", "0", TypeError),
        ("seed", False, TypeError),
        ("seed", -1, ValueError),
        ("seed", 2**64, ValueError),
        ("max_cache_len", 1.5, TypeError),
        ("max_cache_len", 0, ValueError),
        ("max_cache_len", True, TypeError),
        ("remember", "yes", TypeError),
    ],
)
def test_numeric_arguments_of_the_wrong_type_or_range_are_refused_by_name(model, name, value, error):
    kwargs = {"max_new_tokens": 4, "temperature": 0.5, name: value}
    message = refused_before_any_work(model, error, name, **kwargs)
    assert repr(value) in message


@pytest.mark.parametrize("eos", ["2", 1.5, -1, 97, [1, "2"], [True], {3}])
def test_eos_ids_that_are_not_token_ids_of_the_target_are_refused(model, eos):
    refused_before_any_work(model, (TypeError, ValueError), "eos_token_id", max_new_tokens=4, eos_token_id=eos)


@pytest.mark.parametrize(
    "input_ids, error, match",
    [
        ("hello", TypeError, "input_ids"),
        ([["a", "b"]], TypeError, "input_ids"),
        (torch.tensor([[1, 2], [3, 4]]), ValueError, r"one sequence.*\(2, 2\).*list of prompts"),
        ([[1, 2], "x"], TypeError, "prompt 1 of the batch.*got str"),
        ([[1, 2], []], ValueError, "prompt 1 of the batch.*empty"),
        ([[1, 2], [3, 500]], ValueError, r"prompt 1 of the batch.*\[0, 97\)"),
        (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, "one sequence"),
        (torch.tensor([[1.0, 2.0]]), TypeError, "float32"),
        ([[1, 500]], ValueError, r"\[0, 97\)"),
        ([], ValueError, "empty"),
        (torch.empty(1, 3, dtype=torch.long, device="meta"), ValueError, "on the meta device.*target's device"),
    ],
)
def test_prompts_of_the_wrong_kind_shape_or_ids_are_refused(model, input_ids, error, match):
    refused_before_any_work(model, error, match, input_ids=input_ids, max_new_tokens=4)


@pytest.mark.parametrize("stop_strings", ["", [""], ["ab", ""]])
def test_an_empty_stop_string_is_refused_not_ignored(model, stop_strings):
    """Any text contains "": accepted, it would either stop generation at once or be dropped without a word."""
    message = refused_before_any_work(model, ValueError, "empty string", max_new_tokens=4, stop_strings=stop_strings)
    assert repr(stop_strings) in message and "at once" in message


@pytest.mark.parametrize("tree", ["dinamic", 5, {"depth": 2, "top_k": 2, "nodes": 4}])
def test_unknown_trees_are_refused_in_one_line(model, tree):
    refused_before_any_work(model, (InvalidTreeError, TypeError), "tree", max_new_tokens=4, tree=tree)


# ---------------------------------------------------------------------------------------------------------------------
# Tree sizes and the context rule


@pytest.mark.parametrize(
    "tree, match, limit",
    [
        ({"budgeted": {"num_nodes": 1_000_000_000, "lookup_depth": 8, "learned": None}}, "num_nodes", MAX_TREE_NODES),
        ({"dynamic": {"depth": 4, "top_k": 4, "num_nodes": MAX_TREE_NODES + 1}}, "num_nodes", MAX_TREE_NODES),
        ({"dynamic": {"depth": 1000, "top_k": 1000, "num_nodes": 16}}, "drafts", MAX_DRAFTED_NODES),
        ([[i] for i in range(MAX_TREE_NODES + 1)], "nodes", MAX_TREE_NODES),
    ],
)
def test_a_tree_too_large_for_any_step_is_refused_when_resolved(model, tree, match, limit):
    """A budget or tree nothing could allocate is refused where the spec is made, naming the documented maximum."""
    with pytest.raises(InvalidTreeError, match=match) as caught:
        resolve_tree(tree)
    assert str(limit) in str(caught.value) and "\n" not in str(caught.value)
    refused_before_any_work(model, InvalidTreeError, match, max_new_tokens=4, tree=tree)


def test_the_largest_allowed_trees_are_accepted():
    assert BudgetedTreeSpec(None, MAX_TREE_NODES, 8).max_nodes == MAX_TREE_NODES + 1
    assert DynamicTreeSpec(depth=4, top_k=4, num_nodes=MAX_TREE_NODES).max_nodes == MAX_TREE_NODES + 1
    assert TokenTree.from_paths([[i] for i in range(MAX_TREE_NODES)]).max_nodes == MAX_TREE_NODES + 1


def test_the_context_rule_counts_the_positions_a_step_reaches_not_the_lookup_depth(model):
    """`lookup_depth: 1000` with 16 nodes reaches at most 16 positions past the text: a prompt that fits with 16 is
    run (and lossless), by the loop and by the evaluation's rule alike; one that does not is refused naming 16."""
    target = model.target
    limit = target.config.max_position_embeddings  # 512
    tree = {"budgeted": {"num_nodes": 16, "lookup_depth": 1000, "learned": None}}
    spec = model.resolve_tree(tree)
    prompt = random_prompts(1, seed=3, min_len=limit - 60, max_len=limit - 60)[0]
    assert context_overflow(target, prompt.shape[1], 40, spec) is None
    fresh = MedusaLikeModel(target, None, LookupDrafter(), backend="sdpa")
    fresh.drafter.state.cost_model = flat_cost(target)
    out = fresh.generate(prompt, max_new_tokens=40, tree=tree, eos_token_id=[])
    assert out.new_tokens.tolist() == stock_greedy(untouched_target("llama"), [prompt], 40)[0]  # `model`'s target
    with pytest.raises(ValueError, match=r"16") as caught:
        check_context(target, limit - 40, 30, spec)
    assert "1000" not in str(caught.value)
    deep = resolve_tree({"depth": 12, "top_k": 2, "num_nodes": 30})  # deeper than it is wide: 12 positions
    assert context_overflow(target, limit - 40, 29, deep) is None  # the 29th new token is never read
    assert context_overflow(target, limit - 40, 30, deep) is not None
    assert context_overflow(target, limit, 1, deep) is None  # one new token: the prefill's, no tree step
    assert context_overflow(target, limit + 1, 1, deep) is not None


def test_a_tree_step_may_read_the_last_position_and_never_past_it():
    """GPT-2 reads positions through a table of `n_positions` rows, so a position past it fails. A chain 2 deep whose
    drafts are never accepted runs a step from every new token, the last from the (N - 1)-th, whose nodes then sit at
    the last position: a prompt of exactly the allowed length runs, equal to greedy; one token more is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from medusa_like.targets import freeze

    positions, new, chain = 64, 10, [[0], [0, 0]]
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=positions)

    def build():  # the same weights each time: the second build is the untouched reference
        torch.manual_seed(0)
        return freeze(AutoModelForCausalLM.from_config(config, dtype=torch.float32))

    model = MedusaLikeModel(build(), None, random_heads(num_heads=2, hidden=32, std=3.0), backend="sdpa")
    fits = positions - new + 1 - 2  # prompt + new - 1 + reach == positions
    prompt = random_prompts(1, seed=5, min_len=fits, max_len=fits)[0]
    out = model.generate(prompt, max_new_tokens=new, tree=chain, eos_token_id=[])
    assert out.new_tokens.tolist() == stock_greedy(build(), [prompt], new)[0]
    assert out.stats.target_forwards == new  # nothing accepted: a step from every new token, the last at the edge
    longer = random_prompts(1, seed=5, min_len=fits + 1, max_len=fits + 1)[0]
    with pytest.raises(ValueError, match="max_position_embeddings \\(64\\)"):
        model.generate(longer, max_new_tokens=new, tree=chain, eos_token_id=[])


# ---------------------------------------------------------------------------------------------------------------------
# Output store files


def saved_store(tmp_path, target, documents, **fields):
    store = OutputStore(50, fingerprint=weights_fingerprint(target))
    for doc in documents:
        store.add(doc)
    path = store.save(tmp_path / "store.json")
    if fields:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, **fields}))
    return path


def test_a_store_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        OutputStore.load(tmp_path)


@pytest.mark.parametrize("fingerprinted", [True, False])
def test_a_store_with_token_ids_beyond_the_vocabulary_names_its_file(tmp_path, fingerprinted):
    target = tiny_target("llama")
    path = saved_store(
        tmp_path, target, [[1, 2, 3], [4, 500]], **({} if fingerprinted else {"target_fingerprint": None})
    )
    with pytest.raises(DrafterMismatchError, match=r"store\.json.*500.*97"):
        OutputStore.load(path, target)


@pytest.mark.parametrize("max_tokens", [0, -5, 1.5, "abc", True])
def test_a_store_whose_max_tokens_is_not_a_positive_integer_is_refused(tmp_path, max_tokens):
    """`max_tokens: 0` no longer becomes the default: a store bound is a positive integer."""
    path = saved_store(tmp_path, tiny_target("llama"), [[1, 2]], max_tokens=max_tokens)
    with pytest.raises(ValueError, match=rf"store\.json.*max_tokens.*{max_tokens!r}"):
        OutputStore.load(path)
    with pytest.raises((TypeError, ValueError), match="max_tokens"):
        OutputStore(max_tokens)


def test_a_store_file_without_max_tokens_gets_the_default(tmp_path):
    path = saved_store(tmp_path, tiny_target("llama"), [[1, 2]])
    data = json.loads(path.read_text())
    del data["max_tokens"]
    path.write_text(json.dumps(data))
    assert OutputStore.load(path).max_tokens == DEFAULT_STORE_TOKENS == OutputStore().max_tokens
