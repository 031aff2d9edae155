"""The flags of ``kvoffload serve``, one per :class:`~app.settings.Settings`
field (tokens excepted), each naming its environment variable.

A flag given on the command line wins over the environment; values are
validated by the settings model, so both spellings fail the same way.
"""

from __future__ import annotations

import argparse
import difflib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from app.settings import ENV_PREFIX, RENAMED, Settings, env_name, flag_name
from kvoffload.cli import OneLineParser

__all__ = [
    "ENV_ONLY",
    "build_parser",
    "describe_errors",
    "env_name",
    "flag_name",
    "parse_settings",
    "unknown_variables",
]

#: secrets stay out of argv, where every process listing shows them
ENV_ONLY = frozenset({"admin_token", "read_token"})

_EPILOG = f"""\
Every flag has an environment variable (shown in its help); a flag wins over its variable.

Tokens are read from the environment only, never from flags:
  {ENV_PREFIX}ADMIN_TOKEN  bearer token for state-changing routes; unset = those routes are
                          disabled and the service may only listen on loopback
  {ENV_PREFIX}READ_TOKEN   bearer token for read routes; unset = reads are open
Telemetry export is configured with the standard OTEL_* variables (nothing is exported
when no OTLP endpoint is set).
"""


def build_parser(prog: str = "kvoffload serve") -> argparse.ArgumentParser:
    # errors on one line, as every other start-up error (not the usage block)
    parser = OneLineParser(
        prog=prog,
        description="Run the kvoffload engine and its admin API (REST, SSE, /metrics).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, field in Settings.model_fields.items():
        if name in ENV_ONLY:
            continue
        if name in RENAMED:  # accepted, so that the settings say what it is called now
            parser.add_argument(
                flag_name(name), dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
            continue
        default = field.default
        help_text = f"{field.description} [env {env_name(name)}; default: {default}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            choices = _literal_choices(field.annotation)
            if choices:
                kwargs["choices"] = choices
            else:
                kwargs["metavar"] = name.upper()
        parser.add_argument(flag_name(name), **kwargs)
    return parser


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


def parse_settings(argv: Sequence[str] | None) -> Settings:
    """Settings from the environment, overridden by ``argv``. argparse errors
    exit (status 2); invalid values raise :class:`~pydantic.ValidationError`."""
    namespace = build_parser().parse_args(list(argv) if argv is not None else None)
    return Settings(**vars(namespace))


#: variables with the prefix that are not settings: the install and test scripts'
OTHER_VARIABLES = frozenset(
    ENV_PREFIX + name
    for name in (
        "PURE_PYTHON",
        "REINSTALL",
        "TORCH",
        "TORCH_SPEC",
        "VLLM_ENV",
        "VLLM_TIER",
        "VLLM_WHEEL",
    )
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``KVOFFLOAD_*`` variable that is no setting (a typo is
    otherwise ignored in silence), with the nearest setting's name."""
    known = [env_name(name) for name in Settings.model_fields]
    lines = []
    for var in sorted(environ):
        if var.startswith(ENV_PREFIX) and var not in known and var not in OTHER_VARIABLES:
            near = difflib.get_close_matches(var, known, n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            lines.append(f"{var} is not a setting and is ignored{hint}")
    return lines


def describe_errors(exc: ValidationError) -> list[str]:
    """One line per invalid setting, naming the flag and the variable."""
    lines = []
    for error in exc.errors():
        loc = error.get("loc", ())
        field = str(loc[0]) if loc else ""
        if field in Settings.model_fields:
            where = (
                env_name(field) if field in ENV_ONLY else f"{flag_name(field)} / {env_name(field)}"
            )
        else:
            where = "settings"
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        kind = str(error.get("type", ""))
        if kind.endswith("_parsing") and field not in ENV_ONLY:  # never echo a token
            message += f", got {error.get('input')!r}"
            if kind == "bool_parsing":
                message += " (use true or false; also 1/0, yes/no, on/off)"
        lines.append(f"{where}: {message}")
    return lines
