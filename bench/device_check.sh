#!/usr/bin/env bash
# The prepared accelerator check, for a session lent a device machine (one `run`, ~5 minutes):
#   run(command="bash bench/device_check.sh", timeout_s=540)
# It needs only what that machine's image holds (torch, transformers, safetensors, tokenizers, grpcio,
# pyyaml, jinja2, prometheus-client); Ray and FastAPI are not used. Outputs land in $OUT.
# DEVICE=cpu STEP_ARGS=--quick runs the same steps here (to check the script itself).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WAVEMESH_CACHE=/tmp/wavemesh-cache
device=${DEVICE:-cuda}
out=${OUT:-/tmp/wavemesh-device-out}
py=${PYTHON:-python3}
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

# 1. exactness on the device: float32 logits of a station vs transformers (same checkpoint), greedy tokens
$py - "$device" <<'PY' 2>&1 | tee "$out/parity.txt"
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
model = resolve_model(None, "tiny")
prompt = [1, 40, 41, 42, 300, 7, 9, 88, 120, 5, 6]
for dtype in ("float32", "bfloat16"):
    st = Station(model, StationSpec(layers=(0, 6), device=dev, dtype=dtype))
    ours, _ = generate_one(st, prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(dev).eval()
    ids = torch.tensor([prompt], device=dev)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                      min_new_tokens=32)[0, len(prompt):].tolist()
    same = sum(a == b for a, b in zip(ours, ref))
    print(f"{dev} {dtype}: {same}/32 greedy tokens equal transformers' generate")
PY

# 2. the step benchmark on the bench preset, bf16 and float32, ours vs HF in one run each
for dtype in bfloat16 float32; do
  timeout 200 $py bench/step.py --device "$device" --dtype "$dtype" ${STEP_ARGS:---batches 1,16,64 --repeats 3} \
    2>&1 | tee "$out/step_${device}_${dtype}.txt" | grep -v '^{'
done
