"""The command line of the training scripts: a run's options are the fields of a frozen configuration dataclass.

Each option is declared once, as a field with :func:`option` metadata (help text, help group, extra flag names,
argparse type). :func:`build_parser` turns the fields into an ``argparse`` parser with one ``--<field name>`` flag
each; :func:`parse_config` parses and builds the frozen configuration, which fills the defaults it derives and checks
the options against each other as it is built.

transformers' ``HfArgumentParser`` does the same for plain dataclasses, but it would make transformers a dependency
of every training run, and it has no help groups, argparse types or flag aliases; this module is the small part of
it the scripts need.

The library raises ``ValueError`` naming parameters as Python spells them (``P_std must be positive``); a command-line
user reads flags, so :func:`script_main` rewrites the parameter names of a configuration into its flags in one place
(:func:`flag_message`).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from tqdm.auto import tqdm


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: str,
    aliases: Sequence[str] = (),
    type: Callable[[str], Any] | None = None,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    negatable: bool = False,
    parameter: str | None = None,
    nargs: str | None = None,
) -> Any:
    """A configuration field that is also a command-line option ``--<field name>``.

    ``aliases``: more flags for the same option (e.g. diffusers' names); ``type``: argparse's converter of one value
    (default: from the annotation); ``negatable``: a boolean that also has ``--no-<name>``; ``parameter``: the name
    the library's errors use for this option (``lsc_method`` for ``--lsc``; a one-word field's own name), so that
    :func:`flag_message` writes it as the flag.
    Tuple-typed fields take any number of values (``nargs="*"``) unless ``nargs`` says otherwise (``"+"``).
    """
    metadata = dict(
        help=help, group=group, aliases=tuple(aliases), type=type, choices=choices, metavar=metavar,
        negatable=negatable, parameter=parameter, nargs=nargs,
    )  # fmt: skip
    if isinstance(default, list | tuple):
        return dataclasses.field(default=tuple(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _value_type(annotation: Any) -> tuple[Any, bool]:
    """``(element type, is a tuple)`` of a field annotation such as ``int | None`` or ``tuple[float, ...]``."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        return _value_type(args[0])
    if typing.get_origin(annotation) is tuple:
        return args[0], True
    return annotation, False


def _add_option(group: argparse._ArgumentGroup, field: dataclasses.Field, hints: dict, config_class: type) -> None:
    meta = field.metadata
    flags = [f"--{field.name}", *meta["aliases"]]
    default = None if field.default is dataclasses.MISSING else field.default
    help_text = flag_message(meta["help"], config_class)
    shown = not (default is None or default is False or default == ()) and "default" not in help_text
    if shown:
        help_text += f" (default: {' '.join(map(str, default)) if isinstance(default, tuple) else default})"
    kwargs: dict[str, Any] = dict(dest=field.name, help=help_text, default=default)
    value_type, is_tuple = _value_type(hints[field.name])
    if value_type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
        if meta["negatable"]:
            kwargs["help"] = flag_message(meta["help"], config_class)  # argparse appends the default of --x / --no-x
        group.add_argument(*flags, **kwargs)
        return
    kwargs.update(type=meta["type"] or value_type, choices=meta["choices"], metavar=meta["metavar"])
    if field.default is dataclasses.MISSING:
        kwargs.update(required=True)
        del kwargs["default"]
    if is_tuple:
        kwargs["nargs"] = meta["nargs"] or "*"
    group.add_argument(*flags, **kwargs)


def build_parser(config_class: type, description: str) -> argparse.ArgumentParser:
    """An ``argparse`` parser with one option per field of ``config_class``, in help groups in field order."""
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(config_class)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field in dataclasses.fields(config_class):
        if "group" not in field.metadata:
            continue
        name = field.metadata["group"]
        if name not in groups:
            groups[name] = parser.add_argument_group(name)
        _add_option(groups[name], field, hints, config_class)
    return parser


def parse_config(parser: argparse.ArgumentParser, config_class: type, argv: Sequence[str] | None):
    """Parse ``argv`` with ``parser`` (:func:`build_parser`) into a frozen ``config_class`` (which fills the defaults
    it derives and checks how the options combine as it is built)."""
    values = {key: tuple(v) if isinstance(v, list) else v for key, v in vars(parser.parse_args(argv)).items()}
    return config_class(**values)


