"""The target cache: the top-k loss against the full one, refusal of a cache made for other target weights (another
seed of one config, another dtype), other settings or other rows, a build killed inside a real shard write resumed
to the same content, a truncated shard named in one line, training read from the cache, the best checkpoint
exported, and a learning curve from milestone checkpoints."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from medusa_like.formats import load_drafter
from medusa_like.targets import target_fingerprint, weights_fingerprint
from medusa_like.tiny import tiny_model
from medusa_like.training.target_cache import (
    MANIFEST,
    TargetCache,
    TargetCacheCorruptError,
    TargetCacheMismatchError,
    cache_key,
    vocab_digest,
)
from medusa_like.training.ttt import loss_function, simulated_tau, topk_soft_cross_entropy
from train.train import train

from .test_training import ROOT, build_module, compose_train, data_dir  # noqa: F401  (data_dir: the module's fixture)


def full_soft_cross_entropy(logits, teacher_logp):
    return -(teacher_logp.exp() * F.log_softmax(logits, -1)).sum(-1).mean()


def test_topk_loss_equals_the_full_loss_where_k_covers_the_mass():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    # a teacher whose whole mass lies on 5 tokens per row (the rest 0)
    support = torch.randn(6, 50).topk(5, -1).indices
    teacher = torch.full((6, 50), float("-inf")).scatter(-1, support, torch.randn(6, 5)).log_softmax(-1)
    top = teacher.topk(8, -1)
    full = full_soft_cross_entropy(logits, torch.where(teacher.isinf(), -1e30, teacher))
    torch.testing.assert_close(topk_soft_cross_entropy(logits, top.indices, top.values), full)
    # k = the whole vocabulary equals the full loss for any teacher
    teacher = torch.randn(6, 50).log_softmax(-1)
    top = teacher.topk(50, -1)
    torch.testing.assert_close(
        topk_soft_cross_entropy(logits, top.indices, top.values), full_soft_cross_entropy(logits, teacher)
    )
    # and a teacher cut to too few tokens gives another loss: the equality above is not vacuous
    top = teacher.topk(3, -1)
    assert not torch.isclose(
        topk_soft_cross_entropy(logits, top.indices, top.values), full_soft_cross_entropy(logits, teacher)
    )


def test_acceptance_losses_equal_their_full_distribution_forms_and_mix_by_weight():
    """TV = 1/2 sum |p - q| and LK-style -log sum min(p, q) over the whole vocabulary, from top-k labels that hold the
    teacher's mass; a weighted mix is the weighted sum; a drafter that equals the teacher has TV 0; bad names and
    weights are refused naming the choices."""
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    teacher = torch.randn(6, 50).log_softmax(-1)
    top = teacher.topk(50, -1)
    p, q = teacher.exp(), logits.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(loss_function("tv")(logits, top.indices, top.values), tv.mean())
    torch.testing.assert_close(loss_function("lk")(logits, top.indices, top.values), (-(1 - tv).log()).mean())
    mix = loss_function("0.1*soft_ce + 0.9*tv")(logits, top.indices, top.values)
    torch.testing.assert_close(mix, 0.1 * full_soft_cross_entropy(logits, teacher) + 0.9 * tv.mean())
    assert loss_function("tv")(teacher, top.indices, top.values).abs() < 1e-6
    # a teacher kept as its top 8 of 50: TV counts the drafter's mass outside those 8 as disagreement
    cut = teacher.topk(8, -1)
    p8 = torch.zeros(6, 50).scatter(-1, cut.indices, cut.values.softmax(-1))
    torch.testing.assert_close(
        loss_function("tv")(logits, cut.indices, cut.values), (0.5 * (p8 - q).abs().sum(-1)).mean()
    )
    with pytest.raises(ValueError, match="unknown drafter loss 'kl'.*soft_ce"):
        loss_function("kl")
    with pytest.raises(ValueError, match="weight 'x'"):
        loss_function("x*tv")
    with pytest.raises(ValueError, match="weight '0' of 'tv' must be positive"):
        loss_function("1*soft_ce+0*tv")


def test_simulated_tau_of_a_chain():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def rows_of(datamodule, n=None):
    rows = [dict(r) for split in (datamodule.train_set, datamodule.val_set) for r in split]
    return rows[:n] if n else rows


def synthetic_rows(n: int = 24, seed: int = 0) -> list[dict]:
    """Dataset-like rows (`index`, `input_ids`, `loss_mask`) of varied lengths, some longer than KEY's max_length."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(6, 80, (1,), generator=gen))
        ids = torch.randint(1, 500, (length,), generator=gen).tolist()
        rows.append({"index": 3 * i + 1, "input_ids": ids, "loss_mask": [0] * 3 + [1] * (length - 3)})
    return rows


