"""The service's API key: from SPECDEC_API_KEY, else the application config."""

from __future__ import annotations

from specdec.errors import ConfigError

MIN_API_KEY = 8


def api_key_from(environ, configured: str | None) -> str | None:
    """SPECDEC_API_KEY when set, else the config's api_key. Set but empty or short, it is a
    mistake that would leave the service open: refused."""
    value = environ.get("SPECDEC_API_KEY")
    if value is None:
        return configured
    if len(value.strip()) < MIN_API_KEY:
        what = "empty" if not value.strip() else f"shorter than {MIN_API_KEY} characters"
        raise ConfigError(f"SPECDEC_API_KEY is set but {what}: set a real key, or unset it "
                          "to serve without one")
    return value.strip()
