"""``HCPassesConfig``'s exact messages, its flag list, its description and its environment bookkeeping (the
promises of ``config.py``'s docstring; ``tests/test_config.py`` holds the rest), and the config's side of the
registry (``hcpasses.passes.PASSES``): its pass flags follow the registry, and a registry that cannot work is
refused. Fast tests for the mutation run."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch.fx as fx

import hcpasses.passes as registry
from hcpasses.config import BOOL, PATH_OR_NONE, POSITIVE_INT, HCPassesConfig, check_registry, option
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.passes import PassSpec

PASS_NAMES = ("canonical_forms", "gated_mean_quant", "sp_rewrite", "blocked_scans", "cleanup")
FLAGS = (*PASS_NAMES, "sp_min_tokens", "dump_dir", "cudagraphs", "lazy_variants", "overlap")


class Extra(GraphPass):
    name = "extra"

    def run(self, graph: fx.Graph, config: HCPassesConfig) -> PassResult:
        return PassResult(0, "nothing")


def with_extra(monkeypatch, *, default: bool = False, reads: tuple[str, ...] = (), name: str | None = None) -> None:
    """The registry with one more pass, between sp_rewrite and blocked_scans (named ``name`` when given)."""
    extra = type("Extra", (Extra,), {"name": name or "extra"})
    specs = list(registry.PASSES)
    specs.insert(3, PassSpec(extra, default, "an extra pass", reads))
    monkeypatch.setattr(registry, "PASSES", tuple(specs))


def test_the_flags_are_the_passes_then_the_options() -> None:
    assert HCPassesConfig.flag_names() == FLAGS
    assert [field.name for field in HCPassesConfig.options()] == list(FLAGS[len(PASS_NAMES) :])
    with pytest.raises(ValueError, match="unknown hcpasses flag"):
        HCPassesConfig.resolve(env={}, disabled_by_env=("cleanup",))  # bookkeeping, not a flag
    with pytest.raises(ValueError, match="unknown hcpasses flag"):
        HCPassesConfig.resolve(env={}, pass_flags=())  # the values of the pass flags, not a flag


def test_unknown_flags_message_names_them_and_every_valid_flag() -> None:
    with pytest.raises(ValueError) as err:
        HCPassesConfig.resolve(env={}, sp_rewirte=True, fusion=False)
    assert str(err.value) == f"unknown hcpasses flag(s) fusion, sp_rewirte; valid flags are: {', '.join(FLAGS)}"


def test_env_disable_message_names_the_unknown_passes_and_every_valid_pass() -> None:
    with pytest.raises(ValueError) as err:
        HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "sp,cleanup,fusion"})
    assert str(err.value) == (
        f"HCPASSES_DISABLE names unknown pass(es) fusion, sp; valid passes are: {', '.join(PASS_NAMES)}"
    )
    with pytest.raises(ValueError) as err:
        HCPassesConfig(disabled_by_env=("cleanup", "sp"))
    assert str(err.value) == f"disabled_by_env names unknown pass(es) ['sp']; valid passes are: {', '.join(PASS_NAMES)}"


def test_sp_min_tokens_of_one_is_valid() -> None:
    assert HCPassesConfig.resolve(env={}, sp_min_tokens=1).sp_min_tokens == 1


def test_env_bookkeeping_and_the_reason_a_pass_is_off() -> None:
    config = HCPassesConfig.resolve(env={"HCPASSES_DISABLE": " cleanup ,, sp_rewrite,"}, gated_mean_quant=False)
    assert config.disabled_by_env == ("sp_rewrite", "cleanup")  # in pipeline order
    assert [config.pass_enabled(name) for name in PASS_NAMES] == [True, False, False, True, False]
    assert config.why_disabled("cleanup") == "HCPASSES_DISABLE names cleanup"
    assert config.why_disabled("gated_mean_quant") == "flag gated_mean_quant=False"
    assert HCPassesConfig.resolve(env={"HCPASSES_DISABLE": ""}) == HCPassesConfig()
    assert HCPassesConfig.resolve(env={"HCPASSES_DUMP_DIR": ""}).dump_dir is None


def test_describe_lists_every_field_and_the_log_line_is_exact(caplog) -> None:
    config = HCPassesConfig(sp_min_tokens=8, dump_dir="d")
    assert config.describe() == (
        "canonical_forms=True, gated_mean_quant=True, sp_rewrite=True, blocked_scans=True, cleanup=True, "
        "sp_min_tokens=8, dump_dir='d', cudagraphs=False, lazy_variants=True, overlap=True, disabled_by_env=()"
    )
    with caplog.at_level(logging.INFO, logger="hcpasses"):
        HCPassesConfig.resolve(env={}, sp_min_tokens=8, dump_dir="d")
    assert [r.getMessage() for r in caplog.records if r.name == "hcpasses"] == [f"hcpasses config: {config.describe()}"]


def test_the_pass_flags_follow_the_registry_in_order() -> None:
    config = HCPassesConfig.resolve(env={}, cleanup=False)
    assert config.pass_flags == (
        ("canonical_forms", True),
        ("gated_mean_quant", True),
        ("sp_rewrite", True),
        ("blocked_scans", True),
        ("cleanup", False),
    )
    assert config.pass_names == PASS_NAMES == registry.names()
    assert HCPassesConfig().pass_flags == tuple((spec.name, spec.default) for spec in registry.PASSES)


def test_with_passes_sets_only_the_named_flags_and_refuses_unknown_passes() -> None:
    config = HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "cleanup"}, sp_min_tokens=5)
    off = config.with_passes(sp_rewrite=False)
    assert [off.pass_enabled(name) for name in PASS_NAMES] == [True, True, False, True, False]
    assert off == dataclasses.replace(config, pass_flags=off.pass_flags)  # the options and the env reasons kept
    assert off.with_passes(sp_rewrite=True) == config and config.with_passes() == config
    with pytest.raises(ValueError) as err:
        config.with_passes(sp=False, fusion=True)
    assert str(err.value) == f"unknown pass(es) fusion, sp; passes are: {', '.join(PASS_NAMES)}"
    with pytest.raises(ValueError, match="'sp_rewrite' must be True or False, got 0"):
        config.with_passes(sp_rewrite=0)


@pytest.mark.parametrize(
    ("values", "good", "bad"),
    [
        (BOOL, [True, False], [0, 1, None, "True"]),
        (POSITIVE_INT, [1, 2, 1 << 40], [0, -1, 1.0, True, "8", None]),
        (PATH_OR_NONE, [None, "d", "a/b"], ["", 0, b"d"]),
    ],
)
def test_each_kind_of_value_accepts_exactly_its_values(values, good: list, bad: list) -> None:
    assert [values.accepts(v) for v in good] == [True] * len(good)
    assert [values.accepts(v) for v in bad] == [False] * len(bad)


def test_an_option_is_a_field_with_its_default_values_help_and_env_variable() -> None:
    field = option(3, POSITIVE_INT, "some help", env="HCPASSES_X")
    assert (field.default, dict(field.metadata)) == (
        3,
        {"values": POSITIVE_INT, "help": "some help", "env": "HCPASSES_X"},
    )
    assert dict(option(None, BOOL, "h").metadata) == {"values": BOOL, "help": "h", "env": None}


def test_every_option_has_help_values_and_its_env_variable() -> None:
    options = {field.name: field.metadata for field in HCPassesConfig.options()}
    assert {name: meta["values"] for name, meta in options.items()} == {
        "sp_min_tokens": POSITIVE_INT,
        "dump_dir": PATH_OR_NONE,
        "cudagraphs": BOOL,
        "lazy_variants": BOOL,
        "overlap": BOOL,
    }
    assert {name: meta["env"] for name, meta in options.items()} == {
        "sp_min_tokens": None,
        "dump_dir": "HCPASSES_DUMP_DIR",
        "cudagraphs": None,
        "lazy_variants": None,
        "overlap": None,
    }
    assert all(meta["help"] for meta in options.values())


def test_a_pass_added_to_the_registry_is_a_flag_with_its_default(monkeypatch) -> None:
    with_extra(monkeypatch)
    assert HCPassesConfig.flag_names() == (
        *PASS_NAMES[:3],
        "extra",
        "blocked_scans",
        "cleanup",
        *FLAGS[len(PASS_NAMES) :],
    )
    config = HCPassesConfig.resolve(env={})
    assert config.pass_names == (*PASS_NAMES[:3], "extra", "blocked_scans", "cleanup")
    assert config.pass_enabled("extra") is False
    assert "sp_rewrite=True, extra=False, blocked_scans=True, cleanup=True" in config.describe()
    assert HCPassesConfig.resolve(env={}, extra=True).pass_enabled("extra") is True
    with pytest.raises(ValueError, match="'extra' must be True or False, got 'yes'"):
        HCPassesConfig.resolve(env={}, extra="yes")
    by_env = HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "extra"}, extra=True)
    assert by_env.why_disabled("extra") == "HCPASSES_DISABLE names extra" and not by_env.pass_enabled("extra")
    with pytest.raises(
        ValueError, match="valid passes are: canonical_forms, gated_mean_quant, sp_rewrite, extra, blocked_scans, clean"
    ):
        HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "fusion"})


def test_a_pass_removed_from_the_registry_is_no_flag(monkeypatch) -> None:
    monkeypatch.setattr(registry, "PASSES", tuple(spec for spec in registry.PASSES if spec.name != "sp_rewrite"))
    with pytest.raises(ValueError) as err:
        HCPassesConfig.resolve(env={}, sp_rewrite=False)
    assert str(err.value) == (
        "unknown hcpasses flag(s) sp_rewrite; valid flags are: canonical_forms, gated_mean_quant, blocked_scans, "
        "cleanup, sp_min_tokens, dump_dir, cudagraphs, lazy_variants, overlap"
    )
    with pytest.raises(ValueError, match="HCPASSES_DISABLE names unknown pass"):
        HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "sp_rewrite"})


@pytest.mark.parametrize(
    ("name", "reads", "message"),
    [
        ("cleanup", (), "hcpasses.passes.PASSES: pass names must be unique and not an option's: cleanup"),
        ("dump_dir", (), "hcpasses.passes.PASSES: pass names must be unique and not an option's: dump_dir"),
        (
            None,
            ("sp_min_tokens", "tokens", "dumps"),
            "pass extra reads unknown option(s) dumps, tokens; options are: "
            "sp_min_tokens, dump_dir, cudagraphs, lazy_variants, overlap",
        ),
    ],
    ids=["duplicate", "an option's name", "reads no option"],
)
def test_a_registry_that_cannot_work_is_refused(monkeypatch, name, reads, message: str) -> None:
    with_extra(monkeypatch, name=name, reads=reads)
    with pytest.raises(ValueError) as err:
        HCPassesConfig.resolve(env={})
    assert str(err.value) == message
    with pytest.raises(ValueError):
        check_registry()


def test_every_clash_is_named(monkeypatch) -> None:
    clashing = [type("P", (Extra,), {"name": name}) for name in ("cleanup", "dump_dir")]
    extra = tuple(PassSpec(cls, True, "clashes") for cls in clashing)
    monkeypatch.setattr(registry, "PASSES", (*registry.PASSES, *extra))
    with pytest.raises(ValueError) as err:
        check_registry()
    assert str(err.value).endswith("must be unique and not an option's: cleanup, dump_dir")


def test_the_registry_passes_its_own_check() -> None:
    check_registry()  # raises otherwise
    assert [spec.reads for spec in registry.PASSES] == [(), (), ("sp_min_tokens", "overlap"), (), ()]