def fake_outputs(batch):
    """Deterministic fields from a batch: what `Eagle3Module.cacheable_outputs` returns, without a target."""
    ids = batch["input_ids"]  # [B, T]
    return {
        "aux": ids[..., None].expand(-1, -1, 6).to(torch.bfloat16),
        "topk_ids": (ids[..., None] + torch.arange(4)).to(torch.int16),
        "topk_logp": -ids[..., None].expand(-1, -1, 4).to(torch.float16) / 100,
        "labelled": batch["loss_mask"].bool(),
    }


FIELDS = ["aux", "topk_ids", "topk_logp", "labelled"]
CONTENT = {"fields": FIELDS, "draft_vocab": vocab_digest(torch.arange(10)), "aux_layer_ids": [0, 1, 2], "top_k": 4}
TARGET = tiny_model("llama", seed=0)
KEY = cache_key(weights_fingerprint(TARGET), TARGET.dtype, CONTENT, 64)


def read_all(cache: TargetCache, rows: list[dict]) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for row in rows:
        ids = torch.tensor([row["input_ids"][: cache.key["max_length"]]])
        out[row["index"]] = cache.get([row["index"]], ids, torch.tensor([ids.shape[1]]))
    return out


def assert_same_content(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for index in a:
        for name in FIELDS:
            assert torch.equal(a[index][name], b[index][name]), (index, name)


def test_a_cache_for_other_target_weights_or_settings_or_rows_is_refused(tmp_path):
    """Two tiny targets of one config (their architecture fingerprints are equal) with other seeds, and the same
    weights in bf16, have other weights fingerprints: a cache built for one is refused for the others with one line
    naming both fingerprints. The same weights in another model object are accepted."""
    rows = synthetic_rows(8)
    TargetCache(tmp_path / "cache", KEY).build(rows, fake_outputs, batch_tokens=64, shard_tokens=100)
    reseeded, in_bf16 = tiny_model("llama", seed=1), tiny_model("llama", seed=0).to(torch.bfloat16)
    assert target_fingerprint(reseeded.config) == target_fingerprint(TARGET.config)  # what the old key held
    for other in (reseeded, in_bf16):
        key = cache_key(weights_fingerprint(other), other.dtype, CONTENT, 64)
        with pytest.raises(TargetCacheMismatchError) as refusal:
            TargetCache(tmp_path / "cache", key)
        message = str(refusal.value)
        assert f"target_weights: cache '{KEY['target_weights']}', run '{key['target_weights']}'" in message
        assert "\n" not in message and "delete it" in message
    assert "target_dtype: cache 'torch.float32', run 'torch.bfloat16'" in message
    same = tiny_model("llama", seed=0)  # another object with the same weights: the same cache
    key = cache_key(weights_fingerprint(same), same.dtype, CONTENT, 64)
    assert_same_content(
        read_all(TargetCache(tmp_path / "cache", key), rows), read_all(TargetCache(tmp_path / "cache", KEY), rows)
    )

    weights, dtype = KEY["target_weights"], KEY["target_dtype"]
    others = {
        "draft_vocab": {**CONTENT, "draft_vocab": vocab_digest(torch.arange(1, 11))},
        "aux_layer_ids": {**CONTENT, "aux_layer_ids": [0, 1, 3]},
        "top_k": {**CONTENT, "top_k": 8},
        # KEY's cache holds labels at the assistant's tokens only: refused for a run that trains on every token
        "train_on": {**CONTENT, "train_on": "all"},
        "fields": {"fields": ["hidden"]},  # a Medusa module's cache
    }
    for field, content in others.items():
        with pytest.raises(TargetCacheMismatchError, match=field):
            TargetCache(tmp_path / "cache", cache_key(weights, dtype, content, 64))
    with pytest.raises(TargetCacheMismatchError, match="max_length: cache 64, run 128"):
        TargetCache(tmp_path / "cache", cache_key(weights, dtype, CONTENT, 128))
    cache = TargetCache(tmp_path / "cache", KEY)
    row = rows[0]
    ids = torch.tensor([row["input_ids"][:64]])
    cache.get([row["index"]], ids, torch.tensor([ids.shape[1]]))  # the same row is served
    ids[0, -1] += 1  # another dataset's row under the same index
    with pytest.raises(TargetCacheMismatchError, match="other token ids"):
        cache.get([row["index"]], ids, torch.tensor([ids.shape[1]]))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text("{not json")
    with pytest.raises(TargetCacheCorruptError, match="not a target cache manifest"):
        TargetCache(tmp_path / "bad", KEY)


KILLED_BUILD = r"""
import json, os, sys
import torch
from medusa_like.training import target_cache

root, mode, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
key, rows = json.loads(sys.argv[4]), json.loads(sys.argv[5])
calls = {"shard": 0, "manifest": 0}
real_save, real_manifest = target_cache.save_file, target_cache.write_json

def save_file(tensors, path):  # the shard writer, killed half-way through its `at`-th file
    calls["shard"] += 1
    real_save(tensors, path)
    if mode == "in_shard" and calls["shard"] == at:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
        os._exit(9)  # a kill: no `finally`, no clean-up

def write_json(path, data):  # the manifest's writer, killed before its `at`-th write (that shard in place, unnamed)
    calls["manifest"] += 1
    if mode == "before_manifest" and calls["manifest"] == at:
        os._exit(9)
    return real_manifest(path, data)

target_cache.save_file, target_cache.write_json = save_file, write_json

def compute(batch):
    ids = batch["input_ids"]
    return {
        "aux": ids[..., None].expand(-1, -1, 6).to(torch.bfloat16),
        "topk_ids": (ids[..., None] + torch.arange(4)).to(torch.int16),
        "topk_logp": -ids[..., None].expand(-1, -1, 4).to(torch.float16) / 100,
        "labelled": batch["loss_mask"].bool(),
    }

target_cache.TargetCache(root, key).build(rows, compute, batch_tokens=64, shard_tokens=150)
sys.exit(0)
"""


@pytest.mark.parametrize("mode", ["in_shard", "before_manifest"])
def test_a_build_killed_inside_a_shard_write_resumes_to_the_same_content(tmp_path, mode):
    """A process killed (os._exit) inside the third shard's real write, half of the file on disk, or between that
    shard's write and the manifest naming it: the resumed build never reads that shard, computes the rows it held
    again, and ends with the content of an uninterrupted build."""
    rows = synthetic_rows(24)
    whole = TargetCache(tmp_path / "whole", KEY)
    assert whole.build(rows, fake_outputs, batch_tokens=64, shard_tokens=150) == len(rows)
    cut = tmp_path / "cut"
    done = subprocess.run(
        [sys.executable, "-c", KILLED_BUILD, str(cut), mode, "3", json.dumps(KEY), json.dumps(rows)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 9, done.stderr[-2000:]
    named = {shard for shard, _, _ in json.loads((cut / MANIFEST).read_text())["rows"].values()}
    assert named == {"shard-00000.safetensors", "shard-00001.safetensors"}
    if mode == "in_shard":  # the half-written file is the shard's temporary, never its name
        (half,) = [p for p in cut.iterdir() if ".tmp-" in p.name]
        assert half.name.startswith(".shard-00002.safetensors") and half.stat().st_size > 0
        assert not (cut / "shard-00002.safetensors").exists()
    else:  # the shard is whole and in place, but no manifest names it
        assert (cut / "shard-00002.safetensors").is_file()
    kept = TargetCache(cut, KEY)
    assert not [p for p in cut.iterdir() if ".tmp-" in p.name]  # the killed writer's temporary is gone
    survived = len(kept.rows)
    assert 0 < survived < len(rows)
    assert kept.build(rows, fake_outputs, batch_tokens=64, shard_tokens=150) == len(rows) - survived
    assert TargetCache(cut, KEY).build(rows, fake_outputs) == 0  # nothing left to compute
    if mode == "before_manifest":  # the unnamed shard's rows were written again elsewhere; it is never read
        manifest = json.loads((cut / MANIFEST).read_text())
        assert "shard-00002.safetensors" not in {shard for shard, _, _ in manifest["rows"].values()}
    assert_same_content(read_all(whole, rows), read_all(TargetCache(cut, KEY), rows))


def test_a_truncated_shard_is_one_line_naming_it_and_deleting_it_rebuilds_its_rows(tmp_path):
    rows = synthetic_rows(24)
    root = tmp_path / "cache"
    TargetCache(root, KEY).build(rows, fake_outputs, batch_tokens=64, shard_tokens=150)
    expected = read_all(TargetCache(root, KEY), rows)
    shard = root / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # truncated: a full disk, a copy cut short
    with pytest.raises(TargetCacheCorruptError) as refusal:
        TargetCache(root, KEY)
    message = str(refusal.value)
    assert str(shard) in message and "delete that file" in message and "\n" not in message
    shard.unlink()  # as the message says
    again = TargetCache(root, KEY)
    lost = len(rows) - len(again.rows)
    assert lost > 0 and again.build(rows, fake_outputs, batch_tokens=64, shard_tokens=150) == lost
    assert_same_content(expected, read_all(TargetCache(root, KEY), rows))


@pytest.mark.slow
def test_a_modules_cache_is_keyed_by_its_targets_weights_and_dtype(tmp_path, data_dir):  # noqa: F811
    """The EAGLE-3 and Medusa modules key their cache by the target's weights: the tiny target of another seed (the
    same config, the same data directory) or in bf16 is refused one line naming both fingerprints; the same
    target loaded again reads the cache without a target forward."""
    for drafter in ("eagle3", "medusa"):
        where = (f"drafter={drafter}", f"drafter.module.target_cache_dir={tmp_path / drafter}")
        built, datamodule = build_module(data_dir, tmp_path, *where)
        built.prepare_target_cache(datamodule)
        for other in ("model.loader.seed=1", "model.dtype=bfloat16"):
            module, _ = build_module(data_dir, tmp_path, *where, other)
            assert module.target_weights != built.target_weights
            with pytest.raises(TargetCacheMismatchError) as refusal:
                module.prepare_target_cache(datamodule)
            message = str(refusal.value)
            assert f"target_weights: cache '{built.target_weights}', run '{module.target_weights}'" in message
            assert "\n" not in message
        again, _ = build_module(data_dir, tmp_path, *where)
        again.target.base_model.forward = None  # a target forward would fail: the cache must serve every row
        again.prepare_target_cache(datamodule)
        batch = next(iter(datamodule.val_dataloader()))
        torch.testing.assert_close(again._forward(batch)[0], built._forward(batch)[0])


@pytest.mark.slow
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_training_from_the_cache_matches_the_target_and_runs_no_target_forward(tmp_path, data_dir, train_on):  # noqa: F811
    """Training and validation batches read from the cache equal those computed by the target: with labels at every
    token in training, the cache holds them all and validation still reads the assistant's only."""
    cache_dir = tmp_path / "cache"
    common = ("drafter=eagle3", "drafter.module.top_k=null", f"drafter.module.train_on={train_on}")
    module, datamodule = build_module(data_dir, tmp_path, *common)
    cached, _ = build_module(data_dir, tmp_path, *common, f"drafter.module.target_cache_dir={cache_dir}")
    cached.prepare_target_cache(datamodule)
    assert (cache_dir / MANIFEST).is_file()
    cached.target.base_model.forward = None  # a target forward would now fail: the cache must serve every row
    batch = next(iter(datamodule.train_dataloader()))
    rows = {}
    for training in (True, False):
        expected, got = module._forward(batch, training), cached._forward(batch, training)
        torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=2e-2)  # features kept in bf16
        assert [int(a[2]) for a in got[2]] == [int(a[2]) for a in expected[2]]  # the same labelled rows
        rows[training] = int(got[2][0][2])
    assert (rows[True] > rows[False]) == (train_on == "all")  # the prompts' tokens add labels in training only
    aux, k = batch_aux_width(cached), cached.top_k
    expected = aux * 2 + k * (2 + 2) + 1  # bf16 features, int16 ids and fp16 log-probabilities, a bool
    assert expected <= cached.target_cache.bytes_per_token() < 1.1 * expected  # plus the shards' headers


def batch_aux_width(module) -> int:
    return len(module.drafter.config.aux_layer_ids) * module.drafter.config.target_hidden_size


@pytest.mark.slow
def test_train_with_the_cache_exports_the_best_checkpoint(tmp_path, data_dir):  # noqa: F811
    cfg = compose_train(
        tmp_path,
        data_dir,
        "drafter=eagle3",
        "export_drafter=true",
        f"drafter.module.target_cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=3",
        "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=2",
    )
    metrics = train(cfg)
    assert metrics["best/val/sim_tau_chain"] >= metrics["val/sim_tau_chain"]
    best = sorted((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == 1
    state = torch.load(best[0], weights_only=False)["state_dict"]
    from hydra.utils import instantiate

    target, _ = instantiate(cfg.model.loader)
    exported = load_drafter(tmp_path / "drafter", target).state_dict()
    for name, tensor in state.items():
        torch.testing.assert_close(exported[name.removeprefix("drafter.")], tensor)


@pytest.mark.slow
def test_token_milestones_make_a_learning_curve(tmp_path, data_dir):  # noqa: F811
    """A run with TokenMilestones saves a checkpoint per milestone (and stops after the last); the learning curve
    (`python -m eval.bench learning_curve`) measures each on the run's validation rows (as many batches as the run validated on) and by decoding, and writes
    the table, curve.json and the plot."""
    from matplotlib import image

    from benchmarks import learning_curve
    from benchmarks.harness import show
    from medusa_like import MedusaLikeModel
    from medusa_like.training.build import build_module as build_drafter_module

    cfg = compose_train(
        tmp_path,
        data_dir,
        "drafter=eagle3",
        f"drafter.module.target_cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=50",
        "module.optimizer.lr=1e-2",  # steps large enough for the validation loss to move in a few steps
        "+callbacks.token_milestones._target_=medusa_like.training.checkpoints.TokenMilestones",
        f"+callbacks.token_milestones.dirpath={tmp_path / 'checkpoints'}",
        "+callbacks.token_milestones.milestones=[20,40,80]",
        "+trainer.limit_val_batches=1",
        "data.module.batch_size=2",  # two validation batches or more, of which the run validates on the first
    )
    metrics = train(cfg)
    saved = json.loads((tmp_path / "checkpoints" / "milestones.json").read_text())
    assert [s["milestone"] for s in saved] == [20, 40, 80]
    assert all(s["tokens"] >= s["milestone"] for s in saved)
    assert saved[-1]["step"] < 50 * 3  # stopped at the last milestone, long before 50 epochs
    show(learning_curve.run(tmp_path, prompts=2, max_new_tokens=8))
    curve = json.loads((tmp_path / "curve.json").read_text())
    points = curve["points"]
    assert [p["milestone"] for p in points] == [20, 40, 80]
    # a point is what the run's own validation reports for the same weights, on the same rows: the run's last
    # checkpoint against its last validation
    from hydra.utils import instantiate

    target, tokenizer = instantiate(cfg.model.loader)
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    last = learning_curve.held_out(cfg, target, datamodule, tmp_path / "checkpoints" / "last.ckpt")
    run_val = {k: v for k, v in metrics.items() if k.startswith("val/")}
    assert "val/loss" in run_val and "val/sim_tau_chain" in run_val
    assert {k: last[k] for k in run_val} == pytest.approx(run_val, rel=1e-5)
    # the points measure trained drafters: the validation loss falls from the untrained drafter's to the last point's
    untrained = tmp_path / "untrained.ckpt"
    torch.save({"state_dict": build_drafter_module(cfg, target).state_dict()}, untrained)
    before = learning_curve.held_out(cfg, target, datamodule, untrained)["val/loss"]
    assert points[-1]["val/loss"] < points[0]["val/loss"] < before
    # a point's tau alone is its own checkpoint's: tokens per target forward decoding the same prompts alone
    prompts = learning_curve_prompts(cfg, tokenizer)
    model = MedusaLikeModel(target, tokenizer, load_drafter(tmp_path / "checkpoints" / points[-1]["path"], target))
    outs = [model.generate(ids, max_new_tokens=8, tree="dynamic", remember=False) for ids in prompts]
    forwards = sum(out.stats.target_forwards for out in outs)
    assert points[-1]["tau_alone"] == pytest.approx(sum(out.stats.new_tokens for out in outs) / forwards)
    png = image.imread(tmp_path / "curve.png")  # decodes, at the figure's size (10 x 4 inches at 120 dpi)
    assert png.shape[:2] == (4 * 120, 10 * 120) and png[..., :3].std() > 0.05


def learning_curve_prompts(cfg, tokenizer, count: int = 2) -> list[torch.Tensor]:
    """The validation prompts the learning curve decodes (`prompts=count`): first turns, the chat template."""
    from medusa_like.evaluation.questions import load_questions, select
    from medusa_like.targets import chat_input_ids

    questions = load_questions(
        "validation", source=cfg.data.source, val_fraction=cfg.data.val_fraction, split_seed=cfg.data.split_seed,
        limit=count, max_turns=1,
    )  # fmt: skip
    return [chat_input_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in select(questions, count)]


def test_the_ablation_table_compares_each_arm_with_the_base(tmp_path, capsys):
    """The ablation table (`python -m eval.bench ablations`) reads each finished arm's metrics and overrides and reports its change against the base arm;
    an arm with fewer unrolled steps shows no deeper depths, an unfinished arm is left out, and a folder without the
    base arm is one error line."""
    from benchmarks import ablations
    from benchmarks.harness import show

    def arm(name, top1, overrides):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        metrics = {f"val/acc_top1_depth{d}": a for d, a in enumerate(top1, 1)}
        metrics["val/sim_tau_chain"] = simulated_tau(top1)
        (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
        lines = "".join(f"- {o}\n" for o in ["experiment=smollm2_eagle3_ablation", "hydra.run.dir=x", *overrides])
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(lines)

    arm("base", [0.2, 0.1, 0.1, 0.1], [])
    arm("tv", [0.25, 0.1, 0.1, 0.1], ["drafter.module.loss=tv"])
    arm("ttt2", [0.3, 0.2], ["drafter.module.ttt_steps=2"])  # two unrolled steps: no depths 3 and 4
    (tmp_path / "running").mkdir()  # no metrics.json yet
    show(ablations.run(tmp_path))
    table = json.loads((tmp_path / "ablations.json").read_text())
    tv = next(a for a in table["arms"] if a["name"] == "tv")
    assert [a["name"] for a in table["arms"]] == ["base", "ttt2", "tv"]
    assert table["arms"][1]["top1"] == [0.3, 0.2, None, None]
    assert tv["overrides"] == ["drafter.module.loss=tv"]
    assert tv["delta_top1_d1"] == pytest.approx(0.05)
    assert tv["delta_sim_tau"] == pytest.approx(
        simulated_tau([0.25, 0.1, 0.1, 0.1]) - simulated_tau([0.2, 0.1, 0.1, 0.1])
    )
    printed = capsys.readouterr().out
    assert "+0.050 d1" in printed
    ttt2_row = next(line for line in printed.splitlines() if "ttt2" in line)
    assert "0.300" in ttt2_row and ttt2_row.count(" - ") >= 2  # depths 3 and 4 shown as dashes
    with pytest.raises(FileNotFoundError, match="no finished base arm"):
        ablations.run(tmp_path, base="nothing")
