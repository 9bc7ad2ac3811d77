#!/usr/bin/env bash
# The prepared accelerator check, for a session lent a device machine (one `run`, ~6 minutes):
#   run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#                PYTHONPATH=/tmp/site bash bench/device_check.sh", carry=[".whl"], timeout_s=600)
# (.whl: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64`
#  of protobuf, grpcio, grpcio-health-checking and gguf at this venv's versions, into an ignored .whl/)
# It needs what that machine's image holds (torch, transformers, safetensors, tokenizers, pyyaml, jinja2,
# prometheus-client, numpy) plus four small wheels carried in .whl (protobuf and grpcio at least the
# versions our generated code names, grpcio-health-checking, gguf); Ray and FastAPI are not used.
# Parts, each under its own timeout; outputs land in $OUT (at most 8 files):
#   parity.txt       float32 and bfloat16 greedy tokens of a station against transformers on the device
#   step_*.txt       `mesh bench step` on the bench preset (bf16, f32), ours vs HF
#   sim.txt          `mesh bench scale`'s SIMULATED sweep, direct, on that machine's 16 host cores (no GPU used)
#   real.txt         `mesh bench scale`'s real part with every station on the GPU (bfloat16), hub vs direct
# PARTS chooses which run, in order (default "parity bf16 sim real f32"); three more:
#   sim_hub.txt      (simhub) the SIMULATED sweep on the hub path, one round
#   quota.txt        the core quota on real compute: 1 station on 1 core vs 2 on 1 core each, pinned, host CPU
#   ops.txt          bench/wave_ops.py: torch calls, device kernels and wall time of one wave on the torch path
#   graphs.txt       bench/decode_graphs_check.py: decode waves replayed as CUDA graphs against eager, bits and times
# DEVICE=cpu QUICK=1 runs the same parts here, small (to check the script itself).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WAVEMESH_CACHE=/tmp/wavemesh-cache
device=${DEVICE:-cuda}
out=${OUT:-/tmp/wavemesh-device-out}
py=${PYTHON:-python3}
if [ -n "${QUICK:-}" ]; then  # small shapes, to check the script itself
  step_args=(--quick); sim_args=(--quick); real_args=(--quick --real-stations 1,2); quick_args=(--quick)
  ops_args=(--model tiny --repeats 3); graphs_args=(--presets tiny:float32 --batches 1,4 --steps 6)
else
  step_args=(--batches 1,16,64 --repeats 3); sim_args=(--stations 1,2,4,8 --paths direct --rounds 3)
  real_args=(--real-stations 1,2,3 --real-k 16,64); quick_args=(); ops_args=(); graphs_args=()
fi
mkdir -p "$out"
{
  date -u; nproc; grep -m1 "model name" /proc/cpuinfo
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $py -c "import sys, torch, transformers, grpc, google.protobuf as pb; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)"
} 2>&1 | tee "$out/gpu.txt"

parity() {  # a station's greedy tokens vs transformers' generate (same checkpoint)
timeout 150 $py - "$device" <<'PY' 2>&1 | grep -v "Loading weights" | tee "$out/parity.txt"
import sys, torch
from transformers import AutoModelForCausalLM
from mesh.control.cli import resolve_model
from mesh.core.config import StationSpec
from mesh.core.params import SamplingParams
from station.generate import generate_one
from station.step import Station
dev = sys.argv[1]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
for preset, layers in (("tiny", 6), ("bench", 12)):
    model = resolve_model(None, preset)
    prompt = [1, 40, 41, 42, 300, 7, 9, 88, 120, 5, 6]
    for dtype in ("float32", "bfloat16"):
        st = Station(model, StationSpec(layers=(0, layers), device=dev, dtype=dtype))
        ours, _ = generate_one(st, prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(dev).eval()
        ids = torch.tensor([prompt], device=dev)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                          min_new_tokens=32)[0, len(prompt):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), 32)
        print(f"{dev} {preset} {dtype}: the first {same} of 32 greedy tokens equal transformers' generate"
              f"{'' if same == 32 else f' (ours {ours[same:same + 4]}, HF {ref[same:same + 4]})'}")
        del st, hf
PY
}

step() {  # the step benchmark on the bench preset in one dtype, ours vs HF in one run
  timeout "$2" $py bench/step.py --device "$device" --dtype "$1" "${step_args[@]}" \
    2>&1 | grep -v "Loading weights" | tee "$out/step_${device}_$1.txt" | grep -v '^{'
}
sim() {  # SIMULATED GPU stations on this machine's host cores (the 2-core VMs starve P=8's nine processes)
timeout 220 $py bench/scale.py --skip-real "${sim_args[@]}" \
  2>&1 | grep -v "prefix cache off" | tee "$out/sim.txt" | grep -v '^{'
}

simhub() {
timeout 150 $py bench/scale.py --skip-real "${sim_args[@]}" --paths hub --rounds 1 \
  2>&1 | grep -v "prefix cache off" | tee "$out/sim_hub.txt" | grep -v '^{'
}

real() {  # real stations on the device, each its own process on the one GPU, hub vs direct
timeout 150 $py bench/scale.py --skip-sim --real-device "$device" --real-dtype bfloat16 "${real_args[@]}" \
  2>&1 | grep -v "prefix cache off" | tee "$out/real.txt" | grep -v '^{'
}

quota() {  # core quota on real compute: 1 station on 1 core vs 2 stations on 1 core each (float32 on the CPU),
  # 32 greedy requests, prompt 32, 64 tokens, compute-balanced split; pairs alternated; orchestrator unpinned
  for order in 1,2 2,1 1,2; do
    timeout 120 $py bench/scale.py --skip-sim --real-stations $order --real-k 32 --tokens 64 --real-threads 1 \
      --real-balance compute --real-wave-tokens 512 --paths direct "${quick_args[@]}" 2>&1 | grep -v "prefix cache off"
  done | tee "$out/quota.txt" | grep -v '^{'
}

ops() {  # torch calls and device kernels of one wave on the torch path, and its wall time
  timeout 120 $py bench/wave_ops.py --device "$device" "${ops_args[@]}" 2>&1 | grep -v "USDT\|STAGE:" | tee "$out/ops.txt"
}

graphs() {  # CUDA graphs vs eager: the same decode waves through both, logits compared bit for bit, waves timed
  timeout 150 $py bench/decode_graphs_check.py --device "$device" "${graphs_args[@]}" 2>&1 | grep -v "Loading weights" \
    | tee "$out/graphs.txt"
}

for part in ${PARTS:-parity bf16 sim real f32}; do
  case $part in
    bf16) step bfloat16 150 ;;  # the dtype a GPU station serves in
    f32) step float32 120 ;;
    parity|sim|simhub|real|quota|ops|graphs) $part ;;
    *) echo "device_check: unknown part $part" ;;
  esac
done
