"""Drafter kinds: a new kind added the documented way (docs/drafters.md, "Write your own drafter") decodes losslessly
through the public API, and every registered kind reaches its codec and its training module by import."""

import subprocess
import sys

import pytest
import torch

import medusa_like.formats  # noqa: F401  (attaches every weights kind's codec)
from medusa_like import MedusaLikeModel
from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.drafters.kinds import Codec, TrainingFreeKind
from medusa_like.drafters.registry import all_kinds, kind_named, register, trainable_kinds, unregister
from medusa_like.evaluation.setup import load_eval_model
from medusa_like.training.build import module_class
from medusa_like.training.drafter_module import DrafterModule

from .conftest import random_prompts, stock_greedy, tiny_target, untouched_target

# ---------------------------------------------------------------------------------------------------------------------
# A kind defined outside the package: after the current token, propose what followed its latest earlier occurrence,
# then what followed that token, and so on (a bigram read off the sequence itself; no weights, no training)


def follow(history: list[int], depth: int) -> list[int]:
    """The chain of at most `depth` tokens the follower proposes after `history[-1]`."""
    latest = {token: i for i, token in enumerate(history[:-1])}  # token -> its latest position with a successor
    chain, token = [], history[-1]
    while len(chain) < depth and token in latest:
        token = history[latest[token] + 1]
        chain.append(token)
    return chain


class FollowerProposer:
    feature_layers = None  # reads no hidden states (the loop still hands it the last one)
    max_depth = None
    max_rank = None

    def begin(self, prompt_ids, features, root, capacity):
        self.history, self.device = prompt_ids.tolist() + [int(root)], root.device

    def accept(self, tokens, features, bonus):
        self.history += tokens[1:].tolist() + [int(bonus)]

    def propose(self, spec) -> DraftTree:
        chain = follow(self.history, min(spec.max_depth, spec.max_nodes - 1))
        tokens = torch.tensor([self.history[-1], *chain], device=self.device)  # [1 + d]: the root, then the chain
        return DraftTree.from_parents(tokens, torch.arange(-1, len(chain), device=self.device))  # node i's parent i-1


class FollowerDrafter:  # the core protocol alone: no weights, no cost model, nothing learned
    kind = "follower"
    max_depth = None

    def proposer(self, target) -> FollowerProposer:
        return FollowerProposer()

    def check_fits(self, target) -> None:
        pass  # it reads token ids only: it fits any target

    def adapt_tree(self, spec):
        return spec

    def remember(self, tokens: list[int]) -> None:
        pass

    def to(self, device=None, dtype=None) -> "FollowerDrafter":
        return self

    def modules(self):
        return iter(())


FOLLOWER = TrainingFreeKind("follower", lambda target: FollowerDrafter(), "it keeps nothing to save")


@pytest.fixture
def follower():
    """The follower kind registered for one test (the registry is the package's, shared by every test)."""
    register(FOLLOWER)
    yield FOLLOWER
    unregister(FOLLOWER.name)


def accepted_draft_tokens(prompt: list[int], reference: list[int], depth: int, max_new_tokens: int) -> list[int]:
    """Draft tokens the target accepts at each step when the follower proposes and the output is `reference`."""
    accepted, root = [], 0  # `root`: the index in `reference` of the current step's root token
    while root + 1 < max_new_tokens:
        chain = follow(prompt + reference[: root + 1], depth)
        n = 0
        while n < len(chain) and chain[n] == reference[root + 1 + n]:
            n += 1
        accepted.append(n)
        root += n + 1
    return accepted


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_kind_registered_from_outside_the_package_decodes_the_targets_greedy_output(family, follower):
    """`register(KIND)` then `from_pretrained(target, drafter=KIND.name)`: the target's greedy output token for token,
    with the follower's proposals accepted exactly as far as they agree with that output."""
    target = tiny_target(family)
    model = MedusaLikeModel.from_pretrained(target, drafter="follower", tokenizer=None, backend="sdpa")
    assert isinstance(model.drafter, FollowerDrafter)
    spec = model.resolve_tree("dynamic")
    depth = min(spec.max_depth, spec.max_nodes - 1)
    accepted, untouched = [], untouched_target(family)
    for prompt in random_prompts(3, seed=3, min_len=4, max_len=12):
        reference = stock_greedy(untouched, [prompt], 40 + depth)[0]  # past the end: the last step may over-accept
        out = model.generate(prompt, max_new_tokens=40, eos_token_id=[], tree="dynamic")
        assert out.new_tokens.tolist() == reference[:40]
        expected = accepted_draft_tokens(prompt[0].tolist(), reference, depth, 40)
        assert out.stats.accepted_draft == expected
        accepted += expected
    assert sum(accepted) > 0 and 0 in accepted  # the follower was right at some steps and wrong at others


