"""`python -m soma_pl.cli <command>`: the suite's single entry point.

- `fit`, `validate`, `test`, `predict`: LightningCLI over the LightningModules and DataModules.
- `prepare --config configs/data/<name>.yaml`: build a prepared dataset folder.
- `bench data --config ... --out FILE.json`, `bench zo --out FILE.json`: measurements, written as JSON.
- `bench prepare --out FILE.json`: `prepare` throughput and peak memory per task at 1 and N tasks.
- `bench inference|memory`: inference throughput (Table 12) and memory against context.
- `bench kernels`: our LSTM stack against `torch.nn.LSTM` with the same weights (inference, BPTT, grouped).
- `analyze params|variance|topk|error-correlation --out FILE.json`: analyses behind the paper's
  tables and figures.
- `evaluate`: frozen next-byte loss of a checkpoint on external text (Table 9).
- `sweep --sweep sweeps/<name>.yaml`, `sweep report`: Optuna studies and their tables.
- `demo`: the main job: monolithic SPSA against SOMA at equal compute, a table and a figure.

Tools whose code lives elsewhere are registered with `_lazy(module)`: the module defines
`build_parser() -> ArgumentParser` and `run(args)`.

Bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from soma_pl.errors import SomaError
from soma_pl.io import write_json_atomic

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def _section_parser(description: str, section: str, config_type: type, progress: bool = True) -> ArgumentParser:
    """A parser whose YAML (`--config`) has one `section:` of `config_type` (a dataclass)."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--config", action=ActionConfigFile, help=f"YAML with a `{section}:` section")
    parser.add_argument(f"--{section}", type=config_type, default=config_type())
    if progress:
        parser.add_argument("--progress", type=bool, default=True, help="show progress bars")
    return parser


def _prepare_parser() -> ArgumentParser:
    from soma_pl.data.prepare import PrepareConfig

    return _section_parser("Build a prepared dataset folder (shards, evaluation sets, manifest).", "dataset",
                           PrepareConfig)


def _run_prepare(args: Namespace) -> None:
    from soma_pl.data.prepare import MANIFEST, prepare, read_manifest

    output = prepare(args.dataset, progress=args.progress)
    if not (output / MANIFEST).is_file():  # a Slurm or Ray executor: its jobs are still running
        print(json.dumps({"output_dir": str(output), "submitted": True,
                          "note": "run the same command again once the jobs are done"}, indent=2))
        return
    manifest = read_manifest(output)
    summary = {
        "output_dir": str(output),
        "train_documents": manifest["train"]["documents"],
        "train_bytes": manifest["train"]["bytes"],
        "shards": len(manifest["train"]["shards"]),
        "ensemble_val_windows": manifest["ensemble_val"]["windows"],
        "test_windows": manifest["test"]["windows"],
        "test_excluded": manifest["test"]["excluded"],
        "tasks": manifest["tasks"],
        "prepare_seconds": manifest["prepare_seconds"],
    }
    print(json.dumps(summary, indent=2))


def _shard_parser() -> ArgumentParser:
    from soma_pl.data.sharding import ShardConfig

    return _section_parser("Split a prepared dataset into N expert shard sets and fit the router.", "shard",
                           ShardConfig)


def _run_shard(args: Namespace) -> None:
    from soma_pl.data.sharding import read_shard_manifest, shard

    output = shard(args.shard, progress=args.progress)
    manifest = read_shard_manifest(output)
    keys = ("num_experts", "documents", "kmeans_sample", "shard_sizes", "rebalanced_documents", "contingency",
            "purity", "router_agreement", "tasks", "shard_seconds")
    summary = {"output_dir": str(output), "router": str(output / manifest["router"]),
               "embedder": manifest["config"]["embedder"], "sharding": manifest["config"]["sharding"],
               **{key: manifest[key] for key in keys},
               "train_documents": [e["train"]["documents"] for e in manifest["expert_sizes"]],
               "val_documents": [e["val"]["documents"] for e in manifest["expert_sizes"]]}
    print(json.dumps(summary, indent=2))


def _bench_data_parser() -> ArgumentParser:
    from soma_pl.data.prepare import PrepareConfig

    parser = _section_parser("Training-stream throughput from shards (windows/s, MB/s).", "dataset", PrepareConfig,
                             progress=False)
    parser.add_argument("--experts_dir", type=str | None, default=None, help="a sharded dataset folder")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=200, help="timed batches per worker count")
    parser.add_argument("--workers", type=list[int], default=[0, 2], help="DataLoader worker counts to time")
    parser.add_argument("--out", type=str, default="bench_data.json")
    return parser


def _run_bench_data(args: Namespace) -> None:
    from soma_pl.bench.data import bench_data

    result = bench_data(args.dataset, args.batch_size, args.batches, workers=tuple(args.workers),
                        experts_dir=args.experts_dir)
    _emit(result, args.out)


