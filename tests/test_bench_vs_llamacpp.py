"""bench/vs_llamacpp.py's pure parts (arguments, roofline arithmetic, llama-bench parsing, the table), no llama.cpp."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "vs_llamacpp.py"


@pytest.fixture(scope="module")
def vs(bench_script):
    """The benchmark module (bench/ is not a package)."""
    return bench_script("vs_llamacpp")


def test_defaults_are_issue_12s_measurements(vs):
    """Without flags: SmolLM2, every part, 2 threads, tg32, pp512, 16 clients x 64 tokens, table to bench/out."""
    a = vs.parse_args([])
    assert (a.model, a.parts, a.threads) == ("smollm2", ("decode", "prefill", "http"), 2)
    assert (a.gen_tokens, a.prompt_tokens, a.clients, a.http_tokens) == (32, 512, 16, 64)
    assert a.out == SCRIPT.parent / "out" / "vs_llamacpp.txt"


def test_quick_shrinks_counts_and_writes_no_file(vs):
    """--quick: one round, small counts, no table file unless --out is given."""
    a = vs.parse_args(["--quick", "--model", "bench", "--parts", "decode"])
    assert (a.rounds, a.gen_tokens, a.prompt_tokens, a.clients, a.out) == (1, 8, 64, 4, None)
    assert a.model == "bench" and a.parts == ("decode",)
    assert vs.parse_args(["--quick", "--out", "x.txt"]).out == Path("x.txt")


@pytest.mark.parametrize("argv, named", [(["--parts", "decode,speed"], "--parts"), (["--parts", ","], "--parts"),
                                         (["--rounds", "0"], "--rounds"), (["--clients", "-1"], "--clients"),
                                         (["--model", "gpt2"], "--model")])
def test_bad_arguments_are_refused_by_name(vs, capsys, argv, named):
    """A bad flag exits with argparse's error naming that flag."""
    with pytest.raises(SystemExit):
        vs.parse_args(argv)
    assert named in capsys.readouterr().err


def test_roofline_share_is_bytes_per_second_over_bandwidth(vs):
    """10 steps/s of 1 GB each on a 40 GB/s machine is a quarter of the roofline; rows divide tok/s into steps."""
    assert vs.roofline_share(10.0, 1, 10**9, 40.0) == pytest.approx(0.25)
    assert vs.roofline_share(40.0, 4, 10**9, 40.0) == pytest.approx(0.25)


def test_parse_llama_bench_takes_each_tests_median_sample(vs):
    """pp and tg lines of `llama-bench -o jsonl` give their median samples_ts; other lines are skipped."""
    text = "\n".join(["build: something", json.dumps({"n_prompt": 512, "n_gen": 0, "avg_ts": 1.0,
                                                      "samples_ts": [300.0, 100.0, 200.0]}),
                      json.dumps({"n_prompt": 0, "n_gen": 32, "avg_ts": 49.1, "samples_ts": [49.1]})])
    assert vs.parse_llama_bench(text) == {"pp": 200.0, "tg": 49.1}
    assert vs.parse_llama_bench(json.dumps({"n_prompt": 0, "n_gen": 8, "avg_ts": 7.5})) == {"tg": 7.5}


def _samples(**given):
    keys = ("bandwidth_gb_s", "ours_tg", "llama_tg", "ours_pp", "llama_pp", "ours_http", "llama_http")
    return {k: given.get(k, []) for k in keys}


def test_summary_ratios_and_roofline_from_medians(vs):
    """Ratios are ours/llama.cpp of medians; roofline shares use the median bandwidth; absent parts are None."""
    samples = _samples(bandwidth_gb_s=[40.0, 30.0, 50.0], ours_tg=[10.0, 20.0, 16.0], llama_tg=[48.0, 50.0, 49.0])
    s = vs.summarize(samples, 10**9)
    assert s["ratio_tg"] == pytest.approx(16.0 / 49.0)
    assert s["ours_roof"] == pytest.approx(0.4) and s["llama_roof"] == pytest.approx(49 / 40)
    assert s["paired_ratio_tg"] == pytest.approx(16.0 / 49.0)  # rounds: 10/48, 20/50, 16/49
    assert s["ratio_pp"] is None and s["ratio_http"] is None and s["paired_ratio_pp"] is None


def test_paired_ratio_cancels_a_slow_round(vs):
    """A round where the machine slowed both sides tenfold leaves the median of round ratios at the true 0.5x."""
    s = vs.summarize(_samples(ours_tg=[10.0, 1.0, 10.0, 10.0], llama_tg=[20.0, 2.0, 20.0, 2.0]), 10**9)
    assert s["paired_ratio_tg"] == pytest.approx(0.5)
    assert s["ratio_tg"] == pytest.approx(10.0 / 11.0)


def test_table_shows_medians_ranges_ratios_and_targets(vs):
    """The table names each measurement, its median (min-max), the ratio and whether issue 12's bar is met."""
    samples = _samples(bandwidth_gb_s=[40.0], ours_tg=[15.0, 16.8, 17.0], llama_tg=[49.1, 48.0, 50.0],
                       ours_http=[180.0], llama_http=[100.0])
    settings = {"model": "smollm2", "threads": 2, "rounds": 3, "gen_tokens": 32, "prompt_tokens": 512,
                "clients": 16, "http_tokens": 64, "http_rounds": 1, "http_cycles": 1, "read_bytes": 540 * 2**20,
                "machine": "cpu X", "peer_source": "llama_cpp_python-0.3.36.tar.gz", "load_avg": "3.10"}
    table = vs.format_table(samples, vs.summarize(samples, settings["read_bytes"]), settings)
    decode = next(line for line in table.splitlines() if "tg32" in line)
    assert "16.8 (15.0-17.0)" in decode and "49.1 (48.0-50.0)" in decode and "0.34x (paired 0.34x)" in decode and "missed" in decode
    http = next(line for line in table.splitlines() if "16 requests x 64 tokens" in line)
    assert "1.80x (paired 1.80x)" in http and ">= 1.5x met" in http
    prefill = next(line for line in table.splitlines() if "pp512" in line)
    assert prefill.count(" - ") >= 2
    assert "540.0 MiB" in table and "llama_cpp_python-0.3.36" in table