def test_an_unregistered_kind_name_and_a_second_kind_under_a_taken_name_are_refused(follower):
    target = tiny_target("llama")
    with pytest.raises(FileNotFoundError, match=r"'folower' is not a registered drafter kind.*'follower'"):
        MedusaLikeModel.from_pretrained(target, drafter="folower", tokenizer=None)
    assert register(FOLLOWER) is FOLLOWER  # the same kind again: nothing changes
    with pytest.raises(ValueError, match="another drafter kind is registered as 'follower'"):
        register(TrainingFreeKind("follower", lambda target: FollowerDrafter(), "-"))
    with pytest.raises(TypeError, match=r"is not a drafter kind: it lacks \['formats', 'trainable'"):
        register(type("HalfKind", (), {"name": "half", "fresh": lambda target: None})())
    assert "half" not in all_kinds() and kind_named("follower") is FOLLOWER


# ---------------------------------------------------------------------------------------------------------------------
# Every registered kind


@pytest.mark.parametrize("name", sorted(all_kinds()))
def test_every_registered_kind_reaches_its_codec_and_training_module(name, train_cfg):
    """A kind with weights holds its codec and is trained by the `DrafterModule` its training
    config (conf/drafter/<name>.yaml) names; a training-free kind has no formats and refuses files and training."""
    kind = kind_named(name)
    if kind.trainable:
        codec = kind.codec
        assert isinstance(codec, Codec) and kind.formats == codec.formats and kind.formats[0] == "native"
        module = module_class(train_cfg(f"drafter={name}"))
        assert issubclass(module, DrafterModule) and module.kind == name
        assert module.from_config.__func__ is not DrafterModule.from_config.__func__  # it builds itself
    else:
        assert kind.formats == ()
        with pytest.raises(ValueError, match=f"a {name} drafter has no weights to export"):
            kind.export(None, "out", "native", None, "tiny")
        with pytest.raises(
            ValueError, match=rf"drafter.kind={name} needs no training; train one of \['block', 'eagle3'"
        ):
            module_class(train_cfg("drafter=medusa", f"drafter.kind={name}"))


@pytest.mark.slow
def test_a_training_config_whose_module_trains_another_kind_is_refused(train_cfg):
    with pytest.raises(ValueError, match=r"MedusaHeadsModule' \(trains 'medusa'\) does not train drafter.kind=eagle3"):
        module_class(train_cfg("drafter=medusa", "drafter.kind=eagle3"))
    with pytest.raises(ValueError, match=r"drafter.module._target_='medusa_like.nothing.Module' names no importable"):
        module_class(train_cfg("drafter=medusa", "drafter.module._target_=medusa_like.nothing.Module"))


@pytest.mark.slow
def test_reaching_every_kinds_codec_imports_no_training_or_data_code():
    """Drafters and their codecs are inference code: neither pulls in training (Lightning) or data (datasets)."""
    code = (
        "import sys; import medusa_like.formats; from medusa_like.drafters.registry import all_kinds; "
        "[kind.formats for kind in all_kinds().values()]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'datasets', 'hydra') "
        "or m.startswith(('medusa_like.training', 'medusa_like.data'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------------
# The evaluation's choice of how the drafter decodes is `drafter.mode`; `drafter.kind` names a kind in training only


@pytest.mark.slow
def test_the_evaluation_names_its_decoding_mode_drafter_mode_and_refuses_drafter_kind_with_the_new_name(eval_cfg):
    with pytest.raises(ValueError, match="drafter.kind=lookup is now drafter.mode=lookup in the evaluation"):
        load_eval_model(eval_cfg("drafter.kind=lookup"))
    with pytest.raises(ValueError, match="drafter.mode must be combined, learned or lookup, got 'eagle3'"):
        load_eval_model(eval_cfg("drafter.mode=eagle3"))
    model = load_eval_model(eval_cfg("drafter.mode=lookup", "target.tuned_layers=false"))
    assert model.drafter.kind == "lookup"


@pytest.mark.parametrize("name", trainable_kinds())
def test_a_drafter_for_other_weights_of_the_same_architecture_loads_with_a_warning_naming_both(name, tmp_path, caplog):
    """Every kind with weights records which target weights it was made for in its files; loaded onto another
    checkpoint of the same architecture (another seed here: a fine-tune in practice) it loads, lossless still, with
    one warning naming both; onto the weights it was made for, with none, in any dtype (`make run` trains on a bf16
    target and evaluates an fp32 one)."""
    import logging

    from medusa_like.formats import load_drafter, save_drafter
    from medusa_like.targets import weights_identity

    own, other = tiny_target("llama").to(torch.bfloat16), tiny_target("llama", seed=1)
    saved = save_drafter(kind_named(name).fresh(own), tmp_path / name, own, "tiny")
    with caplog.at_level(logging.WARNING, logger="medusa_like.drafters.base"):
        load_drafter(saved, tiny_target("llama"))  # the same weights, in fp32
        assert "trained for target weights" not in caplog.text
        load_drafter(saved, other)
    assert f"trained for target weights {weights_identity(own)}" in caplog.text
    assert f"has weights {weights_identity(other)}" in caplog.text
