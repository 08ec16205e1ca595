"""What the evaluation and tree-search apps share: the model from a config (on the machine profile `target.profile`
names, read once), the question sets, the run directory, and the tree search's run: the tree, the machine profile and
the learned drafter's own tree, each written to a file of its own."""

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig

from medusa_like.data.prepare import load_model as load_target_model
from medusa_like.data.split import draft_vocab_from_training_split, training_answers
from medusa_like.decoding.tree_files import save_tree
from medusa_like.drafters.combined import COMBINED
from medusa_like.drafters.lookup import LOOKUP
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.drafters.medusa import MEDUSA
from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.drafters.registry import kind_of
from medusa_like.evaluation.methods import alone
from medusa_like.evaluation.questions import Question, load_questions, select
from medusa_like.evaluation.tree_choice import fastest_prompt_lookup, search
from medusa_like.formats import load_drafter
from medusa_like.forward import MachineProfile, write_profile
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import weights_fingerprint


def load_eval_model(cfg: DictConfig) -> MedusaLikeModel:
    """The target of `cfg.model` (in `model.dtype`) with the drafter of `cfg.drafter`: the drafter at `drafter.path`
    (zero-initialised heads when it is null), decoding as `drafter.mode` says: alone (`learned`), merged with lookup
    (`combined`), or lookup only (`lookup`); on `target.compile` and the machine profile `target.profile` names, if
    any (refused, naming the differences, when measured for another setup).

    A drafter or store made for another target raises `medusa_like.drafters.base.DrafterMismatchError`.
    """
    return load_eval_setup(cfg)[0]


def load_eval_setup(cfg: DictConfig) -> tuple[MedusaLikeModel, dict | None]:
    """`load_eval_model`'s model and how its lookup store was filled (`output_store`; None without a store)."""
    if cfg.drafter.path is not None and not Path(cfg.drafter.path).exists():
        raise FileNotFoundError(
            f"drafter.path={cfg.drafter.path!r} does not exist (a drafter directory or a .ckpt file)"
        )
    mode = cfg.drafter.mode
    if cfg.drafter.get("kind") is not None:
        raise ValueError(f"drafter.kind={cfg.drafter.kind} is now drafter.mode={cfg.drafter.kind} in the evaluation")
    if mode not in ("combined", "learned", "lookup"):
        raise ValueError(f"drafter.mode must be combined, learned or lookup, got {mode!r}")
    target, tokenizer = load_target_model(cfg.model)
    store, store_filling = (None, None)
    if mode != "learned":
        store, store_filling = output_store(cfg.drafter, cfg.validation, target, tokenizer)
    if mode == "lookup":
        drafter = LOOKUP.fresh(target, store=store)
    else:
        # without drafter.path: fresh zero-initialised Medusa heads (`drafter.num_heads`), as smoke runs and tests use
        path = cfg.drafter.path
        learned = MEDUSA.fresh(target, num_heads=cfg.drafter.num_heads) if path is None else load_drafter(path, target)
        size = cfg.drafter.get("draft_vocab_size")
        if size:  # restrict the drafter's projection to the training data's top tokens (Medusa heads: FR-Spec)
            vocab_size = target.config.get_text_config().vocab_size
            split = cfg.validation  # the training data's split settings
            vocab = draft_vocab_from_training_split(
                cfg.drafter.vocab_data, int(size), vocab_size, split.val_fraction, split.split_seed
            )
            try:
                kind_of(learned).restrict_vocab(learned, vocab)
            except ValueError as err:
                raise ValueError(f"drafter.draft_vocab_size={size}: {err}") from err
        drafter = learned if mode == "learned" else COMBINED.fresh(target, learned, store)
    model = MedusaLikeModel(
        target,
        tokenizer,
        drafter,
        backend=cfg.target.backend,
        target_name=cfg.model.name_or_path,
        tuned_layers=cfg.target.get("tuned_layers"),
        drafter_dtype=cfg.drafter.get("dtype", "auto"),
        compile=cfg.target.get("compile", False),
        profile=cfg.target.get("profile"),
    )
    return model, store_filling


def output_store(drafter: DictConfig, training_data: DictConfig, target, tokenizer) -> tuple[OutputStore, dict]:
    """The lookup store an evaluation starts from: the one saved at `drafter.store`, or an empty one of
    `drafter.store_tokens`; then filled with up to `drafter.seed_store` tokens (the store's total, what it was loaded
    with included) of the answers of the training data's training split (`training_data`: its source and split), so no
    validation conversation leaks into it. Also returns how it was filled, as the report shows it: what was loaded and
    what the seeding actually added, from which source."""
    if drafter.store:
        store = OutputStore.load(drafter.store, target)
    else:
        store = OutputStore(drafter.store_tokens, fingerprint=weights_fingerprint(target))
    loaded = store.num_tokens
    seeded = {"seeded_answers": 0, "seeded_tokens": 0, "seeded_from": None}
    if drafter.seed_store:
        answers = training_answers(training_data.source, training_data.val_fraction, training_data.split_seed)
        added = store.fill(tokenized(tokenizer, answers), drafter.seed_store)
        source = f"answers of the training split of {training_data.source}"
        seeded = {"seeded_answers": added, "seeded_tokens": store.num_tokens - loaded, "seeded_from": source}
    filling = {
        "loaded_from": drafter.store,
        "loaded_tokens": loaded,
        "max_tokens": store.max_tokens,
        "seed_budget_tokens": drafter.seed_store,
        **seeded,
    }
    return store, filling


