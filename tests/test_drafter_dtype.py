"""What a learned drafter computes in (`PreparedTarget.drafting_dtype`): bf16 where that makes a drafting level cheaper,
the target's greedy output whatever the drafter's dtype, and a clear error where a drafter cannot leave the target's."""

import pytest
import torch

from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.drafters.combined import COMBINED
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.evaluation.methods import alone
from medusa_like.forward import prepared as prepared_module
from medusa_like.forward.prepared import PreparedTarget
from medusa_like.model import MedusaLikeModel

from .conftest import random_heads, random_prompts, stock_greedy, tiny_target, untouched_target
from .test_eagle3 import random_drafter

NEW_TOKENS = 20


def drafting_dtype(drafter, target, requested, few_row: bool = True) -> torch.dtype:
    """What `drafter` computes in beside `target` prepared with (or without) this CPU's tuned layers."""
    return PreparedTarget(target, "sdpa", tuned_layers=few_row).drafting_dtype(drafter, requested)


@pytest.mark.parametrize("mode", ["learned", "combined"])
def test_a_bf16_eagle3_drafter_decodes_the_target_greedy_output(family, mode):
    """Drafted in bf16 and verified in fp32: transformers' own greedy output of an untouched copy on every prompt,
    with drafts accepted."""
    target = tiny_target(family)
    drafter = random_drafter(target)
    drafter.init_layer_from_target(target, target.config.num_hidden_layers - 1)
    drafter.init_from_target(target)  # one more target layer and the target's head: often right
    if mode == "combined":
        drafter = COMBINED.fresh(target, drafter)
    model = MedusaLikeModel(target, None, drafter, backend="sdpa", drafter_dtype="bfloat16")
    assert model.drafter_dtype == torch.bfloat16 and model.target.dtype == torch.float32
    accepted = 0
    prompts = random_prompts(6, seed=3, min_len=1, max_len=30)
    for ids, expected in zip(prompts, stock_greedy(untouched_target(family), prompts, NEW_TOKENS), strict=True):
        tree = DynamicTreeSpec(depth=3, top_k=3, num_nodes=6)
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, tree=tree, eos_token_id=[], remember=False)
        assert out.new_tokens.tolist() == expected, f"prompt of length {ids.shape[1]}"
        accepted += sum(out.stats.accepted_draft)
    assert accepted > 0  # the bf16 drafts were right sometimes: not only the all-rejected path


def test_auto_drafts_in_bf16_only_where_few_row_layers_run_bf16_natively_beside_an_fp32_target(monkeypatch):
    target = tiny_target("llama")
    eagle3, heads = random_drafter(target), random_heads()
    monkeypatch.setattr(prepared_module, "native_bf16", lambda device: True)  # a CPU with AVX512-BF16 or AMX
    assert drafting_dtype(eagle3, target, "auto", few_row=True) == torch.bfloat16
    assert drafting_dtype(COMBINED.fresh(target, eagle3), target, "auto", few_row=True) == torch.bfloat16
    assert drafting_dtype(eagle3, tiny_target("llama"), "auto", few_row=False) == torch.float32  # nn.Linear reorders
    assert drafting_dtype(heads, target, "auto", few_row=True) == torch.float32  # heads read the target's lm_head
    assert drafting_dtype(LookupDrafter(), target, "auto", few_row=True) == torch.float32
    assert drafting_dtype(eagle3, tiny_target("llama").to(torch.float16), "auto", few_row=True) == torch.float16
    monkeypatch.setattr(prepared_module, "native_bf16", lambda device: False)  # AVX2: bf16 emulated
    assert drafting_dtype(eagle3, tiny_target("llama"), "auto", few_row=True) == torch.float32


def test_explicit_drafter_dtypes_are_taken_or_refused_clearly():
    target = tiny_target("llama")
    eagle3 = random_drafter(target)
    assert drafting_dtype(eagle3, target, None) == torch.float32
    assert drafting_dtype(eagle3, target, "float32") == torch.float32
    assert drafting_dtype(eagle3, target, torch.bfloat16) == torch.bfloat16
    assert drafting_dtype(random_heads(), target, "float32") == torch.float32  # the target's own: fine
    with pytest.raises(
        ValueError,
        match=r"medusa drafter computes with the target.s own states .* \(torch.float32\), not torch.bfloat16",
    ):
        MedusaLikeModel(target, None, random_heads(), drafter_dtype="bfloat16")
    for bad in ("int8", "bf16", "no_such_dtype"):
        with pytest.raises(ValueError, match=f"drafter dtype '{bad}': expected auto, null or a floating torch dtype"):
            drafting_dtype(eagle3, target, bad)


def test_a_combined_drafters_parts_alone_keep_its_dtype():
    """The evaluation's learned-alone method shares the combined model's drafter: it drafts in the same dtype, and
    building it does not cast the shared drafter back to the target's dtype under the combined model."""
    target = tiny_target("llama")
    combined = COMBINED.fresh(target, random_drafter(target))
    model = MedusaLikeModel(target, None, combined, backend="sdpa", drafter_dtype="bfloat16")
    learned, lookup = alone(model, "learned"), alone(model, "lookup")
    assert learned.drafter_dtype == model.drafter_dtype == torch.bfloat16 and lookup.drafter_dtype is None
