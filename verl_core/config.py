"""Typed configuration: pydantic models that reject unknown keys and load from YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from verl_core.errors import UserError

T = TypeVar("T", bound="StrictConfig")


class ConfigError(UserError, ValueError):
    """A configuration that cannot be used: unknown key, wrong type, bad value."""

    exit_code = 2  # a usage error, like argparse's


class StrictConfig(BaseModel):
    """Base for every config: unknown keys are an error, assignments are validated."""

    # allow_inf_nan=False: a NaN or inf hyper-parameter (learning_rate: .inf passes gt=0) is an error
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(_describe(err, type(self).__name__, "arguments")) from None

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any], *, source: str = "config") -> T:
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_describe(err, cls.__name__, source)) from None

    @classmethod
    def from_yaml(cls: type[T], path: str | Path, overrides: dict[str, Any] | None = None) -> T:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:  # a stream, so that YAML errors name the file
                data = yaml.safe_load(f) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
        for dotted, value in (overrides or {}).items():
            set_dotted(data, dotted, value)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_describe(err, cls.__name__, str(path), set(overrides or {}))) from None

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))

    def updated(self: T, **changes: Any) -> T:
        """A validated copy with ``changes`` applied (unknown keys rejected)."""
        return type(self).from_dict({**self.model_dump(), **changes}, source=type(self).__name__)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_dotted(d, "sft.learning_rate", 1e-4)`` sets ``d["sft"]["learning_rate"]``."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a mapping")
    node[keys[-1]] = value


def _describe(err: ValidationError, name: str, source: str, overridden: set[str] = frozenset()) -> str:
    """One line per problem; a key set by an override (``--set``) is blamed on it, not on the file."""
    lines = [f"invalid {name} in {source}" + (" with overrides:" if overridden else ":")]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        by = next((k for k in overridden if where == k or where.startswith(k + ".") or k.startswith(where + ".")), None)
        if by is not None:
            where = f"{where} (from --set {by})"
        nested = (e.get("ctx") or {}).get("error")
        if isinstance(nested, ConfigError) and len(str(nested).splitlines()) == 1:  # a validator's own message
            lines.append(f"  {where}: {nested} (got {e.get('input')!r})")
        elif isinstance(nested, ConfigError):  # a section's own validation: its lines, prefixed with where it sits
            prefix = "" if where == "(top level)" else f"{where}."
            for line in str(nested).splitlines()[1:]:
                inner = line.strip()
                if inner.startswith("unknown key '"):
                    inner = f"unknown key '{prefix}{inner[len('unknown key ') + 1 :]}"
                else:
                    inner = prefix + inner
                lines.append(f"  {inner}" + (f" (from --set {by})" if by else ""))
        elif e["type"] == "extra_forbidden":
            lines.append(f"  unknown key {where!r}")
        else:
            lines.append(f"  {where}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)
