"""The CUDA paths: decoding with both drafters on the GPU (fp32 and bf16 targets, static and dynamic trees) and a bf16
training run of each drafter. Skipped without CUDA (CI never has a GPU).

What is asserted is what holds: in fp32 the output equals the target's greedy output token for token; in bf16 it
equals it, or differs first where the target's own logits put the two tokens within a few bf16 steps of each other
(a near-tie: the tree's forward over several nodes and greedy's over one round differently, so it can flip; a bug
would give a wide margin)."""

import json
import math

import pytest
import torch

from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.model import MedusaLikeModel

from .conftest import assert_greedy_or_near_tie, random_heads, random_prompts, tiny_target, untouched_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_greedy(target, prompt, n: int) -> list[int]:
    out = target.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, prompt.shape[1] :].tolist()


@pytest.fixture
def true_fp32(monkeypatch):
    """fp32 products in fp32: no TF32, whatever a library or an earlier test set."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def eagle3_drafter(target, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, target.config.vocab_size))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return drafter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_lossless_on_cuda(family, kind, dtype, true_fp32):
    target = tiny_target(family).to("cuda", dtype)
    drafter = random_heads() if kind == "medusa" else eagle3_drafter(target)
    model = MedusaLikeModel(target, None, drafter, backend="sdpa")
    untouched = untouched_target(family, dtype=dtype).to("cuda")
    for prompt in random_prompts(6, seed=3):
        prompt = prompt.cuda()
        expected = cuda_greedy(untouched, prompt, 20)
        for tree in ("small", DynamicTreeSpec(4, 3, 10)):
            out = model.generate(prompt, max_new_tokens=20, tree=tree, eos_token_id=[])
            assert_greedy_or_near_tie(untouched, prompt, out.new_tokens.tolist(), expected)


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
