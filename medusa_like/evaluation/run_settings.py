"""What a run directory's prompts were measured with, so that a resumed evaluation never mixes two runs.

An evaluation writes `run_settings.json` (atomically) into its run directory before its first prompt: every setting
that decides a prompt's record (target, drafter, tree, question selection, tokens, dtype, methods, lookup store,
threads, the machine profile), as flat dotted keys. The target and the learned drafter are recorded by their weights
(`targets.weights_fingerprint`), not by name or path: a drafter retrained at the same path, or target weights replaced
under the same name, are other weights, and a drafter moved to another path is the same one. `eval.resume=true` compares the settings of the new command with that file and refuses,
naming each differing key with both values, before any prompt runs:

    settings = config_settings(cfg)              # from the config alone: compared before the model is loaded
    previous = check_resume(out_dir, settings)   # None for a fresh run
    ...                                          # load the model, choose the tree
    settings |= loaded_settings(model, searched)
    check_resume(out_dir, settings, complete=True) if previous else write_settings(out_dir, settings, search_result)

A tree search's result (`tree=auto`) is kept in the same file, so a resumed run decodes with the tree the first run
chose instead of searching again.
"""

import hashlib
import json
from pathlib import Path

import torch
from omegaconf import DictConfig

from medusa_like.drafters.registry import kind_of
from medusa_like.io import write_json
from medusa_like.runs import config_values
from medusa_like.targets import weights_fingerprint

SETTINGS_FILE = "run_settings.json"
SETTINGS_VERSION = 3  # 3: the machine profile apart from the tree (2: the target and the drafter by their weights)

# config keys that decide every prompt's record, whatever the drafter
COMMON_KEYS = (
    "model.name_or_path",
    "model.dtype",
    "model.chat_template",
    "model.loader",
    "target.backend",
    "target.tuned_layers",
    "target.compile",
    "target.profile",
    "drafter.mode",
    "drafter.dtype",
    "drafter.draft_vocab_size",
    "drafter.vocab_data",
    "tree",
    "learned_tree",
    "data.source",
    "data.path",
    "data.skip",
    "data.limit",
    "data.max_turns",
    "data.per_category",
    "eval.max_new_tokens",
    "eval.prompt_lookup_num_tokens",
    "eval.methods",
    "eval.threads",
    "seed",
)
STORE_KEYS = ("drafter.store", "drafter.store_tokens", "drafter.seed_store")  # a drafter with a lookup store
SPLIT_KEYS = ("validation.source", "validation.val_fraction", "validation.split_seed")  # the training data's split


class ResumeMismatchError(ValueError):
    """`eval.resume=true` with settings other than those the run directory's prompts were measured with."""


def file_sha256(path) -> str | None:
    """The SHA-256 of the file at `path` (a str naming an existing file), else None."""
    if not isinstance(path, str) or not Path(path).is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_settings(cfg: DictConfig) -> dict:
    """The settings of `cfg` (conf/eval.yaml) that decide a prompt's record, with the content hashes of the files it
    names (question file, tree files, saved store; the machine profile's is read with it, `loaded_settings`): known
    before anything is loaded."""
    keys = list(COMMON_KEYS)
    if cfg.drafter.path is None:
        keys.append("drafter.num_heads")  # fresh heads
    uses_store = cfg.drafter.mode != "learned"
    if uses_store:
        keys += STORE_KEYS
    if cfg.data.source == "validation" or (uses_store and cfg.drafter.seed_store) or cfg.drafter.draft_vocab_size:
        keys += SPLIT_KEYS
    if cfg.eval.batch_size != 1:  # recorded where it is not 1: a run of batch 1 resumes as before
        keys.append("eval.batch_size")
    settings = config_values(cfg, keys)
    settings["sha256(data.path)"] = file_sha256(cfg.data.path)
    settings["sha256(tree)"] = file_sha256(cfg.tree)
    settings["sha256(learned_tree)"] = file_sha256(cfg.learned_tree)
    if uses_store:
        settings["sha256(drafter.store)"] = file_sha256(cfg.drafter.store)
    return json.loads(json.dumps(settings))  # as the file holds them: tuples as lists


def loaded_settings(model, searched: dict | None) -> dict:
    """The settings known once the model is loaded and the tree chosen: the target's weights fingerprint and dtype,
    the learned drafter's kind, weights fingerprint (None for a drafter without weights: lookup) and dtype
    (`drafter.dtype=auto` depends on the machine), the content hash of the machine profile the target runs as (as it
    was read), and those of the tree files that `tree=auto` searched (`searched`: the search's result; None for other
    trees)."""
    drafter = kind_of(model.drafter).learned_part(model.drafter) or model.drafter
    profile = model.forward.profile
    return {
        "target weights": weights_fingerprint(model.target),
        "target dtype": str(model.target.dtype),
        "drafter type": drafter.kind,
        "drafter weights": weights_fingerprint(drafter) if isinstance(drafter, torch.nn.Module) else None,
        "drafter dtype": str(model.drafter_dtype),
        "sha256(profile)": None if profile is None else profile.sha256,
        "sha256(searched tree)": file_sha256(searched and searched["path"]),
        "sha256(searched learned tree)": file_sha256(searched and searched["learned_tree"]),
    }


def read_settings(out_dir: Path) -> dict | None:
    """The run directory's recorded file (settings and a tree search's result), or None when it has none."""
    path = out_dir / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ResumeMismatchError(f"{path} is not JSON ({err}): the run's settings cannot be checked") from err
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise ResumeMismatchError(f"{path} is not a run-settings file of version {SETTINGS_VERSION}")
    if data.get("version") != SETTINGS_VERSION:
        raise ResumeMismatchError(
            f"{path} is a run-settings file of version {data.get('version')!r}, not {SETTINGS_VERSION} (which records "
            "the target's and the drafter's weights): its prompts cannot be checked; start a new run in another out_dir"
        )
    return data


def write_settings(out_dir: Path, settings: dict, tree_search: dict | None = None) -> Path:
    return write_json(
        out_dir / SETTINGS_FILE, {"version": SETTINGS_VERSION, "settings": settings, "tree_search": tree_search}
    )


def check_resume(out_dir: Path, settings: dict, complete: bool = False) -> dict | None:
    """Before a run continues the prompts already in `out_dir`: the recorded file (None when the directory holds no
    prompts yet, so the run starts afresh), after checking that every key of `settings` has the recorded value (and,
    when `settings` is `complete`, that the run recorded no other key).

    Raises `ResumeMismatchError` naming each differing key with the run's value and this command's."""
    if not (out_dir / "prompts.jsonl").exists():
        return None
    recorded = read_settings(out_dir)
    if recorded is None:
        raise ResumeMismatchError(
            f"{out_dir} holds prompts but no {SETTINGS_FILE}: the settings they were measured with are unknown, so "
            "this run cannot continue them; start a new run in another out_dir"
        )
    before = recorded["settings"]
    keys = [*settings, *(k for k in before if k not in settings and complete)]
    differences = [
        f"{key}: {show(before, key)} in the run, {show(settings, key)} now"
        for key in keys
        if key not in before or key not in settings or before[key] != settings[key]
    ]
    if differences:
        raise ResumeMismatchError(
            f"eval.resume=true, but {out_dir} was run with other settings, and its prompts would mix with this "
            f"run's: {'; '.join(differences)}. Resume with the run's settings, or start a new run in another out_dir"
        )
    return recorded


def show(settings: dict, key: str) -> str:
    return repr(settings[key]) if key in settings else "not set"