def _bench_zo_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Zero-order update throughput: batched SPSA vs inference and a naive loop.")
    parser.add_argument("--widths", type=list[int], default=[32, 181], help="body widths d_t, one record each")
    parser.add_argument("--n_pert", type=int, default=64, help="directions per update")
    parser.add_argument("--micro_batch", type=int, default=8, help="windows per update (B)")
    parser.add_argument("--context", type=int, default=256, help="predicted bytes per window (T)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per measurement (median)")
    parser.add_argument("--max_rows", type=int | None, default=None,
                        help="windows per loss call; default: the fastest of a few, measured")
    parser.add_argument("--naive_directions", type=int, default=8, help="directions the naive loop is timed on")
    parser.add_argument("--soma_experts", type=int, default=8, help="experts of the SOMA record; 0 skips it")
    parser.add_argument("--eggroll_widths", type=list[int] | None, default=None,
                        help="body widths of the EGGROLL records (default: --widths; [] skips them)")
    parser.add_argument("--eggroll_rank", type=int, default=1, help="rank r of the EGGROLL perturbations")
    parser.add_argument("--device", type=str, default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--out", type=str, default="bench_zo.json")
    return parser


def _run_bench_zo(args: Namespace) -> None:
    from soma_pl.bench.zo import ZOBenchSettings, bench_zo

    settings = ZOBenchSettings(n_pert=args.n_pert, micro_batch=args.micro_batch, context=args.context,
                               repeats=args.repeats, max_rows=args.max_rows,
                               naive_directions=args.naive_directions, eggroll_rank=args.eggroll_rank,
                               device=args.device)
    eggroll_widths = args.widths if args.eggroll_widths is None else args.eggroll_widths
    _emit(bench_zo(tuple(args.widths), settings, soma_experts=args.soma_experts,
                   eggroll_widths=tuple(eggroll_widths)), args.out)


def _analyze_params_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Table 2: parameter counts computed from the real modules.")
    parser.add_argument("--out", type=str, default="params.json")
    return parser


def _run_analyze_params(args: Namespace) -> None:
    from soma_pl.models.counts import table2_rows

    _emit({"analysis": "params", "table": "Table 2", "rows": table2_rows()}, args.out)


Tool = tuple[Callable[[], ArgumentParser], Callable[[Namespace], None]]


def _lazy(module: str, parser: str = "build_parser", runner: str = "run") -> Tool:
    """A tool whose parser factory and runner live in `module` (imported only when the tool runs)."""

    def attribute(name: str):
        return getattr(importlib.import_module(module), name)

    return (lambda: attribute(parser)()), (lambda args: attribute(runner)(args))


# command -> subcommand -> (parser factory, runner). A None subcommand is the command on its own
# (`sweep --sweep ...`); named ones are picked by the next word (`sweep report ...`).
TOOLS: dict[str, dict[str | None, Tool]] = {
    "prepare": {None: (_prepare_parser, _run_prepare)},
    "shard": {None: (_shard_parser, _run_shard)},
    "bench": {"data": (_bench_data_parser, _run_bench_data), "zo": (_bench_zo_parser, _run_bench_zo),
              "prepare": _lazy("soma_pl.bench.prepare"),
              "inference": _lazy("soma_pl.bench.inference"), "memory": _lazy("soma_pl.bench.memory"),
              "kernels": _lazy("soma_pl.bench.kernels")},
    "analyze": {"params": (_analyze_params_parser, _run_analyze_params),
                "variance": _lazy("soma_pl.analysis.variance"), "topk": _lazy("soma_pl.analysis.topk"),
                "error-correlation": _lazy("soma_pl.analysis.error_correlation")},
    "evaluate": {None: _lazy("soma_pl.eval.external")},
    "sweep": {None: _lazy("soma_pl.sweeps.runner"), "report": _lazy("soma_pl.sweeps.report")},
    "demo": {None: _lazy("soma_pl.demo")},
}


def _emit(result: dict, out: str) -> None:
    path = write_json_atomic(Path(out), result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def _usage() -> str:
    tools = [f"{c} {s}" if s else c for c, subs in TOOLS.items() for s in subs]
    return "usage: python -m soma_pl.cli {" + ",".join([*LIGHTNING_COMMANDS, *tools]) + "} [options]"


def _run_tool(argv: Sequence[str]) -> None:
    command, rest = argv[0], list(argv[1:])
    subcommands = TOOLS[command]
    if rest and rest[0] in subcommands:
        make_parser, run = subcommands[rest.pop(0)]
    elif None in subcommands:
        make_parser, run = subcommands[None]
    else:
        raise SystemExit(f"usage: python -m soma_pl.cli {command} {{{','.join(subcommands)}}} [options]")
    parser = make_parser()
    parser.prog = f"python -m soma_pl.cli {' '.join(argv[: len(argv) - len(rest)])}"
    args = parser.parse_args(rest)
    run(parser.instantiate(args))


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.formatwarning = _one_line_warning
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            from soma_pl.lightning_cli import run_lightning

            run_lightning(argv)
        elif argv and argv[0] in TOOLS:
            _run_tool(argv)
        else:
            print(_usage(), file=sys.stderr)
            raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    except SomaError as error:
        print(f"soma_pl: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
