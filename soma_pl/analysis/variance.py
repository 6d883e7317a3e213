"""`analyze variance`: relative SPSA gradient error at fixed weights (Figs. 10 and 11).

Measures ``E‖ĝ − g‖² / ‖g‖²`` over repeated direction draws, against the exact autograd gradient
(or the pool-mean gradient for the batch-noise panel), with standard errors and the closed-form
prediction of :mod:`soma_pl.estimators.theory` for the recorded direction distribution (sparse
probes, whose mean is ``q ⊙ g``, are measured around it: App. G.1's centered variance). Weights
come from a checkpoint or a seeded random init; windows from a prepared ensemble-validation set or
random bytes. Everything runs in float64 with a small ε, so the central differences equal the
directional derivatives to O(ε²) and the measured errors should match the predictions within
their standard errors.

Output (JSON): ``settings``, ``weights``, ``windows``, the panels ``experts`` (Fig. 10 left),
``n_pert`` (Fig. 10 right, Fig. 11 left) and ``batch`` (Fig. 11 right), and the headline figures
``npert_doubling_ratio`` (error at n_pert over error at 2·n_pert, separate losses, largest such
pair), ``separate_vs_joint_ratio`` and ``predicted_separate_vs_joint_ratio`` (how many times lower
the error of separate losses is than that of one joint loss over ``joint_loss_grouping`` experts).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

import torch
from tqdm import tqdm

from soma_pl import WINDOW_BYTES
from soma_pl.analysis.loading import load_experts, window_pool
from soma_pl.analysis.reference_error import reference_panel, step_settings
from soma_pl.analysis.variance_panels import (
    Measurement,
    batch_panel,
    expert_tokens,
    experts_panel,
    n_pert_panel,
)
from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig
from soma_pl.io import check_apart, emit_json
from soma_pl.models.stacked import StackedExperts


class Panel(str, Enum):
    """The measurements `analyze variance` can run."""

    experts = "experts"
    """Fig. 10 left: N experts at about equal total size."""
    n_pert = "n_pert"
    """Fig. 10 right and Fig. 11 left: n_pert and loss grouping on fixed windows."""
    batch = "batch"
    """Fig. 11 right: batch size at fixed n_pert·B against the pool-mean gradient."""
    reference = "reference"
    """Fig. 5 and Table 8: total error against a BPTT reference on separate windows, by N (equal total
    size), n_pert and B, beside each global step's cost (`soma_pl.analysis.reference_error`)."""


