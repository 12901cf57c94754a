"""Configs from YAML files plus command-line overrides, built into the script's own dataclasses.

``parse_config(trainer=TrainerConfig, model=ModelArgs)`` reads ``--config run.yaml`` and
``--trainer.max_steps 2000``-style options with jsonargparse (the library under LightningCLI)
and returns the dataclasses built from them -- built, so a ``TrainerConfig`` is validated as
always. The dataclass *is* the config: its fields are the keys, their types are checked, their
docstrings are the help. The resolved settings are kept in the process (:func:`resolved`): the
Trainer's checkpointer writes them beside the checkpoints as ``config.yaml``, and trackers
can log them.

jsonargparse is an optional extra (``pip install 'dptrain[config]'``): it is imported by
:func:`parse_config` only, never by ``import dptrain`` or ``import dptrain.train``.

[Note: one line per mistake]
argparse answers a mistake with the usage text (30 lines for a TrainerConfig) and jsonargparse
a bad value with a block of per-type attempts; a ``ValueError`` of ``__post_init__`` comes with
a traceback. Each is one mistake, so each gets one line on stderr -- the key, the value, where
it came from (the command line or which file) and what would be valid -- and exit status 2, as
argparse uses. jsonargparse decides what is wrong; only when it has refused something does
this module look at the command line and the files itself, to say it in those terms (so it can
never refuse what jsonargparse accepts). A message it does not recognise is still shown, on
one line.

[Note: which rank says it]
Under ``dptrain run`` every rank parses the same command line, and every rank prints the
error. Printing it from rank 0 alone looks tidier but loses it: the launcher stops the job
as soon as the first rank exits, and that is often a silent one (so rank 0 is killed before it
prints), and on several nodes a ``--config`` path may exist on some nodes and not on others.
With every rank printing, each rank that gets to print says it (prefixed with its rank: the
same line once or a few times, never lost), and the launcher repeats the first one's line in
its summary. ``--help`` and ``--print_config`` are not errors: rank 0 prints them and the
others exit quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import difflib
import inspect
import os
import re
import sys
import typing
import warnings
from typing import Any, Sequence

__all__ = ["parse_config", "resolved", "ResolvedConfig"]

_INSTALL = "pip install 'dptrain[config]' (or pip install 'jsonargparse[signatures]')"
#: Option names of the parser itself, never a group's.
_RESERVED = ("config", "print_config", "help", "print_shtab")
_FLAGS = ("-h", "--help", "--print_config")  # options that take no value
_UNSERIALIZABLE = "Unable to serialize"  # how jsonargparse's dump marks a value it cannot write

_resolved: dict[str, Any] | None = None  # the settings of the last parse_config, for config.yaml and trackers


def resolved() -> dict[str, Any] | None:
    """The settings :func:`parse_config` resolved last in this process, or None if it never ran.

    A plain dict of plain values, ``{group: {key: value}}`` (a copy: changing it changes
    nothing). The Trainer's checkpointer writes it as ``config.yaml`` in ``checkpoint_dir``;
    trackers log it.
    """
    return copy.deepcopy(_resolved)


class ResolvedConfig:
    """What :func:`parse_config` returns: one built dataclass per group, and the settings as data.

    ``cfg.trainer`` (or ``cfg["trainer"]``) is the group's dataclass; ``cfg.to_dict()`` and
    ``cfg.to_yaml()`` are the resolved settings, every field included (defaults too), in the
    form a ``--config`` file takes: ``--config`` of that YAML gives the same dataclasses back.

    ``left_out`` names the fields that are not in the settings: a field whose type jsonargparse
    cannot read from text, or whose value it cannot write as YAML (an object, a lambda). They
    keep the value the dataclass gave them; set them in the script.
    """

    def __init__(self, groups: dict[str, Any], data: dict[str, Any], left_out: Sequence[str] = ()) -> None:
        self._groups = dict(groups)
        self._data = data
        self.left_out = list(left_out)

    def __getattr__(self, name: str) -> Any:
        groups = self.__dict__.get("_groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(f"this config has no group {name!r}; its groups are {sorted(groups)}")

    def __getitem__(self, name: str) -> Any:
        try:
            return self._groups[name]
        except KeyError:
            raise KeyError(f"this config has no group {name!r}; its groups are {sorted(self._groups)}") from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._groups))

    def to_dict(self) -> dict[str, Any]:
        """The resolved settings, ``{group: {key: value}}``, as plain values (a copy)."""
        return copy.deepcopy(self._data)

    def to_yaml(self) -> str:
        """The resolved settings as YAML, ready for ``--config``."""
        return _to_yaml(self._data, self.left_out)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={value!r}" for name, value in self._groups.items())
        return f"ResolvedConfig({inner})"


def parse_config(*, args: Sequence[str] | None = None, description: str | None = None,
                 exit_on_error: bool = True, **groups: Any) -> ResolvedConfig:
    """Build the script's config dataclasses from defaults, YAML files and command-line options.

    Each keyword names a group and gives its dataclass (or an instance, whose values become the
    defaults). Every field of it is an option ``--<group>.<field>`` (nested dataclasses give
    ``--<group>.<field>.<field>``), read from the class when called, so fields added later
    appear by themselves. Precedence, lowest first: the dataclass's defaults, the ``--config``
    files in the order given, files for one group (``--trainer trainer.yaml``), then the other
    options -- whatever their place on the command line. ``--help`` lists every field with its
    type, default and docstring (an attribute docstring, or the class docstring's
    ``Attributes:`` section, as TrainerConfig has); ``--print_config`` prints the resolved YAML
    and exits.

    The resolved settings are kept in the process (:func:`resolved`): with
    ``TrainerConfig(checkpoint_dir=...)`` the Trainer writes them there as ``config.yaml``.
    Fields that take objects: a field whose type jsonargparse cannot read at all is left out of
    the options, and a value that YAML cannot hold (an object, a lambda, e.g. given by an
    instance) is left out of the resolved settings (a function or class is written as its import
    path, as jsonargparse reads it). Such a field keeps the value the class or instance gave it;
    ``ResolvedConfig.left_out`` names them, and so does a comment atop ``to_yaml()``.

    Args:
        args: the command-line arguments. Default None: ``sys.argv[1:]`` (in a notebook, whose
            ``sys.argv`` is the kernel's, pass a list, e.g. ``args=[]``).
        description: the text above ``--help``'s options. Default None: none.
        exit_on_error: True (default): a mistake prints one line on stderr (the key, the value,
            where it was given, what is valid) and exits with status 2; every rank under
            ``dptrain run`` prints it. False: it raises ``ValueError`` with that line instead.
        **groups: group name -> a dataclass or a dataclass instance. ``args``,
            ``description``, ``exit_on_error``, ``config`` and ``print_config`` cannot be group names.

    Returns:
        A :class:`ResolvedConfig`: ``cfg.<group>`` is the built dataclass; ``cfg.to_dict()``,
        ``cfg.to_yaml()`` the resolved settings.

    Raises:
        ModuleNotFoundError: jsonargparse is not installed (``pip install 'dptrain[config]'``).
        ValueError: no group, or a group that is not a dataclass (a mistake in the script); with
            ``exit_on_error=False``, also a mistake in the files or on the command line.
        SystemExit: status 2 for a mistake in the files or on the command line, 0 after
            ``--help`` or ``--print_config``.

    Example:
        >>> @dataclasses.dataclass
        ... class ModelArgs:
        ...     n_layer: int = 4
        ...     \"\"\"transformer blocks\"\"\"
        >>> # python train.py --config run.yaml --model.n_layer 6
        >>> cfg = parse_config(trainer=TrainerConfig, model=ModelArgs)
        >>> trainer = dptrain.Trainer(model, opt, data, loss_fn, cfg.trainer)
    """
    global _resolved
    jsonargparse = _import_jsonargparse()
    specs = _check_groups(groups)
    argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
    if ("-h" in argv or "--help" in argv) and not _rank_zero():
        raise SystemExit(0)  # see [Note: which rank says it]
    layout = _Layout(specs)
    parser, left_out = _build_parser(jsonargparse, specs, layout, description)
    argv = _files_first(argv, layout)
    try:
        with _quiet():
            namespace = parser.parse_args(argv)
    except (argparse.ArgumentError, ValueError, TypeError) as exc:
        _fail(parser, _explain_refusal(str(exc), argv, layout), exit_on_error)
    printing = bool(namespace.pop("print_config", False))
    try:
        with _quiet():
            built = (getattr(parser, "instantiate", None) or parser.instantiate_classes)(namespace)
    except (ValueError, TypeError) as exc:  # __post_init__ refused a value
        _fail(parser, _explain_rejection(exc, argv, layout), exit_on_error)
    data, unwritable = _settings(parser, namespace, specs, layout)
    config = ResolvedConfig({name: built[name] for name in specs}, data, sorted(left_out + unwritable))
    _resolved = copy.deepcopy(data)
    if printing:
        if _rank_zero():
            print(config.to_yaml(), end="", flush=True)
        raise SystemExit(0)
    return config


# -- building the parser -------------------------------------------------------------------

@contextlib.contextmanager
def _quiet():
    """Drop jsonargparse's own warnings (notes about its deprecated internals, values it cannot
    write, which ``left_out`` reports); any other warning -- a dataclass's own -- is shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if not type(w.message).__module__.startswith("jsonargparse"):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _import_jsonargparse():
    try:
        import jsonargparse
    except ImportError as exc:
        raise ModuleNotFoundError(f"dptrain.train.parse_config reads configs with jsonargparse, which is not "
                                  f"installed: {_INSTALL}") from exc
    return jsonargparse


