import pytest

from k3jax import K3Config
from k3jax.cli import main
from k3jax.params import parameter_table


@pytest.mark.slow
def test_demo_runs_and_prints_the_k3_table(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "2,779,484,476,000" in out and "104,189,612,640" in out
    assert "logits (1, 92, 264)" in out


def test_params_command_and_errors(capsys, tmp_path):
    assert main(["params", "test"]) == 0
    assert f"{parameter_table(K3Config.from_preset('test')).total:,}" in capsys.readouterr().out
    assert main(["params", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().out
