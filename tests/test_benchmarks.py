"""The benchmark runner, the README report and benchmarks.model's bookkeeping — cheap: nothing is timed for real."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report, run  # noqa: E402

MACHINE = {"machine": "x86_64", "processor": "x86_64", "python": "3.11.7", "jax": "0.10.2", "backend": "cpu",
           "device": "cpu", "devices": 1, "gemm_flops_fp32": 2.0e11, "memory_bytes_per_s": 8.0e9}


@pytest.fixture(autouse=True)
def _restore_xla_flags(monkeypatch):
    """``run.main`` splits the host into devices through ``XLA_FLAGS`` (no effect here, JAX has started): undo it,
    so that the subprocesses of later tests see the environment they would have."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # records the original (or its absence)
    if not os.environ["XLA_FLAGS"]:
        monkeypatch.delenv("XLA_FLAGS")


def test_list_names_every_benchmark_without_running_any():
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--list"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    for name in ["roofline", "kda", "model", "train", "moonep", "balance", "inference_decode", "inference",
                 "load_rss"]:
        assert name in lines, out
    assert [n for n, ln in lines.items() if ln.split()[1] == "*"] == ["roofline", "kda", "model"]
    assert run.DEFAULT == ["roofline", "kda", "model"]


def test_resolve_groups_and_unknown_names():
    assert run.resolve([]) == run.DEFAULT
    assert run.resolve(["inference", "kda", "inference_cache"]) == [
        "inference_decode", "inference_cache", "inference_vs_transformers", "inference_prefill", "kda"]
    with pytest.raises(SystemExit, match="unknown benchmark 'nope'"):
        run.resolve(["nope"])


def test_quick_save_refuses_to_overwrite_the_stored_results():
    with pytest.raises(SystemExit):
        run.main(["--quick", "--save", "kda"])


@pytest.fixture
def fake_bench(monkeypatch):
    """A benchmark ``fake`` whose main records its argv, and a roofline that is not measured."""
    mod = types.ModuleType("benchmarks._fake")
    mod.calls = []

    def main(argv):
        mod.calls.append(list(argv))
        if "--boom" in argv:
            raise RuntimeError("boom")
        return {"benchmark": "fake", "value": 3.0}

    mod.main = main
    monkeypatch.setitem(sys.modules, "benchmarks._fake", mod)
    monkeypatch.setitem(run.BENCHMARKS, "fake", run.Bench("_fake", "a fake", "fake", ("--full",), ("--small",)))
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "_MEASURED", dict(MACHINE))
    return mod


def test_runner_records_command_roofline_and_saves(fake_bench, tmp_path):
    combined = run.main(["fake", "--quick", "--json", str(tmp_path / "all.json"), "--save", "--save-dir",
                         str(tmp_path)])
    assert fake_bench.calls == [["--small"]]
    on_disk = json.loads((tmp_path / "all.json").read_text())
    assert on_disk["machine"] == MACHINE and list(on_disk["results"]) == ["fake"] and on_disk["failed"] == []
    rec = json.loads((tmp_path / "results_fake.json").read_text())
    assert rec["value"] == 3.0 and rec["roofline"] == MACHINE and rec["quick"] is True
    assert rec["command"] == (f"python -m benchmarks.run fake --quick --json {tmp_path / 'all.json'} --save "
                              f"--save-dir {tmp_path}")
    assert rec["module_command"] == "python -m benchmarks._fake --small"
    assert rec["wall_seconds"] >= 0 and rec == combined["results"]["fake"]


def test_runner_args_override_gpu_suffix_and_failures(fake_bench, tmp_path, monkeypatch):
    import benchmarks.roofline as roofline

    monkeypatch.setattr(roofline, "_MEASURED", {**MACHINE, "backend": "gpu", "device": "NVIDIA H200"})
    run.main(["fake", "--args", "fake=--T 7", "--save", "--save-dir", str(tmp_path)])
    assert fake_bench.calls[-1] == ["--T", "7"]
    assert (tmp_path / "results_fake_gpu.json").exists() and not (tmp_path / "results_fake.json").exists()
    res = run.main(["fake", "--args", "fake=--boom", "--save", "--save-dir", str(tmp_path / "b")])
    assert res["failed"] == ["fake"] and "boom" in res["results"]["fake"]["error"]
    assert not (tmp_path / "b").exists()                    # a failed benchmark is not stored


