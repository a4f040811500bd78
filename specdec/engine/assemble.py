"""One way to assemble an engine from an EngineSpec, whatever runs the models.

A backend makes the target runner and the draft proposer: `LocalBackend` (this file) puts
them in this process; the Ray backend (deployments/actors/ray_backend.py) puts them in actor groups,
under `specdec generate --tp` or inside a Serve replica. Everything else is the same code:
checks that name the config field at fault, the tokenizer, end-of-sequence ids, the n-gram
proposer, the engine's limits, the policy, and the warm-up. So the engine that `bench`
measures in one process is the one the service runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from specdec.engine.calibrate import calibrate
from specdec.engine.engine import Engine
from specdec.engine.request import Request
from specdec.engine.spec import EngineSpec, ModelGroupSpec
from specdec.errors import CapacityError, ConfigError, TargetDown
from specdec.model.checkpoint.config import DecoderConfig
from specdec.model.checkpoint.sharding import ShardSpec
from specdec.model.step.decoder import Decoder
from specdec.model.step.prefix_cache import PrefixStats
from specdec.model.step.sampling import SamplingParams
from specdec.model.step.step_mode import with_step
from specdec.pack import hub
from specdec.pack.tokenizer import IncompatibleDraft, check_same_tokenizer, load_tokenizer
from specdec.policy.decide import Decision
from specdec.policy.engine_policy import EnginePolicy
from specdec.spec_decode.proposal import Proposer, draft_held_prefix
from specdec.spec_decode.proposers import DraftModelProposer, NgramProposer
from specdec.spec_decode.speculation import AUTO, Speculation
from specdec.spec_decode.suffix import SuffixProposer
from specdec.spec_decode.target_runner import LocalTargetRunner, TargetRunner


class Backend(Protocol):
    def target(self, spec: EngineSpec, path: Path) -> TargetRunner: ...

    def draft(self, spec: EngineSpec, path: Path) -> Proposer: ...

    def close(self) -> None: ...


def eos_ids_of(path: str | Path, tokenizer) -> set[int]:
    """Every token that ends generation: config, generation config and tokenizer agree
    rarely (Qwen instruct models end turns with <|im_end|>, not the config's eos)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def check_threads(field: str, group: ModelGroupSpec, cores: int | None = None) -> int:
    """Threads per rank, refused when they exceed the cores of the machine they run on."""
    cores = cores or os.cpu_count() or 1
    threads = group.threads_per_rank()
    if not group.threads:  # the default (the cores Ray reserves) never exceeds the machine's
        threads = min(threads, cores)
    if threads > cores:
        raise ConfigError(f"{field}.threads: {threads} threads per rank, but this machine "
                          f"has {cores} cores: more threads than cores only slows each one")
    return threads


def check_spec(spec: EngineSpec, target_path: Path, draft_path: Path | None) -> None:
    """What only the checkpoints can tell: shapes against TP sizes, limits, tokenizers."""
    t_cfg = DecoderConfig.from_checkpoint(target_path)
    groups = [("target", spec.target, t_cfg)]
    if draft_path is not None:
        groups.append(("draft", spec.draft, DecoderConfig.from_checkpoint(draft_path)))
    for field, group, cfg in groups:
        try:
            ShardSpec(0, group.tp).check(cfg)
        except ValueError as exc:
            raise ConfigError(f"{field}.tp: {exc}") from None
        limit = cfg.context_limit
        if spec.runtime.max_len > limit:
            raise ConfigError(f"runtime.max_len: {spec.runtime.max_len} exceeds what the "
                              f"{field} model supports ({limit} tokens)")
    if draft_path is not None:
        vl = spec.draft.vocab_limit
        t_vocab, d_vocab = groups[0][2].vocab_size, groups[1][2].vocab_size
        if d_vocab > t_vocab:
            # Its guesses could name ids the target has no row for.
            raise ConfigError(f"draft.model: its vocabulary ({d_vocab} ids) exceeds the "
                              f"target's ({t_vocab})")
        if vl is not None and vl > groups[1][2].vocab_size:
            raise ConfigError(f"draft.vocab_limit: {vl} exceeds the draft's vocabulary "
                              f"({groups[1][2].vocab_size})")
        try:
            check_same_tokenizer(target_path, draft_path)
        except IncompatibleDraft as exc:
            raise ConfigError(f"draft.model: {exc}") from None


class LocalBackend:
    """Target and draft in this process (one torch thread pool for both: they take turns)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def _threads(self, spec: EngineSpec) -> None:
        if self.device != "cpu":
            return
        target = check_threads("target", spec.target)
        wanted = [target]
        if spec.draft is not None:
            draft = check_threads("draft", spec.draft)
            wanted.append(draft)
            cores = os.cpu_count() or 1
            if spec.overlap != "off" and target + draft > cores:
                raise ConfigError(f"overlap: target.threads ({target}) + draft.threads "
                                  f"({draft}) exceed this machine's {cores} cores; they "
                                  "compute at the same time in overlap")
        # Sequentially the two models take turns on one thread pool; with overlap the draft
        # computes on its own thread (see overlap.ThreadWindow) and this one is the target's.
        # `auto` switches between the two per step (mode_threads).
        self.mode_threads = {False: max(wanted), True: target}
        torch.set_num_threads(target if spec.overlap == "on" else max(wanted))

    def target(self, spec: EngineSpec, path: Path) -> TargetRunner:
        if spec.target.tp != 1:
            raise ConfigError("target.tp: tensor parallelism needs the Ray backend "
                              "(`specdec generate --tp N`, or the Serve app)")
        self._threads(spec)
        model = with_step(Decoder.from_checkpoint(path, spec.target.dtype, self.device),
                          spec.target.step)
        return LocalTargetRunner(model, spec.runtime.kv_slots(), spec.runtime.max_len)

    def draft(self, spec: EngineSpec, path: Path) -> Proposer:
        d = spec.draft
        model = with_step(Decoder.from_checkpoint(path, d.dtype, self.device), d.step)
        proposer = DraftModelProposer(model, spec.runtime.kv_slots(), spec.runtime.max_len,
                                      d.sampling, d.vocab_limit, d.confidence_threshold,
                                      d.q_top_m, prefix_cache=spec.runtime.prefix_cache)
        if self.device == "cpu":
            proposer.window_threads = check_threads("draft", d)
        return proposer

    def close(self) -> None:
        pass


@dataclasses.dataclass
class AssembledEngine:
    engine: Engine
    tokenizer: object
    spec: EngineSpec
    policy: EnginePolicy
    backend: Backend
    target_path: Path
    calibration: dict | None = None  # what the start-up calibration ran (calibrate.py)

    @property
    def target(self) -> TargetRunner:
        return self.engine.target

    @property
    def draft(self) -> Proposer | None:
        return self.engine.proposers.get("draft")

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               wanted: Speculation | None = None, on_output=None,
               tenant: str | None = None, grammar_start: object | None = None
               ) -> tuple[Request, Decision]:
        """Decide this request's speculation from the engine's own load (the policy), then
        queue it: the path every served request takes. Raises EngineError (a bad override)
        or CapacityError (queue full)."""
        wanted = wanted or AUTO
        down = getattr(self.engine.target, "down", None)
        if down:
            raise TargetDown(f"{down}; retry shortly")
        methods = self.methods()
        if wanted.method in self.engine.proposers and wanted.method not in methods:
            raise CapacityError(f"speculative.method {wanted.method!r} is unavailable for now "
                                "(its proposer is being rebuilt); retry, or leave method unset")
        draft = self.engine.proposers.get("draft")
        catchup = len(prompt_ids) - draft_held_prefix(draft, prompt_ids, tenant) if draft else 0
        decision = self.policy.admit(self.engine.load(), methods, len(prompt_ids),
                                     params.max_tokens, bool(params.stop), wanted, catchup)
        # Plain for now, on standby (only `auto` without a pinned k gets one): it follows
        # the batch's decision in later rounds, so the batch never mixes speculative and
        # plain rows it could have matched.
        method = decision.standby or decision.method
        req = Request(request_id, prompt_ids, params, method, decision.k, on_output,
                      speculation=wanted, tenant=tenant, grammar_start=grammar_start)
        self.engine.add_request(req)
        return req, decision

    def methods(self) -> list[str]:
        """Proposers that can propose right now (a lost draft is rebuilt in the background)."""
        return sorted(m for m, p in self.engine.proposers.items()
                      if p.available)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> AssembledEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def assemble(spec: EngineSpec, backend: Backend,
             on_phase: Callable[[str], None] | None = None) -> AssembledEngine:
    """Build the engine; on_phase(name) hears each phase of the start-up as it begins
    (the served replica tells the ingress, which answers 503 saying what it waits for)."""
    phase = on_phase or (lambda name: None)
    phase("checking the models")
    target_path = hub.resolve(spec.target.model)
    draft_path = hub.resolve(spec.draft.model) if spec.draft is not None else None
    check_spec(spec, target_path, draft_path)
    tok = load_tokenizer(target_path)
    phase("loading the target model")
    target = backend.target(spec, target_path)
    try:
        proposers: dict[str, Proposer] = {"ngram": NgramProposer(spec.ngram_min, spec.ngram_max)}
        sx = spec.suffix
        if sx.enabled:
            proposers["suffix"] = SuffixProposer(sx.min_n, sx.max_n, sx.table_bits,
                                                 sx.spec_factor, sx.min_count, sx.shared,
                                                 sx.plain_rows_k)
        if draft_path is not None:
            phase("loading the draft model")
            proposers["draft"] = backend.draft(spec, draft_path)
        policy = EnginePolicy(spec.policy)
        engine = Engine(target, proposers, tok, eos_ids_of(target_path, tok), spec.limits(),
                        choose_k=policy.choose_k, overlap=spec.overlap)
        threads = getattr(backend, "mode_threads", None)
        if spec.overlap == "auto" and threads:
            engine.overlap.on_mode = lambda overlapped: torch.set_num_threads(threads[overlapped])
        built = AssembledEngine(engine, tok, spec, policy, backend, target_path)
        if spec.warmup:
            phase("warming up")
            warm_up(engine)
            phase("calibrating the step costs")
            built.calibration = calibrate(engine, policy, spec.policy.k_max)
            _forget(engine)
        # The policy learns costs and acceptance from every step and finished request,
        # in one process and served alike.
        engine.probing = policy.probing
        engine.on_step.append(policy.observe_step)
        engine.on_finished.append(policy.observe_finished)
    except BaseException:
        backend.close()
        raise
    return built


def warm_up(engine: Engine) -> None:
    """One short request per path (prefill, plain step, each proposer's round), then forget
    it: first calls pay for allocations, kernel choice and lazy imports, and the policy's
    fits must not learn from them."""
    prompt = list(range(10, 42))
    reqs = [Request("warmup-plain", prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                            ignore_eos=True))]
    for method in engine.proposers:
        reqs.append(Request.pinned(f"warmup-{method}", prompt, SamplingParams(
            temperature=0.7, max_tokens=6, ignore_eos=True, seed=0), method, 2))
    engine.run(reqs)
    _forget(engine)


def _forget(engine: Engine) -> None:
    engine.totals.clear()
    engine.history.clear()
    engine.steps = 0
    # The prefix caches' counters start with the first served request (what warm-up and
    # calibration left in the slots is never asked for again: their prompts are their own).
    engine.prefixes.stats = PrefixStats()
    for proposer in engine.proposers.values():
        forget = getattr(proposer, "forget_prefix_stats", None)
        if forget is not None:
            forget()
