"""``torchrefit demo`` (the README's first command) runs, checks itself and passes."""

from torchrefit.cli import main


def test_demo_passes(capsys) -> None:
    assert main(["demo", "--layers", "2", "--hidden", "64", "--ffn", "128", "--vocab", "256"]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK") == 2 and "demo passed" in out
