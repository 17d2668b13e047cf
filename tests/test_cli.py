import pytest

from k3jax import K3Config
from k3jax.cli import main
from k3jax.params import parameter_table


def test_params_command_and_errors(capsys, tmp_path):
    assert main(["params", "test"]) == 0
    assert f"{parameter_table(K3Config.from_preset('test')).total:,}" in capsys.readouterr().out
    assert main(["params", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_trains_and_beats_unigram(capsys, tmp_path):
    assert main(["demo", "--steps", "40", "--out", str(tmp_path / "demo"), "--sample-tokens", "20"]) == 0
    out = capsys.readouterr().out
    val = float(out.split("val loss ")[-1].split()[0])
    uni = float(out.split("unigram entropy ")[-1].split()[0])
    assert val < uni
    assert (tmp_path / "demo" / "loss.png").exists() and (tmp_path / "demo" / "expert_load.png").exists()
    assert "greedy sample" in out
    # the demo's checkpoint serves `k3jax generate` (training-run directory → latest step, its tokenizer)
    assert main(["generate", "--model", str(tmp_path / "demo"), "--prompt", "def ", "--max-new-tokens", "12",
                 "--no-stream"]) == 0
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