# ------------------------------------------------------------------------------------------------------ report
def kda_record(backend="cpu", device="cpu", command=True):
    rec = {"benchmark": "kda", **MACHINE, "backend": backend, "device": device,
           "shape": {"B": 1, "H": 4, "K": 128, "V": 128, "chunk": 64}, "dtype": "float32",
           "rows": [{"T": 1024, "chunked_forward_s": 0.066, "forward_vs_roofline": 24.4, "chunked_fwd_bwd_s": 0.356,
                     "fwd_bwd_vs_roofline": 44.0, "recurrent_forward_s": 0.049, "recurrent_fwd_bwd_s": 0.2,
                     "chunked_speedup_vs_recurrent_forward": 0.74, "temp_bytes_forward": 46 * 2**20,
                     "temp_bytes_grad": 349 * 2**20}]}
    if command:
        rec.update(command=f"python -m benchmarks.run --save kda # on {backend}",
                   module_command="python -m benchmarks.kda")
    return rec


def write_results(d: Path) -> None:
    (d / "results_kda.json").write_text(json.dumps(kda_record()))
    (d / "results_kda_gpu.json").write_text(json.dumps(kda_record("gpu", "NVIDIA H200")))
    (d / "results_model.json").write_text(json.dumps({
        "benchmark": "model", **MACHINE, "command": "python -m benchmarks.run --save model",
        "rows": [{"preset": "tiny", "mode": "forward", "params": 2833100, "batch": 8, "seq_len": 128,
                  "seconds_median": 0.154, "first_call_seconds": 5.7, "tokens_per_s": 6666.0,
                  "flops_per_token": 3763832, "mfu": 0.1048}]}))
    (d / "results_train_throughput.json").write_text(json.dumps({   # an older record: no "command"
        "benchmark": "train_throughput", "machine": "x86_64", "backend": "cpu", "gemm_peak_flops": 2.4e11,
        "runs": [{"preset": "tiny", "params": 1, "batch": 8, "seq_len": 128, "step_seconds_median": 1.1,
                  "tokens_per_s": 915.8, "train_flops_per_token": 11291496, "mfu": 0.0418}]}))
    (d / "results_broken.json").write_text("{not json")


def test_report_renders_tables_commands_gpu_and_missing(tmp_path):
    write_results(tmp_path)
    text = report.render(tmp_path)
    assert text.startswith(report.BEGIN) and text.rstrip().endswith(report.END)
    assert "do not" in text and "edit it by hand" in text and "2048×2048" in text and "256 MiB" in text
    # one table per file; the GPU record separately, with its device and command
    assert text.count("| T | peak GEMM GFLOP/s | median GEMM GFLOP/s | chunked fwd ms | fwd × roofline |") == 2
    assert "### kda\n" in text and "### kda — GPU (NVIDIA H200)" in text
    assert "`python -m benchmarks.run --save kda # on gpu` (= `python -m benchmarks.kda`)" in text
    assert ("| 1024 | — | — | 66.0 | 24.40× | 356.0 | 44.00× | — | — | — | 49.0 | 200.0 | 0.74× | 0.56× | — | — | 46.0 | "
            "349.0 | — |") in text
    assert text.index("### kda\n") < text.index("### kda — GPU") < text.index("### model")
    assert "| tiny | forward | 2,833,100 | 8×128 | 154.0 | 5.7 | 6,666 | 3.76e+06 | 10.48% |" in text
    # an older record gets the module's documented command; a broken one does not stop the report
    assert "documented command" in text and "python -m benchmarks.train_throughput [--presets tiny 100m]" in text
    assert "`results_broken.json`" in text and "unreadable" in text
    # benchmarks without a file are named, with the command that would record them
    missing = text.split("## Not recorded", 1)[1]
    assert "`roofline` (`python -m benchmarks.run --save roofline`)" in missing and "`kda`" not in missing


def test_report_rewrites_only_the_generated_part(tmp_path):
    write_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"hand-written top\n{report.BEGIN}\nold\n{report.END}\nhand-written bottom\n")
    report.main(["--dir", str(tmp_path)])
    text = readme.read_text()
    assert text.startswith("hand-written top\n") and text.endswith("hand-written bottom\n")
    assert "old\n" not in text and "### kda — GPU (NVIDIA H200)" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    text = report.render(empty)                                # no results at all
    assert "## Latest figures" in text and "`model` (`python -m benchmarks.run --save model`)" in text


