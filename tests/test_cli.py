import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import k3jax
from k3jax import K3Config
from k3jax.cli import main
from k3jax.config import ConfigError, preset_names, resolve_config
from k3jax.params import parameter_table

from conftest import TEST_XLA_FLAGS


def test_params_command_and_errors(capsys, tmp_path):
    assert main(["params", "test"]) == 0
    assert f"{parameter_table(K3Config.from_preset('test')).total:,}" in capsys.readouterr().out
    assert main(["params", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_trains_and_beats_unigram(capsys, tmp_path):
    # `k3jax demo` as a user runs it: its own process, XLA's default optimisation (most of this test is 30 training
    # steps, which the suite's fast-compile flags would make ~2× slower; see conftest)
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip(),
           "COLUMNS": "200"}
    res = subprocess.run([sys.executable, "-m", "k3jax.cli", "demo", "--steps", "30", "--batch-size", "8",
                          "--out", str(tmp_path / "demo"), "--sample-tokens", "20"], capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    val = float(out.split("val loss ")[-1].split()[0])           # 30 steps: 3.013 vs a 3.119 unigram (measured)
    uni = float(out.split("unigram entropy ")[-1].split()[0])
    assert val < uni
    assert (tmp_path / "demo" / "loss.png").exists() and (tmp_path / "demo" / "expert_load.png").exists()
    assert "greedy sample" in out
    # the tiny preset's forward and gradient at initialisation (what test_layers checked with its own compile of the
    # tiny model's value_and_grad; the demo's step 1 is that computation on the initial parameters): the loss near
    # log(vocab_size), a finite nonzero gradient
    first = json.loads((tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kind"] == "train" and first["step"] == 1
    vocab = K3Config.from_preset("tiny").vocab_size
    assert np.isfinite(first["loss"]) and abs(first["loss"] - np.log(vocab)) < 1.0
    assert np.isfinite(first["grad_norm"]) and first["grad_norm"] > 0
    # the demo's checkpoint serves `k3jax generate` (training-run directory → latest step, its tokenizer). With the
    # demo's prefill chunk (64) its engine lowers the demo's prefill and decode steps again: their compiles come from
    # the session's compilation cache (~20 s less CPU). The default chunk: test_generate_from_a_release_checkpoint.
    assert main(["generate", "--model", str(tmp_path / "demo"), "--prompt", "def ", "--max-new-tokens", "12",
                 "--no-stream", "--chunk", "64"]) == 0
    out = capsys.readouterr().out
    assert f"training run {tmp_path / 'demo'}" in out and "tokens/s" in out and "\ndef " in out


def test_generate_from_a_release_checkpoint(capsys, tmp_path):
    from make_k3_fixture import write_random_k3_checkpoint

    write_random_k3_checkpoint(tmp_path / "rel", K3Config.from_preset("test").to_dict(), seed=1)
    assert main(["generate", "--model", str(tmp_path / "rel"), "--prompt", "hello", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--top-p", "0.9"]) == 0
    out = capsys.readouterr().out
    assert f"release checkpoint {tmp_path / 'rel'}" in out and "cache per sequence" in out
    assert main(["generate", "--model", str(tmp_path / "nope")]) == 2
    assert "neither a preset" in capsys.readouterr().out


def test_resolve_config_an_existing_path_wins_over_a_preset(capsys, tmp_path, monkeypatch):
    assert sorted(preset_names()) == sorted(p.name[:-5] for p in resources.files("k3jax").joinpath("presets").iterdir()
                                            if p.name.endswith(".json"))
    test_cfg = K3Config.from_preset("test")
    assert resolve_config("tiny") == K3Config.from_preset("tiny")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()                       # a directory named like a preset, holding another config
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(test_cfg.to_release_dict()))
    assert resolve_config("tiny") == resolve_config(tmp_path / "tiny" / "config.json") == test_cfg
    assert main(["params", "tiny"]) == 0
    assert f"{parameter_table(test_cfg).total:,}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"'nope': neither a preset \(k3, kimi-linear-48b, tiny, 100m, test\) nor"):
        resolve_config("nope")
    assert main(["inspect", "nope"]) == 2 and "neither a preset" in capsys.readouterr().out


def test_bench_runs_the_checkout_benchmarks_without_touching_sys_path(capsys):
    path = list(sys.path)
    assert main(["bench", "--list"]) == 0
    assert "roofline" in capsys.readouterr().out
    assert sys.path == path
    assert Path(sys.modules["benchmarks.run"].__file__).resolve() == \
        Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def test_bench_from_an_installed_package_says_it_needs_a_checkout(tmp_path):
    """k3jax as installed (a site-packages copy, no benchmarks/ next to it): a clear error, exit code 2."""
    site = tmp_path / "site"
    shutil.copytree(Path(k3jax.__file__).parent, site / "k3jax", ignore=shutil.ignore_patterns("__pycache__"))
    code = "import sys, k3jax; from k3jax.cli import main; print('k3jax from', k3jax.__file__); sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "bench", "--list"], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}, timeout=300)
    out = " ".join(res.stdout.split())
    assert f"k3jax from {site / 'k3jax' / '__init__.py'}" in out, res.stdout + res.stderr
    assert res.returncode == 2, res.stdout + res.stderr
    assert "k3jax bench needs a source checkout" in out and "python -m benchmarks.run" in out


def test_inspect_cp_reports_kda_summary_and_mla_gather_bytes(capsys):
    """``k3jax inspect --cp N``: the KDA summary bytes per layer do not depend on the sequence length, the MLA
    latent gather grows with it (figures from the config: H·K·(K+V) and (T/N)·(kv_lora_rank + rope) fp32)."""
    import json

    assert main(["inspect", "test", "--cp", "4", "--seq-len", "8192", "--json"]) == 0
    a = json.loads(capsys.readouterr().out)["context_parallel"]
    assert main(["inspect", "test", "--cp", "4", "--seq-len", "65536", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["context_parallel"]
    assert a["kda_summary_send_per_layer"] == b["kda_summary_send_per_layer"] == 2 * 32 * 64 * 4
    assert b["mla_latent_send_per_layer"] == 8 * a["mla_latent_send_per_layer"] == 16384 * (32 + 8) * 4
    assert main(["inspect", "test", "--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "context parallelism: 4 ranks" in out and "all-gather of (M, S̃)" in out


def test_training_mesh_must_split_the_sequence_and_batch():
    from k3jax.train.loop import TrainConfig

    with pytest.raises(ConfigError, match=r"seq_len=100 does not split over context=8 \(mesh context=8\)"):
        TrainConfig.load(None, ["mesh=context=8", "seq_len=100"])
    with pytest.raises(ConfigError, match=r"batch_size=3 does not split over data×fsdp=2"):
        TrainConfig.load(None, ["mesh=data=2,context=2", "batch_size=3"])
    with pytest.raises(ConfigError, match=r"batch_size=4 does not split over data×fsdp=2 × micro_batches=4"):
        TrainConfig.load(None, ["mesh=data=2,context=2", "batch_size=4", "micro_batches=4"])
    with pytest.raises(ConfigError, match=r"unknown axis 'time'"):
        TrainConfig.load(None, ["mesh=time=2"])
