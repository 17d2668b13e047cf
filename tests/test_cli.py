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
