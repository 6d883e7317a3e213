#!/usr/bin/env bash
# One prepared GPU check, sized to finish within 10 minutes on one GPU: the CUDA-marked tests, then
# the kernel, zero-order and inference benchmarks on the device, JSON under $OUT (default
# results/gpu); each stage stops after STAGE_S seconds (default 100: five stages and about 40 s of
# installs and start-up fit a 10-minute command) so the others still run. The CPU dry run below
# takes about a minute.
#
#   bash scripts/gpu_check.sh             # on a machine with a CUDA GPU
#   DEVICE=cpu QUICK=1 bash scripts/gpu_check.sh   # the same steps, tiny, on the CPU (a dry run)
#
# Where jsonargparse, webdataset, optuna or wandb are missing (a bare GPU image), wheels in .whl/
# are installed first into /tmp/site. On the GPU `kernel: auto` runs grouped layers on the Triton
# kernel up to 256 units and the PyTorch loop above (soma_pl/models/triton_lstm.py; its CUDA test is in
# tests/models/test_triton_lstm.py; results in docs/kernels.md, "On a GPU"), so
# bench kernels' `grouped` rows and bench zo time it; SOMA_PL_LSTM_KERNEL=python times the loop instead.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 - <<'PY' | tee "$OUT/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY

if [ "${QUICK:-0}" = 1 ]; then
  KERNELS=(--shapes '[{width: 32, batch: 2, groups: 4, group_batch: 2}]' --settings.context 64
           --settings.grouped_context 32 --settings.rounds 1 --settings.repeats 1)
  ZO=(--widths '[32]' --n_pert 4 --micro_batch 2 --context 32 --repeats 1 --soma_experts 2 --eggroll_widths '[]')
  INFERENCE=(--models '[{experts: 1, width: 64, batch_size: 2}, {experts: 8, width: 16, batch_size: 8, shared_head: true}]'
             --settings.repeats 1 --settings.rounds 1)
  TESTS=(tests/models/test_recurrence.py)
else
  KERNELS=(--settings.threads null --settings.rounds 1)  # each run a child: CUDA's start, ~6 s
  ZO=(--widths '[32, 181]' --soma_experts 8)
  INFERENCE=(--batch_sizes '[768, 768, 1024, 4096]' --settings.threads null --settings.repeats 3 --settings.rounds 2)
  mapfile -t TESTS < <(grep -rl "pytest.mark.cuda" tests)  # only these: the rest need packages a bare image lacks
fi
STAGE=(timeout "${STAGE_S:-100}")

status=0  # the stages most worth a short lease first
if [ "$DEVICE" != cpu ] && [ "${#TESTS[@]}" -eq 0 ]; then
  echo "no test file carries a cuda mark" | tee "$OUT/pytest_cuda.txt"
  status=1
elif [ "$DEVICE" != cpu ]; then
  "${STAGE[@]}" python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts='-ra --strict-markers' "${TESTS[@]}" 2>&1 | tee "$OUT/pytest_cuda.txt" || status=1
fi
if [ "$DEVICE" != cpu ]; then  # the Triton grouped kernel against the loop, naive cuDNN and cuDNN inference
  "${STAGE[@]}" python3 scripts/gpu_grouped.py --out "$OUT/gpu_grouped.json" > "$OUT/gpu_grouped.log" 2>&1 || status=1
fi
"${STAGE[@]}" python3 -m soma_pl.cli bench zo --device "$DEVICE" "${ZO[@]}" --out "$OUT/bench_zo.json" \
  > "$OUT/bench_zo.log" 2>&1 || status=1
"${STAGE[@]}" python3 -m soma_pl.cli bench kernels --device "$DEVICE" "${KERNELS[@]}" --out "$OUT/bench_kernels.json" \
  > "$OUT/bench_kernels.log" 2>&1 || status=1
"${STAGE[@]}" python3 -m soma_pl.cli bench inference --settings.device "$DEVICE" "${INFERENCE[@]}" \
  --out "$OUT/bench_inference.json" > "$OUT/bench_inference.log" 2>&1 || status=1

python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("gpu_grouped", "bench_kernels", "bench_zo", "bench_inference"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name}: missing (see {name}.log)")
        continue
    record = json.loads(path.read_text())
    if name == "gpu_grouped":
        keys = ("width", "triton_over_python", "naive_speedup", "efficiency", "max_abs_loss_diff")
        print(name, json.dumps([{k: run.get(k) for k in keys} for run in record["runs"]]))
        continue
    if name == "bench_zo":
        keys = ("efficiency", "naive_speedup", "speedup", "zo_tokens_per_s", "batched_tokens_per_s")
        summary = [{"record": r["record"], "d_t": r["d_t"], **{k: r[k] for k in keys if k in r}} for r in record["results"]]
    elif name == "bench_inference":
        summary = {"ratio_to_n1": record["throughput_ratio_to_n1"],
                   "tokens_per_s": {r["model"]: r["tokens_per_s"] for r in record["results"]}}
    else:
        summary = record["ratios"]
    print(name, json.dumps(summary))
PY
exit $status
