"""Tree files and names: a tree spec written to and read from JSON, and resolved from whatever a caller passes as a
tree (a preset name, a JSON tree file, a list of rank paths, a dict of `DynamicTreeSpec` fields, or a spec itself).

    save_tree(spec, "tree.json", timings=rows)   # the spec's JSON and what the search measured about it
    spec = load_tree("tree.json")                # what `save_tree` wrote, or a bare JSON list of paths
    spec = spec_from_json(data)                               # {"paths": ...}, {"dynamic": ...} or {"budgeted": ...}
    spec = resolve_tree("small", max_depth=4)                 # a preset, a file, paths, a dict or a spec

A tree file holds a tree (and what the search measured about it: timings, predicted tau, head accuracies), nothing
that changes how the target computes: this machine's cost model, kernels and compile choice are a machine profile's,
passed as such (`forward/profile.py`). A file of an earlier version that still holds them is read as a tree, those
keys ignored with one log line. A bad file or name is refused with an `InvalidTreeError` that says where it came from.
The specs and their checks are `tree.py`'s; the static presets and how they are built are `tree_presets.py`'s.
"""

import functools
import json
import logging
from pathlib import Path

from medusa_like.io import existing_file, write_json

from .tree import BudgetedTreeSpec, DynamicTreeSpec, InvalidTreeError, TokenTree, TreeSpec
from .tree_presets import DEFAULT_DEPTH, PRESETS

log = logging.getLogger(__name__)

# what tree files of earlier versions held besides the tree: a machine profile's now, and the learned tree's own file
MACHINE_KEYS = (
    "cost_model",
    "prompt_lookup_num_tokens",
    "prompt_lookup_timings",
    "learned_alone",
    "learned_alone_timings",
)


def save_tree(spec: TreeSpec, path, **meta) -> Path:
    """Write a tree spec as JSON (`spec.to_json()` plus `meta`: what measured it, on which machine)."""
    return write_json(path, {**spec.to_json(), **meta})


def spec_from_json(data, source: str = "tree") -> TreeSpec:
    """The spec `to_json` wrote: `{"paths": [...]}`, `{"dynamic": {...}}`, `{"budgeted": {...}}`, or a bare list of
    paths."""
    if isinstance(data, dict) and "budgeted" in data:
        if not isinstance(data["budgeted"], dict):
            raise InvalidTreeError(f"{source}: a budgeted tree is a dict of its fields, got {data['budgeted']!r}")
        fields = dict(data["budgeted"])
        learned = fields.pop("learned", None)
        learned = None if learned is None else spec_from_json(learned, source)
        try:
            return BudgetedTreeSpec(learned, **fields)
        except (TypeError, ValueError) as err:
            raise InvalidTreeError(f"{source}: bad budgeted tree {data['budgeted']!r}: {err}") from err
    if isinstance(data, dict) and "dynamic" in data:
        try:
            return DynamicTreeSpec(**data["dynamic"])
        except (TypeError, ValueError) as err:
            raise InvalidTreeError(f"{source}: bad dynamic tree {data['dynamic']!r}: {err}") from err
    paths = data["paths"] if isinstance(data, dict) and "paths" in data else data
    try:
        return TokenTree.from_paths(paths)
    except InvalidTreeError as err:
        raise InvalidTreeError(f"{source}: {err}") from err


def load_tree(path) -> TreeSpec:
    """Read a tree written by `save_tree` (or a bare JSON list of paths)."""
    path = existing_file(path, "tree file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InvalidTreeError(f"tree file {str(path)!r} is not UTF-8 text: {err}") from err
    except json.JSONDecodeError as err:
        raise InvalidTreeError(f"tree file {str(path)!r} is not valid JSON: {err}") from err
    ignored = tuple(key for key in MACHINE_KEYS if isinstance(data, dict) and key in data)
    if ignored:
        _ignoring(str(path.resolve()), ignored)
    return spec_from_json(data, f"tree file {str(path)!r}")


@functools.cache
def _ignoring(path: str, keys: tuple[str, ...]) -> None:
    """The one log line (per file) for a tree file of an earlier version that holds more than the tree."""
    log.warning(
        "tree file %s also holds %s, which a tree file no longer carries: read as a tree, those ignored (a machine "
        "profile is passed as profile=, the learned drafter's own tree as a tree file of its own; search again to "
        "write both)",
        path,
        ", ".join(keys),
    )


def resolve_tree(tree, max_depth: int | None = None) -> TreeSpec:
    """A tree spec from a preset name ('dynamic', 'chain', 'small', 'medusa', 'none'), a JSON tree file, a list of
    rank paths, a dict of `DynamicTreeSpec` fields, or a spec itself.

    `max_depth` shapes the presets (a drafter's heads; None: a drafter of any depth, for which static presets are
    `DEFAULT_DEPTH` deep). Whether the drafter can fill the tree is `check_drafter`'s to say, once, before decoding.
    """
    depth = max_depth if max_depth is not None else DEFAULT_DEPTH
    if isinstance(tree, (TokenTree, DynamicTreeSpec, BudgetedTreeSpec)):
        return tree
    if isinstance(tree, dict):
        known = {"dynamic", "paths", "budgeted"}
        return spec_from_json(tree if known & set(tree) else {"dynamic": tree}, "tree")
    if tree is None or tree == "none":
        return TokenTree.from_paths([])
    if tree == "dynamic":
        return DynamicTreeSpec(depth=min(DynamicTreeSpec.depth, depth))
    if isinstance(tree, (str, Path)) and str(tree).endswith(".json"):
        return load_tree(tree)
    if isinstance(tree, str):
        if tree not in PRESETS and Path(tree).exists():
            kind = "a directory" if Path(tree).is_dir() else "not a .json file"
            raise InvalidTreeError(f"tree {tree!r} is {kind}: expected a tree JSON file (tree_search.out) or a preset")
        if tree not in PRESETS:
            raise InvalidTreeError(
                f"unknown tree preset {tree!r}; choose from {sorted([*PRESETS, 'dynamic', 'none'])}, a tree JSON "
                "file or a list of paths"
            )
        return TokenTree.from_paths(PRESETS[tree](depth))
    if not isinstance(tree, (list, tuple)):
        raise InvalidTreeError(
            f"tree must be a preset name, a tree JSON file, a list of rank paths, a dict or a tree spec; got {tree!r} "
            f"({type(tree).__name__})"
        )
    return TokenTree.from_paths(tree)