@dataclass
class VarianceSettings:
    """Settings of `analyze variance` (defaults: a CPU run of a few minutes)."""

    checkpoint: str | None = None
    """Weights for the n_pert and batch panels (any soma_pl checkpoint; experts are cycled or
    truncated to `experts`). None: seeded random init of width `width`."""
    data: str | None = None
    """Prepared dataset folder whose ensemble_val.npz supplies the windows; None: random bytes."""
    panels: list[Panel] = field(default_factory=lambda: [Panel.experts, Panel.n_pert, Panel.batch])
    """Which measurements to run (by default Figs. 10 and 11's; `reference` adds Fig. 5's)."""
    context: int = 16
    """Predicted bytes per window T (windows are cut to T + 1 bytes; every target is scored). Every
    time step reads all 2·n_pert perturbed copies of the weights, so the cost grows with T·n_pert·d."""
    batch: int = 2
    """Windows per expert in the experts and n_pert panels (the paper: two chunks)."""
    experts: int = 4
    """Experts in the n_pert and batch panels (Fig. 11: 4)."""
    width: int = 32
    """Body width of random-init experts when no checkpoint is given."""
    n_pert: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    """Directions per expert (prefixes of one draw of the largest)."""
    loss_groupings: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Experts per joint loss, regrouped on the same evaluations (each must divide `experts`)."""
    repeats: int = 16
    """Independent direction draws per point in the experts and n_pert panels (the paper: 32)."""
    expert_counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """N of the experts panel (its n_pert is the largest of `n_pert`)."""
    total_params: int = 32_768
    """Perturbed parameters of the whole ensemble in the experts panel (bodies; shared head frozen)."""
    pool: int = 32
    """Windows in the batch panel's fixed pool (the paper: 32 chunks)."""
    probe_coordinates: int = 128
    """Coordinates perturbed per expert in the batch panel (the paper: 128)."""
    budget: int = 64
    """n_pert · B of the batch panel (the paper: 256)."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """B of the batch panel (each must divide `budget` and be at most `pool`)."""
    batch_repeats: int = 8
    """Batch-and-direction draws per point in the batch panel (the paper: 16)."""
    eps: float = 1e-5
    """ε of the central differences (float64 throughout)."""
    direction: DirectionKind = DirectionKind.rademacher
    """Direction distribution (the predictions follow it): `rademacher` is Fig. 11's dense probe,
    `sparse` the training probe of Fig. 10 (App. G.1)."""
    reference_windows: int = 64
    """Windows of `context + 1` bytes in each expert's reference batch (Fig. 5; Table 8: 8,000 of 1,025
    bytes), cut from the prepared windows; a second batch of as many gives Table 8's distance."""
    scales: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Fig. 5's N = 1 curves: n_pert and B at these multiples of the base (the smallest `n_pert`,
    `batch`); B is drawn from each expert's sampling pool of `pool` windows (the paper: 64 → 1,024)."""
    max_rows: int | None = 1024
    """Most windows per loss call (bounds memory; see SPSAConfig.max_rows)."""
    seed: int = 0
    """Seed of the random init, the windows, the probed coordinates and the directions."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting that cannot work."""
        checks = [
            (self.repeats >= 2 and self.batch_repeats >= 2, "repeats and batch_repeats must be >= 2"),
            (min(self.n_pert) >= 1 and self.context >= 1 and self.batch >= 1, "n_pert, context, batch must be >= 1"),
            (self.context < 1025, "context must be below 1025"),
            (all(self.experts % k == 0 for k in self.loss_groupings), "every loss_grouping must divide experts"),
            (Panel.batch not in self.panels or all(b <= self.pool and self.budget % b == 0 for b in self.batch_sizes),
             "every batch_size must divide budget and be at most pool"),
            (min(self.expert_counts) >= 1 and self.eps > 0, "expert_counts must be >= 1 and eps > 0"),
            (Panel.reference not in self.panels or (1 in self.scales and min(self.scales) >= 1
                                                    and 1 in self.expert_counts and max(self.expert_counts) > 1
                                                    and self.reference_windows >= 1
                                                    and 2 * self.batch * max(self.scales) <= self.pool),
             "the reference panel needs 1 in scales, 1 and a larger N in expert_counts, reference_windows >= 1 "
             "and a pool of at least twice the largest batch (batch x max(scales)), so that batches vary"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"analyze variance: {message}")

    def windows_needed(self) -> int:
        pieces = max(self.expert_counts) * (2 * self.reference_windows + self.pool)
        needed = {Panel.experts: max(self.expert_counts) * self.batch, Panel.n_pert: self.experts * self.batch,
                  Panel.batch: self.pool, Panel.reference: -(-pieces // (WINDOW_BYTES // (self.context + 1)))}
        return max(needed[Panel(panel)] for panel in self.panels)


def panel_model(settings: VarianceSettings) -> tuple[StackedExperts, str]:
    """The `experts` experts whose weights the n_pert and batch panels hold fixed (float64)."""
    if settings.checkpoint is None:
        with torch.random.fork_rng():
            torch.manual_seed(settings.seed)
            model = StackedExperts(settings.experts, settings.width, dtype=torch.float64)
        return model.requires_grad_(False), f"random init (seed {settings.seed}, width {settings.width})"
    source = load_experts(settings.checkpoint, torch.float64).model
    model = StackedExperts(settings.experts, source.width, source.embed_dim, source.num_layers, source.head_mode,
                           source.time_chunk, dtype=torch.float64).requires_grad_(False)
    index = torch.arange(settings.experts) % source.num_experts  # cycle a smaller ensemble's experts
    for name, param in model.named_parameters():
        param.copy_(getattr(source, name) if model.is_shared(name) else getattr(source, name)[index])
    return model, f"{settings.checkpoint} (experts {index.tolist()})"


def _headline(panel: dict) -> dict:
    """The figures the acceptance checks read, lifted out of the n_pert panel."""
    out = {}
    if panel["doubling"]:
        largest = panel["doubling"][-1]
        out.update(npert_doubling_ratio=largest["ratio"], npert_doubling_ratio_stderr=largest["stderr"],
                   npert_doubling_at=[largest["n_pert"], 2 * largest["n_pert"]],
                   predicted_npert_doubling_ratio=largest["predicted"])
    if "joint_vs_separate" in panel:
        joint = panel["joint_vs_separate"]
        out.update(separate_vs_joint_ratio=joint["ratio"], separate_vs_joint_ratio_stderr=joint["stderr"],
                   predicted_separate_vs_joint_ratio=joint["predicted"], joint_loss_grouping=joint["loss_grouping"],
                   separate_vs_joint_n_pert=joint["n_pert"])
    return out


def total_draws(settings: VarianceSettings, panels: list[Panel]) -> int:
    """Direction draws the selected panels make (the progress bar's length)."""
    return ((len(settings.expert_counts) * settings.repeats if Panel.experts in panels else 0)
            + (settings.repeats if Panel.n_pert in panels else 0)
            + (len(settings.batch_sizes) * settings.batch_repeats if Panel.batch in panels else 0)
            + (settings.repeats * sum(len(step_settings(count, min(settings.n_pert), settings.batch, settings.scales))
                                      for count in set(settings.expert_counts)) if Panel.reference in panels else 0))


def variance_analysis(settings: VarianceSettings, progress: bool = False) -> dict:
    """Run the selected panels and return the JSON record (see the module docstring); `progress`
    shows a bar of direction draws on stderr."""
    settings.validate()
    panels = [Panel(p) for p in settings.panels]
    # The bar appears with the first draw: a run that stops while loading (a bad checkpoint, a
    # missing folder) prints its one error line and nothing above it.
    bar = None

    def drawn() -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total_draws(settings, panels), desc="analyze variance", unit="draw", file=sys.stderr,
                       disable=not progress)
        bar.update()

    try:
        return _panels(settings, panels, drawn)
    finally:
        if bar is not None:
            bar.close()


def _panels(settings: VarianceSettings, panels: list[Panel], drawn) -> dict:
    windows = window_pool(settings.data, settings.windows_needed(), settings.seed)
    config = SPSAConfig(eps=settings.eps, direction=DirectionKind(settings.direction), max_rows=settings.max_rows)
    measure = Measurement(config, settings.repeats, settings.seed, drawn)
    figures = ["Fig. 10", "Fig. 11", *(["Fig. 5", "Table 8"] if Panel.reference in panels else [])]
    result = {"analysis": "variance", "figures": figures,
              "settings": {k: v.value if isinstance(v, Enum) else v for k, v in asdict(settings).items()},
              "windows": f"{settings.data}/ensemble_val.npz" if settings.data else "random bytes"}
    result["settings"]["panels"] = [p.value for p in panels]
    if Panel.experts in panels:
        result["experts"] = experts_panel(windows, settings.expert_counts, settings.total_params, settings.batch,
                                          settings.context, max(settings.n_pert), measure)
    if Panel.reference in panels:
        result["reference"] = reference_panel(windows, settings.expert_counts, settings.total_params,
                                              min(settings.n_pert), settings.batch, settings.scales,
                                              settings.reference_windows, settings.pool, settings.context, measure)
    if Panel.n_pert in panels or Panel.batch in panels:
        model, result["weights"] = panel_model(settings)
    if Panel.n_pert in panels:
        tokens = expert_tokens(windows, settings.experts, settings.batch, settings.context)
        result["n_pert"] = n_pert_panel(model, tokens, settings.n_pert, settings.loss_groupings, measure)
        result.update(_headline(result["n_pert"]))
    if Panel.batch in panels:
        pool = windows[: settings.pool, : settings.context + 1]
        result["batch"] = batch_panel(model, pool, settings.probe_coordinates, settings.budget,
                                      settings.batch_sizes, settings.loss_groupings,
                                      replace(measure, repeats=settings.batch_repeats))
    return result


def main(settings: VarianceSettings = VarianceSettings(), out: str = "variance.json", progress: bool = True) -> None:
    """Figs. 10, 11: relative SPSA gradient error at fixed weights, measured and predicted.

    Args:
        settings: what is measured (its fields are top-level options: `--context 16`).
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    check_apart(out, "--out", [settings.checkpoint, settings.data])
    emit_json(variance_analysis(settings, progress=progress), out)
