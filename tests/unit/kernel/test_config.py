"""kernel.config: flags over env over defaults, and errors that name the setting."""

from typing import Annotated, Literal

import msgspec
import pytest

from kernel.config import ConfigError, load_settings


class Demo(msgspec.Struct, forbid_unknown_fields=True):
    """Demo settings."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8080
    fail_mode: Literal["closed", "open"] = "closed"
    verbose: bool = False
    urls: list[str] = []


def test_flags_override_env_override_defaults():
    s = load_settings(Demo, "X_", ["--port", "9000"], env={"X_PORT": "7000", "X_VERBOSE": "yes", "X_URLS": "a,b"})
    assert s.port == 9000 and s.verbose is True and s.urls == ["a", "b"]
    assert load_settings(Demo, "X_", [], env={}).port == 8080
    assert load_settings(Demo, "X_", [], env={"X_PORT": "7000"}).port == 7000


def test_invalid_values_name_the_setting_and_the_valid_values():
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", ["--fail-mode", "sideways"], env={})
    assert "--fail-mode" in str(e.value) and "closed, open" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", [], env={"X_PORT": "70000"})
    assert "X_PORT" in str(e.value) and "[1, 65535]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_settings(Demo, "X_", ["--port", "eighty"], env={})
    assert "--port" in str(e.value)
