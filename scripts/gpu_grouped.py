"""Time the grouped zero-order forward on a CUDA GPU: the Triton kernel against the PyTorch loop,
a naive loop of cuDNN calls (one weight set each) and cuDNN inference on all rows with one weight
set (the same FLOPs), as `bench zo` does on the CPU; and the Triton kernel and the loop each
captured once in a CUDA graph and replayed (no launch gaps). Checks the Triton losses against the
loop's first. Shapes as `bench zo`'s defaults (n_pert 64: G = 128 weight sets, B = 8 windows of T = 256,
4 layers, d_E = 32).

    python scripts/gpu_grouped.py --out results/gpu/grouped.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from soma_pl.models.recurrence import Kernel, resolve_kernel
from soma_pl.models.stacked import StackedExperts

DEVICE = "cuda"
"""`--device cpu`: a dry run of the script with tiny shapes (Triton in its interpreter)."""


def timed(fn, repeats: int, device: str | None = None) -> float:
    """Median seconds of `fn` over `repeats` calls (CUDA events; the host clock on the CPU), after
    two warm-up calls. `device`: None for `DEVICE`."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if (device or DEVICE) == "cpu":
            begun = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begun)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up on a side stream): a callable that replays it,
    or the error's text where capture fails (a host synchronisation inside, say)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as error:  # reported in the JSON, the other columns still measured
        torch.cuda.synchronize()
        return f"{type(error).__name__}: {str(error)[:200]}"


def measure(width: int, groups: int, batch: int, context: int, repeats: int) -> dict:
    torch.manual_seed(width)
    model = StackedExperts(1, width, 32, 4).to(DEVICE)
    params = {name: p.detach().expand(groups, *p.shape[1:]) + 0.01 * torch.randn(groups, *p.shape[1:], device=DEVICE)
              for name, p in model.expert_parameters().items()}
    tokens = torch.randint(0, 256, (groups, batch, context + 1), dtype=torch.uint8, device=DEVICE)
    results = {"width": width, "groups": groups, "batch": batch, "context": context}
    with torch.no_grad():
        losses = {}
        for kernel in (Kernel.triton, Kernel.python):
            model.kernel = kernel
            assert resolve_kernel(kernel, params) is kernel
            losses[kernel.value] = model.loss_per_group(params, tokens)
            results[f"{kernel.value}_s"] = timed(lambda: model.loss_per_group(params, tokens), repeats)
            if DEVICE == "cuda":
                replay = graphed(lambda: model.loss_per_group(params, tokens))
                if isinstance(replay, str):
                    results[f"{kernel.value}_graph_error"] = replay
                else:
                    results[f"{kernel.value}_graph_s"] = timed(replay, repeats)
        results["max_abs_loss_diff"] = (losses["triton"] - losses["python"]).abs().max().item()
        model.kernel = Kernel.library
        one = [{name: p[g : g + 1] for name, p in params.items()} for g in range(groups)]
        results["naive_s"] = timed(lambda: [model.loss_per_group(one[g], tokens[g : g + 1]) for g in range(groups)],
                                   max(3, repeats // 2))
        everything = tokens.reshape(1, groups * batch, context + 1)
        results["inference_s"] = timed(lambda: model.loss_per_group(one[0], everything), repeats)
    tokens_done = groups * batch * context
    for name in ("triton", "python", "naive", "inference", "triton_graph", "python_graph"):
        if f"{name}_s" in results:
            results[f"{name}_tokens_per_s"] = round(tokens_done / results[f"{name}_s"], 1)
    results["triton_over_python"] = round(results["python_s"] / results["triton_s"], 2)
    results["naive_speedup"] = round(results["naive_s"] / results["triton_s"], 2)
    results["efficiency"] = round(results["inference_s"] / results["triton_s"], 4)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 181])
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="gpu_grouped.json")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    runs = [measure(width, args.groups, args.batch, args.context, args.repeats) for width in args.widths]
    with open(args.out, "w") as handle:
        json.dump({"device": device, "torch": torch.__version__, "runs": runs}, handle, indent=1)
    shown = ("width", "triton_tokens_per_s", "python_tokens_per_s", "naive_tokens_per_s", "inference_tokens_per_s",
             "triton_graph_tokens_per_s", "python_graph_tokens_per_s", "triton_graph_error", "python_graph_error",
             "triton_over_python", "naive_speedup", "efficiency", "max_abs_loss_diff")
    for run in runs:
        print(json.dumps({key: run[key] for key in shown if key in run}))


if __name__ == "__main__":
    main()
