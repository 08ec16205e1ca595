"""This machine's profile of a target: how this machine runs it, written by the tree search beside the tree it chose
and passed to a model explicitly (`profile=`), never read out of a tree file.

    profile = read_profile("runs/make_run/profile.json")        # checked for form; its path and content hash kept
    model = MedusaLikeModel.from_pretrained(..., profile=profile)   # or profile="runs/make_run/profile.json"
    write_profile(profile, "profile.json")

A profile holds what depends on the machine and not on the tree:

    compile                   the compile choice it was measured under (false, true, "auto"); `compile=None` uses it
    identity                  the setup it holds for: the target's weights, dtype, device, this machine and the step
                              (`PreparedTarget.identity`; the step says whether "auto" compiled)
    cost_model                this machine's cost model of that step with its kernel record (`cpu/few_row_linear.py`),
                              or null where nothing was measured (a learned drafter on the target's own layers)
    prompt_lookup_num_tokens  transformers' fastest prompt lookup here (the evaluation's baseline (b)), or null
    measured                  what else the search measured, for people (its timings, the target's name)

Reading one changes nothing: `PreparedTarget.use_profile` puts it to use, refused for another setup with every
difference named (`ProfileMismatchError`), its cost model made active. A tree file holds the tree alone
(`decoding/tree_files.py`).
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from medusa_like.decoding.cost_model import IDENTITY, CostModel, CostModelError, InvalidCostModelError
from medusa_like.io import existing_file, write_json

from .cpu.few_row_linear import KernelRecordError, validate_record

PROFILE_VERSION = 1
COMPILE_CHOICES = (False, True, "auto")  # "auto": compiled where this platform runs it, else eager
FIELDS = ("version", "compile", "identity", "cost_model", "prompt_lookup_num_tokens", "measured")


class ProfileError(ValueError):
    """A machine profile that cannot be used: the message names the file, the field and what to do."""


class InvalidProfileError(ProfileError):
    """A file that is not a machine profile: a missing, malformed or unknown field."""


class ProfileMismatchError(ProfileError):
    """A machine profile measured for another target, dtype, device, machine or step."""


@dataclass(frozen=True)
class MachineProfile:
    compile: bool | str  # the compile choice it was measured under (`COMPILE_CHOICES`)
    identity: dict  # {IDENTITY field: value} of the setup it holds for
    cost_model: CostModel | None = None  # this machine's cost model of that step, its layers' record in it
    prompt_lookup_num_tokens: int | None = None  # transformers' fastest prompt lookup here
    measured: dict = field(default_factory=dict)  # what else was measured, for people
    path: str | None = None  # the file it was read from (None: made in this process)
    sha256: str | None = None  # that file's content hash

    @property
    def source(self) -> str:
        return f"profile {self.path}" if self.path else "profile"

    def mismatches(self, identity: dict) -> list[str]:
        """How the setup it holds for differs from `identity` (this target's now); empty: it fits."""
        return [
            f"{name} {self.identity.get(name)!r} (here {value!r})"
            for name, value in identity.items()
            if self.identity.get(name) != value
        ]

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "compile": self.compile,
            "identity": self.identity,
            # where this copy of the cost model came from is the reader's to say (`file:<this profile>`)
            "cost_model": None if self.cost_model is None else without_source(self.cost_model.to_json()),
            "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens,
            "measured": self.measured,
        }

    @classmethod
    def from_json(cls, data, path: str | None = None, sha256: str | None = None) -> "MachineProfile":
        """The profile `to_json` wrote, checked field by field (whether it holds for a target is
        `PreparedTarget.use_profile`'s to say)."""
        source = f"profile {path}" if path else "profile"
        if not isinstance(data, dict):
            raise InvalidProfileError(f"{source}: a machine profile is a JSON object, got {type(data).__name__}")
        unknown, missing = set(data) - set(FIELDS), [k for k in FIELDS if k not in data]
        if unknown or missing:
            raise InvalidProfileError(
                f"{source}: expected the fields {list(FIELDS)}; unknown {sorted(unknown)}, missing {missing} "
                "(a tree file? pass it as tree=; the tree search writes the profile beside it)"
            )
        if data["version"] != PROFILE_VERSION:
            raise InvalidProfileError(f"{source}: version {data['version']!r}, not {PROFILE_VERSION}: search again")
        if data["compile"] not in COMPILE_CHOICES:
            raise InvalidProfileError(f"{source}: compile must be one of {COMPILE_CHOICES}, got {data['compile']!r}")
        identity = data["identity"]
        if not isinstance(identity, dict) or sorted(identity) != sorted(IDENTITY):
            raise InvalidProfileError(f"{source}: identity must hold {list(IDENTITY)}, got {identity!r}")
        lookup = data["prompt_lookup_num_tokens"]
        if lookup is not None and (type(lookup) is not int or lookup < 1):
            raise InvalidProfileError(
                f"{source}: prompt_lookup_num_tokens must be an integer >= 1 or null, got {lookup!r}"
            )
        if not isinstance(data["measured"], dict):
            raise InvalidProfileError(f"{source}: measured must be a JSON object, got {data['measured']!r}")
        cost = None
        if data["cost_model"] is not None:
            try:
                cost = parse_cost_model(data["cost_model"], f"file:{path}" if path else source)
            except CostModelError as err:
                raise InvalidProfileError(f"{source}: {err}") from err
            differs = cost.mismatches(identity)
            if differs:
                raise InvalidProfileError(
                    f"{source}: its cost model was measured for another setup: {'; '.join(differs)}"
                )
        return cls(data["compile"], dict(identity), cost, lookup, dict(data["measured"]), path, sha256)


def without_source(data: dict) -> dict:
    return {key: value for key, value in data.items() if key != "source"}


def parse_cost_model(data, source: str) -> CostModel:
    """A stored cost model (`source`: where it came from) checked for form, its kernel record too; an error names the
    field, the caller names the file."""
    try:
        cost = CostModel.from_json(data, source=source)
        validate_record(cost.kernels)
    except KernelRecordError as err:
        raise InvalidCostModelError(f"cost model: {err}") from err
    return cost


def read_profile(path) -> MachineProfile:
    """The profile at `path`, read once: its bytes parsed and hashed (the report records the hash)."""
    path = existing_file(path, "machine profile")
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidProfileError(f"profile {path}: not JSON text ({err})") from err
    return MachineProfile.from_json(data, str(path), hashlib.sha256(raw).hexdigest())


def write_profile(profile: MachineProfile, path) -> MachineProfile:
    """Write `profile` as JSON (atomically) and return it as read from there: its path and content hash set."""
    write_json(path, profile.to_json())
    return read_profile(path)


def as_profile(profile) -> MachineProfile | None:
    """What `profile=` takes: None, a `MachineProfile`, or the path of one (read once)."""
    if profile is None or isinstance(profile, MachineProfile):
        return profile
    if isinstance(profile, (str, Path)):
        return read_profile(profile)
    raise TypeError(f"profile: expected a machine profile's path or a MachineProfile, got {profile!r}")