def test_documented_commands_exist_for_every_module():
    for name, b in run.BENCHMARKS.items():
        sub = b.args[0] if b.module == "inference" else None
        cmd = report.documented_command(b.module, sub)
        assert cmd and f"-m benchmarks.{b.module}" in cmd, name


# ------------------------------------------------------------------------------------------------------- model
def test_model_mfu_bookkeeping_reuses_the_training_step(monkeypatch, tmp_path):
    """benchmarks.model wires train_throughput.bench and costs.flops_per_token into tokens/s and MFU (the real
    timing compiles a model for tens of seconds, so the step itself is replaced here)."""
    import benchmarks.model as model
    seen = {}

    def fake_train(preset, steps, peak, shape):
        seen.update(preset=preset, steps=steps, peak=peak, shape=shape)
        return {"first_step_seconds": 9.0, "step_seconds_median": 0.5, "train_flops_per_token": 1000, "params": 7}

    monkeypatch.setattr(model, "train_bench", fake_train)
    monkeypatch.setattr(model, "machine", lambda: dict(MACHINE))
    res = model.main(["--presets", "test", "--modes", "train", "--batch", "2", "--seq", "16", "--steps", "3",
                      "--json", str(tmp_path / "m.json")])
    assert seen == {"preset": "test", "steps": 3, "peak": 2.0e11, "shape": (2, 16)}
    (r,) = res["rows"]
    assert r["tokens_per_s"] == pytest.approx(32 / 0.5) and r["mfu"] == pytest.approx(64 * 1000 / 2.0e11)
    assert (r["mode"], r["batch"], r["seq_len"], r["first_call_seconds"]) == ("train", 2, 16, 9.0)
    assert json.loads((tmp_path / "m.json").read_text())["rows"] == res["rows"]
    from k3jax import K3Config
    from k3jax.costs import flops_per_token

    f = flops_per_token(K3Config.from_preset("test"), train_seq=16)
    assert f["training"] == 3 * f["forward"] > 0              # the forward/prefill rows use f["forward"]


def test_report_shows_kernel_gemm_rates_against_the_roofline(tmp_path):
    rec = kda_record()
    rec["kernel_gemm_flops"] = {"[4×64×128]·[4×128×128] (W·S, Q·S)": 5.0e10}   # a quarter of MACHINE's 2e11
    (tmp_path / "results_kda.json").write_text(json.dumps(rec))
    text = report.render(tmp_path)
    assert "GEMM rate at the kernel's own matmul shapes" in text
    assert "| [4×64×128]·[4×128×128] (W·S, Q·S) | 50.0 | 25.00% |" in text


def test_k3jax_bench_is_the_runner_and_needs_a_checkout(capsys, monkeypatch, tmp_path):
    from k3jax import cli

    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "roofline" in out and "kda" in out and "moonep" in out
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "k3jax" / "cli.py"))
    assert cli.main(["bench", "kda"]) == 2
    err = " ".join(capsys.readouterr().out.split())
    assert "runs the benchmarks/ folder of a source checkout" in err and "pip install -e ." in err


