"""``HCPassesConfig``'s exact messages, its flag list, its description and its environment bookkeeping (the
promises of ``config.py``'s docstring; ``tests/test_config.py`` holds the rest). Fast tests for the mutation run."""

from __future__ import annotations

import logging

import pytest

from hcpasses.config import PASS_NAMES, HCPassesConfig

FLAGS = ("canonical_forms", "cleanup", "gated_mean_quant", "sp_rewrite", "sp_min_tokens", "dump_dir", "cudagraphs")


def test_the_flags_are_the_fields_a_user_sets() -> None:
    assert HCPassesConfig.flag_names() == FLAGS
    with pytest.raises(ValueError, match="unknown hcpasses flag"):
        HCPassesConfig.resolve(env={}, disabled_by_env=("cleanup",))  # bookkeeping, not a flag


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
    assert [config.pass_enabled(name) for name in PASS_NAMES] == [True, False, False, False]
    assert config.why_disabled("cleanup") == "HCPASSES_DISABLE names cleanup"
    assert config.why_disabled("gated_mean_quant") == "flag gated_mean_quant=False"
    assert HCPassesConfig.resolve(env={"HCPASSES_DISABLE": ""}) == HCPassesConfig()
    assert HCPassesConfig.resolve(env={"HCPASSES_DUMP_DIR": ""}).dump_dir is None


def test_describe_lists_every_field_and_the_log_line_is_exact(caplog) -> None:
    config = HCPassesConfig(sp_min_tokens=8, dump_dir="d")
    assert config.describe() == (
        "canonical_forms=True, cleanup=True, gated_mean_quant=True, sp_rewrite=True, sp_min_tokens=8, "
        "dump_dir='d', cudagraphs=False, disabled_by_env=()"
    )
    with caplog.at_level(logging.INFO, logger="hcpasses"):
        HCPassesConfig.resolve(env={}, sp_min_tokens=8, dump_dir="d")
    assert [r.getMessage() for r in caplog.records if r.name == "hcpasses"] == [f"hcpasses config: {config.describe()}"]