def _check_groups(groups: dict[str, Any]) -> dict[str, tuple[type, Any]]:
    """group -> (dataclass, instance whose values are the defaults, or None)."""
    if not groups:
        raise ValueError("parse_config() needs at least one group, e.g. parse_config(trainer=dptrain.TrainerConfig)")
    specs = {}
    for name, given in groups.items():
        cls = given if isinstance(given, type) else type(given)
        if not dataclasses.is_dataclass(cls):
            raise ValueError(
                f"parse_config({name}={given!r}): a group is a dataclass or a dataclass instance, got "
                f"{type(given).__name__}; wrap the settings in a @dataclasses.dataclass"
            )
        if name in _RESERVED or "." in name:
            raise ValueError(f"parse_config({name}=...): {name!r} cannot name a group (reserved: {list(_RESERVED)}); "
                             f"choose another keyword")
        specs[name] = (cls, None if isinstance(given, type) else given)
    return specs


class _Layout:
    """The keys the groups' dataclasses define: leaf keys with their types, nested groups, and
    which dataclass sits where (read from the classes at call time)."""

    def __init__(self, specs: dict[str, tuple[type, Any]]) -> None:
        self.leaves: dict[str, str] = {}  # "trainer.batch_size" -> "int | None"
        self.groups: set[str] = set()  # "trainer", "model", "model.opt"
        self.where: dict[type, str] = {}  # dataclass -> its (first) group path
        for name, (cls, _) in specs.items():
            self._walk(cls, name, set())

    def _walk(self, cls: type, path: str, seen: set[type]) -> None:
        self.groups.add(path)
        self.where.setdefault(cls, path)
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: read the raw ones
            hints = {}
        for f in dataclasses.fields(cls):
            if not f.init or f.name.startswith("_"):
                continue  # jsonargparse leaves these out too
            kind = hints.get(f.name, f.type)
            key = f"{path}.{f.name}"
            if isinstance(kind, type) and dataclasses.is_dataclass(kind) and kind not in seen:
                self._walk(kind, key, seen | {cls})
            else:
                self.leaves[key] = _type_text(f.type)

    def children(self, prefix: str) -> list[str]:
        """The names directly under ``prefix`` ("" for the top level)."""
        start = f"{prefix}." if prefix else ""
        keys = (k for k in (*self.leaves, *self.groups) if k.startswith(start) and k != prefix)
        return sorted({k[len(start):].split(".")[0] for k in keys})


