"""The shipped application configs parse and are sized as they say."""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.actors.placement import bundles_for
from deployments.app import parse_args

ROOT = Path(__file__).resolve().parents[2]


def args_of(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())["applications"][0]["args"]


def test_cpu_default_fits_two_cores_without_hidden_oversubscription():
    app = parse_args(args_of("serve_config.yaml"))
    cfg = app.engine
    bundles, t_idx, d_idx = bundles_for(cfg, replica_cpus=app.replica_cpus)
    assert sum(b.get("CPU", 0) for b in bundles) <= 2.0
    assert cfg.target.tp == 1 and cfg.target.threads_per_rank() == cfg.target.resources.num_cpus
    # The draft computes with the target's cores only while the target waits: it reserves
    # nothing and sits in target rank 0's bundle, on the same node.
    assert cfg.draft.resources.reserves_nothing and d_idx == [t_idx[0]]
    assert cfg.draft.vocab_limit and cfg.draft.q_top_m <= 256
    # The target in a batch-independent format (greedy speculative == plain in it).
    assert cfg.target.dtype == "q4k" and cfg.draft.dtype == "int4"
    from specdec.model.formats.weight_format import DRAFT_ONLY, resolve_format
    assert cfg.target.dtype not in DRAFT_ONLY and resolve_format(cfg.target.dtype).per_row


def test_gpu_variant_puts_every_shard_and_the_draft_on_its_own_gpu():
    app = parse_args(args_of("serve_config.gpu.yaml"))
    cfg = app.engine
    assert cfg.target.tp >= 2 and cfg.target.resources.num_gpus == 1
    assert cfg.draft.resources.num_gpus == 1
    bundles, t_idx, d_idx = bundles_for(cfg, replica_cpus=app.replica_cpus)
    assert sum(b.get("GPU", 0) for b in bundles) == cfg.target.tp + 1
    assert set(t_idx).isdisjoint(d_idx)


def test_the_ingress_keys_old_names_still_validate():
    """router_* were renamed ingress_*; a config written with the old keys still deploys
    the same, and a key of neither name is refused naming it."""
    import pytest
    from pydantic import ValidationError

    from deployments.app_config import AppArgs

    old = AppArgs.model_validate({"target": {"model": "m"}, "router_cpus": 0.5,
                                  "router_replicas": 2, "router_max_ongoing_requests": 7})
    new = AppArgs.model_validate({"target": {"model": "m"}, "ingress_cpus": 0.5,
                                  "ingress_replicas": 2, "ingress_max_ongoing_requests": 7})
    assert old == new and new.ingress_replicas == 2 and new.ingress_cpus == 0.5
    with pytest.raises(ValidationError, match="routr_cpus"):
        AppArgs.model_validate({"target": {"model": "m"}, "routr_cpus": 1})


def test_engine_keys_are_written_flat_and_errors_name_them_as_written():
    """The app args hold an EngineSpec (composition), but the YAML stays one flat mapping,
    and a bad engine key is named as the user wrote it."""
    import pytest

    from specdec.errors import ConfigError

    args = args_of("serve_config.yaml")
    app = parse_args(args)
    assert app.engine.target.model == args["target"]["model"]
    assert app.engine.runtime.max_slots == args["runtime"]["max_slots"]
    with pytest.raises(ConfigError, match=r"\n  target\.tp: Input should be greater"):
        parse_args({**args, "target": {**args["target"], "tp": 0}})
    with pytest.raises(ConfigError, match=r"\n  ingress_cpus: Input should be"):
        parse_args({**args, "ingress_cpus": -1})


def test_the_gemma3_config_serves_the_pack_model_without_a_draft():
    app = parse_args(args_of("serve_config.gemma3.yaml"))
    cfg = app.engine
    assert cfg.target.model == "gemma3-270m" and cfg.draft is None
    assert cfg.runtime.max_len > 512  # past the model's window: masked, not capped
    bundles, _, _ = bundles_for(cfg, replica_cpus=app.replica_cpus)
    assert sum(b.get("CPU", 0) for b in bundles) <= 2.0
