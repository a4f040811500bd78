"""docs/configuration.md is what the config models generate: a field added, renamed or
re-described without regenerating the reference fails here."""

from specdec_tools.config_reference import OUT, render


def test_committed_reference_equals_a_fresh_generation():
    assert OUT.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m specdec_tools.config_reference`")


def test_every_field_of_the_app_config_is_documented():
    from deployments.app_config import AppArgs
    from specdec.engine.spec import DraftGroupSpec, EngineSpec, RuntimeSpec
    from specdec.policy.settings import PolicySettings

    text = render()
    app_own = {n: f for n, f in AppArgs.model_fields.items() if n != "engine"}
    for prefix, fields in (("", app_own), ("", EngineSpec.model_fields),
                           ("draft.", DraftGroupSpec.model_fields),
                           ("runtime.", RuntimeSpec.model_fields),
                           ("policy.", PolicySettings.model_fields)):
        for name, field in fields.items():
            assert f"| `{prefix}{name}` |" in text
            assert field.description, f"{prefix}{name} has no description"