def _type_text(kind: Any) -> str:
    if isinstance(kind, str):
        return kind
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "").replace("NoneType", "None")


def _build_parser(jsonargparse, specs: dict[str, tuple[type, Any]], layout: _Layout, description: str | None):
    """The parser, and the leaf keys it could not take (left out, see ``ResolvedConfig.left_out``)."""
    _read_attribute_docstrings(jsonargparse)
    skip: dict[str, set[str]] = {name: set() for name in specs}
    for _ in range(1 + len(layout.leaves)):  # each round leaves out one more field, or succeeds
        parser = jsonargparse.ArgumentParser(prog=_prog(), description=description, exit_on_error=False,
                                             print_config=None)
        parser.add_argument(
            "--config", action=jsonargparse.ActionConfigFile,
            help="a YAML file of settings, {group: {key: value}}; several are applied in order, before the other "
                 "options")
        parser.add_argument("--print_config", action="store_true", help="print the resolved settings as YAML and exit")
        try:
            with _quiet():
                for name, (cls, instance) in specs.items():
                    extra = {"default": instance} if instance is not None else {}
                    parser.add_class_arguments(cls, name, skip=skip[name] or None, **extra)
        except ValueError as exc:
            # jsonargparse refuses a few types outright ("Unable to add parameter ..."): leave that field out.
            m = re.search(r'parameter "(\w+)"', str(exc))
            group = next((g for g in specs if m and f"{g}.{m.group(1)}" in layout.leaves), None)
            if group is None or m.group(1) in skip[group]:
                raise ValueError(f"parse_config: jsonargparse cannot take a field of {list(specs)}: {exc}") from exc
            skip[group].add(m.group(1))
            continue
        break
    try:
        with _quiet():
            taken = set(parser.get_defaults().keys())
    except Exception:  # noqa: BLE001 - defaults that do not validate are reported when parsing
        taken = set(layout.leaves)
    left_out = [key for key in layout.leaves if key not in taken]
    return parser, left_out


