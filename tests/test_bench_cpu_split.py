"""bench/cpu_split.py's pure parts: reading `perf script` lines into categories, and the table (no perf, no servers)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def split(bench_script):
    """The benchmark module (bench/ is not a package)."""
    return bench_script("cpu_split")


# `perf script -F comm,pid,ip,sym,dso` lines as perf 6.1 prints them, one per kind of sample
LINES = """\
     llama-server 14350      55d0c3a1b2c4 ggml_vec_dot_f32 (/cache/llamacpp/build/bin/llama-server)
  ray::StationAct 15197      7f3a2b1c0d10 rows_block (/root/.cache/wavemesh/kernels/wavemesh-native-396d.so)
  ray::StationAct 15197      7f3a2b1c0e20 paged_attention_f32._omp_fn.0 (/root/.cache/wavemesh/kernels/wavemesh-native-396d.so)
  ray::StationAct 15199      7f3a2b1c0f30 silu_mul_f32._omp_fn.0 (/root/.cache/wavemesh/kernels/wavemesh-native-396d.so)
  ray::StationAct 15199      7f3a2b01e02a [unknown] (/usr/lib/x86_64-linux-gnu/libgomp.so.1)
     llama-server 14350      55d0c3a1b9f0 llama_sampler_sample (/cache/llamacpp/build/bin/llama-server)
           python 14961      7ffa1c4bb344 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
           python 14961  ffffffff8a2b3c4d tcp_sendmsg ([kernel.kallsyms])
          swapper     0  ffffffff8a0f1e2d pv_native_safe_halt ([kernel.kallsyms])
           python  4242      7ffa1c4bb344 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
             perf  4300      55aa00001234 __perf_mmap__read_init (/usr/bin/perf)
this line is not a sample
"""


def test_each_sample_lands_in_its_category(split):
    """Both engines' matmuls, attention, tensor ops, OpenMP waits, sampling, the interpreter, the kernel and idle CPU
    are told apart; the benchmark's own process (pid 4242 here) and perf are left out; an unreadable line is counted."""
    counts = split.count_samples(LINES.splitlines(), frozenset({4242}))
    assert counts == {"matmuls (linears)": 2, "attention": 1, "other tensor ops": 1,
                      "threads waiting (OpenMP, barriers)": 1, "sampling": 1,
                      "runtime (interpreter, RPC, HTTP, Ray)": 1, "kernel": 1, split.IDLE: 1, split.EXCLUDED: 2,
                      "unparsed": 1}


def test_milliseconds_per_token_and_the_table(split):
    """A sample stands for 1/frequency s of one CPU: 500 samples at 500 Hz over 100 tokens are 10 ms per token; the
    busy row sums every category but idle and the left-out samples."""
    ms = split.ms_per_token({"matmuls (linears)": 500, split.IDLE: 100, split.EXCLUDED: 50}, 500, 100)
    assert ms == {"matmuls (linears)": 10.0, split.IDLE: 2.0, split.EXCLUDED: 1.0}
    results = {("ours", 1): {"ms_per_token": ms, "tok_s": 40.0, "seconds": 1.6},
               ("llama", 1): {"ms_per_token": {"matmuls (linears)": 12.0}, "tok_s": 38.0, "seconds": 1.7}}
    table = split.format_table(results, [("ours", 1), ("llama", 1)])
    assert "| wavemesh, 1 client | llama.cpp, 1 client |" in table
    assert "| matmuls (linears) | 10.00 | 12.00 |" in table
    assert "| **busy CPU ms per token (all but idle and left out)** | **10.00** | **12.00** |" in table


@pytest.mark.parametrize("argv, named", [(["--clients", "1,x"], "--clients"), (["--clients", "0"], "--clients"),
                                         (["--tokens", "0"], "--tokens"), (["--frequency", "0"], "--frequency")])
def test_bad_arguments_are_refused_by_name(split, argv, named, capsys):
    with pytest.raises(SystemExit):
        split.parse_args(argv)
    assert named in capsys.readouterr().err
