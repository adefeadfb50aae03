"""All policy of hcpasses in one frozen object.

``HCPassesConfig.resolve(**flags)`` validates the user's flags, applies the environment overrides
and returns the config every other module reads. Nothing else in the package reads flags or the
environment.

Two kinds of flag, each defined in one place:

- one boolean per pass, named as the pass: the registry ``hcpasses.passes.PASSES`` gives their names, defaults
  and order. The config holds their values in ``pass_flags``; the manager asks ``pass_enabled(name)``.
- the options (``sp_min_tokens``, ``dump_dir``, ``cudagraphs``, ``lazy_variants``, ``overlap``): the fields made by
  ``option``, whose metadata holds their valid values, their help and their environment variable. A pass reads the
  options its ``PassSpec.reads`` names.

Environment overrides (they win over flags, so an operator can switch a pass off without touching
code):

- ``HCPASSES_DISABLE=sp_rewrite,gated_mean_quant``: turn these passes off.
- ``HCPASSES_DUMP_DIR=dir``: write graph diff dumps to ``dir``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import hcpasses.passes as registry

log = logging.getLogger("hcpasses")

ENV_DISABLE = "HCPASSES_DISABLE"
ENV_DUMP_DIR = "HCPASSES_DUMP_DIR"


@dataclasses.dataclass(frozen=True)
class Values:
    """The values a flag takes: ``phrase`` for messages and the flags table, ``accepts`` to check one."""

    phrase: str
    accepts: Callable[[Any], bool]


BOOL = Values("True or False", lambda value: isinstance(value, bool))
POSITIVE_INT = Values("an int >= 1", lambda value: type(value) is int and value >= 1)
PATH_OR_NONE = Values(
    "a non-empty path string or None", lambda value: value is None or (isinstance(value, str) and value != "")
)


def option(default: Any, values: Values, help: str, env: str | None = None) -> Any:
    """A field of ``HCPassesConfig`` that is an option: a flag that is not a pass."""
    return dataclasses.field(default=default, metadata={"values": values, "help": help, "env": env})


def _check(name: str, value: Any, values: Values) -> None:
    if not values.accepts(value):
        raise ValueError(f"hcpasses flag {name!r} must be {values.phrase}, got {value!r}")


def _registry_defaults() -> tuple[tuple[str, bool], ...]:
    return tuple((spec.name, spec.default) for spec in registry.PASSES)


@dataclasses.dataclass(frozen=True)
class HCPassesConfig:
    """The resolved configuration of one backend object.

    Attributes:
        pass_flags: ``(name, on)`` of every pass, in pipeline order (``hcpasses.passes.PASSES``); not a flag itself:
            each pass is its own flag (``backend(sp_rewrite=False)``). Read them with ``pass_enabled(name)``.
        sp_min_tokens, dump_dir, cudagraphs, lazy_variants, overlap: the options; what each means is in its field's
            ``help`` (``python -m hcpasses flags``).
        disabled_by_env: not a flag (``resolve`` refuses it): the passes ``HCPASSES_DISABLE`` turned off, in
            pipeline order, so that a report gives the environment as the reason, not a flag the user never set.
    """

    pass_flags: tuple[tuple[str, bool], ...] = dataclasses.field(default_factory=_registry_defaults)
    sp_min_tokens: int = option(1024, POSITIVE_INT, "below this many tokens SP is not worth its collectives")
    dump_dir: str | None = option(
        None,
        PATH_OR_NONE,
        "write graph diff dumps here (bypasses Inductor's caches so that every compile writes its dumps)",
        env=ENV_DUMP_DIR,
    )
    cudagraphs: bool = option(
        False,
        BOOL,
        "capture the graphs no pass sharded (decode sizes: T < sp_min_tokens) as CUDA graphs, like "
        '`mode="reduce-overhead"`; sharded graphs are never captured; their outputs are copied out of the graph\'s '
        "memory (one copy per output buffer and call), so a tensor kept across calls (a KV cache) stays valid",
    )
    lazy_variants: bool = option(
        True,
        BOOL,
        "compile the unsharded variant of a graph SP sharded with a symbolic T (decode sizes) on its first call, "
        "not beside the sharded one; if that compile adds a shape guard Dynamo would no longer check, small T runs "
        "the sharded graph instead (logged)",
    )
    overlap: bool = option(
        True,
        BOOL,
        "shape SP's all-gathers and reduce-scatters for Inductor's micro-pipeline TP, which fuses them with their "
        "GEMMs as symmetric-memory ops (where the TP group is NCCL on CUDA with > 1 rank; elsewhere off, said why)",
    )
    disabled_by_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, on in self.pass_flags:
            _check(name, on, BOOL)
        for field in self.options():
            _check(field.name, getattr(self, field.name), field.metadata["values"])
        unknown = sorted(set(self.disabled_by_env) - set(self.pass_names))
        if unknown:
            raise ValueError(
                f"disabled_by_env names unknown pass(es) {unknown}; valid passes are: {', '.join(self.pass_names)}"
            )

    @classmethod
    def options(cls) -> tuple[dataclasses.Field, ...]:
        """The fields that are options (flags that are not passes), in field order."""
        return tuple(field for field in dataclasses.fields(cls) if "values" in field.metadata)

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        """Every flag ``resolve`` takes: the passes in pipeline order, then the options."""
        return (*registry.names(), *(field.name for field in cls.options()))

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **flags: Any) -> HCPassesConfig:
        """Validate ``flags``, apply the environment overrides, log the result once at INFO.

        Raises ``ValueError`` naming the valid flags (or values) for an unknown flag, a bad value,
        or an unknown pass name in ``HCPASSES_DISABLE``.
        """
        check_registry(cls)
        unknown = sorted(set(flags) - set(cls.flag_names()))
        if unknown:
            raise ValueError(
                f"unknown hcpasses flag(s) {', '.join(unknown)}; valid flags are: {', '.join(cls.flag_names())}"
            )
        if isinstance(flags.get("dump_dir"), os.PathLike):
            flags["dump_dir"] = os.fspath(flags["dump_dir"])
        pass_flags = {name: flags.pop(name) for name in registry.names() if name in flags}
        config = cls(**flags).with_passes(**pass_flags)
        config = config._with_env(os.environ if env is None else env)
        log.info("hcpasses config: %s", config.describe())
        return config

    def _with_env(self, env: Mapping[str, str]) -> HCPassesConfig:
        disabled = [name.strip() for name in env.get(ENV_DISABLE, "").split(",") if name.strip()]
        bad = sorted(set(disabled) - set(self.pass_names))
        if bad:
            raise ValueError(
                f"{ENV_DISABLE} names unknown pass(es) {', '.join(bad)}; valid passes are: {', '.join(self.pass_names)}"
            )
        overrides: dict[str, Any] = {}
        if disabled:
            overrides["disabled_by_env"] = tuple(name for name in self.pass_names if name in disabled)
        for field in self.options():
            variable = field.metadata["env"]
            if variable and env.get(variable):
                overrides[field.name] = env[variable]
        return dataclasses.replace(self.with_passes(**dict.fromkeys(disabled, False)), **overrides)

    @property
    def pass_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.pass_flags)

    def pass_enabled(self, name: str) -> bool:
        return dict(self.pass_flags)[name]

    def with_passes(self, **flags: bool) -> HCPassesConfig:
        """This config with these passes' flags set (the backend's unsharded variant: the sharding pass off)."""
        unknown = sorted(set(flags) - set(self.pass_names))
        if unknown:
            raise ValueError(f"unknown pass(es) {', '.join(unknown)}; passes are: {', '.join(self.pass_names)}")
        return dataclasses.replace(self, pass_flags=tuple((name, flags.get(name, on)) for name, on in self.pass_flags))

    def why_disabled(self, name: str) -> str:
        """The reason a report gives for a pass that is off: the environment, or the flag."""
        if name in self.disabled_by_env:
            return f"{ENV_DISABLE} names {name}"
        return f"flag {name}=False"

    def describe(self) -> str:
        """Every flag and its value, as ``name=value``, then ``disabled_by_env``."""
        values = [*self.pass_flags, *((field.name, getattr(self, field.name)) for field in self.options())]
        values.append(("disabled_by_env", self.disabled_by_env))
        return ", ".join(f"{name}={value!r}" for name, value in values)


def check_registry(config: type[HCPassesConfig] = HCPassesConfig) -> None:
    """The registry's passes have one name each, none an option's, and read only options of the config."""
    names = registry.names()
    options = [field.name for field in config.options()]
    clashes = sorted({name for name in names if names.count(name) > 1} | (set(names) & set(options)))
    if clashes:
        raise ValueError(f"hcpasses.passes.PASSES: pass names must be unique and not an option's: {', '.join(clashes)}")
    for spec in registry.PASSES:
        unknown = sorted(set(spec.reads) - set(options))
        if unknown:
            raise ValueError(
                f"pass {spec.name} reads unknown option(s) {', '.join(unknown)}; options are: {', '.join(options)}"
            )
