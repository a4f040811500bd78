"""The speculation policy's settings, validated by pydantic: serve_config.yaml `policy`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PolicySettings(BaseModel):
    """The speculation policy's settings (serve_config.yaml `policy`); the one owner of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    k_max: int = Field(6, ge=1, le=16, description="Largest k the policy chooses.")
    min_expected_tokens: int = Field(12, ge=0, description=(
        "Requests expected to produce fewer tokens go plain: nothing to amortize a draft "
        "round over."))
    min_speedup: float = Field(1.05, ge=1.0, description=(
        "Speculate only where the cost model's expected speedup over plain is at least "
        "this."))
    draft_cost_ratio: float = Field(0.35, gt=0, description=(
        "c, one draft forward over one plain target step, until the draft is measured."))
    ngram_cost_ratio: float = Field(0.02, ge=0, description="The same for n-gram lookup "
                                    "and suffix guesses (no forward: a table lookup).")
    acceptance_prior: tuple[tuple[str, float], ...] = Field(
        (("draft", 0.75), ("ngram", 0.15), ("suffix", 0.3)), description=(
            "Per-token acceptance per method until measured: a same-family draft agrees "
            "often; prompt lookup rarely finds a match outside editing and quoting; suffix "
            "guesses, from every recent request too, somewhat more often."))
    prior_weight: float = Field(20.0, ge=0, description="Pseudo-trials behind the prior.")
    collapse_rounds: int = Field(4, ge=1, description="A request's own rounds before its "
                                 "acceptance is trusted over its method's.")
    collapse_alpha: float = Field(0.25, ge=0, le=1, description="A request whose own "
                                  "acceptance falls below this drops to plain.")
    length_buckets: tuple[int, ...] = Field((64, 256, 1024, 4096), description=(
        "Prompt-length buckets for learning the output lengths of finished requests."))
    acceptance_half_life: float = Field(2000.0, ge=0, description=(
        "Acceptance evidence halves in weight every this many trials (0 = never), so a "
        "changed workload fades in instead of ruling forever."))
    explore_share: float = Field(0.05, ge=0, le=1, description=(
        "Share of requests that speculate although the estimate says plain: without trials "
        "the estimate could never learn that speculation pays again."))
    probe_interval_s: float = Field(20.0, ge=0, description=(
        "A step shape the batch does not run (a verify while all run plain, a plain step "
        "while all speculate) is measured by one probe step at most this often while "
        "nothing waits (0 = never): a wrong start-up calibration cannot rule for good. A "
        "shape never run live is probed at a tenth of this interval."))