def _read_attribute_docstrings(jsonargparse) -> None:
    """Have the help show a field's attribute docstring (a string literal right below the field).

    jsonargparse reads them only when told to, in a setting of the whole process (it reads the
    source; the ``Attributes:`` section of a class docstring is read either way)."""
    try:
        with _quiet():
            settings = getattr(jsonargparse, "set_parsing_settings", None)
            option = "docstring_parse_attribute_docstrings"  # jsonargparse >= 4.39; before, its own function
            if settings is not None and option in inspect.signature(settings).parameters:
                settings(**{option: True})
            else:
                jsonargparse.set_docstring_parse_options(attribute_docstrings=True)
    except Exception:  # noqa: BLE001 - without docstring-parser the help shows types and defaults only
        pass


def _prog() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def _rank_zero() -> bool:
    from dptrain.runtime import env

    try:
        return env.get_world().rank == 0
    except Exception:  # noqa: BLE001 - a malformed launcher environment is reported by dptrain.init
        return True


# -- the command line ----------------------------------------------------------------------

def _options(argv: Sequence[str]) -> list[tuple[int, int, str, str | None]]:
    """(start, end, name, value) of each option of ``argv``: ``--name value`` or ``--name=value``."""
    found, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            break
        if token.startswith("-") and len(token) > 1 and not _is_number(token):
            name, eq, value = token.lstrip("-").partition("=")
            if eq or token in _FLAGS:
                found.append((i, i + 1, name, value if eq else None))
                i += 1
                continue
            value = argv[i + 1] if i + 1 < len(argv) else None
            found.append((i, min(i + 2, len(argv)), name, value))
            i += 2
            continue
        i += 1
    return found


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def _files_first(argv: list[str], layout: _Layout) -> list[str]:
    """``argv`` with the config files (``--config``, ``--<group>``) moved to the front, in their
    order: jsonargparse applies options left to right, and an override must win over a file
    wherever it stands."""
    files, taken = [], set()
    for start, end, name, _ in _options(argv):
        if name == "config" or name in layout.groups:
            files.extend(argv[start:end])
            taken.update(range(start, end))
    rest = [token for i, token in enumerate(argv) if i not in taken]
    return files + rest


class _Sources:
    """Where each key was given: on the command line, or in which file (for the messages)."""

    def __init__(self, argv: Sequence[str], layout: _Layout) -> None:
        self.cli: dict[str, str | None] = {}
        self.files: list[tuple[str, str, Any]] = []  # (path, group prefix, content or why it cannot be read)
        for _, _, name, value in _options(argv):
            if name == "config" or name in layout.groups:
                if value is not None and os.path.isfile(value):
                    self.files.append((value, "" if name == "config" else name, _read_yaml(value)))
            elif name not in ("help", "h", "print_config"):
                self.cli[name] = value

    def describe(self, key: str) -> tuple[str, Any]:
        """Where ``key`` was given, as a phrase ("on the command line", "in run.yaml"; "" for a
        default), and its value there."""
        if key in self.cli:
            return "on the command line", self.cli[key]
        for path, prefix, content in reversed(self.files):
            found, value = _lookup(content, key, prefix)
            if found:
                return f"in {path}", value
        return "", None

    def name(self, key: str) -> str:
        """``key`` as written, and where: "--trainer.seed on the command line", "trainer.seed in run.yaml"."""
        where, _ = self.describe(key)
        if where.endswith("command line"):
            return f"--{key} on the command line"
        return f"{key} {where}" if where else f"{key}, the default"


