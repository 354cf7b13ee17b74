"""One way to declare and dispatch commands, for the node's table (`watchdog/commands.py`), the
coordinator's queries (`refit_bridge/queries.py`) and its refit commands
(`refit_bridge/service.py`), after circus's `commands/`.

Each command is one `Command`: its name, its handler, whose docstring is both its wire spec and
its help text, and its declared arguments (`Arg`), which `validate` checks before the handler
runs. A malformed argument is refused with one `ArgumentError` that names it (code BAD_ARGS), so
handlers read arguments that are already the right type and within bounds; rules that join
several arguments, or need the core's state (does that engine exist?), stay in the handler. The
core a command acts on is passed to its handler by the transport, never imported by it.

A kind (`number`, `integer`, `flag`, `text`, `choice`, `rule`) is a callable that returns the
value as the handler gets it, or raises ValueError whose text is the problem without the
argument's name ("must be ..."): the one validator of that kind, whoever declares it. An
optional argument that is absent or null takes its default (None unless declared); a required
one is refused by its kind ("got None"); arguments that are not declared reach the handler
untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rollout_watchdog.common.protocol import BAD_ARGS, UNKNOWN_COMMAND
from rollout_watchdog.common.replies import CommandError
from rollout_watchdog.common.validate import shown

Kind = Callable[[Any], Any]
H = TypeVar("H", bound=Callable[..., Any])


class ArgumentError(CommandError, ValueError):
    """An argument that is missing or malformed: the reason names it, `argument` is its name,
    the code BAD_ARGS."""

    def __init__(self, argument: str, problem: str) -> None:
        super().__init__(f"'{argument}' {problem}", BAD_ARGS)
        self.argument = argument


@dataclass(frozen=True)
class Arg:
    """A declared argument: its name, its kind, its default (absent or null), whether the
    command needs it."""

    name: str
    kind: Kind
    default: Any = None
    required: bool = False

    def take(self, args: Mapping[str, Any]) -> Any:
        value = args.get(self.name)
        if value is None and not self.required:
            return self.default
        try:   # (a missing required one too: its kind says what it must be, "got None")
            return self.kind(value)
        except ValueError as exc:
            raise ArgumentError(self.name, str(exc)) from None


class Command(Generic[H]):
    """One command: `handler` (its docstring is the wire spec and the help text) and the
    arguments it declares."""

    def __init__(self, name: str, handler: H, args: tuple[Arg, ...]) -> None:
        self.name, self.handler, self.args = name, handler, args
        self.__doc__ = handler.__doc__

    def validate(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """`args` with every declared argument checked and converted (or its default), in the
        order they are declared; raises ArgumentError for the first one that is not valid."""
        return {**args, **{arg.name: arg.take(args) for arg in self.args}}


class Registry(Mapping[str, Command[H]]):
    """The commands of one side (the node, the coordinator), by name."""

    def __init__(self, side: str) -> None:
        self.side = side
        self._commands: dict[str, Command[H]] = {}

    def command(self, name: str, *args: Arg) -> Callable[[H], H]:
        """Register the decorated function as command `name`, taking `args`."""
        def register(handler: H) -> H:
            if name in self._commands:
                raise ValueError(f"command {name!r} is registered twice on {self.side}")
            self._commands[name] = Command(name, handler, args)
            return handler
        return register

    def lookup(self, name: str) -> Command[H]:
        """The command `name`; CommandError (UNKNOWN_COMMAND) naming the known ones if none."""
        found = self._commands.get(name)
        if found is None:
            raise CommandError(f"unknown command {name!r} (commands: "
                               f"{', '.join(sorted(self._commands))})", UNKNOWN_COMMAND)
        return found

    def __getitem__(self, name: str) -> Command[H]:
        return self._commands[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._commands)

    def __len__(self) -> int:
        return len(self._commands)


# ---------------------------------------------------------------------- kinds


def number(minimum: float = 0.0, *, above: bool = False, maximum: float | None = None) -> Kind:
    """A finite number (not a boolean) >= `minimum` (> with `above`), at most `maximum`; as
    a float."""
    bounds = f"{'>' if above else '>='} {minimum:g}" + (
        f" and <= {maximum:g}" if maximum is not None else "")

    def check(value: Any) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                got = float(value)
            except OverflowError:   # an integer too big for a float
                got = math.inf
            if math.isfinite(got) and (got > minimum if above else got >= minimum) and (
                    maximum is None or got <= maximum):
                return got
        raise ValueError(f"must be a finite number {bounds}, got {shown(value)}")
    return check


def integer(minimum: int) -> Kind:
    """An integer (not a boolean, not 2.0) >= `minimum`."""
    def check(value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return value
        raise ValueError(f"must be an integer >= {minimum}, got {shown(value)}")
    return check


def flag(value: Any) -> bool:
    """A JSON boolean: only `true` means yes (`"no"` must not)."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"must be true or false, got {shown(value)}")


def text(max_chars: int | None = None, *, empty: bool = False) -> Kind:
    """A string of at most `max_chars` characters, not empty unless `empty` (a free-text
    reason, which a holder may leave empty: its default then)."""
    wanted = "a string" if empty else "a non-empty string"
    if max_chars is not None:
        wanted = f"a string of {0 if empty else 1} to {max_chars} characters"

    def check(value: Any) -> str:
        if isinstance(value, str) and (value or empty) and (
                max_chars is None or len(value) <= max_chars):
            return value
        raise ValueError(f"must be {wanted}, got {shown(value)}")
    return check


def choice(*allowed: str) -> Kind:
    """One of `allowed`."""
    def check(value: Any) -> str:
        if isinstance(value, str) and value in allowed:
            return value
        raise ValueError(f"must be {' or '.join(map(repr, allowed))}, got {shown(value)}")
    return check


def rule(problem: Callable[[Any], str | None]) -> Kind:
    """A kind from a rule that says what is wrong with a value, or None (`common.validate`'s
    rules, a weight version's)."""
    def check(value: Any) -> Any:
        found = problem(value)
        if found is not None:
            raise ValueError(found)
        return value
    return check
