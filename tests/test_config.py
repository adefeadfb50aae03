"""Flag validation, environment overrides and the config log line."""

from __future__ import annotations

import logging
import re

import pytest

import hcpasses
from hcpasses.config import HCPassesConfig
from hcpasses.passes import names


def test_defaults_match_the_public_contract() -> None:
    config = HCPassesConfig.resolve(env={})
    assert [config.pass_enabled(name) for name in names()] == [True, True, True, True, True]
    assert config.sp_min_tokens == 1024
    assert config.dump_dir is None


def test_unknown_flag_names_every_valid_flag() -> None:
    with pytest.raises(ValueError) as err:
        hcpasses.backend(sp_rewirte=True)
    message = str(err.value)
    assert "sp_rewirte" in message
    for flag in (
        "canonical_forms",
        "gated_mean_quant",
        "sp_rewrite",
        "blocked_scans",
        "cleanup",
        "sp_min_tokens",
        "dump_dir",
        "cudagraphs",
    ):
        assert flag in message


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"sp_rewrite": 1}, "'sp_rewrite' must be True or False, got 1"),
        ({"gated_mean_quant": "yes"}, "'gated_mean_quant' must be True or False, got 'yes'"),
        ({"sp_min_tokens": 0}, "'sp_min_tokens' must be an int >= 1, got 0"),
        ({"sp_min_tokens": 2.5}, "'sp_min_tokens' must be an int >= 1, got 2.5"),
        ({"sp_min_tokens": True}, "'sp_min_tokens' must be an int >= 1, got True"),
        ({"dump_dir": 3}, "'dump_dir' must be a non-empty path string or None, got 3"),
        ({"dump_dir": ""}, "'dump_dir' must be a non-empty path string or None, got ''"),
    ],
)
def test_bad_values_say_what_is_valid(flags: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        HCPassesConfig.resolve(env={}, **flags)


def test_path_like_dump_dir_is_accepted(tmp_path) -> None:
    assert HCPassesConfig.resolve(env={}, dump_dir=tmp_path).dump_dir == str(tmp_path)


def test_env_disable_turns_passes_off_and_wins_over_flags() -> None:
    env = {"HCPASSES_DISABLE": "sp_rewrite, gated_mean_quant"}
    config = HCPassesConfig.resolve(env=env, sp_rewrite=True)
    assert config.pass_enabled("sp_rewrite") is False
    assert config.pass_enabled("gated_mean_quant") is False
    assert config.pass_enabled("cleanup") is True


def test_env_disable_rejects_unknown_pass_names() -> None:
    with pytest.raises(ValueError) as err:
        HCPassesConfig.resolve(env={"HCPASSES_DISABLE": "sp_rewrite,fusion"})
    assert "fusion" in str(err.value)
    for name in names():
        assert name in str(err.value)


def test_env_dump_dir_overrides_flag(tmp_path) -> None:
    config = HCPassesConfig.resolve(env={"HCPASSES_DUMP_DIR": str(tmp_path)}, dump_dir="elsewhere")
    assert config.dump_dir == str(tmp_path)


def test_backend_reads_the_process_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HCPASSES_DISABLE", "gated_mean_quant")
    monkeypatch.setenv("HCPASSES_DUMP_DIR", str(tmp_path))
    be = hcpasses.backend()
    assert be.config.pass_enabled("gated_mean_quant") is False
    assert be.config.pass_enabled("sp_rewrite") is True
    assert be.config.dump_dir == str(tmp_path)


def test_resolved_config_is_logged_once_at_info(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hcpasses"):
        hcpasses.backend(sp_min_tokens=4096)
    lines = [r for r in caplog.records if r.name == "hcpasses" and "hcpasses config" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "sp_min_tokens=4096" in lines[0].getMessage()


def test_config_is_frozen() -> None:
    config = HCPassesConfig.resolve(env={})
    with pytest.raises(AttributeError):
        config.pass_flags = ()  # type: ignore[misc]