def _read_yaml(path: str) -> Any:
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        return exc


def _lookup(content: Any, key: str, prefix: str) -> tuple[bool, Any]:
    if prefix:
        if not key.startswith(prefix + "."):
            return False, None
        key = key[len(prefix) + 1:]
    node = content
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


# -- explaining a mistake in one line (see [Note: one line per mistake]) ---------------------

def _fail(parser, line: str, exit_on_error: bool) -> typing.NoReturn:
    line = " ".join(line.split())
    if not exit_on_error:
        raise ValueError(line) from None
    print(f"{parser.prog}: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _explain_refusal(message: str, argv: Sequence[str], layout: _Layout) -> str:
    """One line for what jsonargparse refused while parsing."""
    sources = _Sources(argv, layout)
    m = re.search(r'Parser key "([^"]+)"', message)
    if m and m.group(1) in layout.leaves:
        return _bad_value(m.group(1), message, sources, layout)
    for path, prefix, content in sources.files:
        problem = _file_problem(path, prefix, content, layout)
        if problem:
            return problem
    if message.lower().startswith("unrecognized arguments:"):
        return _unrecognized(message.split(":", 1)[1].split(), layout)
    if m and m.group(1) == "config":
        return f"--config: {message.split(':', 1)[1].strip()}"
    return message


def _bad_value(key: str, message: str, sources: _Sources, layout: _Layout) -> str:
    where, value = sources.describe(key)
    if not where:
        given = re.findall(r"(?:Given|Got) value:\s*(.+)", message)
        value = given[-1].strip() if given else "?"
    detail = ""
    for line in message.splitlines()[1:]:
        line = re.sub(r"\.?\s*Got value:.*$", "", line.strip())
        if line.startswith("Expected") and not re.fullmatch(r"Expected an? <class '[\w.]+'>", line):
            detail = f"; {line[0].lower()}{line[1:]}"
            break
    written = f"--{key}" if where.endswith("command line") else key
    return f"{written}={value!r} {f'{where} ' if where else ''}is not a valid {layout.leaves[key]}{detail}"


def _file_problem(path: str, prefix: str, content: Any, layout: _Layout) -> str | None:
    """What is wrong in one config file, or None (then the problem is elsewhere)."""
    import yaml

    if isinstance(content, yaml.MarkedYAMLError):
        mark = content.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{path} is not valid YAML{at}: {content.problem or content}"
    if isinstance(content, BaseException):
        return f"{path} cannot be read: {content}"
    if not isinstance(content, dict):
        what = "nothing" if content is None else f"a {type(content).__name__}"
        return (f"{path} holds {what}, but a config file holds keys of {prefix or 'the top level'} "
                f"({', '.join(layout.children(prefix))}), e.g. {_example(prefix, layout)}")
    return _unknown_in(content, prefix, path, layout)


def _unknown_in(node: dict, prefix: str, path: str, layout: _Layout) -> str | None:
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if key in layout.leaves or (not prefix and name == "config"):
            continue
        if key in layout.groups:
            if isinstance(value, dict):
                problem = _unknown_in(value, key, path, layout)
                if problem:
                    return problem
            elif value is not None and not isinstance(value, str):  # a string names a file for the group
                return (f"{key} in {path} is {value!r}, but it is a group of settings: give its keys under it "
                        f"({', '.join(layout.children(key))})")
            continue
        return f"unknown key {key!r} in {path}{_suggest(key, layout, quote=True)}"
    return None


def _unrecognized(tokens: list[str], layout: _Layout) -> str:
    for token in tokens:
        if token.startswith("-") and not _is_number(token):
            key = token.lstrip("-").partition("=")[0]
            return f"unknown option --{key}{_suggest(key, layout, quote=False)}"
    return (f"unexpected argument {tokens[0]!r}: settings are given as --<group>.<key> VALUE (e.g. "
            f"--{next(iter(sorted(layout.leaves)))} ...) or in a --config file")


def _suggest(key: str, layout: _Layout, *, quote: bool) -> str:
    """"; did you mean X?" for a close name, else the names that are valid at that level."""
    parts = key.split(".")
    depth = 1
    while depth < len(parts) and ".".join(parts[:depth]) in layout.groups:
        depth += 1
    prefix, wrong = ".".join(parts[: depth - 1]), parts[depth - 1]
    names = layout.children(prefix)
    close = difflib.get_close_matches(wrong, names, n=1, cutoff=0.6)
    show = (lambda k: repr(k)) if quote else (lambda k: f"--{k}")  # noqa: E731
    if close:
        return f"; did you mean {show('.'.join(filter(None, [prefix, close[0], *parts[depth:]])))}?"
    where = f"the keys of {prefix}" if prefix else "the groups"
    return f"; {where} are: {', '.join(names)}"


def _example(prefix: str, layout: _Layout) -> str:
    key = next(k for k in sorted(layout.leaves) if k.startswith(f"{prefix}." if prefix else ""))
    parts = key[len(prefix) + 1:].split(".") if prefix else key.split(".")
    return "{" + ": {".join(parts) + ": ...}" + "}" * (len(parts) - 1)


def _explain_rejection(exc: BaseException, argv: Sequence[str], layout: _Layout) -> str:
    """One line for a value the dataclass itself refused (its ``__post_init__``)."""
    message = " ".join(str(exc).split())
    owner = None
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame whose `self` is one of the groups' dataclasses
        candidate = tb.tb_frame.f_locals.get("self")
        if type(candidate) in layout.where:
            owner = type(candidate)
        tb = tb.tb_next
    if owner is None:  # not a dataclass's own check: a file may hold something jsonargparse let through
        sources = _Sources(argv, layout)
        problems = (_file_problem(path, prefix, content, layout) for path, prefix, content in sources.files)
        return next((p for p in problems if p), message)
    path = layout.where[owner]
    m = re.search(rf"\b{re.escape(owner.__name__)}\((\w+)=", message)
    if m and f"{path}.{m.group(1)}" in layout.leaves:
        return f"{message} ({_Sources(argv, layout).name(f'{path}.{m.group(1)}')})"
    return f"{path}: {message}"


# -- the resolved settings -------------------------------------------------------------------

def _settings(parser, namespace, specs, layout: _Layout) -> tuple[dict[str, Any], list[str]]:
    """The groups' settings as plain data, and the keys whose values cannot be written as YAML
    (left out whole: half a dict of settings would read back as another setting)."""
    import yaml

    # Keep the keys whose value is None: a field whose default is not None was set to null.
    keep_none = "skip_unset" if "skip_unset" in inspect.signature(parser.dump).parameters else "skip_none"
    try:
        with _quiet():
            text = parser.dump(namespace, format="yaml", **{keep_none: False})
        loaded = yaml.safe_load(text) or {}
    except Exception:  # noqa: BLE001 - a value YAML cannot hold (an object among the defaults): plain values only
        loaded = namespace.as_dict()
    data = {name: loaded.get(name) or {} for name in specs}
    unwritable = []
    for key in layout.leaves:
        parent, name = _parent(data, key)
        if parent is None or name not in parent:
            continue
        try:
            parent[name] = _plain(parent[name])
        except TypeError:
            del parent[name]
            unwritable.append(key)
    return data, unwritable


def _parent(data: dict, key: str) -> tuple[dict | None, str]:
    *path, name = key.split(".")
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), name


def _plain(value: Any) -> Any:
    """``value`` as YAML's plain values (lists for tuples); TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, str) and value.startswith(_UNSERIALIZABLE):
            raise TypeError(value)
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, (str, int, float, bool)) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace (a class_path/init_args spec)
        return _plain(value.as_dict())
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if callable(value) and module and name and "<" not in name:  # a function or class: its import path,
        return f"{module}.{name}"  # as jsonargparse writes and reads it
    raise TypeError(f"{type(value).__name__} is not a plain value")


def _to_yaml(data: dict[str, Any], left_out: Sequence[str] = ()) -> str:
    import yaml

    head = ""
    if left_out:
        head = f"# not in this file (set in the script, not from a config): {', '.join(left_out)}\n"
    return head + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