def test_runner_splits_the_host_but_isolated_children_get_the_environment_as_it_was(fake_bench, monkeypatch,
                                                                                   tmp_path):
    # the children (one-device benchmarks among them) get XLA_FLAGS and NPROC as found: the split host's larger
    # thread pool (NPROC, set for its collectives) made a one-device forward ~15% slower
    monkeypatch.setattr(run, "_CHILD_ENV", [])
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.setenv("NPROC", "2")             # (setenv, so the runner's larger value is undone after the test)
    seen = {}

    def fake_run(cmd, cwd, env, check):
        seen["env"] = env
        Path(cmd[-1]).write_text(json.dumps({"benchmark": "iso"}))

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    monkeypatch.setitem(run.BENCHMARKS, "iso", run.Bench("_fake", "isolated", "iso", isolated=True))
    run.main(["fake", "iso", "--host-devices", "3", "--json", str(tmp_path / "all.json")])
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=3"
    assert seen["env"]["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    assert int(os.environ["NPROC"]) >= 2 * 3 and seen["env"]["NPROC"] == "2"


def test_kda_peak_is_the_best_round_of_any_gemm_and_medians_exclude_them():
    from benchmarks.kda import medians_and_peak

    ts = {"gemm": [2.0, 1.0, 4.0], "gemm_over_devices": [0.5, 3.0, 3.0], "chunked_forward_s": [1.0, 3.0, 2.0]}
    med, g_med, peak = medians_and_peak(ts, {"gemm": 10.0, "gemm_over_devices": 10.0}, roofline=15.0)
    assert med == {"chunked_forward_s": 2.0}
    assert g_med == 10.0 / 2.0                  # the one-device GEMM's median round
    assert peak == 10.0 / 0.5                   # its best round over both GEMMs, above the runner's roofline
    assert medians_and_peak({"gemm": [1.0], "x": [1.0]}, {"gemm": 10.0}, roofline=15.0)[2] == 15.0


def test_kda_interleaved_rounds_settle_with_an_untimed_call_before_each_timed_one(monkeypatch):
    from benchmarks import kda

    calls: list[str] = []
    monkeypatch.setattr(kda.time, "sleep", lambda s: calls.append(f"sleep {s}"))
    ts = kda.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=2, settle=0.5)
    assert {k: len(v) for k, v in ts.items()} == {"a": 2, "b": 2}
    assert calls == ["a", "b"] + ["sleep 0.5", "a", "a", "sleep 0.5", "b", "b"] * 2
    calls.clear()
    kda.interleaved({"a": lambda: calls.append("a")}, reps=2)
    assert calls == ["a"] * 3


def test_kda_every_variant_of_the_table_builds():
    """Each ``--explore-T`` row of ``benchmarks/kda.py`` traces, forward and backward (``jax.eval_shape``: nothing
    is compiled or run; the variants' numbers are checked in ``tests/test_kda.py``)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import kda

    x = [jnp.zeros((1, 64, 2, 16)), jnp.zeros((1, 64, 2, 16)), jnp.zeros((1, 64, 2, 8)), jnp.zeros((1, 64, 2, 16)),
         jnp.zeros((1, 64, 2))]
    for name, kw in kda.VARIANTS.items():
        fwd, grad = kda.kernels(**kw)
        assert jax.eval_shape(fwd, *x).shape == (1, 64, 2, 8), name
        assert [s.shape for s in jax.eval_shape(grad, *x)] == [a.shape for a in x], name


def test_step_profile_counts_the_attnres_reads_and_muon_flops_the_model_runs(monkeypatch):
    # the profile multiplies each AttnRes read's time by how often the model makes a read over n blocks: count
    # the reads the model actually makes (abstractly, nothing compiled) and compare
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.step_profile import attnres_reads, ns_flops
    from k3jax import K3Config, K3ForCausalLM
    from k3jax.nn import model as model_mod

    seen: dict[int, int] = {}
    orig = model_mod.AttnResSite.__call__

    def counting(self, blocks, partial, *args, **kw):
        seen[len(blocks)] = seen.get(len(blocks), 0) + 1
        return orig(self, blocks, partial, *args, **kw)

    monkeypatch.setattr(model_mod.AttnResSite, "__call__", counting)
    for preset in ("tiny", "100m"):
        cfg = K3Config.from_preset(preset)
        seen.clear()
        g, st = nnx.split(nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0))))
        jax.eval_shape(lambda st, ids: nnx.merge(g, st)(ids).logits, st, jnp.zeros((1, 16), jnp.int32))
        assert seen == attnres_reads(cfg.num_hidden_layers, cfg.attn_res_block_size), preset
    # Newton–Schulz FLOPs by its closed form: an [heads=2, 3, 5] per-head matrix is two 3×5 matrices,
    # 5 iterations of X Xᵀ (2·3·3·5), A² (2·3³) and (bA + cA²) X (2·3·3·5), whichever side is the input
    from optax.contrib import MuonDimensionNumbers

    per_matrix = 5 * (2 * 45 + 2 * 27 + 2 * 45)
    assert ns_flops((2, 3, 5), MuonDimensionNumbers(reduction_axis=1, output_axis=2)) == 2 * per_matrix
    assert ns_flops((2, 5, 3), MuonDimensionNumbers(reduction_axis=1, output_axis=2)) == 2 * per_matrix