def tokenized(tokenizer, texts: Iterable[str], batch: int = 256) -> Iterator[list[int]]:
    """The token ids of each of `texts` in order, without special tokens, tokenized `batch` texts at a time (a fast
    tokenizer works through a batch in parallel)."""
    texts = iter(texts)
    while chunk := list(itertools.islice(texts, batch)):
        yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]


def question_set(data: DictConfig, validation: DictConfig) -> list[Question]:
    """The questions of one `data`-like section (source, path, limit, per_category)."""
    split = {}
    if data.source == "validation":
        split = dict(
            source=validation.source,
            val_fraction=validation.val_fraction,
            split_seed=validation.split_seed,
            limit=None if data.get("limit") is None else data.get("limit") + data.get("skip", 0),
            max_turns=data.get("max_turns", 2),
        )
    questions = load_questions(data.source, data.get("path"), **split)
    return select(questions, data.get("limit"), data.get("per_category"), data.get("skip", 0))


def run_dir(cfg: DictConfig) -> Path:
    """`cfg.out_dir`, else the run directory (`paths.output_dir`: Hydra's run directory)."""
    out = Path(cfg.out_dir) if cfg.get("out_dir") else Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"eval.threads must be >= 1 or null, got {threads}")
        torch.set_num_threads(threads)


def calibration_prompts(cfg: DictConfig, model) -> list[torch.Tensor]:
    """First-turn prompt ids [1, T] of the calibration questions, under the target's chat template."""
    questions = question_set(cfg.tree_search.calibration, cfg.validation)
    return [model.chat_ids([{"role": "user", "content": q.turns[0]}]) for q in questions]


# what the tree search writes: {file: (its `tree_search` setting, its name in the run directory where that is null)}
SEARCH_FILES = {
    "tree": ("out", "tree.json"),
    "profile": ("profile_out", "profile.json"),
    "learned_tree": ("learned_out", "learned_tree.json"),
}


def search_files(cfg: DictConfig) -> dict[str, Path]:
    """Where the tree search writes (`SEARCH_FILES`): the tree, the machine profile and the learned drafter's own
    tree, each at its `tree_search` setting, else in the run directory."""
    ts = cfg.tree_search
    return {file: Path(ts[key]) if ts[key] else run_dir(cfg) / name for file, (key, name) in SEARCH_FILES.items()}


def run_search(cfg: DictConfig, model, files: dict[str, Path]) -> dict:
    """Search with `cfg.tree_search` and write each finding to a file of its own (`files`: `search_files`): the chosen
    tree with what was measured about it; this machine's profile of the target (the compile choice, the cost model
    that sizes a budgeted tree, the fastest `prompt_lookup_num_tokens`), which
    the model runs as from then on; for a combined drafter with `tree_search.learned_alone`, the learned drafter's own
    tree when it decodes alone. Returns what was measured, the trees as JSON and the files' paths."""
    prompts = calibration_prompts(cfg, model)
    ts = cfg.tree_search
    timing = prompts[: max(ts.timing_prompts, 1)]
    budgeted = ts.get("budgeted") is not None and sized_by_cost_model(model.drafter)
    cost = None
    if budgeted or model.forward.differs_from_stock:
        # budgeted trees are sized by a full cost model; and any tree is timed on the step and kernels measured here,
        # which the profile records
        cost = model.forward.measure_cost_model()
    args = (ts.timing_prompts, cfg.eval.max_new_tokens, ts.budget, ts.budgets, ts.dynamic, cfg.eval.k_max)
    result = search(model, prompts, *args, ts.get("budgeted"))
    learned_alone = None
    if ts.get("learned_alone") and budgeted and "learned" in model.drafter.parts():
        # after the combined search: the learned drafter alone runs the kernels its cost model chose on the target
        alone_model = alone(model, "learned")
        learned_alone = search(alone_model, prompts, *args)
        learned_spec = alone_model.resolve_tree(learned_alone["spec"])
        save_tree(learned_spec, files["learned_tree"], timings=learned_alone["timings"])
        learned_alone["spec"] = learned_spec.to_json()
    prompt_lookup, prompt_lookup_rows = fastest_prompt_lookup(model, timing, cfg.eval.max_new_tokens, ts.prompt_lookup)
    meta = dict(
        calibration={"source": ts.calibration.source, "prompts": len(prompts)},
        target=str(cfg.model.name_or_path),
        drafter=None if cfg.drafter.path is None else str(cfg.drafter.path),
        timings=result["timings"],
    )
    if result["kind"] == "static":
        meta.update(budget=result["label"], predicted_tau=result["predicted_tau"], head_topk_accuracy=result["topk"])
    spec = model.resolve_tree(result["spec"])
    save_tree(spec, files["tree"], **meta)
    measured = {"target": meta["target"], "prompt_lookup_timings": prompt_lookup_rows}
    profile = MachineProfile(cfg.target.compile, model.forward.identity(), cost, prompt_lookup, measured)
    model.forward.use_profile(write_profile(profile, files["profile"]))
    return {
        **result,
        "spec": spec.to_json(),
        "path": str(files["tree"]),
        "profile": str(files["profile"]),
        "learned_tree": None if learned_alone is None else str(files["learned_tree"]),
        "prompt_lookup_num_tokens": prompt_lookup,
        "learned_alone": learned_alone,
    }
