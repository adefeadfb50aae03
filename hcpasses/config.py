"""All policy of hcpasses in one frozen object.

``HCPassesConfig.resolve(**flags)`` validates the user's flags, applies the environment overrides
and returns the config every other module reads. Nothing else in the package reads flags or the
environment.

Environment overrides (they win over flags, so an operator can switch a pass off without touching
code):

- ``HCPASSES_DISABLE=sp_rewrite,gated_mean_quant``: turn these passes off.
- ``HCPASSES_DUMP_DIR=dir``: write graph diff dumps to ``dir``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("hcpasses")

# One boolean flag per pass, in the order the manager runs them.
PASS_NAMES: tuple[str, ...] = ("canonical_forms", "gated_mean_quant", "sp_rewrite", "cleanup")

ENV_DISABLE = "HCPASSES_DISABLE"
ENV_DUMP_DIR = "HCPASSES_DUMP_DIR"


@dataclasses.dataclass(frozen=True)
class HCPassesConfig:
    """The resolved configuration of one backend object.

    Attributes:
        canonical_forms: rewrite equivalent quant spellings into the fusion's form (exact rewrites only).
        cleanup: run the built-in cleanup pass (removes ops whose results nothing uses).
        gated_mean_quant: fuse the HC gated mean with the per-token FP8 quant that follows it.
        sp_rewrite: shard the HC residual streams by tokens across TP ranks.
        sp_min_tokens: below this many tokens the SP rewrite is not worth its collectives.
        dump_dir: where graph diff dumps go; ``None`` writes none.
        cudagraphs: capture the unsharded graphs (T < sp_min_tokens: decode sizes) as CUDA graphs,
            like ``mode="reduce-overhead"``; sharded graphs are never captured.
        disabled_by_env: not a flag (``resolve`` refuses it): the passes ``HCPASSES_DISABLE`` turned off, in
            pipeline order, so that a report gives the environment as the reason, not a flag the user never set.
    """

    canonical_forms: bool = True
    cleanup: bool = True
    gated_mean_quant: bool = True
    sp_rewrite: bool = True
    sp_min_tokens: int = 1024
    dump_dir: str | None = None
    cudagraphs: bool = False
    disabled_by_env: tuple[str, ...] = dataclasses.field(default=(), metadata={"flag": False})

    def __post_init__(self) -> None:
        for name in (*PASS_NAMES, "cudagraphs"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"hcpasses flag {name!r} must be True or False, got {value!r}")
        if isinstance(self.sp_min_tokens, bool) or not isinstance(self.sp_min_tokens, int):
            raise ValueError(f"hcpasses flag 'sp_min_tokens' must be an int >= 1, got {self.sp_min_tokens!r}")
        if self.sp_min_tokens < 1:
            raise ValueError(f"hcpasses flag 'sp_min_tokens' must be an int >= 1, got {self.sp_min_tokens}")
        if self.dump_dir is not None and (not isinstance(self.dump_dir, str) or not self.dump_dir):
            raise ValueError(f"hcpasses flag 'dump_dir' must be a non-empty path string or None, got {self.dump_dir!r}")
        unknown = sorted(set(self.disabled_by_env) - set(PASS_NAMES))
        if unknown:
            raise ValueError(
                f"disabled_by_env names unknown pass(es) {unknown}; valid passes are: {', '.join(PASS_NAMES)}"
            )

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls) if field.metadata.get("flag", True))

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **flags: Any) -> HCPassesConfig:
        """Validate ``flags``, apply the environment overrides, log the result once at INFO.

        Raises ``ValueError`` naming the valid flags (or values) for an unknown flag, a bad value,
        or an unknown pass name in ``HCPASSES_DISABLE``.
        """
        unknown = sorted(set(flags) - set(cls.flag_names()))
        if unknown:
            raise ValueError(
                f"unknown hcpasses flag(s) {', '.join(unknown)}; valid flags are: {', '.join(cls.flag_names())}"
            )
        if isinstance(flags.get("dump_dir"), os.PathLike):
            flags["dump_dir"] = os.fspath(flags["dump_dir"])
        config = cls(**flags)
        config = config._with_env(os.environ if env is None else env)
        log.info("hcpasses config: %s", config.describe())
        return config

    def _with_env(self, env: Mapping[str, str]) -> HCPassesConfig:
        overrides: dict[str, Any] = {}
        disabled = [name.strip() for name in env.get(ENV_DISABLE, "").split(",") if name.strip()]
        bad = sorted(set(disabled) - set(PASS_NAMES))
        if bad:
            raise ValueError(
                f"{ENV_DISABLE} names unknown pass(es) {', '.join(bad)}; valid passes are: {', '.join(PASS_NAMES)}"
            )
        overrides.update(dict.fromkeys(disabled, False))
        if disabled:
            overrides["disabled_by_env"] = tuple(name for name in PASS_NAMES if name in disabled)
        if env.get(ENV_DUMP_DIR):
            overrides["dump_dir"] = env[ENV_DUMP_DIR]
        return dataclasses.replace(self, **overrides) if overrides else self

    def pass_enabled(self, name: str) -> bool:
        return bool(getattr(self, name))

    def why_disabled(self, name: str) -> str:
        """The reason a report gives for a pass that is off: the environment, or the flag."""
        if name in self.disabled_by_env:
            return f"{ENV_DISABLE} names {name}"
        return f"flag {name}=False"

    def describe(self) -> str:
        return ", ".join(f"{field.name}={getattr(self, field.name)!r}" for field in dataclasses.fields(self))
