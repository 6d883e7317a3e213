"""Sweep the Triton grouped LSTM kernel's launch settings on a CUDA GPU: rows per program, warps,
hidden units per block and ``tl.dot``'s input precision, on one time chunk of the shapes the suite
runs (zero-order updates: many weight sets of 8 rows; routed inference: few weight sets of hundreds
of rows). Each variant's error against a float64 loop and its median time; beside them cuDNN's LSTM
on all rows with one weight set (the same FLOPs), the library a user would pick.

    python scripts/gpu_triton_sweep.py --out results/gpu/triton_sweep.json
    python scripts/gpu_triton_sweep.py --device cpu   # a dry run in Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_grouped import timed  # this folder is on the path when the script runs

from soma_pl.models import triton_lstm
from soma_pl.models.stacked import lstm_cell

REPEATS = 20

SHAPES = [  # (name, groups, rows, width)
    ("zo d_t=32", 128, 8, 32),
    ("zo d_t=181", 128, 8, 181),
    ("inference N=256", 256, 64, 32),
    ("inference N=8", 8, 512, 181),
    ("inference N=2", 2, 768, 361),
    ("kernels d_t=32", 64, 8, 32),  # bench kernels' grouped shapes
    ("kernels d_t=181", 16, 8, 181),
    ("kernels d_t=509", 4, 4, 509),
]
VARIANTS = [  # (precision, rows per program, warps, units per block); None: triton_lstm.launch's choice
    ("ieee", None, None, None), ("ieee", 16, 4, None), ("ieee", 16, 8, None), ("ieee", 64, 8, None),
]
"""The first sweep (docs/kernels.md, "On a GPU") also tried 32 units per block, 64 rows in 4 warps,
tf32x3 in 16, 64 and 128 rows and tf32: none won a shape by more than its spread, and tf32 (error
2.4e-4) is too coarse for a zero-order loss difference."""


def loop(gates_in, w_hh_t, state):
    """The `python` kernel's recurrence: a batched product and the cell per step. ``[G, b, Tc, d]``."""
    h, c = state
    outputs = []
    for t in range(gates_in.shape[1]):
        h, c = lstm_cell(torch.baddbmm(gates_in[:, t], h, w_hh_t), c)
        outputs.append(h)
    return torch.stack(outputs, 2)


def reference(gates_in, w_hh_t, state):
    """:func:`loop` in float64."""
    return loop(gates_in.double(), w_hh_t.double(), tuple(tensor.double() for tensor in state))


def library_seconds(groups: int, rows: int, width: int, steps: int, device: str) -> float:
    """cuDNN's (oneDNN's on the CPU) one-layer LSTM on groups × rows rows, one weight set."""
    lstm = torch.nn.LSTM(width, width, batch_first=True).to(device)
    x = torch.randn(groups * rows, steps, width, device=device)
    with torch.no_grad():
        return timed(lambda: lstm(x), REPEATS, device)


def sweep(name: str, groups: int, rows: int, width: int, steps: int, device: str) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(width)
    gates_in = torch.randn(groups, steps, rows, 4 * width, device=device, generator=generator)
    w_hh_t = torch.randn(groups, width, 4 * width, device=device, generator=generator) / width**0.5
    state = tuple(torch.randn(groups, rows, width, device=device, generator=generator) for _ in range(2))
    expected = reference(gates_in, w_hh_t, state)
    flops = 2 * groups * rows * steps * width * 4 * width  # the recurrent products
    library = library_seconds(groups, rows, width, steps, device)
    runs = [{"shape": name, "groups": groups, "rows": rows, "width": width, "steps": steps, "variant": "library",
             "seconds": library, "gflops": round(flops / library / 1e9, 1)}]
    seconds = timed(lambda: loop(gates_in, w_hh_t, state), REPEATS, device)
    runs.append({"shape": name, "groups": groups, "rows": rows, "width": width, "steps": steps, "variant": "python",
                 "rel_error": ((loop(gates_in, w_hh_t, state).double() - expected).norm() / expected.norm()).item(),
                 "seconds": seconds, "gflops": round(flops / seconds / 1e9, 1),
                 "over_library": round(library / seconds, 3)})
    for precision, block_rows, warps, units in VARIANTS:
        if block_rows is None:
            chosen = triton_lstm.launch(width, rows)
            label = f"launch(): {precision} rows={chosen[0]} warps={chosen[1]}"
        else:
            label = f"{precision} rows={block_rows} warps={warps} units={units or 'auto'}"
            if block_rows > max(16, rows):
                continue
        run = {"shape": name, "groups": groups, "rows": rows, "width": width, "steps": steps, "variant": label}
        try:
            def call(block_rows=block_rows, warps=warps, precision=precision, units=units):
                return triton_lstm.triton_chunk(gates_in, w_hh_t, state, block_rows=block_rows, num_warps=warps,
                                                precision=precision, block_units=units)
            out = call()[0]
            run["rel_error"] = ((out.double() - expected).norm() / expected.norm()).item()
            run["seconds"] = timed(call, REPEATS, device)
            run["gflops"] = round(flops / run["seconds"] / 1e9, 1)
            run["over_library"] = round(library / run["seconds"], 3)
        except Exception as error:  # one variant failing (registers, shared memory) leaves the rest
            run["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        runs.append(run)
        print(json.dumps(run), flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default="triton_sweep.json")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    shapes = SHAPES if args.device == "cuda" else [("dry run", 2, 16, 20)]
    steps = args.steps if args.device == "cuda" else 3
    runs = [run for shape in shapes for run in sweep(*shape, steps, args.device)]
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "torch": torch.__version__, "runs": runs}, handle, indent=1)
    for shape in dict.fromkeys(run["shape"] for run in runs):
        rows = sorted((run for run in runs if run["shape"] == shape and "seconds" in run),
                      key=lambda run: run["seconds"])
        print(shape, " | ".join(f"{run['variant']}: {run['gflops']} GF/s, err {run.get('rel_error', 0):.1e}"
                                for run in rows[:4]))


if __name__ == "__main__":
    main()