def flag_names(config_class: type) -> dict[str, str]:
    """``{parameter name: flag}`` of a configuration: the field names with an underscore (``max_train_steps``) and
    the ``parameter`` names given to :func:`option`. A one-word field name (``seed``, ``model``) is also an everyday
    word, so it is rewritten only where its option names it as its ``parameter``."""
    names = {}
    for field in dataclasses.fields(config_class):
        if "_" in field.name:
            names[field.name] = f"--{field.name}"
        if field.metadata.get("parameter"):
            names[field.metadata["parameter"]] = f"--{field.name}"
    return names


def flag_message(message: str, config_class: type) -> str:
    """``message`` with the parameter names of ``config_class`` written as its flags (``P_std`` -> ``--P_std``).

    Only whole words are rewritten, never inside a path, a longer identifier or an existing flag.
    """
    names = flag_names(config_class)
    pattern = re.compile(
        r"(?<![\w./-])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")(?![\w/])"
    )
    return pattern.sub(lambda match: names[match.group(1)], message)


class _ProgressBarSafeHandler(logging.StreamHandler):
    """Writes each log line through ``tqdm.write``: above a progress bar, never on its line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's own contract: a failing handler reports and carries on
            self.handleError(record)


def set_up_logging() -> None:
    """Log lines of this package at INFO level, of other libraries at WARNING, on standard error, each on a line of
    its own (also while a progress bar is shown)."""
    handler = _ProgressBarSafeHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("diffusers_scalelong").setLevel(logging.INFO)


def script_main(
    config_class: type, train: Callable[[Any], Any], description: str
) -> Callable[[Sequence[str] | None], int]:
    """The ``main(argv) -> exit status`` of a training script: parse -> configuration -> ``train(config)``.

    Bad input (``ValueError``) or a Hub that cannot be reached or refuses the credentials (``HubAccessError``) exits
    with status 2 and one line naming the flags; a diverged loss, or a checkpoint the disk has no room for, exits with
    status 1 and one line naming what is intact.
    """
    from ..hub.access import HubAccessError
    from .checkpoint import Checkpoint, CheckpointWriteError
    from .trainer import TrainingDiverged

    def main(argv: Sequence[str] | None = None) -> int:
        parser = build_parser(config_class, description)
        try:
            config = parse_config(parser, config_class, argv)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {flag_message(str(error), config_class)}\n")
        set_up_logging()
        try:
            train(config)
        except (ValueError, HubAccessError) as error:
            parser.exit(2, f"{parser.prog}: error: {flag_message(str(error), config_class)}\n")
        except CheckpointWriteError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except TrainingDiverged as error:
            found = Checkpoint.find_all(config.output_dir)
            where = f"The last good checkpoint is {found[-1]}; " if found else "No checkpoint was written yet; "
            print(
                f"error: {error}; training stopped. {where}lower --learning_rate and resume with "
                "--resume_from_checkpoint latest.",
                file=sys.stderr,
            )
            return 1
        return 0

    return main


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run a training script's ``main()`` and end the process with its exit status.

    A process started by ``accelerate launch`` or ``torchrun`` (``WORLD_SIZE`` > 1) runs Python's exit functions
    (trackers and log handlers flush there), then ends without tearing the interpreter down: torch keeps the gloo
    process group FSDP2 used alive after ``destroy_process_group``, and its worker threads, meeting the interpreter's
    teardown, abort a process that has written everything ("terminate called without an active exception"; 5 of 60
    two-process runs of a 3-step FSDP2 script on a busy 2-core machine, none of 60 ending this way).
    """
    try:
        code = main()
    except SystemExit as exit_request:  # argparse's exits: --help, refused options
        code = exit_request.code
    if code is not None and not isinstance(code, int):  # sys.exit("message") prints it and exits with 1
        print(code, file=sys.stderr)
        code = 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()  # what a normal exit runs before the teardown (CPython's own, underscored, entry)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
