"""The CUDA paths: decoding with every drafter kind on the GPU (fp32 and bf16 targets, static and dynamic trees),
on the eager step and on the compiled one (Inductor with CUDA graphs), and a bf16 training run of each trainable
drafter. Skipped without CUDA (CI never has a GPU); the decoding tests' bodies take the device as an argument, and
tests/test_compiled.py runs the same checks on the CPU's compiled step.

What is asserted is what holds: in fp32 the output equals transformers' greedy output on an untouched copy of the
target, token for token; in bf16 it equals it, or differs first where the untouched target's own logits put the two
tokens within a few bf16 steps of each other (a near-tie: the tree's forward over several nodes and greedy's over one
round differently, so it can flip; a bug gives a wide margin). Every drafter's drafts must be accepted somewhere, so
that the accepting paths, not only the all-rejected one, are what is compared."""

import json
import math

import pytest
import torch

from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.drafters.combined import CombinedDrafter
from medusa_like.drafters.eagle3 import EAGLE3
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.forward import prepare_target
from medusa_like.forward.compiled import CompiledStep
from medusa_like.model import MedusaLikeModel

from .conftest import (
    assert_greedy_or_near_tie,
    greedy_reference,
    random_heads,
    random_prompts,
    tiny_target,
    untouched_target,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


NEW_TOKENS = 20


@pytest.fixture
def true_fp32(monkeypatch):
    """fp32 products in fp32: no TF32, whatever a library or an earlier test set."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def drafters_on(target) -> list:
    """(drafter, tree) runs whose drafts a tiny target accepts: random Medusa heads, an EAGLE-3 drafter started from
    the target's last layer and head (often right: accepted paths of several nodes), lookup, and the combined tree."""
    eagle3 = EAGLE3.fresh(target)
    eagle3.init_layer_from_target(target, target.config.num_hidden_layers - 1)
    eagle3.init_from_target(target)
    heads = random_heads()
    return [
        (heads, "small"),
        (heads, "chain"),
        (eagle3, DynamicTreeSpec(4, 3, 10)),
        (LookupDrafter(), "dynamic"),
        (CombinedDrafter(eagle3, LookupDrafter()), "dynamic"),
    ]


def assert_lossless_and_accepted(prepared, family: str, dtype: torch.dtype, device: str) -> None:
    """Every run of `drafters_on` decodes 6 random prompts to transformers' greedy tokens of an untouched copy (up to
    near-ties in bf16), on `prepared`'s step, each drafter with drafts accepted."""
    untouched = untouched_target(family, dtype=dtype).to(device)
    prompts = [p.to(device) for p in random_prompts(6, seed=3)]
    references = [greedy_reference(untouched, p, NEW_TOKENS).tolist() for p in prompts]
    runs = drafters_on(prepared.target)
    accepted = {drafter.kind: 0 for drafter, _ in runs}
    for drafter, tree in runs:
        model = MedusaLikeModel(prepared, None, drafter)
        for prompt, reference in zip(prompts, references, strict=True):
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=tree, eos_token_id=[], remember=False)
            assert_greedy_or_near_tie(untouched, prompt, out.new_tokens.tolist(), reference)
            accepted[drafter.kind] += sum(out.stats.accepted_draft)
    assert all(accepted.values()), f"drafts accepted per drafter: {accepted} (0: only the all-rejected path tested)"


def eager_lossless(family: str, dtype: torch.dtype, device: str) -> None:
    target = tiny_target(family).to(device, dtype)
    assert_lossless_and_accepted(prepare_target(target, backend="sdpa"), family, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_every_drafter_is_lossless_on_cuda_with_drafts_accepted(family, dtype, true_fp32):
    eager_lossless(family, dtype, "cuda")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_compiled_cuda_step_with_cuda_graphs_is_lossless_with_drafts_accepted(family, true_fp32):
    """The compiled step on CUDA (Inductor, CUDA graphs: `forward/platform.py`) compiles, replays its graphs with
    every tree width the drafters ask for, and stays lossless; a failed compile would fall back to eager for good
    (equal tokens, nothing tested), so the step must still be the compiled one at the end."""
    target = tiny_target(family).to("cuda")
    prepared = prepare_target(target, tuned_layers=False, compile=True)
    assert isinstance(prepared.step, CompiledStep) and "CUDA graphs" in prepared.step.label
    assert_lossless_and_accepted(prepared, family, torch.float32, "cuda")
    assert prepared.step.failed is None and prepared.step is prepared.compiled


@pytest.mark.parametrize("drafter", ["medusa", "eagle3"])
def test_bf16_training_on_cuda(drafter, tmp_path, train_cfg):
    from train.train import train

    chats = tmp_path / "chats.jsonl"
    rows = [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": f"Count to {i}."},
                {"role": "assistant", "content": " ".join(map(str, range(i + 3)))},
            ],
        }
        for i in range(24)
    ]
    chats.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = train_cfg(
        "data=local",
        f"data.source={chats}",
        "data.recipe=original",
        "data.val_fraction=0.25",
        f"drafter={drafter}",
        "trainer=gpu",
        "trainer.precision=bf16-mixed",
        "trainer.max_epochs=2",
    )
    metrics = train(cfg)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    keys = [f"val/loss_head{k}" for k in range(1, 5)] if drafter == "medusa" else ["val/loss_depth1", "val/loss"]
    keys += ["val/acc_top1_head1" if drafter == "medusa" else "val/acc_top1_depth1"]
    for key in keys:  # named metrics: an empty or renamed metrics dict fails here
        assert key in metrics and math.isfinite(metrics[key]), (key, sorted(metrics))
    assert 0 <= metrics[keys[-1]] <= 1 and metrics[keys[0]] > 0
