"""`python -m eval.bench <name> [options]`: every benchmark and analysis by name, its options read off the signature
of its function, what it returns shown by the harness (`harness.show`: tables, then the JSON file).

    python -m eval.bench                          # the list, one line each
    python -m eval.bench verify --help            # one benchmark's options
    python -m eval.bench verify --profile runs/make_run/profile.json --nodes 1,2,3,6

A new benchmark is a module with a function `run(...) -> harness.Report`, listed in `BENCHMARKS`. Its positional
parameters are positional arguments (`*args`: any number of them), its keyword-only parameters options
(`--max-new-tokens`; one without a default is required), typed by their annotations: int, float, str, Path,
`X | None`, bool (`--flag` / `--no-flag`), `tuple[X, ...]` (comma-separated: `--nodes 1,2,3`) and `Literal[...]`
(choices); `Annotated[X, "help"]` adds a help line. An expected failure (a bad value, a missing file) ends the command
with one `error:` line.
"""

import argparse
import inspect
import sys
import types
import typing
from collections.abc import Callable

from medusa_like.errors import one_line_errors

from . import (
    ablations,
    agreement,
    attention,
    batch,
    core,
    distill,
    draft,
    first_call,
    learning_curve,
    linear,
    lookup,
    plot_results,
    prefill,
    products,
    train_step,
    verify,
    vocab,
)
from .harness import show

BENCHMARKS: dict[str, Callable] = {
    "attention": attention.run,
    "batch": batch.run,
    "core": core.run,
    "distill": distill.run,
    "draft": draft.run,
    "first_call": first_call.run,
    "linear": linear.run,
    "lookup": lookup.run,
    "prefill": prefill.run,
    "products": products.run,
    "train_step": train_step.run,
    "verify": verify.run,
    "vocab": vocab.run,
}
ANALYSES: dict[str, Callable] = {  # of finished runs and reports: they time nothing
    "ablations": ablations.run,
    "agreement": agreement.run,
    "learning_curve": learning_curve.run,
    "plot_results": plot_results.run,
}
ENTRIES = {**BENCHMARKS, **ANALYSES}


def summary(function: Callable) -> str:
    return inspect.getdoc(function).splitlines()[0]


def _kind(annotation) -> tuple:
    """(what one value converts with, choices or None, whether it is a comma-separated tuple) of an annotation,
    with `Annotated` already taken off."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None
        annotation = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return type(args[0]), args, False
    if origin is tuple:
        return _kind(args[0])[0], _kind(args[0])[1], True
    return annotation, None, False


def _comma_separated(convert: Callable, choices) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        values = tuple(convert(item) for item in text.split(",") if item)
        unknown = [v for v in values if choices is not None and v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"{unknown} not among {list(choices)}")
        return values

    return parse


def _shown(default) -> str:
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)


def parser_for(name: str, function: Callable) -> argparse.ArgumentParser:
    """The command line of one entry, from `function`'s signature (see the module's docstring)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m eval.bench {name}",
        description=sys.modules[function.__module__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hints = typing.get_type_hints(function, include_extras=True)
    for parameter in inspect.signature(function).parameters.values():
        annotation = hints.get(parameter.name, str)
        help_text = None
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, help_text = typing.get_args(annotation)[:2]
        convert, choices, many = _kind(annotation)
        options = {"help": help_text}
        if many:
            options["type"] = _comma_separated(convert, choices)
        elif convert is bool:
            options["action"] = argparse.BooleanOptionalAction  # --flag / --no-flag
        else:
            options.update(type=convert, choices=choices)
        if parameter.kind is parameter.VAR_POSITIONAL:
            parser.add_argument(parameter.name, nargs="*", **options)
        elif parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
            parser.add_argument(parameter.name, **options)
        else:
            flag = "--" + parameter.name.replace("_", "-")
            if parameter.default is parameter.empty:
                parser.add_argument(flag, dest=parameter.name, required=True, **options)
            else:
                if parameter.default is not None:
                    default = f"default: {_shown(parameter.default)}"
                    options["help"] = f"{help_text} ({default})" if help_text else default
                parser.add_argument(flag, dest=parameter.name, default=parameter.default, **options)
    return parser


def call(function: Callable, arguments: argparse.Namespace):
    """`function` called with the parsed `arguments`, positional ones in their places."""
    values = dict(vars(arguments))
    positional = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            positional += values.pop(parameter.name)
        elif parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
            positional.append(values.pop(parameter.name))
    return function(*positional, **values)


def listing() -> str:
    lines = ["usage: python -m eval.bench <name> [options]   (python -m eval.bench <name> --help: its options)", ""]
    for title, entries in (("benchmarks", BENCHMARKS), ("analyses", ANALYSES)):
        lines.append(f"{title}:")
        lines += [f"  {name:<15} {summary(function)}" for name, function in entries.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return None
    name, rest = argv[0], argv[1:]
    if name not in ENTRIES:
        print(f"error: no benchmark named {name!r}\n\n{listing()}", file=sys.stderr)
        sys.exit(2)
    function = ENTRIES[name]
    arguments = parser_for(name, function).parse_args(rest)
    with one_line_errors():
        return show(call(function, arguments))
